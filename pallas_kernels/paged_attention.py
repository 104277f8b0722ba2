"""Paged attention over the kvjax page pool, returning the statistics eviction policies use.

`paged_attention_reference` is the specification (pure jnp); a Pallas kernel and the
`paged_attention(..., impl=...)` dispatcher sit beside it in this module.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
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
#   head). Its extra HBM traffic is 4*G bytes per slot written + read, against 2*D*itemsize
#   bytes of K/V per slot read by the kernel (e.g. 12 vs 256 bytes for G=3, D=64, bf16).
#   The epilogue was preferred over a second kernel pass, which would read K again.
#
#   Empty rows (length 0 or a padding query) give out = 0, probs = 0 and lse = +inf, so that
#   exp(logit - lse) = 0 for any consumer of lse (e.g. the output-impact kernel).
#
#   Backends: the kernels use scalar prefetch, which only the Mosaic TPU lowering supports
#   (Triton and Mosaic GPU raise NotImplementedError for it), so impl="auto" picks Pallas
#   on TPU and the reference on GPU and CPU; impl="pallas" off TPU runs in interpret mode.
# ---------------------------------------------------------------------------------------

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
IMPLS = ("auto", "pallas", "ref")
_TARGET_BLOCK_TOKENS = 128  # tokens per grid step when pages are small


def resolve_impl(impl: str, interpret=None) -> tuple[bool, Any]:
  """(use_pallas, interpret) for a dispatcher call on the default backend.

  auto: Pallas on TPU, reference elsewhere. pallas: the kernel; compiled on TPU, interpret
  mode elsewhere unless `interpret` says otherwise. `interpret` is passed on to
  `pl.pallas_call`: a bool, or `pltpu.InterpretParams(...)` for the TPU interpreter. The
  environment variable KVJAX_PALLAS_INTERPRET (0/1) sets its default for impl="pallas".
  """
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  backend = jax.default_backend()
  if impl == "ref" or (impl == "auto" and backend != "tpu"):
    return False, False
  if interpret is None:
    env = os.environ.get("KVJAX_PALLAS_INTERPRET", "")
    interpret = (env != "0") if env else backend != "tpu"
  if not interpret and backend != "tpu":
    raise NotImplementedError(
        f"the kvjax Pallas kernels are TPU-style (scalar-prefetched page tables), which the "
        f"{backend!r} backend cannot compile; use interpret=True or impl='ref'/'auto'"
    )
  return True, interpret


def is_traced(x) -> bool:
  return isinstance(x, jax.core.Tracer)


def check_float_dtypes(**arrays):
  for name, x in arrays.items():
    if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
      raise TypeError(f"{name} must be float32 or bfloat16 for the Pallas kernel, got {x.dtype}")


def check_page_table_range(page_table, num_pages: int):
  """ValueError if a concrete page table points outside [0, num_pages)."""
  if is_traced(page_table):
    return
  table = np.asarray(page_table)
  if table.size and (table.min() < 0 or table.max() >= num_pages):
    raise ValueError(
        f"page_table entries must lie in [0, P={num_pages}), got range "
        f"[{table.min()}, {table.max()}]"
    )


def default_pages_per_block(page_size: int, max_pages: int) -> int:
  return max(1, min(max_pages, _TARGET_BLOCK_TOKENS // page_size))


def paged_kv_specs(page_size, head_dim, num_kv_heads, pages_per_table, pages_per_block):
  """BlockSpecs for `pages_per_block` views of one page pool, read through the
  scalar-prefetched page table. Index maps take (b, h, i, table_ref, lengths_ref)."""

  def spec(j):
    def index_map(b, h, i, table_ref, lengths_ref):
      seq = b * num_kv_heads + h
      live_pages = jax.lax.div(lengths_ref[seq] + page_size - 1, page_size)
      page = jnp.minimum(i * pages_per_block + j, jnp.maximum(live_pages - 1, 0))
      return table_ref[seq * pages_per_table + page], 0, 0

    return pl.BlockSpec((None, page_size, head_dim), index_map)

  return [spec(j) for j in range(pages_per_block)]


def last_live_block(b, h, i, lengths_ref, num_kv_heads, block_tokens):
  """Block index i clamped to the last block holding live slots (dead steps revisit it)."""
  length = lengths_ref[b * num_kv_heads + h]
  return jnp.minimum(i, jnp.maximum(jax.lax.div(length + block_tokens - 1, block_tokens) - 1, 0))


def prepare_paged_operands(page_table, lengths, num_pages, pages_per_block):
  """Pads the table to whole blocks, clips it into range (memory safety under jit; concrete
  tables were validated) and flattens table and lengths for scalar prefetch."""
  b, hkv, m = page_table.shape
  num_blocks = -(-m // pages_per_block)
  pad = num_blocks * pages_per_block - m
  table = jnp.clip(jnp.asarray(page_table, jnp.int32), 0, num_pages - 1)
  table = jnp.pad(table, ((0, 0), (0, 0), (0, pad)))
  return table.reshape(-1), jnp.asarray(lengths, jnp.int32).reshape(-1), num_blocks


def _dot(a, b, contract):
  return jax.lax.dot_general(
      a,
      b,
      ((contract[0], contract[1]), ((), ())),
      precision=jax.lax.Precision.HIGHEST,
      preferred_element_type=jnp.float32,
  )


def _paged_attention_kernel(
    table_ref,
    lengths_ref,
    q_ref,
    *refs,
    scale,
    page_size,
    pages_per_block,
    num_kv_heads,
):
  k_refs = refs[:pages_per_block]
  v_refs = refs[pages_per_block : 2 * pages_per_block]
  out_ref, logits_ref, lse_ref, m_ref, l_ref, acc_ref = refs[2 * pages_per_block :]
  b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  block_tokens = page_size * pages_per_block
  length = lengths_ref[b * num_kv_heads + h]

  @pl.when(i == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(i * block_tokens < length)
  def _block():
    q = q_ref[...].astype(jnp.float32) * scale  # [G, D]
    # Cast each page before concatenating: f32 pages of >= 8 rows stay sublane-tile aligned.
    k = jnp.concatenate([r[...].astype(jnp.float32) for r in k_refs], axis=0)  # [bk, D]
    v = jnp.concatenate([r[...].astype(jnp.float32) for r in v_refs], axis=0)
    s = _dot(q, k, ((1,), (1,)))  # [G, bk]
    slot = i * block_tokens + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    s = jnp.where(slot < length, s, -jnp.inf)
    logits_ref[...] = s
    m_prev = m_ref[...]
    m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))  # finite: block has a live slot
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.exp(s - m_new)  # masked slots: exp(-inf) = 0
    live_row = (i * block_tokens + jax.lax.broadcasted_iota(jnp.int32, (block_tokens, 1), 0)) < (
        length
    )
    v = jnp.where(live_row, v, 0.0)
    l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
    acc_ref[...] = alpha * acc_ref[...] + _dot(p, v, ((1,), (0,)))
    m_ref[...] = m_new

  @pl.when(i == pl.num_programs(2) - 1)
  def _finish():
    l = l_ref[...]
    live = l > 0.0
    safe_l = jnp.where(live, l, 1.0)
    out_ref[...] = jnp.where(live, acc_ref[...] / safe_l, 0.0).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(live, m_ref[...] + jnp.log(safe_l), jnp.inf)


def effective_lengths(lengths, num_queries, num_slots):
  """Slots visible to the single (decode) query of each sequence: [B, Hkv] int32."""
  lengths = jnp.asarray(lengths, jnp.int32)
  if num_queries is None:
    visible = lengths
  else:
    nq = jnp.asarray(num_queries, jnp.int32)[:, None]
    visible = jnp.where(nq > 0, lengths - nq + 1, 0)
  return jnp.clip(visible, 0, num_slots)


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
  b, t, hq, d = q.shape
  if t != 1:
    raise ValueError(f"paged_attention_pallas handles decode (T == 1), got T={t}")
  num_pages, page_size, _ = k_pages.shape
  _, hkv, m = page_table.shape
  g = hq // hkv
  n = m * page_size
  scale = d**-0.5 if scale is None else float(scale)
  ppb = default_pages_per_block(page_size, m) if pages_per_block is None else pages_per_block
  bk = ppb * page_size
  visible = effective_lengths(lengths, num_queries, n)
  table, lens, num_blocks = prepare_paged_operands(page_table, visible, num_pages, ppb)

  q_BxKxGxD = q.reshape(b, hkv, g, d)
  head_spec = pl.BlockSpec((None, None, g, d), lambda b_, h_, i_, *_: (b_, h_, 0, 0))
  kv_specs = paged_kv_specs(page_size, d, hkv, num_blocks * ppb, ppb)

  def logits_map(b_, h_, i_, table_ref, lengths_ref):
    return b_, h_, last_live_block(b_, h_, i_, lengths_ref, hkv, bk), 0, 0

  kernel = functools.partial(
      _paged_attention_kernel,
      scale=scale,
      page_size=page_size,
      pages_per_block=ppb,
      num_kv_heads=hkv,
  )
  out, logits, lse = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(b, hkv, num_blocks),
          in_specs=[head_spec, *kv_specs, *kv_specs],
          out_specs=[
              head_spec,
              pl.BlockSpec((None, None, None, g, bk), logits_map),
              pl.BlockSpec((None, None, g, 1), lambda b_, h_, i_, *_: (b_, h_, 0, 0)),
          ],
          scratch_shapes=[
              pltpu.VMEM((g, 1), jnp.float32),
              pltpu.VMEM((g, 1), jnp.float32),
              pltpu.VMEM((g, d), jnp.float32),
          ],
      ),
      out_shape=[
          jax.ShapeDtypeStruct((b, hkv, g, d), q.dtype),
          jax.ShapeDtypeStruct((b, hkv, num_blocks, g, bk), jnp.float32),
          jax.ShapeDtypeStruct((b, hkv, g, 1), jnp.float32),
      ],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")
      ),
      interpret=interpret,
      name="kvjax_paged_attention",
  )(table, lens, q_BxKxGxD, *([k_pages] * ppb), *([v_pages] * ppb))

  # Epilogue (one fused XLA pass): normalise the live logits with the final lse;
  # never-written blocks and dead slots are masked out by `where`.
  lse = lse[..., 0]  # [B, Hkv, G]
  slot = jnp.arange(num_blocks * bk).reshape(num_blocks, 1, bk)
  live = slot < visible[:, :, None, None, None]  # [B, Hkv, M/ppb, 1, bk]
  probs = jnp.where(live, jnp.exp(logits - lse[:, :, None, :, None]), 0.0)
  if per_query_head:
    probs = probs.transpose(0, 1, 3, 2, 4).reshape(b, hq, 1, num_blocks * bk)[..., :n]
  else:
    probs = probs.sum(axis=3).reshape(b, hkv, 1, num_blocks * bk)[..., :n]
  out = out.reshape(b, 1, hq, d)
  if return_lse:
    return out, probs, lse.reshape(b, 1, hq)
  return out, probs


def paged_attention_lse_reference(
    q: Float[Array, "B T Hq D"],
    k_pages: Float[Array, "P S D"],
    page_table: Int[Array, "B Hkv M"],
    lengths: Int[Array, "B Hkv"],
    num_queries: Int[Array, " B"] | None = None,
    *,
    scale: float | None = None,
) -> Float[Array, "B T Hq"]:
  """Log-sum-exp of each query head's visible scaled logits (+inf where none is visible)."""
  b, t, hq, d = q.shape
  _, hkv, m = page_table.shape
  n = m * k_pages.shape[1]
  g = hq // hkv
  num_queries = jnp.full((b,), t, jnp.int32) if num_queries is None else num_queries
  scale = d**-0.5 if scale is None else scale
  k_BxKxNxD = k_pages[page_table].reshape(b, hkv, n, d).astype(jnp.float32)
  q_BxKxQxD = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * g, d)
  logits = jnp.einsum("bkqd,bknd->bkqn", q_BxKxQxD.astype(jnp.float32) * scale, k_BxKxNxD)
  visible = jnp.repeat(visible_mask(lengths, num_queries, t, n), g, axis=2)
  logits = jnp.where(visible, logits, -jnp.inf)
  any_visible = visible.any(-1)
  lse = jax.nn.logsumexp(jnp.where(any_visible[..., None], logits, 0.0), axis=-1)
  lse = jnp.where(any_visible, lse, jnp.inf)  # [B, Hkv, T*G]
  return lse.reshape(b, hkv, t, g).transpose(0, 2, 1, 3).reshape(b, t, hq)


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
    impl: str = "auto",
    interpret: Any = None,
    pages_per_block: int | None = None,
):
  """Paged attention with the kernel where it runs (TPU; impl="auto") and the reference
  elsewhere; prefill chunks (T > 1) always take the reference.

  Validates every argument before launching anything: shapes (ValueError), dtypes
  (TypeError; the kernel takes float32/bfloat16 only) and, when the page table is concrete,
  its entries against [0, P) (ValueError). Returns (out, probs), plus the per-query-head
  log-sum-exp [B, T, Hq] with `return_lse`.
  """
  use_pallas, interpret = resolve_impl(impl, interpret)
  validate_paged_attention_args(q, k_pages, v_pages, page_table, lengths, num_queries)
  check_page_table_range(page_table, k_pages.shape[0])
  if use_pallas and q.shape[1] == 1:
    check_float_dtypes(q=q, k_pages=k_pages, v_pages=v_pages)
    return paged_attention_pallas(
        q,
        k_pages,
        v_pages,
        page_table,
        lengths,
        num_queries,
        scale=scale,
        per_query_head=per_query_head,
        return_lse=return_lse,
        pages_per_block=pages_per_block,
        interpret=interpret,
    )
  result = paged_attention_reference(
      q,
      k_pages,
      v_pages,
      page_table,
      lengths,
      num_queries,
      scale=scale,
      per_query_head=per_query_head,
  )
  if return_lse:
    lse = paged_attention_lse_reference(q, k_pages, page_table, lengths, num_queries, scale=scale)
    return (*result, lse)
  return result
