"""Group importance: per-slot scores reduced to one value per group of `group_size`
consecutive slots (mean, sum or max), +inf for groups holding a protected slot.

`group_importance_reference` is the specification (pure jnp; what kvjax's eviction
ranks groups by), `group_importance_pallas` the kernel and `group_importance(..., impl=...)`
the dispatcher.

Kernel design: leading axes are flattened to R rows. For group_size > 1 the scores are
viewed (a free row-major reshape) as [R, NG, gs] and the grid runs over (R, NG / ngb);
each step reads a (ngb, gs) block of scores and of the protection mask (int8), zeroes
protected slots with `where` (they may hold NaN), reduces the minor axis with keepdims and
writes a (ngb, 1) column of [R, NG, 1]. For group_size == 1 the op is elementwise
(where(protected, inf, score)) on lane-dense (1, tb) blocks of [R, 1, N]. NG or N is padded
to whole blocks with protected slots, which are sliced off again.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Bool, Float

from pallas_kernels._common import check_dtype_kind, check_float_dtypes, resolve_impl

__all__ = [
    "REDUCTIONS",
    "group_importance",
    "group_importance_pallas",
    "group_importance_reference",
    "validate_group_importance_args",
]

REDUCTIONS = ("mean", "sum", "max")  # how scores combine in a group (kvjax: group_reduce)
_GROUPS_PER_BLOCK = 512  # (512, gs) f32 block: 256 KiB of VMEM once lanes are padded
_TOKENS_PER_BLOCK = 2048  # group_size == 1: lane-dense (1, 2048) blocks


def validate_group_importance_args(token_scores, group_size, protected, reduce):
  """ValueError/TypeError for bad arguments (before any compute)."""
  if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
    raise ValueError(f"group_size must be a positive int, got {group_size!r}")
  if getattr(token_scores, "ndim", 0) < 1:
    raise ValueError(f"token_scores must be [..., T], got {getattr(token_scores, 'shape', None)}")
  t = token_scores.shape[-1]
  if t % group_size:
    raise ValueError(f"group_size={group_size} must divide the token axis T={t}")
  if getattr(protected, "shape", None) != token_scores.shape:
    raise ValueError(
        f"protected shape {getattr(protected, 'shape', None)} != token_scores shape "
        f"{token_scores.shape}"
    )
  if reduce not in REDUCTIONS:
    raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
  check_dtype_kind(jnp.floating, "floating point", token_scores=token_scores)
  if protected.dtype != jnp.bool_:
    raise TypeError(f"protected must be bool, got {protected.dtype}")


def group_importance_reference(
    token_scores: Float[Array, "... T"],
    group_size: int,
    protected: Bool[Array, "... T"],
    reduce: str = "mean",
) -> Float[Array, "... G"]:
  """One float32 importance per group; +inf for groups with a protected slot. Protected
  slots (which may hold NaN, e.g. unused ones) never enter the reduction."""
  validate_group_importance_args(token_scores, group_size, protected, reduce)
  t = token_scores.shape[-1]
  shape = (*token_scores.shape[:-1], t // group_size, group_size)
  grouped = jnp.where(protected.reshape(shape), 0.0, token_scores.reshape(shape))
  value = {"mean": jnp.mean, "sum": jnp.sum, "max": jnp.max}[reduce](grouped, axis=-1)
  return jnp.where(protected.reshape(shape).any(-1), jnp.inf, value.astype(jnp.float32))


def _group_kernel(x_ref, p_ref, o_ref, *, reduce, group_size):
  x = x_ref[...].astype(jnp.float32)  # [ngb, gs]
  p = p_ref[...] != 0
  x = jnp.where(p, 0.0, x)
  if reduce == "max":
    value = x.max(axis=-1, keepdims=True)
  else:
    value = x.sum(axis=-1, keepdims=True)
    if reduce == "mean":
      value = value * (1.0 / group_size)
  any_protected = p.astype(jnp.int32).max(axis=-1, keepdims=True) > 0
  o_ref[...] = jnp.where(any_protected, jnp.inf, value)


def _token_kernel(x_ref, p_ref, o_ref):
  o_ref[...] = jnp.where(p_ref[...] != 0, jnp.inf, x_ref[...].astype(jnp.float32))


def _pad_axis(x, axis, size, value):
  pad = size - x.shape[axis]
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def group_importance_pallas(
    token_scores: Float[Array, "... T"],
    group_size: int,
    protected: Bool[Array, "... T"],
    reduce: str = "mean",
    *,
    interpret=False,
) -> Float[Array, "... G"]:
  """The Pallas kernel; arguments are not validated here (see `group_importance`)."""
  lead, t = token_scores.shape[:-1], token_scores.shape[-1]
  rows = math.prod(lead)
  x = token_scores.reshape(rows, t)
  p = protected.reshape(rows, t).astype(jnp.int8)
  params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))
  if group_size == 1:
    tb = t if t <= _TOKENS_PER_BLOCK else _TOKENS_PER_BLOCK
    tp = -(-t // tb) * tb
    x = _pad_axis(x, 1, tp, 0).reshape(rows, 1, tp)
    p = _pad_axis(p, 1, tp, 1).reshape(rows, 1, tp)
    spec = pl.BlockSpec((None, 1, tb), lambda r, j: (r, 0, j))
    out = pl.pallas_call(
        _token_kernel,
        grid=(rows, tp // tb),
        in_specs=[spec, spec],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct((rows, 1, tp), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name="kvjax_group_importance_tokens",
    )(x, p)
    return out[:, 0, :t].reshape(*lead, t)
  ng = t // group_size
  ngb = ng if ng <= _GROUPS_PER_BLOCK else _GROUPS_PER_BLOCK
  ngp = -(-ng // ngb) * ngb
  x = _pad_axis(x.reshape(rows, ng, group_size), 1, ngp, 0)
  p = _pad_axis(p.reshape(rows, ng, group_size), 1, ngp, 1)
  in_spec = pl.BlockSpec((None, ngb, group_size), lambda r, j: (r, j, 0))
  out = pl.pallas_call(
      functools.partial(_group_kernel, reduce=reduce, group_size=group_size),
      grid=(rows, ngp // ngb),
      in_specs=[in_spec, in_spec],
      out_specs=pl.BlockSpec((None, ngb, 1), lambda r, j: (r, j, 0)),
      out_shape=jax.ShapeDtypeStruct((rows, ngp, 1), jnp.float32),
      compiler_params=params,
      interpret=interpret,
      name="kvjax_group_importance",
  )(x, p)
  return out[:, :ng, 0].reshape(*lead, ng)


def group_importance(
    token_scores: Float[Array, "... T"],
    group_size: int,
    protected: Bool[Array, "... T"],
    reduce: str = "mean",
    *,
    impl: str = "auto",
    interpret=None,
) -> Float[Array, "... G"]:
  """Group importance, [..., T / group_size] float32; Pallas on TPU (impl="auto"), the
  reference elsewhere. Validates arguments (ValueError/TypeError) before launching; the
  kernel takes float32/bfloat16 scores."""
  use_pallas, interpret = resolve_impl(impl, interpret)
  validate_group_importance_args(token_scores, group_size, protected, reduce)
  if not use_pallas:
    return group_importance_reference(token_scores, group_size, protected, reduce)
  check_float_dtypes(token_scores=token_scores)
  return group_importance_pallas(token_scores, group_size, protected, reduce, interpret=interpret)
