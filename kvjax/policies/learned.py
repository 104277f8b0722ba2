"""Policy `learned` (KVzap-style) and its scorer: weights, prediction, and the
orbax-checkpoint files it is kept in, tied to the model it was trained for.

  score[l, t, h] = rms_normalise(h_in[l, t]) @ weight[l, :, h] + bias[l, h]

predicts, for the token at t, the log of the score `kvzip` would give its key in layer l and
kv head h. `kvjax.tuning.scorer_training` trains it; a trained scorer is a directory:

  <dir>/params   orbax StandardSave of {"weight": [L, d, H], "bias": [L, H]} (float32)
  <dir>/meta     orbax JsonSave: format, model name, model fingerprint, shapes, metrics
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.resources
import os
import pathlib
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from kvjax_store import files as _files
from kvjax.cache.paged_cache import Slot
from kvjax.fingerprint import model_fingerprint
from kvjax.policies.base import SCORE, Policy, write_new_tokens
from kvjax.sharding import my_heads

FORMAT = "kvjax-learned-scorer/1"
# The largest scorer a directory may declare: weight values (L x d x H) and each dimension.
# A 405B-parameter Llama's would hold 126 x 16384 x 8 = 16.5M; the cap bounds what a
# directory of a few kilobytes (orbax does not write chunks of zeros) can make a load allocate.
MAX_SCORER_VALUES = 2**25
MAX_SCORER_DIM = 2**17
# The shipped scorer's directory, kvjax/data/scorers/<name>: named for the model it was
# trained for (the default model of `models.registry`).
SHIPPED_SCORER = "smollm2-135m-instruct"


@dataclasses.dataclass(frozen=True, eq=False)
class Scorer:
  """A trained per-layer linear scorer (see the module docstring). Hashable by its weights,
  so a jitted step specialises once per scorer."""

  weight: np.ndarray  # [L, d, H] float32
  bias: np.ndarray  # [L, H] float32
  model: str  # the name of the model it was trained for
  fingerprint: str  # `model_fingerprint` of that model
  metrics: dict = dataclasses.field(default_factory=dict)  # held-out quality, training setup

  def __post_init__(self):
    weight, bias = np.asarray(self.weight, np.float32), np.asarray(self.bias, np.float32)
    if weight.ndim != 3 or bias.shape != (weight.shape[0], weight.shape[2]):
      raise ValueError(
          f"scorer weight must be [L, d, H] and bias [L, H], got {weight.shape} and {bias.shape}"
      )
    for name, x in (("weight", weight), ("bias", bias)):
      bad = int((~np.isfinite(x)).sum())
      if bad:  # a scorer with NaN/Inf scores every token NaN: eviction would be arbitrary
        raise ValueError(f"scorer {name} holds {bad} non-finite values (NaN or Inf)")
    object.__setattr__(self, "weight", weight)
    object.__setattr__(self, "bias", bias)
    digest = hashlib.sha256(weight.tobytes() + bias.tobytes() + self.fingerprint.encode())
    object.__setattr__(self, "_digest", digest.hexdigest())

  def __hash__(self):
    return hash(self._digest)

  def __eq__(self, other):
    return isinstance(other, Scorer) and self._digest == other._digest

  @property
  def shape(self) -> tuple[int, int, int]:
    """(layers, hidden size, kv heads): what the scorer reads and for which heads."""
    return tuple(self.weight.shape)

  def predict(self, hidden: Float[Array, "B T d"], layer) -> Float[Array, "B T H"]:
    """Predicted log-scores of one layer's tokens from the layer's input hidden states
    (`layer` may be traced: the weights are indexed inside jit)."""
    if hidden.shape[-1] != self.shape[1]:
      raise ValueError(
          f"the scorer reads hidden states of size {self.shape[1]}, got {hidden.shape}"
      )
    x = normalise(hidden)
    return x @ jnp.asarray(self.weight)[layer] + jnp.asarray(self.bias)[layer]

  def check_model(self, model) -> None:
    """ValueError unless `model` is the model this scorer was trained for."""
    shape = (model.config.n_layers, model.config.n_kv_heads)
    if shape != (self.shape[0], self.shape[2]) or model_fingerprint(model) != self.fingerprint:
      name = getattr(model.config, "name", type(model).__name__)
      raise ValueError(
          f"the learned scorer was trained for {self.model!r} (fingerprint "
          f"{self.fingerprint[:12]}), not for this model ({name}, {model.config.n_layers} "
          f"layers x {model.config.n_kv_heads} kv heads): train one with `kvjax train-scorer "
          "--model ...` and pass it with --scorer DIR"
      )

  # ---- files ---------------------------------------------------------------------------

  def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> pathlib.Path:
    """Writes the scorer to directory `path` atomically (a complete directory or none)."""
    layers, hidden, heads = self.shape
    meta = {
        "format": FORMAT,
        "model": self.model,
        "fingerprint": self.fingerprint,
        "num_layers": layers,
        "hidden_size": hidden,
        "num_kv_heads": heads,
        "metrics": self.metrics,
    }
    params = {"weight": self.weight, "bias": self.bias}
    return _files.write_params(path, params, meta, overwrite=overwrite)

  @classmethod
  def load(cls, path: str | os.PathLike) -> "Scorer":
    """A scorer saved by `save`; ValueError naming the path when it is not one."""
    params, meta = _files.read_params(
        path, what="trained kvjax scorer", fmt=FORMAT, expected=scorer_arrays
    )
    try:
      return cls(
          weight=params["weight"],
          bias=params["bias"],
          model=meta["model"],
          fingerprint=meta["fingerprint"],
          metrics=meta.get("metrics", {}),
      )
    except ValueError as err:
      raise ValueError(f"{pathlib.Path(path).absolute()}: not a usable scorer: {err}") from None


def scorer_arrays(meta: dict, declared=None) -> dict[str, tuple[tuple[int, ...], str]]:
  """The arrays a scorer directory's meta says it holds: weight [L, d, H] and bias [L, H],
  float32 (ValueError for shapes that are not positive ints, or past the caps above).
  `declared` (what the directory declares) is compared with this by the reader."""
  dims = [meta.get(k) for k in ("num_layers", "hidden_size", "num_kv_heads")]
  for name, n in zip(("num_layers", "hidden_size", "num_kv_heads"), dims):
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_SCORER_DIM:
      raise ValueError(f"meta {name} must be an int in [1, {MAX_SCORER_DIM}], got {n!r}")
  layers, hidden, heads = dims
  if layers * hidden * heads > MAX_SCORER_VALUES:
    raise ValueError(
        f"a scorer of {layers} x {hidden} x {heads} weights is larger than any model's "
        f"({MAX_SCORER_VALUES} values at most)"
    )
  return {"weight": ((layers, hidden, heads), "float32"), "bias": ((layers, heads), "float32")}


def normalise(hidden: Float[Array, "... d"]) -> Float[Array, "... d"]:
  """RMS-normalised hidden states (no learned scale): the scorer's input features."""
  x = hidden.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def shipped_path(model: str = SHIPPED_SCORER) -> pathlib.Path:
  """Where the scorer shipped for `model` lives inside the package."""
  return pathlib.Path(str(importlib.resources.files("kvjax") / "data" / "scorers" / model))


@functools.lru_cache(maxsize=None)
def default_scorer() -> Scorer:
  """The scorer shipped for the default model (loaded once per process)."""
  path = shipped_path()
  if not path.is_dir():
    raise ValueError(
        f"no learned scorer is shipped at {path}: train one with `kvjax train-scorer` and "
        "pass it with --scorer DIR"
    )
  return Scorer.load(path)


@dataclasses.dataclass(frozen=True)
class Learned(Policy):
  """KVzap-style (Jégou & Jeblick, 2026), query-agnostic: a linear model per layer maps each
  token's hidden state (the layer's input, RMS-normalised) to the log of the score `kvzip`
  would give it, one output per kv head. Scoring costs one [d, H] product per token and
  layer while the context is read: no reconstruction pass. Train one for a model with
  `kvjax train-scorer` (`kvjax.tuning.scorer_training`); the default model's ships with kvjax."""

  name: ClassVar[str] = "learned"
  slots: ClassVar[tuple[Slot, ...]] = (SCORE,)
  mode: ClassVar[str] = "once"
  scorer: Scorer | str | None = None  # a Scorer, its directory, or None: the shipped one

  def __post_init__(self):
    if self.scorer is None:
      object.__setattr__(self, "scorer", default_scorer())
    elif isinstance(self.scorer, (str, os.PathLike)):
      object.__setattr__(self, "scorer", Scorer.load(self.scorer))
    elif not isinstance(self.scorer, Scorer):
      raise TypeError(f"scorer must be a Scorer or its directory, got {type(self.scorer).__name__}")

  def check_model(self, model):
    self.scorer.check_model(model)

  def observe_layer(self, cache, layer, hidden_in, hidden_out, num_new):
    predicted = self.scorer.predict(hidden_in, layer)  # [B, T, H]: every kv head's score
    predicted = my_heads(predicted, axis=2, local=cache.num_kv_heads)  # a shard's own heads
    return write_new_tokens(cache, "score", layer, predicted, num_new)
