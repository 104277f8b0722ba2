"""Output-impact scores over the page pool: r_i = sum_h a_hi / (1 - a_hi) * ||v_i - O_h||.

For one decode query per sequence, r [B, Hkv, N] sums over the G = Hq / Hkv query heads h
of a kv head the exact change of head h's output when slot i is removed and the rest
renormalised (see `kvjax.scores.output_impact`). The attention weights are recomputed from
q, K and the per-query-head log-sum-exp of the attention pass,
a_hi = exp(q_h . k_i * scale - lse_h), rather than taken as a [B, Hq, N] probability
input: the kernel then reads only K/V pages through the page table (the bytes attention
already reads) plus O and lse, and never materialises per-query-head probabilities.
`lse` is what `paged_attention(..., return_lse=True)` returns; +inf marks a row that sees
no slot (then a = 0 and r = 0).

`output_impact_reference` is the specification (pure jnp), `output_impact_pallas` the
kernel and `output_impact(..., impl=...)` the dispatcher.

Kernel design: grid (B, Hkv, M / pages_per_block) with the page table and lengths
scalar-prefetched; K and V pages are DMA'd through index maps that read the table (the
same `paged_kv_specs` as the attention kernel, so dead pages cost no DMA); one pass. Per
block of bk slots: s = q k^T * scale [G, bk] on the MXU, a = exp(s - lse) masked by length,
V rows past the length zeroed; for each of the G query heads the squared distance
||v_i - O_h||^2 is a lane-dense [1, bk] row obtained as ones[1, D] . ((v - O_h)^2)^T (the
direct difference, not ||v||^2 - 2 v.O + ||O||^2, which cancels catastrophically when
v_i ~ O_h, e.g. a single live token with a = 1 and a 1/eps factor). The block result
[1, bk] goes to r [B, Hkv, M/ppb, 1, bk]; dead blocks are never written and the epilogue
masks slots past the length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from pallas_kernels.paged_attention import (
    _dot,
    check_float_dtypes,
    check_page_table_range,
    default_pages_per_block,
    last_live_block,
    paged_kv_specs,
    prepare_paged_operands,
    resolve_impl,
    validate_paged_attention_args,
)

DEFAULT_EPS = 1e-6  # same clamp of 1 - a as kvjax.scores.output_impact


def validate_output_impact_args(q, k_pages, v_pages, page_table, lengths, out, lse):
  """ValueError/TypeError for inconsistent shapes or dtypes (before any compute)."""
  validate_paged_attention_args(q, k_pages, v_pages, page_table, lengths, None)
  b, t, hq, _ = q.shape
  if t != 1:
    raise ValueError(f"output_impact scores one decode query per sequence (T == 1), got T={t}")
  if getattr(out, "shape", None) != q.shape:
    raise ValueError(f"out must have q's shape {q.shape}, got {getattr(out, 'shape', None)}")
  if getattr(lse, "shape", None) != (b, 1, hq):
    raise ValueError(f"lse must be [B, 1, Hq] = {(b, 1, hq)}, got {getattr(lse, 'shape', None)}")
  for name, x in (("out", out), ("lse", lse)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must be floating point, got {x.dtype}")


def output_impact_reference(
    q: Float[Array, "B 1 Hq D"],
    k_pages: Float[Array, "P S D"],
    v_pages: Float[Array, "P S D"],
    page_table: Int[Array, "B Hkv M"],
    lengths: Int[Array, "B Hkv"],
    out: Float[Array, "B 1 Hq D"],
    lse: Float[Array, "B 1 Hq"],
    *,
    scale: float | None = None,
    eps: float = DEFAULT_EPS,
) -> Float[Array, "B Hkv N"]:
  """r [B, Hkv, N] float32: sum over the kv head's query heads of a/(1-a) * ||v - O||,
  a = exp(q.k * scale - lse); zero for slots at or past `lengths`."""
  validate_output_impact_args(q, k_pages, v_pages, page_table, lengths, out, lse)
  b, _, hq, d = q.shape
  _, hkv, m = page_table.shape
  n = m * k_pages.shape[1]
  g = hq // hkv
  scale = d**-0.5 if scale is None else scale
  live = jnp.arange(n) < lengths[..., None]  # [B, Hkv, N]
  k = k_pages[page_table].reshape(b, hkv, n, d).astype(jnp.float32)
  v = v_pages[page_table].reshape(b, hkv, n, d).astype(jnp.float32)
  v = jnp.where(live[..., None], v, 0.0)  # unused slots may hold NaN
  q = q.reshape(b, hkv, g, d).astype(jnp.float32) * scale
  o = out.reshape(b, hkv, g, d).astype(jnp.float32)
  logits = jnp.einsum("bkgd,bknd->bkgn", q, k)
  lse = lse.reshape(b, hkv, g, 1).astype(jnp.float32)
  a = jnp.where(live[:, :, None], jnp.exp(jnp.where(live[:, :, None], logits, -jnp.inf) - lse), 0)
  distance = jnp.sqrt(jnp.sum(jnp.square(v[:, :, None] - o[..., None, :]), axis=-1))
  r = (a / jnp.maximum(1.0 - a, eps) * distance).sum(axis=2)
  return jnp.where(live, r, 0.0)


def _output_impact_kernel(
    table_ref,
    lengths_ref,
    q_ref,
    o_ref,
    lse_ref,
    *refs,
    scale,
    eps,
    page_size,
    pages_per_block,
    num_kv_heads,
):
  k_refs = refs[:pages_per_block]
  v_refs = refs[pages_per_block : 2 * pages_per_block]
  (r_ref,) = refs[2 * pages_per_block :]
  b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  block_tokens = page_size * pages_per_block
  length = lengths_ref[b * num_kv_heads + h]

  @pl.when(i * block_tokens < length)
  def _block():
    q = q_ref[...].astype(jnp.float32) * scale  # [G, D]
    k = jnp.concatenate([r[...].astype(jnp.float32) for r in k_refs], axis=0)  # [bk, D]
    v = jnp.concatenate([r[...].astype(jnp.float32) for r in v_refs], axis=0)
    s = _dot(q, k, ((1,), (1,)))  # [G, bk]
    slot = i * block_tokens + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    live = slot < length
    a = jnp.where(live, jnp.exp(jnp.where(live, s, -jnp.inf) - lse_ref[...]), 0.0)
    weight = a / jnp.maximum(1.0 - a, eps)  # [G, bk]
    live_row = (i * block_tokens + jax.lax.broadcasted_iota(jnp.int32, (block_tokens, 1), 0)) < (
        length
    )
    v = jnp.where(live_row, v, 0.0)
    o = o_ref[...].astype(jnp.float32)  # [G, D]
    ones = jnp.ones((1, v.shape[1]), jnp.float32)
    r = jnp.zeros((1, block_tokens), jnp.float32)
    for gi in range(o.shape[0]):  # G <= a handful: unrolled
      diff = v - o[gi : gi + 1, :]  # [bk, D]
      dist = jnp.sqrt(_dot(ones, diff * diff, ((1,), (1,))))  # [1, bk], lane-dense
      r = r + weight[gi : gi + 1, :] * dist
    r_ref[...] = r


def output_impact_pallas(
    q: Float[Array, "B 1 Hq D"],
    k_pages: Float[Array, "P S D"],
    v_pages: Float[Array, "P S D"],
    page_table: Int[Array, "B Hkv M"],
    lengths: Int[Array, "B Hkv"],
    out: Float[Array, "B 1 Hq D"],
    lse: Float[Array, "B 1 Hq"],
    *,
    scale: float | None = None,
    eps: float = DEFAULT_EPS,
    pages_per_block: int | None = None,
    interpret=False,
) -> Float[Array, "B Hkv N"]:
  """The Pallas kernel (one pass over K/V pages); arguments are not validated here."""
  b, _, hq, d = q.shape
  num_pages, page_size, _ = k_pages.shape
  _, hkv, m = page_table.shape
  g = hq // hkv
  n = m * page_size
  scale = d**-0.5 if scale is None else float(scale)
  ppb = default_pages_per_block(page_size, m) if pages_per_block is None else pages_per_block
  bk = ppb * page_size
  visible = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, n)
  table, lens, num_blocks = prepare_paged_operands(page_table, visible, num_pages, ppb)

  head_spec = pl.BlockSpec((None, None, g, d), lambda b_, h_, i_, *_: (b_, h_, 0, 0))
  lse_spec = pl.BlockSpec((None, None, g, 1), lambda b_, h_, i_, *_: (b_, h_, 0, 0))
  kv_specs = paged_kv_specs(page_size, d, hkv, num_blocks * ppb, ppb)

  def r_map(b_, h_, i_, table_ref, lengths_ref):
    return b_, h_, last_live_block(b_, h_, i_, lengths_ref, hkv, bk), 0, 0

  kernel = functools.partial(
      _output_impact_kernel,
      scale=scale,
      eps=float(eps),
      page_size=page_size,
      pages_per_block=ppb,
      num_kv_heads=hkv,
  )
  r = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(b, hkv, num_blocks),
          in_specs=[head_spec, head_spec, lse_spec, *kv_specs, *kv_specs],
          out_specs=pl.BlockSpec((None, None, None, 1, bk), r_map),
      ),
      out_shape=jax.ShapeDtypeStruct((b, hkv, num_blocks, 1, bk), jnp.float32),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")
      ),
      interpret=interpret,
      name="kvjax_output_impact",
  )(
      table,
      lens,
      q.reshape(b, hkv, g, d),
      out.reshape(b, hkv, g, d),
      lse.reshape(b, hkv, g, 1).astype(jnp.float32),
      *([k_pages] * ppb),
      *([v_pages] * ppb),
  )
  r = r.reshape(b, hkv, num_blocks * bk)[..., :n]
  return jnp.where(jnp.arange(n) < visible[..., None], r, 0.0)


def output_impact(
    q: Float[Array, "B 1 Hq D"],
    k_pages: Float[Array, "P S D"],
    v_pages: Float[Array, "P S D"],
    page_table: Int[Array, "B Hkv M"],
    lengths: Int[Array, "B Hkv"],
    out: Float[Array, "B 1 Hq D"],
    lse: Float[Array, "B 1 Hq"],
    *,
    scale: float | None = None,
    eps: float = DEFAULT_EPS,
    impl: str = "auto",
    interpret=None,
    pages_per_block: int | None = None,
) -> Float[Array, "B Hkv N"]:
  """Output impact per slot, [B, Hkv, N] float32; Pallas on TPU (impl="auto"), reference
  elsewhere. Validates shapes (ValueError), dtypes (TypeError; the kernel takes
  float32/bfloat16) and, when concrete, page-table entries in [0, P) before launching."""
  use_pallas, interpret = resolve_impl(impl, interpret)
  validate_output_impact_args(q, k_pages, v_pages, page_table, lengths, out, lse)
  check_page_table_range(page_table, k_pages.shape[0])
  if not use_pallas:
    return output_impact_reference(
        q, k_pages, v_pages, page_table, lengths, out, lse, scale=scale, eps=eps
    )
  check_float_dtypes(q=q, k_pages=k_pages, v_pages=v_pages, out=out)
  return output_impact_pallas(
      q,
      k_pages,
      v_pages,
      page_table,
      lengths,
      out,
      lse,
      scale=scale,
      eps=eps,
      pages_per_block=pages_per_block,
      interpret=interpret,
  )
