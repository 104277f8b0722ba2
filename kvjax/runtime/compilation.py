"""Compiled steps: one executable per step function, static values and argument shapes.

`compiled(fn, statics, *args)` returns the step ready to call, from the first place that has it:

1. this process's last `MAX_KEPT` steps;
2. kvjax's executable store, `$KVJAX_CACHE_DIR/executables`: a step serialised after it was
   compiled, loaded without tracing or lowering the model again (on a 2-core CPU the default
   model's prefill step and decode loop for one shape bucket take 1.3-1.7 s from JAX's
   cache below, most of it tracing and lowering, and 0.4-0.6 s from the store);
3. JAX's persistent compilation cache, `$KVJAX_CACHE_DIR/jax`, for the steps the store does
   not keep: traces and lowers the step, then loads what XLA compiled for the same program
   in an earlier process;
4. XLA's compiler (with JAX's cache off for a step the store will keep: XLA:CPU cannot
   serialise again an executable JAX's cache loaded).

Both caches hold native code, so both are trusted only as far as `kvjax_store.cache_dir`
allows:
the directory must be private to this user (else one warning, and no cache), and every
entry carries an HMAC keyed by this user's secret. A store entry is a JSON header line
(format, payload size, tag) and the serialised executable; nothing in it is unpickled
before its tag checks, and its pytree structures come from the step being loaded (its
arguments and `returns`), not from the file. JAX's cache entries get the same tag through a
wrapper around JAX's own file cache. An entry that fails is removed and compiled again.

The store's key cannot be the program (that is what tracing makes), so it is everything
the program is made from: the step's static values and argument types, the source of every
file of `kvjax`, `kvjax_store`, `models` and `pallas_kernels`, the versions of Python, jax,
jaxlib, flax and numpy, the backend and device, jax's configuration and the environment variables that steer
kernels. A step whose static values refer to code kvjax cannot hash that way (a model or
policy defined outside those packages, whose source may change while its names stay) goes
through JAX's cache only, which keys on the program itself. Sharded steps do too: an
executable is bound to its devices. `KVJAX_CACHE_DIR=off` turns both caches off,
`KVJAX_EXECUTABLES=off` the store alone.

`compile_ahead` prepares a step in a background thread from its arguments' shapes (e.g. the
decode loop while the prompt is read); `compiled` then waits for it instead of compiling it
again. Tracing holds Python's lock, so steps are traced one at a time; XLA compiles them in
parallel.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import hashlib
import json
import os
import pathlib
import pickle
import pickletools
import platform
import sys
import threading
import time

import jax
import jax.numpy as jnp

from kvjax_store import files as _files
from kvjax import sharding as shards
from kvjax_store import cache_dir as private_cache
from kvjax_store.cache_dir import private_dir

try:  # JAX's persistent cache, wrapped by `_AuthenticatedCache` (private modules)
  from jax._src import compilation_cache as _jax_cache
  from jax._src import lru_cache as _lru_cache
  from jax._src.compilation_cache_interface import CacheInterface as _CacheInterface

  if not hasattr(_lru_cache, "_CACHE_SUFFIX"):
    raise ImportError("jax._src.lru_cache has changed")
except ImportError:
  _jax_cache = _lru_cache = None
  _CacheInterface = object

MAX_KEPT = 16  # steps kept compiled in this process; older ones are freed
_STORE_FORMAT = "kvjax-executable-2"
# Packages whose source files are hashed into the key, so their code may change freely.
_HASHED_PACKAGES = ("kvjax", "kvjax_store", "models", "pallas_kernels")
# Packages whose code the key pins by version.
_VERSIONED_PACKAGES = ("jax", "jaxlib", "flax", "numpy", "ml_dtypes", "optax")

_KEPT: collections.OrderedDict = collections.OrderedDict()
_PENDING: dict = {}  # key -> Future of a step `compile_ahead` is preparing
_STATS = {"compiles": 0, "compile_seconds": 0.0, "loaded": 0, "dropped": 0}
_LOCK = threading.RLock()  # _KEPT, _PENDING, _STATS and JAX's cache setting
_TRACING = threading.Lock()  # one step traced at a time (the model's Python is not shared)


def compile_stats() -> dict:
  """Steps this process prepared (compiled, or loaded from kvjax's executable store), how
  many of them came from the store, and the seconds callers waited for them (a step
  prepared ahead counts only the time a caller still waited for it)."""
  with _LOCK:
    return {k: _STATS[k] for k in ("compiles", "compile_seconds", "loaded")}


def compiled(fn, statics: dict, *args, returns):
  """`fn` (a `jax.jit` function) lowered and compiled for these static keyword values and
  these arguments' shapes, dtypes and layouts; see the module docstring for where from.
  `returns(*args)` gives a pytree of `fn`'s output structure without running it (e.g. the
  arguments it hands back updated): a stored step is loaded with it."""
  _use_persistent_cache()
  key = _key(fn, statics, args)
  start = time.perf_counter()
  with _LOCK:
    if key in _KEPT:
      _KEPT.move_to_end(key)
      return _KEPT[key]
    ahead = _PENDING.get(key)
  step = None
  if ahead is not None:
    try:
      step = ahead.result()
    except Exception:  # noqa: BLE001 - prepared again below, where its error is raised
      step = None
  if step is None:
    step = _prepare(key, fn, statics, args, returns)
  with _LOCK:
    _STATS["compile_seconds"] += time.perf_counter() - start
  return step


def compile_ahead(fn, statics: dict, *args, returns) -> None:
  """Starts preparing the step `compiled(fn, statics, *args, returns=returns)` will ask for:
  traced here (Python's lock serialises tracing anyway), compiled or loaded in a background
  thread. `args` may be abstract (`jax.ShapeDtypeStruct`s with the real arguments'
  shardings). Does nothing when the step is ready or on its way, or with several processes
  (each must compile the same steps in the same order); never raises (a step that cannot
  be made fails where `compiled` asks for it)."""
  if jax.process_count() > 1:
    return
  _use_persistent_cache()
  key = _key(fn, statics, args)
  with _LOCK:
    if key in _KEPT or key in _PENDING:
      return
  try:
    job = _start(fn, statics, args, returns)
  except Exception:  # noqa: BLE001 - `compiled` meets the same error, where it is asked for
    return
  with _LOCK:
    _PENDING[key] = _background().submit(_finish_ahead, key, job)


@functools.cache
def _background() -> concurrent.futures.ThreadPoolExecutor:
  return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvjax-compile")


def _finish_ahead(key, job):
  try:
    return _finish(key, job)
  finally:
    with _LOCK:
      _PENDING.pop(key, None)


def _key(fn, statics: dict, args) -> tuple:
  leaves, treedef = jax.tree.flatten(args)
  return (
      fn,
      tuple(statics.items()),
      treedef,
      # An executable compiled for one layout over a mesh refuses another.
      tuple((jnp.shape(x), jnp.result_type(x), shards.layout_key(x)) for x in leaves),
  )


@dataclasses.dataclass
class _Job:
  """A step on its way: where the store keeps it, the structures a load needs, and its
  program (traced and lowered unless the store has it)."""

  fn: object
  statics: dict
  args: tuple
  path: pathlib.Path | None
  trees: tuple
  lowered: object | None


def _start(fn, statics: dict, args, returns) -> _Job:
  leaves, treedef = jax.tree.flatten(args)
  path = _store_path(fn, statics, treedef, leaves)
  trees = (jax.tree.structure((args, {})), jax.tree.structure(returns(*args)))
  job = _Job(fn, statics, args, path, trees, None)
  if path is None or not path.exists():
    _lower(job)
  return job


def _lower(job: _Job) -> None:
  with _TRACING:
    job.lowered = job.fn.lower(*job.args, **job.statics)


def _prepare(key, fn, statics: dict, args, returns):
  """The step from the store, JAX's cache or XLA (see the module docstring), kept."""
  return _finish(key, _start(fn, statics, args, returns))


def _finish(key, job: _Job):
  step = None
  if job.lowered is None:
    step = _load(job.path, *job.trees)
    if step is None:  # unreadable or not ours: removed, made again
      _lower(job)
  if step is not None:
    with _LOCK:
      _STATS["loaded"] += 1
  elif job.path is None:
    step = job.lowered.compile()
  else:
    hits = _JAX_CACHE_HITS[0]
    with _without_jax_cache():
      step = job.lowered.compile()
    if _JAX_CACHE_HITS[0] == hits:
      _save(job.path, step, *job.trees)
  with _LOCK:
    _STATS["compiles"] += 1
    _keep(key, step)
  return step


def _keep(key, step) -> None:
  _KEPT[key] = step
  if len(_KEPT) <= MAX_KEPT:
    return
  _KEPT.popitem(last=False)
  _STATS["dropped"] += 1
  if _STATS["dropped"] % MAX_KEPT == 0:
    # JAX keeps every executable it compiled in caches of its own. On CPU each holds ~450
    # memory maps of JIT code, and a process dies (LLVM cannot allocate section memory) at
    # vm.max_map_count, 65530, after ~140 executables: a service that sees many shapes
    # would crash. Clearing JAX's caches now and then (and collecting the cycles that hold
    # the executables) frees what kvjax dropped; the steps kept here stay compiled.
    with _TRACING:  # not under a step being traced in another thread
      jax.clear_caches()
      gc.collect()


@functools.cache
def _use_persistent_cache() -> None:
  """Points JAX's persistent compilation cache at `private_dir('jax')`, its entries
  authenticated (once per process, unless the user set a JAX cache directory of their own,
  KVJAX_CACHE_DIR=off, the directory is not private, or this JAX's cache cannot be wrapped),
  so a second process loads its executables instead of compiling them again."""
  if jax.config.jax_compilation_cache_dir is not None:
    return  # the user chose a JAX cache directory (and trusts it)
  path = private_dir("jax")
  if path is None or not _AuthenticatedCache.install(path):
    return
  jax.config.update("jax_compilation_cache_dir", str(path))
  # kvjax's steps take 0.2-5 s to compile on a CPU: keep them all.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)


class _AuthenticatedCache(_CacheInterface):
  """JAX's file cache (`LRUCache`) with an HMAC tag before every entry: an entry someone else
  wrote into the directory is removed and compiled again, never deserialised. Keys get a
  prefix of their own, so JAX's plain cache (were it ever pointed here) sees none of them.
  JAX has no public hook for its cache's storage: where its internals differ from what this
  wraps, `install` returns False and JAX's persistent cache stays off."""

  _PREFIX = "kvjax-"
  _TAG_BYTES = 64  # hex HMAC-SHA256
  installed: pathlib.Path | None = None  # the directory kvjax's cache serves; None until then

  def __init__(self, path: pathlib.Path):
    self.base = _lru_cache.LRUCache(str(path), max_size=jax.config.jax_compilation_cache_max_size)
    self._path = self.base._path

  @classmethod
  def install(cls, path: pathlib.Path | None = None) -> bool:
    """Makes JAX's persistent cache this one, over `path` (default: the directory it was
    last installed over, after a `reset_cache` dropped it)."""
    path = path or cls.installed
    if path is None or _jax_cache is None:
      return False
    if not all(hasattr(_jax_cache, n) for n in ("_cache", "_cache_initialized", "reset_cache")):
      return False
    _jax_cache._cache = cls(path)
    _jax_cache._cache_initialized = True  # JAX would otherwise make its own plain cache
    cls.installed = path
    return True

  def get(self, key: str) -> bytes | None:
    value = self.base.get(self._PREFIX + key)
    if value is None:
      return None
    tag, body = value[: self._TAG_BYTES], value[self._TAG_BYTES :]
    if private_cache.verify(tag.decode("ascii", "replace"), "jax-cache", key.encode(), body):
      return body
    # Not ours: removed, so that `put` (which never overwrites) can store our own.
    entry = pathlib.Path(self._path) / f"{self._PREFIX}{key}{_lru_cache._CACHE_SUFFIX}"
    entry.unlink(missing_ok=True)
    return None

  def put(self, key: str, value: bytes) -> None:
    tag = private_cache.tag("jax-cache", key.encode(), value)
    if tag is not None:
      self.base.put(self._PREFIX + key, tag.encode("ascii") + value)


# ---- the executable store ------------------------------------------------------------------


def _store_path(fn, statics: dict, treedef, leaves) -> pathlib.Path | None:
  """Where the store keeps this step, or None when it must not (see the module docstring)."""
  if jax.process_count() > 1 or not store_enabled():
    return None
  store = private_dir("executables")
  if store is None:
    return None
  if any(shards.layout_key(x) for x in leaves):
    return None  # sharded over a mesh: bound to its devices
  try:
    # Protocol 2 names every class and function it refers to in a GLOBAL opcode.
    made_of = pickle.dumps((fn.__module__, fn.__qualname__, statics), protocol=2)
  except Exception:  # noqa: BLE001 - anything unpicklable just is not stored
    return None
  modules = _referenced_modules(made_of) | {fn.__module__}
  if not all(_code_is_pinned(module) for module in modules):
    return None
  digest = hashlib.sha256()
  for part in (
      _STORE_FORMAT,
      _environment(),
      made_of,
      str(treedef),
      # jax.typeof says shape, dtype and weak type: all change the program.
      repr([(str(jax.typeof(x)), _devices(x)) for x in leaves]),
  ):
    digest.update(part if isinstance(part, bytes) else part.encode())
  return store / f"{fn.__name__}-{digest.hexdigest()[:40]}.bin"


def _devices(x) -> str:
  """The devices an argument lives on (an array's or a `jax.ShapeDtypeStruct`'s)."""
  sharding = getattr(x, "sharding", None)
  return "" if sharding is None else repr(sorted(str(d) for d in sharding.device_set))


def store_enabled() -> bool:
  """False when KVJAX_EXECUTABLES=off: the store trusts that the code it hashed is the code
  that runs, which patching kvjax or its models at run time (as tests do) breaks."""
  return os.environ.get("KVJAX_EXECUTABLES", "").lower() not in ("off", "0", "false")


def _referenced_modules(pickled: bytes) -> set[str]:
  modules = set()
  for opcode, arg, _ in pickletools.genops(pickled):
    if opcode.name == "GLOBAL":
      modules.add(arg.split(" ")[0])
  return modules


def _code_is_pinned(module: str) -> bool:
  """The module's code is part of the key: hashed, versioned, or Python's own."""
  top = module.split(".")[0]
  return (
      top in _HASHED_PACKAGES
      or top in _VERSIONED_PACKAGES
      or top in sys.stdlib_module_names
      or top in ("builtins", "__builtin__", "copy_reg", "_codecs")
  )


@functools.cache
def _environment() -> str:
  """Everything besides the step's own values that decides the program or its machine code."""
  from importlib import metadata

  versions = []
  for name in _VERSIONED_PACKAGES:
    try:
      versions.append((name, metadata.version(name)))
    except metadata.PackageNotFoundError:
      versions.append((name, None))
  device = jax.devices()[0]
  config = sorted(
      (name, repr(value))
      for name, value in jax.config.values.items()
      if not any(part in name for part in ("cache", "log", "dump", "traceback", "guard"))
  )
  env = sorted(
      (name, value)
      for name, value in os.environ.items()
      if (name.startswith("KVJAX_") and name not in ("KVJAX_CACHE_DIR", "KVJAX_EXECUTABLES"))
      or name in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
  )
  return repr(
      (
          sys.version,
          platform.machine(),
          versions,
          _source_digest(),
          device.platform,
          device.device_kind,
          jax.device_count(),
          config,
          env,
      )
  )


@functools.cache
def _source_digest() -> str:
  digest = hashlib.sha256()
  for package in _HASHED_PACKAGES:
    module = sys.modules.get(package) or __import__(package)
    for root in sorted(map(pathlib.Path, module.__path__)):
      for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
  return digest.hexdigest()


# XLA:CPU executables that JAX's persistent cache loaded cannot be serialised again: the copy
# loads, then fails when run ("Function wrapped_iota not found", jax 0.10.2). A step the
# store will keep is compiled with JAX's cache off, and not stored if the cache served it.
_JAX_CACHE_HITS = [0]


def _count_jax_cache_hits(event: str, **_) -> None:
  if event == "/jax/compilation_cache/cache_hits":
    _JAX_CACHE_HITS[0] += 1


jax.monitoring.register_event_listener(_count_jax_cache_hits)


_CACHE_OFF = {"depth": 0, "enabled": None}  # steps compiling with JAX's cache off


@contextlib.contextmanager
def _without_jax_cache():
  """JAX's persistent cache off while any step the store keeps compiles (in any thread)."""
  from jax.experimental.compilation_cache import compilation_cache as jax_cache

  with _LOCK:
    if _CACHE_OFF["depth"] == 0:
      _CACHE_OFF["enabled"] = jax.config.jax_enable_compilation_cache
      jax.config.update("jax_enable_compilation_cache", False)
      jax_cache.reset_cache()  # it reads the setting once, when first used
    _CACHE_OFF["depth"] += 1
  try:
    yield
  finally:
    with _LOCK:
      _CACHE_OFF["depth"] -= 1
      if _CACHE_OFF["depth"] == 0:
        jax.config.update("jax_enable_compilation_cache", _CACHE_OFF["enabled"])
        jax_cache.reset_cache()
        _AuthenticatedCache.install()  # the reset dropped it


def _load(path: pathlib.Path, in_tree, out_tree):
  """The stored step, or None (absent, or not authenticated, or unreadable: then it is
  removed and made again)."""
  from jax.experimental import serialize_executable

  try:
    entry = path.read_bytes()
  except OSError:
    return None
  try:
    line, _, payload = entry.partition(b"\n")
    header = json.loads(line)
    if not isinstance(header, dict) or header.get("format") != _STORE_FORMAT:
      raise ValueError("another format")
    if header.get("size") != len(payload) or not private_cache.verify(
        header.get("tag"), "executable", path.name.encode(), payload
    ):
      raise ValueError("not authenticated")
    # Authenticated: written by this user's kvjax. The payload is JAX's own serialised form.
    return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
  except Exception:  # noqa: BLE001 - a damaged, foreign or planted entry is compiled again
    path.unlink(missing_ok=True)
    return None


def _save(path: pathlib.Path, step, in_tree, out_tree) -> None:
  """Stores `step` atomically; a step that cannot be serialised, whose structures are not
  the ones a load will give it, or a cache directory that cannot be written, is not stored
  (the step itself is unaffected)."""
  from jax.experimental import serialize_executable

  try:
    payload, step_in, step_out = serialize_executable.serialize(step)
    if (step_in, step_out) != (in_tree, out_tree):
      return  # `returns` does not describe the step: a load would mislabel its outputs
    tag = private_cache.tag("executable", path.name.encode(), payload)
    if tag is None:
      return
    header = json.dumps({"format": _STORE_FORMAT, "size": len(payload), "tag": tag})
    _files.write_bytes(path, header.encode() + b"\n" + payload)
  except Exception:  # noqa: BLE001 - storing is an optimisation, never a failure
    return
