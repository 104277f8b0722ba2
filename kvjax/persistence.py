"""A session's state on disk: compress a context once, answer from it many times, in another
process or on another day.

    state = kvjax.prefill(model, [document_ids], spec, tokenizer=tokenizer)
    kvjax.save_state("doc.kvjax", state, model, tokenizer=tokenizer, tokens=[document_ids])
    ...                                                   # another process
    state = kvjax.load_state("doc.kvjax", model, tokenizer=tokenizer)
    state, result = kvjax.decode(model, kvjax.extend(model, state, [question_ids]), 32)

A state directory keeps complete versions and names the current one:

  DIR/CURRENT     the current version's name, replaced atomically (write + rename)
  DIR/.lock       what a save locks (`fcntl.flock`) from its checks to its clean-up, so
                  saves into one directory run one after another
  DIR/v<N>/       an orbax-checkpoint composite checkpoint (orbax writes it to a temporary
                  directory and renames it when complete):
    arrays/       StandardSave: the live pages only (k, v and the per-slot arrays, in page
                  table order), the page table, lengths, logits, positions, sampling key
    meta/         JsonSave: format, kvjax version, model and tokenizer fingerprints, the
                  CompressionSpec (a head allocation by value) and cache plan, the prefilled
                  token ids, and a SHA-256 digest of all of it and of every array

A save keeps the version CURRENT named before it (a reader may be reading it) and removes
older ones; a reader whose version was removed under it (two saves during one read) reads
CURRENT again and retries. A process killed while saving leaves CURRENT naming the previous
complete version (or no CURRENT at all for a first save: nothing loads); the next save clears
what it left. A load checks the digest, the format, the model, its dtype and the tokenizer
before any array reaches the device: a corrupted or foreign checkpoint is a `ValueError`,
never a state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np

from kvjax_store import files as _files
from kvjax._version import __version__
from kvjax.eviction.allocation import HeadAllocation
from kvjax.cache import pages
from kvjax.cache.paged_cache import PagedKVCache, Slot
from kvjax.cache.config import CacheConfig
from kvjax.fingerprint import model_fingerprint
from kvjax.policies import get_policy
from kvjax.eviction.budgets import EvictionPlan
from kvjax.seam import ModelShape, model_record
from kvjax.runtime.session import State
from pallas_kernels import page_format
from kvjax.spec import CachePlan, CompressionSpec
from kvjax_store.files import arrays_digest

try:
  import fcntl
except ImportError:  # not POSIX (Windows): saves into one directory must not overlap there
  fcntl = None

FORMAT = "kvjax-state/1"
CURRENT = "CURRENT"
LOCK = ".lock"
_VERSION = re.compile(r"v(\d+)")
# What a state directory may hold: CURRENT, its temporaries (`_files.write_bytes` names them
# `.CURRENT.<random>`; older kvjax wrote `CURRENT.tmp-<pid>`), the lock, versions, and
# orbax's temporaries of versions (`v3.orbax-checkpoint-tmp`, older orbax added
# `-<timestamp>`).
_OURS = re.compile(
    r"CURRENT|\.CURRENT\..+|CURRENT\.tmp-\d+|\.lock|v\d+(\.orbax-checkpoint-tmp.*)?", re.DOTALL
)
# Reads of a directory that saves keep replacing: each retry follows CURRENT to a newer
# version, and a version is only removed after two later saves completed.
_READ_ATTEMPTS = 5


class StateFileError(ValueError):
  """A state directory that cannot be loaded: missing, corrupted, or saved for another
  model, dtype, tokenizer or kvjax format. The message names the mismatch."""


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


# ---- saving --------------------------------------------------------------------------------


def save_state(
    path: str | os.PathLike,
    state: State,
    model,
    *,
    tokenizer=None,
    tokens=None,
    info: dict | None = None,
    overwrite: bool = False,
) -> pathlib.Path:
  """Writes `state` to directory `path`: only its live pages, with what a load checks.

  Args:
    state: a `kvjax.State` (from `prefill`, `extend` or `decode`).
    model: the model the state was made with (its fingerprint is recorded).
    tokenizer: recorded by fingerprint, so a load with another tokenizer is refused.
    tokens: the token ids the state has read, per row (recorded; `state_info` returns them).
    info: your own JSON-serialisable metadata (e.g. how the prompt was built).
    overwrite: replace the state already saved at `path` (atomically: a reader or a crash
      sees the old state or the new one, never a mixture). Saves into one directory from
      several processes run one after another (a lock in the directory).
  Returns the directory.
  """
  if not isinstance(state, State):
    raise TypeError(f"state must be a kvjax.State, got {type(state).__name__}")
  if state.cache.mesh is not None:
    raise ValueError(
        "save_state: the state is sharded over a mesh, which kvjax does not save yet; "
        "prefill without mesh= to save it"
    )
  path = pathlib.Path(path).absolute()
  _check_target(path, overwrite)  # before anything is written or locked
  # As JSON gives it back (string keys, lists): the digest must match what a load reads.
  meta = json.loads(json.dumps(_describe(state, model, tokenizer, tokens, info)))
  arrays = _live_arrays(state)
  meta["cache"]["live_pages"] = int(arrays["table"].max(initial=pages.NULL_PAGE))
  meta["digest"] = _digest(meta, arrays)

  import orbax.checkpoint as ocp

  path.mkdir(parents=True, exist_ok=True)
  with _locked(path):
    _check_target(path, overwrite)  # again: another process may have saved meanwhile
    previous = _current_name(path)
    name = f"v{1 + max(_versions(path), default=0)}"
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
      checkpointer.save(  # a temporary directory, renamed to `name` once complete
          path / name,
          ocp.args.Composite(arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)),
      )
    _files.write_text(path / CURRENT, name + "\n")
    # The previous version stays until the next save: a reader may have just read its name.
    _remove_stale(path, keep={name, previous})
  return path


def _check_target(path: pathlib.Path, overwrite: bool) -> None:
  if not path.exists():
    return
  if not path.is_dir():
    raise FileExistsError(f"{path} exists and is not a directory")
  if (path / CURRENT).exists():
    if not overwrite:
      raise FileExistsError(f"{path} holds a saved state; pass overwrite=True to replace it")
  elif any(not _is_ours(p.name) for p in path.iterdir()):
    raise FileExistsError(f"{path} is a directory of other files, not a kvjax state")


@contextlib.contextmanager
def _locked(path: pathlib.Path):
  """Holds an exclusive `flock` on `path/.lock` (created once, never removed: removing it
  would let two processes lock two different files). The kernel releases it when the
  process dies, so a killed save never blocks the next one."""
  fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    if fcntl is not None:
      fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)  # releases the lock


def _describe(state: State, model, tokenizer, tokens, info) -> dict:
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
      "spec": _spec_dict(spec),
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


def _spec_dict(spec: CompressionSpec) -> dict:
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


def _spec_from_dict(saved: dict) -> CompressionSpec:
  fields = dict(saved)
  allocation = fields.get("allocation")
  if isinstance(allocation, dict):  # by value; older states name a directory (a str)
    fields["allocation"] = HeadAllocation(
        **{**allocation, "offsets": np.asarray(allocation["offsets"], np.float32)}
    )
  return CompressionSpec(**fields)


def _live_arrays(state: State) -> dict[str, np.ndarray]:
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


def _saved_pool(arrays: dict, name: str, kv_dtype: str, rebuild):
  """The pool `_pool_arrays` saved, each array through `rebuild` (re-laid out to size)."""
  names = page_format.part_names(kv_dtype)
  return page_format.from_parts([rebuild(arrays[_array_name(name, p)]) for p in names], kv_dtype)


def _array_name(pool: str, part: str) -> str:
  """A pool's array on disk: a float pool under its own name (as before quantized pages)."""
  return pool if part == "values" else f"{pool}.{part}"


def _digest(meta: dict, arrays: dict[str, np.ndarray]) -> str:
  """SHA-256 of the metadata (without its digest) and of the arrays (`arrays_digest`)."""
  body = {k: v for k, v in meta.items() if k != "digest"}
  text = json.dumps(body, sort_keys=True) + arrays_digest(arrays)
  return hashlib.sha256(text.encode()).hexdigest()


def _is_ours(name: str) -> bool:
  """Files a state directory may hold: CURRENT (and its temporary), versions, and orbax's
  temporary directories of versions."""
  return _OURS.fullmatch(name) is not None


def _versions(path: pathlib.Path) -> list[int]:
  return [
      int(_VERSION.match(p.name).group(1))
      for p in path.iterdir()
      if _is_ours(p.name) and _VERSION.match(p.name)
  ]


def _remove_stale(path: pathlib.Path, keep: set) -> None:
  """Removes versions not in `keep` and what interrupted saves left (never other files).
  Called under the lock: no other save has temporaries in flight."""
  for p in path.iterdir():
    if p.name not in (CURRENT, LOCK) and p.name not in keep and _is_ours(p.name):
      if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
      else:
        p.unlink(missing_ok=True)


# ---- loading -------------------------------------------------------------------------------


def state_info(path: str | os.PathLike) -> dict:
  """The metadata of a saved state (model, spec, tokens, sizes, your `info`), read without
  its arrays; StateFileError when `path` holds no readable state."""
  return _read_current(pathlib.Path(path).absolute(), _read_meta)


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
    meta = _read_meta(version)
    _check_compatible(meta, model, tokenizer, version)
    saved_dtype = _get(_get(meta, "cache"), "kv_dtype")
    if kv_dtype is not None and saved_dtype != kv_dtype:
      raise StateFileError(
          f"{version}: its K/V pages are {saved_dtype}, not kv_dtype={kv_dtype!r}; a state "
          "keeps the dtype it was saved with (prefill again to store it as another)"
      )
    arrays = _read_arrays(version, meta)
    if _digest(meta, arrays) != meta.get("digest"):
      raise StateFileError(
          f"{version}: the checkpoint is corrupted (its SHA-256 digest does not match its "
          "contents); save the state again"
      )
    try:
      return _rebuild(meta, arrays, version)
    except StateFileError:
      raise
    except (KeyError, TypeError, ValueError) as err:
      raise StateFileError(
          f"{version}: its metadata does not describe a state this kvjax can rebuild "
          f"({type(err).__name__}: {_short(err)})"
      ) from None

  return _read_current(pathlib.Path(path).absolute(), read)


def _read_current(path: pathlib.Path, read):
  """`read(version)` of the version CURRENT names. A save keeps the version it replaces, so
  a read fails under saves only when two of them completed during it, removing its version;
  then CURRENT names a newer version, which is read instead (a failure while CURRENT still
  names the version read is that version's own, raised as it is)."""
  for _ in range(_READ_ATTEMPTS):
    name = _read_pointer(path)
    try:
      return read(_version(path, name))
    except StateFileError:
      if _current_name(path) == name:
        raise
  raise StateFileError(
      f"{path}: saved again {_READ_ATTEMPTS} times while it was read, each time removing the "
      "version being read; read it when saves are less frequent"
  )


def current_version(path: str | os.PathLike) -> pathlib.Path:
  """The directory of the version a state directory's CURRENT names (StateFileError when
  there is none); e.g. to measure what one saved state takes on disk."""
  path = pathlib.Path(path).absolute()
  return _version(path, _read_pointer(path))


def _read_pointer(path: pathlib.Path) -> str:
  if not path.is_dir():
    raise StateFileError(f"{path}: no saved kvjax state there (not a directory)")
  try:
    return (path / CURRENT).read_text().strip()
  except (OSError, UnicodeDecodeError):
    raise StateFileError(
        f"{path}: not a saved kvjax state (no readable {CURRENT} file; an interrupted first "
        "save leaves none)"
    ) from None


def _current_name(path: pathlib.Path) -> str | None:
  """What CURRENT holds (stripped), or None where it cannot be read."""
  try:
    return (path / CURRENT).read_text().strip()
  except (OSError, UnicodeDecodeError):
    return None


def _version(path: pathlib.Path, name: str) -> pathlib.Path:
  if not _VERSION.fullmatch(name) or not (path / name).is_dir():
    raise StateFileError(f"{path}: {CURRENT} names {name[:40]!r}, which is not a saved version")
  return path / name


def _read_meta(version: pathlib.Path) -> dict:
  import orbax.checkpoint as ocp

  try:
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
      meta = checkpointer.restore(version, ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  except Exception as err:  # noqa: BLE001 - orbax's many failure types, one message
    raise StateFileError(f"{version}: unreadable metadata ({_short(err)})") from None
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    found = meta.get("format") if isinstance(meta, dict) else None
    raise StateFileError(
        f"{version}: state format {found!r} (kvjax {_get(meta, 'kvjax_version')}); this kvjax "
        f"reads {FORMAT!r}: save the state again with this version"
    )
  return meta


def _check_compatible(meta: dict, model, tokenizer, version: pathlib.Path) -> None:
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
    raise StateFileError(f"{version}: incomplete metadata ({_short(err)})") from None


def _read_arrays(version: pathlib.Path, meta: dict) -> dict[str, np.ndarray]:
  import orbax.checkpoint as ocp

  try:
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
      arrays = checkpointer.restore(version, ocp.args.Composite(arrays=ocp.args.StandardRestore()))[
          "arrays"
      ]
    return {name: np.asarray(x) for name, x in arrays.items()}
  except Exception as err:  # noqa: BLE001 - truncated or missing files, one message
    raise StateFileError(
        f"{version}: unreadable arrays, the checkpoint is damaged ({_short(err)})"
    ) from None


def _rebuild(meta: dict, arrays: dict[str, np.ndarray], version: pathlib.Path) -> State:
  """The State of checked metadata and arrays: the pool of the saved size, its live pages
  first (ids 1..n), the rest free, so the state has the shapes it was saved with and runs
  the same compiled steps."""
  try:
    spec = _spec_from_dict(meta["spec"])
  except (ValueError, TypeError, OSError) as err:
    raise StateFileError(
        f"{version}: its CompressionSpec does not load here ({_short(err)})"
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
      k_pages=_saved_pool(arrays, "k_pages", kv_dtype, pool),
      v_pages=_saved_pool(arrays, "v_pages", kv_dtype, pool),
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


def _get(meta, key):
  return meta.get(key) if isinstance(meta, dict) else None


def _short(err: Exception) -> str:
  """An exception as one short line."""
  text = " ".join(str(err).split()) or type(err).__name__
  return text if len(text) <= 200 else text[:197] + "..."
