"""Fixed-shape eviction: lowest-importance groups leave until each sequence meets its budget.

Block eviction (group_size == page_size) removes whole pages from the page table and
moves no K/V data. Token eviction (group_size == 1) compacts the kept tokens, in order,
into the sequence's leading pages with one gather and one scatter, then frees the
trailing pages. Both select the groups to drop with `lowest` (a 32-step radix select,
not a sort: sorting each sequence's slots dominated an eviction event on CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvjax.cache.paged_cache import PagedKVCache, Status, logical_view, one_device, valid_mask
from kvjax.cache.pages import compact_index, locate, pages_for
from pallas_kernels.group_importance import group_importance


def protection_mask(cache: PagedKVCache) -> Bool[Array, "L B H N"]:
  """Slots eviction must not touch: sink, recent window, caller-marked and empty slots."""
  one_device(cache, "protection_mask")
  cfg = cache.config
  idx = jnp.arange(cfg.max_tokens)
  length = cache.length[..., None]
  return (
      (idx < cfg.sink)
      | (idx >= length - cfg.recent)
      | ~valid_mask(cache)
      | logical_view(cache, cache.slot("protected"))
  )


def sort_keys(x: Float[Array, "..."]) -> Array:
  """uint32 keys whose order is jnp.sort's order of float32 x: -inf < finite < inf < NaN,
  -0.0 == 0.0 (jax's own sort key: zeros and NaNs made canonical, sign-magnitude flipped)."""
  x = x.astype(jnp.float32)
  x = jnp.where(x == 0, jnp.float32(0), x)
  x = jnp.where(jnp.isnan(x), jnp.float32(jnp.nan), x)
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  negative = (bits >> 31) == 1
  return jnp.where(negative, ~bits, bits | jnp.uint32(1 << 31))


def lowest(x: Float[Array, "... M"], k: Int[Array, "..."] | int) -> Bool[Array, "... M"]:
  """The `k` smallest entries of each row of x (k broadcast to x.shape[:-1], clipped to
  [0, M]), in jnp.sort's order with ties to the earlier index: exactly what the first k of
  a stable argsort pick, found by a binary search for the k-th smallest key (32 passes of
  compare-and-count) instead of a sort."""
  x, k = jnp.asarray(x), jnp.asarray(k)
  if x.ndim < 1:
    raise ValueError(f"x must have a last axis to choose along, got shape {x.shape}")
  try:
    k = jnp.broadcast_to(k.astype(jnp.int32), x.shape[:-1])[..., None]
  except ValueError:
    raise ValueError(
        f"k of shape {k.shape} does not broadcast to x's rows {x.shape[:-1]}"
    ) from None
  keys = sort_keys(x)

  def narrow(_, bounds):  # smallest key t with count(keys <= t) >= k lies in [lo, hi]
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    enough = (keys <= mid).sum(-1, keepdims=True) >= k
    return jnp.where(enough, lo, mid + 1), jnp.where(enough, mid, hi)

  full = jnp.full(k.shape, 0xFFFFFFFF, jnp.uint32)
  kth, _ = jax.lax.fori_loop(0, 32, narrow, (jnp.zeros(k.shape, jnp.uint32), full))
  below = keys < kth
  tied = keys == kth
  return below | (tied & (jnp.cumsum(tied, -1) <= k - below.sum(-1, keepdims=True)))


def evict(
    cache: PagedKVCache,
    scores: Float[Array, "L B H N"],
    budget: int | Int[Array, "..."] | None = None,
    threshold: int | Int[Array, "..."] | None = None,
    *,
    impl: str = "auto",
) -> PagedKVCache:
  """Evicts the lowest-importance groups of every sequence longer than the threshold.

  Args:
    cache: the cache; sequences with length > config.threshold shrink to <= budget.
    scores: per-slot scores in logical order [L, B, H, N] (N = max_tokens), e.g. a
      policy's `scores(cache, key)`. Higher = more important.
    budget: tokens to keep, broadcastable to [L, B, H] (per-layer or per-head
      budgets); defaults to config.budget.
    threshold: evict sequences longer than this, broadcastable to [L, B, H]; defaults to
      `budget + config.margin`.
    impl: the group-importance kernel ("auto", "pallas" or "ref").
  """
  one_device(cache, "evict")
  cfg = cache.config
  if not cfg.evicts:
    return cache
  n = cfg.max_tokens
  scores = jnp.asarray(scores)
  if scores.shape != (*cache.length.shape, n):
    raise ValueError(
        f"scores must be [L, B, H, N] = {(*cache.length.shape, n)}, " f"got {scores.shape}"
    )
  budget = jnp.broadcast_to(
      jnp.asarray(cfg.budget if budget is None else budget, jnp.int32), cache.length.shape
  )
  if threshold is None:
    threshold = budget + cfg.margin
  needs = cache.length > threshold  # [L, B, H]

  def run(cache):
    g = cfg.group_size
    protected = protection_mask(cache)
    importance = group_importance(scores, g, protected, cfg.group_reduce, impl=impl)
    guarded = protected.reshape(*importance.shape, g).any(-1)  # groups that never go
    # A NaN or -inf score says nothing for its token: those groups go first (and the host
    # hears of it), +inf ones last; guarded groups rank after everything (NaN sorts last).
    nonfinite = ~guarded & ~jnp.isfinite(importance) & needs[..., None]
    rank = jnp.where(jnp.isnan(importance), -jnp.inf, importance)
    rank = jnp.where(guarded, jnp.nan, rank)
    n_evict = jnp.where(needs, pages_for(cache.length - budget, g), 0)  # groups, [L, B, H]
    evicted = lowest(rank, n_evict) & ~guarded
    short = (evicted.sum(-1) < n_evict).any()  # protected tokens alone pass the budget
    apply = _evict_pages if g > 1 else _evict_tokens
    cache = apply(cache, evicted)
    cache = cache.raise_status(short, Status.OVER_BUDGET)
    return cache.raise_status(nonfinite.any(), Status.NONFINITE_SCORES)

  return jax.lax.cond(needs.any(), run, lambda c: c, cache)


def _evict_pages(cache: PagedKVCache, evicted: Bool[Array, "L B H M"]) -> PagedKVCache:
  return cache.freed(*cache.pages.drop(evicted, cache.config.page_size))


def _evict_tokens(cache: PagedKVCache, evicted: Bool[Array, "L B H N"]) -> PagedKVCache:
  ps = cache.config.page_size
  keep = ~evicted & valid_mask(cache)
  # Kept tokens move to the front, in order; destinations are never after their sources,
  # and the gather reads the old pool, so compaction in place is safe.
  new_slot = compact_index(keep)  # [L, B, H, N]
  new_length = keep.sum(-1)
  src_page, src_off = cache.pages.slots(ps)
  dst_page, dst_off = locate(cache.page_table, new_slot, ps)
  dst_page = jnp.where(keep, dst_page, cache.num_pages)
  src_off = jnp.broadcast_to(src_off, src_page.shape)

  def move(x):
    return x.at[dst_page, dst_off].set(x[src_page, src_off], mode="drop")

  cache = cache.replace(
      k_pages=jax.tree.map(move, cache.k_pages),  # codes and scales alike
      v_pages=jax.tree.map(move, cache.v_pages),
      slots={name: move(x) for name, x in cache.slots.items()},
  )
  return _shorten(cache, new_length)


def _shorten(cache: PagedKVCache, length: Int[Array, "L B H"]) -> PagedKVCache:
  """Every sequence cut to `length` (<= its own): the slots left behind reset to empty (no
  stale state at a slot a later token takes), the pages past it freed."""
  idx = jnp.arange(cache.config.max_tokens)
  stale = (idx >= length[..., None]) & (idx < cache.length[..., None])
  page, offset = cache.pages.slots(cache.config.page_size)
  page = jnp.where(stale, page, cache.num_pages)
  offset = jnp.broadcast_to(offset, page.shape)
  cache = cache.replace(
      slots={
          spec.name: cache.slots[spec.name].at[page, offset].set(spec.empty, mode="drop")
          for spec in cache.slot_specs
      }
  )
  return cache.freed(*cache.pages.cut(length, cache.config.page_size))


def truncate(cache: PagedKVCache, length: Int[Array, "L B H"]) -> PagedKVCache:
  """Drops every token of each sequence past `length` (e.g. a scratch continuation that
  scored the context): their pages go back to the pool, their slots are cleared."""
  one_device(cache, "truncate")
  return _shorten(cache, jnp.minimum(jnp.asarray(length, jnp.int32), cache.length))
