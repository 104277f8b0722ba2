"""`load_state` and `state_info`: the version CURRENT names, checked against the model (and
tokenizer, dtype, format, digest) before any array reaches the device, then rebuilt into a
`State` with the shapes it was saved with."""

from __future__ import annotations

import dataclasses
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import pages
from kvjax.cache.config import CacheConfig
from kvjax.cache.paged_cache import PagedKVCache, Slot
from kvjax.eviction.budgets import EvictionPlan
from kvjax.fingerprint import model_fingerprint
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
from kvjax.seam import ModelShape
from kvjax.spec import CachePlan
from pallas_kernels import page_format


def state_info(path: str | os.PathLike) -> dict:
  """The metadata of a saved state (model, spec, tokens, sizes, your `info`), read without
  its arrays; StateFileError when `path` holds no readable state."""
  return read_current(pathlib.Path(path).absolute(), read_meta)

def load_state(
    path: str | os.PathLike, model, *, tokenizer=None, kv_dtype: str | None = None
) -> State:
  """The state saved at `path`, for `model` (and `tokenizer`, when the state recorded one).
  A state loads with the K/V dtype it was saved with (int8 pages as int8: codes and scales
  as they were); `kv_dtype`, when given, is the dtype the caller expects.

  Raises StateFileError (a ValueError) naming what is wrong: no state there, a corrupted or
  truncated checkpoint (the digest does not match), another kvjax format, another model,
  another dtype, another K/V dtype than `kv_dtype` or another tokenizer. Nothing reaches
  the device before every check passed.
  """
  ModelShape.of(model)  # a wrong argument is a TypeError, not a damaged state
  if kv_dtype is not None:
    page_format.check_kv_dtype("kv_dtype", kv_dtype)

  def read(version: pathlib.Path) -> State:
    meta = read_meta(version)
    check_compatible(meta, model, tokenizer, version)
    saved_dtype = get(get(meta, "cache"), "kv_dtype")
    if kv_dtype is not None and saved_dtype != kv_dtype:
      raise StateFileError(
          f"{version}: its K/V pages are {saved_dtype}, not kv_dtype={kv_dtype!r}; a state "
          "keeps the dtype it was saved with (prefill again to store it as another)"
      )
    arrays = read_arrays(version, meta)
    if digest(meta, arrays) != meta.get("digest"):
      raise StateFileError(
          f"{version}: the checkpoint is corrupted (its SHA-256 digest does not match its "
          "contents); save the state again"
      )
    try:
      return rebuild(meta, arrays, version)
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

def read_arrays(version: pathlib.Path, meta: dict) -> dict[str, np.ndarray]:
  import orbax.checkpoint as ocp

  try:
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
      arrays = checkpointer.restore(version, ocp.args.Composite(arrays=ocp.args.StandardRestore()))[
          "arrays"
      ]
    return {name: np.asarray(x) for name, x in arrays.items()}
  except Exception as err:  # noqa: BLE001 - truncated or missing files, one message
    raise StateFileError(
        f"{version}: unreadable arrays, the checkpoint is damaged ({short(err)})"
    ) from None

def rebuild(meta: dict, arrays: dict[str, np.ndarray], version: pathlib.Path) -> State:
  """The State of checked metadata and arrays: the pool of the saved size, its live pages
  first (ids 1..n), the rest free, so the state has the shapes it was saved with and runs
  the same compiled steps."""
  try:
    spec = spec_from_dict(meta["spec"])
  except (ValueError, TypeError, OSError) as err:
    raise StateFileError(
        f"{version}: its CompressionSpec does not load here ({short(err)})"
    ) from None
  saved_plan, saved_cache = meta["plan"], meta["cache"]
  config = CacheConfig(**saved_plan["config"])
  eviction = saved_plan["eviction"]
  if eviction is not None:
    options = {k: v for k, v in eviction.items() if k != "layer_budget"}
    eviction = EvictionPlan(spec.policy, tuple(eviction["layer_budget"]), **options)
  plan = CachePlan(None, eviction, saved_plan["chunk"], spec)  # the cache holds `config`
  slot_specs = tuple(Slot(name, dtype, empty) for name, dtype, empty in saved_cache["slots"])
  if eviction is not None:
    missing = {s.name for s in spec.policy.slots} - {s.name for s in slot_specs}
    if missing:
      raise StateFileError(
          f"{version}: policy {spec.policy.name!r} in this kvjax keeps slots {sorted(missing)} "
          "that the saved state lacks (saved by another kvjax version); prefill again"
      )
  num_pages, live = saved_cache["num_pages"], saved_cache["live_pages"]
  kv_dtype = saved_cache.get("kv_dtype", config.dtype)
  if kv_dtype != config.dtype:
    raise StateFileError(f"{version}: its pages ({kv_dtype}) disagree with its config")
  saved_pages = [x for name, x in arrays.items() if name.split(".")[0] in ("k_pages", "v_pages")]
  if int(arrays["table"].max(initial=pages.NULL_PAGE)) != live or any(
      x.shape[0] != live for x in saved_pages
  ):
    raise StateFileError(f"{version}: its page table does not match its {live} saved pages")

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
      chunk=saved_cache["chunk"],
      extra={name: jnp.asarray(arrays[f"extra.{name}"]) for name in saved_cache["extra"]},
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
