"""The live-blocks loops: paged attention and its key_max reading only the blocks of the page
table that hold live slots, in a `lax.fori_loop` whose trip count is the live blocks (pure jnp;
the path CPU and GPU take when nothing needs the probabilities).

`paged_attention_live_blocks` is the reference's output and lse by an online softmax;
`paged_attention_key_max` the most attention any query pays each slot, from that lse. Both
walk the table the same way (`_blocks_of`, `_read_block`, `_visible_in_block`), with the
reference's row layout and visibility bounds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels import page_format
from pallas_kernels._common import validate_paged_args as validate_paged_attention_args
from pallas_kernels.paged_attention.reference import (
    _NEG_INF,
    _per_query,
    _query_rows,
    _visible_floor,
    _visible_limit,
)

__all__ = [
    "KEY_MAX_BLOCK_TOKENS",
    "LIVE_BLOCK_TOKENS",
    "paged_attention_key_max",
    "paged_attention_live_blocks",
]

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
