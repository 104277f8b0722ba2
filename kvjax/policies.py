"""Eviction policies: what each token's score is, and how budgets are spread.

A policy is a frozen dataclass (hashable, so jitted code specialises on it) that declares
the per-token state it keeps (`slots`: name, dtype, empty value; the cache allocates them and
eviction moves them with K/V), any state that is not per token (`init_extra`, kept in
`cache.extra`), and has up to four hooks, all pure functions of the cache:

  observe(cache, stats)        after each layer's attention: update the score history
  observe_layer(cache, ...)    after each layer: per-token signals from hidden states
  observe_logits(cache, ...)   after the model's head: per-token signals from logits
  scores(cache, key)           at an eviction event: per-slot scores [L, B, H, N], higher = keep

A new score is a subclass overriding one or two hooks (see `docs/policies.md`); register it
with `register` to select it by name in `generate` and the CLI.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from kvjax import scores as S
from kvjax.scorer import Scorer, default_scorer
from kvjax.cache import PagedKVCache, Slot, logical_view, valid_mask
from kvjax.pages import token_slots
from kvjax.eviction import evict, lowest, protection_mask, sort_keys
from kvjax.sharding import all_heads, any_shard, my_heads, shard_key
from pallas_kernels import output_impact as output_impact_kernel


@dataclasses.dataclass(frozen=True)
class AttentionStats:
  """What one layer's attention saw, for `Policy.observe` (N = cache.config.max_tokens)."""

  layer: Int[Array, ""]
  q: Float[Array, "B T Hq D"]
  out: Float[Array, "B T Hq D"]
  probs: Float[Array, "B Hkv T N"] | None  # summed over the query heads of each kv head;
  # None for a policy that does not ask for them (`Policy.needs_probs`)
  head_probs: Float[Array, "B Hq T N"] | None  # only when the policy asks for it
  num_new: Int[Array, " B"]
  lse: Float[Array, "B T Hq"] | None = None  # per-query-head log-sum-exp, if asked for
  impl: str = "auto"  # the model's attention_impl, for policies that call kernels
  positions: Int[Array, "B T"] | None = None  # the chunk's token positions
  # The model's position encoding, `rotate(x [B, T, H, D], positions [B, T])`, None when the
  # model does not expose it (an optional part of the seam, see kvjax.seam).
  rotate: Callable[[Array, Array], Array] | None = None


SCORE = Slot("score", "float32", 0.0)  # a policy's running per-token score
INFO = Slot("info", "float32", 0.0)  # info_aware's per-token information


def read_layer(cache: PagedKVCache, name: str, layer) -> Array:
  """The per-slot array `name` of one layer in logical order: [B, H, N]."""
  return logical_view(cache, cache.slot(name), layer)


def write_layer(cache: PagedKVCache, name: str, layer, values: Float[Array, "B H N"]):
  """The cache with logical-order `values` written to one layer's live slots of `name`."""
  x = cache.slot(name)
  pages, offsets = cache.pages.slots(cache.config.page_size, layer)  # [B, H, N], [N]
  pages = jnp.where(valid_mask(cache, layer), pages, cache.num_pages)
  return cache.with_slots(**{name: x.at[pages, offsets].set(values.astype(x.dtype), mode="drop")})


def write_new_tokens(
    cache: PagedKVCache, name: str, layer, values: Float[Array, "B T *H"], num_new, *, add=False
):
  """The cache with per-token `values` set (or added) in slot `name` for the tokens just
  appended to one layer: the last num_new[b] tokens of every kv head of row b (`values`
  [B, T] for all kv heads alike, or [B, T, H] per kv head)."""
  b, t = values.shape[:2]
  page, offset = token_slots(
      cache.page_table[layer],
      cache.length[layer] - num_new[:, None],
      num_new,
      t,
      cache.config.page_size,
      cache.num_pages,
  )
  values = jnp.broadcast_to(values if values.ndim == 3 else values[..., None], page.shape)
  at = cache.slot(name).at[page, offset]
  return cache.with_slots(
      **{name: at.add(values, mode="drop") if add else at.set(values, mode="drop")}
  )


def _normalise(x: Float[Array, "... N"], valid) -> Float[Array, "... N"]:
  """Each live slot's rank among its sequence's live slots, scaled into [0, 1].

  Ranks, not x / max: attention histories are heavy-tailed (the sink tokens draw most of
  the attention), so dividing by the max squashed every evictable token near 0 and let
  the 0.1-weighted info term decide alone. The ranks come from one sort of uint32 keys in
  jnp.sort's order (a quarter of the time of a float sort on XLA:CPU) and two unrolled
  binary searches; ties share their average rank."""
  keys = sort_keys(jnp.where(valid, x, -jnp.inf))  # [..., N]
  ordered = jax.lax.sort(keys, dimension=keys.ndim - 1)
  search = jax.vmap(
      lambda row, values, side: jnp.searchsorted(row, values, side, method="scan_unrolled"),
      in_axes=(0, 0, None),
  )
  flat_sorted, flat_keys = ordered.reshape(-1, x.shape[-1]), keys.reshape(-1, x.shape[-1])
  below = search(flat_sorted, flat_keys, "left").reshape(x.shape)
  through = search(flat_sorted, flat_keys, "right").reshape(x.shape)
  rank = (below + through - 1).astype(jnp.float32) / 2
  dead = x.shape[-1] - valid.sum(-1, keepdims=True)  # empty slots rank first
  live = jnp.maximum(valid.sum(-1, keepdims=True) - 1, 1)
  return jnp.where(valid, jnp.clip(rank - dead, 0.0) / live, 0.0)


@dataclasses.dataclass(frozen=True)
class Policy:
  """Base policy: no state, no observation; `scores` reads the "score" slot if declared."""

  name: ClassVar[str] = "base"
  slots: ClassVar[tuple[Slot, ...]] = ()  # per-token state this policy keeps in the cache
  token_level: ClassVar[bool] = True  # default eviction granularity: tokens, else pages
  needs_head_probs: ClassVar[bool] = False
  needs_lse: ClassVar[bool] = False  # stats.lse: the attention's log-sum-exp
  needs_logits: ClassVar[bool] = False  # observe_logits needs logits of every token
  # Compresses the context once: nothing is evicted while it is read, then every sequence
  # keeps its share of one ranking of the whole scored context (`spec.head_budget`).
  query_agnostic: ClassVar[bool] = False
  # Scores come from the model repeating the context after it (KVzip), not from reading it.
  reconstructs: ClassVar[bool] = False
  # Keeps state that is not per token in `cache.extra` (`init_extra`).
  keeps_extra: ClassVar[bool] = False

  @property
  def needs_probs(self) -> bool:
    """Whether `observe` reads the attention probabilities (`stats.probs`): a policy that
    does not override `observe` gets none computed, so attention reads only live pages
    while it prefills. A policy whose `observe` reads only q, lse or the cache sets a class
    attribute `needs_probs = False`."""
    return type(self).observe is not Policy.observe

  def check_model(self, model) -> None:
    """Raises ValueError when this policy cannot score `model` (e.g. a scorer trained for
    another model). Called by `kvjax.prefill` before any work."""

  def init_extra(
      self, num_layers: int, batch: int, num_kv_heads: int, num_query_heads: int, head_dim: int
  ) -> dict[str, Array]:
    """The initial state this policy keeps beside the cache that is not per token (arrays by
    name, e.g. statistics per layer and row), when `keeps_extra`: the session puts it in
    `cache.extra`, every cache operation carries it, eviction leaves it alone."""
    return {}

  def observe(self, cache: PagedKVCache, stats: AttentionStats) -> PagedKVCache:
    return cache

  def observe_layer(self, cache, layer, hidden_in, hidden_out, num_new) -> PagedKVCache:
    return cache

  def observe_logits(self, cache, logits, num_new) -> PagedKVCache:
    return cache

  def scores(self, cache: PagedKVCache, key) -> Float[Array, "L B H N"]:
    return logical_view(cache, cache.slot(SCORE.name))


@dataclasses.dataclass(frozen=True)
class Full(Policy):
  """Keeps every token (no budget)."""

  name: ClassVar[str] = "full"


@dataclasses.dataclass(frozen=True)
class Streaming(Policy):
  """StreamingLLM: the sink tokens plus the most recent window."""

  name: ClassVar[str] = "streaming"

  def scores(self, cache, key):
    return jnp.broadcast_to(
        jnp.arange(cache.config.max_tokens, dtype=jnp.float32),
        (*cache.length.shape, cache.config.max_tokens),
    )


@dataclasses.dataclass(frozen=True)
class AttentionHistory(Policy):
  """Accumulated attention (H2O heavy hitters): s_i <- decay * s_i + sum_queries a_i."""

  name: ClassVar[str] = "h2o"
  slots: ClassVar[tuple[Slot, ...]] = (SCORE,)
  decay: float = 1.0

  def observe(self, cache, stats):
    history = read_layer(cache, "score", stats.layer)
    updated = S.accumulate_history(history, stats.probs.sum(axis=2), self.decay)
    return write_layer(cache, "score", stats.layer, updated)


@dataclasses.dataclass(frozen=True)
class MeanAttention(AttentionHistory):
  """h2o's history divided by the number of queries that could see each key: the plain sum
  favours early tokens, which every later query saw."""

  name: ClassVar[str] = "h2o_mean"

  def scores(self, cache, key):
    history = logical_view(cache, cache.slot(SCORE.name))  # [L, B, H, N]
    position = logical_view(cache, cache.slot("position"))
    newest = jnp.where(valid_mask(cache), position, -1).max(-1, keepdims=True)
    return history / jnp.maximum(newest - position + 1, 1).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class GroupHistory(AttentionHistory):
  """Attention history aggregated into page-group importance; lowest pages leave."""

  name: ClassVar[str] = "group_history"
  token_level: ClassVar[bool] = False


@dataclasses.dataclass(frozen=True)
class Tova(Policy):
  """TOVA: the attention of the most recent query only."""

  name: ClassVar[str] = "tova"
  slots: ClassVar[tuple[Slot, ...]] = (SCORE,)

  def observe(self, cache, stats):
    b = stats.probs.shape[0]
    last = jnp.maximum(stats.num_new - 1, 0)
    latest = stats.probs[jnp.arange(b), :, last]  # [B, Hkv, N]
    current = read_layer(cache, "score", stats.layer)
    latest = jnp.where((stats.num_new > 0)[:, None, None], latest, current)
    return write_layer(cache, "score", stats.layer, latest)


@dataclasses.dataclass(frozen=True)
class SnapKV(Policy):
  """SnapKV: attention of an observation window (the last `window` queries of the chunk),
  max-pooled over `kernel` neighbouring tokens. During decode the window is the newest
  query. The scores are replaced, not accumulated."""

  name: ClassVar[str] = "snapkv"
  slots: ClassVar[tuple[Slot, ...]] = (SCORE,)
  window: int = 32
  kernel: int = 7

  def observe(self, cache, stats):
    t = stats.probs.shape[2]
    q_idx = jnp.arange(t)
    in_window = (q_idx < stats.num_new[:, None]) & (q_idx >= stats.num_new[:, None] - self.window)
    votes = jnp.einsum("bkqn,bq->bkn", stats.probs, in_window.astype(jnp.float32))
    pooled = jax.lax.reduce_window(
        votes, -jnp.inf, jax.lax.max, (1, 1, self.kernel), (1, 1, 1), "SAME"
    )
    current = read_layer(cache, "score", stats.layer)
    pooled = jnp.where((stats.num_new > 0)[:, None, None], pooled, current)
    return write_layer(cache, "score", stats.layer, pooled)


@dataclasses.dataclass(frozen=True)
class KeyNorm(Policy):
  """Keeps the tokens with the smallest key L2 norm (low-norm keys draw attention)."""

  name: ClassVar[str] = "knorm"

  def scores(self, cache, key):
    # Norms over the pool, then their logical order: gathering [P, S] scalars instead of
    # every cached key's [D] row.
    return -logical_view(cache, jnp.linalg.norm(cache.k_pages.astype(jnp.float32), axis=-1))


@dataclasses.dataclass(frozen=True)
class Random(Policy):
  """Uniformly random scores at every eviction event (a floor for the others)."""

  name: ClassVar[str] = "random"

  def scores(self, cache, key):
    # On a sharded cache each shard draws its own (drawing the whole batch's on every device
    # to keep a block would cost [L, B, H, N] per device), so a mesh evicts other tokens
    # than one device: equally random.
    return jax.random.uniform(shard_key(key), (*cache.length.shape, cache.config.max_tokens))


@dataclasses.dataclass(frozen=True)
class OutputImpact(Policy):
  """Accumulated exact output impact r_i = a_i/(1-a_i) ||v_i - O|| (summed over the query
  heads of a kv head) of the last `window` queries of each chunk (every decode query).

  In the model it calls the output-impact kernel dispatcher (`impl` = the model's
  `attention_impl`), which recomputes a_i from q, K and the attention's lse; stats without
  lse (hand-made ones) take the jnp specification on `head_probs`."""

  name: ClassVar[str] = "output_impact"
  slots: ClassVar[tuple[Slot, ...]] = (SCORE,)
  needs_lse: ClassVar[bool] = True
  needs_probs: ClassVar[bool] = False  # the kernel recomputes a_i from q, K and lse
  window: int = 8
  decay: float = 1.0
  squared: bool = False  # sum (a/(1-a))^2 ||v - O||^2 instead (DropKV): see `DropKV`

  def observe(self, cache, stats):
    w = min(self.window, stats.q.shape[1])
    # The last w query indices of each row (clamped at 0 for rows with fewer tokens).
    q_idx = jnp.maximum(stats.num_new[:, None] - w + jnp.arange(w), 0)  # [B, W]
    live_q = jnp.arange(w) >= w - stats.num_new[:, None]  # [B, W]
    if stats.lse is None:
      impact = self._from_probs(cache, stats, q_idx, live_q)
    else:
      impact = self._from_kernel(cache, stats, q_idx, live_q)
    history = read_layer(cache, "score", stats.layer)
    updated = S.accumulate_history(history, impact, self.decay)
    return write_layer(cache, "score", stats.layer, updated)

  def _from_kernel(self, cache, stats, q_idx, live_q) -> Float[Array, "B Hkv N"]:
    rows = jnp.arange(stats.q.shape[0])
    length = cache.length[stats.layer]  # [B, Hkv], this chunk included
    impact = 0.0
    for j in range(q_idx.shape[1]):  # one query per call (the kernel's T == 1); 1 in decode
      at = q_idx[:, j]  # [B]
      # The query saw its own slot and those before: not the chunk's later tokens.
      seen = jnp.where(live_q[:, j, None], length - (stats.num_new - at - 1)[:, None], 0)
      impact += output_impact_kernel.output_impact(
          stats.q[rows, at][:, None],
          cache.k_pages,
          cache.v_pages,
          cache.page_table[stats.layer],
          seen,
          stats.out[rows, at][:, None],
          stats.lse[rows, at][:, None],
          squared=self.squared,
          impl=stats.impl,
      )
    return impact

  def _from_probs(self, cache, stats, q_idx, live_q) -> Float[Array, "B Hkv N"]:
    b, t, hq, d = stats.q.shape
    hkv = cache.num_kv_heads
    probs = jnp.take_along_axis(stats.head_probs, q_idx[:, None, :, None], axis=2)  # [B,Hq,W,N]
    out = jnp.take_along_axis(stats.out, q_idx[:, :, None, None], axis=1)  # [B, W, Hq, D]
    values = logical_view(cache, cache.v_pages, stats.layer)  # [B, Hkv, N, D]
    values = jnp.repeat(values, hq // hkv, axis=1)[:, :, None]  # [B, Hq, 1, N, D]
    impact = S.output_impact(probs, values, out.transpose(0, 2, 1, 3))  # [B, Hq, W, N]
    if self.squared:
      impact = jnp.square(impact)
    impact = jnp.einsum("bhwn,bw->bhn", impact, live_q.astype(jnp.float32))
    return impact.reshape(b, hkv, hq // hkv, -1).sum(axis=2)


@dataclasses.dataclass(frozen=True)
class DropKV(OutputImpact):
  """The squared output impact, accumulated: s_i += sum_h (a_hi/(1-a_hi))^2 ||v_i - O_h||^2
  over the window's queries (DropKV, proposed for kvpress). Squared changes of a head's
  output add up as energy across query heads, queries and layers, so one ranking across
  heads (`head_budget='layer'` or `'global'`) compares like with like."""

  name: ClassVar[str] = "dropkv"
  squared: bool = True


@dataclasses.dataclass(frozen=True)
class InfoAware(AttentionHistory):
  """alpha * norm(attention history) + (1 - alpha) * norm(info), where a token's info is
  the mean of its normalised predictive entropy (H / log V) and its layer-wise hidden-state
  change (1 - cos(h^l, h^(l-1))) / 2."""

  name: ClassVar[str] = "info_aware"
  slots: ClassVar[tuple[Slot, ...]] = (SCORE, INFO)
  needs_logits: ClassVar[bool] = True
  alpha: float = 0.9

  def observe_layer(self, cache, layer, hidden_in, hidden_out, num_new):
    change = S.layer_change(hidden_out, hidden_in) / 2.0  # [B, T]
    return write_new_tokens(cache, "info", layer, 0.5 * change, num_new)

  def observe_logits(self, cache, logits, num_new):
    entropy = S.predictive_entropy(logits) / math.log(logits.shape[-1])  # [B, T]

    def add(layer, info):
      cache_ = cache.with_slots(info=info)
      return write_new_tokens(cache_, "info", layer, 0.5 * entropy, num_new, add=True).slot("info")

    return cache.with_slots(info=jax.lax.fori_loop(0, cache.num_layers, add, cache.slot("info")))

  def scores(self, cache, key):
    valid = valid_mask(cache)
    attention = _normalise(logical_view(cache, cache.slot("score")), valid)
    info = _normalise(logical_view(cache, cache.slot("info")), valid)
    return self.alpha * attention + (1.0 - self.alpha) * info


@dataclasses.dataclass(frozen=True)
class KVzip(Policy):
  """KVzip (Kim et al., 2025), query-agnostic. After the context is prefilled (nothing
  evicted), the model is asked to repeat it, `chunk` context tokens at a time on a fork of
  the state; a KV pair's score is the largest attention it receives from those
  reconstruction queries (max over the query heads of its kv head). One ranking across all
  layers and kv heads of a row then sets how many tokens each sequence keeps, and the pool
  is re-laid out to what is kept: the compressed context serves any later question."""

  name: ClassVar[str] = "kvzip"
  slots: ClassVar[tuple[Slot, ...]] = (SCORE,)
  needs_head_probs: ClassVar[bool] = True
  query_agnostic: ClassVar[bool] = True
  reconstructs: ClassVar[bool] = True
  chunk: int = 512  # context tokens repeated per reconstruction pass

  def observe(self, cache, stats):
    # stats.head_probs: [B, Hq, T, N]; padded queries (t >= num_new) count for nothing.
    b, hq, t, n = stats.head_probs.shape
    live = (jnp.arange(t) < stats.num_new[:, None])[:, None, :, None]  # [B, 1, T, 1]
    probs = jnp.where(live, stats.head_probs, 0.0)
    peak = probs.reshape(b, cache.num_kv_heads, hq // cache.num_kv_heads * t, n).max(axis=2)
    current = read_layer(cache, "score", stats.layer)
    return write_layer(cache, "score", stats.layer, jnp.maximum(current, peak))


@dataclasses.dataclass(frozen=True)
class Learned(Policy):
  """KVzap-style (Jégou & Jeblick, 2026), query-agnostic: a linear model per layer maps each
  token's hidden state (the layer's input, RMS-normalised) to the log of the score `kvzip`
  would give it, one output per kv head. Scoring costs one [d, H] product per token and
  layer while the context is read: no reconstruction pass. Train one for a model with
  `kvjax train-scorer` (`kvjax.training`); the default model's ships with kvjax."""

  name: ClassVar[str] = "learned"
  slots: ClassVar[tuple[Slot, ...]] = (SCORE,)
  query_agnostic: ClassVar[bool] = True
  scorer: Scorer | None = None  # None: the scorer shipped for the default model

  def __post_init__(self):
    if self.scorer is None:
      object.__setattr__(self, "scorer", default_scorer())
    elif not isinstance(self.scorer, Scorer):
      raise TypeError(f"scorer must be a kvjax.scorer.Scorer, got {type(self.scorer).__name__}")

  def check_model(self, model):
    self.scorer.check_model(model)

  def observe_layer(self, cache, layer, hidden_in, hidden_out, num_new):
    predicted = self.scorer.predict(hidden_in, layer)  # [B, T, H]: every kv head's score
    predicted = my_heads(predicted, axis=2, local=cache.num_kv_heads)  # a shard's own heads
    return write_new_tokens(cache, "score", layer, predicted, num_new)


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
  softmax over its sequence of the expected logit `kvjax.scores.expected_attention`,
  averaged over the query heads of its kv head, times ||v_j|| (`use_vnorm`).

  Scores are recomputed from the statistics so far after each chunk (for every live key of
  the layer), so after the last chunk they reflect the whole context. Needs the model's
  position encoding: the optional seam method `model.rotate(x, positions)`."""

  name: ClassVar[str] = "expected_attention"
  slots: ClassVar[tuple[Slot, ...]] = (SCORE,)
  query_agnostic: ClassVar[bool] = True
  keeps_extra: ClassVar[bool] = True
  needs_probs: ClassVar[bool] = False  # observe reads the queries and the cached keys
  n_future: int = 512  # future query positions the rotation is averaged over
  use_covariance: bool = True  # the k^T Sigma' k / 2D term; False: the mean query only
  use_vnorm: bool = True  # weigh each key's expected attention by ||v_j||

  def __post_init__(self):
    if isinstance(self.n_future, bool) or not isinstance(self.n_future, int) or self.n_future < 1:
      raise ValueError(f"n_future must be an int >= 1, got {self.n_future!r}")
    for name in ("use_covariance", "use_vnorm"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

  def check_model(self, model):
    if not callable(getattr(model, "rotate", None)):
      raise ValueError(
          f"policy {self.name!r} needs the model's position encoding: "
          f"{type(model).__name__} has no `rotate(x, positions)` method (an optional part of "
          "the seam, see docs/integration.md)"
      )

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
    b, t, _, d = stats.q.shape
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
    cache = cache.with_extra(**updated)
    # Future queries start right after the row's last token read so far.
    last = jnp.maximum(stats.num_new - 1, 0)
    after = stats.positions[jnp.arange(b), last] + 1  # [B]
    rbar = S.mean_rotation(stats.rotate, after, self.n_future, d)  # [B, D, D]
    future_mean = jnp.einsum("bij,bhj->bhi", rbar, mean)
    future_cov = None
    if self.use_covariance:
      cov = m2 / jnp.maximum(count, 1.0)[:, None, None, None]  # [B, Hq, D, D]
      future_cov = jnp.einsum("bij,bhjk,blk->bhil", rbar, cov, rbar)
    values = logical_view(cache, cache.v_pages, layer) if self.use_vnorm else None
    score = S.expected_attention(
        logical_view(cache, cache.k_pages, layer),
        future_mean,
        future_cov,
        valid_mask(cache, layer),
        values,
    )
    # A row with nothing new in this chunk keeps the scores it has.
    score = jnp.where((stats.num_new > 0)[:, None, None], score, read_layer(cache, "score", layer))
    return write_layer(cache, "score", layer, score)


POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
  """Makes a policy class selectable by its `name` (usable as a decorator)."""
  POLICIES[cls.name] = cls
  return cls


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
    Learned,
    ExpectedAttention,
):
  register(_cls)


def get_policy(policy: str | Policy, *, scorer: str | None = None) -> Policy:
  """The policy of a name (or the policy itself); `scorer`: a trained scorer's directory
  for 'learned'."""
  if isinstance(policy, Policy):
    return policy
  if policy not in POLICIES:
    raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
  if scorer is not None:
    return POLICIES[policy](scorer=Scorer.load(scorer))
  return POLICIES[policy]()


# ---- budgets -------------------------------------------------------------------------------

BUDGET_SCHEDULES = ("uniform", "pyramid")


def layer_budgets(
    budget: int, num_layers: int, schedule: str, group: int, floor: int
) -> np.ndarray:
  """Per-layer token budgets averaging `budget`: uniform, or pyramid (PyramidKV: lower
  layers keep more, linearly from 1.5x to 0.5x), multiples of `group`, at least `floor`."""
  if schedule not in BUDGET_SCHEDULES:
    raise ValueError(f"budget schedule must be one of {BUDGET_SCHEDULES}, got {schedule!r}")
  if schedule == "uniform" or num_layers == 1:
    return np.full((num_layers,), budget, np.int32)
  total = budget * num_layers
  if floor * num_layers > total:
    raise ValueError(f"budget={budget} is below the floor {floor} every layer needs")
  raw = budget * np.linspace(1.5, 0.5, num_layers)
  pinned = np.zeros(num_layers, bool)
  while True:  # pin layers below the floor, rescale the rest to what is left
    free = total - floor * pinned.sum()
    raw = np.where(pinned, floor, raw * free / raw[~pinned].sum())
    low = ~pinned & (raw < floor)
    if not low.any():
      break
    pinned |= low
  out = np.maximum(np.floor(raw / group) * group, floor).astype(np.int64)
  # Hand the rounding remainder to the lowest layers, one group at a time.
  for i in range(int((total - out.sum()) // group)):
    out[i % num_layers] += group
  return out.astype(np.int32)


HEAD_BUDGETS = ("uniform", "layer", "global")
ADAKV_FLOOR = 0.2  # with head_budget='layer', every head keeps this share of the budget


def head_budgets(
    scores: Float[Array, "L B H N"],
    protected,
    valid,
    layer_budget: Int[Array, " L"],
    sharing: str,
    *,
    threshold: float | None = None,
    floor: float = ADAKV_FLOOR,
) -> Int[Array, "L B H"]:
  """Tokens each sequence keeps (protected ones always count in) when a budget is shared:

  - 'uniform': every sequence keeps its layer's budget;
  - 'layer' (AdaKV): each layer's H x budget best tokens of a row by one ranking across its
    kv heads, after every head's own `floor` x budget best;
  - 'global' (KVzip): a row's sum-over-layers H x budget best tokens by one ranking across
    all its layers and kv heads;
  - `threshold` (budget='auto'): every token scored above it, whatever the count.
  """
  l, b, h, n = scores.shape
  keep = protected & valid
  if threshold is not None:
    return (keep | (valid & (scores > threshold))).sum(-1).astype(jnp.int32)
  layer_budget = jnp.broadcast_to(jnp.asarray(layer_budget, jnp.int32), (l,))
  if sharing == "uniform":
    return jnp.broadcast_to(layer_budget[:, None, None], (l, b, h))
  # A ranking across kv heads: on a sharded cache, over the heads of every model shard
  # (gathered once), so each shard keeps what one device would; then this shard's heads.
  local_heads = h
  scores, keep, valid = (all_heads(x, axis=2) for x in (scores, keep, valid))
  h = scores.shape[2]
  ranked = jnp.where(keep, jnp.inf, jnp.where(valid, scores, -jnp.inf))
  if sharing == "layer":
    if floor > 0:  # each head's own best `floor` share counts in first
      k = jnp.clip((floor * layer_budget).astype(jnp.int32), 1, n)[:, None, None]  # [L, 1, 1]
      ranked = jnp.where(valid & _best(ranked, k), jnp.inf, ranked)
    kept = _best(ranked.reshape(l, b, h * n), (layer_budget * h)[:, None]).reshape(l, b, h, n)
  elif sharing == "global":
    per_row = ranked.transpose(1, 0, 2, 3).reshape(b, l * h * n)
    kept = _best(per_row, layer_budget.sum() * h).reshape(b, l, h, n).transpose(1, 0, 2, 3)
  else:
    raise ValueError(f"sharing must be one of {HEAD_BUDGETS}, got {sharing!r}")
  counts = ((kept | keep) & valid).sum(-1).astype(jnp.int32)
  return my_heads(counts, axis=2, local=local_heads)


def _best(x: Float[Array, "... M"], k) -> Bool[Array, "... M"]:
  """The `k` largest entries of each row of x (k broadcast to x.shape[:-1]); ties go to
  the earlier index, so exactly k are chosen and a tie never passes the budget."""
  return lowest(-x, k)


def fair_scores(scores: Float[Array, "L B H N"], segment, valid) -> Float[Array, "L B H N"]:
  """Replaces scores by their quantile within the token's segment, so that evicting the
  lowest takes the same fraction of every segment (segment 0 is the unmarked rest)."""
  n = scores.shape[-1]
  empty = jnp.iinfo(jnp.int32).max  # empty slots form their own, last, segment
  seg = jnp.where(valid, segment, empty)
  by_score = jnp.argsort(scores, axis=-1, stable=True)
  by_segment = jnp.argsort(jnp.take_along_axis(seg, by_score, -1), axis=-1, stable=True)
  order = jnp.take_along_axis(by_score, by_segment, -1)  # slots sorted by (segment, score)
  run = jnp.take_along_axis(seg, order, -1)
  pos = jnp.broadcast_to(jnp.arange(n), run.shape)
  first = jnp.concatenate([jnp.ones_like(run[..., :1], bool), run[..., 1:] != run[..., :-1]], -1)
  last = jnp.concatenate([run[..., 1:] != run[..., :-1], jnp.ones_like(run[..., :1], bool)], -1)
  start = jax.lax.cummax(jnp.where(first, pos, 0), axis=run.ndim - 1)
  end = jax.lax.cummin(jnp.where(last, pos, n), axis=run.ndim - 1, reverse=True)
  quantile = (pos - start + 1).astype(jnp.float32) / (end - start + 1).astype(jnp.float32)
  return jnp.take_along_axis(quantile, jnp.argsort(order, axis=-1), -1)


@dataclasses.dataclass(frozen=True)
class EvictionPlan:
  """How a cache is kept within budget: the policy, per-layer budgets, per-head split and
  fair eviction over marked segments. Static (hashable) so jitted steps specialise on it.

  `evict=False` keeps the policy observing (its scores update) but never evicts: the cost
  benchmark times eviction as the difference against such a plan."""

  policy: Policy
  layer_budget: tuple[int, ...]
  per_head: bool = False
  fair: bool = False
  evict: bool = True
  impl: str = "auto"  # group-importance kernel

  def apply(self, cache: PagedKVCache, key) -> PagedKVCache:
    """Evicts where a sequence (or, per head, a layer) passed its threshold."""
    cfg = cache.config
    if not cfg.evicts or not self.evict:
      return cache
    budget = jnp.asarray(self.layer_budget, jnp.int32)  # [L]
    margin = cfg.threshold - cfg.budget
    if self.per_head:
      length = all_heads(cache.length, axis=2)  # a sharded cache: every kv head of the row
      needs = length.sum(-1) > length.shape[2] * (budget[:, None] + margin)  # [L, B]
    else:
      needs = cache.length > budget[:, None, None] + margin

    def run(cache):
      scores = self.policy.scores(cache, key)
      valid = valid_mask(cache)
      if self.fair:
        scores = fair_scores(scores, logical_view(cache, cache.slot("segment")), valid)
      if not self.per_head:
        return evict(cache, scores=scores, budget=budget[:, None, None], impl=self.impl)
      head_budget = head_budgets(scores, protection_mask(cache), valid, budget, "layer")
      # Evict every head of a triggered layer to its share; leave the others alone.
      limit = jnp.where(needs[..., None], head_budget, jnp.iinfo(jnp.int32).max // 2)
      return evict(cache, scores=scores, budget=limit, threshold=limit, impl=self.impl)

    # Only sequences past their threshold shrink, so a shard may decide alone; but a budget
    # shared across heads gathers them in `run` (a collective), which every shard must
    # then enter together.
    trigger = any_shard(needs.any()) if self.per_head else needs.any()
    return jax.lax.cond(trigger, run, lambda c: c, cache)
