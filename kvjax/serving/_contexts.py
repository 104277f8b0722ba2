"""Compressed contexts kept across requests (context caching), scoped per tenant.

A context is a document read and compressed once (kvzip or any policy that compresses a
context once), saved in kvjax's state format (`kvjax.save_state`: only its live pages, the
model's fingerprint, a digest), with a record of what it keeps beside it:

    ROOT/<model>/<tenant>/<id>/        the state
    ROOT/<model>/<tenant>/<id>.json    its record (`Context`): name, sizes, created, expires

`<model>` is a digest of the model's weights and tokenizer: servers of one model share their
contexts (replicas over one directory), a server of another never sees, and so never
removes, them. A request that names a context continues from a copy: the question is
appended (`extend`) and the request decodes in the batch.

Scope: the tenant that made it. Another tenant's id is looked up in that tenant's directory
only, so it is answered exactly as an unknown id (not found); ids are 128 random bits.
Lifetime: a time to live (an expired context is removed when it is next seen and never
counted), an update of it, an explicit delete. A context whose files cannot be read is an
error, not a deletion: only expiry and delete remove one. A quota per tenant bounds the
bytes its live contexts take on disk, checked before the work on what the document will
hold and again when it is saved.

Processes: every change of a tenant's contexts (save, update, delete, the removal of expired
ones) holds the tenant directory's lock (`kvjax_store.files.locked`, an `flock`), so replicas
over one file system agree on its quota and never see half a context: a state without its
record is invisible, and one a killed save left is removed under the lock. Directories are
private (0700).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import secrets
import shutil
import time
from pathlib import Path

from kvjax.fingerprint import model_fingerprint
from kvjax.persistence import load_state, save_state, tokenizer_fingerprint
from kvjax.runtime.generation import held_stats
from kvjax.seam import ModelShape
from kvjax_store.cache_dir import unsafe_reason
from kvjax_store.files import locked, make_dirs, write_text

_ID = re.compile(r"ctx-[0-9a-f]{32}")
_TENANT = re.compile(r"[0-9a-z]{1,64}")
NAME_MAX = 256  # characters of a display name


class QuotaExceeded(RuntimeError):
  """The tenant's contexts would take more bytes than its quota."""


@dataclasses.dataclass(frozen=True)
class Context:
  """A stored context's record: what it keeps, as a reader can check it against the full
  cache, and its lifetime (seconds since the epoch)."""

  id: str
  name: str | None  # the client's display name
  model: str  # the served model's name
  policy: str  # how it was compressed ("kvzip, budget 0.25")
  document_tokens: int  # tokens read: the document and the chat template's opening
  # K/V entries kept as a share of `document_tokens`, the mean over layers and kv heads.
  kept_share: float
  kv_bytes: int  # K/V bytes it holds
  full_kv_bytes: int  # what the full cache holds for the same tokens
  disk_bytes: int  # on disk, counted against the tenant's quota
  created: float
  expires: float


def check_ttl(ttl, what: str = "ttl") -> float:
  """`ttl` as seconds to live: a finite number > 0 (an infinite one would never expire)."""
  if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
    raise TypeError(f"{what} must be a number of seconds, got {ttl!r}")
  if not (math.isfinite(ttl) and ttl > 0):
    raise ValueError(f"{what} must be a finite number of seconds > 0, got {ttl!r}")
  return float(ttl)


def check_name(name) -> str | None:
  """A display name: None, or a string of at most `NAME_MAX` printable characters."""
  if name is None:
    return None
  if not isinstance(name, str):
    raise TypeError(f"name must be a string, got {type(name).__name__}")
  if len(name) > NAME_MAX or not name.isprintable():
    raise ValueError(f"name must be at most {NAME_MAX} printable characters")
  return name


class ContextStore:
  """Contexts under `root` (made private), each tenant's in its own directory; `ttl`
  seconds to live by default; `quota` bytes per tenant; `model_name` in each record."""

  def __init__(
      self, root: str | Path, model, tokenizer, *, ttl: float, quota: int, model_name="model"
  ):
    self.ttl = check_ttl(ttl, "the contexts' ttl")
    if isinstance(quota, bool) or not isinstance(quota, int) or quota < 0:
      raise ValueError(f"quota must be a number of bytes >= 0, got {quota!r}")
    root = Path(root)
    make_dirs(root)
    why = unsafe_reason(root)
    if why is not None:
      raise ValueError(f"the contexts directory {root} cannot be used: {why}")
    scope = hashlib.sha256(
        f"{model_fingerprint(model)}:{tokenizer_fingerprint(tokenizer)}".encode()
    ).hexdigest()[:16]
    self.root = root / scope  # this model's contexts
    make_dirs(self.root)
    self.model, self.tokenizer, self.quota = model, tokenizer, quota
    self.model_name = model_name

  # ---- where things are ---------------------------------------------------------------

  def _dir(self, tenant: str) -> Path:
    if not _TENANT.fullmatch(tenant):
      raise ValueError(f"bad tenant name {tenant!r}")
    return self.root / tenant

  def _path(self, tenant: str, cid: str) -> Path | None:
    """Where `cid` of `tenant` would be; None for a string that is no context id."""
    if not isinstance(cid, str) or not _ID.fullmatch(cid):
      return None
    return self._dir(tenant) / cid

  def _records(self, tenant: str) -> list[Context]:
    """The tenant's records as stored (expired ones included), oldest first."""
    directory = self._dir(tenant)
    if not directory.is_dir():
      return []
    found = []
    for path in directory.glob("ctx-*.json"):
      record = _read_record(path)
      if record is not None and path.stem == record.id:
        found.append(record)
    return sorted(found, key=lambda c: (c.created, c.id))

  def _sweep(self, tenant: str) -> list[Context]:
    """Under the tenant's lock: removes its expired contexts and what a killed save left (a
    state without a record); its live records, oldest first."""
    now, live = time.time(), []
    for record in self._records(tenant):
      if record.expires <= now:
        self._remove(tenant, record.id)
      else:
        live.append(record)
    known = {c.id for c in live}
    for path in self._dir(tenant).glob("ctx-*"):
      if path.is_dir() and _ID.fullmatch(path.name) and path.name not in known:
        shutil.rmtree(path, ignore_errors=True)
    return live

  def _remove(self, tenant: str, cid: str) -> None:
    path = self._path(tenant, cid)
    path.with_suffix(".json").unlink(missing_ok=True)  # invisible first, then its files
    shutil.rmtree(path, ignore_errors=True)

  def _locked(self, tenant: str):
    make_dirs(self._dir(tenant))
    return locked(self._dir(tenant))

  # ---- what the API does --------------------------------------------------------------

  def usage(self, tenant: str) -> int:
    """Bytes the tenant's live contexts take on disk."""
    if not self._dir(tenant).is_dir():
      return 0
    with self._locked(tenant):
      return sum(c.disk_bytes for c in self._sweep(tenant))

  def check_quota(self, tenant: str, adding: int) -> None:
    """QuotaExceeded unless the tenant's contexts have room for `adding` more bytes (what
    a document will hold, before it is read)."""
    used = self.usage(tenant)
    if used + adding > self.quota:
      raise QuotaExceeded(
          f"the tenant's contexts take {used} bytes; this one adds about {adding}; the quota "
          f"is {self.quota}: delete some (DELETE /v1/contexts/ID)"
      )

  def save(
      self,
      tenant: str,
      state,
      tokens: int,
      *,
      name: str | None = None,
      policy: str = "",
      ttl: float | None = None,
  ) -> Context:
    """Stores a compressed context `state` (one row) for `tenant`; QuotaExceeded when its
    contexts would pass the quota."""
    name = check_name(name)
    ttl = self.ttl if ttl is None else check_ttl(ttl)
    held = held_stats(state, ModelShape.of(self.model))
    with self._locked(tenant):
      live = self._sweep(tenant)
      used, adding = sum(c.disk_bytes for c in live), state.kv_bytes()
      if used + adding > self.quota:
        raise QuotaExceeded(
            f"the tenant's contexts take {used} bytes; this one adds about {adding}; the "
            f"quota is {self.quota}: delete some (DELETE /v1/contexts/ID)"
        )
      cid = f"ctx-{secrets.token_hex(16)}"
      now = time.time()
      path = save_state(self._path(tenant, cid), state, self.model, tokenizer=self.tokenizer)
      record = Context(
          id=cid,
          name=name,
          model=self.model_name,
          policy=policy,
          document_tokens=tokens,
          kept_share=held["kept_fraction"][0],
          kv_bytes=held["kv_bytes_held"],
          full_kv_bytes=held["full_kv_bytes"],
          disk_bytes=_size(path),
          created=now,
          expires=now + ttl,
      )
      _write_record(path.with_suffix(".json"), record)  # now it exists
    return record

  def get(self, tenant: str, cid: str) -> Context | None:
    """The context's record; None when `tenant` has no such live context."""
    path = self._path(tenant, cid)
    if path is None:
      return None
    record = _read_record(path.with_suffix(".json"))
    if record is None or record.id != cid:
      return None
    if record.expires <= time.time():
      with self._locked(tenant):
        self._sweep(tenant)
      return None
    return record

  def list(
      self, tenant: str, *, after: str | None = None, limit: int = 20
  ) -> tuple[list[Context], bool]:
    """The tenant's live contexts, oldest first, `limit` of them after the id `after`
    (None: from the first); and whether more follow."""
    if not self._dir(tenant).is_dir():
      return [], False
    with self._locked(tenant):
      live = self._sweep(tenant)
    if after is not None:
      ids = [c.id for c in live]
      live = live[ids.index(after) + 1 :] if after in ids else []
    return live[:limit], len(live) > limit

  _KEEP = object()

  def update(
      self, tenant: str, cid: str, *, ttl: float | None = None, name=_KEEP
  ) -> Context | None:
    """The context with a new lifetime (`ttl` seconds from now) or display name; None when
    `tenant` has no such live context."""
    ttl = None if ttl is None else check_ttl(ttl)
    name = name if name is self._KEEP else check_name(name)
    path = self._path(tenant, cid)
    if path is None or not self._dir(tenant).is_dir():
      return None
    with self._locked(tenant):
      record = next((c for c in self._sweep(tenant) if c.id == cid), None)
      if record is None:
        return None
      changes = {} if ttl is None else {"expires": time.time() + ttl}
      if name is not self._KEEP:
        changes["name"] = name
      record = dataclasses.replace(record, **changes)
      _write_record(path.with_suffix(".json"), record)
    return record

  def load(self, tenant: str, cid: str):
    """(the context's state, its record), or None when `tenant` has no such live context.
    Files that cannot be read raise (an error to answer, never a reason to remove them)."""
    record = self.get(tenant, cid)
    if record is None:
      return None
    state = load_state(self._path(tenant, cid), self.model, tokenizer=self.tokenizer)
    return state, record

  def delete(self, tenant: str, cid: str) -> bool:
    """Removes the context; False when `tenant` has none of that id."""
    path = self._path(tenant, cid)
    if path is None or not self._dir(tenant).is_dir():
      return False
    with self._locked(tenant):
      exists = path.with_suffix(".json").is_file()
      if exists:
        self._remove(tenant, cid)
    return exists


def _write_record(path: Path, record: Context) -> None:
  write_text(path, json.dumps(dataclasses.asdict(record)))


def _read_record(path: Path) -> Context | None:
  """A record as written (`_write_record`), or None: missing, or not one (a record is
  small; anything else in its place is not trusted)."""
  try:
    if not path.is_file() or path.is_symlink() or path.stat().st_size > 64 * 1024:
      return None
    data = json.loads(path.read_text("utf-8"))
    return Context(**{f.name: data[f.name] for f in dataclasses.fields(Context)})
  except (OSError, ValueError, KeyError, TypeError):
    return None


def _size(path: Path) -> int:
  return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file() and not p.is_symlink())
