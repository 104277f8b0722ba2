import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.testing import assert_cache_invariants

L, B, H, D = 2, 2, 3, 8


def _kv(rng, t, layers=L):
  k = jnp.asarray(rng.normal(size=(layers, B, t, H, D)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(layers, B, t, H, D)), jnp.float32)
  return k, v


def _positions(start, t):
  return jnp.broadcast_to(jnp.arange(start, start + t, dtype=jnp.int32), (B, t))


@pytest.mark.parametrize("use_jit", [False, True])
def test_append_then_read_back_ragged_rows(use_jit):
  rng = np.random.default_rng(0)
  cfg = kvjax.CacheConfig(page_size=4, max_tokens=32)
  cache = kvjax.init_cache(cfg, L, B, H, D)
  append = jax.jit(kvjax.append) if use_jit else kvjax.append
  k1, v1 = _kv(rng, 6)
  cache = append(cache, k1, v1, _positions(0, 6), jnp.array([6, 3]))
  k2, v2 = _kv(rng, 1)
  cache = append(cache, k2, v2, jnp.array([[6], [3]]))
  assert_cache_invariants(cache)
  np.testing.assert_array_equal(cache.length[:, 0], 7)
  np.testing.assert_array_equal(cache.length[:, 1], 4)
  for layer in range(L):
    for head in range(H):
      k, v, pos = kvjax.read_sequence(cache, layer, 1, head)
      np.testing.assert_array_equal(pos, [0, 1, 2, 3])
      np.testing.assert_array_equal(
          k, np.concatenate([k1[layer, 1, :3, head], k2[layer, 1, :, head]])
      )
      np.testing.assert_array_equal(
          v, np.concatenate([v1[layer, 1, :3, head], v2[layer, 1, :, head]])
      )


def test_jit_and_eager_agree_bitwise():
  rng = np.random.default_rng(1)
  cfg = kvjax.CacheConfig(page_size=4, max_tokens=32, budget=12, sink=1, recent=2, group_size=1)
  k, v = _kv(rng, 20)
  score = jnp.asarray(rng.random((L, B, H, 32)), jnp.float32)

  def run(cache):
    cache = kvjax.append(cache, k, v, _positions(0, 20), jnp.array([20, 15]))
    return kvjax.evict(cache, scores=score)

  cache = kvjax.init_cache(cfg, L, B, H, D, chunk=20)
  eager, jitted = run(cache), jax.jit(run)(cache)
  for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
    np.testing.assert_array_equal(a, b)


def test_out_of_pages_is_a_status_and_a_host_error():
  rng = np.random.default_rng(2)
  cfg = kvjax.CacheConfig(page_size=4, max_tokens=32, num_pages=8)
  cache = kvjax.init_cache(cfg, L, B, H, D)
  k, v = _kv(rng, 4)
  cache = jax.jit(kvjax.append)(cache, k, v, _positions(0, 4))  # needs 12 pages, has 7
  assert kvjax.Status(int(cache.status)) & kvjax.Status.OUT_OF_PAGES
  assert_cache_invariants(cache)  # the failed append left the allocator consistent
  with pytest.raises(kvjax.CacheError, match="out of pages: the pool of 8 pages"):
    kvjax.check_status(cache)


def test_over_capacity_is_a_status_and_a_host_error():
  rng = np.random.default_rng(3)
  cfg = kvjax.CacheConfig(page_size=4, max_tokens=8)
  cache = kvjax.init_cache(cfg, L, B, H, D)
  k, v = _kv(rng, 6)
  cache = kvjax.append(cache, k, v, _positions(0, 6))
  cache = kvjax.append(cache, k, v, _positions(6, 6))
  assert int(cache.length.max()) == 6, "the overflowing append must be dropped whole"
  with pytest.raises(kvjax.CacheError, match="max_tokens=8"):
    kvjax.read_sequence(cache, 0, 0, 0)


def test_freed_pages_do_not_leak_into_new_owner():
  rng = np.random.default_rng(4)
  cfg = kvjax.CacheConfig(page_size=4, max_tokens=32, budget=8, sink=0, recent=0)
  cache = kvjax.init_cache(cfg, 1, 1, 1, D, chunk=16)
  k, v = _kv(rng, 16, layers=1)
  cache = kvjax.append(cache, k[:, :1, :, :1], v[:, :1, :, :1], jnp.arange(16)[None])
  cache = kvjax.evict(cache, scores=jnp.arange(32, dtype=jnp.float32)[None, None, None])
  assert int(cache.length[0, 0, 0]) == 8
  assert_cache_invariants(cache)
  k2, v2 = _kv(rng, 1, layers=1)
  cache = kvjax.append(cache, k2[:, :1, :, :1], v2[:, :1, :, :1], jnp.array([[16]]))
  _, _, pos = kvjax.read_sequence(cache, 0, 0, 0)
  np.testing.assert_array_equal(pos, [8, 9, 10, 11, 12, 13, 14, 15, 16])
  # The reused page held evicted tokens before; its other slots are empty now.
  page = int(cache.page_table[0, 0, 0, 2])
  np.testing.assert_array_equal(cache.slot("position")[page], [16, -1, -1, -1])


def test_decode_loop_compiles_once():
  rng = np.random.default_rng(5)
  cfg = kvjax.CacheConfig(page_size=4, max_tokens=64, budget=16, sink=2, recent=4, group_size=1)
  traces = []

  @jax.jit
  def step(cache, k, v, pos, score):
    traces.append(1)
    cache = kvjax.append(cache, k, v, pos)
    return kvjax.evict(cache, scores=kvjax.logical_view(cache, score))

  cache = kvjax.init_cache(cfg, L, B, H, D)
  for i in range(40):
    k, v = _kv(rng, 1)
    score = jnp.asarray(rng.random(cache.k_pages.shape[:2]), jnp.float32)
    cache = step(cache, k, v, jnp.full((B, 1), i, jnp.int32), score)
  kvjax.check_status(cache)
  assert len(traces) == 1
  assert int(cache.length.max()) <= cfg.threshold
  assert_cache_invariants(cache)


def test_kv_bytes_counts_live_pages():
  cfg = kvjax.CacheConfig(page_size=4, max_tokens=32)
  cache = kvjax.init_cache(cfg, L, B, H, D)
  k, v = _kv(np.random.default_rng(6), 5)
  cache = kvjax.append(cache, k, v, _positions(0, 5))
  assert cache.kv_bytes() == L * B * H * 2 * 2 * 4 * D * 4  # 2 pages each, K and V


@pytest.mark.parametrize(
    "change, error, match",
    [
        (
            dict(k=np.zeros((L, B, 2, H, D + 1), np.float32)),
            ValueError,
            r"k must be \[L, B, T, H, D\]",
        ),
        (dict(v=np.zeros((L, B, 3, H, D), np.float32)), ValueError, r"v must be"),
        (dict(k=np.zeros((L, B, 2, H, D), np.int32)), TypeError, "k must be floating point"),
        (dict(positions=np.zeros((B,), np.int32)), ValueError, r"positions must be \[B, T\]"),
        (dict(positions=np.zeros((B, 2), np.float32)), TypeError, "positions must be integer"),
        (dict(num_new=np.zeros((B + 1,), np.int32)), ValueError, r"num_new must be \[B\]"),
        (dict(protected=np.zeros((B, 2), np.int32)), ValueError, "protected must be bool"),
    ],
)
def test_append_rejects_bad_arguments(change, error, match):
  cache = kvjax.init_cache(kvjax.CacheConfig(page_size=4, max_tokens=32), L, B, H, D)
  args = dict(
      k=np.zeros((L, B, 2, H, D), np.float32),
      v=np.zeros((L, B, 2, H, D), np.float32),
      positions=np.zeros((B, 2), np.int32),
      num_new=None,
      protected=None,
  )
  args.update(change)
  args = {name: None if x is None else jnp.asarray(x) for name, x in args.items()}
  with pytest.raises(error, match=match):
    kvjax.append(cache, **args)


def test_append_rejects_chunk_longer_than_capacity_and_bad_cache():
  cache = kvjax.init_cache(kvjax.CacheConfig(page_size=4, max_tokens=8), 1, 1, 1, D)
  k = jnp.zeros((1, 1, 9, 1, D))
  with pytest.raises(ValueError, match="T=9 tokens exceeds max_tokens=8"):
    kvjax.append(cache, k, k, jnp.zeros((1, 9), jnp.int32))
  with pytest.raises(TypeError, match="cache must be a PagedKVCache"):
    kvjax.append({}, k, k, jnp.zeros((1, 9), jnp.int32))
  with pytest.raises(ValueError, match=r"head=1 out of range \[0, 1\)"):
    kvjax.read_sequence(cache, 0, 0, 1)
