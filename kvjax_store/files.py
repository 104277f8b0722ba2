"""Files written atomically: text and binary files, and small learned artefacts (the learned
scorer, a tuned head allocation) as a directory of orbax-checkpoint items `params`
(StandardSave of named arrays) and `meta` (JsonSave): a complete file or directory, or the old
one. `arrays_digest` is the one digest of named arrays (saved states, converted weights).

Everything written here is private, whatever the umask: files 0600, directories kvjax creates
0700 (`write_bytes`, `make_dirs`, `make_private`). A directory of arrays is read by its
declared shapes first (`stored_arrays`): orbax does not write chunks that hold only zeros, so
a file of a few kilobytes can declare gigabytes; a reader compares what is declared with what
it expects before a byte is restored."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import hashlib
import os
import pathlib
import shutil
import sys
import tempfile
import time

import numpy as np

try:  # POSIX; elsewhere a lock is not taken
  import fcntl
except ImportError:  # pragma: no cover
  fcntl = None

__all__ = [
    "ArraysMismatch",
    "arrays_digest",
    "make_dirs",
    "make_private",
    "private_checkpointer",
    "read_params",
    "restore_arrays",
    "shapes_mismatch",
    "stored_arrays",
    "write_bytes",
    "write_params",
    "write_text",
]

# A read of a directory that `write_params` replaces meanwhile is repeated this many times.
_READ_ATTEMPTS = 5


def write_params(
    path: str | os.PathLike, params: dict, meta: dict, *, overwrite: bool
) -> pathlib.Path:
  """Writes `params` (arrays by name) and `meta` (JSON values) to directory `path`: staged
  beside it, then put in its place in one step (`_swap`), so a reader finds the old directory
  or the new one, never none; the old one is removed afterwards."""
  import orbax.checkpoint as ocp

  path = pathlib.Path(path).absolute()
  if os.path.lexists(path) and not overwrite:  # a link (even a dangling one) counts
    raise FileExistsError(f"{path} exists; choose another directory or overwrite=True")
  make_dirs(path.parent)
  staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
  shutil.rmtree(staging)  # orbax creates the directory itself (0700: `private_checkpointer`)
  try:
    with private_checkpointer() as checkpointer:
      checkpointer.save(
          staging,
          ocp.args.Composite(params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta)),
      )
    make_private(staging)  # before it takes its name: never readable by others
    try:
      os.rename(staging, path)  # nothing there (or an empty directory): one step
    except OSError as err:
      if err.errno == errno.ENOTDIR and overwrite and not _is_real_dir(path):
        # A link or a file in its place (planted there, perhaps by another user): replaced
        # by the directory, never followed.
        path.unlink()
        os.rename(staging, path)
        return path
      if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
        raise
      if not overwrite:  # written meanwhile by another process
        raise FileExistsError(
            f"{path} exists; choose another directory or overwrite=True"
        ) from None
      _swap(staging, path)  # `staging` now holds the old directory, removed below
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return path


def _is_real_dir(path: pathlib.Path) -> bool:
  return path.is_dir() and not path.is_symlink()


def _swap(new: pathlib.Path, path: pathlib.Path) -> None:
  """Puts directory `new` at `path` and the old `path` at `new`. In one step where the system
  can exchange two names (Linux `renameat2(RENAME_EXCHANGE)`); elsewhere in two renames (the
  old one aside, the new one in), and `read_params` waits out the moment between them."""
  if _exchange(new, path):
    return
  aside = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
  aside.rmdir()  # a free hidden name (renaming onto a directory fails on Windows)
  os.rename(path, aside)
  try:
    os.rename(new, path)
  except BaseException:
    os.rename(aside, path)  # the old one back
    raise
  os.rename(aside, new)


def _exchange(a: pathlib.Path, b: pathlib.Path) -> bool:
  """Swaps the names `a` and `b` atomically; False where the system or the file system
  cannot (then nothing was changed)."""
  renameat2 = _renameat2()
  if renameat2 is None:
    return False
  if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
    return True
  code = ctypes.get_errno()
  if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
    return False
  raise OSError(code, os.strerror(code), str(b))


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # Linux's values (fcntl.h, linux/fs.h)


def _renameat2():
  if sys.platform != "linux":
    return None
  try:
    return getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc >= 2.28
  except OSError:
    return None


def read_params(path: str | os.PathLike, *, what: str, fmt: str, expected) -> tuple[dict, dict]:
  """(params as numpy arrays, meta) of a directory written by `write_params` whose meta
  format is `fmt`; ValueError naming the path (and `what` it should be) otherwise.
  `expected(meta, declared)` gives the arrays the directory must hold, {name: (shape, dtype
  name)}, from its meta and what its params declare (`stored_arrays`), or raises ValueError
  for either; a directory whose params declare anything else is refused before any array
  is restored. A read that `write_params` replaced the directory under (seen by its
  identity: device, inode, change time) is repeated, so params and meta always come from
  one writing."""
  path = pathlib.Path(path).absolute()
  for attempt in range(_READ_ATTEMPTS):
    before = _identity(path)
    if before is None and _being_replaced(path) and attempt + 1 < _READ_ATTEMPTS:
      time.sleep(0.02 * (attempt + 1))  # between the two renames of a `_swap` fallback
      continue
    try:
      result = _read_params_once(path, what, fmt, expected)
    except Exception:  # any failure: the directory may have been replaced under the read
      if _identity(path) == before:
        raise
      continue
    if _identity(path) == before:
      return result
  raise ValueError(
      f"{path}: replaced {_READ_ATTEMPTS} times while it was read as a {what}; read it again"
  )


def _identity(path: pathlib.Path):
  try:
    st = os.stat(path)
  except OSError:
    return None
  return st.st_dev, st.st_ino, st.st_ctime_ns


def _being_replaced(path: pathlib.Path) -> bool:
  """Whether a hidden sibling that `write_params` stages or sets aside exists."""
  return any(path.parent.glob(f".{glob.escape(path.name)}.*"))


def _read_params_once(path: pathlib.Path, what: str, fmt: str, expected) -> tuple[dict, dict]:
  import orbax.checkpoint as ocp

  if not (path / "meta").is_dir() or not (path / "params").is_dir():
    raise ValueError(f"{path} is not a {what} (no params/ and meta/ inside)")
  try:
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
      meta = checkpointer.restore(path, ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  except (OSError, ValueError, KeyError) as e:
    raise ValueError(f"{path}: cannot read this {what}: {type(e).__name__}: {e}") from None
  if not isinstance(meta, dict) or meta.get("format") != fmt:
    found = meta.get("format") if isinstance(meta, dict) else None
    raise ValueError(f"{path}: unknown {what} format {found!r}, need {fmt!r}")
  try:
    declared = stored_arrays(path, "params")
  except (OSError, ValueError, KeyError) as e:
    raise ValueError(f"{path}: cannot read this {what}: {type(e).__name__}: {e}") from None
  try:
    want = expected(meta, declared)
  except (ValueError, TypeError, KeyError) as e:
    raise ValueError(f"{path}: not a usable {what}: {e}") from None
  mismatch = shapes_mismatch(declared, want)
  if mismatch:
    raise ValueError(f"{path}: not a usable {what}: {mismatch}")
  try:
    params = restore_arrays(path, "params", want)
  except ArraysMismatch as e:
    raise ValueError(f"{path}: not a usable {what}: {e}") from None
  except (OSError, ValueError, KeyError) as e:
    raise ValueError(f"{path}: cannot read this {what}: {type(e).__name__}: {e}") from None
  return params, meta


def stored_arrays(path: str | os.PathLike, item: str) -> dict[str, tuple[tuple, str]]:
  """{name: (shape, dtype name)} of the arrays that orbax item `item` (a StandardSave of
  named arrays, beside a JsonSave `meta`) of checkpoint `path` declares, read from its
  metadata: no array is restored. ValueError for an item that is not a flat dict of arrays."""
  import orbax.checkpoint as ocp

  handlers = {item: ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler(**handlers)) as checkpointer:
    tree = checkpointer.metadata(path).item_metadata[item]
  if tree is None or not callable(getattr(tree, "items", None)):
    raise ValueError(f"its {item!r} holds no named arrays")
  out = {}
  for name, value in tree.items():
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if not isinstance(name, str) or not isinstance(shape, tuple) or dtype is None:
      raise ValueError(f"its {item!r} holds {str(name)[:40]!r}, which is not an array")
    out[name] = (tuple(int(n) for n in shape), np.dtype(dtype).name)
  return out


class ArraysMismatch(ValueError):
  """Restored arrays whose names, shapes or dtypes are not the ones their metadata declared."""


def restore_arrays(path: str | os.PathLike, item: str, want: dict) -> dict[str, np.ndarray]:
  """The arrays of orbax item `item` of checkpoint `path`, once `stored_arrays` declared
  `want` ({name: (shape, dtype name)}), checked again once restored (ArraysMismatch): the
  files may have changed since their metadata was read. orbax's errors pass through."""
  import orbax.checkpoint as ocp

  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    restored = checkpointer.restore(path, ocp.args.Composite(**{item: ocp.args.StandardRestore()}))
  arrays = {name: np.asarray(x) for name, x in restored[item].items()}
  mismatch = shapes_mismatch({k: (x.shape, x.dtype.name) for k, x in arrays.items()}, want)
  if mismatch:
    raise ArraysMismatch(mismatch)
  return arrays


def shapes_mismatch(found: dict, want: dict) -> str | None:
  """What differs between arrays `found` and `want` ({name: (shape, dtype name)}), in one
  line naming the first difference; None when they agree."""
  extra, missing = sorted(set(found) - set(want)), sorted(set(want) - set(found))
  if extra:
    shape, dtype = found[extra[0]]
    return f"unexpected array {extra[0][:40]!r} ({dtype} {shape})"
  if missing:
    return f"array {missing[0]!r} is missing"
  for name in sorted(want):
    (shape, dtype), (want_shape, want_dtype) = found[name], want[name]
    if tuple(shape) != tuple(want_shape) or dtype != want_dtype:
      return f"array {name!r} is {dtype} {tuple(shape)}, expected {want_dtype} {tuple(want_shape)}"
  return None


def private_checkpointer(handler=None):
  """An orbax Checkpointer (of a CompositeCheckpointHandler by default) that creates the
  directory it saves to 0700: what it writes inside is out of other users' reach from the
  start, before `make_private` sets every mode."""
  import orbax.checkpoint as ocp

  options = ocp.options.FileOptions(path_permission_mode=0o700)
  return ocp.Checkpointer(handler or ocp.CompositeCheckpointHandler(), file_options=options)


def make_private(path: str | os.PathLike) -> None:
  """Directory `path` and every directory under it 0700, every file 0600 (symbolic links
  are neither followed nor changed)."""
  for root, _, names in os.walk(path):  # does not descend into linked directories
    os.chmod(root, 0o700)
    for name in names:
      file = os.path.join(root, name)
      if not os.path.islink(file):
        os.chmod(file, 0o600)


def make_dirs(path: str | os.PathLike) -> None:
  """Directory `path` and its missing parents, each one made 0700 whatever the umask (those
  that exist are left as they are)."""
  path = pathlib.Path(path)
  missing = []
  while not path.is_dir():
    missing.append(path)
    if path.parent == path:
      break
    path = path.parent
  for directory in reversed(missing):
    try:
      directory.mkdir(mode=0o700)
    except FileExistsError:
      if not directory.is_dir():
        raise
      continue  # made meanwhile by another process: theirs
    os.chmod(directory, 0o700)


def write_text(path: str | os.PathLike, text: str) -> None:
  """`text` in `path`, or the old file (see `write_bytes`)."""
  write_bytes(path, text.encode("utf-8"))


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
  """`data` in `path`, or the old file: a temporary file beside it, flushed to disk, renamed,
  and the rename flushed too."""
  path = pathlib.Path(path)
  fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(temporary, path)
  except BaseException:
    pathlib.Path(temporary).unlink(missing_ok=True)
    raise
  directory = os.open(path.parent, os.O_RDONLY)
  try:
    os.fsync(directory)
  finally:
    os.close(directory)


def arrays_digest(arrays: dict[str, np.ndarray]) -> str:
  """SHA-256 of named arrays: each one's name, dtype, shape and bytes, in name order."""
  digest = hashlib.sha256()
  for name in sorted(arrays):
    x = np.ascontiguousarray(arrays[name])
    digest.update(f"{name}:{x.dtype.name}:{x.shape};".encode())
    digest.update(x.reshape(-1).view(np.uint8).data)  # any dtype (bfloat16 too), no copy
  return digest.hexdigest()


LOCK = ".lock"  # the lock file `locked` holds in a directory


@contextlib.contextmanager
def locked(path: str | os.PathLike):
  """Holds an exclusive `flock` on `path/.lock` (created once, 0600, never removed: removing
  it would let two processes lock two different files). The kernel releases it when the
  process dies, so a killed save never blocks the next one. A `.lock` that is a symbolic
  link is refused, never followed (O_NOFOLLOW): it would create or lock a file elsewhere.
  A saved state's directory and a tenant's contexts are locked with it."""
  path = pathlib.Path(path)
  nofollow = getattr(os, "O_NOFOLLOW", 0)
  try:
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT | nofollow, 0o600)
  except OSError as err:
    if err.errno != errno.ELOOP:
      raise
    raise FileExistsError(
        f"{path / LOCK} is a symbolic link; a directory's lock is a plain file "
        "(remove the link)"
    ) from None
  try:
    with contextlib.suppress(OSError):  # one an older kvjax made 0644; another user's: theirs
      os.fchmod(fd, 0o600)
    if fcntl is not None:
      fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)  # releases the lock
