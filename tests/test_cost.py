"""Decode cost (`kvjax.eval._cost.decode_cost`) on a tiny random model: sane fields, the
full cache's zero eviction share, a budget's smaller footprint, and argument errors."""

import numpy as np
import pytest

import kvjax
from kvjax.eval._cost import decode_cost
from kvjax.testing import tiny_llama

CONTEXT = np.random.default_rng(1).integers(3, 259, 90).tolist()
FIELDS = {
    "policy",
    "context_tokens",
    "budget_tokens",
    "decode_steps",
    "decode_ms_per_token",
    "decode_ms_per_token_no_eviction",
    "eviction_ms_per_token",
    "eviction_share",
    "eviction_events",
    "eviction_ms_per_event",
    "eviction_period_steps",
    "eviction_share_steady",
    "kv_bytes_peak",
    "kv_bytes_final",
    "prefill_seconds",
    "prefill_compile_seconds",
    "decode_compile_seconds",
}


@pytest.fixture(scope="module")
def tiny():
  return tiny_llama()


@pytest.fixture(scope="module")
def full(tiny):
  return decode_cost(tiny, CONTEXT, decode_steps=16, repeats=1)


def test_full_cache_costs_no_eviction(full):
  assert set(full) == FIELDS
  assert full["policy"] == "full" and full["budget_tokens"] is None
  assert full["context_tokens"] == len(CONTEXT) and full["decode_steps"] == 16
  assert full["eviction_share"] == 0.0 and full["eviction_events"] == 0
  assert full["eviction_ms_per_token"] == 0.0 and full["eviction_ms_per_event"] is None
  assert full["eviction_share_steady"] is None and full["eviction_period_steps"] is None
  assert full["decode_ms_per_token"] > 0 and full["prefill_seconds"] > 0
  # 2 layers x 2 kv heads, each holding the context and the decoded tokens in 16-token pages.
  page_bytes = 2 * 16 * 8 * 4
  assert full["kv_bytes_final"] == 2 * 2 * -(-(len(CONTEXT) + 16) // 16) * page_bytes
  assert full["kv_bytes_peak"] == full["kv_bytes_final"]


@pytest.mark.parametrize("policy", ["h2o", pytest.param("group_history", marks=pytest.mark.slow)])
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_budget_holds_fewer_bytes_and_eviction_share_is_a_fraction(tiny, full, policy):
  cost = decode_cost(
      tiny, CONTEXT, kvjax.CompressionSpec(policy, budget=48), decode_steps=24, repeats=1
  )
  assert set(cost) == FIELDS
  assert cost["policy"] == policy and cost["budget_tokens"] == 48
  assert 0.0 <= cost["eviction_share"] <= 1.0
  assert cost["decode_ms_per_token"] > 0 and cost["decode_ms_per_token_no_eviction"] > 0
  # At most the budget after prefill: 24 more tokens pass the threshold (budget + a page) once.
  assert cost["eviction_events"] == 1 and isinstance(cost["eviction_ms_per_event"], float)
  # A sequence passes budget + one page every 17 tokens, in whole groups (1 or 16 tokens).
  assert cost["eviction_period_steps"] == (17 if policy == "h2o" else 32)
  assert 0.0 <= cost["eviction_share_steady"] < 1.0
  assert cost["kv_bytes_final"] <= cost["kv_bytes_peak"] < full["kv_bytes_peak"]
  assert cost["kv_bytes_final"] <= 2 * 2 * (48 + 16) * 2 * 8 * 4


@pytest.mark.parametrize(
    "context, kwargs, message",
    [
        ([], {}, "context_ids is empty"),
        ("some text", {}, "context_ids must be a sequence of token ids"),
        ([1, 2, 999], {}, r"context_ids has token ids outside \[0, 259\)"),
        (CONTEXT, {"decode_steps": 0}, "decode_steps must be an int >= 1"),
        (CONTEXT, {"repeats": 0}, "repeats must be an int >= 1"),
        (CONTEXT, {"decode_steps": 60}, "exceeds the model context 128"),
        (
            CONTEXT,
            {"spec": {"policy": "h2o", "budget": 48, "prefill_chunk": 16}, "decode_steps": 17},
            "decode_steps=17 exceeds the prefill chunk",
        ),
        (CONTEXT, {"spec": {"policy": "h2o"}}, "give budget="),
    ],
)
def test_bad_input_raises_value_error_naming_it(tiny, context, kwargs, message):
  with pytest.raises(ValueError, match=message):
    spec = kvjax.CompressionSpec(**kwargs.pop("spec", {}))
    decode_cost(tiny, context, spec, **kwargs)
