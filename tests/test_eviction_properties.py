"""Property tests: random append / score / evict sequences keep every cache invariant."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
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


def _snapshot(cache):
  """Per sequence: list of (position, protected, k row, v row) in logical order."""
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
            )
        )
  return out


op = st.tuples(
    st.sampled_from(CHUNKS),
    st.lists(st.floats(0.0, 1.0), min_size=B, max_size=B),  # fraction of the chunk per row
    st.integers(0, 2**31 - 1),  # seed for data, scores and marks
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=st.sampled_from(CONFIGS), ops=st.lists(op, min_size=1, max_size=12))
def test_random_append_evict_sequences_keep_invariants(config, ops):
  cache = kvjax.init_cache(config, L, B, H, D, chunk=max(CHUNKS))
  next_pos = np.zeros(B, np.int32)
  for t, fractions, seed in ops:
    rng = np.random.default_rng(seed)
    num_new = np.array([round(f * t) for f in fractions], np.int32)
    positions = next_pos[:, None] + np.arange(t, dtype=np.int32)
    next_pos += num_new
    k = rng.normal(size=(L, B, t, H, D)).astype(np.float32)
    v = rng.normal(size=(L, B, t, H, D)).astype(np.float32)
    marked = rng.random((B, t)) < 0.1
    score = rng.random(cache.k_pages.shape[:2]).astype(np.float32)
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

    pre, post = _snapshot(before), _snapshot(cache)
    for seq, tokens in pre.items():
      kept = post[seq]
      # Survivors keep their bytes, positions and order: a subsequence of what was there.
      kept_positions = [tok[0] for tok in kept]
      assert kept_positions == sorted(kept_positions)
      by_position = {tok[0]: tok for tok in tokens}
      assert all(by_position[tok[0]] == tok for tok in kept)
      n = len(tokens)
      must_keep = {
          tok[0]
          for i, tok in enumerate(tokens)
          if i < config.sink or i >= n - config.recent or tok[1]
      }
      assert must_keep <= set(kept_positions), "a protected token was evicted"
      if n <= config.threshold:
        assert len(kept) == n
      else:
        assert len(kept) <= config.budget or status & kvjax.Status.OVER_BUDGET
        assert (n - len(kept)) % config.group_size == 0
