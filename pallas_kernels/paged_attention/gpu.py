"""The GPU paged decode attention kernel (T == 1): `paged_attention_pallas_gpu`, Triton-style
Pallas (no scalar prefetch, no BlockSpecs), with the same results and outputs as the TPU
kernel (`tpu`).

  grid = (B, Hkv, splits). Every operand is a whole-array ref in HBM: the program reads
  its sequence's length and, block by block, its page numbers from the table, then
  gathers those pages from the pools (`k_ref[pages]`, a [ppb, S, D] pointer gather) in a
  `lax.fori_loop` whose trip count is the number of *live* blocks of its split, so dead
  pages are never read. No K/V is gathered in HBM beforehand.

  Triton needs power-of-two tensor shapes and tl.dot needs every dim >= 16, so the G
  query heads of a kv head are zero-padded to Gp = max(16, next_pow2(G)) in the wrapper
  (q only: a few KiB) and blocks hold ppb * S >= 16 tokens; head dim and page size must
  be powers of two (D >= 16). The online softmax over the [Gp, D] block and its masking
  are the TPU kernel's (`_decode`, `_common.mask_dead_slots`): logits masked with `where`
  before exp, dead V rows zeroed, so NaN never leaks.
  Offsets are int32 (Triton's default pointer arithmetic): pools of >= 2**31 elements are
  rejected before launch.
  Precision: float32 uses IEEE f32 dots (Precision.HIGHEST); bfloat16 feeds the tensor
  cores bf16 operands with f32 accumulation (the probabilities are rounded to bf16 for
  the P.V dot, as in flash attention).

  Splits (flash-decoding): one program per (row, kv head) leaves most SMs idle at small
  batch, so the live blocks are divided among `splits` programs, each writing a partial
  normalised output and lse; a tiny XLA step combines them. The logits keep the same
  [B, Hkv, blocks, G, bk] layout as the TPU kernel (rows >= G are masked off at the
  store), so `_decode.attention_epilogue` and `return_lse` are shared.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from pallas_kernels import page_format
from pallas_kernels._common import (
    TARGET_BLOCK_TOKENS,
    decode_prologue,
    dot,
    leaves_per_pool,
    load_pages,
    mask_dead_slots,
)
from pallas_kernels.paged_attention._decode import (
    attention_epilogue,
    online_softmax_init,
    online_softmax_result,
    online_softmax_step,
)

__all__ = [
    "check_gpu_pool_size",
    "check_gpu_shapes",
    "gpu_pages_per_block",
    "paged_attention_pallas_gpu",
]

_GPU_MIN_DOT = 16  # tl.dot needs M, N, K >= 16
_GPU_TARGET_PROGRAMS = 264  # ~2 waves of programs on a 132-SM H100/H200


def _is_pow2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


def _next_pow2(x: int) -> int:
  return 1 << max(0, int(x) - 1).bit_length()


def check_gpu_shapes(q_shape, page_size: int):
  """ValueError for shapes the Triton kernel cannot tile."""
  d = q_shape[-1]
  if not _is_pow2(d) or d < _GPU_MIN_DOT:
    raise ValueError(f"the GPU kernel needs a power-of-two head dim >= 16, got D={d}")
  if not _is_pow2(page_size):
    raise ValueError(f"the GPU kernel needs a power-of-two page size, got S={page_size}")


def check_gpu_pool_size(k_pages):
  """ValueError for pools the Triton kernel cannot address (its offsets are int32)."""
  if max(x.size for x in jax.tree.leaves(k_pages)) >= 2**31:
    raise ValueError(f"the GPU kernel addresses pools of < 2**31 elements, got {k_pages.shape}")


def gpu_pages_per_block(
    page_size: int, max_pages: int, pages_per_block: int | None, itemsize: int
) -> int:
  """Pages per block: the request (default: ~128 tokens of 2-byte K/V, 64 of float32, so
  that f32 blocks fit twice in shared memory) raised to a power of two and to at least 16
  tokens, and no larger than the table needs."""
  if pages_per_block is None:
    target = TARGET_BLOCK_TOKENS if itemsize <= 2 else TARGET_BLOCK_TOKENS // 2
    pages_per_block = max(1, target // page_size)
  ppb = _next_pow2(max(1, pages_per_block, -(-_GPU_MIN_DOT // page_size)))
  return min(ppb, max(_next_pow2(max_pages), -(-_GPU_MIN_DOT // page_size)))


def _paged_attention_gpu_kernel(
    table_ref,  # [B, Hkv, blocks * ppb] int32
    lengths_ref,  # [B, Hkv] int32, visible slots
    q_ref,  # [B, Hkv, Gp, D]
    *refs,  # K pool, V pool: [P, S, D] each, or codes [P, S, W], scale, zero [P, S, G]
    # then out [B, Hkv, splits, Gp, D] f32 (normalised within the split), logits
    # [B, Hkv, blocks, G, bk] f32, lse [B, Hkv, splits, Gp, 1] f32 (-inf for an empty split)
    scale,
    group,
    pages_per_block,
    blocks_per_split,
    precision,
    kv_dtype,
):
  n = leaves_per_pool(kv_dtype)
  k_refs, v_refs = refs[:n], refs[n : 2 * n]
  out_ref, logits_ref, lse_ref = refs[2 * n :]
  b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  gp, d = q_ref.shape[2], q_ref.shape[3]
  page_size = k_refs[0].shape[1]
  ppb = pages_per_block
  bk = ppb * page_size
  length = lengths_ref[b, h]
  first = split * blocks_per_split
  live_blocks = jax.lax.div(length + bk - 1, bk)
  stop = jnp.minimum(first + blocks_per_split, live_blocks)
  q = q_ref[b, h]  # [Gp, D], input dtype

  def body(i, state):  # state: m [Gp, 1], l [Gp, 1], acc [Gp, D]
    pages = table_ref[b, h, pl.ds(i * ppb, ppb)]  # [ppb]
    # Both dots run in q's dtype (tl.dot takes one operand type; no-op when the pools agree).
    # Quantized pages are gathered as codes and dequantized here, in registers.
    k = load_pages(k_refs, kv_dtype, pages, q.dtype).reshape(bk, d)  # [bk, D]
    v = load_pages(v_refs, kv_dtype, pages, q.dtype).reshape(bk, d)  # [bk, D]
    # Scaled after the dot, unlike the TPU kernel's f32 q: q * scale in bf16 would round.
    s = dot(q, k, ((1,), (1,)), precision) * scale  # [Gp, bk]
    s, _, v = mask_dead_slots(s, v, i * bk, length)
    # Rows >= G are padding: the masked store keeps the logits [.., G, bk] like the TPU kernel.
    head = jax.lax.broadcasted_iota(jnp.int32, (gp, bk), 0)
    pltriton.store(logits_ref.at[b, h, i, pl.ds(0, gp), :], s, mask=head < group)
    return online_softmax_step(state, s, v, precision)

  state = online_softmax_init(gp, d)
  state = jax.lax.fori_loop(first, stop, body, state)  # no trip past the live blocks
  out_ref[b, h, split], lse_ref[b, h, split] = online_softmax_result(state, -jnp.inf)


def paged_attention_pallas_gpu(
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
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: Any = False,
):
  """GPU (Triton) Pallas paged decode attention: the same results and outputs as
  `paged_attention_pallas`. `pages_per_block` is raised to a power of two of >= 16 tokens;
  `num_splits` (default: enough programs for ~2 waves on an H100/H200) splits each
  sequence's blocks among programs. Arguments are not validated here (see
  `paged_attention`), shapes are (`check_gpu_shapes`).
  """
  kv_dtype = page_format.kv_dtype_of(k_pages)
  # Blocks are held in q's dtype once loaded (quantized pages are dequantized to it).
  itemsize = jnp.dtype(q.dtype if kv_dtype in page_format.QUANTIZED_DTYPES else kv_dtype).itemsize
  ppb = functools.partial(gpu_pages_per_block, pages_per_block=pages_per_block, itemsize=itemsize)
  p = decode_prologue(
      "paged_attention_pallas_gpu", q, k_pages, page_table, lengths, num_queries, scale, ppb
  )
  check_gpu_shapes(q.shape, p.page_size)
  check_gpu_pool_size(k_pages)
  b, hkv, g, d, num_blocks = p.batch, p.kv_heads, p.group, p.head_dim, p.num_blocks
  gp = max(_GPU_MIN_DOT, _next_pow2(g))
  if num_splits is None:
    num_splits = max(1, min(num_blocks, _GPU_TARGET_PROGRAMS // (b * hkv)))
  blocks_per_split = -(-num_blocks // num_splits)
  num_splits = -(-num_blocks // blocks_per_split)  # no split left without blocks
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

  q_BxKxGpxD = jnp.pad(q.reshape(b, hkv, g, d), ((0, 0), (0, 0), (0, gp - g), (0, 0)))
  kernel = functools.partial(
      _paged_attention_gpu_kernel,
      scale=p.scale,
      group=g,
      pages_per_block=p.pages_per_block,
      blocks_per_split=blocks_per_split,
      precision=precision,
      kv_dtype=kv_dtype,
  )
  out_s, logits, lse_s = pl.pallas_call(
      kernel,
      grid=(b, hkv, num_splits),
      out_shape=[
          jax.ShapeDtypeStruct((b, hkv, num_splits, gp, d), jnp.float32),
          jax.ShapeDtypeStruct((b, hkv, num_blocks, g, p.block_tokens), jnp.float32),
          jax.ShapeDtypeStruct((b, hkv, num_splits, gp, 1), jnp.float32),
      ],
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="kvjax_paged_attention_gpu",
  )(
      p.table.reshape(b, hkv, -1),
      p.lens.reshape(b, hkv),
      q_BxKxGpxD,
      *page_format.parts(k_pages).values(),
      *page_format.parts(v_pages).values(),
  )

  # Combine the splits (flash-decoding): weights exp(lse_s - lse); empty splits weigh 0.
  out_s, lse_s = out_s[..., :g, :], lse_s[..., :g, 0]  # [B, Hkv, splits, G, D], [.., G]
  m_max = lse_s.max(axis=2)  # [B, Hkv, G]
  seen = m_max != -jnp.inf  # NaN stays NaN
  shift = jnp.where(seen, m_max, 0.0)
  weight = jnp.exp(lse_s - shift[:, :, None])  # [B, Hkv, splits, G]
  total = weight.sum(axis=2)
  lse = jnp.where(seen, shift + jnp.log(jnp.where(seen, total, 1.0)), jnp.inf)
  out = (weight[..., None] * out_s).sum(axis=2) / jnp.where(seen, total, 1.0)[..., None]
  return attention_epilogue(p, out.astype(q.dtype), logits, lse, per_query_head, return_lse)
