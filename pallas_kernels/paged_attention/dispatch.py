"""Which path a paged attention call takes: `paged_attention(..., impl=...)`, the dispatcher
(the TPU or GPU kernel for decode where it runs, the live-blocks loop or the reference
elsewhere), and `paged_attention_live_prefix`, the reference path's decode, which picks per
call the narrowest prefix of the page table to run the reference on.

The kernel wrappers are looked up in this module's namespace when a call is dispatched, so
a test that replaces `paged_attention_pallas` or `paged_attention_pallas_gpu` here sees the
dispatcher call (or not call) its replacement; such tests reach the GPU kernel's block sizing
(`gpu_pages_per_block`) through this module too, which is why it is imported here unused.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from pallas_kernels._common import check_float_dtypes, check_page_table_range, resolve_impl
from pallas_kernels._common import validate_paged_args as validate_paged_attention_args
from pallas_kernels.paged_attention.blocks import paged_attention_live_blocks
from pallas_kernels.paged_attention.gpu import (  # noqa: F401 (gpu_pages_per_block: unused)
    check_gpu_pool_size,
    check_gpu_shapes,
    gpu_pages_per_block,
    paged_attention_pallas_gpu,
)
from pallas_kernels.paged_attention.reference import (
    paged_attention_lse_reference,
    paged_attention_reference,
)
from pallas_kernels.paged_attention.tpu import paged_attention_pallas

__all__ = [
    "PREFIX_MIN_TOKENS",
    "paged_attention",
    "paged_attention_live_prefix",
    "prefix_heads_per_step",
    "prefix_widths",
]


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
