"""Rows of a batch as slots that requests come and go through (continuous batching): a row
released gives every page back to the shared pool; a request prefilled in a cache of its own
(its context compressed by its own policy) is inserted into a free row, its live pages copied
into pages the row takes from the pool. Both run inside `jit` with the row traced, so a
batch serves request after request with one compiled program per source shape.

    cache   [L, B, H, M] table over a pool of P pages: the batch (B slots)
    source  [L, Bs, H, Ms] table over its own pool: the request (row `source_row`)

Nothing of a released row can be read afterwards: its table entries point at the null page
and its lengths are 0, so every gather masks what its old pages still hold; the pages'
per-slot arrays are reset when they are freed (`PagedKVCache.freed`), as eviction does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.cache.paged_cache import PagedKVCache, Status, one_device


def release_row(cache: PagedKVCache, row) -> PagedKVCache:
  """The cache with row `row` (traced) holding nothing: its pages back in the pool."""
  one_device(cache, "release_row")
  pages, ids = cache.pages.release(row, cache.config.page_size)
  return cache.freed(pages, ids)


def check_insertable(cache: PagedKVCache, source: PagedKVCache) -> None:
  """ValueError unless `source`'s sequences can move into `cache`'s rows: the same layers,
  kv heads, head size, page size, K/V storage and sliding windows (host-side, static)."""
  one_device(cache, "insert_row")
  one_device(source, "insert_row")
  for what, ours, theirs in (
      ("num_layers", cache.num_layers, source.num_layers),
      ("num_kv_heads", cache.num_kv_heads, source.num_kv_heads),
      ("head_dim", cache.head_dim, source.head_dim),
      ("page_size", cache.config.page_size, source.config.page_size),
      ("kv_dtype", cache.kv_dtype, source.kv_dtype),
      ("windows", cache.config.windows, source.config.windows),
  ):
    if ours != theirs:
      raise ValueError(
          f"a cache with {what}={theirs!r} cannot be inserted into one with {what}={ours!r}"
      )


def insert_row(cache: PagedKVCache, row, source: PagedKVCache, source_row=0) -> PagedKVCache:
  """`cache` with row `row` (released, holding nothing) holding `source`'s row
  `source_row`: K/V, every per-slot array both caches declare (the others start empty) and
  the `extra` state per layer and row ([L, B, ...]) copied into pages taken from `cache`'s
  pool. All or nothing: when the pool is short of pages (or a sequence is longer than the
  cache's `max_tokens`) nothing changes and the cache's status says why."""
  check_insertable(cache, source)
  config, m = cache.config, cache.page_table.shape[-1]
  length = source.length[:, source_row]  # [L, H]
  pages, dest, fits = cache.pages.adopt(row, length, config.page_size, config.max_tokens)
  # Only the source's table width is copied (a request's cache is sized for its prompt, the
  # batch's rows for the longest request): the rest of the row takes no page.
  src = source.page_table[:, source_row, :, :m]  # [L, H, Ms] its pages in its own pool
  dest, src = dest[..., : src.shape[-1]].reshape(-1), src.reshape(-1)  # P (dropped) past each

  def move(ours, theirs):
    return ours.at[dest].set(theirs[src], mode="drop")

  slots = {}
  for spec in cache.slot_specs:
    if spec.name in source.slots:
      slots[spec.name] = move(cache.slots[spec.name], source.slots[spec.name])
    else:
      slots[spec.name] = cache.slots[spec.name].at[dest].set(spec.empty, mode="drop")
  extra = {}
  for name, value in cache.extra.items():
    theirs = source.extra.get(name)
    if (
        theirs is not None
        and theirs.shape[:1] + theirs.shape[2:] == value.shape[:1] + value.shape[2:]
    ):
      new = theirs[:, source_row]
    else:
      new = jnp.zeros(value.shape[:1] + value.shape[2:], value.dtype)
    extra[name] = jnp.where(fits, value.at[:, row].set(new), value)
  over = (length > config.max_tokens).any()
  inserted = cache.replace(
      k_pages=jax.tree.map(move, cache.k_pages, source.k_pages),
      v_pages=jax.tree.map(move, cache.v_pages, source.v_pages),
      slots=slots,
      pages=pages,
      extra=extra,
  )
  # `adopt` changed nothing when it did not fit, and every copy above was dropped (dest P).
  inserted = inserted.raise_status(~fits & over, Status.OVER_CAPACITY)
  return inserted.raise_status(~fits & ~over, Status.OUT_OF_PAGES)
