"""A state directory: complete versions, the CURRENT pointer that names one, the lock saves
take, and reads that follow CURRENT while saves replace it (the layout is in
`kvjax.persistence`)."""

from __future__ import annotations

import errno
import os
import pathlib
import re
import shutil
import stat

from kvjax.persistence._format import StateFileError
from kvjax_store.files import LOCK

CURRENT = "CURRENT"  # the file naming the current version
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
READ_ATTEMPTS = 5
_NAME_BYTES = 64  # what is read of CURRENT: a version's name ("v12\n")


def check_target(path: pathlib.Path, overwrite: bool) -> None:
  if not path.exists():
    return
  if not path.is_dir():
    raise FileExistsError(f"{path} exists and is not a directory")
  for name in (CURRENT, LOCK):
    if (path / name).is_symlink():  # a save writes these: never through a link
      raise FileExistsError(
          f"{path / name} is a symbolic link; a state directory's {name} is a plain file "
          "(remove the link)"
      )
  if (path / CURRENT).exists():
    if not overwrite:
      raise FileExistsError(f"{path} holds a saved state; pass overwrite=True to replace it")
  elif any(not is_ours(p.name) for p in path.iterdir()):
    raise FileExistsError(f"{path} is a directory of other files, not a kvjax state")


def is_ours(name: str) -> bool:
  """Files a state directory may hold: CURRENT (and its temporary), versions, and orbax's
  temporary directories of versions."""
  return _OURS.fullmatch(name) is not None


def versions(path: pathlib.Path) -> list[int]:
  return [
      int(_VERSION.match(p.name).group(1))
      for p in path.iterdir()
      if is_ours(p.name) and _VERSION.match(p.name)
  ]


def remove_stale(path: pathlib.Path, keep: set) -> None:
  """Removes versions not in `keep` and what interrupted saves left (never other files).
  Called under the lock: no other save has temporaries in flight."""
  for p in path.iterdir():
    if p.name not in (CURRENT, LOCK) and p.name not in keep and is_ours(p.name):
      if p.is_dir() and not p.is_symlink():  # a link is removed, never what it names
        shutil.rmtree(p, ignore_errors=True)
      else:
        p.unlink(missing_ok=True)


def read_current(path: pathlib.Path, read):
  """`read(version)` of the version CURRENT names. A save keeps the version it replaces, so
  a read fails under saves only when two of them completed during it, removing its version;
  then CURRENT names a newer version, which is read instead (a failure while CURRENT still
  names the version read is that version's own, raised as it is)."""
  for _ in range(READ_ATTEMPTS):
    name = read_pointer(path)
    try:
      return read(version_dir(path, name))
    except StateFileError:
      if current_name(path) == name:
        raise
  raise StateFileError(
      f"{path}: saved again {READ_ATTEMPTS} times while it was read, each time removing the "
      "version being read; read it when saves are less frequent"
  )


def current_version(path: str | os.PathLike) -> pathlib.Path:
  """The directory of the version a state directory's CURRENT names (StateFileError when
  there is none); e.g. to measure what one saved state takes on disk."""
  path = pathlib.Path(path).absolute()
  return version_dir(path, read_pointer(path))


def read_pointer(path: pathlib.Path) -> str:
  if not path.is_dir():
    raise StateFileError(f"{path}: no saved kvjax state there (not a directory)")
  try:
    return _read_name(path)
  except PermissionError:
    raise StateFileError(
        f"{path}: permission denied reading its {CURRENT} file (a saved state is private to "
        "the user who saved it: files 0600, directories 0700)"
    ) from None
  except OSError as err:
    if err.errno in (errno.ELOOP, errno.EINVAL):  # a link; a FIFO, a device, a directory
      kind = "a symbolic link" if err.errno == errno.ELOOP else "not a regular file"
      raise StateFileError(f"{path}: its {CURRENT} is {kind}; a save writes a plain file") from None
    raise StateFileError(
        f"{path}: not a saved kvjax state (no readable {CURRENT} file; an interrupted first "
        "save leaves none)"
    ) from None
  except UnicodeDecodeError:
    raise StateFileError(f"{path}: its {CURRENT} file does not name a version") from None


def current_name(path: pathlib.Path) -> str | None:
  """What CURRENT holds (stripped), or None where it cannot be read."""
  try:
    return _read_name(path)
  except (OSError, UnicodeDecodeError):
    return None


def _read_name(path: pathlib.Path) -> str:
  """CURRENT's text: a regular file (a link is not followed, a FIFO not waited on), of which
  at most `_NAME_BYTES` are read."""
  flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
  fd = os.open(path / CURRENT, flags)
  try:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
      raise OSError(errno.EINVAL, f"{CURRENT} is not a regular file")
    return os.read(fd, _NAME_BYTES).decode().strip()
  finally:
    os.close(fd)


def _raise(err: OSError):
  raise err


def version_dir(path: pathlib.Path, name: str) -> pathlib.Path:
  """The version `name` of state directory `path`: a directory inside it of directories and
  regular files, neither a link nor holding one (a save writes none; a link would read a
  state from elsewhere, a FIFO or a device would block or never end a read)."""
  version = path / name
  if not _VERSION.fullmatch(name) or not version.is_dir():
    raise StateFileError(f"{path}: {CURRENT} names {name[:40]!r}, which is not a saved version")
  if version.is_symlink() or version.resolve().parent != path.resolve():
    raise StateFileError(
        f"{path}: its version {name} is a symbolic link (to {os.path.realpath(version)}); a "
        "saved version is a directory inside the state"
    )
  try:
    for root, dirs, names in os.walk(version, onerror=_raise):
      for entry in dirs + names:
        mode = os.lstat(os.path.join(root, entry)).st_mode
        if not (stat.S_ISDIR(mode) if entry in dirs else stat.S_ISREG(mode)):
          what = "a symbolic link" if stat.S_ISLNK(mode) else "a special file"
          raise StateFileError(
              f"{path}: its version {name} holds {what} "
              f"({os.path.relpath(os.path.join(root, entry), path)}); a save writes none"
          )
  except PermissionError:
    raise StateFileError(f"{path}: permission denied reading its version {name}") from None
  return version
