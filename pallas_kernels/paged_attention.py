"""Paged attention over the kvjax page pool, returning the statistics eviction policies use.

`paged_attention_reference` is the specification (pure jnp); a Pallas kernel and the
`paged_attention(..., impl=...)` dispatcher sit beside it in this module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

_NEG_INF = -1e30  # finite, so fully masked rows give zeros instead of NaN


def validate_paged_attention_args(q, k_pages, v_pages, page_table, lengths, num_queries):
  """Raises ValueError/TypeError for inconsistent shapes or dtypes (before any compute)."""
  if getattr(q, "ndim", None) != 4:
    raise ValueError(f"q must be [B, T, Hq, D], got shape {getattr(q, 'shape', None)}")
  b, _, hq, d = q.shape
  if getattr(k_pages, "ndim", None) != 3 or k_pages.shape[-1] != d:
    raise ValueError(f"k_pages must be [P, S, D={d}], got {getattr(k_pages, 'shape', None)}")
  if getattr(v_pages, "shape", None) != k_pages.shape:
    raise ValueError(f"v_pages shape {getattr(v_pages, 'shape', None)} != k_pages shape "
                     f"{k_pages.shape}")
  if getattr(page_table, "ndim", None) != 3 or page_table.shape[0] != b:
    raise ValueError(f"page_table must be [B={b}, Hkv, M], got "
                     f"{getattr(page_table, 'shape', None)}")
  hkv = page_table.shape[1]
  if hq % hkv:
    raise ValueError(f"query heads Hq={hq} must be a multiple of kv heads Hkv={hkv}")
  if getattr(lengths, "shape", None) != (b, hkv):
    raise ValueError(f"lengths must be [B, Hkv] = {(b, hkv)}, got "
                     f"{getattr(lengths, 'shape', None)}")
  if num_queries is not None and jnp.shape(num_queries) != (b,):
    raise ValueError(f"num_queries must be [B] = ({b},), got {jnp.shape(num_queries)}")
  for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must be floating point, got {x.dtype}")
  for name, x in (("page_table", page_table), ("lengths", lengths)):
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise TypeError(f"{name} must be integer, got {x.dtype}")


def visible_mask(lengths, num_queries, t: int, n: int):
  """[B, T, Hkv, N]: slot n is visible to query t of row b.

  The T queries are the last `num_queries[b]` tokens written to each sequence (a prefill
  chunk or one decode token), so query t sees slots < lengths - num_queries + t + 1:
  everything cached before the chunk, and the chunk causally. Padding queries see nothing.
  """
  q_idx = jnp.arange(t)[None, :, None]  # [1, T, 1]
  limit = lengths[:, None, :] - num_queries[:, None, None] + q_idx + 1  # [B, T, Hkv]
  limit = jnp.where(q_idx < num_queries[:, None, None], limit, 0)
  return jnp.arange(n) < limit[..., None]


def paged_attention_reference(
    q: Float[Array, "B T Hq D"],
    k_pages: Float[Array, "P S D"],
    v_pages: Float[Array, "P S D"],
    page_table: Int[Array, "B Hkv M"],
    lengths: Int[Array, "B Hkv"],
    num_queries: Int[Array, " B"] | None = None,
    *,
    scale: float | None = None,
) -> tuple[Float[Array, "B T Hq D"], Float[Array, "B T Hkv N"]]:
  """Causal GQA attention of T queries over paged sequences (N = M * S slots).

  Returns the output and the attention probabilities per kv head, summed over the
  query heads that share it (zero for masked slots and padding queries).
  """
  validate_paged_attention_args(q, k_pages, v_pages, page_table, lengths, num_queries)
  b, t, hq, d = q.shape
  _, hkv, m = page_table.shape
  s = k_pages.shape[1]
  n = m * s
  g = hq // hkv
  num_queries = jnp.full((b,), t, jnp.int32) if num_queries is None else num_queries
  scale = d**-0.5 if scale is None else scale

  k_BxKxNxD = k_pages[page_table].reshape(b, hkv, n, d)
  v_BxKxNxD = v_pages[page_table].reshape(b, hkv, n, d)
  live_BxKxN = jnp.arange(n) < lengths[..., None]
  # Unused slots may hold anything (NaN included): zero them so 0 * NaN never happens.
  k_BxKxNxD = jnp.where(live_BxKxN[..., None], k_BxKxNxD, 0).astype(jnp.float32)
  v_BxKxNxD = jnp.where(live_BxKxN[..., None], v_BxKxNxD, 0).astype(jnp.float32)

  q_BxTxKxGxD = q.reshape(b, t, hkv, g, d).astype(jnp.float32) * scale
  logits = jnp.einsum("btkgd,bknd->btkgn", q_BxTxKxGxD, k_BxKxNxD)
  visible = visible_mask(lengths, num_queries, t, n)[:, :, :, None, :]  # [B, T, Hkv, 1, N]
  logits = jnp.where(visible, logits, _NEG_INF)
  probs = jax.nn.softmax(logits, axis=-1)
  probs = jnp.where(visible, probs, 0.0)
  out = jnp.einsum("btkgn,bknd->btkgd", probs, v_BxKxNxD)
  return out.reshape(b, t, hq, d).astype(q.dtype), probs.sum(axis=3)
