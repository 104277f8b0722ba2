import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from pallas_kernels.group_importance import group_importance
from kvjax.eviction.fixed_shape import lowest
from kvjax.testing import assert_cache_invariants


def _filled(cfg, n, layers=1, batch=1, heads=1, d=4, protected=None):
  cache = kvjax.init_cache(cfg, layers, batch, heads, d, chunk=n)
  k = jnp.broadcast_to(
      jnp.arange(n, dtype=jnp.float32)[None, None, :, None, None], (layers, batch, n, heads, d)
  )
  return kvjax.append(cache, k, k, jnp.broadcast_to(jnp.arange(n), (batch, n)), None, protected)


def _positions(cache, layer=0):
  return kvjax.read_sequence(cache, layer, 0, 0)[2].tolist()


def test_block_eviction_drops_lowest_pages_and_moves_no_data():
  cfg = kvjax.CacheConfig(page_size=4, max_tokens=32, budget=12, sink=1, recent=1)
  cache = _filled(cfg, 20)
  pages_before = np.asarray(cache.page_table[0, 0, 0, :5])
  # Page scores (mean): page 0 = sink, pages 2 and 3 lowest, page 4 = recent.
  scores = jnp.repeat(jnp.array([9, 5, 1, 2, 7, 0, 0, 0], jnp.float32), 4)[None, None, None]
  evicted = kvjax.evict(cache, scores=scores)
  assert _positions(evicted) == [*range(0, 8), *range(16, 20)]
  np.testing.assert_array_equal(evicted.page_table[0, 0, 0, :3], pages_before[[0, 1, 4]])
  np.testing.assert_array_equal(evicted.k_pages, cache.k_pages)  # a page-table operation
  assert_cache_invariants(evicted)


def test_token_eviction_keeps_top_tokens_in_order():
  cfg = kvjax.CacheConfig(
      page_size=4, max_tokens=32, budget=5, sink=1, recent=1, group_size=1, threshold=6
  )
  cache = _filled(cfg, 10)
  scores = jnp.array([0, 9, 1, 8, 2, 7, 3, 0, 0, 0] + [0] * 22, jnp.float32)[None, None, None]
  evicted = kvjax.evict(cache, scores=scores)
  assert _positions(evicted) == [0, 1, 3, 5, 9]
  assert int(evicted.pages_in_use().sum()) == 2
  k, _, _ = kvjax.read_sequence(evicted, 0, 0, 0)
  np.testing.assert_array_equal(k[:, 0], [0, 1, 3, 5, 9])
  assert_cache_invariants(evicted)


def test_sequences_under_threshold_are_untouched():
  cfg = kvjax.CacheConfig(page_size=4, max_tokens=32, budget=8, group_size=1)
  cache = _filled(cfg, 12)  # threshold = 12: not passed
  assert _positions(kvjax.evict(cache, scores=jnp.zeros((1, 1, 1, 32)))) == list(range(12))


def test_per_layer_budgets_hold_fewer_pages():
  cfg = kvjax.CacheConfig(page_size=4, max_tokens=64, budget=16, group_size=1)
  cache = _filled(cfg, 40, layers=3)
  scores = jnp.zeros((3, 1, 1, 64))
  uniform = kvjax.evict(cache, scores=scores)
  pyramid = kvjax.evict(cache, scores=scores, budget=jnp.array([16, 8, 4])[:, None, None])
  assert uniform.length.ravel().tolist() == [16, 16, 16]
  assert pyramid.length.ravel().tolist() == [16, 8, 4]
  assert int(pyramid.pages_in_use().sum()) < int(uniform.pages_in_use().sum())
  assert pyramid.kv_bytes() < uniform.kv_bytes()
  assert_cache_invariants(pyramid)


def test_marked_tokens_beyond_budget_are_kept_with_a_warning():
  cfg = kvjax.CacheConfig(page_size=4, max_tokens=32, budget=4, group_size=1)
  protected = jnp.ones((1, 10), bool).at[0, 9].set(False)
  cache = kvjax.evict(_filled(cfg, 10, protected=protected), scores=jnp.zeros((1, 1, 1, 32)))
  assert _positions(cache) == list(range(9))
  assert kvjax.Status(int(cache.status)) & kvjax.Status.OVER_BUDGET
  with pytest.warns(
      UserWarning,
      match=r"protected tokens \(a question, marked segments\) with the sink and recent window exceed budget=4",
  ):
    kvjax.check_status(cache)


def test_evict_rejects_bad_scores():
  cfg = kvjax.CacheConfig(page_size=4, max_tokens=32, budget=8)
  cache = _filled(cfg, 4)
  with pytest.raises(ValueError, match=r"scores must be \[L, B, H, N\] = \(1, 1, 1, 32\)"):
    kvjax.evict(cache, scores=jnp.zeros((1, 1, 32)))


def test_group_importance_reductions_and_errors():
  scores = jnp.array([[1.0, 3.0, 2.0, 6.0, np.nan, 0.0]])
  protected = jnp.array([[False, False, False, False, True, False]])
  np.testing.assert_array_equal(
      group_importance(scores, 2, protected, "mean"), [[2.0, 4.0, np.inf]]
  )
  np.testing.assert_array_equal(group_importance(scores, 2, protected, "sum"), [[4.0, 8.0, np.inf]])
  np.testing.assert_array_equal(group_importance(scores, 3, protected, "max"), [[3.0, np.inf]])
  with pytest.raises(ValueError, match="group_size=4 must divide the token axis T=6"):
    group_importance(scores, 4, protected)
  with pytest.raises(ValueError, match="reduce must be one of"):
    group_importance(scores, 2, protected, "median")
  with pytest.raises(ValueError, match="protected shape"):
    group_importance(scores, 2, protected[:, :4])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("values", ["distinct", "ties", "specials"])
def test_lowest_picks_what_a_stable_argsort_picks(seed, values):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(6, 37)).astype(np.float32)
  if values == "ties":  # few distinct values: ties decided by index
    x = np.round(x).astype(np.float32)
  if values == "specials":
    specials = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-45, -1e-45], np.float32)
    x = np.where(rng.random(x.shape) < 0.4, rng.choice(specials, size=x.shape), x)
  k = np.array([0, 1, 5, 18, 37, 50])  # 50 > M: every entry
  ranks = np.asarray(jnp.argsort(jnp.argsort(jnp.asarray(x), axis=-1, stable=True), axis=-1))
  expected = ranks < k[:, None]
  np.testing.assert_array_equal(np.asarray(lowest(jnp.asarray(x), jnp.asarray(k))), expected)


@pytest.mark.parametrize(
    "x, k, message",
    [
        (jnp.float32(1.0), 1, "x must have a last axis"),
        (
            jnp.zeros((3, 5)),
            jnp.array([1, 2]),
            r"k of shape \(2,\) does not broadcast to x's rows \(3,\)",
        ),
    ],
)
def test_lowest_refuses_shapes_it_cannot_choose_along(x, k, message):
  with pytest.raises(ValueError, match=message):
    lowest(x, k)


def test_lowest_hand_case():
  x = jnp.array([[3.0, 1.0, 2.0, 1.0, -jnp.inf, 5.0]])
  # -inf, then the two 1.0s (earlier index first), then 2.0
  assert lowest(x, 3).tolist() == [[False, True, False, True, True, False]]
  assert lowest(x, 4).tolist() == [[False, True, True, True, True, False]]
  assert lowest(x, 0).tolist() == [[False] * 6]


def test_non_finite_scores_are_evicted_first_and_reported():
  """NaN and -inf scores say nothing for their tokens: they go first (+inf ones last), the
  status says so, and the host warning names the scores, not protected tokens."""
  cfg = kvjax.CacheConfig(page_size=4, max_tokens=32, budget=6, sink=1, group_size=1)
  cache = _filled(cfg, 12)
  scores = np.array([0, 5, np.nan, 6, -np.inf, 7, 8, np.inf, 9, 4, 3, 2] + [0] * 20, np.float32)
  evicted = kvjax.evict(cache, scores=jnp.asarray(scores)[None, None, None])
  # Kept: the sink, then the 5 best by rank (NaN, -inf lowest; +inf highest).
  assert _positions(evicted) == [0, 3, 5, 6, 7, 8]
  status = kvjax.Status(int(evicted.status))
  assert status & kvjax.Status.NONFINITE_SCORES and not status & kvjax.Status.OVER_BUDGET
  with pytest.warns(UserWarning, match="scored some tokens NaN or infinite") as caught:
    kvjax.check_status(evicted)
  assert not any("protected tokens" in str(w.message) for w in caught)
  assert_cache_invariants(evicted)
  finite = jnp.nan_to_num(jnp.asarray(scores), posinf=1.0, neginf=0.0)
  finite = kvjax.evict(cache, scores=finite[None, None, None])
  assert not kvjax.Status(int(finite.status)) & kvjax.Status.NONFINITE_SCORES
