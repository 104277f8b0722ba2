"""Paged attention over the kvjax page pool, returning the statistics eviction policies use.

`paged_attention_reference` is the specification (pure jnp); a Pallas kernel and the
`paged_attention(..., impl=...)` dispatcher sit beside it in this module.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels import page_format
from pallas_kernels._common import (
    IMPLS,
    SUPPORTED_DTYPES,
    TARGET_BLOCK_TOKENS,
    PagedDecode,
    check_float_dtypes,
    check_page_table_range,
    decode_prologue,
    default_pages_per_block,
    dot,
    effective_lengths,
    gather_pages,
    head_spec,
    is_traced,
    kernel_block,
    last_live_block,
    leaves_per_pool,
    live_block_spec,
    load_pages,
    paged_kv_specs,
    paged_pallas_call,
    prepare_paged_operands,
    resolve_impl,
    unblock,
)
from pallas_kernels._common import validate_paged_args as validate_paged_attention_args

__all__ = [
    "IMPLS",
    "SUPPORTED_DTYPES",
    "check_float_dtypes",
    "check_gpu_pool_size",
    "check_gpu_shapes",
    "check_page_table_range",
    "default_pages_per_block",
    "effective_lengths",
    "gpu_pages_per_block",
    "is_traced",
    "last_live_block",
    "paged_attention",
    "paged_attention_key_max",
    "paged_attention_live_blocks",
    "paged_attention_live_prefix",
    "paged_attention_lse_reference",
    "paged_attention_pallas",
    "paged_attention_pallas_gpu",
    "paged_attention_reference",
    "paged_kv_specs",
    "prepare_paged_operands",
    "resolve_impl",
    "validate_paged_attention_args",
    "visible_mask",
]

_NEG_INF = -1e30  # finite, so fully masked rows give zeros instead of NaN


def _visible_limit(lengths, num_queries, t: int):
  """[B, Hkv, T]: query t of row b sees the slots below this limit.

  The T queries are the last `num_queries[b]` tokens written to each sequence (a prefill
  chunk or one decode token), so query t sees slots < lengths - num_queries + t + 1:
  everything cached before the chunk, and the chunk causally. Padding queries see nothing.
  """
  q_idx = jnp.arange(t)[None, None, :]  # [1, 1, T]
  limit = lengths[:, :, None] - num_queries[:, None, None] + q_idx + 1  # [B, Hkv, T]
  return jnp.where(q_idx < num_queries[:, None, None], limit, 0)


def _visible_floor(limit, window):
  """[B, Hkv, T]: the lowest slot a query under `limit` sees with a sliding `window` (the
  keys it sees, itself included; an int or int32 scalar, 0 or None = every earlier key).
  Exact for a sequence whose slots hold consecutive positions, as a sliding layer's do."""
  if window is None:
    return jnp.zeros_like(limit)
  window = jnp.asarray(window, jnp.int32)
  return jnp.where(window > 0, limit - window, 0)


def visible_mask(lengths, num_queries, t: int, n: int, window=None):
  """[B, Hkv, T, N]: slot n is visible to query t of row b (`_visible_limit`, and within
  its `window`: `_visible_floor`)."""
  limit = _visible_limit(lengths, num_queries, t)[..., None]
  slot = jnp.arange(n)
  return (slot < limit) & (slot >= _visible_floor(limit, window))


def _query_rows(q, hkv: int, scale):
  """q [B, T, Hq, D] as scaled float32 rows [B, Hkv, T*G, D] in kv-head-major layout (row
  t * G + g is query t, head g of the kv head): both contractions are then plain batched
  matmuls."""
  b, t, hq, d = q.shape
  scale = d**-0.5 if scale is None else scale
  rows = q.reshape(b, t, hkv, hq // hkv, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, -1, d)
  return rows.astype(jnp.float32) * scale


def _per_query(x, t: int):
  """Kv-head-major rows [B, Hkv, T*G, ...] back to [B, T, Hq, ...]."""
  b, hkv, tg, *rest = x.shape
  x = x.reshape(b, hkv, t, tg // t, *rest)
  return jnp.swapaxes(x, 1, 2).reshape(b, t, hkv * (tg // t), *rest)


def _reference_logits(q, k_pages, page_table, lengths, num_queries, scale, window=None):
  """Scaled logits [B, Hkv, T*G, N] float32 in kv-head-major layout (`_query_rows`) and
  the mask of the slots each row sees, same shape."""
  b, t, hq, _ = q.shape
  _, hkv, m = page_table.shape
  n = m * k_pages.shape[1]
  num_queries = jnp.full((b,), t, jnp.int32) if num_queries is None else num_queries
  k_BxKxNxD = gather_pages(k_pages, page_table)
  logits = jnp.einsum("bkqd,bknd->bkqn", _query_rows(q, hkv, scale), k_BxKxNxD)
  visible = visible_mask(lengths, num_queries, t, n, window)
  return logits, jnp.repeat(visible, hq // hkv, axis=2)


def paged_attention_reference(
    q: Float[Array, "B T Hq D"],
    k_pages: Float[Array, "P S D"],
    v_pages: Float[Array, "P S D"],
    page_table: Int[Array, "B Hkv M"],
    lengths: Int[Array, "B Hkv"],
    num_queries: Int[Array, " B"] | None = None,
    *,
    scale: float | None = None,
    per_query_head: bool = False,
    window=None,
) -> tuple[Float[Array, "B T Hq D"], Float[Array, "B Hkv T N"]]:
  """Causal GQA attention of T queries over paged sequences (N = M * S slots), each query
  seeing at most the `window` latest slots, itself included (an int or int32 scalar; 0 or
  None: every earlier slot).

  Returns the output and the attention probabilities per kv head, summed over the
  query heads that share it (zero for masked slots and padding queries); with
  `per_query_head`, the probabilities of each query head instead: [B, Hq, T, N].
  """
  validate_paged_attention_args(q, k_pages, v_pages, page_table, lengths, num_queries)
  b, t, hq, _ = q.shape
  hkv = page_table.shape[1]
  g = hq // hkv
  logits, visible = _reference_logits(q, k_pages, page_table, lengths, num_queries, scale, window)
  n = logits.shape[-1]
  # Unused slots may hold anything (NaN included). Masked logits are replaced below; V
  # must be zeroed so that 0 * NaN never reaches the output.
  v_BxKxNxD = gather_pages(v_pages, page_table, lengths)
  logits = jnp.where(visible, logits, _NEG_INF)  # [B, Hkv, T*G, N]
  probs = jnp.where(visible, jax.nn.softmax(logits, axis=-1), 0.0)
  out = _per_query(jnp.einsum("bkqn,bknd->bkqd", probs, v_BxKxNxD), t)
  probs = probs.reshape(b, hkv, t, g, n)
  if per_query_head:
    return out.astype(q.dtype), probs.transpose(0, 1, 3, 2, 4).reshape(b, hq, t, n)
  return out.astype(q.dtype), probs.sum(axis=3)


def paged_attention_lse_reference(
    q: Float[Array, "B T Hq D"],
    k_pages: Float[Array, "P S D"],
    page_table: Int[Array, "B Hkv M"],
    lengths: Int[Array, "B Hkv"],
    num_queries: Int[Array, " B"] | None = None,
    *,
    scale: float | None = None,
    window=None,
) -> Float[Array, "B T Hq"]:
  """Log-sum-exp of each query head's visible scaled logits (+inf where none is visible)."""
  t = q.shape[1]
  logits, visible = _reference_logits(q, k_pages, page_table, lengths, num_queries, scale, window)
  logits = jnp.where(visible, logits, -jnp.inf)  # [B, Hkv, T*G, N]
  any_visible = visible.any(-1)
  lse = jax.nn.logsumexp(jnp.where(any_visible[..., None], logits, 0.0), axis=-1)
  return _per_query(jnp.where(any_visible, lse, jnp.inf), t)  # [B, Hkv, T*G] -> [B, T, Hq]


LIVE_BLOCK_TOKENS = 512  # tokens per step of the live-blocks loop (256: 5-15% slower on CPU)
# key_max's loop keeps no softmax state: smaller blocks waste less past the last slot it
# scores (one layer of a KVzip pass, 528 queries after 528 context slots, before_chunk, 2-core
# AMD EPYC: 5.4 ms at 256 against 8.4 ms at 512, medians of 15; docs/results/compression_cost).
KEY_MAX_BLOCK_TOKENS = 256


def _blocks_of(page_table, page_size: int, block_tokens: int):
  """How the live-blocks loops walk a page table: (pages per block, blocks, slots per
  block, the table padded to whole blocks with the null page, which is in range)."""
  if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
    raise ValueError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
  m = page_table.shape[2]
  ppb = max(1, min(block_tokens // page_size, m))
  blocks = -(-m // ppb)
  table = jnp.pad(page_table, ((0, 0), (0, 0), (0, blocks * ppb - m)))
  return ppb, blocks, ppb * page_size, table


def _read_block(pages, table, j, ppb: int) -> Float[Array, "B Hkv W D"]:
  """Block j of every sequence's pages, float32 (dequantized block by block)."""
  b, hkv = table.shape[:2]
  held = jax.lax.dynamic_slice_in_dim(table, j * ppb, ppb, axis=2)  # [B, Hkv, ppb]
  return page_format.read(pages, held).reshape(b, hkv, -1, pages.shape[-1])


def _visible_in_block(j, width: int, limit, floor) -> Bool[Array, "B Hkv TG W"]:
  """Which slots of block j each query row sees (its limit, its window's floor)."""
  slot = j * width + jnp.arange(width)
  return (slot < limit[..., None]) & (slot >= floor[..., None])


def paged_attention_live_blocks(
    q: Float[Array, "B T Hq D"],
    k_pages: Float[Array, "P S D"],
    v_pages: Float[Array, "P S D"],
    page_table: Int[Array, "B Hkv M"],
    lengths: Int[Array, "B Hkv"],
    num_queries: Int[Array, " B"] | None = None,
    *,
    scale: float | None = None,
    block_tokens: int = LIVE_BLOCK_TOKENS,
    window=None,
) -> tuple[Float[Array, "B T Hq D"], Float[Array, "B T Hq"]]:
  """The reference's output (and the lse), reading only live pages: an online softmax
  (flash-attention style) over blocks of ~`block_tokens` slots whose trip count is the live
  blocks of the longest sequence, so a prefill chunk costs O(length), not O(capacity).
  No probabilities: for callers that need none (the full cache, a compressed context).

  Two loops: blocks that every query sees whole (cached before the chunk, in every
  sequence, and within every query's `window`) skip the masks; only the remaining blocks
  (the chunk's own, the ragged ends, the window's edge) are masked. Blocks below every
  query's window are not read.
  """
  validate_paged_attention_args(q, k_pages, v_pages, page_table, lengths, num_queries)
  q, page_table, lengths = map(jnp.asarray, (q, page_table, lengths))
  k_pages, v_pages = (jax.tree.map(jnp.asarray, x) for x in (k_pages, v_pages))
  b, t, hq, d = q.shape
  hkv = page_table.shape[1]
  g = hq // hkv
  ppb, _, width, table = _blocks_of(page_table, k_pages.shape[1], block_tokens)
  num_queries = jnp.full((b,), t, jnp.int32) if num_queries is None else num_queries
  q_BxKxQxD = _query_rows(q, hkv, scale)
  limit = jnp.repeat(_visible_limit(lengths, num_queries, t), g, axis=2)  # [B, Hkv, T*G]
  floor = _visible_floor(limit, window)  # [B, Hkv, T*G]: the lowest slot each query sees

  def load(j):  # K, V of block j: [B, Hkv, W, D] float32 each
    return _read_block(k_pages, table, j, ppb), _read_block(v_pages, table, j, ppb)

  def update(carry, logits, v, visible=None):
    m_i, l_i, acc = carry  # [B, Hkv, TG], [B, Hkv, TG], [B, Hkv, TG, D]
    m_new = jnp.maximum(m_i, logits.max(-1))
    p = jnp.exp(logits - m_new[..., None])
    if visible is not None:
      p = jnp.where(visible, p, 0.0)
    correction = jnp.exp(m_i - m_new)
    acc = acc * correction[..., None] + jnp.einsum("bkqn,bknd->bkqd", p, v)
    return m_new, l_i * correction + p.sum(-1), acc

  def whole_block(j, carry):
    k, v = load(j)
    return update(carry, jnp.einsum("bkqd,bknd->bkqn", q_BxKxQxD, k), v)

  def masked_block(j, carry):
    k, v = load(j)
    slot = j * width + jnp.arange(width)  # [W]
    # Unused slots may hold NaN: V is zeroed there (0 * NaN would reach the output).
    v = jnp.where((slot < lengths[..., None])[..., None], v, 0.0)
    visible = _visible_in_block(j, width, limit, floor)  # [B, Hkv, TG, W]
    logits = jnp.where(visible, jnp.einsum("bkqd,bknd->bkqn", q_BxKxQxD, k), _NEG_INF)
    return update(carry, logits, v, visible)

  init = (
      jnp.full((b, hkv, t * g), _NEG_INF, jnp.float32),
      jnp.zeros((b, hkv, t * g), jnp.float32),
      jnp.zeros((b, hkv, t * g, d), jnp.float32),
  )
  # Slots below every sequence's chunk start, and from every query's window on, are live
  # and visible to every query; blocks below every window are skipped.
  live = jnp.arange(t)[None, :] < num_queries[:, None]  # [B, T]: real queries
  live = jnp.repeat(live[:, None, :], g, axis=2)  # [B, Hkv, T*G]
  first_block = jnp.min(jnp.where(live, floor, jnp.iinfo(jnp.int32).max)) // width
  first_block = jnp.clip(first_block, 0, None)
  whole_from = jnp.maximum(first_block, -(-jnp.max(jnp.where(live, floor, 0)) // width))
  whole_to = jnp.maximum(whole_from, jnp.min(lengths - num_queries[:, None]) // width)
  live_blocks = -(-jnp.max(lengths) // width)
  carry = jax.lax.fori_loop(first_block, whole_from, masked_block, init)
  carry = jax.lax.fori_loop(whole_from, whole_to, whole_block, carry)
  m_i, l_i, acc = jax.lax.fori_loop(whole_to, live_blocks, masked_block, carry)
  # Padding queries saw the whole blocks too: they see nothing (zeros, lse +inf).
  query = jnp.arange(t)[None, :] < num_queries[:, None]  # [B, T]
  # l_i == 0: nothing visible. NaN (a NaN key or value) stays NaN in the output, never zeros.
  seen = jnp.repeat(query[:, None, :], g, axis=2) & (l_i != 0)  # [B, Hkv, T*G]
  out = jnp.where(seen[..., None], acc / jnp.where(seen, l_i, 1.0)[..., None], 0.0)
  lse = jnp.where(seen, m_i + jnp.log(jnp.where(seen, l_i, 1.0)), jnp.inf)
  return _per_query(out, t).astype(q.dtype), _per_query(lse, t)


def paged_attention_key_max(
    q: Float[Array, "B T Hq D"],
    k_pages: Float[Array, "P S D"],
    page_table: Int[Array, "B Hkv M"],
    lengths: Int[Array, "B Hkv"],
    num_queries: Int[Array, " B"] | None,
    lse: Float[Array, "B T Hq"],
    *,
    scale: float | None = None,
    block_tokens: int = KEY_MAX_BLOCK_TOKENS,
    window=None,
    before_chunk: bool = False,
) -> Float[Array, "B Hkv N"]:
  """The most attention any live query of a kv head's query heads pays each slot:
  key_max[b, k, n] = max over queries t and heads h of kv head k of
  exp(logit[b, t, h, n] - lse[b, t, h]) (N = M * S; 0 where no query sees the slot).

  What a compress-once scorer (KVzip) reduces the per-head probabilities to, without
  materialising them: with the log-sum-exp of the attention that produced the output
  (any path's `return_lse`), one more QK^T per block of the live blocks, a max over the
  query rows, and one [B, Hkv, N] result. Exactly the max of `paged_attention(...,
  per_query_head=True)`'s probabilities over each kv head's query heads and live queries
  (up to rounding). One layer timed alone on CPU: 0.6x the time of the reference's
  probabilities plus that reduction; in a whole KVzip prefill, within noise (design.md).
  A jnp loop, no Pallas kernel: it runs wherever XLA does. Unused slots may hold NaN:
  they are masked before the max; a visible NaN stays NaN.

  `before_chunk`: only the slots cached before the queries' chunk (`lengths -
  num_queries`), 0 for the chunk's own; blocks past the last such slot are not read: a
  KVzip pass scores the context it repeats and cuts its own tokens afterwards (a 528-token
  pass after a 528-slot stretch scores half the slots: 3 blocks of 256 read instead of 5)."""
  validate_paged_attention_args(q, k_pages, k_pages, page_table, lengths, num_queries)
  q, page_table, lengths, lse = map(jnp.asarray, (q, page_table, lengths, lse))
  b, t, hq, _ = q.shape
  _, hkv, m = page_table.shape
  if lse.shape != (b, t, hq):
    raise ValueError(f"lse must be [B, T, Hq] = {(b, t, hq)}, got {lse.shape}")
  if not isinstance(before_chunk, bool):
    raise TypeError(f"before_chunk must be a bool, got {before_chunk!r}")
  s, g = k_pages.shape[1], hq // hkv
  ppb, blocks, width, table = _blocks_of(page_table, s, block_tokens)
  num_queries = jnp.full((b,), t, jnp.int32) if num_queries is None else num_queries
  rows = _query_rows(q, hkv, scale)  # [B, Hkv, T*G, D]
  lse_rows = lse.reshape(b, t, hkv, g).transpose(0, 2, 1, 3).reshape(b, hkv, t * g)
  limit = jnp.repeat(_visible_limit(lengths, num_queries, t), g, axis=2)  # [B, Hkv, T*G]
  floor = _visible_floor(limit, window)
  end = lengths  # [B, Hkv]: the slots scored
  if before_chunk:
    end = lengths - num_queries[:, None]
    limit = jnp.minimum(limit, end[..., None])

  def block(j, key_max):  # key_max [B, Hkv, blocks * W]
    k = _read_block(k_pages, table, j, ppb)  # [B, Hkv, W, D]
    logits = jnp.einsum("bkqd,bknd->bkqn", rows, k)  # [B, Hkv, T*G, W]
    visible = _visible_in_block(j, width, limit, floor)
    peak = jnp.where(visible, logits - lse_rows[..., None], _NEG_INF).max(axis=2)
    # exp(-1e30) = 0 where no query sees a slot (padding queries see none: limit 0).
    return jax.lax.dynamic_update_slice_in_dim(key_max, jnp.exp(peak), j * width, axis=2)

  key_max = jnp.zeros((b, hkv, blocks * width), jnp.float32)
  key_max = jax.lax.fori_loop(0, -(-jnp.max(end) // width), block, key_max)
  return key_max[..., : m * s]


# ---------------------------------------------------------------------------------------
# Pallas kernel (decode, T == 1) and dispatcher.
#
# Design (TPU-style Pallas: `pltpu.PrefetchScalarGridSpec`, runs in interpret mode anywhere):
#
#   grid = (B, Hkv, M / pages_per_block); the page table (flattened [B*Hkv*M]) and the
#   visible lengths ([B*Hkv]) are scalar-prefetched, so the K/V BlockSpec index maps read
#   the physical page of each logical page straight from the table: the pipeline DMAs one
#   [S, D] page per operand per grid step. A block of `pages_per_block` pages is made by
#   passing each pool `pages_per_block` times, operand j mapping to logical page
#   i * pages_per_block + j (the same HBM buffer, no copy), so small pages still give
#   ~128-token blocks. Logical pages past a sequence's length map to its last live page:
#   consecutive grid steps then ask for the same block, so the pipeline issues no DMA, and
#   the kernel skips them with `pl.when`.
#
#   All G = Hq / Hkv query heads of a kv head form one [G, D] q block; the online softmax
#   keeps a running max m [G, 1], running sum l [G, 1] and output accumulator [G, D] in
#   VMEM scratch. Logits are masked with `where` (not added) before exp, and V rows past
#   the length are zeroed before the weighted sum, so NaN in unused slots never leaks.
#
#   Probabilities need the final max and sum, so the kernel emits the masked, scaled,
#   *unnormalised* logits of each live block ([B, Hkv, M/ppb, G, ppb*S] f32; dead blocks
#   are never written, hence never DMA'd back) and, at the last step, the per-query-head
#   log-sum-exp lse [B, Hkv, G]. A cheap XLA epilogue computes
#   probs = where(slot < length, exp(logits - lse), 0), summed over G (or reshaped per query
#   head) in `attention_epilogue`. Its extra HBM traffic is 4*G bytes per slot written + read, against 2*D*itemsize
#   bytes of K/V per slot read by the kernel (e.g. 12 vs 256 bytes for G=3, D=64, bf16).
#   The epilogue was preferred over a second kernel pass, which would read K again.
#
#   Empty rows (length 0 or a padding query) give out = 0, probs = 0 and lse = +inf, so that
#   exp(logit - lse) = 0 for any consumer of lse (e.g. the output-impact kernel).
#
#   Backends: this kernel uses scalar prefetch, which only the Mosaic TPU lowering supports
#   (Triton and Mosaic GPU raise NotImplementedError for it); GPUs get the Triton-style
#   variant `paged_attention_pallas_gpu` below. impl="auto" picks Pallas on TPU only.
#
#   The prologue (sizes, visible lengths, padded page table), block specs, grid and block
#   loading are shared with the output-impact kernel (`pallas_kernels._common`).
# ---------------------------------------------------------------------------------------


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
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(live)
  def _block():
    s, _, v = load()  # [G, bk] (-inf at dead slots), [bk, D] (dead rows zeroed)
    logits_ref[...] = s
    m_prev = m_ref[...]
    m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))  # finite: block has a live slot
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.exp(s - m_new)  # masked slots: exp(-inf) = 0
    l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
    acc_ref[...] = alpha * acc_ref[...] + dot(p, v, ((1,), (0,)))
    m_ref[...] = m_new

  @pl.when(i == pl.num_programs(2) - 1)
  def _finish():
    l = l_ref[...]
    live = l != 0.0  # NaN (from a NaN key or value) stays NaN, never zeros
    safe_l = jnp.where(live, l, 1.0)
    out_ref[...] = jnp.where(live, acc_ref[...] / safe_l, 0.0).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(live, m_ref[...] + jnp.log(safe_l), jnp.inf)


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


# ---------------------------------------------------------------------------------------
# GPU variant (Triton-style Pallas; no scalar prefetch, no BlockSpecs).
#
#   grid = (B, Hkv, splits). Every operand is a whole-array ref in HBM: the program reads
#   its sequence's length and, block by block, its page numbers from the table, then
#   gathers those pages from the pools (`k_ref[pages]`, a [ppb, S, D] pointer gather) in a
#   `lax.fori_loop` whose trip count is the number of *live* blocks of its split, so dead
#   pages are never read. No K/V is gathered in HBM beforehand.
#
#   Triton needs power-of-two tensor shapes and tl.dot needs every dim >= 16, so the G
#   query heads of a kv head are zero-padded to Gp = max(16, next_pow2(G)) in the wrapper
#   (q only: a few KiB) and blocks hold ppb * S >= 16 tokens; head dim and page size must
#   be powers of two (D >= 16). Online softmax over the [Gp, D] block as in the TPU kernel:
#   logits masked with `where` before exp, dead V rows zeroed, so NaN never leaks.
#   Offsets are int32 (Triton's default pointer arithmetic): pools of >= 2**31 elements are
#   rejected before launch.
#   Precision: float32 uses IEEE f32 dots (Precision.HIGHEST); bfloat16 feeds the tensor
#   cores bf16 operands with f32 accumulation (the probabilities are rounded to bf16 for
#   the P.V dot, as in flash attention).
#
#   Splits (flash-decoding): one program per (row, kv head) leaves most SMs idle at small
#   batch, so the live blocks are divided among `splits` programs, each writing a partial
#   normalised output and lse; a tiny XLA step combines them. The logits keep the same
#   [B, Hkv, blocks, G, bk] layout as the TPU kernel (rows >= G are masked off at the
#   store), so `attention_epilogue` and `return_lse` are shared.
# ---------------------------------------------------------------------------------------

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
    # [B, Hkv, blocks, G, bk] f32, lse [B, Hkv, splits, Gp] f32 (-inf for an empty split)
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

  def body(i, carry):
    m_prev, l_prev, acc_prev = carry  # [Gp], [Gp], [Gp, D]
    pages = table_ref[b, h, pl.ds(i * ppb, ppb)]  # [ppb]
    # Both dots run in q's dtype (tl.dot takes one operand type; no-op when the pools agree).
    # Quantized pages are gathered as codes and dequantized here, in registers.
    k = load_pages(k_refs, kv_dtype, pages, q.dtype).reshape(bk, d)  # [bk, D]
    v = load_pages(v_refs, kv_dtype, pages, q.dtype).reshape(bk, d)  # [bk, D]
    s = dot(q, k, ((1,), (1,)), precision) * scale  # [Gp, bk]
    slot = i * bk + jax.lax.broadcasted_iota(jnp.int32, (gp, bk), 1)
    s = jnp.where(slot < length, s, -jnp.inf)
    # Rows >= G are padding: the masked store keeps the logits [.., G, bk] like the TPU kernel.
    head = jax.lax.broadcasted_iota(jnp.int32, (gp, bk), 0)
    pltriton.store(logits_ref.at[b, h, i, pl.ds(0, gp), :], s, mask=head < group)
    m_new = jnp.maximum(m_prev, s.max(axis=1))  # finite: the block has a live slot
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.exp(s - m_new[:, None])  # masked slots: exp(-inf) = 0
    live_row = (i * bk + jax.lax.broadcasted_iota(jnp.int32, (bk, d), 0)) < length
    v = jnp.where(live_row, v, jnp.zeros_like(v))
    pv = dot(p.astype(v.dtype), v, ((1,), (0,)), precision)  # [Gp, D]
    return m_new, alpha * l_prev + p.sum(axis=1), alpha[:, None] * acc_prev + pv

  init = (
      jnp.full((gp,), -jnp.inf, jnp.float32),
      jnp.zeros((gp,), jnp.float32),
      jnp.zeros((gp, d), jnp.float32),
  )
  m, l, acc = jax.lax.fori_loop(first, stop, body, init)  # no trip past the live blocks
  live = l != 0.0  # NaN (from a NaN key or value) stays NaN, never zeros
  safe_l = jnp.where(live, l, 1.0)
  out_ref[b, h, split] = jnp.where(live[:, None], acc / safe_l[:, None], 0.0)
  lse_ref[b, h, split] = jnp.where(live, m + jnp.log(safe_l), -jnp.inf)


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
          jax.ShapeDtypeStruct((b, hkv, num_splits, gp), jnp.float32),
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
  out_s, lse_s = out_s[..., :g, :], lse_s[..., :g]  # [B, Hkv, splits, G, D], [.., G]
  m_max = lse_s.max(axis=2)  # [B, Hkv, G]
  seen = m_max != -jnp.inf  # NaN stays NaN
  shift = jnp.where(seen, m_max, 0.0)
  weight = jnp.exp(lse_s - shift[:, :, None])  # [B, Hkv, splits, G]
  total = weight.sum(axis=2)
  lse = jnp.where(seen, shift + jnp.log(jnp.where(seen, total, 1.0)), jnp.inf)
  out = (weight[..., None] * out_s).sum(axis=2) / jnp.where(seen, total, 1.0)[..., None]
  return attention_epilogue(p, out.astype(q.dtype), logits, lse, per_query_head, return_lse)


def paged_attention(
    q: Float[Array, "B T Hq D"],
    k_pages: Float[Array, "P S D"],
    v_pages: Float[Array, "P S D"],
    page_table: Int[Array, "B Hkv M"],
    lengths: Int[Array, "B Hkv"],
    num_queries: Int[Array, " B"] | None = None,
    *,
    scale: float | None = None,
    per_query_head: bool = False,
    return_lse: bool = False,
    return_probs: bool = True,
    impl: str = "auto",
    interpret: Any = None,
    pages_per_block: int | None = None,
    window=None,
):
  """Paged attention with the kernel where it runs (TPU; impl="auto") and the reference
  elsewhere; prefill chunks (T > 1) always take the reference.

  `window` (an int or int32 scalar, may be traced; 0 or None = every earlier slot): each
  query sees at most its `window` latest slots, itself included (a sliding-window layer,
  whose slots hold consecutive positions). The kernels apply no window: a call with a
  window > 0 takes the reference path (a sliding layer holds about its window, so it reads
  little); with a traced window, `lax.cond` picks per call.

  impl="pallas" on a GPU runs the Triton variant (`paged_attention_pallas_gpu`; compiled,
  or in the generic interpreter with interpret=True); a `pltpu.InterpretParams` as
  `interpret` always runs the TPU kernel under the TPU interpreter. impl="auto" keeps the
  reference on GPU until the GPU kernel has been checked on one (docs/kernels.md).

  Validates every argument before launching anything: shapes (ValueError), dtypes
  (TypeError; the kernel takes float32/bfloat16 only) and, when the page table is concrete,
  its entries against [0, P) (ValueError). Returns (out, probs), plus the per-query-head
  log-sum-exp [B, T, Hq] with `return_lse`. With `return_probs=False` the probabilities
  are None, and prefill chunks (T > 1) on the reference path read only live pages
  (`paged_attention_live_blocks`). Decode (T == 1) on the reference path reads the live
  prefix of the table (`paged_attention_live_prefix`), with or without probabilities.
  """
  use_pallas, interpret = resolve_impl(impl, interpret, gpu_kernel=True)
  validate_paged_attention_args(q, k_pages, v_pages, page_table, lengths, num_queries)
  check_page_table_range(page_table, k_pages.shape[0])
  arrays = (q, k_pages, v_pages, page_table, lengths, num_queries)
  options = dict(
      scale=scale,
      per_query_head=per_query_head,
      return_lse=return_lse,
      return_probs=return_probs,
      impl=impl,
      interpret=interpret,
      pages_per_block=pages_per_block,
  )
  if window is not None and use_pallas and q.shape[1] == 1:
    return _windowed_decode(arrays, options, window)
  if use_pallas and q.shape[1] == 1:
    check_float_dtypes(q=q, k_pages=k_pages, v_pages=v_pages)
    kernel = paged_attention_pallas
    if jax.default_backend() == "gpu" and not isinstance(interpret, pltpu.InterpretParams):
      check_gpu_shapes(q.shape, k_pages.shape[1])
      check_gpu_pool_size(k_pages)
      kernel = paged_attention_pallas_gpu
    return kernel(
        *arrays,
        scale=scale,
        per_query_head=per_query_head,
        return_lse=return_lse,
        pages_per_block=pages_per_block,
        interpret=interpret,
    )
  if not return_probs and q.shape[1] > 1:
    out, lse = paged_attention_live_blocks(*arrays, scale=scale, window=window)
    return (out, None, lse) if return_lse else (out, None)
  if q.shape[1] == 1:
    return paged_attention_live_prefix(
        *arrays,
        scale=scale,
        per_query_head=per_query_head,
        return_lse=return_lse,
        return_probs=return_probs,
        window=window,
    )
  result = paged_attention_reference(
      *arrays, scale=scale, per_query_head=per_query_head, window=window
  )
  if not return_probs:
    result = (result[0], None)
  if return_lse:
    lse = paged_attention_lse_reference(
        q, k_pages, page_table, lengths, num_queries, scale=scale, window=window
    )
    return (*result, lse)
  return result


def _windowed_decode(arrays, options: dict, window):
  """`paged_attention(*arrays, **options)` for a decode step on the kernel path with a
  (possibly traced) `window`: the reference where it is > 0 (the kernels apply none), the
  kernel where it is 0, chosen under `lax.cond`."""
  q, num_queries = arrays[0], arrays[5]
  if num_queries is None:  # both branches take the same arguments
    arrays = (*arrays[:5], jnp.ones((q.shape[0],), jnp.int32))
  reference = dict(options, impl="ref", interpret=None, pages_per_block=None)

  def same_outputs(result):  # the kernel returns probabilities whether asked or not
    return (result[0], result[1] if options["return_probs"] else None, *result[2:])

  return jax.lax.cond(
      jnp.asarray(window) > 0,
      lambda *a: same_outputs(paged_attention(*a, **reference, window=window)),
      lambda *a: same_outputs(paged_attention(*a, **options)),
      *arrays,
  )


PREFIX_MIN_TOKENS = 512  # the narrowest prefix `paged_attention_live_prefix` reads


def prefix_widths(pages: int, page_size: int) -> tuple[int, ...]:
  """The table widths (pages) `paged_attention_live_prefix` chooses among: powers of two
  from `PREFIX_MIN_TOKENS` tokens, and the whole table."""
  width = max(1, PREFIX_MIN_TOKENS // page_size)
  widths = []
  while width < pages:
    widths.append(width)
    width *= 2
  return (*widths, pages)


def prefix_heads_per_step(hkv: int) -> int:
  """Kv heads `paged_attention_live_prefix` reads per step of its loop: one on CPU, where a
  step costs little and each head then reads only its own prefix; all of them elsewhere,
  where every loop step is a launch (and on GPU a host round trip), so one prefix serves
  every head (not measured on an accelerator yet)."""
  return 1 if jax.default_backend() == "cpu" else hkv


def paged_attention_live_prefix(
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
    return_probs: bool = True,
    heads_per_step: int | None = None,
    window=None,
):
  """`paged_attention_reference` (and its lse) for one query per row (within `window`), reading for each
  group of `heads_per_step` kv heads (`prefix_heads_per_step` by default: one on CPU) only
  the narrowest prefix of their tables that holds their live pages in every row: a power
  of two of pages (`prefix_widths`), picked by a switch inside a loop over the groups. One
  pass over a prefix beats the live-blocks loop on CPU (2-3x at 1k-8k tokens); a prefix is
  under twice its heads' longest length, so a cache sized beyond its tokens (a capacity
  bucket) costs memory, not decode time, and a context compressed with a budget per head
  (kvzip: a layer's longest head holds ~1.5x its mean) reads about its kept tokens, not
  its longest head's (one prefix for every head read 50 % of an 8062-token context kept
  at 25 %; one per head, 34 %). Probabilities are zero past the prefix."""
  validate_paged_attention_args(q, k_pages, v_pages, page_table, lengths, num_queries)
  if q.shape[1] != 1:
    raise ValueError(
        f"paged_attention_live_prefix reads for one query per row: q must be [B, 1, Hq, D], "
        f"got {q.shape} (prefill chunks take paged_attention_live_blocks)"
    )
  # Device arrays: the loop slices them with a traced index (NumPy's indexing cannot).
  q, page_table, lengths = map(jnp.asarray, (q, page_table, lengths))
  k_pages, v_pages = (jax.tree.map(jnp.asarray, x) for x in (k_pages, v_pages))
  b, _, hq, d = q.shape
  _, hkv, m = page_table.shape
  g = hq // hkv
  step = prefix_heads_per_step(hkv) if heads_per_step is None else heads_per_step
  if isinstance(step, bool) or not isinstance(step, int) or step < 1 or hkv % step:
    raise ValueError(f"heads_per_step must be an int >= 1 dividing Hkv={hkv}, got {step!r}")
  s = k_pages.shape[1]
  n = m * s
  widths = prefix_widths(m, s)
  num_queries = jnp.ones((b,), jnp.int32) if num_queries is None else jnp.asarray(num_queries)
  rows = step * (g if per_query_head else 1)  # probability rows per group

  def attend(width):
    def run(group, lens):  # kv heads [group * step, (group + 1) * step) of every row
      first = group * step
      table = jax.lax.dynamic_slice_in_dim(page_table, first, step, axis=1)[..., :width]
      q_g = jax.lax.dynamic_slice_in_dim(q, first * g, step * g, axis=2)  # [B, 1, step*G, D]
      args = (q_g, k_pages, v_pages, table, lens, num_queries)
      out, probs = paged_attention_reference(
          *args, scale=scale, per_query_head=per_query_head, window=window
      )  # [B, 1, step*G, D], [B, rows, 1, width * S]
      if return_probs:
        probs = jnp.pad(probs, ((0, 0), (0, 0), (0, 0), (0, n - width * s)))
      else:
        probs = jnp.zeros((), jnp.float32)
      lse = (
          paged_attention_lse_reference(
              q_g, k_pages, table, lens, num_queries, scale=scale, window=window
          )
          if return_lse
          else jnp.zeros((b, 1, step * g), jnp.float32)
      )
      return out, probs, lse

    return run

  branches = [attend(w) for w in widths]
  narrower = jnp.asarray(widths[:-1])

  def one_group(group, carry):
    out, probs, lse = carry
    lens = jax.lax.dynamic_slice_in_dim(lengths, group * step, step, axis=1)  # [B, step]
    live_pages = -(-jnp.max(lens) // s)
    # The first width that holds the group's live pages in every row.
    o, p, l = jax.lax.switch(jnp.sum(narrower < live_pages), branches, group, lens)
    out = jax.lax.dynamic_update_slice_in_dim(out, o.astype(out.dtype), group * step * g, axis=2)
    if return_probs:
      probs = jax.lax.dynamic_update_slice_in_dim(probs, p, group * rows, axis=1)
    return out, probs, jax.lax.dynamic_update_slice_in_dim(lse, l, group * step * g, axis=2)

  init = (
      jnp.zeros((b, 1, hq, d), q.dtype),
      jnp.zeros((b, hkv // step * rows, 1, n), jnp.float32) if return_probs else jnp.zeros(()),
      jnp.zeros((b, 1, hq), jnp.float32),
  )
  out, probs, lse = jax.lax.fori_loop(0, hkv // step, one_group, init)
  result = (out, probs if return_probs else None)
  return (*result, lse) if return_lse else result
