"""kvjax's cache directory: where it is, whether it is safe to use, and the key that
authenticates what is read back from it.

What the cache holds is trusted the way code is: a compiled executable is native code, and
converted weights decide every answer. So, as ssh's StrictModes does for ~/.ssh:

- The root and every directory kvjax uses inside it must belong to this user (or root) and
  must not be writable by group or others. A directory that fails is not used: one warning
  naming it and the reason, and the run goes on without that cache. Directories kvjax makes
  are 0700.
- Every entry carries an HMAC-SHA256 tag keyed by a per-user secret kept outside the cache
  (`$KVJAX_CACHE_KEY_FILE`, else `$XDG_CONFIG_HOME/kvjax/cache.key`, else
  `~/.config/kvjax/cache.key`; 32 random bytes, 0600). An entry someone else wrote or replaced
  (a restored CI cache, a copied or mounted directory) does not carry a valid tag: it is
  rejected and rebuilt, never loaded. Entries are trusted on the machine (home) that made
  them; to share a cache on purpose, share the key file too.

The model loaders (`models.weight_cache`) and kvjax's compiled steps
(`kvjax.runtime.compilation`) both go through here.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import warnings
from pathlib import Path

__all__ = [
    "cache_root",
    "describe",
    "key_file",
    "private_dir",
    "signing_key",
    "tag",
    "unsafe_reason",
    "verify",
]

_WARNED: set[str] = set()  # each warning is given once per process
_KEY_BYTES = 32
_KEYS: dict[str, bytes] = {}  # key file -> its key, read once per process


def cache_root() -> Path | None:
  """Where kvjax's cache lives: $KVJAX_CACHE_DIR, else kvjax under $XDG_CACHE_HOME or
  ~/.cache; None when KVJAX_CACHE_DIR=off. Only the location: `private_dir` says whether it
  may be used."""
  chosen = os.environ.get("KVJAX_CACHE_DIR", "")
  if chosen.lower() == "off":
    return None
  if chosen:
    return Path(chosen).expanduser()
  return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvjax"


def private_dir(*parts: str) -> Path | None:
  """`cache_root()/parts...`, made 0700 where missing, when the root and every directory
  below it on the way are this user's own and written by nobody else; else None, after one
  warning naming the directory and why (None silently when KVJAX_CACHE_DIR=off)."""
  path, reason = _checked(parts)
  if reason is not None:
    _warn_once(reason)
  return None if reason is not None else path


def describe() -> str:
  """One line on the cache directory (for `kvjax doctor`): where it is, or why unused."""
  path, reason = _checked(())
  if path is None:
    return "off (KVJAX_CACHE_DIR=off)"
  return str(path) if reason is None else reason


def _checked(parts) -> tuple[Path | None, str | None]:
  """(the directory, None) when it may be used; (None, None) when the cache is off;
  (path, why not) otherwise."""
  root = cache_root()
  if root is None:
    return None, None
  path = root
  for part in ("", *parts):
    path = path / part if part else path
    reason = _make_private(path)
    if reason is not None:
      return path, f"not using the cache directory {path}: {reason}; running without it"
  _, why = _key()
  if why is not None:
    return path, f"the cache key {key_file()} cannot be used ({why}); running without the cache"
  return path, None


def _make_private(path: Path) -> str | None:
  """Creates `path` (mode 0700) when missing; returns why it must not be used, or None."""
  try:
    path.mkdir(mode=0o700, parents=True)
  except FileExistsError:
    pass
  except OSError as err:
    return f"it cannot be created ({err.strerror})"
  return unsafe_reason(path)


def unsafe_reason(path: Path) -> str | None:
  """Why the directory `path` must not hold trusted files, or None when it may."""
  try:
    st = path.stat()
  except OSError as err:
    return f"it cannot be read ({err.strerror})"
  if not stat.S_ISDIR(st.st_mode):
    return "it is not a directory"
  if st.st_uid not in (os.getuid(), 0):
    return f"it belongs to another user (uid {st.st_uid}, this process runs as {os.getuid()})"
  if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
    who = "others" if st.st_mode & stat.S_IWOTH else "its group"
    return f"it is writable by {who} (mode {stat.S_IMODE(st.st_mode):03o}; chmod 700 it)"
  return None


def _warn_once(message: str) -> None:
  if message not in _WARNED:
    _WARNED.add(message)
    warnings.warn(f"kvjax: {message}", stacklevel=3)


# ---- the key that authenticates entries ------------------------------------------------------


def key_file() -> Path:
  """Where this user's secret key lives: $KVJAX_CACHE_KEY_FILE, else kvjax/cache.key under
  $XDG_CONFIG_HOME or ~/.config."""
  chosen = os.environ.get("KVJAX_CACHE_KEY_FILE", "")
  if chosen:
    return Path(chosen).expanduser()
  return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "kvjax" / "cache.key"


def signing_key() -> bytes | None:
  """This user's secret (made on first use, 0600 in a 0700 directory), or None when it
  cannot be kept safely (then `private_dir` refuses every cache directory, with a warning)."""
  return _key()[0]


def _key() -> tuple[bytes | None, str | None]:
  """(the key, None), or (None, why it cannot be used); a key is read once per process."""
  path = str(key_file())
  if path not in _KEYS:
    key, why = _load_or_make_key(Path(path))
    if key is None:
      return None, why
    _KEYS[path] = key
  return _KEYS[path], None


def _load_or_make_key(path: Path) -> tuple[bytes | None, str | None]:
  try:
    return _read_key(path), None
  except FileNotFoundError:
    reason = None
  except (OSError, ValueError) as err:
    reason = str(err)
  if reason is None:
    try:
      path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
      parent = unsafe_reason(path.parent)
      if parent is not None:
        raise ValueError(f"its directory is unsafe: {parent}")
      # Written whole beside it, then linked in: of two processes making the key at once,
      # one wins and the other reads the winner's complete key.
      staging = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
      fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
      try:
        with os.fdopen(fd, "wb") as f:
          f.write(secrets.token_bytes(_KEY_BYTES))
          f.flush()
          os.fsync(f.fileno())
        try:
          os.link(staging, path)
        except FileExistsError:
          pass
      finally:
        staging.unlink(missing_ok=True)
      return _read_key(path), None
    except (OSError, ValueError) as err:
      reason = getattr(err, "strerror", None) or str(err)
  return None, reason


def _read_key(path: Path) -> bytes:
  fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
  with os.fdopen(fd, "rb") as f:
    st = os.fstat(f.fileno())
    if st.st_uid != os.getuid():
      raise ValueError(f"it belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
      raise ValueError(f"others may read or write it (mode {stat.S_IMODE(st.st_mode):03o})")
    key = f.read(_KEY_BYTES + 1)
  if len(key) != _KEY_BYTES:
    raise ValueError(f"it holds {len(key)} bytes, not {_KEY_BYTES}")
  return key


def tag(purpose: str, *pieces: bytes) -> str | None:
  """Hex HMAC-SHA256 of `pieces` (each length-prefixed, so no two splits collide) for
  `purpose` (e.g. 'executable', 'weights'); None when no key can be kept."""
  key = signing_key()
  if key is None:
    return None
  mac = hmac.new(key, purpose.encode() + b"\0", hashlib.sha256)
  for piece in pieces:
    mac.update(len(piece).to_bytes(8, "little"))
    mac.update(piece)
  return mac.hexdigest()


def verify(expected: object, purpose: str, *pieces: bytes) -> bool:
  """True when `expected` is the tag of `pieces` for `purpose` under this user's key."""
  actual = tag(purpose, *pieces)
  return (
      actual is not None
      and isinstance(expected, str)
      and hmac.compare_digest(actual.encode(), expected.encode())
  )
