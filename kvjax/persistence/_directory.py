"""A state directory: complete versions, the CURRENT pointer that names one, the lock saves
take, and reads that follow CURRENT while saves replace it (the layout is in
`kvjax.persistence`)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shutil

from kvjax.persistence._format import StateFileError

try:
  import fcntl
except ImportError:  # not POSIX (Windows): saves into one directory must not overlap there
  fcntl = None

CURRENT = "CURRENT"  # the file naming the current version
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
READ_ATTEMPTS = 5


def check_target(path: pathlib.Path, overwrite: bool) -> None:
  if not path.exists():
    return
  if not path.is_dir():
    raise FileExistsError(f"{path} exists and is not a directory")
  if (path / CURRENT).exists():
    if not overwrite:
      raise FileExistsError(f"{path} holds a saved state; pass overwrite=True to replace it")
  elif any(not is_ours(p.name) for p in path.iterdir()):
    raise FileExistsError(f"{path} is a directory of other files, not a kvjax state")

@contextlib.contextmanager
def locked(path: pathlib.Path):
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
      if p.is_dir():
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
    return (path / CURRENT).read_text().strip()
  except (OSError, UnicodeDecodeError):
    raise StateFileError(
        f"{path}: not a saved kvjax state (no readable {CURRENT} file; an interrupted first "
        "save leaves none)"
    ) from None

def current_name(path: pathlib.Path) -> str | None:
  """What CURRENT holds (stripped), or None where it cannot be read."""
  try:
    return (path / CURRENT).read_text().strip()
  except (OSError, UnicodeDecodeError):
    return None

def version_dir(path: pathlib.Path, name: str) -> pathlib.Path:
  if not _VERSION.fullmatch(name) or not (path / name).is_dir():
    raise StateFileError(f"{path}: {CURRENT} names {name[:40]!r}, which is not a saved version")
  return path / name
