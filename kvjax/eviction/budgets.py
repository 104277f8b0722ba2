"""Budgets: how many tokens each sequence keeps and how an eviction event or a context
compressed once gets there. Per-layer budgets (uniform or pyramid), a budget shared across
heads (AdaKV per layer, KVzip's global ranking, a score threshold), fair eviction over
marked segments, and the `EvictionPlan` the compiled steps carry."""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from kvjax.cache.paged_cache import PagedKVCache, logical_view, valid_mask
from kvjax.eviction.fixed_shape import evict, lowest, protection_mask
from kvjax.eviction.sliding import full_layers
from kvjax.sharding import all_heads, any_shard, constrain, my_heads, on_shards

BUDGET_SCHEDULES = ("uniform", "pyramid")
NEVER = jnp.iinfo(jnp.int32).max // 2  # a threshold no sequence passes


class TokenScores(Protocol):
  """What eviction asks of a policy (`kvjax.policies.Policy` is one): per-slot scores at an
  eviction event, higher = keep. Frozen and hashable, so compiled steps specialise on it."""

  def scores(self, cache: PagedKVCache, key) -> Float[Array, "L B H N"]:
    ...


def layer_budgets(
    budget: int, num_layers: int, schedule: str, group: int, floor: int
) -> np.ndarray:
  """Per-layer token budgets averaging `budget`: uniform, or pyramid (PyramidKV: lower
  layers keep more, linearly from 1.5x to 0.5x), multiples of `group`, at least `floor`."""
  if schedule not in BUDGET_SCHEDULES:
    raise ValueError(f"budget schedule must be one of {BUDGET_SCHEDULES}, got {schedule!r}")
  if schedule == "uniform" or num_layers == 1:
    return np.full((num_layers,), budget, np.int32)
  total = budget * num_layers
  if floor * num_layers > total:
    raise ValueError(f"budget={budget} is below the floor {floor} every layer needs")
  raw = budget * np.linspace(1.5, 0.5, num_layers)
  pinned = np.zeros(num_layers, bool)
  while True:  # pin layers below the floor, rescale the rest to what is left
    free = total - floor * pinned.sum()
    raw = np.where(pinned, floor, raw * free / raw[~pinned].sum())
    low = ~pinned & (raw < floor)
    if not low.any():
      break
    pinned |= low
  out = np.maximum(np.floor(raw / group) * group, floor).astype(np.int64)
  # Hand the rounding remainder to the lowest layers, one group at a time.
  for i in range(int((total - out.sum()) // group)):
    out[i % num_layers] += group
  return out.astype(np.int32)


HEAD_BUDGETS = ("uniform", "layer", "global")
ADAKV_FLOOR = 0.2  # with head_budget='layer', every head keeps this share of the budget


def head_budgets(
    scores: Float[Array, "L B H N"],
    protected,
    valid,
    layer_budget: Int[Array, " L"],
    sharing: str,
    *,
    threshold: float | None = None,
    floor: float = ADAKV_FLOOR,
) -> Int[Array, "L B H"]:
  """Tokens each sequence keeps (protected ones always count in) when a budget is shared:

  - 'uniform': every sequence keeps its layer's budget;
  - 'layer' (AdaKV): each layer's H x budget best tokens of a row by one ranking across its
    kv heads, after every head's own `floor` x budget best;
  - 'global' (KVzip): a row's sum-over-layers H x budget best tokens by one ranking across
    all its layers and kv heads;
  - `threshold` (budget='auto'): every token scored above it, whatever the count.
  """
  l, b, h, n = scores.shape
  keep = protected & valid
  if threshold is not None:
    return (keep | (valid & (scores > threshold))).sum(-1).astype(jnp.int32)
  layer_budget = jnp.broadcast_to(jnp.asarray(layer_budget, jnp.int32), (l,))
  if sharing == "uniform":
    return jnp.broadcast_to(layer_budget[:, None, None], (l, b, h))
  # A ranking across kv heads: on a sharded cache, over the heads of every model shard
  # (gathered once), so each shard keeps what one device would; then this shard's heads.
  local_heads = h
  scores, keep, valid = (all_heads(x, axis=2) for x in (scores, keep, valid))
  h = scores.shape[2]
  ranked = jnp.where(keep, jnp.inf, jnp.where(valid, scores, -jnp.inf))
  if sharing == "layer":
    if floor > 0:  # each head's own best `floor` share counts in first
      k = jnp.clip((floor * layer_budget).astype(jnp.int32), 1, n)[:, None, None]  # [L, 1, 1]
      ranked = jnp.where(valid & _best(ranked, k), jnp.inf, ranked)
    kept = _best(ranked.reshape(l, b, h * n), (layer_budget * h)[:, None]).reshape(l, b, h, n)
  elif sharing == "global":
    per_row = ranked.transpose(1, 0, 2, 3).reshape(b, l * h * n)
    kept = _best(per_row, layer_budget.sum() * h).reshape(b, l, h, n).transpose(1, 0, 2, 3)
  else:
    raise ValueError(f"sharing must be one of {HEAD_BUDGETS}, got {sharing!r}")
  counts = ((kept | keep) & valid).sum(-1).astype(jnp.int32)
  return my_heads(counts, axis=2, local=local_heads)


def _best(x: Float[Array, "... M"], k) -> Bool[Array, "... M"]:
  """The `k` largest entries of each row of x (k broadcast to x.shape[:-1]); ties go to
  the earlier index, so exactly k are chosen and a tie never passes the budget."""
  return lowest(-x, k)


def fair_scores(scores: Float[Array, "L B H N"], segment, valid) -> Float[Array, "L B H N"]:
  """Replaces scores by their quantile within the token's segment, so that evicting the
  lowest takes the same fraction of every segment (segment 0 is the unmarked rest)."""
  n = scores.shape[-1]
  empty = jnp.iinfo(jnp.int32).max  # empty slots form their own, last, segment
  seg = jnp.where(valid, segment, empty)
  by_score = jnp.argsort(scores, axis=-1, stable=True)
  by_segment = jnp.argsort(jnp.take_along_axis(seg, by_score, -1), axis=-1, stable=True)
  order = jnp.take_along_axis(by_score, by_segment, -1)  # slots sorted by (segment, score)
  run = jnp.take_along_axis(seg, order, -1)
  pos = jnp.broadcast_to(jnp.arange(n), run.shape)
  first = jnp.concatenate([jnp.ones_like(run[..., :1], bool), run[..., 1:] != run[..., :-1]], -1)
  last = jnp.concatenate([run[..., 1:] != run[..., :-1], jnp.ones_like(run[..., :1], bool)], -1)
  start = jax.lax.cummax(jnp.where(first, pos, 0), axis=run.ndim - 1)
  end = jax.lax.cummin(jnp.where(last, pos, n), axis=run.ndim - 1, reverse=True)
  quantile = (pos - start + 1).astype(jnp.float32) / (end - start + 1).astype(jnp.float32)
  return jnp.take_along_axis(quantile, jnp.argsort(order, axis=-1), -1)


@dataclasses.dataclass(frozen=True)
class EvictionPlan:
  """How a cache is kept within budget: the policy, per-layer budgets, per-head split and
  fair eviction over marked segments. Static (hashable) so jitted steps specialise on it.

  `evict=False` keeps the policy observing (its scores update) but never evicts: the cost
  benchmark times eviction as the difference against such a plan."""

  policy: TokenScores
  layer_budget: tuple[int, ...]
  per_head: bool = False
  fair: bool = False
  evict: bool = True
  impl: str = "auto"  # group-importance kernel

  def apply(self, cache: PagedKVCache, key, row_budget=None) -> PagedKVCache:
    """Evicts where a sequence (or, per head, a layer) passed its threshold. `row_budget`
    ([B] int32, traced; `NEVER` for a row that keeps everything) gives every row its own
    budget on each full layer instead of the plan's (rows of a served batch, each request
    with its own); the plan's margin applies. Not with a budget shared across heads."""
    cfg = cache.config
    if not cfg.evicts or not self.evict:
      return cache
    budget = jnp.asarray(self.layer_budget, jnp.int32)  # [L]
    margin = cfg.margin
    full = full_layers(cache)  # sliding layers hold their window: no policy evicts there
    if row_budget is not None:
      if self.per_head:
        raise ValueError("row budgets are per sequence: not with a budget shared across heads")
      rows = jnp.where(full[:, None], row_budget[None, :], NEVER)[..., None]  # [L, B, 1]
      threshold = jnp.where(rows >= NEVER, NEVER, rows + margin)

      def run_rows(cache):
        scores = self.policy.scores(cache, key)
        if self.fair:
          scores = fair_scores(
              scores, logical_view(cache, cache.slot("segment")), valid_mask(cache)
          )
        return evict(cache, scores=scores, budget=rows, threshold=threshold, impl=self.impl)

      return jax.lax.cond((cache.length > threshold).any(), run_rows, lambda c: c, cache)
    if self.per_head:
      length = all_heads(cache.length, axis=2)  # a sharded cache: every kv head of the row
      needs = length.sum(-1) > length.shape[2] * (budget[:, None] + margin)  # [L, B]
      needs &= full[:, None]
    else:
      needs = (cache.length > budget[:, None, None] + margin) & full[:, None, None]

    def run(cache):
      scores = self.policy.scores(cache, key)
      valid = valid_mask(cache)
      if self.fair:
        scores = fair_scores(scores, logical_view(cache, cache.slot("segment")), valid)
      if not self.per_head:
        threshold = jnp.where(full, budget + margin, NEVER)[:, None, None]
        return evict(
            cache, scores=scores, budget=budget[:, None, None], threshold=threshold, impl=self.impl
        )
      head_budget = head_budgets(scores, protection_mask(cache), valid, budget, "layer")
      # Evict every head of a triggered layer to its share; leave the others alone.
      limit = jnp.where(needs[..., None], head_budget, NEVER)
      return evict(cache, scores=scores, budget=limit, threshold=limit, impl=self.impl)

    # Only sequences past their threshold shrink, so a shard may decide alone; but a budget
    # shared across heads gathers them in `run` (a collective), which every shard must
    # then enter together.
    trigger = any_shard(needs.any()) if self.per_head else needs.any()
    return jax.lax.cond(trigger, run, lambda c: c, cache)


@functools.partial(jax.jit, static_argnames=("policy", "sharing", "auto", "impl", "allocation"))
def evict_once(cache: PagedKVCache, threshold, key, *, policy, sharing, auto, impl, allocation):
  """Every sequence evicted to its share of the scored context (`head_budgets`),
  ranked through the learned head `allocation` when the spec has one."""

  def evict_here(cache, threshold, key):
    ranked = policy.scores(cache, key)
    if allocation is not None:
      ranked = allocation.rank(ranked)
    # Sliding layers hold their window: outside every ranking, and never evicted here.
    full = full_layers(cache)
    counts = head_budgets(
        ranked,
        protection_mask(cache),
        valid_mask(cache) & full[:, None, None, None],
        jnp.where(full, cache.config.budget, 0).astype(jnp.int32),
        sharing,
        threshold=threshold if auto else None,
    )
    counts = jnp.where(full[:, None, None], counts, NEVER)
    return evict(cache, ranked, budget=counts, threshold=counts, impl=impl)

  return constrain(on_shards(evict_here, cache, threshold, key, specs=(P(), P())))
