"""Policies scored by how much removing a token would change the attention's output: the
exact output impact, and its square (DropKV)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
from jaxtyping import Array, Float

from kvjax._checks import check_int
from kvjax.policies import scores as S
from kvjax.cache.paged_cache import Slot, logical_view
from kvjax.policies.base import SCORE, Policy, read_layer, write_layer
from pallas_kernels import output_impact as output_impact_kernel


@dataclasses.dataclass(frozen=True)
class OutputImpact(Policy):
  """Accumulated exact output impact r_i = a_i/(1-a_i) ||v_i - O|| (summed over the query
  heads of a kv head) of the last `window` queries of each chunk (every decode query).

  In the model it calls the output-impact kernel dispatcher (`impl` = the model's
  `attention_impl`), which recomputes a_i from q, K and the attention's lse; stats without
  lse (hand-made ones) take the jnp specification on `head_probs`."""

  name: ClassVar[str] = "output_impact"
  slots: ClassVar[tuple[Slot, ...]] = (SCORE,)
  reads: ClassVar[frozenset[str]] = frozenset({"lse"})  # the kernel recomputes a_i from q, K, lse
  window: int = 8
  decay: float = 1.0
  squared: bool = False  # sum (a/(1-a))^2 ||v - O||^2 instead (DropKV): see `DropKV`

  def __post_init__(self):
    check_int(f"{type(self).__name__} window", self.window)

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
