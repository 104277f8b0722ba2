"""Files written atomically: text and binary files, and small learned artefacts (the learned
scorer, a tuned head allocation) as a directory of orbax-checkpoint items `params`
(StandardSave of named arrays) and `meta` (JsonSave): a complete file or directory, or the old
one. `arrays_digest` is the one digest of named arrays (saved states, converted weights)."""

from __future__ import annotations

import ctypes
import hashlib
import errno
import glob
import os
import pathlib
import shutil
import sys
import tempfile
import time

import numpy as np

__all__ = [
    "arrays_digest",
    "read_params",
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
  if path.exists() and not overwrite:
    raise FileExistsError(f"{path} exists; choose another directory or overwrite=True")
  path.parent.mkdir(parents=True, exist_ok=True)
  staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
  shutil.rmtree(staging)  # orbax creates the directory itself
  try:
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
      checkpointer.save(
          staging,
          ocp.args.Composite(params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta)),
      )
    try:
      os.rename(staging, path)  # nothing there (or an empty directory): one step
    except OSError as err:
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


def read_params(path: str | os.PathLike, *, what: str, fmt: str) -> tuple[dict, dict]:
  """(params as numpy arrays, meta) of a directory written by `write_params` whose meta
  format is `fmt`; ValueError naming the path (and `what` it should be) otherwise. A read
  that `write_params` replaced the directory under (seen by its identity: device, inode,
  change time) is repeated, so params and meta always come from one writing."""
  path = pathlib.Path(path).absolute()
  for attempt in range(_READ_ATTEMPTS):
    before = _identity(path)
    if before is None and _being_replaced(path) and attempt + 1 < _READ_ATTEMPTS:
      time.sleep(0.02 * (attempt + 1))  # between the two renames of a `_swap` fallback
      continue
    try:
      result = _read_params_once(path, what, fmt)
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


def _read_params_once(path: pathlib.Path, what: str, fmt: str) -> tuple[dict, dict]:
  import orbax.checkpoint as ocp

  if not (path / "meta").is_dir() or not (path / "params").is_dir():
    raise ValueError(f"{path} is not a {what} (no params/ and meta/ inside)")
  try:
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
      restored = checkpointer.restore(
          path,
          ocp.args.Composite(params=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()),
      )
  except (OSError, ValueError, KeyError) as e:
    raise ValueError(f"{path}: cannot read this {what}: {type(e).__name__}: {e}") from None
  meta, params = restored["meta"], restored["params"]
  if not isinstance(meta, dict) or meta.get("format") != fmt:
    found = meta.get("format") if isinstance(meta, dict) else None
    raise ValueError(f"{path}: unknown {what} format {found!r}, need {fmt!r}")
  return {k: np.asarray(v) for k, v in params.items()}, meta


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
