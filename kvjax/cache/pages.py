"""Pages: the page table of a paged KV cache and every operation of its allocator.

  table       [L, B, H, M]  logical page -> physical page; NULL_PAGE (0) when unused
  length      [L, B, H]     live tokens per sequence (layer, row, kv head)
  free_pages  [P]           a stack of free pages: the first `num_free` are free, the top
                            at num_free - 1; low ids are popped first
  status      []            `kvjax.cache.paged_cache.Status` bits raised inside jit

A sequence owns exactly its first `pages_for(length)` table entries; the others point at
the null page, which keeps every gather in range (its contents are masked by `length`).
Pages are not shared between sequences.

Inside jit: `allocate` (append), `free` (eviction, truncation), `drop` (block eviction),
`cut` (a shorter length), `release` / `adopt` (a row's sequences given back, or taken on
from another cache: continuous batching), `window` / `unwindow` (a view of some of each sequence's pages, to
append to for a while), and the coordinates of logical slots (`slots`, `locate`,
`token_slots`). On the host: `live`, `packed_table`, `free_stack`, `grown_free_stacks`
and `compact_plan`, which re-lay a pool out. What lives in the pages (K/V and the per-slot
arrays) is the cache's: these functions return page ids, and the cache gathers or resets
its arrays at them, so a new page format changes the cache, never this arithmetic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Int

NULL_PAGE = 0


def pages_for(tokens, page_size: int):
  """Pages that hold `tokens` tokens (ints, NumPy or JAX arrays): ceil(tokens / page_size)."""
  return -(-tokens // page_size)


def compact_index(keep: Bool[Array, "... X"]) -> Int[Array, "... X"]:
  """New index of each kept element when the kept ones move to the front, in order; dropped
  elements map to X (out of range, so scatters with mode='drop' skip them)."""
  return jnp.where(keep, jnp.cumsum(keep, axis=-1) - 1, keep.shape[-1])


def whole_pages(tokens, page_size: int):
  """`tokens` rounded up to whole pages: the tokens `pages_for(tokens)` pages hold."""
  return pages_for(tokens, page_size) * page_size


@struct.dataclass
class PageTable:
  """Which physical pages each sequence owns, and the allocator's state."""

  table: Int[Array, "L B H M"]  # logical page -> physical page; 0 (null) when unused
  length: Int[Array, "L B H"]  # live tokens per sequence
  free_pages: Int[Array, " P"]  # stack of free pages; the first num_free are free
  num_free: Int[Array, ""]
  status: Int[Array, ""]  # bit set of `Status` flags raised inside jit

  @classmethod
  def empty(cls, table_shape: tuple[int, ...], num_pages: int) -> "PageTable":
    """No page owned; every page but the null one free, low ids popped first."""
    return cls(
        table=jnp.full(table_shape, NULL_PAGE, jnp.int32),
        length=jnp.zeros(table_shape[:-1], jnp.int32),
        free_pages=jnp.concatenate(
            [jnp.arange(num_pages - 1, 0, -1, dtype=jnp.int32), jnp.zeros((1,), jnp.int32)]
        ),
        num_free=jnp.array(num_pages - 1, jnp.int32),
        status=jnp.array(0, jnp.int32),
    )

  @classmethod
  def packed(cls, table, length, num_pages: int, num_live: int, status) -> "PageTable":
    """The table of a pool whose live pages are 1..num_live (`packed_table`), the rest free."""
    return cls(
        table=jnp.asarray(table),
        length=jnp.asarray(length),
        free_pages=jnp.asarray(free_stack(num_pages, num_live)),
        num_free=jnp.asarray(np.int32(num_pages - 1 - num_live)),
        status=jnp.asarray(status),
    )

  def held(self, page_size: int) -> Int[Array, "L B H"]:
    """Pages each sequence holds."""
    return pages_for(self.length, page_size)

  # ---- in jit --------------------------------------------------------------------------

  def allocate(
      self, layer, new_length: Int[Array, "B H"], page_size: int, max_tokens: int
  ) -> tuple["PageTable", Bool[Array, ""]]:
    """Pops pages so that layer `layer` holds `new_length` tokens per sequence, and sets
    those lengths; all or nothing: when the pool is short of pages or a sequence would pass
    `max_tokens`, the table is unchanged and `fits` is False (the caller records why)."""
    table_BxHxM = self.table[layer]
    num_pages = self.free_pages.shape[0]
    cur = pages_for(self.length[layer], page_size)  # [B, H] pages held
    need = pages_for(new_length, page_size) - cur  # [B, H] pages to add (>= 0)
    total = need.sum()
    fits = (total <= self.num_free) & (new_length <= max_tokens).all()
    max_new = table_BxHxM.shape[-1]
    j = jnp.arange(max_new)  # candidate new page index per sequence
    rank = (jnp.cumsum(need.reshape(-1)) - need.reshape(-1)).reshape(need.shape)[..., None] + j
    valid = (j < need[..., None]) & fits
    page = self.free_pages[jnp.clip(self.num_free - 1 - rank, 0, num_pages - 1)]
    slot = jnp.where(valid, cur[..., None] + j, max_new)  # out of range -> dropped
    table_BxHxM = jax.vmap(jax.vmap(lambda t, s, p: t.at[s].set(p, mode="drop")))(
        table_BxHxM, slot, page
    )
    length = self.length[layer]
    return (
        self.replace(
            table=self.table.at[layer].set(table_BxHxM),
            length=self.length.at[layer].set(jnp.where(fits, new_length, length)),
            num_free=jnp.where(fits, self.num_free - total, self.num_free),
        ),
        fits,
    )

  def free(self, freed: Bool[Array, "L B H M"]) -> tuple["PageTable", Int[Array, " X"]]:
    """Pushes the pages at the table entries marked in `freed` onto the free stack and
    nulls those entries. Returns the table and the freed physical page ids, one per table
    entry (P, out of range, where nothing was freed: for scatters with mode='drop'), at
    which the cache resets what the pages held."""
    pushed, ids = self._push(self.table.reshape(-1), freed.reshape(-1))
    return pushed.replace(table=jnp.where(freed, NULL_PAGE, self.table)), ids

  def _push(self, pages: Int[Array, " X"], flag: Bool[Array, " X"]):
    """The free stack with `pages` where `flag` pushed on it, and the pushed ids (P, out of
    range, where not flagged)."""
    num_pages = self.free_pages.shape[0]
    dest = jnp.where(flag, self.num_free + jnp.cumsum(flag) - 1, num_pages)
    pushed = self.replace(
        free_pages=self.free_pages.at[dest].set(pages, mode="drop"),
        num_free=self.num_free + flag.sum(),
    )
    return pushed, jnp.where(flag, pages, num_pages)

  def cut(self, length: Int[Array, "L B H"], page_size: int):
    """Every sequence cut back to `length` tokens (at most its own): the pages past it
    freed. Returns (table, freed page ids) as `free` does."""
    length = jnp.minimum(length, self.length)
    page_idx = jnp.arange(self.table.shape[-1])
    freed = (page_idx >= pages_for(length, page_size)[..., None]) & (
        page_idx < self.held(page_size)[..., None]
    )
    pages, ids = self.free(freed)
    return pages.replace(length=length), ids

  def drop(self, evicted: Bool[Array, "L B H M"], page_size: int):
    """Block eviction: the `evicted` table entries' pages freed, the kept entries moved to
    the front of each sequence's table, in order; no page's contents move. Returns (table,
    freed page ids) as `free` does."""
    pages, ids = self.free(evicted)
    m = self.table.shape[-1]
    keep = ~evicted
    table = jax.vmap(lambda t, i: jnp.full_like(t, NULL_PAGE).at[i].set(t, mode="drop"))(
        self.table.reshape(-1, m), compact_index(keep).reshape(-1, m)
    ).reshape(self.table.shape)
    length = self.length - evicted.sum(-1) * page_size
    return pages.replace(table=table, length=length), ids

  def release(self, row, page_size: int):
    """Every sequence of row `row` (traced) gives all its pages back and holds no token (a
    finished request's slot). Returns (table, freed page ids [L * H * M]) as `free` does.
    Only the row's entries are read: a release costs one row, not the batch."""
    held = pages_for(self.length[:, row], page_size)  # [L, H]
    owned = jnp.arange(self.table.shape[-1]) < held[..., None]  # [L, H, M]
    pushed, ids = self._push(self.table[:, row].reshape(-1), owned.reshape(-1))
    released = pushed.replace(
        table=self.table.at[:, row].set(NULL_PAGE), length=self.length.at[:, row].set(0)
    )
    return released, ids

  def adopt(
      self, row, length: Int[Array, "L H"], page_size: int, max_tokens: int
  ) -> tuple["PageTable", Int[Array, "L H M"], Bool[Array, ""]]:
    """Row `row` (which must hold nothing: `release` it first) takes fresh pages for
    sequences of `length` tokens (one per layer and kv head), e.g. a request prefilled in a
    cache of its own, whose pages the caller then copies in. All or nothing: when the pool
    is short of pages or a sequence would pass `max_tokens`, the table is unchanged and
    `fits` is False. Returns (table, the physical page of each of the row's table entries
    [L, H, M], P (out of range, for scatters with mode='drop') where it takes none, fits)."""
    num_pages, m = self.free_pages.shape[0], self.table.shape[-1]
    need = pages_for(length, page_size)  # [L, H]
    total = need.sum()
    fits = (total <= self.num_free) & (length <= max_tokens).all()
    j = jnp.arange(m)
    rank = (jnp.cumsum(need.reshape(-1)) - need.reshape(-1)).reshape(need.shape)[..., None] + j
    taken = (j < need[..., None]) & fits  # [L, H, M]
    page = self.free_pages[jnp.clip(self.num_free - 1 - rank, 0, num_pages - 1)]
    page = jnp.where(taken, page, num_pages)
    table = self.table.at[:, row].set(jnp.where(taken, page, NULL_PAGE))
    return (
        self.replace(
            table=jnp.where(fits, table, self.table),
            length=self.length.at[:, row].set(jnp.where(fits, length, self.length[:, row])),
            num_free=jnp.where(fits, self.num_free - total, self.num_free),
        ),
        page,
        fits,
    )

  def window(
      self, entries: Int[Array, "#L E"], length: Int[Array, "L B H"], width: int
  ) -> "PageTable":
    """A table of `width` entries in which every sequence owns only its logical pages
    `entries` (the same for every sequence of a layer, [E] or per layer [L, E], in that
    order; an entry a sequence does not own, or past its table, reads as the null page),
    holding `length` tokens, which must be exactly the tokens of those pages (so a sequence
    still owns its first `pages_for(length)` entries). The pages stay where they are: a
    window shares the pool and the free stack, what is appended to it allocates as usual,
    and `unwindow` puts this table back once that is cut away."""
    entries = jnp.asarray(entries)
    if entries.ndim == 1:
      entries = jnp.broadcast_to(entries, (self.table.shape[0], entries.shape[0]))
    index = jnp.broadcast_to(entries[:, None, None, :], (*self.table.shape[:-1], entries.shape[-1]))
    picked = jnp.take_along_axis(self.table, index, axis=-1, mode="fill", fill_value=NULL_PAGE)
    pad = [(0, 0)] * (picked.ndim - 1) + [(0, width - picked.shape[-1])]
    return self.replace(table=jnp.pad(picked, pad, constant_values=NULL_PAGE), length=length)

  def unwindow(self, window: "PageTable") -> "PageTable":
    """This table again, after `window` (a `window` of it) was cut back to its own tokens:
    the allocator's state (free stack, status) is the window's, the sequences this table's."""
    return self.replace(
        free_pages=window.free_pages, num_free=window.num_free, status=window.status
    )

  def slots(self, page_size: int, layer=None) -> tuple[Int[Array, "... N"], Int[Array, " N"]]:
    """Physical (page, offset) of every logical slot of every sequence (of one layer):
    [(L,) B, H, N] pages and [N] offsets, N = M x page_size."""
    table = self.table if layer is None else self.table[layer]
    pages = jnp.repeat(table, page_size, axis=-1)
    return pages, jnp.arange(pages.shape[-1]) % page_size


def locate(table: Int[Array, "... M"], slot: Int[Array, "... N"], page_size: int):
  """Physical (page, offset) of logical slots `slot` of the sequences of `table` (slots
  past the table read its last entry: mask them)."""
  logical = jnp.minimum(slot // page_size, table.shape[-1] - 1)
  return jnp.take_along_axis(table, logical, axis=-1), slot % page_size


def token_slots(
    table_BxHxM: Int[Array, "B H M"],
    first_slot: Int[Array, "B H"],
    num_new: Int[Array, " B"],
    t: int,
    page_size: int,
    num_pages: int,
) -> tuple[Int[Array, "B T H"], Int[Array, "B T H"]]:
  """Physical (page, offset) of the T tokens of each row that start at logical slot
  `first_slot`. Tokens t >= num_new[b] get page `num_pages`, out of range, so that
  scatters with mode="drop" skip them."""
  slot_BxHxT = first_slot[..., None] + jnp.arange(t)
  page, offset = locate(table_BxHxM, slot_BxHxT, page_size)
  live = (jnp.arange(t)[None, :] < num_new[:, None])[..., None]  # [B, T, 1]
  return jnp.where(live, page.transpose(0, 2, 1), num_pages), offset.transpose(0, 2, 1)


# ---- on the host: a pool re-laid out ------------------------------------------------------


def live(table: np.ndarray, length: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
  """The mask of table entries sequences own [..., M], and the physical pages of those
  entries in table order (each live page once: no page is shared)."""
  owned = _owned(length, page_size, table.shape[-1])
  return owned, table[owned]


def _owned(length: np.ndarray, page_size: int, max_pages: int) -> np.ndarray:
  """The table entries [..., M] each sequence owns: its first pages_for(length)."""
  return np.arange(max_pages) < pages_for(length, page_size)[..., None]


def packed_table(owned: np.ndarray) -> np.ndarray:
  """The page table of a pool whose live pages are 1..n in table order (`live`)."""
  table = np.full(owned.shape, NULL_PAGE, np.int32)
  table[owned] = np.arange(1, owned.sum() + 1, dtype=np.int32)
  return table


def free_stack(num_pages: int, num_live: int) -> np.ndarray:
  """The free stack of a pool whose pages 1..num_live are live: the rest, low ids popped
  first (the stack top is at num_free - 1, as `PageTable.empty` lays it out)."""
  free = np.zeros(num_pages, np.int32)
  free[: num_pages - 1 - num_live] = np.arange(num_pages - 1, num_live, -1)
  return free


def grown_free_stacks(free: np.ndarray, num_free: np.ndarray, extra: int) -> np.ndarray:
  """Free stacks [G, P + extra] of pools [G] of P pages that gain `extra` pages (ids P..),
  pushed under the pages already free so that those are still popped first."""
  g, p = free.shape
  grown = np.zeros((g, p + extra), np.int32)
  for i, n in enumerate(num_free):
    grown[i, :n] = free[i, :n]
    grown[i, n : n + extra] = np.arange(p + extra - 1, p - 1, -1)
  return grown


def compact_plan(
    table: np.ndarray, length: np.ndarray, page_size: int, reserve: int, size=lambda need: need
):
  """How pools [G] (tables [G, L, b, h, M], lengths [G, L, b, h]) shrink to their live pages
  plus room for `reserve` more tokens per sequence, one size for all: `size(need)` pages
  besides the null one (at least the largest need; by default exactly it). Returns
  (num_pages, live [G], gather [G, num_pages]: the old page of each new page, the null page
  first, then the live pages in table order; packed tables; free stacks)."""
  owned = _owned(length, page_size, table.shape[-1])
  live_pages = owned.sum(axis=(1, 2, 3, 4))  # [G]
  held = owned.sum(-1)
  headroom = (pages_for(length + reserve, page_size) - held).sum(axis=(1, 2, 3))  # [G]
  need = int((live_pages + headroom).max())
  num_pages = 1 + int(size(need))
  if num_pages - 1 < need:
    raise ValueError(f"a compacted pool of {num_pages - 1} pages cannot hold the {need} needed")
  gather = np.full((len(live_pages), num_pages), NULL_PAGE, np.int32)
  packed = np.zeros_like(table)
  free = np.zeros((len(live_pages), num_pages), np.int32)
  for g in range(len(live_pages)):
    gather[g, 1 : 1 + live_pages[g]] = table[g][owned[g]]
    packed[g] = packed_table(owned[g])
    free[g] = free_stack(num_pages, live_pages[g])
  return num_pages, live_pages, gather, packed, free
