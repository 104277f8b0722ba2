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
from jax.experimental.pallas import triton as pltriton
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
#   Backends: this kernel uses scalar prefetch, which only the Mosaic TPU lowering supports
#   (Triton and Mosaic GPU raise NotImplementedError for it); GPUs get the Triton-style
#   variant `paged_attention_pallas_gpu` below. impl="auto" picks Pallas on TPU only.
# ---------------------------------------------------------------------------------------

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
IMPLS = ("auto", "pallas", "ref")
_TARGET_BLOCK_TOKENS = 128  # tokens per grid step when pages are small


def resolve_impl(impl: str, interpret=None, *, gpu_kernel: bool = False) -> tuple[bool, Any]:
  """(use_pallas, interpret) for a dispatcher call on the default backend.

  auto: Pallas on TPU, reference elsewhere (no GPU kernel has been run on a GPU yet).
  pallas: the kernel; compiled on TPU, and on GPU for ops with a GPU variant
  (`gpu_kernel`, so far paged attention); interpret mode elsewhere unless `interpret` says
  otherwise. `interpret` is passed on to `pl.pallas_call`: a bool, or
  `pltpu.InterpretParams(...)` for the TPU interpreter. The environment variable
  KVJAX_PALLAS_INTERPRET (0/1) sets its default for impl="pallas".
  """
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  backend = jax.default_backend()
  if impl == "ref" or (impl == "auto" and backend != "tpu"):
    return False, False
  compiles = backend == "tpu" or (gpu_kernel and backend == "gpu")
  if interpret is None:
    env = os.environ.get("KVJAX_PALLAS_INTERPRET", "")
    interpret = (env != "0") if env else not compiles
  if not interpret and not compiles:
    raise NotImplementedError(
        f"this kvjax Pallas kernel is TPU-style (scalar-prefetched page tables), which the "
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

  probs = probs_epilogue(logits, lse[..., 0], visible, n, per_query_head)
  out = out.reshape(b, 1, hq, d)
  if return_lse:
    return out, probs, lse.reshape(b, 1, hq)
  return out, probs


def probs_epilogue(logits, lse, visible, n: int, per_query_head: bool):
  """Probabilities from the kernels' unnormalised logits [B, Hkv, blocks, G, bk] and lse
  [B, Hkv, G], in one fused XLA pass; never-written blocks and dead slots are masked out by
  `where`. Returns [B, Hkv, 1, N], or [B, Hq, 1, N] per query head."""
  b, hkv, num_blocks, g, bk = logits.shape
  slot = jnp.arange(num_blocks * bk).reshape(num_blocks, 1, bk)
  live = slot < visible[:, :, None, None, None]  # [B, Hkv, blocks, 1, bk]
  probs = jnp.where(live, jnp.exp(logits - lse[:, :, None, :, None]), 0.0)
  if per_query_head:
    return probs.transpose(0, 1, 3, 2, 4).reshape(b, hkv * g, 1, num_blocks * bk)[..., :n]
  return probs.sum(axis=3).reshape(b, hkv, 1, num_blocks * bk)[..., :n]


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
#   store), so `probs_epilogue` and `return_lse` are shared.
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
  if k_pages.size >= 2**31:
    raise ValueError(f"the GPU kernel addresses pools of < 2**31 elements, got {k_pages.shape}")


def gpu_pages_per_block(
    page_size: int, max_pages: int, pages_per_block: int | None, itemsize: int
) -> int:
  """Pages per block: the request (default: ~128 tokens of 2-byte K/V, 64 of float32, so
  that f32 blocks fit twice in shared memory) raised to a power of two and to at least 16
  tokens, and no larger than the table needs."""
  if pages_per_block is None:
    target = _TARGET_BLOCK_TOKENS if itemsize <= 2 else _TARGET_BLOCK_TOKENS // 2
    pages_per_block = max(1, target // page_size)
  ppb = _next_pow2(max(1, pages_per_block, -(-_GPU_MIN_DOT // page_size)))
  return min(ppb, max(_next_pow2(max_pages), -(-_GPU_MIN_DOT // page_size)))


def _paged_attention_gpu_kernel(
    table_ref,  # [B, Hkv, blocks * ppb] int32
    lengths_ref,  # [B, Hkv] int32, visible slots
    q_ref,  # [B, Hkv, Gp, D]
    k_ref,  # [P, S, D]
    v_ref,  # [P, S, D]
    out_ref,  # [B, Hkv, splits, Gp, D] f32, normalised within the split
    logits_ref,  # [B, Hkv, blocks, G, bk] f32
    lse_ref,  # [B, Hkv, splits, Gp] f32, -inf for an empty split
    *,
    scale,
    group,
    pages_per_block,
    blocks_per_split,
    precision,
):
  b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  gp, d = q_ref.shape[2], q_ref.shape[3]
  page_size = k_ref.shape[1]
  ppb = pages_per_block
  bk = ppb * page_size
  length = lengths_ref[b, h]
  first = split * blocks_per_split
  live_blocks = jax.lax.div(length + bk - 1, bk)
  stop = jnp.minimum(first + blocks_per_split, live_blocks)
  q = q_ref[b, h]  # [Gp, D], input dtype
  dims = (((1,), (1,)), ((), ()))

  def body(i, carry):
    m_prev, l_prev, acc_prev = carry  # [Gp], [Gp], [Gp, D]
    pages = table_ref[b, h, pl.ds(i * ppb, ppb)]  # [ppb]
    # Both dots run in q's dtype (tl.dot takes one operand type; no-op when the pools agree).
    k = k_ref[pages].reshape(bk, d).astype(q.dtype)
    v = v_ref[pages].reshape(bk, d).astype(q.dtype)
    s = jax.lax.dot_general(q, k, dims, precision=precision, preferred_element_type=jnp.float32)
    s = s * scale  # [Gp, bk]
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
    pv = jax.lax.dot_general(
        p.astype(v.dtype),
        v,
        (((1,), (0,)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )
    return m_new, alpha * l_prev + p.sum(axis=1), alpha[:, None] * acc_prev + pv

  init = (
      jnp.full((gp,), -jnp.inf, jnp.float32),
      jnp.zeros((gp,), jnp.float32),
      jnp.zeros((gp, d), jnp.float32),
  )
  m, l, acc = jax.lax.fori_loop(first, stop, body, init)  # no trip past the live blocks
  live = l > 0.0
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
  b, t, hq, d = q.shape
  if t != 1:
    raise ValueError(f"paged_attention_pallas_gpu handles decode (T == 1), got T={t}")
  num_pages, page_size, _ = k_pages.shape
  check_gpu_shapes(q.shape, page_size)
  check_gpu_pool_size(k_pages)
  _, hkv, m = page_table.shape
  g = hq // hkv
  gp = max(_GPU_MIN_DOT, _next_pow2(g))
  n = m * page_size
  scale = d**-0.5 if scale is None else float(scale)
  ppb = gpu_pages_per_block(page_size, m, pages_per_block, jnp.dtype(k_pages.dtype).itemsize)
  bk = ppb * page_size
  visible = effective_lengths(lengths, num_queries, n)
  table, lens, num_blocks = prepare_paged_operands(page_table, visible, num_pages, ppb)
  table, lens = table.reshape(b, hkv, num_blocks * ppb), lens.reshape(b, hkv)
  if num_splits is None:
    num_splits = max(1, min(num_blocks, _GPU_TARGET_PROGRAMS // (b * hkv)))
  blocks_per_split = -(-num_blocks // num_splits)
  num_splits = -(-num_blocks // blocks_per_split)  # no split left without blocks
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

  q_BxKxGpxD = jnp.pad(q.reshape(b, hkv, g, d), ((0, 0), (0, 0), (0, gp - g), (0, 0)))
  kernel = functools.partial(
      _paged_attention_gpu_kernel,
      scale=scale,
      group=g,
      pages_per_block=ppb,
      blocks_per_split=blocks_per_split,
      precision=precision,
  )
  out_s, logits, lse_s = pl.pallas_call(
      kernel,
      grid=(b, hkv, num_splits),
      out_shape=[
          jax.ShapeDtypeStruct((b, hkv, num_splits, gp, d), jnp.float32),
          jax.ShapeDtypeStruct((b, hkv, num_blocks, g, bk), jnp.float32),
          jax.ShapeDtypeStruct((b, hkv, num_splits, gp), jnp.float32),
      ],
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="kvjax_paged_attention_gpu",
  )(table, lens, q_BxKxGpxD, k_pages, v_pages)

  # Combine the splits (flash-decoding): weights exp(lse_s - lse); empty splits weigh 0.
  out_s, lse_s = out_s[..., :g, :], lse_s[..., :g]  # [B, Hkv, splits, G, D], [.., G]
  m_max = lse_s.max(axis=2)  # [B, Hkv, G]
  seen = m_max > -jnp.inf
  shift = jnp.where(seen, m_max, 0.0)
  weight = jnp.exp(lse_s - shift[:, :, None])  # [B, Hkv, splits, G]
  total = weight.sum(axis=2)
  lse = jnp.where(seen, shift + jnp.log(jnp.where(seen, total, 1.0)), jnp.inf)
  out = (weight[..., None] * out_s).sum(axis=2) / jnp.where(seen, total, 1.0)[..., None]
  out = out.astype(q.dtype).reshape(b, 1, hq, d)

  probs = probs_epilogue(logits, lse, visible, n, per_query_head)
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

  impl="pallas" on a GPU runs the Triton variant (`paged_attention_pallas_gpu`; compiled,
  or in the generic interpreter with interpret=True); a `pltpu.InterpretParams` as
  `interpret` always runs the TPU kernel under the TPU interpreter. impl="auto" keeps the
  reference on GPU until the GPU kernel has been checked on one (docs/kernels.md).

  Validates every argument before launching anything: shapes (ValueError), dtypes
  (TypeError; the kernel takes float32/bfloat16 only) and, when the page table is concrete,
  its entries against [0, P) (ValueError). Returns (out, probs), plus the per-query-head
  log-sum-exp [B, T, Hq] with `return_lse`.
  """
  use_pallas, interpret = resolve_impl(impl, interpret, gpu_kernel=True)
  validate_paged_attention_args(q, k_pages, v_pages, page_table, lengths, num_queries)
  check_page_table_range(page_table, k_pages.shape[0])
  if use_pallas and q.shape[1] == 1:
    check_float_dtypes(q=q, k_pages=k_pages, v_pages=v_pages)
    kernel = paged_attention_pallas
    if jax.default_backend() == "gpu" and not isinstance(interpret, pltpu.InterpretParams):
      check_gpu_shapes(q.shape, k_pages.shape[1])
      check_gpu_pool_size(k_pages)
      kernel = paged_attention_pallas_gpu
    return kernel(
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
