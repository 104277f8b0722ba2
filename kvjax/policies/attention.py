"""Policies scored by the attention the cached tokens receive: accumulated (H2O, its mean,
page groups), the latest query's (TOVA), an observation window's (SnapKV)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax._checks import check_int
from kvjax.policies import scores as S
from kvjax.cache.paged_cache import Slot, logical_view, valid_mask
from kvjax.policies.base import SCORE, Policy, read_layer, write_layer


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
  granularity: ClassVar[str] = "page"


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

  def __post_init__(self):
    check_int("SnapKV window", self.window)
    check_int("SnapKV kernel", self.kernel)

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
