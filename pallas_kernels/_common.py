"""Helpers shared by the kvjax Pallas kernels (paged attention, output impact, group
importance): implementation choice, argument checks, and the prologue, block specs, grid
and in-kernel block loading of the TPU-style paged decode kernels.

Each op keeps its kernel, wrapper (`*_pallas`), reference (`*_reference`) and dispatcher in
its own module; this module holds only what more than one of them uses.

Paged decode layout (see `pallas_kernels.paged_attention.tpu` for the design): q is
[B, 1, Hq, D] with G = Hq / Hkv query heads per kv head, the pools are [P, S, D], the page
table [B, Hkv, M] and the lengths [B, Hkv]; a sequence has N = M * S slots, read in blocks
of bk = pages_per_block * S tokens on the grid (B, Hkv, blocks).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import page_format

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
IMPLS = ("auto", "pallas", "ref")
TARGET_BLOCK_TOKENS = 128  # tokens per grid step when pages are small

# ---------------------------------------------------------------------------------------
# Dispatch and argument checks.


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
  """Whether `x` is a tracer (inside jit): its values cannot be checked on the host."""
  return isinstance(x, jax.core.Tracer)


def check_float_dtypes(**arrays):
  """TypeError unless every array is float32 or bfloat16 (what the kernels take); a
  quantized page pool (`QuantizedPages`) passes: the kernels dequantize it."""
  for name, x in arrays.items():
    if isinstance(x, page_format.QuantizedPages):
      continue
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


def validate_paged_args(q, k_pages, v_pages, page_table, lengths, num_queries=None):
  """Raises ValueError/TypeError for inconsistent shapes or dtypes (before any compute):
  q [B, T, Hq, D], k_pages = v_pages [P, S, D] (float, or `QuantizedPages` of one K/V
  dtype), page_table [B, Hkv, M] with Hkv dividing Hq, lengths [B, Hkv] and, if given,
  num_queries [B]."""
  if getattr(q, "ndim", None) != 4:
    raise ValueError(f"q must be [B, T, Hq, D], got shape {getattr(q, 'shape', None)}")
  b, _, hq, d = q.shape
  if getattr(k_pages, "ndim", None) != 3 or k_pages.shape[-1] != d:
    raise ValueError(f"k_pages must be [P, S, D={d}], got {getattr(k_pages, 'shape', None)}")
  if getattr(v_pages, "shape", None) != k_pages.shape:
    raise ValueError(
        f"v_pages shape {getattr(v_pages, 'shape', None)} != k_pages shape " f"{k_pages.shape}"
    )
  quantized = [isinstance(x, page_format.QuantizedPages) for x in (k_pages, v_pages)]
  if any(quantized) and (not all(quantized) or k_pages.kv_dtype != v_pages.kv_dtype):
    raise TypeError(
        f"k_pages and v_pages must be stored alike, got {page_format.kv_dtype_of(k_pages)} "
        f"and {page_format.kv_dtype_of(v_pages)}"
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
  check_dtype_kind(jnp.floating, "floating point", q=q)
  if not any(quantized):
    check_dtype_kind(jnp.floating, "floating point", k_pages=k_pages, v_pages=v_pages)
  check_dtype_kind(jnp.integer, "integer", page_table=page_table, lengths=lengths)


def check_dtype_kind(kind, kind_name: str, **arrays):
  """TypeError unless every array's dtype is a subtype of `kind` (e.g. jnp.floating)."""
  for name, x in arrays.items():
    if not jnp.issubdtype(x.dtype, kind):
      raise TypeError(f"{name} must be {kind_name}, got {x.dtype}")


# ---------------------------------------------------------------------------------------
# References.


def gather_pages(pages, page_table, lengths=None):
  """[B, Hkv, N, D] float32: each sequence's pages [P, S, D] (float or quantized) in logical
  order through the table [B, Hkv, M]. With `lengths` [B, Hkv], slots at or past the
  length are zeroed (unused slots may hold anything, NaN included)."""
  b, hkv, m = page_table.shape
  _, page_size, d = pages.shape
  x = page_format.read(pages, page_table).reshape(b, hkv, m * page_size, d)
  if lengths is None:
    return x
  return jnp.where(live_slots(lengths, m * page_size)[..., None], x, 0.0)


def live_slots(lengths, num_slots: int):
  """[B, Hkv, N]: slot n holds a token of its sequence (n < length)."""
  return jnp.arange(num_slots) < lengths[..., None]


# ---------------------------------------------------------------------------------------
# Paged decode kernels (TPU-style: scalar-prefetched page table and lengths).


def effective_lengths(lengths, num_queries, num_slots):
  """Slots visible to the single (decode) query of each sequence: [B, Hkv] int32."""
  lengths = jnp.asarray(lengths, jnp.int32)
  if num_queries is None:
    visible = lengths
  else:
    nq = jnp.asarray(num_queries, jnp.int32)[:, None]
    visible = jnp.where(nq > 0, lengths - nq + 1, 0)
  return jnp.clip(visible, 0, num_slots)


def default_pages_per_block(page_size: int, max_pages: int) -> int:
  """Pages per kernel block: about `TARGET_BLOCK_TOKENS` tokens, at least one page and at
  most the page table's width."""
  return max(1, min(max_pages, TARGET_BLOCK_TOKENS // page_size))


def prepare_paged_operands(page_table, lengths, num_pages, pages_per_block):
  """Pads the table to whole blocks, clips it into range (memory safety under jit; concrete
  tables were validated) and flattens table and lengths for scalar prefetch."""
  b, hkv, m = page_table.shape
  num_blocks = -(-m // pages_per_block)
  pad = num_blocks * pages_per_block - m
  table = jnp.clip(jnp.asarray(page_table, jnp.int32), 0, num_pages - 1)
  table = jnp.pad(table, ((0, 0), (0, 0), (0, pad)))
  return table.reshape(-1), jnp.asarray(lengths, jnp.int32).reshape(-1), num_blocks


@dataclasses.dataclass(frozen=True)
class PagedDecode:
  """Sizes and prepared operands of one paged decode kernel call (see `decode_prologue`)."""

  batch: int  # B
  kv_heads: int  # Hkv
  group: int  # G = Hq / Hkv
  head_dim: int  # D
  num_pages: int  # P
  page_size: int  # S
  num_slots: int  # N = M * S
  scale: float
  pages_per_block: int  # ppb
  num_blocks: int  # blocks = ceil(M / ppb)
  visible: jax.Array  # [B, Hkv] int32, slots the query sees
  table: jax.Array  # [B * Hkv * blocks * ppb] int32, padded and clipped into [0, P)
  lens: jax.Array  # [B * Hkv] int32, = visible

  @property
  def block_tokens(self) -> int:  # bk
    return self.pages_per_block * self.page_size

  @property
  def q_heads(self) -> int:  # Hq
    return self.kv_heads * self.group


def decode_prologue(
    name: str, q, k_pages, page_table, lengths, num_queries, scale, pages_per_block
) -> PagedDecode:
  """What the paged decode wrappers (`name`, for the error) share before their kernel:
  the T == 1 check, sizes, default scale D**-0.5, pages per block (`pages_per_block`: a
  number, None for `default_pages_per_block`, or a function of (S, M) giving it), the
  visible lengths and the padded, flattened page table."""
  b, t, hq, d = q.shape  # [B, 1, Hq, D]
  if t != 1:
    raise ValueError(f"{name} handles decode (T == 1), got T={t}")
  num_pages, page_size, _ = k_pages.shape  # [P, S, D]
  _, hkv, m = page_table.shape  # [B, Hkv, M]
  n = m * page_size
  if pages_per_block is None:
    ppb = default_pages_per_block(page_size, m)
  else:
    ppb = pages_per_block(page_size, m) if callable(pages_per_block) else pages_per_block
  visible = effective_lengths(lengths, num_queries, n)  # [B, Hkv]
  table, lens, num_blocks = prepare_paged_operands(page_table, visible, num_pages, ppb)
  return PagedDecode(
      batch=b,
      kv_heads=hkv,
      group=hq // hkv,
      head_dim=d,
      num_pages=num_pages,
      page_size=page_size,
      num_slots=n,
      scale=d**-0.5 if scale is None else float(scale),
      pages_per_block=ppb,
      num_blocks=num_blocks,
      visible=visible,
      table=table,
      lens=lens,
  )


def unblock(p: PagedDecode, x):
  """[B, Hkv, R, N] from a kernel's blocked output x [B, Hkv, blocks, R, bk], zero at
  never-written blocks and dead slots (`where`, so whatever they hold never leaks)."""
  b, hkv, num_blocks, rows, bk = x.shape
  slot = jnp.arange(num_blocks * bk).reshape(num_blocks, 1, bk)
  x = jnp.where(slot < p.visible[:, :, None, None, None], x, 0.0)
  return x.transpose(0, 1, 3, 2, 4).reshape(b, hkv, rows, num_blocks * bk)[..., : p.num_slots]


def paged_kv_specs(pool, num_kv_heads, pages_per_table, pages_per_block):
  """BlockSpecs for `pages_per_block` views of one page pool (float [P, S, D], or each of a
  `QuantizedPages`' arrays [P, S, ...], page by page), read through the scalar-prefetched
  page table. Index maps take (b, h, i, table_ref, lengths_ref)."""
  page_size = pool.shape[1]

  def spec(j, width):
    def index_map(b, h, i, table_ref, lengths_ref):
      seq = b * num_kv_heads + h
      live_pages = jax.lax.div(lengths_ref[seq] + page_size - 1, page_size)
      page = jnp.minimum(i * pages_per_block + j, jnp.maximum(live_pages - 1, 0))
      return table_ref[seq * pages_per_table + page], 0, 0

    return pl.BlockSpec((None, page_size, width), index_map)

  arrays = page_format.parts(pool).values()
  return [spec(j, x.shape[-1]) for j in range(pages_per_block) for x in arrays]


def pool_operands(pool, pages_per_block: int) -> list:
  """The operands `paged_kv_specs` describes: the pool's arrays, once per page of a block."""
  return list(page_format.parts(pool).values()) * pages_per_block


def last_live_block(b, h, i, lengths_ref, num_kv_heads, block_tokens):
  """Block index i clamped to the last block holding live slots (dead steps revisit it)."""
  length = lengths_ref[b * num_kv_heads + h]
  return jnp.minimum(i, jnp.maximum(jax.lax.div(length + block_tokens - 1, block_tokens) - 1, 0))


def head_spec(p: PagedDecode, cols: int):
  """BlockSpec of the [G, cols] block of one (row, kv head) in a [B, Hkv, G, cols] array."""
  return pl.BlockSpec((None, None, p.group, cols), lambda b, h, i, *_: (b, h, 0, 0))


def live_block_spec(p: PagedDecode, rows: int):
  """BlockSpec of one [rows, bk] block of a [B, Hkv, blocks, rows, bk] output; steps past
  the last live block revisit it, so dead blocks are never written nor copied back."""

  def index_map(b, h, i, table_ref, lengths_ref):
    return b, h, last_live_block(b, h, i, lengths_ref, p.kv_heads, p.block_tokens), 0, 0

  return pl.BlockSpec((None, None, None, rows, p.block_tokens), index_map)


def paged_pallas_call(
    kernel, p: PagedDecode, *, in_specs, out_specs, out_shape, scratch_shapes=(), interpret, name
):
  """`pl.pallas_call` of a paged decode kernel on the grid (B, Hkv, blocks).

  The kernel gets the layout as keywords (page_size, pages_per_block, num_kv_heads,
  kv_dtype) and its operands as (table_ref, lengths_ref, *head operands, *ppb K page refs,
  *ppb V page refs, *outputs, *scratch); a quantized pool gives each page its codes, scale
  and zero refs. Returns a function of (*head operands, k_pages, v_pages), whose `in_specs`
  are those of the head operands."""
  ppb = p.pages_per_block

  def run(*heads_and_pools):
    *heads, k_pages, v_pages = heads_and_pools
    kv_specs = paged_kv_specs(k_pages, p.kv_heads, p.num_blocks * ppb, ppb)
    call = pl.pallas_call(
        functools.partial(
            kernel,
            page_size=p.page_size,
            pages_per_block=ppb,
            num_kv_heads=p.kv_heads,
            kv_dtype=page_format.kv_dtype_of(k_pages),
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(p.batch, p.kv_heads, p.num_blocks),
            in_specs=[*in_specs, *kv_specs, *kv_specs],
            out_specs=out_specs,
            scratch_shapes=scratch_shapes,
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name=name,
    )
    pools = [*pool_operands(k_pages, ppb), *pool_operands(v_pages, ppb)]
    return call(p.table, p.lens, *heads, *pools)

  return run


def load_pages(refs, kv_dtype: str, index=..., dtype=jnp.float32):
  """In a kernel: the values [.., D] of page refs (one per array of the pool,
  `page_format.parts` order) at `index`, as `dtype` (dequantized)."""
  stored = page_format.from_parts([r[index] for r in refs], kv_dtype)
  return page_format.decode(stored, dtype)


def leaves_per_pool(kv_dtype: str) -> int:
  """Arrays in one pool: a float array, or codes, scale and zero."""
  return len(page_format.part_names(kv_dtype))


def dot(a, b, contract, precision=jax.lax.Precision.HIGHEST):
  """a . b contracting dims contract = (a's, b's), accumulated in float32."""
  return jax.lax.dot_general(
      a,
      b,
      ((contract[0], contract[1]), ((), ())),
      precision=precision,
      preferred_element_type=jnp.float32,
  )


def mask_dead_slots(s, v, first_slot, length):
  """In a paged decode kernel, for a block whose slots start at `first_slot`: the logits s
  [G, bk] with -inf at dead slots (>= `length`), the mask of live slots [G, bk] and V
  [bk, D] with dead rows zeroed. Masked with `where` (not added), so that NaN in unused
  slots never leaks."""
  live = first_slot + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1) < length
  row = first_slot + jax.lax.broadcasted_iota(jnp.int32, (v.shape[0], 1), 0)
  return jnp.where(live, s, -jnp.inf), live, jnp.where(row < length, v, 0.0)


def kernel_block(
    lengths_ref, q_ref, refs, *, scale, page_size, pages_per_block, num_kv_heads, kv_dtype
):
  """In a paged decode kernel: the grid step's block along the sequence.

  Returns (i, live, out_refs, load): the block index, whether the block holds live slots
  (< `length`), the refs after the K/V pages (outputs, scratch), and `load()`, to call
  under `pl.when(live)`, which gives the scaled logits s = q.k^T * scale [G, bk] f32 with
  -inf at dead slots, the mask of live slots [G, bk] and V [bk, D] f32 with dead rows
  zeroed (so that NaN in unused slots never leaks).
  """
  n = leaves_per_pool(kv_dtype)  # refs per page: [S, D], or codes, scale and zero
  k_refs = [refs[j * n : (j + 1) * n] for j in range(pages_per_block)]
  v_refs = [
      refs[(pages_per_block + j) * n : (pages_per_block + j + 1) * n]
      for j in range(pages_per_block)
  ]
  b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  block_tokens = page_size * pages_per_block
  length = lengths_ref[b * num_kv_heads + h]

  def load():
    q = q_ref[...].astype(jnp.float32) * scale  # [G, D]
    # Cast each page before concatenating: f32 pages of >= 8 rows stay sublane-tile aligned.
    # Quantized pages are dequantized page by page, in VMEM: HBM holds only the codes.
    k = jnp.concatenate([load_pages(r, kv_dtype) for r in k_refs], axis=0)  # [bk, D]
    v = jnp.concatenate([load_pages(r, kv_dtype) for r in v_refs], axis=0)  # [bk, D]
    return mask_dead_slots(dot(q, k, ((1,), (1,))), v, i * block_tokens, length)

  return i, i * block_tokens < length, refs[2 * pages_per_block * n :], load
