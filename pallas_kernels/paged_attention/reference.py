"""The specification of paged attention: `paged_attention_reference` (the output and the
attention probabilities eviction policies use) and `paged_attention_lse_reference` (the
log-sum-exp the kernels and the live-blocks loop also return), pure jnp over the whole page
table, for T queries per row (a prefill chunk or one decode token).

The row layout and the visibility bounds here (`_query_rows`, `_per_query`, `_visible_limit`,
`_visible_floor`) are the ones the live-blocks loops (`blocks`) compute block by block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels._common import gather_pages
from pallas_kernels._common import validate_paged_args as validate_paged_attention_args

__all__ = ["paged_attention_lse_reference", "paged_attention_reference", "visible_mask"]

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
