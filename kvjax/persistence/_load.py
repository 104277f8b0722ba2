"""`load_state` and `state_info`: the version CURRENT names, checked against the model (and
tokenizer, dtype, format), its array sizes against its metadata before any is restored, its
digest and its page table after (`_checks`), then rebuilt into a `State` with the shapes it
was saved with."""

from __future__ import annotations

import dataclasses
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import pages
from kvjax.cache.paged_cache import PagedKVCache
from kvjax.eviction.budgets import EvictionPlan
from kvjax.fingerprint import model_fingerprint
from kvjax.persistence import _checks
from kvjax.persistence._directory import read_current
from kvjax.persistence._format import (
    FORMAT,
    StateFileError,
    digest,
    get,
    saved_pool,
    short,
    spec_from_dict,
    tokenizer_fingerprint,
)
from kvjax.runtime.state import State
from kvjax.seam import ModelShape, query_heads
from kvjax.spec import CachePlan, CompressionSpec
from kvjax_store import files
from pallas_kernels import page_format


def state_info(path: str | os.PathLike) -> dict:
  """The metadata of a saved state (model, spec, tokens, sizes, your `info`), after the
  checks that need no model: its fields and array sizes (`_checks`, before any array is
  read), its digest and its page table; StateFileError when `path` holds no state that
  passes them (as `load_state` would refuse it)."""

  def read(version: pathlib.Path) -> dict:
    meta = read_meta(version)
    layout = _checks.layout(meta, version, _checks.recorded_shape(meta, version))
    read_arrays(version, meta, layout, lambda declared: _checks.bounded_extra(layout, declared))
    return meta

  return read_current(pathlib.Path(path).absolute(), read)


def load_state(
    path: str | os.PathLike, model, *, tokenizer=None, kv_dtype: str | None = None
) -> State:
  """The state saved at `path`, for `model` (and `tokenizer`, when the state recorded one).
  A state loads with the K/V dtype it was saved with (int8 pages as int8: codes and scales
  as they were); `kv_dtype`, when given, is the dtype the caller expects.

  Raises StateFileError (a ValueError) naming what is wrong: no state there, a corrupted or
  truncated checkpoint (the digest does not match), another kvjax format, another model,
  another dtype, another K/V dtype than `kv_dtype` or another tokenizer, or a field, an
  array or a page table that is not what a save writes (`_checks`). No array is restored
  before its size is checked against the metadata, and nothing reaches the device before
  every check passed.
  """
  ModelShape.of(model)  # a wrong argument is a TypeError, not a damaged state
  if kv_dtype is not None:
    page_format.check_kv_dtype("kv_dtype", kv_dtype)

  def read(version: pathlib.Path) -> State:
    meta = read_meta(version)
    check_compatible(meta, model, tokenizer, version)
    layout = _checks.layout(meta, version, dataclasses.asdict(ModelShape.of(model)))
    if kv_dtype is not None and layout.kv_dtype != kv_dtype:
      raise StateFileError(
          f"{version}: its K/V pages are {layout.kv_dtype}, not kv_dtype={kv_dtype!r}; a state "
          "keeps the dtype it was saved with (prefill again to store it as another)"
      )
    spec = saved_spec(meta, version)
    arrays = read_arrays(version, meta, layout, lambda _: extra_shapes(spec, model, layout))
    try:
      return rebuild(meta, arrays, layout, spec)
    except StateFileError:
      raise
    except (KeyError, TypeError, ValueError) as err:
      raise StateFileError(
          f"{version}: its metadata does not describe a state this kvjax can rebuild "
          f"({type(err).__name__}: {short(err)})"
      ) from None

  return read_current(pathlib.Path(path).absolute(), read)


def read_meta(version: pathlib.Path) -> dict:
  import orbax.checkpoint as ocp

  try:
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
      meta = checkpointer.restore(version, ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  except Exception as err:  # noqa: BLE001 - orbax's many failure types, one message
    raise StateFileError(f"{version}: unreadable metadata ({short(err)})") from None
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    found = meta.get("format") if isinstance(meta, dict) else None
    raise StateFileError(
        f"{version}: state format {found!r} (kvjax {get(meta, 'kvjax_version')}); this kvjax "
        f"reads {FORMAT!r}: save the state again with this version"
    )
  return meta


def check_compatible(meta: dict, model, tokenizer, version: pathlib.Path) -> None:
  """StateFileError naming the first mismatch between the saved state and this model."""
  try:
    saved = meta["model"]
    shape = dataclasses.asdict(ModelShape.of(model))
    name = getattr(model.config, "name", type(model).__name__)
    dims = ("n_layers", "n_kv_heads", "head_dim", "vocab_size")
    if any(saved[k] != shape[k] for k in dims):
      have = lambda d: " x ".join(f"{d[k]} {k}" for k in dims)  # noqa: E731
      raise StateFileError(
          f"{version}: saved for model {saved['name']!r} ({have(saved)}), not for this model "
          f"{name!r} ({have(shape)})"
      )
    if saved["dtype"] != shape["dtype"]:
      raise StateFileError(
          f"{version}: saved with a {saved['dtype']} model; this model is {shape['dtype']} "
          f"(load it as {saved['dtype']}, or prefill again)"
      )
    fingerprint = model_fingerprint(model)
    if saved["fingerprint"] != fingerprint:
      raise StateFileError(
          f"{version}: saved for model {saved['name']!r} with weights {saved['fingerprint'][:12]}"
          f"; this model {name!r} has other weights ({fingerprint[:12]})"
      )
    if tokenizer is not None and meta["tokenizer"] is not None:
      if tokenizer_fingerprint(tokenizer) != meta["tokenizer"]:
        raise StateFileError(
            f"{version}: saved with another tokenizer ({meta['tokenizer'][:12]}) than this one "
            f"({tokenizer_fingerprint(tokenizer)[:12]})"
        )
  except (KeyError, TypeError) as err:
    raise StateFileError(f"{version}: incomplete metadata ({short(err)})") from None


def read_arrays(version: pathlib.Path, meta: dict, layout, extra) -> dict[str, np.ndarray]:
  """The arrays of a version whose metadata is `layout`, checked in three steps: what the
  checkpoint declares (names, shapes, dtypes, from orbax's metadata) against what `layout`
  implies (`extra(declared)`: the shapes of the policy's state beside the cache) before any
  is restored; the digest; the values (`_checks.check_values`)."""
  try:
    declared = files.stored_arrays(version, "arrays")
  except Exception as err:  # noqa: BLE001 - orbax's many failure types, one message
    raise StateFileError(
        f"{version}: unreadable arrays, the checkpoint is damaged ({short(err)})"
    ) from None
  want = layout.arrays(extra(declared))
  mismatch = files.shapes_mismatch(declared, want)
  if mismatch:
    raise StateFileError(f"{version}: {mismatch}, for the state its metadata describes")
  try:
    arrays = files.restore_arrays(version, "arrays", want)
  except files.ArraysMismatch as err:  # changed on disk since its metadata was read
    raise StateFileError(f"{version}: {err}, for the state its metadata describes") from None
  except Exception as err:  # noqa: BLE001 - truncated or missing files, one message
    raise StateFileError(
        f"{version}: unreadable arrays, the checkpoint is damaged ({short(err)})"
    ) from None
  if digest(meta, arrays) != meta.get("digest"):
    raise StateFileError(
        f"{version}: the checkpoint is corrupted (its SHA-256 digest does not match its "
        "contents); save the state again"
    )
  _checks.check_values(layout, arrays)
  return arrays


def saved_spec(meta: dict, version: pathlib.Path) -> CompressionSpec:
  try:
    return spec_from_dict(meta["spec"])
  except (KeyError, ValueError, TypeError, OSError) as err:
    raise StateFileError(
        f"{version}: its CompressionSpec does not load here ({short(err)})"
    ) from None


def extra_shapes(spec: CompressionSpec, model, layout) -> dict:
  """The shapes of the policy's state beside the cache that a state of `layout` holds: none
  once its context is compressed (`pool.compress` drops it), else what the policy makes
  for this model (its query heads from one abstract call)."""
  if not layout.extra:
    return {}
  policy = spec.policy
  if not policy.keeps_extra:
    raise StateFileError(
        f"{layout.version}: cache.extra names {list(layout.extra)}, which policy "
        f"{policy.name!r} does not keep"
    )
  made = jax.eval_shape(
      lambda: policy.init_extra(
          layout.layers, layout.batch, layout.kv_heads, query_heads(model), layout.head_dim
      )
  )
  if sorted(made) != list(layout.extra):
    raise StateFileError(
        f"{layout.version}: cache.extra names {list(layout.extra)}; policy {policy.name!r} "
        f"keeps {sorted(made)}"
    )
  return {name: (tuple(x.shape), np.dtype(x.dtype).name) for name, x in made.items()}


def rebuild(meta: dict, arrays: dict[str, np.ndarray], layout, spec: CompressionSpec) -> State:
  """The State of checked metadata and arrays: the pool of the saved size, its live pages
  first (ids 1..n), the rest free, so the state has the shapes it was saved with and runs
  the same compiled steps."""
  version, saved_plan, config = layout.version, meta["plan"], layout.config
  eviction = saved_plan["eviction"]
  if eviction is not None:
    options = {k: v for k, v in eviction.items() if k != "layer_budget"}
    eviction = EvictionPlan(spec.policy, tuple(eviction["layer_budget"]), **options)
  plan = CachePlan(None, eviction, saved_plan["chunk"], spec)  # the cache holds `config`
  slot_specs = layout.slots
  if eviction is not None:
    missing = {s.name for s in spec.policy.slots} - {s.name for s in slot_specs}
    if missing:
      raise StateFileError(
          f"{version}: policy {spec.policy.name!r} in this kvjax keeps slots {sorted(missing)} "
          "that the saved state lacks (saved by another kvjax version); prefill again"
      )
  num_pages, live, kv_dtype = layout.num_pages, layout.live, layout.kv_dtype

  def pool(saved: np.ndarray, empty=0) -> jax.Array:
    full = np.full((num_pages, *saved.shape[1:]), empty, saved.dtype)
    full[1 : 1 + live] = saved
    return jnp.asarray(full)

  cache = PagedKVCache(
      k_pages=saved_pool(arrays, "k_pages", kv_dtype, pool),
      v_pages=saved_pool(arrays, "v_pages", kv_dtype, pool),
      slots={s.name: pool(arrays[f"slot.{s.name}"], s.empty) for s in slot_specs},
      pages=pages.PageTable.packed(
          arrays["table"], arrays["length"], num_pages, live, arrays["status"]
      ),
      config=config,
      slot_specs=slot_specs,
      chunk=meta["cache"]["chunk"],
      extra={name: jnp.asarray(arrays[f"extra.{name}"]) for name in layout.extra},
  )
  return State(
      cache=cache,
      logits=jnp.asarray(arrays["logits"]),
      position=jnp.asarray(arrays["position"]),
      done=jnp.asarray(arrays["done"]),
      key=jax.random.wrap_key_data(jnp.asarray(arrays["key"]), impl=meta["key_impl"]),
      peak_pages=jnp.asarray(arrays["peak_pages"]),
      plan=plan,
  )
