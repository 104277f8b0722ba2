"""Eviction policies: what each token's score is, a module per family. `base` says what a
policy declares and which hooks it has; `scores` holds the score primitives (pure jnp). A new
policy is a subclass in a file of its own, made selectable by name with `register`
(`examples/custom_policy.py`, `docs/policies.md`). How a budget is shared and what goes is
`kvjax.eviction`'s: policies score, eviction decides."""

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
    "INFO",
    "POLICIES",
    "READS",
    "SCORE",
    "AttentionHistory",
    "AttentionStats",
    "DropKV",
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
    "get_policy",
    "read_layer",
    "register",
    "write_layer",
    "write_new_tokens",
]
