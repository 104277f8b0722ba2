"""Expected Attention: the score formula on hand-computed cases, the mean future rotation,
query statistics accumulated across chunks, the scores of a chunked prefill against a direct
computation from the model's own queries, compression through the session, the cache's
`extra` state, and models without `rotate`."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax import policies
from kvjax.policies import scores as S
from kvjax.policies import AttentionStats, ExpectedAttention
from kvjax.runtime.state import copy as _copy
from kvjax.testing import ByteTokenizer, assert_cache_invariants, assert_compressed_once, tiny_llama

CONTEXT = "The vault code is 4812. Remember it while the filler goes on and on. " * 4


@pytest.fixture(scope="module")
def tiny():
  return tiny_llama(max_context=1024, n_layers=2), ByteTokenizer()


@pytest.fixture(scope="module")
def sharp():
  """The tiny model with 20x larger q and k weights: the random model's logits are near 0
  and its attention near uniform; these make the scores depend on the query statistics."""
  return tiny_llama(max_context=1024, n_layers=2, qk_scale=20.0)


def _rope_matrix(position, inv_freq):
  """R_p [D, D] of half-rotation RoPE: [[C, -S], [S, C]] with angles p * inv_freq."""
  angles = position * np.float64(inv_freq)
  c, s = np.diag(np.cos(angles)), np.diag(np.sin(angles))
  return np.block([[c, -s], [s, c]])


def _no_position_encoding(x, positions):
  return x


# ---- the formula ----------------------------------------------------------------------------


def test_expected_attention_on_a_hand_computed_case():
  # D = 2, one kv head read by two query heads; keys (1, 0), (0, 1), (0, 0) and an empty slot.
  # Head 0: mean (sqrt(2) ln 2, 0), cov diag(0, 4 ln 3): expected logits
  #   z = mean.k / sqrt(2) + k^T cov k / 4 = (ln 2, ln 3, 0) -> softmax (2, 3, 1) / 6.
  # Head 1: mean 0, cov 0 -> uniform (2, 2, 2) / 6. Averaged: (4, 5, 3) / 12; x ||v|| (1, 2, 3).
  keys = np.array([[1, 0], [0, 1], [0, 0], [7, 7]], np.float32)[None, None]  # [1, 1, 4, 2]
  values = np.array([[1, 0], [0, 2], [3, 0], [5, 5]], np.float32)[None, None]
  mean = np.array([[np.sqrt(2) * np.log(2), 0], [0, 0]], np.float32)[None]  # [1, 2, 2]
  cov = np.zeros((1, 2, 2, 2), np.float32)
  cov[0, 0, 1, 1] = 4 * np.log(3)
  valid = np.array([True, True, True, False])[None, None]
  args = jnp.asarray(keys), jnp.asarray(mean), jnp.asarray(cov), jnp.asarray(valid)
  np.testing.assert_allclose(
      S.expected_attention(*args)[0, 0], [4 / 12, 5 / 12, 3 / 12, 0], rtol=1e-6
  )
  with_vnorm = S.expected_attention(*args, values=jnp.asarray(values))[0, 0]
  np.testing.assert_allclose(with_vnorm, [4 / 12, 10 / 12, 9 / 12, 0], rtol=1e-6)
  # Without the covariance term head 0's logits are (ln 2, 0, 0): softmax (2, 1, 1) / 4.
  no_cov = S.expected_attention(args[0], args[1], None, args[3])[0, 0]
  np.testing.assert_allclose(no_cov, [5 / 12, 7 / 24, 7 / 24, 0], rtol=1e-6)
  # A sequence with no live key scores 0 everywhere, not NaN.
  empty = S.expected_attention(args[0], args[1], args[2], jnp.zeros_like(args[3]))
  np.testing.assert_array_equal(empty, 0.0)


def test_policy_scores_with_identity_rotation_follow_the_formula():
  """observe() on a hand-made cache gathers the statistics of the chunk's queries (the
  sink's left out); score_layer() then gives, rotated by the identity, the formula's scores
  for every live key."""
  cfg = kvjax.CacheConfig(page_size=4, max_tokens=16, budget=4, sink=1, recent=1, group_size=1)
  rng = np.random.default_rng(0)
  d, n = 4, 6
  keys = rng.normal(size=(n, 1, d)).astype(np.float32)
  values = rng.normal(size=(n, 1, d)).astype(np.float32)
  policy = ExpectedAttention()
  cache = kvjax.init_cache(
      cfg, 1, 1, 1, d, chunk=n, slots=policy.slots, extra=policy.init_extra(1, 1, 1, 2, d)
  )
  cache = kvjax.append(cache, keys[None, None], values[None, None], jnp.arange(n)[None])
  q = rng.normal(size=(1, n, 2, d)).astype(np.float32)  # two query heads
  stats = AttentionStats(
      layer=jnp.int32(0),
      q=jnp.asarray(q),
      out=jnp.zeros((1, n, 2, d)),
      probs=jnp.zeros((1, 1, n, 16)),
      head_probs=None,
      num_new=jnp.array([n], jnp.int32),
      positions=jnp.arange(n)[None],
      rotate=_no_position_encoding,
  )
  cache = policy.observe(cache, stats)
  assert not np.asarray(cache.slot("score")).any()  # scored once the context is read
  identity = types.SimpleNamespace(rotate=_no_position_encoding)
  cache = policy.score_layer(cache, identity, 0, jnp.array([n]))
  score = np.asarray(kvjax.logical_view(cache, cache.slot("score")))[0, 0, 0]
  seen = q[0, 1:]  # [T - sink, Hq, D]
  mean = seen.mean(0)
  cov = np.einsum("thd,the->hde", seen - mean, seen - mean) / len(seen)
  k = np.float64(keys[:, 0])
  z = mean @ k.T / np.sqrt(d) + np.einsum("nd,hde,ne->hn", k, cov, k) / (2 * d)  # [Hq, N]
  probs = np.exp(z - z.max(-1, keepdims=True))
  expected = (probs / probs.sum(-1, keepdims=True)).mean(0) * np.linalg.norm(values[:, 0], axis=-1)
  np.testing.assert_allclose(score[:n], expected, rtol=1e-5)
  np.testing.assert_array_equal(score[n:], 0.0)


def test_mean_rotation_of_rope_matches_numpy(tiny):
  model, _ = tiny
  d = model.config.head_dim
  inv_freq = np.asarray(model.inv_freq[...])
  start, count = np.array([5, 300]), 37
  rbar = np.asarray(S.mean_rotation(model.rotate, jnp.asarray(start), count, d))
  for row, first in enumerate(start):
    expected = np.mean([_rope_matrix(p, inv_freq) for p in range(first, first + count)], axis=0)
    np.testing.assert_allclose(rbar[row], expected, atol=1e-5)
  # A negative position undoes the rotation (what the policy relies on to recover q0).
  x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 4, d)), jnp.float32)
  positions = jnp.asarray([[0, 7, 900], [1, 2, 3]])
  np.testing.assert_allclose(model.rotate(model.rotate(x, positions), -positions), x, atol=1e-5)


def test_statistics_of_two_chunks_equal_those_of_one_chunk_with_every_query():
  rng = np.random.default_rng(2)
  b, h, d = 2, 3, 4
  # Large means: raw sums of x x^T would cancel badly in float32; centred moments do not.
  first = rng.normal(50.0, 1.0, size=(b, 5, h, d)).astype(np.float32)
  second = rng.normal(50.0, 2.0, size=(b, 7, h, d)).astype(np.float32)
  live_first = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], bool)  # row 1: 2 live, 3 padded
  live_second = np.array([[1] * 7, [1, 1, 1, 1, 0, 0, 0]], bool)
  first[~live_first] = 1e4  # padding must not count
  second[~live_second] = -1e4
  start = (jnp.zeros(b), jnp.zeros((b, h, d)), jnp.zeros((b, h, d, d)))
  merged = S.merge_moments(*start, jnp.asarray(first), jnp.asarray(live_first))
  merged = S.merge_moments(*merged, jnp.asarray(second), jnp.asarray(live_second))
  both = S.merge_moments(
      *start,
      jnp.concatenate([first, second], axis=1),
      jnp.concatenate([live_first, live_second], axis=1),
  )
  for got, want in zip(merged, both):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
  count, mean, m2 = merged
  for row in range(b):
    x = np.float64(np.concatenate([first[row][live_first[row]], second[row][live_second[row]]]))
    assert count[row] == len(x)
    np.testing.assert_allclose(mean[row], x.mean(0), rtol=1e-6)
    centred = x - x.mean(0)
    np.testing.assert_allclose(
        m2[row], np.einsum("thd,the->hde", centred, centred), rtol=1e-4, atol=1e-3
    )
  # The mean alone when the covariance is not kept.
  assert S.merge_moments(*start[:2], None, jnp.asarray(first), jnp.asarray(live_first))[2] is None


# ---- through the model ----------------------------------------------------------------------


def _model_qkv(model, ids):
  """The model's own post-RoPE q [L, T, Hq, D], k and v [L, T, Hkv, D] on `ids`, with dense
  causal attention."""
  c = model.config
  t = len(ids)

  def record(q, k, v, state, layer):
    g = q.shape[2] // k.shape[2]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, g, 2)) / np.sqrt(q.shape[-1])
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -jnp.inf)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), jnp.repeat(v, g, 2))
    return out, {n: state[n].at[layer].set(x[0]) for n, x in (("q", q), ("k", k), ("v", v))}

  state = {
      "q": jnp.zeros((c.n_layers, t, c.n_heads, c.head_dim)),
      "k": jnp.zeros((c.n_layers, t, c.n_kv_heads, c.head_dim)),
      "v": jnp.zeros((c.n_layers, t, c.n_kv_heads, c.head_dim)),
  }
  tokens = jnp.asarray([ids], jnp.int32)
  _, state = model.run(tokens, jnp.arange(t)[None], state, record)
  return {name: np.float64(x) for name, x in state.items()}


def _reference_scores(model, ids, sink, n_future):
  """Expected Attention of every key of `ids` [L, Hkv, T], straight from the definition."""
  qkv = _model_qkv(model, ids)
  c = model.config
  t, d, group = len(ids), c.head_dim, c.n_heads // c.n_kv_heads
  inv_freq = np.asarray(model.inv_freq[...])
  unrotate = np.stack([_rope_matrix(-p, inv_freq) for p in range(t)])  # [T, D, D]
  rbar = np.mean([_rope_matrix(p, inv_freq) for p in range(t, t + n_future)], axis=0)
  out = np.zeros((c.n_layers, c.n_kv_heads, t))
  for layer in range(c.n_layers):
    q0 = np.einsum("tij,thj->thi", unrotate, qkv["q"][layer])[sink:]  # [T - sink, Hq, D]
    mean = q0.mean(0)
    cov = np.einsum("thd,the->hde", q0 - mean, q0 - mean) / len(q0)
    mean, cov = mean @ rbar.T, rbar @ cov @ rbar.T
    for head in range(c.n_heads):
      k = qkv["k"][layer, :, head // group]  # [T, D], rotated as cached
      z = k @ mean[head] / np.sqrt(d) + np.einsum("td,de,te->t", k, cov[head], k) / (2 * d)
      p = np.exp(z - z.max())
      out[layer, head // group] += p / p.sum() / group
    out[layer] *= np.linalg.norm(qkv["v"][layer], axis=-1).T
  return out


def test_chunked_prefill_scores_equal_the_definition_on_the_models_own_queries(sharp):
  """Two rows of different lengths read in chunks of 32: the statistics accumulated over
  the chunks, un-rotated and rotated to each row's own future (the short row's starts
  after its own end, chunks before the long row's), give the scores computed directly from
  every query of the row."""
  model, tokenizer = sharp, ByteTokenizer()
  rows = [tokenizer.encode(CONTEXT[:150]), tokenizer.encode(CONTEXT[:70])]
  policy = ExpectedAttention(n_future=64)
  spec = kvjax.CompressionSpec(policy=policy, budget=0.25, prefill_chunk=32, sink=4)
  scores, valid = kvjax.runtime.session.context_scores(model, rows, spec)
  for row, ids in enumerate(rows):
    t = len(ids)
    assert valid[:, row, :, :t].all() and not valid[:, row, :, t:].any()
    want = _reference_scores(model, ids, sink=4, n_future=64)
    assert want.max() > 50 * want.mean()  # far from uniform: the statistics decide
    np.testing.assert_allclose(scores[:, row, :, :t], want, rtol=1e-4)


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_prefill_compresses_unevenly_and_decoding_continues(tiny):
  model, tokenizer = tiny
  c = model.config
  spec = kvjax.CompressionSpec(policy="expected_attention", budget=0.25, prefill_chunk=64)
  state = kvjax.prefill(model, [CONTEXT], spec, tokenizer=tokenizer, reserve=16)
  n = len(tokenizer.encode(CONTEXT))
  cache = state.cache
  assert_compressed_once(state, n)
  assert cache.num_pages - 1 < c.n_layers * c.n_kv_heads * -(-n // spec.page_size) / 2
  assert cache.extra == {}  # the statistics are dropped with the policy
  state = kvjax.extend(model, state, [" What is the code?"], tokenizer=tokenizer)
  state, result = kvjax.decode(model, state, 16)
  assert len(result.tokens[0]) == 16
  assert_cache_invariants(state.cache)


class _NoRotate(nnx.Module):
  """A model with the seam's required part only: no `rotate`."""

  def __init__(self, inner):
    self.inner = inner
    self.config = inner.config

  def run(self, *args, **kwargs):
    return self.inner.run(*args, **kwargs)


def test_a_model_without_rotate_is_refused(tiny):
  model, tokenizer = tiny
  spec = kvjax.CompressionSpec(policy="expected_attention", budget=0.25)
  with pytest.raises(ValueError, match=r"_NoRotate has no `rotate\(x, positions\)` method"):
    kvjax.prefill(_NoRotate(model), [CONTEXT], spec, tokenizer=tokenizer)
  # Hand-made stats without positions or rotate are refused too, not scored wrongly.
  policy = ExpectedAttention()
  cfg = kvjax.CacheConfig(page_size=4, max_tokens=16, budget=4, sink=0, recent=0, group_size=1)
  cache = kvjax.init_cache(
      cfg, 1, 1, 1, 2, slots=policy.slots, extra=policy.init_extra(1, 1, 1, 1, 2)
  )
  stats = AttentionStats(
      jnp.int32(0), jnp.zeros((1, 1, 1, 2)), jnp.zeros((1, 1, 1, 2)), None, None, jnp.ones(1)
  )
  with pytest.raises(ValueError, match="needs the chunk's positions and the model's `rotate`"):
    policy.observe(cache, stats)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("n_future", 0, "n_future must be an int >= 1"),
        ("n_future", 2.5, "n_future must be an int >= 1"),
        ("use_covariance", 1, "use_covariance must be True or False"),
        ("use_vnorm", None, "use_vnorm must be True or False"),
    ],
)
def test_bad_fields_are_refused(field, value, match):
  with pytest.raises(ValueError, match=match):
    ExpectedAttention(**{field: value})


def test_without_covariance_only_the_mean_is_kept():
  extra = ExpectedAttention(use_covariance=False).init_extra(2, 1, 2, 4, 8)
  assert {name: x.shape for name, x in extra.items()} == {
      "query_count": (2, 1),
      "query_mean": (2, 1, 4, 8),
  }
  assert policies.get_policy("expected_attention") == ExpectedAttention()


# ---- the cache's extra state ----------------------------------------------------------------


def test_extra_state_travels_through_every_cache_operation():
  cfg = kvjax.CacheConfig(page_size=4, max_tokens=32, budget=8, sink=1, recent=1, group_size=1)
  marker = np.arange(6, dtype=np.float32).reshape(2, 3)
  cache = kvjax.init_cache(cfg, 1, 1, 1, 4, chunk=16, extra={"marker": marker})
  k = jnp.ones((1, 1, 16, 1, 4))
  cache = kvjax.append(cache, k, k, jnp.arange(16)[None])
  evicted = jax.jit(kvjax.evict)(cache, jnp.zeros((1, 1, 1, 32)))
  assert int(evicted.length.max()) == 8
  truncated = kvjax.eviction.fixed_shape.truncate(evicted, jnp.full((1, 1, 1), 4))
  for c in (cache, evicted, truncated, _copy(truncated)):
    np.testing.assert_array_equal(c.extra["marker"], marker)
  updated = truncated.with_extra(marker=jnp.zeros((2, 3)))
  np.testing.assert_array_equal(updated.extra["marker"], 0.0)
  with pytest.raises(KeyError, match="no extra state 'other'; declared: marker"):
    truncated.with_extra(other=jnp.zeros(1))
  with pytest.raises(TypeError, match="extra must be a dict of named arrays"):
    kvjax.init_cache(cfg, 1, 1, 1, 4, extra=[marker])


def test_the_session_sizes_the_statistics_by_the_models_query_heads(tiny, monkeypatch):
  """Statistics per query head (Hq = 4 on the tiny model, 2 kv heads), allocated at prefill,
  carried through every chunk; only compress-once scoring needs them."""
  model, tokenizer = tiny
  c = model.config
  assert kvjax.seam.query_heads(model) == c.n_heads == 4
  spec = kvjax.CompressionSpec(policy="expected_attention", budget=0.25, prefill_chunk=32)
  state = kvjax.runtime.session.begin(
      model, [CONTEXT[:40]], spec, tokenizer, False, 0, 0, None
  ).state
  shapes = {name: x.shape for name, x in state.cache.extra.items()}
  assert shapes == {
      "query_count": (c.n_layers, 1),
      "query_mean": (c.n_layers, 1, 4, c.head_dim),
      "query_m2": (c.n_layers, 1, 4, c.head_dim, c.head_dim),
  }
  # Other policies keep none (and cost no abstract call of the model).
  monkeypatch.setattr(kvjax.runtime.session, "query_heads", None)
  h2o = kvjax.CompressionSpec(policy="h2o", budget=16, page_size=4)
  state = kvjax.runtime.session.begin(
      model, [CONTEXT[:40]], h2o, tokenizer, False, 0, 0, None
  ).state
  assert state.cache.extra == {}
