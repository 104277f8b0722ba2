"""A learned head allocation: how a context compressed once shares its budget between layers
and kv heads, learned by `kvjax tune` for one model and one policy.

A policy that compresses the context once (kvzip, learned, expected_attention) keeps a row's
best tokens by one ranking across all its layers and kv heads (head_budget='global'). Their
scores are not equally calibrated across heads: a head whose scores run high keeps more than
it needs, another too little. The allocation adds one learned offset per (layer, kv head)
before that ranking:

  ranked[l, b, h, n] = transform(score[l, b, h, n]) / scale + offset[l, h]

(`transform` is the log for policies whose scores are non-negative, else the identity;
`scale` puts the offsets in units of the scores' spread). The ranking still adapts to each
input; the offsets move the share of each head. On disk it is a directory:

  <dir>/params   orbax StandardSave of {"offsets": [L, H]} (float32)
  <dir>/meta     orbax JsonSave: format, policy, transform, scale, model name + fingerprint
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pathlib

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from kvjax_store import files as _files
from kvjax.fingerprint import model_fingerprint

FORMAT = "kvjax-head-allocation/1"
LOG_FLOOR = 1e-12  # scores at or below it rank equally (kvzip's max attention can be ~0)
# The most layers, and kv heads per layer, an allocation directory may hold: what a load
# allocates for a directory of a few kilobytes stays bounded (orbax writes no chunk of zeros).
MAX_LAYERS = MAX_KV_HEADS = 1024


def transform(scores, log_scores: bool, scale: float):
  """The policy's scores in the units the offsets are learned in (numpy or jax arrays)."""
  xp = jnp if isinstance(scores, jnp.ndarray) else np
  z = xp.log(xp.maximum(scores, LOG_FLOOR)) if log_scores else scores
  return z / scale


@dataclasses.dataclass(frozen=True, eq=False)
class HeadAllocation:
  """Per-(layer, kv head) offsets to a policy's scores before the global ranking (see the
  module docstring). Hashable by its values, so a jitted step specialises once per
  allocation."""

  offsets: np.ndarray  # [L, H] float32
  policy: str  # the policy whose scores it was learned on
  log_scores: bool
  scale: float
  model: str
  fingerprint: str  # `kvjax.fingerprint.model_fingerprint` of that model
  metrics: dict = dataclasses.field(default_factory=dict)
  path: str | None = None  # the directory it was loaded from or saved to

  def __post_init__(self):
    offsets = np.asarray(self.offsets, np.float32)
    if offsets.ndim != 2 or not np.isfinite(offsets).all():
      raise ValueError(f"allocation offsets must be a finite [L, H] array, got {offsets.shape}")
    if not (isinstance(self.scale, (int, float)) and np.isfinite(self.scale) and self.scale > 0):
      raise ValueError(f"allocation scale must be a positive number, got {self.scale!r}")
    object.__setattr__(self, "offsets", offsets)
    key = f"{self.policy}:{self.log_scores}:{float(self.scale)!r}:{self.fingerprint}".encode()
    object.__setattr__(self, "_digest", hashlib.sha256(offsets.tobytes() + key).hexdigest())

  def __hash__(self):
    return hash(self._digest)

  def __eq__(self, other):
    return isinstance(other, HeadAllocation) and self._digest == other._digest

  @property
  def shape(self) -> tuple[int, int]:
    return self.offsets.shape

  def rank(self, scores: Float[Array, "L B H N"]) -> Float[Array, "L B H N"]:
    """What the global ranking compares: transformed scores plus each head's offset. Within
    a sequence the order is the policy's own (a monotone map), so eviction keeps the same
    tokens a head would keep at the same count."""
    if scores.shape[0] != self.offsets.shape[0] or scores.shape[2] != self.offsets.shape[1]:
      raise ValueError(
          f"allocation is for {self.shape[0]} layers x {self.shape[1]} kv heads, scores are "
          f"{scores.shape} [L, B, H, N]"
      )
    z = transform(jnp.asarray(scores, jnp.float32), self.log_scores, self.scale)
    return z + jnp.asarray(self.offsets)[:, None, :, None]

  def check_model(self, model) -> None:
    """ValueError unless `model` is the model this allocation was learned for."""
    c = model.config
    if (c.n_layers, c.n_kv_heads) != self.shape or model_fingerprint(model) != self.fingerprint:
      name = getattr(c, "name", type(model).__name__)
      raise ValueError(
          f"the head allocation {self.path or ''} was learned for {self.model!r} "
          f"({self.shape[0]} layers x {self.shape[1]} kv heads, fingerprint "
          f"{self.fingerprint[:12]}), not for this model ({name}, {c.n_layers} x "
          f"{c.n_kv_heads}): run `kvjax tune` with this model"
      )

  # ---- files ---------------------------------------------------------------------------

  def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> "HeadAllocation":
    """Writes the allocation to directory `path` atomically; returns it with `path` set."""
    meta = {
        "format": FORMAT,
        "policy": self.policy,
        "log_scores": bool(self.log_scores),
        "scale": float(self.scale),
        "model": self.model,
        "fingerprint": self.fingerprint,
        "metrics": self.metrics,
    }
    written = _files.write_params(path, {"offsets": self.offsets}, meta, overwrite=overwrite)
    _load.cache_clear()
    return dataclasses.replace(self, path=str(written))

  @classmethod
  def load(cls, path: str | os.PathLike) -> "HeadAllocation":
    """An allocation saved by `save` (read once per path and modification time)."""
    path = pathlib.Path(path).absolute()
    meta_file = path / "meta"
    return _load(str(path), meta_file.stat().st_mtime_ns if meta_file.exists() else 0)


def _offsets_array(meta: dict, declared: dict) -> dict[str, tuple[tuple[int, ...], str]]:
  """The one array an allocation directory holds: offsets [L, H] float32, L and H within
  the caps above (its meta does not record the shape: `check_model` compares it with the
  model's once loaded)."""
  shape = declared.get("offsets", ((),))[0]
  if len(shape) != 2 or not (1 <= shape[0] <= MAX_LAYERS and 1 <= shape[1] <= MAX_KV_HEADS):
    raise ValueError(
        f"offsets must be [layers, kv heads] of at most [{MAX_LAYERS}, {MAX_KV_HEADS}], got "
        f"{shape}"
    )
  return {"offsets": (shape, "float32")}


@functools.lru_cache(maxsize=32)
def _load(path: str, mtime: int) -> HeadAllocation:
  params, meta = _files.read_params(
      path, what="kvjax head allocation", fmt=FORMAT, expected=_offsets_array
  )
  try:
    return HeadAllocation(
        offsets=params["offsets"],
        policy=str(meta["policy"]),
        log_scores=bool(meta["log_scores"]),
        scale=float(meta["scale"]),
        model=str(meta["model"]),
        fingerprint=str(meta["fingerprint"]),
        metrics=meta.get("metrics", {}),
        path=path,
    )
  except KeyError as e:
    raise ValueError(f"{path}: head allocation metadata lacks {e}") from None
