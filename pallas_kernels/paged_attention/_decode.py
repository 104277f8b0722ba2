"""What the two decode kernels (`tpu`, `gpu`) share, written once: the online softmax inside a
kernel (its start, one block's step, the final normalisation) and the XLA epilogue that turns
their blocked logits and lse into the probabilities.

In a kernel, the G query heads of one kv head are the rows of the state: running max m
[G, 1], running sum l [G, 1] and output accumulator acc [G, D], all float32. The TPU kernel
keeps it in VMEM scratch across grid steps, the GPU kernel in a `fori_loop`'s carry; the
arithmetic is the same, so both give the same numbers from the same logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import PagedDecode, dot, unblock


def online_softmax_init(rows: int, head_dim: int):
  """The state before the first block: m = -inf [rows, 1], l = 0 [rows, 1], acc = 0
  [rows, D]."""
  return (
      jnp.full((rows, 1), -jnp.inf, jnp.float32),
      jnp.zeros((rows, 1), jnp.float32),
      jnp.zeros((rows, head_dim), jnp.float32),
  )


def online_softmax_step(state, s, v, precision=jax.lax.Precision.HIGHEST):
  """The state after one block of scaled logits s [rows, bk] f32 (-inf at dead slots) and
  V [bk, D] (dead rows zeroed, `mask_dead_slots`). The probabilities enter the P.V dot in
  V's dtype (a no-op for float32 V; bf16 operands for the tensor cores otherwise, as in
  flash attention), accumulated in float32."""
  m_prev, l_prev, acc_prev = state
  m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))  # finite: block has a live slot
  alpha = jnp.exp(m_prev - m_new)
  p = jnp.exp(s - m_new)  # masked slots: exp(-inf) = 0
  pv = dot(p.astype(v.dtype), v, ((1,), (0,)), precision)  # [rows, D]
  return m_new, alpha * l_prev + p.sum(axis=1, keepdims=True), alpha * acc_prev + pv


def online_softmax_result(state, empty_lse: float):
  """(out [rows, D] f32, lse [rows, 1]) from the final state. A row that saw no slot
  (l == 0) gives out = 0 and lse = `empty_lse` (+inf for a final result, so that
  exp(logit - lse) = 0 for any consumer; -inf for a GPU split, so that it weighs 0 in the
  combine). NaN (from a NaN key or value) stays NaN, never zeros."""
  m, l, acc = state
  seen = l != 0.0
  safe_l = jnp.where(seen, l, 1.0)
  return jnp.where(seen, acc / safe_l, 0.0), jnp.where(seen, m + jnp.log(safe_l), empty_lse)


def attention_epilogue(p: PagedDecode, out, logits, lse, per_query_head, return_lse):
  """The results of both decode kernels from their out [B, Hkv, G, D] (q's dtype),
  unnormalised logits [B, Hkv, blocks, G, bk] and lse [B, Hkv, G]: out [B, 1, Hq, D],
  probs [B, Hkv, 1, N] (or [B, Hq, 1, N] per query head) and, with `return_lse`, lse
  [B, 1, Hq]. The probabilities take one fused XLA pass; never-written blocks and dead
  slots are masked out by `where`."""
  b, hq, n = p.batch, p.q_heads, p.num_slots
  probs = jnp.exp(logits - lse[:, :, None, :, None])  # [B, Hkv, blocks, G, bk]
  if per_query_head:
    probs = unblock(p, probs).reshape(b, hq, 1, n)
  else:
    probs = unblock(p, probs.sum(axis=3, keepdims=True))  # [B, Hkv, 1, N]
  out = out.reshape(b, 1, hq, p.head_dim)
  if return_lse:
    return out, probs, lse.reshape(b, 1, hq)
  return out, probs
