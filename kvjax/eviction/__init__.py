"""Eviction: what leaves a cache, in fixed shapes, inside `jit`. Policies score tokens
(`kvjax.policies`); this package decides what goes.

    fixed_shape  `evict`: the lowest-importance groups outside the protected tokens (sink,
                 recent, marked spans), as page-table edits (whole pages) or one compaction
                 (single tokens); `protection_mask`, `truncate`
    budgets      how many tokens each sequence keeps: per-layer schedules, a budget shared
                 across heads (AdaKV per layer, KVzip's global ranking, a score threshold),
                 fair eviction over marked segments, and the `EvictionPlan` compiled steps carry
    allocation   `HeadAllocation`: learned per-(layer, kv head) offsets applied before a
                 global ranking (made by `kvjax tune`)
    sliding      `slide`: a sliding-window layer frees the pages its window has passed;
                 `full_layers`, the layers policies compress
"""

from kvjax.eviction.allocation import HeadAllocation
from kvjax.eviction.budgets import (
    ADAKV_FLOOR,
    BUDGET_SCHEDULES,
    HEAD_BUDGETS,
    EvictionPlan,
    evict_once,
    fair_scores,
    head_budgets,
    layer_budgets,
)
from kvjax.eviction.fixed_shape import evict, protection_mask, truncate
from kvjax.eviction.sliding import full_layers, slide

__all__ = [
    "ADAKV_FLOOR",
    "BUDGET_SCHEDULES",
    "HEAD_BUDGETS",
    "EvictionPlan",
    "HeadAllocation",
    "evict",
    "evict_once",
    "fair_scores",
    "full_layers",
    "head_budgets",
    "layer_budgets",
    "protection_mask",
    "slide",
    "truncate",
]
