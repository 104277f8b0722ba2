"""Property tests: random append / score / evict sequences keep every cache invariant."""

import functools

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvjax
from kvjax.testing import assert_cache_invariants

L, B, H, D = 2, 2, 2, 4
CHUNKS = (1, 3, 8)
CONFIGS = (
    kvjax.CacheConfig(page_size=4, max_tokens=48, budget=16, sink=2, recent=3),
    kvjax.CacheConfig(page_size=4, max_tokens=48, budget=10, sink=1, recent=2, group_size=1),
    kvjax.CacheConfig(page_size=8, max_tokens=48, budget=8, group_reduce="max"),
    kvjax.CacheConfig(
        page_size=2, max_tokens=48, budget=7, sink=3, recent=0, group_size=1, group_reduce="sum"
    ),
)


@functools.partial(jax.jit, static_argnames=())
def _step(cache, k, v, positions, num_new, protected, score):
  cache = kvjax.append(cache, k, v, positions, num_new, protected)
  return cache, kvjax.evict(cache, scores=kvjax.logical_view(cache, score))


def _snapshot(cache, score=None):
  """Per sequence: list of (position, protected, k row, v row[, score]) in logical order."""
  cache = jax.device_get(cache)
  out = {}
  for l in range(L):
    for b in range(B):
      for h in range(H):
        n = int(cache.length[l, b, h])
        table = cache.page_table[l, b, h]
        flat = lambda x: x[table].reshape(-1, *x.shape[2:])[:n]  # noqa: E731
        out[l, b, h] = list(
            zip(
                flat(cache.slots["position"]).tolist(),
                flat(cache.slots["protected"]).tolist(),
                map(tuple, flat(cache.k_pages)),
                map(tuple, flat(cache.v_pages)),
                *([] if score is None else [flat(score).tolist()]),
            )
        )
  return out


op = st.tuples(
    st.sampled_from(CHUNKS),
    st.lists(st.floats(0.0, 1.0), min_size=B, max_size=B),  # fraction of the chunk per row
    st.integers(0, 2**31 - 1),  # seed for data, scores and marks
    st.sampled_from(("uniform", "ties", "nonfinite")),  # how scores are drawn
)
_REDUCE = {"mean": np.mean, "sum": np.sum, "max": np.max}


def _scores(rng, shape, kind):
  """Scores per slot: uniform, or few distinct values (ties), or ties with NaN and ±inf."""
  if kind == "uniform":
    return rng.random(shape).astype(np.float32)
  score = rng.choice(np.array([0.0, 0.5, 1.0], np.float32), shape)
  if kind == "nonfinite":
    special = rng.random(shape) < 0.15
    score[special] = rng.choice(np.array([np.nan, -np.inf, np.inf], np.float32), special.sum())
  return score


def _check_choice(config, tokens, kept):
  """What eviction owes one sequence it evicted from: protected groups kept; over budget
  only when every evictable group went; every evicted group ranked no higher than every
  kept one (NaN and -inf lowest, +inf highest). Returns whether an evictable group's score
  was not finite (then the status must say so)."""
  g, n = config.group_size, len(tokens)
  guard = [i < config.sink or i >= n - config.recent or tok[1] for i, tok in enumerate(tokens)]
  kept_positions = {tok[0] for tok in kept}
  groups = []  # (guarded, kept, rank, finite)
  for start in range(0, n, g):
    members = range(start, min(start + g, n))
    # A partly filled page holds empty slots, which are guarded too.
    guarded = any(guard[i] for i in members) or start + g > n
    score = np.float32(_REDUCE[config.group_reduce](np.float32([tokens[i][4] for i in members])))
    rank = -np.inf if np.isnan(score) else score
    groups.append((guarded, tokens[start][0] in kept_positions, rank, np.isfinite(score)))
  assert all(kept for guarded, kept, _, _ in groups if guarded), "a protected token was evicted"
  free = [(kept, rank, finite) for guarded, kept, rank, finite in groups if not guarded]
  if len(kept) > config.budget:
    assert not any(k for k, _, _ in free), "over budget while an evictable group was kept"
  evicted = [rank for k, rank, _ in free if not k]
  stayed = [rank for k, rank, _ in free if k]
  if evicted and stayed:
    assert max(evicted) <= min(stayed) + 1e-6, (evicted, stayed)
  return not all(finite for _, _, finite in free)


# 6 random sequences by default, 100 more under -m slow.
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=st.sampled_from(CONFIGS), ops=st.lists(op, min_size=1, max_size=12))
def test_random_append_evict_sequences_keep_invariants(config, ops):
  _random_sequence_keeps_invariants(config, ops)


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=st.sampled_from(CONFIGS), ops=st.lists(op, min_size=1, max_size=12))
def test_many_random_append_evict_sequences_keep_invariants(config, ops):
  _random_sequence_keeps_invariants(config, ops)


def _random_sequence_keeps_invariants(config, ops):
  cache = kvjax.init_cache(config, L, B, H, D, chunk=max(CHUNKS))
  next_pos = np.zeros(B, np.int32)
  nonfinite_seen = False
  for t, fractions, seed, kind in ops:
    rng = np.random.default_rng(seed)
    num_new = np.array([round(f * t) for f in fractions], np.int32)
    positions = next_pos[:, None] + np.arange(t, dtype=np.int32)
    next_pos += num_new
    k = rng.normal(size=(L, B, t, H, D)).astype(np.float32)
    v = rng.normal(size=(L, B, t, H, D)).astype(np.float32)
    marked = rng.random((B, t)) < 0.1
    score = _scores(rng, cache.k_pages.shape[:2], kind)
    lengths = np.asarray(cache.length)
    before, cache = _step(cache, k, v, positions, num_new, marked, score)
    assert_cache_invariants(before)
    assert_cache_invariants(cache)
    status = kvjax.Status(int(before.status))
    if status & (kvjax.Status.OUT_OF_PAGES | kvjax.Status.OVER_CAPACITY):
      # The pool is sized for sequences kept within budget; only marked tokens beyond the
      # budget may push it over, and then each layer's append lands whole or not at all.
      assert status & kvjax.Status.OVER_BUDGET
      grown = lengths + num_new[None, :, None]
      for layer in range(L):
        after = np.asarray(before.length[layer])
        assert (after == lengths[layer]).all() or (after == grown[layer]).all()
      return
    status = kvjax.Status(int(cache.status))

    pre, post = _snapshot(before, score), _snapshot(cache)
    for seq, tokens in pre.items():
      kept = post[seq]
      # Survivors keep their bytes, positions and order: a subsequence of what was there.
      kept_positions = [tok[0] for tok in kept]
      assert kept_positions == sorted(kept_positions)
      by_position = {tok[0]: tok[:4] for tok in tokens}
      assert all(by_position[tok[0]] == tok for tok in kept)
      n = len(tokens)
      if n <= config.threshold:
        assert len(kept) == n
      else:
        assert (n - len(kept)) % config.group_size == 0
        nonfinite_seen |= _check_choice(config, tokens, kept)
    assert bool(status & kvjax.Status.NONFINITE_SCORES) == nonfinite_seen
