"""Compressed contexts kept across requests (context caching), scoped per tenant.

A context is a document read and compressed once (kvzip or any policy that compresses a
context once), saved in kvjax's state format (`kvjax.save_state`: only its live pages, the
model's fingerprint, a digest) under `ROOT/<tenant>/<id>`. A request that names it continues
from a copy: the question is appended (`extend`) and the request decodes in the batch.

Scope: the tenant that made it. Another tenant's id is looked up in that tenant's directory
only, so it is answered exactly as an unknown id (not found); ids are 128 random bits.
Invalidation: a time to live, an explicit delete, and any change of model weights or
tokenizer (the saved state's fingerprints: its load is refused, the entry removed). A quota
per tenant bounds the bytes its contexts take on disk. Directories are private (0700).
"""

from __future__ import annotations

import dataclasses
import re
import secrets
import shutil
import threading
import time
from pathlib import Path

from kvjax.persistence import StateFileError, load_state, save_state, state_info
from kvjax.runtime.generation import held_stats
from kvjax.seam import ModelShape
from kvjax_store.cache_dir import unsafe_reason
from kvjax_store.files import make_dirs

_ID = re.compile(r"ctx-[0-9a-f]{32}")
_TENANT = re.compile(r"[0-9a-z]{1,64}")


class QuotaExceeded(RuntimeError):
  """The tenant's contexts would take more bytes than its quota."""


@dataclasses.dataclass(frozen=True)
class Context:
  """What a stored context keeps, as a reader can check it against the full cache."""

  id: str
  document_tokens: int  # tokens read: the document and the chat template's opening
  # K/V entries kept as a share of `document_tokens`, the mean over layers and kv heads.
  kept_share: float
  kv_bytes: int  # K/V bytes it holds
  full_kv_bytes: int  # what the full cache holds for the same tokens
  disk_bytes: int  # on disk, counted against the tenant's quota
  created: float
  expires: float


class ContextStore:
  """Contexts under `root` (made private), each tenant's in its own directory; `ttl`
  seconds to live; `quota` bytes per tenant."""

  def __init__(self, root: str | Path, model, tokenizer, *, ttl: float, quota: int):
    self.root = Path(root)
    make_dirs(self.root)
    why = unsafe_reason(self.root)
    if why is not None:
      raise ValueError(f"the contexts directory {self.root} cannot be used: {why}")
    self.model, self.tokenizer, self.ttl, self.quota = model, tokenizer, ttl, quota
    self._lock = threading.Lock()  # one tenant's quota is checked and spent at once

  def _dir(self, tenant: str) -> Path:
    if not _TENANT.fullmatch(tenant):
      raise ValueError(f"bad tenant name {tenant!r}")
    return self.root / tenant

  def _path(self, tenant: str, cid: str) -> Path | None:
    """Where `cid` of `tenant` would be; None for a string that is no context id."""
    if not isinstance(cid, str) or not _ID.fullmatch(cid):
      return None
    return self._dir(tenant) / cid

  def usage(self, tenant: str) -> int:
    """Bytes the tenant's contexts take on disk."""
    directory = self._dir(tenant)
    return _size(directory) if directory.is_dir() else 0

  def save(self, tenant: str, state, tokens: int) -> Context:
    """Stores a compressed context `state` (one row) for `tenant`; QuotaExceeded when its
    contexts would pass the quota."""
    with self._lock:
      used, adding = self.usage(tenant), state.kv_bytes()
      if used + adding > self.quota:
        raise QuotaExceeded(
            f"the tenant's contexts take {used} bytes; this one adds about {adding}; the quota "
            f"is {self.quota}: delete some (DELETE /v1/contexts/ID)"
        )
      make_dirs(self._dir(tenant))
      cid = f"ctx-{secrets.token_hex(16)}"
      now = time.time()
      path = save_state(
          self._path(tenant, cid),
          state,
          self.model,
          tokenizer=self.tokenizer,
          info={"created": now, "expires": now + self.ttl, "tokens": tokens},
      )
    held = held_stats(state, ModelShape.of(self.model))
    return Context(
        id=cid,
        document_tokens=tokens,
        kept_share=held["kept_fraction"][0],
        kv_bytes=held["kv_bytes_held"],
        full_kv_bytes=held["full_kv_bytes"],
        disk_bytes=_size(path),
        created=now,
        expires=now + self.ttl,
    )

  def load(self, tenant: str, cid: str):
    """The context's state, or None when `tenant` has no such live context (unknown, another
    tenant's, expired, or made for other weights: the last two are removed)."""
    path = self._path(tenant, cid)
    if path is None or not path.is_dir():
      return None
    try:
      info = state_info(path).get("info") or {}
      if float(info.get("expires", 0)) < time.time():
        raise StateFileError("expired")
      return load_state(path, self.model, tokenizer=self.tokenizer)
    except (StateFileError, ValueError, OSError):
      shutil.rmtree(path, ignore_errors=True)
      return None

  def delete(self, tenant: str, cid: str) -> bool:
    """Removes the context; False when `tenant` has none of that id."""
    path = self._path(tenant, cid)
    if path is None or not path.is_dir():
      return False
    shutil.rmtree(path, ignore_errors=True)
    return True


def _size(path: Path) -> int:
  return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file() and not p.is_symlink())
