"""A state's pool of pages, sized and re-laid out on the host between compiled steps: grown
when a request needs more room (`fit`), compacted to what a context compressed once keeps
(`compress`, `compact`). The page arithmetic is `kvjax.cache.pages`'."""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import pages, sizing
from kvjax import sharding as shards
from kvjax.cache.paged_cache import PagedKVCache, check_status, to_host
from kvjax.eviction.budgets import evict_once
from kvjax.seam import ModelShape
from kvjax.runtime.state import State, copy


def fit(state: State, shape: ModelShape, more: int, donate: bool) -> State:
  """The state, owned by the caller's next step (copied unless `donate`), with room for
  `more` tokens per row: past the model's context is an error; a cache that keeps every
  token (the full cache, or a context compressed once) grows when it is too short: longer
  page tables, more pages (new shapes, compiled once). An evicting cache's pool, sized
  for the first request, grows to what its budgets (and its protected tokens) hold."""
  furthest = int(to_host(state.position).max()) + more
  if furthest > shape.max_context:
    raise ValueError(
        f"the state's rows reach position {furthest - more}; {more} more tokens pass the "
        f"model context {shape.max_context}"
    )
  if not donate:
    state = copy(state)
  cache, cfg = state.cache, state.cache.config
  ps = cfg.page_size
  # Per shard (one on a single device): each shard's pool serves its own sequences.
  length = shards.blocks(cache, to_host(cache.length))  # [G, L, b, h]
  num_free = np.atleast_1d(to_host(cache.pages.num_free))  # [G]
  held = pages.pages_for(length, ps)
  shard_total = lambda x: x.sum(axis=(1, 2, 3))  # noqa: E731
  eviction = state.plan.eviction
  # A sliding layer's sequence never holds more than its window's peak (`slide`).
  window = np.asarray(cfg.windows or (0,) * cache.num_layers)[:, None, None]  # [L, 1, 1]
  bounded = lambda tokens: np.where(  # noqa: E731
      window > 0, np.minimum(tokens, sizing.window_peak(window, ps, state.plan.chunk)), tokens
  )
  if eviction is not None:
    # Eviction holds a sequence at its peak (`kvjax.cache.sizing.peak_tokens`; x heads when they
    # share the layer's budget); a sequence already past it (protected tokens are never
    # evicted) may grow by a margin and a chunk before eviction brings it back.
    heads = cache.num_kv_heads if eviction.per_head else 1
    budget = np.asarray(eviction.layer_budget)[:, None, None] * heads  # [L, 1, 1]
    peak = sizing.peak_tokens(budget, cfg.margin * heads, state.plan.chunk, floor=length)
    target = bounded(np.minimum(length + more, peak))
    needed = shard_total(np.maximum(pages.pages_for(target, ps) - held, 0))
    capacity = max(cfg.max_tokens, pages.whole_pages(int(target.max()), ps))
    if (needed <= num_free).all() and capacity == cfg.max_tokens:
      return state
    return grow(state, capacity, int(np.maximum(needed - num_free, 0).max()))
  longest = int(length.max())
  capacity = cfg.max_tokens
  needed = shard_total(np.maximum(pages.pages_for(bounded(length + more), ps) - held, 0))
  if longest + more <= capacity and (needed <= num_free).all():
    return state
  room = sizing.growth_room(more, capacity)
  if longest + more > capacity:
    capacity = sizing.capacity_bucket(longest + room, ps, shape.max_context)
  needed = shard_total(
      np.maximum(pages.pages_for(bounded(np.minimum(length + room, capacity)), ps) - held, 0)
  )
  return grow(state, capacity, int(np.maximum(needed - num_free, 0).max()))


def grow(state: State, capacity: int, extra: int) -> State:
  """The state with page tables for `capacity` tokens per sequence and `extra` more free
  pages in every shard's pool (new shapes, compiled once)."""
  cache, cfg = state.cache, state.cache.config
  num_free = np.atleast_1d(to_host(cache.pages.num_free))  # [G]
  p = cache.num_pages

  axis = 0 if cache.mesh is None else 1  # the pool axis ([G, P, ...] when sharded)

  def pad(x, value):  # `extra` pages of `value` after every shard's pool
    more = jnp.full((*x.shape[:axis], extra, *x.shape[axis + 1 :]), value, x.dtype)
    return jnp.concatenate([x, more], axis=axis)

  old_free = shards.per_shard(cache, to_host(cache.pages.free_pages))  # [G, P]
  free = pages.grown_free_stacks(old_free, num_free, extra)
  table = cache.page_table
  new_cfg = dataclasses.replace(cfg, max_tokens=capacity, num_pages=p + extra)
  grown = cache.replace(
      k_pages=jax.tree.map(lambda x: pad(x, 0), cache.k_pages),  # codes and scales alike
      v_pages=jax.tree.map(lambda x: pad(x, 0), cache.v_pages),
      slots={s.name: pad(cache.slots[s.name], s.empty) for s in cache.slot_specs},
      pages=cache.pages.replace(
          table=jnp.concatenate(
              [
                  table,
                  jnp.full(
                      (*table.shape[:-1], new_cfg.max_pages - cfg.max_pages),
                      pages.NULL_PAGE,
                      jnp.int32,
                  ),
              ],
              axis=-1,
          ),
          free_pages=jnp.asarray(shards.from_per_shard(cache, free)),
          num_free=jnp.asarray(shards.from_per_shard(cache, (num_free + extra).astype(np.int32))),
      ),
      config=new_cfg,
  )
  return state.replace(cache=shards.place(grown))


def compress(state: State, reserve: int) -> State:
  """Evicts every sequence of a scored context to its share of the budget
  (`spec.head_budget`, or the tokens above `spec.threshold`), and re-lays the pool out to
  what is kept (+ `reserve`)."""
  plan = state.plan
  spec = plan.spec
  threshold = jnp.float32(spec.threshold if spec.auto else 0.0)  # traced: no recompile
  cache = evict_once(
      state.cache,
      threshold,
      jax.random.fold_in(state.key, 2),
      policy=plan.eviction.policy,
      sharing=spec.sharing,
      auto=spec.auto,
      impl=plan.impl,
      allocation=spec.allocation,
  )
  check_status(cache)
  # The context is compressed once: later tokens are kept (no observation, no eviction), so
  # the policy's state that is not per token is dropped with its memory.
  # `budget='auto'` keeps what its scores say: no budget bounds its pool.
  budget = None if spec.auto else cache.config.budget
  cache = compact(cache, reserve, budget=budget).replace(extra={})
  compressed = dataclasses.replace(plan, eviction=None)
  peak = max(int(state.peak_pages), int(cache.pages_in_use().sum()))
  return state.replace(cache=cache, plan=compressed, peak_pages=jnp.int32(peak))


def compact(cache: PagedKVCache, reserve: int, budget: int | None = None) -> PagedKVCache:
  """The cache in a pool of its live pages, plus room for `reserve` more tokens per
  sequence: evicted memory is returned, not only marked free. With a `budget` (tokens per
  sequence, kept in all), the pool has the size that budget bounds (`sizing.compacted_pages`:
  one size for every request of a plan, so its decode compiles once); without, exactly the
  need. A sharded cache compacts every shard's pool on its own; they share one size (the
  largest need)."""
  length = shards.blocks(cache, to_host(cache.length))  # [G, L, b, h]
  table = shards.blocks(cache, to_host(cache.page_table))  # [G, L, b, h, M]
  ps = cache.config.page_size
  size = lambda need: need  # noqa: E731
  if budget is not None:
    # What a shard's sequences can keep (each rounding up by under a page) + the reserve.
    sequences = int(np.prod(length.shape[1:]))
    bound = sizing.held_pages_bound(0, budget, sequences=sequences, page_size=ps, once=True)
    bound += sequences * pages.pages_for(reserve, ps)
    size = lambda need: sizing.compacted_pages(need, bound)  # noqa: E731
  # Shard g's new pool: its null page, its live pages in table order, then free pages.
  num_pages, live, gather, packed, free = pages.compact_plan(table, length, ps, reserve, size)
  used = np.arange(num_pages) <= live[:, None]  # [G, num_pages]

  def compact(x, empty):
    if cache.mesh is None:  # one pool: its live pages, then fresh free pages
      kept = x[jnp.asarray(gather[0, : 1 + live[0]])]
      fresh = jnp.full((num_pages - 1 - live[0], *x.shape[1:]), empty, x.dtype)
      return jnp.concatenate([kept, fresh])
    kept = jax.vmap(lambda pool, ids: pool[ids])(x, jnp.asarray(gather))
    mask = jnp.asarray(used.reshape(*used.shape, *([1] * (kept.ndim - 2))))
    return jnp.where(mask, kept, jnp.asarray(empty, x.dtype))

  compacted = cache.replace(
      k_pages=jax.tree.map(lambda x: compact(x, 0), cache.k_pages),
      v_pages=jax.tree.map(lambda x: compact(x, 0), cache.v_pages),
      slots={s.name: compact(cache.slots[s.name], s.empty) for s in cache.slot_specs},
      pages=cache.pages.replace(
          table=jnp.asarray(shards.unblocks(cache, packed)),
          free_pages=jnp.asarray(shards.from_per_shard(cache, free)),
          num_free=jnp.asarray(
              shards.from_per_shard(cache, (num_pages - 1 - live).astype(np.int32))
          ),
      ),
      config=dataclasses.replace(cache.config, num_pages=num_pages),
  )
  return shards.place(compacted)
