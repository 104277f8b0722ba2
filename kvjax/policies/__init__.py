"""Eviction policies: what each token's score is (a module per family), and how budgets
are spread (`budgets`). `base` says what a policy declares and which hooks it has; a new
policy is a subclass in a file of its own, made selectable by name with `register`
(`examples/custom_policy.py`, `docs/policies.md`)."""

from kvjax.policies.attention import AttentionHistory, GroupHistory, MeanAttention, SnapKV, Tova
from kvjax.policies.base import (
    POLICIES,
    READS,
    SCORE,
    AttentionStats,
    Policy,
    get_policy,
    read_layer,
    register,
    write_layer,
    write_new_tokens,
)
from kvjax.policies.budgets import (
    ADAKV_FLOOR,
    BUDGET_SCHEDULES,
    HEAD_BUDGETS,
    EvictionPlan,
    evict_once,
    fair_scores,
    head_budgets,
    layer_budgets,
)
from kvjax.policies.expected_attention import ExpectedAttention
from kvjax.policies.info_aware import INFO, InfoAware
from kvjax.policies.kvzip import KVzip, KVzipPlus
from kvjax.policies.learned import Learned, Scorer
from kvjax.policies.output_impact import DropKV, OutputImpact
from kvjax.policies.simple import Full, KeyNorm, Random, Streaming

for _cls in (
    Full,
    Streaming,
    AttentionHistory,
    MeanAttention,
    GroupHistory,
    Tova,
    SnapKV,
    KeyNorm,
    Random,
    OutputImpact,
    DropKV,
    InfoAware,
    KVzip,
    KVzipPlus,
    Learned,
    ExpectedAttention,
):
  register(_cls)

__all__ = [
    "ADAKV_FLOOR",
    "BUDGET_SCHEDULES",
    "HEAD_BUDGETS",
    "INFO",
    "POLICIES",
    "READS",
    "SCORE",
    "AttentionHistory",
    "AttentionStats",
    "DropKV",
    "EvictionPlan",
    "ExpectedAttention",
    "Full",
    "GroupHistory",
    "InfoAware",
    "KVzip",
    "KVzipPlus",
    "KeyNorm",
    "Learned",
    "MeanAttention",
    "OutputImpact",
    "Policy",
    "Random",
    "Scorer",
    "SnapKV",
    "Streaming",
    "Tova",
    "evict_once",
    "fair_scores",
    "get_policy",
    "head_budgets",
    "layer_budgets",
    "read_layer",
    "register",
    "write_layer",
    "write_new_tokens",
]
