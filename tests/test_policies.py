"""Eviction policies: score primitives, each policy on hand-made cases, protection, memory
bounds, per-layer / per-head budgets, fair eviction and argument errors."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import policies
from kvjax.policies import scores as S
from kvjax import Segment
from kvjax.policies import AttentionStats, info_aware
from kvjax.eviction import budgets
from kvjax.eviction.budgets import EvictionPlan
from kvjax.testing import ByteTokenizer, assert_cache_invariants, tiny_llama
from models import load_llama

EVICTING = [name for name in policies.POLICIES if name != "full"]
# Policies that evict during prefill (kvzip scores the whole context first: tests/test_kvzip.py).
STREAMING = [name for name in EVICTING if policies.POLICIES[name].mode == "running"]
# `learned` scores a model only with a scorer trained for it (tests/test_learned.py).
ANY_MODEL = [name for name in EVICTING if name != "learned"]
# Through the model, by default one policy per way of scoring (attention history, a window,
# no attention, the lse path, reconstruction, query statistics); the rest are slow. Every
# policy also runs through the model in `kvjax doctor`'s self-check (the notebook test) and
# through hand-made caches here.
MODEL_DEFAULT = {"h2o", "snapkv", "knorm", "output_impact", "kvzip", "expected_attention"}


def _by_model(names, default=MODEL_DEFAULT):
  return [n if n in default else pytest.param(n, marks=pytest.mark.slow) for n in names]


@pytest.fixture(scope="module")
def tiny():
  return tiny_llama(n_layers=4, max_context=256), ByteTokenizer()


@pytest.fixture(scope="module")
def smollm():
  return load_llama()


# ---- score primitives ----------------------------------------------------------------------


def test_output_impact_worked_example():
  probs = jnp.array([0.05, 0.20, 0.75])
  values = jnp.array([[100.0], [10.0], [10.0]])
  output = jnp.sum(probs[:, None] * values, axis=0)
  np.testing.assert_allclose(output, [14.5], rtol=1e-6)
  np.testing.assert_allclose(S.output_impact(probs, values, output), [4.5, 1.125, 13.5], rtol=1e-6)


def _brute_force_impact(probs, values):
  """||O^(-i) - O|| by removing each token and renormalising the rest (float64)."""
  probs, values = np.float64(probs), np.float64(values)
  output = np.einsum("...t,...td->...d", probs, values)
  t = probs.shape[-1]
  out = np.zeros(probs.shape)
  for i in range(t):
    rest = probs.copy()
    rest[..., i] = 0.0
    rest /= rest.sum(-1, keepdims=True)
    removed = np.einsum("...t,...td->...d", rest, values)
    out[..., i] = np.linalg.norm(removed - output, axis=-1)
  return out


@pytest.mark.parametrize("shape", [(5, 1), (7, 16), (3, 7, 16), (2, 3, 6, 4)])
def test_output_impact_matches_brute_force_removal(shape):
  *lead, t, d = shape
  rng = np.random.default_rng(sum(shape))
  probs = np.asarray(jax.nn.softmax(rng.normal(size=(*lead, t)).astype(np.float32) * 2, -1))
  values = rng.normal(size=shape).astype(np.float32)
  output = np.einsum("...t,...td->...d", np.float64(probs), np.float64(values))
  impact = S.output_impact(jnp.asarray(probs), jnp.asarray(values), jnp.float32(output))
  assert impact.shape == (*lead, t) and impact.dtype == jnp.float32
  expected = _brute_force_impact(probs, values)
  # Relative error of each query's impact vector (a single v_i close to O cancels in float32).
  error = np.linalg.norm(np.asarray(impact) - expected, axis=-1)
  assert np.max(error / np.linalg.norm(expected, axis=-1)) <= 1e-5


def test_output_impact_clamps_a_token_holding_all_the_weight():
  probs = jnp.array([1.0, 0.0, 0.0])
  values = jnp.array([[2.0], [5.0], [7.0]])
  np.testing.assert_array_equal(S.output_impact(probs, values, jnp.array([2.0])), [0, 0, 0])
  # An inexact O (say, from a low-precision kernel): 1 - a_i is clamped to eps, not 0.
  impact = S.output_impact(probs, values, jnp.array([2.5]), eps=1e-6)
  assert np.isfinite(impact).all()
  np.testing.assert_allclose(impact, [0.5 / 1e-6, 0, 0], rtol=1e-6)


@pytest.mark.parametrize(
    "probs, values, output",
    [
        ((3,), (4, 1), (1,)),  # T differs
        ((3,), (3, 2), (3,)),  # D differs
        ((2, 3), (5, 3, 4), (2, 4)),  # batch axes do not broadcast
    ],
)
def test_output_impact_rejects_bad_shapes(probs, values, output):
  with pytest.raises(ValueError, match="output_impact: probs"):
    S.output_impact(jnp.ones(probs), jnp.ones(values), jnp.ones(output))


def test_accumulate_history_decays_and_validates():
  history, attention = jnp.array([1.0, 2.0, 0.0]), jnp.array([0.5, 0.25, 1.0])
  np.testing.assert_allclose(S.accumulate_history(history, attention), [1.5, 2.25, 1.0])
  np.testing.assert_allclose(S.accumulate_history(history, attention, 0.5), [1.0, 1.25, 1.0])
  np.testing.assert_allclose(S.accumulate_history(history, attention, 0.0), attention)
  for decay in (-0.1, 1.5):
    with pytest.raises(ValueError, match=r"decay must be in \[0, 1\]"):
      S.accumulate_history(history, attention, decay)


def test_predictive_entropy_uniform_and_one_hot():
  np.testing.assert_allclose(S.predictive_entropy(jnp.zeros((2, 3, 7))), np.log(7), rtol=1e-6)
  one_hot = jnp.array([[0.0, -1e4, -1e4, -1e4], [-1e4, -1e4, 5.0, -1e4]])
  np.testing.assert_allclose(S.predictive_entropy(one_hot), [0.0, 0.0], atol=1e-6)
  two_way = jnp.log(jnp.array([0.5, 0.5, 1e-30]))
  np.testing.assert_allclose(S.predictive_entropy(two_way), np.log(2), rtol=1e-5)


def test_predictive_entropy_of_masked_logits_is_finite():
  logits = jnp.array([0.0, -jnp.inf, -jnp.inf])
  np.testing.assert_allclose(S.predictive_entropy(logits), 0.0, atol=1e-6)


def test_layer_change_identical_opposite_orthogonal():
  h = jnp.array([[1.0, 2.0, 3.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
  previous = jnp.array([[2.0, 4.0, 6.0], [0.0, -3.0, 0.0], [0.0, 0.0, 5.0]])
  np.testing.assert_allclose(S.layer_change(h, previous), [0.0, 2.0, 1.0], atol=1e-6)


# ---- each policy on a hand-made cache ------------------------------------------------------

N_TOKENS = 16
# Token eviction: keep 8 of 16 tokens, token 0 (sink) and 15 (recent) protected.
TOKEN_CFG = kvjax.CacheConfig(page_size=4, max_tokens=32, budget=8, sink=1, recent=1, group_size=1)
# Block eviction: 24 tokens in 6 pages, keep 3; page 0 (sink) and page 5 (recent) protected.
BLOCK_CFG = kvjax.CacheConfig(page_size=4, max_tokens=48, budget=12, sink=2, recent=3)


def _cache(cfg, n=N_TOKENS, heads=1, d=4, k=None, v=None, protected=None, extra=None):
  """One layer and row of `heads` kv heads holding positions 0..n-1 (K = V = position);
  `extra`: a policy's state that is not per token."""
  slots = (policies.SCORE, policies.INFO)
  cache = kvjax.init_cache(cfg, 1, 1, heads, d, chunk=n, slots=slots, extra=extra)
  fill = jnp.broadcast_to(jnp.arange(n, dtype=jnp.float32)[:, None, None], (n, heads, d))
  k = fill if k is None else jnp.broadcast_to(jnp.asarray(k, jnp.float32)[:, None], (n, heads, d))
  v = fill if v is None else jnp.broadcast_to(jnp.asarray(v, jnp.float32)[:, None], (n, heads, d))
  positions = jnp.arange(n)[None]
  protected = None if protected is None else jnp.asarray(protected)[None]
  return kvjax.append(cache, k[None, None], v[None, None], positions, None, protected)


def _kept(cache, head=0, layer=0, row=0):
  return kvjax.read_sequence(cache, layer, row, head)[2].tolist()


def _stats(cache, probs, head_probs=None, out=None):
  """AttentionStats of layer 0 for hand-made probs [Hkv, T, N] of one row: T queries, the
  last T tokens of the cache, of a model without position encoding."""
  probs = jnp.asarray(probs, jnp.float32)[None]
  _, hkv, t, _ = probs.shape
  hq = hkv if head_probs is None else jnp.shape(head_probs)[0]
  d = cache.head_dim
  out = jnp.zeros((1, t, hq, d)) if out is None else jnp.asarray(out, jnp.float32)[None]
  length = int(cache.length.max())
  per_head = probs if head_probs is None else jnp.asarray(head_probs, jnp.float32)[None]
  key_max = per_head.reshape(1, hkv, -1, per_head.shape[-1]).max(axis=2)  # [1, Hkv, N]
  return AttentionStats(
      layer=jnp.int32(0),
      q=jnp.zeros((1, t, hq, d)),
      out=out,
      probs=probs,
      head_probs=None if head_probs is None else jnp.asarray(head_probs, jnp.float32)[None],
      num_new=jnp.array([t], jnp.int32),
      positions=jnp.arange(length - t, length)[None],
      rotate=lambda x, positions: x,
      head_output=jnp.broadcast_to(jnp.eye(d), (hq, d, d)),  # an output projection W_O = I
      key_max=key_max,
  )


_EVICT = jax.jit(kvjax.evict)  # one compilation per cache config, shared by the policies


def _evict(policy, cache, key=0):
  """Evicts with `policy.scores` to the config's budget (what a uniform EvictionPlan does)."""
  return _EVICT(cache, policy.scores(cache, jax.random.key(key)))


def _apply(policy, cache, budget=None, key=0, **kwargs):
  """Evicts through an EvictionPlan of one layer."""
  budget = cache.config.budget if budget is None else budget
  plan = EvictionPlan(policy, layer_budget=(budget,), **kwargs)
  return plan.apply(cache, jax.random.key(key))


def _two_queries(n=TOKEN_CFG.max_tokens):
  """probs [1, 2, N]: query 0 attends only token 3, query 1 (the newest) only token 5."""
  probs = np.zeros((1, 2, n), np.float32)
  probs[0, 0, 3] = 1.0
  probs[0, 1, 5] = 1.0
  return probs


@pytest.mark.parametrize(
    "policy, kept",
    [
        # No observation: all scores tie and the lowest positions leave first.
        (policies.Policy(), [0, 9, 10, 11, 12, 13, 14, 15]),
        (policies.AttentionHistory(), [0, 3, 5, 11, 12, 13, 14, 15]),
        (policies.InfoAware(), [0, 3, 5, 11, 12, 13, 14, 15]),
        (policies.Tova(), [0, 5, 10, 11, 12, 13, 14, 15]),
        (policies.SnapKV(window=1, kernel=1), [0, 5, 10, 11, 12, 13, 14, 15]),
        (policies.SnapKV(window=2, kernel=1), [0, 3, 5, 11, 12, 13, 14, 15]),
        (policies.SnapKV(window=1, kernel=3), [0, 4, 5, 6, 12, 13, 14, 15]),
        (policies.SnapKV(), [0, 3, 4, 5, 6, 7, 8, 15]),
    ],
    ids=lambda x: repr(x) if isinstance(x, policies.Policy) else None,
)
def test_attention_policies_keep_the_attended_tokens(policy, kept):
  cache = _cache(TOKEN_CFG)
  cache = policy.observe(cache, _stats(cache, _two_queries()))
  evicted = _evict(policy, cache)
  assert _kept(evicted) == kept
  assert_cache_invariants(evicted)


def test_h2o_decay_forgets_old_attention():
  cfg = kvjax.CacheConfig(page_size=4, max_tokens=32, budget=3, sink=1, recent=1, group_size=1)
  first = np.zeros((1, 1, 32), np.float32)
  first[0, 0, 3] = 1.0
  second = np.zeros((1, 1, 32), np.float32)
  second[0, 0, 5] = 0.6
  for decay, kept in ((1.0, [0, 3, 15]), (0.5, [0, 5, 15])):
    policy = policies.AttentionHistory(decay=decay)
    cache = _cache(cfg)
    cache = policy.observe(cache, _stats(cache, first))
    cache = policy.observe(cache, _stats(cache, second))
    assert _kept(_evict(policy, cache)) == kept, decay


def test_h2o_mean_divides_the_history_by_the_queries_that_saw_each_key():
  # 16 tokens at positions 0..15: key i was seen by 16 - i queries.
  cfg = kvjax.CacheConfig(page_size=4, max_tokens=32, budget=3, sink=1, recent=1, group_size=1)
  probs = np.zeros((1, 1, 32), np.float32)
  probs[0, 0, 2] = 2.8  # seen by 14 queries: mean 0.2
  probs[0, 0, 12] = 1.0  # seen by 4 queries: mean 0.25
  cache = _cache(cfg)
  for policy, kept in (
      (policies.AttentionHistory(), [0, 2, 15]),
      (policies.MeanAttention(), [0, 12, 15]),
  ):
    observed = policy.observe(cache, _stats(cache, probs))
    scores = np.asarray(policy.scores(observed, jax.random.key(0)))[0, 0, 0, :16]
    if isinstance(policy, policies.MeanAttention):
      np.testing.assert_allclose(scores[[2, 12]], [0.2, 0.25], rtol=1e-6)
    assert _kept(_evict(policy, observed)) == kept, policy.name


def test_group_history_keeps_the_attended_page():
  policy = policies.GroupHistory()
  cache = _cache(BLOCK_CFG, n=24)
  assert _kept(_evict(policy, cache)) == [*range(0, 4), *range(16, 24)]  # ties: oldest leave
  probs = np.zeros((1, 1, 48), np.float32)
  probs[0, 0, 9] = 1.0  # page 2
  cache = policy.observe(cache, _stats(cache, probs))
  evicted = _apply(policy, cache)
  assert _kept(_evict(policy, cache)) == _kept(evicted)
  assert _kept(evicted) == [*range(0, 4), *range(8, 12), *range(20, 24)]
  assert int(evicted.pages_in_use().sum()) == 3
  assert_cache_invariants(evicted)


def test_output_impact_keeps_the_token_whose_removal_moves_the_output():
  # Token 3 has weight 0.5 and v_3 = O: removing it changes nothing (r_3 = 0). Token 4 has
  # weight 0.05 but v_4 far from O. H2O keeps token 3, output impact keeps token 4.
  cfg = kvjax.CacheConfig(page_size=4, max_tokens=32, budget=3, sink=1, recent=1, group_size=1)
  a = np.full(32, 0.45 / 14, np.float32)
  a[16:] = 0.0
  a[3], a[4] = 0.5, 0.05
  v = np.zeros((N_TOKENS, 4), np.float32)
  v[4, 0] = 10.0
  v[3, 0] = 1.0  # O = 0.5 * v_3 + 0.05 * v_4  =>  O = v_3 = (1, 0, 0, 0)
  output = a[:N_TOKENS] @ v
  np.testing.assert_allclose(output, v[3], rtol=1e-6)
  cache = _cache(cfg, v=v)
  stats = _stats(cache, a[None, None], head_probs=a[None, None], out=output[None, None])
  impact = policies.OutputImpact()
  observed = impact.observe(cache, stats)
  scores = np.asarray(kvjax.logical_view(observed, observed.slot("score")))[0, 0, 0]
  np.testing.assert_allclose(scores[[3, 4]], [0.0, 0.05 / 0.95 * 9.0], atol=1e-6)
  assert scores[4] == scores.max()
  assert _kept(_evict(impact, observed)) == [0, 4, 15]
  h2o = policies.AttentionHistory()
  assert _kept(_evict(h2o, h2o.observe(cache, stats))) == [0, 3, 15]


def test_output_impact_sums_query_heads_of_a_kv_head():
  cache = _cache(TOKEN_CFG)
  head_probs = np.zeros((2, 1, 32), np.float32)  # two query heads share kv head 0
  head_probs[0, 0, [2, 7]] = 0.5
  head_probs[1, 0, [7, 9]] = 0.5
  v = np.arange(N_TOKENS, dtype=np.float32)
  out = np.stack([0.5 * (v[2] + v[7]), 0.5 * (v[7] + v[9])])[None, :, None] * np.ones(4)
  stats = _stats(cache, head_probs.sum(0, keepdims=True), head_probs=head_probs, out=out)
  cache = policies.OutputImpact().observe(cache, stats)
  score = kvjax.logical_view(cache, cache.slot("score"))[0, 0, 0, :N_TOKENS]
  dist = lambda i, o: np.linalg.norm(np.full(4, v[i] - o))  # noqa: E731
  expected = np.zeros(N_TOKENS)
  expected[2] = dist(2, 4.5)
  expected[7] = dist(7, 4.5) + dist(7, 8.0)
  expected[9] = dist(9, 8.0)
  np.testing.assert_allclose(score, expected, rtol=1e-6)


@pytest.mark.parametrize(
    "t, impl, policy",
    [
        (6, "ref", policies.OutputImpact(window=4)),
        (1, "pallas", policies.OutputImpact(window=4)),
        (1, "ref", policies.DropKV(window=4)),
        *(
            pytest.param(*case, marks=pytest.mark.slow)
            for case in [
                (1, "ref", policies.OutputImpact(window=4)),
                (6, "ref", policies.DropKV(window=4)),
                (1, "pallas", policies.DropKV(window=4)),
            ]
        ),
    ],
)
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_output_impact_through_the_kernel_dispatcher_matches_head_probs(t, impl, policy):
  """The model's path (the dispatcher on q, K, V and the attention's lse) agrees with the
  jnp specification on per-query-head probabilities, padded rows and short rows included."""
  from pallas_kernels.paged_attention import paged_attention

  cfg = kvjax.CacheConfig(page_size=4, max_tokens=32)
  b, hkv, hq, d = 2, 2, 4, 8
  rng = np.random.default_rng(0)
  cache = kvjax.init_cache(cfg, 1, b, hkv, d, chunk=16, slots=(policies.SCORE,))
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
  cache = kvjax.append(
      cache, normal(1, b, 9, hkv, d), normal(1, b, 9, hkv, d), jnp.zeros((b, 9), int)
  )
  num_new = jnp.array([t, max(t // 2, 1)], jnp.int32)  # row 1 is a short chunk
  positions = jnp.zeros((b, t), jnp.int32)
  chunk_k, chunk_v = normal(1, b, t, hkv, d), normal(1, b, t, hkv, d)
  cache = kvjax.append(cache, chunk_k, chunk_v, positions, num_new)
  q = normal(b, t, hq, d)
  out, head_probs, lse = paged_attention(
      q,
      cache.k_pages,
      cache.v_pages,
      cache.page_table[0],
      cache.length[0],
      num_new,
      per_query_head=True,
      return_lse=True,
      impl="ref",
  )
  probs = head_probs.reshape(b, hkv, 2, t, -1).sum(2)
  common = dict(layer=jnp.int32(0), q=q, out=out, probs=probs, num_new=num_new)
  spec = policy.observe(cache, AttentionStats(**common, head_probs=head_probs))
  kernel = policy.observe(cache, AttentionStats(**common, head_probs=None, lse=lse, impl=impl))
  want = kvjax.logical_view(spec, spec.slot("score"))
  assert float(jnp.abs(want).max()) > 0
  got = kvjax.logical_view(kernel, kernel.slot("score"))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def _info_cache(policy):
  """TOKEN_CFG cache where token 5 drew all attention, token 7's hidden state flipped in
  layer 0 (change 1) and the model was unsure at token 9 (entropy log V)."""
  cache = _cache(TOKEN_CFG)
  probs = np.zeros((1, 1, 32), np.float32)
  probs[0, 0, 5] = 1.0
  cache = policy.observe(cache, _stats(cache, probs))
  hidden_in = jnp.ones((1, N_TOKENS, 8))
  hidden_out = hidden_in.at[0, 7].set(-1.0)
  cache = policy.observe_layer(cache, 0, hidden_in, hidden_out, jnp.array([N_TOKENS]))
  logits = jnp.zeros((1, N_TOKENS, 10)).at[:, :, 0].set(100.0).at[0, 9].set(0.0)
  return policy.observe_logits(cache, logits, jnp.array([N_TOKENS]))


@pytest.mark.parametrize("n", [1, 2, 7, 64])
def test_normalised_ranks_average_ties_and_skip_empty_slots(n):
  """info_aware's rank normalisation against counting by hand: a live slot's rank is the
  mean of its lowest and highest position among the live values (ties share it; -0.0 ties
  0.0), scaled by the live count - 1; empty slots get 0 (live scores are never -inf)."""
  rng = np.random.default_rng(n)
  x = rng.choice([-1.5, -0.0, 0.0, 0.25, 2.0, np.inf], size=(3, n)).astype(np.float32)
  x[1] = rng.normal(size=n)
  valid = rng.random((3, n)) < 0.7
  got = np.asarray(info_aware._normalise(jnp.asarray(x), jnp.asarray(valid)))
  for row in range(3):
    live = x[row][valid[row]]
    for i in range(n):
      if not valid[row, i]:
        assert got[row, i] == 0
        continue
      rank = ((live < x[row, i]).sum() + (live <= x[row, i]).sum() - 1) / 2
      assert got[row, i] == pytest.approx(rank / max(len(live) - 1, 1), abs=1e-6)


def test_info_aware_records_entropy_and_layer_change():
  policy = policies.InfoAware()
  cache = _info_cache(policy)
  info = np.asarray(kvjax.logical_view(cache, cache.slot("info")))[0, 0, 0, :N_TOKENS]
  np.testing.assert_allclose(info[[7, 9]], [0.5, 0.5], atol=1e-6)  # 0.5 * 1 each
  np.testing.assert_allclose(np.delete(info, [7, 9]), 0.0, atol=1e-6)
  assert 5 in _kept(_evict(policy, cache))


def test_info_aware_blends_attention_with_information():
  # Distinct scores: attention grows with position (token 5 the most), info falls with
  # position except token 9's. The info term lifts token 9 over token 10 (next in
  # attention), not over token 11 (two attention ranks up).
  cache = _cache(TOKEN_CFG)
  attention = np.zeros(32, np.float32)
  attention[:N_TOKENS] = 0.01 * (np.arange(N_TOKENS) + 1)
  attention[5] = 1.0
  info = np.zeros(32, np.float32)
  info[:N_TOKENS] = 0.001 * (N_TOKENS - np.arange(N_TOKENS))
  info[9] = 0.5

  cache = policies.write_layer(cache, "score", 0, jnp.asarray(attention)[None, None])
  cache = policies.write_layer(cache, "info", 0, jnp.asarray(info)[None, None])
  assert _kept(_evict(policies.InfoAware(), cache)) == [0, 5, 9, 11, 12, 13, 14, 15]
  assert _kept(_evict(policies.InfoAware(alpha=1.0), cache)) == [0, 5, 10, 11, 12, 13, 14, 15]
  assert _kept(_evict(policies.InfoAware(alpha=0.0), cache)) == [0, 1, 2, 3, 4, 5, 9, 15]


def test_info_aware_lets_info_decide_between_equal_attention():
  # Tokens other than 5 drew no attention at all: the information term must pick 7 and 9.
  cache = _info_cache(policies.InfoAware())
  assert _kept(_evict(policies.InfoAware(), cache)) == [0, 5, 7, 9, 12, 13, 14, 15]


def test_streaming_keeps_sink_and_newest_whatever_the_history():
  cache = _cache(TOKEN_CFG)
  cache = cache.with_slots(score=jax.random.uniform(jax.random.key(1), cache.k_pages.shape[:2]))
  assert _kept(_evict(policies.Streaming(), cache)) == [0, 9, 10, 11, 12, 13, 14, 15]


def test_knorm_keeps_the_smallest_key_norms():
  norms = np.random.default_rng(0).permutation(N_TOKENS).astype(np.float32) + 1.0
  cache = _cache(TOKEN_CFG, k=norms[:, None] * np.full(4, 0.5))  # ||k_i|| = norms[i]
  cache = cache.with_slots(score=jax.random.uniform(jax.random.key(1), cache.k_pages.shape[:2]))
  smallest = np.argsort(norms[1:-1])[:6] + 1
  assert _kept(_evict(policies.KeyNorm(), cache)) == sorted([0, 15, *smallest.tolist()])


def test_random_depends_on_the_key_and_respects_protection():
  protected = np.zeros(N_TOKENS, bool)
  protected[[6, 7]] = True
  cache = _cache(TOKEN_CFG, protected=protected)
  kept = [tuple(_kept(_evict(policies.Random(), cache, key=key))) for key in range(6)]
  for k in kept:
    assert len(k) == 8 and {0, 6, 7, 15} <= set(k)
  assert len(set(kept)) > 1
  assert tuple(_kept(_evict(policies.Random(), cache, key=3))) == kept[3]


@pytest.mark.parametrize("name", EVICTING)
def test_every_policy_keeps_protected_tokens_of_a_hand_made_cache(name):
  policy = policies.get_policy(name)
  cfg, n = (TOKEN_CFG, N_TOKENS) if policy.granularity == "token" else (BLOCK_CFG, 24)
  protected = np.zeros(n, bool)
  protected[8:12] = True
  extra = policy.init_extra(1, 1, 1, 1, 4)  # 1 layer, row, kv head and query head; D = 4
  cache = _cache(cfg, n=n, protected=protected, extra=extra)
  probs = np.zeros((1, 1, cfg.max_tokens), np.float32)
  probs[0, 0, [4, 13, 17]] = 1.0  # attention elsewhere
  stats = _stats(cache, probs, head_probs=probs, out=np.ones((1, 1, 4)))
  cache = policy.observe(cache, stats)
  evicted = _evict(policy, cache)
  kept = set(_kept(evicted))
  must_keep = range(cfg.sink), range(8, 12), range(n - cfg.recent, n)
  assert set().union(*must_keep) <= kept
  assert len(kept) == cfg.budget
  assert_cache_invariants(evicted)


# ---- protection and memory through prefill / generate on the tiny model --------------------

BUDGET, PAGE, CHUNK, MAX_NEW = 16, 4, 8, 4
# 128 tokens (8x the budget); the protected span fills page 15 (positions 60..63), so that
# block eviction can hold sink + protected + recent pages within the budget.
FILLER = "The quick brown fox jumps over the lazy dog. Pack my box with jugs. " * 2
PROMPT = [Segment(FILLER[:60]), Segment("KEEP", protected=True), Segment(FILLER[:64])]
PROMPT_LEN = 128
PROTECTED = range(60, 64)
PLAIN = FILLER[:60] + "KEEP" + FILLER[:64]  # the same tokens, none protected


def _prefill(model, tokenizer, prompts, policy, budget, *, chunk=CHUNK, **kwargs):
  spec = kvjax.CompressionSpec(
      policy=policy, budget=budget, prefill_chunk=chunk, page_size=PAGE, **kwargs
  )
  state = kvjax.prefill(model, prompts, spec, tokenizer=tokenizer, reserve=MAX_NEW)
  plan, cache, peak = state.plan, state.cache, int(state.peak_pages)
  assert not kvjax.Status(int(cache.status)) & kvjax.Status.OVER_BUDGET
  assert_cache_invariants(cache)
  return plan, cache, peak


def _all_kept(cache):
  """{(layer, row, head): kept positions}."""
  l, b, h = cache.length.shape
  return {(i, j, k): _kept(cache, k, i, j) for i in range(l) for j in range(b) for k in range(h)}


# What survives is eviction's rule, not a scorer's: one running, one query-free, one
# compress-once policy by default.
@pytest.mark.parametrize("name", _by_model(ANY_MODEL, default={"h2o", "knorm", "kvzip"}))
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_sink_recent_and_protected_tokens_survive_prefill(tiny, name):
  model, tokenizer = tiny
  _, cache, _ = _prefill(model, tokenizer, [PROMPT], name, BUDGET)
  cfg = cache.config
  assert cfg.sink == 4 and cfg.recent == 4
  must_keep = {*range(cfg.sink), *PROTECTED, *range(PROMPT_LEN - cfg.recent, PROMPT_LEN)}
  for seq, kept in _all_kept(cache).items():
    assert must_keep <= set(kept), (seq, sorted(must_keep - set(kept)))
    assert kept == sorted(set(kept)), seq
  lengths = np.asarray(cache.length)
  if policies.POLICIES[name].mode == "once":  # one budget for all the row's sequences
    assert lengths.sum() <= BUDGET * lengths.size + 4  # evicted down from 128 tokens each
  else:
    assert int(lengths.max()) <= BUDGET + PAGE


def _generate_prompt(model, tokenizer, **spec):
  """`generate` on PROMPT with the test's chunk and page size."""
  spec = kvjax.CompressionSpec(prefill_chunk=CHUNK, page_size=PAGE, **spec)
  return kvjax.generate(model, tokenizer, [PROMPT], spec, max_new_tokens=MAX_NEW)


def _peak_bound(layers, batch, heads, budget, page, chunk, bytes_per_token):
  return layers * batch * heads * math.ceil((budget + page + chunk) / page) * page * bytes_per_token


@pytest.mark.parametrize("name", _by_model(STREAMING, default={"h2o", "snapkv"}))
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_peak_kv_is_within_budget_plus_a_page_and_a_chunk(tiny, name):
  model, tokenizer = tiny
  c = model.config
  result = _generate_prompt(model, tokenizer, policy=name, budget=BUDGET)
  stats = result.stats
  assert stats["prompt_tokens"] == [PROMPT_LEN]
  # After prefill at most the budget and the eviction margin of the prompt are kept.
  assert BUDGET / PROMPT_LEN <= stats["kept_fraction"][0] <= (BUDGET + PAGE) / PROMPT_LEN
  bytes_per_token = 2 * c.head_dim * 4
  bound = _peak_bound(c.n_layers, 1, c.n_kv_heads, BUDGET, PAGE, CHUNK, bytes_per_token)
  full = c.n_layers * c.n_kv_heads * PROMPT_LEN * bytes_per_token
  assert c.n_layers * c.n_kv_heads * BUDGET * bytes_per_token <= stats["peak_kv_bytes"] <= bound
  assert bound < full / 3
  assert stats["final_kv_bytes"] <= c.n_layers * c.n_kv_heads * (BUDGET + PAGE) * bytes_per_token


# Token eviction runs by default; block eviction on the real model (~15 s more) with -m slow.
@pytest.mark.slow  # ~16 s with the model: -m slow; the bound runs on the tiny model by default
@pytest.mark.parametrize("name", ["h2o", pytest.param("group_history", marks=pytest.mark.slow)])
def test_peak_kv_of_the_default_model_within_bound(smollm, name):
  model, tokenizer = smollm
  c = model.config
  text = " ".join(
      f"Note {i}: the {('red', 'blue', 'green')[i % 3]} box holds {i * 7 % 13} stones."
      for i in range(80)
  )
  ids = tokenizer.encode(text)[:512]
  assert len(ids) == 512
  spec = kvjax.CompressionSpec(policy=name, budget=0.25, prefill_chunk=256)
  result = kvjax.generate(model, tokenizer, [ids], spec, max_new_tokens=4)
  stats = result.stats
  budget, page = stats["cache"]["budget"], stats["cache"]["page_size"]
  assert budget == 128 and stats["layer_budgets"] == [128] * c.n_layers
  bound = _peak_bound(c.n_layers, 1, c.n_kv_heads, budget, page, 256, 2 * c.head_dim * 4)
  assert 0 < stats["peak_kv_bytes"] <= bound
  assert len(result.tokens[0]) + (result.finish_reasons[0] == "stop") >= 1


# ---- budgets ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "budget, layers, group, floor",
    [(64, 8, 1, 4), (16, 4, 1, 8), (128, 30, 16, 64), (48, 30, 16, 32), (12, 30, 1, 7)],
)
def test_pyramid_budgets_fall_keep_the_mean_and_respect_the_floor(budget, layers, group, floor):
  b = budgets.layer_budgets(budget, layers, "pyramid", group, floor)
  assert b.shape == (layers,) and b.dtype == np.int32
  assert (np.diff(b) <= 0).all() and b[0] > b[-1]
  assert (b >= floor).all() and (b % group == 0).all()
  assert abs(b.sum() - budget * layers) <= layers * group / 2
  if group == 1 and floor <= budget // 2:
    assert (np.diff(b) < 0).all()  # strictly decreasing when nothing rounds or floors
  np.testing.assert_array_equal(
      budgets.layer_budgets(budget, layers, "uniform", group, floor), budget
  )


def test_pyramid_budgets_keep_the_mean_when_the_floor_binds():
  b = budgets.layer_budgets(20, 5, "pyramid", 1, 18)
  assert (b >= 18).all()
  assert abs(b.sum() - 100) <= 5 / 2


def test_layer_budgets_reject_an_unknown_schedule():
  with pytest.raises(ValueError, match="budget schedule must be one of"):
    budgets.layer_budgets(16, 4, "linear", 1, 4)


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_pyramid_holds_about_the_uniform_pages_and_fewer_than_its_largest_layer(tiny):
  model, tokenizer = tiny
  c = model.config
  # No protected span: the smallest layer budget (8) holds just sink + recent.
  plan, pyramid, _ = _prefill(model, tokenizer, [PLAIN], "h2o", BUDGET, budget_schedule="pyramid")
  budgets = plan.eviction.layer_budget
  assert budgets == (25, 18, 13, 8)  # mean 16 = BUDGET
  # Chunks of 8 > the margin of 4: the last chunk evicted every layer down to its budget.
  np.testing.assert_array_equal(
      pyramid.length, np.broadcast_to(np.array(budgets)[:, None, None], pyramid.length.shape)
  )
  _, uniform, _ = _prefill(model, tokenizer, [PLAIN], "h2o", BUDGET)
  _, largest, _ = _prefill(model, tokenizer, [PLAIN], "h2o", max(budgets))
  pages = lambda cache: int(cache.pages_in_use().sum())  # noqa: E731
  assert abs(pages(pyramid) - pages(uniform)) <= c.n_layers * c.n_kv_heads
  assert pages(pyramid) < pages(largest)
  assert pyramid.num_pages < largest.num_pages  # the pool is sized from the layer budgets


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_per_head_split_follows_the_scores_across_heads():
  cache = _cache(TOKEN_CFG, heads=2)
  probs = np.zeros((2, 1, 32), np.float32)
  probs[0, 0, :N_TOKENS] = 1.0 + 0.01 * np.arange(N_TOKENS)  # head 0: every token matters
  probs[1, 0, :N_TOKENS] = 0.001 * np.arange(N_TOKENS)  # head 1: nothing does
  policy = policies.AttentionHistory()
  cache = policy.observe(cache, _stats(cache, probs))
  evicted = _apply(policy, cache, per_head=True)
  assert _kept(evicted, head=0) == [0, *range(3, 16)]
  assert _kept(evicted, head=1) == [0, 15]
  assert int(evicted.length.sum()) == 2 * TOKEN_CFG.budget
  assert_cache_invariants(evicted)


def test_per_head_prefill_splits_each_layer_budget_unevenly(tiny):
  model, tokenizer = tiny
  h = model.config.n_kv_heads
  # Key norms differ between heads (on a random model attention is near uniform, so every
  # head's attention history is about the same and h2o splits evenly).
  plan, cache, _ = _prefill(model, tokenizer, [PROMPT], "knorm", BUDGET, head_budget="layer")
  assert plan.eviction.per_head
  length = np.asarray(cache.length)  # [L, B, H]
  assert (length[..., 0] != length[..., 1]).any(), length
  # The last chunk triggered every layer (16 new tokens > a margin of 2 x 4), so each layer
  # holds H x budget tokens, plus the tokens tied with the cutoff score beyond the H x
  # budget-th (layer 0's keys have equal norms for equal token ids: RoPE keeps the norm).
  scores = np.asarray(policies.KeyNorm().scores(cache, None))  # [L, B, H, N]
  unprotected = np.asarray(kvjax.valid_mask(cache) & ~kvjax.protection_mask(cache))
  for layer in range(model.config.n_layers):
    kept_scores = scores[layer][unprotected[layer]]
    ties = int((kept_scores == kept_scores.min()).sum())
    assert h * BUDGET <= length[layer].sum() <= h * BUDGET + ties - 1, (layer, ties)
  assert (length.sum(-1) == h * BUDGET).any()
  for (layer, row, head), kept in _all_kept(cache).items():
    assert {0, 1, 2, 3, *PROTECTED, 124, 125, 126, 127} <= set(kept), (layer, head)


@pytest.mark.slow
def test_pyramid_per_head_generate_stays_within_its_pool(tiny):
  model, tokenizer = tiny
  c = model.config
  result = _generate_prompt(
      model, tokenizer, policy="h2o", budget=BUDGET, budget_schedule="pyramid", head_budget="layer"
  )
  stats = result.stats
  budgets = stats["layer_budgets"]
  assert stats["head_budget"] == "layer" and sum(budgets) == BUDGET * c.n_layers  # the mean is kept
  assert budgets == sorted(budgets, reverse=True) and min(budgets) >= 8  # floor: sink + recent
  page_bytes = 2 * PAGE * c.head_dim * 4
  # Per layer: H x (budget + page + chunk) tokens, plus one partial page per head.
  bound_pages = sum(
      c.n_kv_heads * (math.ceil((b + PAGE + CHUNK) / PAGE) + 1) for b in stats["layer_budgets"]
  )
  assert 0 < stats["peak_kv_bytes"] <= bound_pages * page_bytes
  assert stats["peak_kv_bytes"] <= stats["pool_bytes"]


# ---- fair eviction ------------------------------------------------------------------------


def test_fair_scores_are_quantiles_within_each_segment():
  # Segment 1 (4 tokens) and 2 (8 tokens) interleaved, 2 unmarked tokens, 2 empty slots.
  segment = np.array([1, 2, 2, 1, 2, 2, 1, 2, 2, 1, 2, 2, 0, 0, 1, 1])
  valid = np.arange(16) < 14
  scores = np.array([0.3, 5, 1, 0.1, 7, 3, 0.4, 8, 2, 0.2, 6, 4, 9, -1, -5, 50], np.float32)
  out = budgets.fair_scores(
      jnp.asarray(scores)[None, None, None],
      jnp.asarray(segment)[None, None, None],
      jnp.asarray(valid)[None, None, None],
  )[0, 0, 0]
  rank = np.array([3, 5, 1, 1, 7, 3, 4, 8, 2, 2, 6, 4, 2, 1])  # within the segment
  size = np.array([4, 8, 8, 4, 8, 8, 4, 8, 8, 4, 8, 8, 2, 2])
  expected = rank / size
  np.testing.assert_allclose(out[:14], expected, rtol=1e-6)


FAIR_PROMPT = [Segment(FILLER[:40]), Segment(FILLER[40:120])]  # 40 + 80 tokens


def _kept_per_segment(cache):
  return {
      seq: (sum(p < 40 for p in kept), sum(p >= 40 for p in kept))
      for seq, kept in _all_kept(cache).items()
  }


@pytest.mark.parametrize("name", [pytest.param("streaming", marks=pytest.mark.slow), "h2o"])
def test_fair_eviction_takes_the_same_fraction_from_each_segment(tiny, name):
  model, tokenizer = tiny
  # One chunk holds the whole prompt: one eviction event from 120 to 60 tokens.
  _, cache, _ = _prefill(
      model, tokenizer, [FAIR_PROMPT], name, 60, chunk=128, sink=0, recent=0, fair=True
  )
  for seq, (first, second) in _kept_per_segment(cache).items():
    assert first + second == 60, seq
    assert abs(first - 20) <= 1 and abs(second - 40) <= 1, (seq, first, second)
  if name == "streaming":  # each segment keeps its newest half
    for seq, kept in _all_kept(cache).items():
      assert kept == [*range(20, 40), *range(80, 120)], seq
    _, unfair, _ = _prefill(model, tokenizer, [FAIR_PROMPT], name, 60, chunk=128, sink=0, recent=0)
    assert set(_kept_per_segment(unfair).values()) == {(0, 60)}


# ---- errors -------------------------------------------------------------------------------


def _plan(model, policy, budget, **kwargs):
  spec = kvjax.CompressionSpec(policy=policy, budget=budget, page_size=PAGE, **kwargs)
  return spec.plan(kvjax.ModelShape.of(model), batch=1, longest=64, reserve=4)


def test_unknown_policy_name(tiny):
  with pytest.raises(ValueError, match="unknown policy 'nope'; known: full, streaming"):
    policies.get_policy("nope")
  with pytest.raises(ValueError, match="unknown policy 'nope'"):
    _plan(tiny[0], "nope", 16)


@pytest.mark.parametrize("name", EVICTING)
def test_evicting_policy_needs_a_budget(tiny, name):
  with pytest.raises(ValueError, match=f"policy '{name}' evicts to a budget: give budget="):
    _plan(tiny[0], name, None)


@pytest.mark.parametrize("budget", [0.0, 1.0, 1.5, -0.25])
def test_fractional_budget_outside_the_unit_interval(tiny, budget):
  with pytest.raises(ValueError, match=r"a fractional budget must be in \(0, 1\)"):
    _plan(tiny[0], "h2o", budget)


@pytest.mark.parametrize("name, group_size", [("group_history", None), ("h2o", PAGE)])
def test_per_head_needs_token_eviction(tiny, name, group_size):
  with pytest.raises(ValueError, match="head_budget='layer' needs token eviction"):
    _plan(tiny[0], name, 16, head_budget="layer", group_size=group_size)


def test_bad_budget_schedule_in_plan(tiny):
  with pytest.raises(ValueError, match="budget_schedule must be one of"):
    _plan(tiny[0], "h2o", 16, budget_schedule="linear")


def test_knorm_scores_are_the_negated_norms_of_the_cached_keys():
  model = tiny_llama(n_layers=2, max_context=512)
  ids = np.random.default_rng(1).integers(3, 250, 200).tolist()
  state = kvjax.prefill(model, [ids], kvjax.CompressionSpec(policy="knorm", budget=64))
  state, _ = kvjax.decode(model, state, 20)  # one eviction event while decoding
  cache = state.cache
  keys = np.asarray(kvjax.cache.paged_cache.logical_view(cache, cache.k_pages))  # [L, B, H, N, D]
  valid = np.asarray(kvjax.cache.paged_cache.valid_mask(cache))
  scores = np.asarray(policies.KeyNorm().scores(cache, None))
  np.testing.assert_allclose(
      scores[valid], -np.linalg.norm(keys, axis=-1)[valid], rtol=1e-6, atol=1e-6
  )


def test_only_policies_that_read_the_probabilities_get_them():
  reads = {name for name, cls in policies.POLICIES.items() if cls.reads & {"probs", "head_probs"}}
  assert reads == {
      "h2o",
      "h2o_mean",
      "group_history",
      "tova",
      "snapkv",
      "info_aware",
      "kvzip_plus",
  }
  # KVzip reduces the per-head probabilities to a max per key: attention computes that
  # instead of materialising them.
  assert policies.KVzip.reads == {"key_max"}

  class Custom(policies.Policy):  # a user's observe reads whatever stats hold

    def observe(self, cache, stats):
      return cache

  assert Custom.reads == {"probs"}

  class Lean(policies.Policy):  # one that says it reads nothing but the cache
    reads = frozenset()

    def observe(self, cache, stats):
      return cache

  class Child(Lean):  # inherits the declaration

    def observe(self, cache, stats):
      return cache

  assert Lean.reads == Child.reads == frozenset()


@pytest.mark.parametrize(
    "policy, option, value",
    [
        (policies.SnapKV, "window", 0),
        (policies.SnapKV, "kernel", -3),
        (policies.SnapKV, "kernel", 2.5),
        (policies.OutputImpact, "window", 0),
        (policies.DropKV, "window", True),
    ],
)
def test_a_window_or_kernel_below_one_is_refused(policy, option, value):
  with pytest.raises(ValueError, match=f"{policy.__name__} {option} must be an int >= 1, got"):
    policy(**{option: value})


def test_a_policy_declaration_outside_the_known_values_is_refused():
  with pytest.raises(TypeError, match="reads must be a subset"):
    type("Bad", (policies.Policy,), {"reads": frozenset({"hidden"})})


@pytest.mark.parametrize(
    "name",
    [
        "streaming",
        *(
            pytest.param(n, marks=pytest.mark.slow)
            for n in ("expected_attention", "knorm", "output_impact")
        ),
    ],
)
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_a_policy_without_probabilities_keeps_what_it_kept_with_them(name):
  """The attention path that skips the probabilities (live pages only) changes nothing but
  float order: the same tokens kept, the same logits to 1e-5."""
  model, tok = tiny_llama(n_layers=2, max_context=512), ByteTokenizer()
  del tok
  ids = np.random.default_rng(0).integers(3, 250, 300).tolist()
  lean_policy = policies.POLICIES[name]()
  # The same policy, but asking for the probabilities (the path every policy took before).
  reads = type(lean_policy).reads | {"probs"}
  heavy = type("WithProbs", (type(lean_policy),), {"reads": reads, "__annotations__": {}})
  heavy_policy = dataclasses.dataclass(frozen=True)(heavy)()
  states = [
      kvjax.prefill(model, [ids], kvjax.CompressionSpec(policy=p, budget=96))
      for p in (lean_policy, heavy_policy)
  ]
  lean, full = states
  np.testing.assert_array_equal(
      np.asarray(kvjax.cache.paged_cache.logical_view(lean.cache, lean.cache.slot("position"))),
      np.asarray(kvjax.cache.paged_cache.logical_view(full.cache, full.cache.slot("position"))),
  )
  np.testing.assert_allclose(np.asarray(lean.logits), np.asarray(full.logits), atol=1e-5)


def test_a_policy_name_takes_its_options_after_a_colon():
  assert policies.get_policy("kvzip:chunk=256,attend_to=context") == policies.KVzip(
      chunk=256, attend_to="context"
  )
  assert policies.get_policy("h2o:decay=0.5") == policies.AttentionHistory(decay=0.5)
  spec = kvjax.CompressionSpec(policy="kvzip:chunk=128", budget=64)
  assert spec.policy == policies.KVzip(chunk=128)
  for bad, match in [
      ("kvzip:chunk=x", "option chunk must be an int, got 'x'"),
      ("kvzip:window=3", "bad option 'window=3'; its options: chunk=, attend_to="),
      ("kvzip:chunk", "bad option 'chunk'"),
      ("kvzip:attend_to=everything", "attend_to must be one of"),
      ("nope:chunk=1", "unknown policy 'nope'"),
  ]:
    with pytest.raises(ValueError, match=match):
      policies.get_policy(bad)


def test_a_policy_spells_its_options_as_get_policy_reads_them():
  for policy in (
      policies.KVzip(),
      policies.KVzip(chunk=256, attend_to="context"),
      policies.AttentionHistory(decay=0.5),
  ):
    assert policies.get_policy(policy.spelling) == policy
  assert policies.KVzip().spelling == "kvzip"
  spec = kvjax.CompressionSpec(policy="kvzip:attend_to=context", budget=0.25)
  assert spec.to_dict()["policy"] == "kvzip:attend_to=context"
  assert kvjax.CompressionSpec(**spec.to_dict()) == spec
