"""Output-impact scores over the page pool: r_i = sum_h a_hi / (1 - a_hi) * ||v_i - O_h||,
or with `squared=True` (DropKV) r_i = sum_h (a_hi / (1 - a_hi))^2 * ||v_i - O_h||^2: the
squared change of each head's output, which adds up across query heads and queries as
energy and so compares across heads and layers.

For one decode query per sequence, r [B, Hkv, N] sums over the G = Hq / Hkv query heads h
of a kv head the exact change of head h's output when slot i is removed and the rest
renormalised (see `kvjax.policies.scores.output_impact`). The attention weights are recomputed from
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
from jaxtyping import Array, Float, Int

from pallas_kernels._common import (
    check_dtype_kind,
    check_float_dtypes,
    check_page_table_range,
    decode_prologue,
    dot,
    gather_pages,
    head_spec,
    kernel_block,
    live_block_spec,
    live_slots,
    paged_pallas_call,
    resolve_impl,
    unblock,
    validate_paged_args,
)

__all__ = [
    "DEFAULT_EPS",
    "output_impact",
    "output_impact_pallas",
    "output_impact_reference",
    "validate_output_impact_args",
]

DEFAULT_EPS = 1e-6  # same clamp of 1 - a as kvjax.policies.scores.output_impact


def validate_output_impact_args(q, k_pages, v_pages, page_table, lengths, out, lse):
  """ValueError/TypeError for inconsistent shapes or dtypes (before any compute)."""
  validate_paged_args(q, k_pages, v_pages, page_table, lengths)
  b, t, hq, _ = q.shape
  if t != 1:
    raise ValueError(f"output_impact scores one decode query per sequence (T == 1), got T={t}")
  if getattr(out, "shape", None) != q.shape:
    raise ValueError(f"out must have q's shape {q.shape}, got {getattr(out, 'shape', None)}")
  if getattr(lse, "shape", None) != (b, 1, hq):
    raise ValueError(f"lse must be [B, 1, Hq] = {(b, 1, hq)}, got {getattr(lse, 'shape', None)}")
  check_dtype_kind(jnp.floating, "floating point", out=out, lse=lse)


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
    squared: bool = False,
) -> Float[Array, "B Hkv N"]:
  """r [B, Hkv, N] float32: sum over the kv head's query heads of a/(1-a) * ||v - O|| (its
  square when `squared`), a = exp(q.k * scale - lse); zero for slots at or past `lengths`."""
  validate_output_impact_args(q, k_pages, v_pages, page_table, lengths, out, lse)
  b, _, hq, d = q.shape
  hkv = page_table.shape[1]
  g = hq // hkv
  scale = d**-0.5 if scale is None else scale
  k = gather_pages(k_pages, page_table)  # [B, Hkv, N, D]
  v = gather_pages(v_pages, page_table, lengths)  # unused slots (may hold NaN) zeroed
  live = live_slots(lengths, k.shape[2])  # [B, Hkv, N]
  q = q.reshape(b, hkv, g, d).astype(jnp.float32) * scale
  o = out.reshape(b, hkv, g, d).astype(jnp.float32)
  logits = jnp.einsum("bkgd,bknd->bkgn", q, k)  # [B, Hkv, G, N]
  lse = lse.reshape(b, hkv, g, 1).astype(jnp.float32)
  a = jnp.where(live[:, :, None], jnp.exp(jnp.where(live[:, :, None], logits, -jnp.inf) - lse), 0)
  distance = jnp.sqrt(jnp.sum(jnp.square(v[:, :, None] - o[..., None, :]), axis=-1))
  impact = a / jnp.maximum(1.0 - a, eps) * distance  # [B, Hkv, G, N]
  r = (jnp.square(impact) if squared else impact).sum(axis=2)
  return jnp.where(live, r, 0.0)


def _output_impact_kernel(
    table_ref,  # [B * Hkv * blocks * ppb] int32, scalar-prefetched (read by the index maps)
    lengths_ref,  # [B * Hkv] int32, visible slots
    q_ref,  # [G, D]
    o_ref,  # [G, D], attention output
    lse_ref,  # [G, 1] f32
    *refs,  # K pages ppb x [S, D], V pages ppb x [S, D]; r [1, bk] f32
    scale,
    eps,
    squared,
    **layout,  # page_size, pages_per_block, num_kv_heads, kv_dtype
):
  i, live, (r_ref,), load = kernel_block(lengths_ref, q_ref, refs, scale=scale, **layout)

  @pl.when(live)
  def _block():
    s, live_slot, v = load()  # [G, bk] (-inf at dead slots), [G, bk], [bk, D] (dead rows 0)
    a = jnp.where(live_slot, jnp.exp(s - lse_ref[...]), 0.0)
    weight = a / jnp.maximum(1.0 - a, eps)  # [G, bk]
    o = o_ref[...].astype(jnp.float32)  # [G, D]
    ones = jnp.ones((1, v.shape[1]), jnp.float32)
    r = jnp.zeros((1, v.shape[0]), jnp.float32)  # [1, bk]
    for gi in range(o.shape[0]):  # G <= a handful: unrolled
      diff = v - o[gi : gi + 1, :]  # [bk, D]
      dist2 = dot(ones, diff * diff, ((1,), (1,)))  # [1, bk], lane-dense
      w = weight[gi : gi + 1, :]
      r = r + (w * w * dist2 if squared else w * jnp.sqrt(dist2))
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
    squared: bool = False,
    pages_per_block: int | None = None,
    interpret=False,
) -> Float[Array, "B Hkv N"]:
  """The Pallas kernel (one pass over K/V pages); arguments are not validated here."""
  p = decode_prologue(
      "output_impact_pallas", q, k_pages, page_table, lengths, None, scale, pages_per_block
  )
  b, hkv, g, d = p.batch, p.kv_heads, p.group, p.head_dim
  r = paged_pallas_call(
      functools.partial(
          _output_impact_kernel, scale=p.scale, eps=float(eps), squared=bool(squared)
      ),
      p,
      in_specs=[head_spec(p, d), head_spec(p, d), head_spec(p, 1)],
      out_specs=live_block_spec(p, 1),
      out_shape=jax.ShapeDtypeStruct((b, hkv, p.num_blocks, 1, p.block_tokens), jnp.float32),
      interpret=interpret,
      name="kvjax_output_impact",
  )(
      q.reshape(b, hkv, g, d),
      out.reshape(b, hkv, g, d),
      lse.reshape(b, hkv, g, 1).astype(jnp.float32),
      k_pages,
      v_pages,
  )
  return unblock(p, r)[:, :, 0]  # [B, Hkv, N]


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
    squared: bool = False,
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
        q, k_pages, v_pages, page_table, lengths, out, lse, scale=scale, eps=eps, squared=squared
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
      squared=squared,
      pages_per_block=pages_per_block,
      interpret=interpret,
  )
