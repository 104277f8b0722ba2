"""The TPU paged decode attention kernel (T == 1): `paged_attention_pallas`.

Design (TPU-style Pallas: `pltpu.PrefetchScalarGridSpec`, runs in interpret mode anywhere):

  grid = (B, Hkv, M / pages_per_block); the page table (flattened [B*Hkv*M]) and the
  visible lengths ([B*Hkv]) are scalar-prefetched, so the K/V BlockSpec index maps read
  the physical page of each logical page straight from the table: the pipeline DMAs one
  [S, D] page per operand per grid step. A block of `pages_per_block` pages is made by
  passing each pool `pages_per_block` times, operand j mapping to logical page
  i * pages_per_block + j (the same HBM buffer, no copy), so small pages still give
  ~128-token blocks. Logical pages past a sequence's length map to its last live page:
  consecutive grid steps then ask for the same block, so the pipeline issues no DMA, and
  the kernel skips them with `pl.when`.

  All G = Hq / Hkv query heads of a kv head form one [G, D] q block; the online softmax
  (`_decode`, shared with the GPU kernel) keeps a running max m [G, 1], running sum l
  [G, 1] and output accumulator [G, D] in VMEM scratch. Logits are masked with `where`
  (not added) before exp, and V rows past the length are zeroed before the weighted sum,
  so NaN in unused slots never leaks.

  Probabilities need the final max and sum, so the kernel emits the masked, scaled,
  *unnormalised* logits of each live block ([B, Hkv, M/ppb, G, ppb*S] f32; dead blocks
  are never written, hence never DMA'd back) and, at the last step, the per-query-head
  log-sum-exp lse [B, Hkv, G]. A cheap XLA epilogue computes
  probs = where(slot < length, exp(logits - lse), 0), summed over G (or reshaped per query
  head) in `_decode.attention_epilogue`. Its extra HBM traffic is 4*G bytes per slot
  written + read, against 2*D*itemsize bytes of K/V per slot read by the kernel (e.g. 12
  vs 256 bytes for G=3, D=64, bf16). The epilogue was preferred over a second kernel pass,
  which would read K again.

  Empty rows (length 0 or a padding query) give out = 0, probs = 0 and lse = +inf, so that
  exp(logit - lse) = 0 for any consumer of lse (e.g. the output-impact kernel).

  Backends: this kernel uses scalar prefetch, which only the Mosaic TPU lowering supports
  (Triton and Mosaic GPU raise NotImplementedError for it); GPUs get the Triton-style
  variant in `gpu`. impl="auto" picks Pallas on TPU only (`dispatch`).

  The prologue (sizes, visible lengths, padded page table), block specs, grid and block
  loading are shared with the output-impact kernel (`pallas_kernels._common`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from pallas_kernels._common import (
    decode_prologue,
    head_spec,
    kernel_block,
    live_block_spec,
    paged_pallas_call,
)
from pallas_kernels.paged_attention._decode import (
    attention_epilogue,
    online_softmax_init,
    online_softmax_result,
    online_softmax_step,
)

__all__ = ["paged_attention_pallas"]


def _paged_attention_kernel(
    table_ref,  # [B * Hkv * blocks * ppb] int32, scalar-prefetched (read by the index maps)
    lengths_ref,  # [B * Hkv] int32, visible slots
    q_ref,  # [G, D]
    *refs,  # K pages ppb x [S, D], V pages ppb x [S, D]; outputs; scratch
    scale,
    **layout,  # page_size, pages_per_block, num_kv_heads, kv_dtype
):
  i, live, out_refs, load = kernel_block(lengths_ref, q_ref, refs, scale=scale, **layout)
  out_ref, logits_ref, lse_ref, m_ref, l_ref, acc_ref = out_refs  # [G, D], [G, bk], [G, 1];
  # scratch: running max m [G, 1], running sum l [G, 1], output accumulator acc [G, D]

  @pl.when(i == 0)
  def _init():
    m_ref[...], l_ref[...], acc_ref[...] = online_softmax_init(*acc_ref.shape)

  @pl.when(live)
  def _block():
    s, _, v = load()  # [G, bk] (-inf at dead slots), [bk, D] (dead rows zeroed)
    logits_ref[...] = s
    state = online_softmax_step((m_ref[...], l_ref[...], acc_ref[...]), s, v)
    m_ref[...], l_ref[...], acc_ref[...] = state

  @pl.when(i == pl.num_programs(2) - 1)
  def _finish():
    out, lse = online_softmax_result((m_ref[...], l_ref[...], acc_ref[...]), jnp.inf)
    out_ref[...] = out.astype(out_ref.dtype)
    lse_ref[...] = lse


def paged_attention_pallas(
    q: Float[Array, "B 1 Hq D"],
    k_pages: Float[Array, "P S D"],
    v_pages: Float[Array, "P S D"],
    page_table: Int[Array, "B Hkv M"],
    lengths: Int[Array, "B Hkv"],
    num_queries: Int[Array, " B"] | None = None,
    *,
    scale: float | None = None,
    per_query_head: bool = False,
    return_lse: bool = False,
    pages_per_block: int | None = None,
    interpret: Any = False,
):
  """Pallas paged decode attention; same results as `paged_attention_reference` for T == 1.

  With `return_lse`, also returns the log-sum-exp of each query head's scaled logits,
  [B, 1, Hq] float32 (+inf for rows that see no slot). Arguments are not validated here
  (see `paged_attention`).
  """
  p = decode_prologue(
      "paged_attention_pallas", q, k_pages, page_table, lengths, num_queries, scale, pages_per_block
  )
  b, hkv, g, d = p.batch, p.kv_heads, p.group, p.head_dim
  out, logits, lse = paged_pallas_call(
      functools.partial(_paged_attention_kernel, scale=p.scale),
      p,
      in_specs=[head_spec(p, d)],
      out_specs=[head_spec(p, d), live_block_spec(p, g), head_spec(p, 1)],
      out_shape=[
          jax.ShapeDtypeStruct((b, hkv, g, d), q.dtype),  # out
          jax.ShapeDtypeStruct((b, hkv, p.num_blocks, g, p.block_tokens), jnp.float32),
          jax.ShapeDtypeStruct((b, hkv, g, 1), jnp.float32),  # lse
      ],
      scratch_shapes=[
          pltpu.VMEM((g, 1), jnp.float32),  # m
          pltpu.VMEM((g, 1), jnp.float32),  # l
          pltpu.VMEM((g, d), jnp.float32),  # acc
      ],
      interpret=interpret,
      name="kvjax_paged_attention",
  )(q.reshape(b, hkv, g, d), k_pages, v_pages)
  return attention_epilogue(p, out, logits, lse[..., 0], per_query_head, return_lse)
