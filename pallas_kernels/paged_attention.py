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
    raise ValueError(
        f"v_pages shape {getattr(v_pages, 'shape', None)} != k_pages shape " f"{k_pages.shape}"
    )
  if getattr(page_table, "ndim", None) != 3 or page_table.shape[0] != b:
    raise ValueError(
        f"page_table must be [B={b}, Hkv, M], got " f"{getattr(page_table, 'shape', None)}"
    )
  hkv = page_table.shape[1]
  if hq % hkv:
    raise ValueError(f"query heads Hq={hq} must be a multiple of kv heads Hkv={hkv}")
  if getattr(lengths, "shape", None) != (b, hkv):
    raise ValueError(
        f"lengths must be [B, Hkv] = {(b, hkv)}, got " f"{getattr(lengths, 'shape', None)}"
    )
  if num_queries is not None and jnp.shape(num_queries) != (b,):
    raise ValueError(f"num_queries must be [B] = ({b},), got {jnp.shape(num_queries)}")
  for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must be floating point, got {x.dtype}")
  for name, x in (("page_table", page_table), ("lengths", lengths)):
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise TypeError(f"{name} must be integer, got {x.dtype}")


def visible_mask(lengths, num_queries, t: int, n: int):
  """[B, Hkv, T, N]: slot n is visible to query t of row b.

  The T queries are the last `num_queries[b]` tokens written to each sequence (a prefill
  chunk or one decode token), so query t sees slots < lengths - num_queries + t + 1:
  everything cached before the chunk, and the chunk causally. Padding queries see nothing.
  """
  q_idx = jnp.arange(t)[None, None, :]  # [1, 1, T]
  limit = lengths[:, :, None] - num_queries[:, None, None] + q_idx + 1  # [B, Hkv, T]
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
    per_query_head: bool = False,
) -> tuple[Float[Array, "B T Hq D"], Float[Array, "B Hkv T N"]]:
  """Causal GQA attention of T queries over paged sequences (N = M * S slots).

  Returns the output and the attention probabilities per kv head, summed over the
  query heads that share it (zero for masked slots and padding queries); with
  `per_query_head`, the probabilities of each query head instead: [B, Hq, T, N].
  """
  validate_paged_attention_args(q, k_pages, v_pages, page_table, lengths, num_queries)
  b, t, hq, d = q.shape
  _, hkv, m = page_table.shape
  n = m * k_pages.shape[1]
  g = hq // hkv
  num_queries = jnp.full((b,), t, jnp.int32) if num_queries is None else num_queries
  scale = d**-0.5 if scale is None else scale

  k_BxKxNxD = k_pages[page_table].reshape(b, hkv, n, d).astype(jnp.float32)
  v_BxKxNxD = v_pages[page_table].reshape(b, hkv, n, d).astype(jnp.float32)
  # Unused slots may hold anything (NaN included). Masked logits are replaced below; V
  # must be zeroed so that 0 * NaN never reaches the output.
  live_BxKxN = jnp.arange(n) < lengths[..., None]
  v_BxKxNxD = jnp.where(live_BxKxN[..., None], v_BxKxNxD, 0.0)

  # Kv-head-major layout ([B, Hkv, T*G, D]) keeps both contractions plain batched matmuls.
  q_BxKxQxD = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * g, d)
  logits = jnp.einsum("bkqd,bknd->bkqn", q_BxKxQxD.astype(jnp.float32) * scale, k_BxKxNxD)
  visible = jnp.repeat(visible_mask(lengths, num_queries, t, n), g, axis=2)  # [B, Hkv, T*G, N]
  logits = jnp.where(visible, logits, _NEG_INF)
  probs = jnp.where(visible, jax.nn.softmax(logits, axis=-1), 0.0)
  out = jnp.einsum("bkqn,bknd->bkqd", probs, v_BxKxNxD)
  out = out.reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, hq, d)
  probs = probs.reshape(b, hkv, t, g, n)
  if per_query_head:
    return out.astype(q.dtype), probs.transpose(0, 1, 3, 2, 4).reshape(b, hq, t, n)
  return out.astype(q.dtype), probs.sum(axis=3)
