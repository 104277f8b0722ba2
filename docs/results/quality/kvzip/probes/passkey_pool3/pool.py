# Ran on kvjax at c536944, the commit that recorded its results (results.md beside it);
# not edited since. It is a patch to kvjax internals as they were at that commit.
# The probe's change to kvjax/policies/kvzip.py (not kept): option `pool: int = 1`, applied
# at the end of KVzip.score_context as `cache = _pooled(cache, self.pool)` when pool > 1.


@functools.partial(jax.jit, static_argnames="width")
def _pooled(cache, width):
  """Each live token's score raised to the highest of the `width` tokens centred on it in its
  sequence (a kept token brings its neighbours: the text the model reads stays phrases)."""
  score = cache.slot("score")  # [P, S]
  table = cache.page_table  # [L, B, H, M]
  valid = valid_mask(cache)  # [L, B, H, N]
  logical = logical_view(cache, score)  # [L, B, H, N]
  x = jnp.where(valid, logical, -jnp.inf)
  pooled = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 1, 1, width), (1,) * 4, "SAME")
  pooled = jnp.where(valid, pooled, logical).reshape(*table.shape, -1)  # [L, B, H, M, S]
  target = jnp.where(table == NULL_PAGE, score.shape[0], table)  # unused entries dropped
  return cache.with_slots(score=score.at[target].set(pooled, mode="drop"))
