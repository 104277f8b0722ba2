"""What a saved state holds: its metadata (format, model and tokenizer fingerprints, the
spec and cache plan, positions, tokens, your `info`) and its arrays (the live pages in
page-table order and the state's small arrays), the digest over both, and the error every
load failure becomes."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np

from kvjax._version import __version__
from kvjax.cache import pages
from kvjax.eviction.allocation import HeadAllocation
from kvjax.policies import get_policy
from kvjax.runtime.state import State
from kvjax.seam import ModelShape, model_record
from kvjax.spec import CompressionSpec
from kvjax_store.files import arrays_digest
from pallas_kernels import page_format

FORMAT = "kvjax-state/1"


class StateFileError(ValueError):
  """A state directory that cannot be loaded: missing, unreadable, corrupted, edited into
  something a save does not write, or saved for another model, dtype, tokenizer or kvjax
  format. The message names the mismatch (the field, for an edited state)."""


def tokenizer_fingerprint(tokenizer) -> str:
  """A digest of how a tokenizer maps text to ids: its serialised form when it has one (a
  Hugging Face `tokenizers` object, as kvjax's `models.Tokenizer` wraps), else the ids of a
  fixed probe text; plus its special ids and chat template."""
  digest = hashlib.sha256()
  inner = getattr(tokenizer, "tok", None)
  if callable(getattr(inner, "to_str", None)):
    digest.update(inner.to_str().encode())
  else:
    probe = "kvjax probe: The quick brown fox, 0123456789; naïve café 日本語 🙂\n\t<|end|>"
    digest.update(json.dumps(list(tokenizer.encode(probe))).encode())
  special = {
      "bos": getattr(tokenizer, "bos_id", None),
      "eos": list(getattr(tokenizer, "eos_ids", ()) or ()),
      "chat_template": getattr(tokenizer, "chat_template", None),
  }
  digest.update(json.dumps(special, sort_keys=True).encode())
  return digest.hexdigest()[:32]


def describe(state: State, model, tokenizer, tokens, info) -> dict:
  """The metadata of a state (everything but the arrays)."""
  plan, cache = state.plan, state.cache
  spec = plan.spec
  if get_policy(spec.policy.spelling, scorer=spec.scorer) != spec.policy:
    raise ValueError(
        f"the state's policy {spec.policy!r} is not the registered policy "
        f"{spec.policy.name!r} with options it can spell ({spec.policy.spelling!r}): it "
        "cannot be saved by name"
    )
  shape = ModelShape.of(model)
  if (cache.num_layers, cache.num_kv_heads, cache.head_dim) != (
      shape.n_layers,
      shape.n_kv_heads,
      shape.head_dim,
  ):
    raise ValueError(
        f"the state's cache ({cache.num_layers} layers x {cache.num_kv_heads} kv heads x "
        f"{cache.head_dim}) was not made by this model ({shape.n_layers} x {shape.n_kv_heads} "
        f"x {shape.head_dim})"
    )
  position = np.asarray(state.position)
  if tokens is not None:
    tokens = [[int(t) for t in row] for row in tokens]
    lengths = [len(row) for row in tokens]
    if lengths != position.tolist():
      raise ValueError(
          f"tokens must be the ids each row has read: lengths {position.tolist()}, got {lengths}"
      )
  if info is not None:
    if not isinstance(info, dict):
      raise TypeError(f"info must be a dict, got {type(info).__name__}")
    try:
      json.dumps(info)
    except TypeError as err:
      raise TypeError(f"info must be JSON-serialisable: {err}") from None
  eviction = plan.eviction
  return {
      "format": FORMAT,
      "kvjax_version": __version__,
      "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "model": model_record(model),
      "tokenizer": None if tokenizer is None else tokenizer_fingerprint(tokenizer),
      "spec": spec_dict(spec),
      "plan": {
          "config": dataclasses.asdict(cache.config),
          "chunk": plan.chunk,
          "eviction": None
          if eviction is None
          else {
              "layer_budget": list(eviction.layer_budget),
              "per_head": eviction.per_head,
              "fair": eviction.fair,
              "evict": eviction.evict,
              "impl": eviction.impl,
          },
      },
      "cache": {
          "num_pages": cache.num_pages,
          "chunk": cache.chunk,
          "slots": [[s.name, s.dtype, s.empty] for s in cache.slot_specs],
          "extra": sorted(cache.extra),
          "kv_dtype": cache.kv_dtype,
          "kv_bytes": cache.kv_bytes(),
      },
      "key_impl": str(jax.random.key_impl(state.key)),
      "batch_size": state.batch_size,
      "position": position.tolist(),
      "tokens": tokens,
      "info": info,
  }


def spec_dict(spec: CompressionSpec) -> dict:
  """The spec's fields, with its head allocation by value (offsets and what checks them):
  `to_dict` writes an allocation as its directory, which an allocation made in memory lacks
  and which may have changed or gone by the time the state loads."""
  out = spec.to_dict()
  allocation = spec.allocation
  if allocation is not None:
    out["allocation"] = {
        "offsets": allocation.offsets.tolist(),  # float32 -> float -> float32 is exact
        "policy": allocation.policy,
        "log_scores": bool(allocation.log_scores),
        "scale": float(allocation.scale),
        "model": allocation.model,
        "fingerprint": allocation.fingerprint,
        "path": allocation.path,
    }
  return out


def spec_from_dict(saved: dict) -> CompressionSpec:
  fields = dict(saved)
  allocation = fields.get("allocation")
  if isinstance(allocation, dict):  # by value; older states name a directory (a str)
    fields["allocation"] = HeadAllocation(
        **{**allocation, "offsets": np.asarray(allocation["offsets"], np.float32)}
    )
  return CompressionSpec(**fields)


def live_arrays(state: State) -> dict[str, np.ndarray]:
  """The arrays to write: live pages in page-table order (the table renumbered to match,
  1..n), and the state's small arrays."""
  cache = state.cache
  # The pool compacted to its live pages (no headroom): page 0 is the null page, dropped.
  _, live, gather, packed, _ = pages.compact_plan(
      np.asarray(cache.page_table)[None], np.asarray(cache.length)[None], cache.config.page_size, 0
  )
  live_ids = jnp.asarray(gather[0, 1 : 1 + live[0]])
  take = lambda x: np.asarray(jnp.take(x, live_ids, axis=0))  # noqa: E731
  arrays = {
      **_pool_arrays("k_pages", jax.tree.map(take, cache.k_pages)),
      **_pool_arrays("v_pages", jax.tree.map(take, cache.v_pages)),
      "table": packed[0],
      "length": np.asarray(cache.length),
      "status": np.asarray(cache.status),
      "logits": np.asarray(state.logits),
      "position": np.asarray(state.position),
      "done": np.asarray(state.done),
      "key": np.asarray(jax.random.key_data(state.key)),
      "peak_pages": np.asarray(state.peak_pages),
  }
  arrays.update({f"slot.{name}": take(x) for name, x in cache.slots.items()})
  arrays.update({f"extra.{name}": np.asarray(x) for name, x in cache.extra.items()})
  return arrays


def _pool_arrays(name: str, pool) -> dict[str, np.ndarray]:
  """A K or V pool's arrays by name: `name` for floats; `name.codes`, `name.scale` and
  `name.zero` for quantized pages (saved as they are: a state loads as it was saved)."""
  return {_array_name(name, part): x for part, x in page_format.parts(pool).items()}


def saved_pool(arrays: dict, name: str, kv_dtype: str, rebuild):
  """The pool `_pool_arrays` saved, each array through `rebuild` (re-laid out to size)."""
  names = page_format.part_names(kv_dtype)
  return page_format.from_parts([rebuild(arrays[_array_name(name, p)]) for p in names], kv_dtype)


def _array_name(pool: str, part: str) -> str:
  """A pool's array on disk: a float pool under its own name (as before quantized pages)."""
  return pool if part == "values" else f"{pool}.{part}"


def digest(meta: dict, arrays: dict[str, np.ndarray]) -> str:
  """SHA-256 of the metadata (without its digest) and of the arrays (`arrays_digest`)."""
  body = {k: v for k, v in meta.items() if k != "digest"}
  text = json.dumps(body, sort_keys=True) + arrays_digest(arrays)
  return hashlib.sha256(text.encode()).hexdigest()


def get(meta, key):
  return meta.get(key) if isinstance(meta, dict) else None


def short(err: Exception) -> str:
  """An exception as one short line."""
  text = " ".join(str(err).split()) or type(err).__name__
  return text if len(text) <= 200 else text[:197] + "..."
