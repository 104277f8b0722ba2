"""Expected Attention: the attention future queries are expected to pay each key."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from kvjax.policies import scores as S
from kvjax.cache.paged_cache import Slot, logical_view, valid_mask
from kvjax.policies.base import SCORE, Policy, require_model_method, write_layer
from kvjax._checks import check_int


@dataclasses.dataclass(frozen=True)
class ExpectedAttention(Policy):
  """Expected Attention (Devoto et al., 2025; kvpress' ExpectedAttentionPress),
  query-agnostic: the attention future queries are expected to pay each key, estimated from
  the distribution of the context's own queries.

  While the context is read, each layer keeps the running mean and covariance of every query
  head's queries before RoPE (the first `sink` positions left out: attention sinks ask
  atypical questions), in `cache.extra`. The queries of the `n_future` positions after the
  context are modelled as q = R_p q0 with q0 ~ N(mu, Sigma); averaging the rotation over
  those positions (Rbar) gives mu' = Rbar mu and Sigma' = Rbar Sigma Rbar^T, to compare with
  the cached keys, already rotated (q_p . k_j = (R_p q0) . (R_j k0)). A key's score is the
  softmax over its sequence of the expected logit `kvjax.policies.scores.expected_attention`,
  averaged over the query heads of its kv head, times ||v_j|| (`use_vnorm`).

  The statistics are gathered while the context is read; the keys are scored once it is
  read (`score_context`: a pass over the layers, after the last query is counted), not
  after every chunk: only the last scores count, and rescoring every live key after each
  chunk (the same final scores) made an 8,000-token read of the default model 19 % slower
  on a 2-core CPU. Needs the model's position encoding: the optional seam method
  `model.rotate(x, positions)`."""

  name: ClassVar[str] = "expected_attention"
  slots: ClassVar[tuple[Slot, ...]] = (SCORE,)
  reads: ClassVar[frozenset[str]] = frozenset()  # observe reads the queries and the keys
  mode: ClassVar[str] = "once"
  n_future: int = 512  # future query positions the rotation is averaged over
  use_covariance: bool = True  # the k^T Sigma' k / 2D term; False: the mean query only
  use_vnorm: bool = True  # weigh each key's expected attention by ||v_j||

  def __post_init__(self):
    check_int("n_future", self.n_future)
    for name in ("use_covariance", "use_vnorm"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

  def check_model(self, model):
    require_model_method(self, model, "rotate(x, positions)", "needs the model's position encoding")

  def init_extra(self, num_layers, batch, num_kv_heads, num_query_heads, head_dim):
    # Host-made zeros: device transfers, no eager op to compile.
    zeros = lambda *shape: np.zeros((num_layers, batch, *shape), np.float32)  # noqa: E731
    extra = {"query_count": zeros(), "query_mean": zeros(num_query_heads, head_dim)}
    if self.use_covariance:
      extra["query_m2"] = zeros(num_query_heads, head_dim, head_dim)
    return extra

  def observe(self, cache, stats):
    if stats.rotate is None or stats.positions is None:
      raise ValueError(
          f"policy {self.name!r} needs the chunk's positions and the model's `rotate` in "
          "AttentionStats (kvjax.seam.forward passes them for a model with `rotate`)"
      )
    layer, extra = stats.layer, cache.extra
    t = stats.q.shape[1]
    live = (jnp.arange(t) < stats.num_new[:, None]) & (stats.positions >= cache.config.sink)
    # RoPE undone: a query's content, the same whatever position asks it.
    unrotated = stats.rotate(stats.q.astype(jnp.float32), -stats.positions)  # [B, T, Hq, D]
    m2 = extra["query_m2"][layer] if self.use_covariance else None
    count, mean, m2 = S.merge_moments(
        extra["query_count"][layer], extra["query_mean"][layer], m2, unrotated, live
    )
    updated = {
        "query_count": extra["query_count"].at[layer].set(count),
        "query_mean": extra["query_mean"].at[layer].set(mean),
    }
    if self.use_covariance:
      updated["query_m2"] = extra["query_m2"].at[layer].set(m2)
    return cache.with_extra(**updated)

  def score_context(self, reader, state, context, progress=None):
    """Reads the context, gathering its queries' statistics, then scores every key from
    them, layer by layer. `progress` counts the tokens read, then the keys scored."""
    longest = int(context.lengths.max())
    work = reader.progress(progress, 2 * longest)
    state = reader.read(state, context, progress=work.part(longest))
    return reader.score_layers(state, self, progress=work.part(longest))

  def score_layer(self, cache, model, layer, next_position):
    """One layer's scores from the statistics of the context's queries: the future queries
    start at `next_position` [B] (after each row's last token)."""
    extra = cache.extra
    count, mean = extra["query_count"][layer], extra["query_mean"][layer]  # [B], [B, Hq, D]
    rbar = S.mean_rotation(model.rotate, next_position, self.n_future, mean.shape[-1])
    future_mean = jnp.einsum("bij,bhj->bhi", rbar, mean)
    future_cov = None
    if self.use_covariance:
      cov = extra["query_m2"][layer] / jnp.maximum(count, 1.0)[:, None, None, None]
      future_cov = jnp.einsum("bij,bhjk,blk->bhil", rbar, cov, rbar)
    values = logical_view(cache, cache.v_pages, layer) if self.use_vnorm else None
    score = S.expected_attention(
        logical_view(cache, cache.k_pages, layer),
        future_mean,
        future_cov,
        valid_mask(cache, layer),
        values,
    )
    return write_layer(cache, "score", layer, score)


POLICIES: dict[str, type[Policy]] = {}
