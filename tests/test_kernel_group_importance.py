"""Pallas group-importance kernel against its reference, and the reference against a
float64 numpy oracle (interpret mode off TPU). The reference is kvjax's only group
importance (eviction calls `pallas_kernels.group_importance`)."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import (  # noqa: F401 (release_compiled_code: autouse fixture)
    DTYPES,
    LENGTH_KINDS,
    PAGE_SIZES,
    jitted,
    kernel_interpret,
    must_not_launch,
    release_compiled_code,
)

import pallas_kernels.group_importance as gi
from pallas_kernels.group_importance import group_importance, group_importance_reference

GROUP_SIZES = (1, *PAGE_SIZES)  # token eviction, and block eviction at each page size
REDUCTIONS = gi.REDUCTIONS  # the one list kvjax validates group_reduce against


def scores_problem(seed, group_size, length_kind, dtype="float32", layers=2, heads=2):
  """Logical-view scores [L, B, H, N] as eviction sees them: slots past each length hold
  NaN and are protected (with the sink, the recent window and a few caller marks)."""
  rng = np.random.default_rng(seed)
  unit = max(group_size, 8)
  lengths, n = {
      "one": ([1], 2 * unit),
      "boundary": ([unit, unit + 1, 2 * unit - 1], 3 * unit),
      "full": ([3 * unit, 3 * unit], 3 * unit),
      "ragged": ([1, 3 * unit, 2 * unit + 3, 0], 4 * unit),
  }[length_kind]
  shape = (layers, len(lengths), heads, n)
  x = rng.normal(size=shape).astype(np.float32)
  idx = np.arange(n)
  length = np.asarray(lengths)[None, :, None, None]
  protected = (idx >= length) | (idx < 1) | (idx >= length - 2) | (rng.random(shape) < 0.02)
  x[idx >= np.broadcast_to(length, shape)] = np.nan
  return jnp.asarray(x, jnp.dtype(dtype)), jnp.asarray(protected)


def _cases():
  return list(itertools.product(GROUP_SIZES, REDUCTIONS, LENGTH_KINDS, DTYPES))


def _default_cases():
  cases = []
  # Every group size, reduction, length kind and dtype, each at least once (the whole
  # product runs under -m slow).
  for i, (g, red) in enumerate(itertools.product(GROUP_SIZES, REDUCTIONS)):
    if i % 2 == 0:
      cases.append((g, red, LENGTH_KINDS[(i // 2) % 4], DTYPES[(i // 4) % 2]))
  return cases


CASES = [pytest.param(*c) for c in _default_cases()] + [
    pytest.param(*c, marks=pytest.mark.slow) for c in _cases() if c not in _default_cases()
]


@pytest.mark.parametrize("group_size, reduce, length_kind, dtype", CASES)
def test_kernel_matches_reference(group_size, reduce, length_kind, dtype):
  x, protected = scores_problem(group_size * 7 + len(reduce), group_size, length_kind, dtype)
  got = jitted(
      group_importance,
      group_size=group_size,
      reduce=reduce,
      impl="pallas",
      interpret=kernel_interpret(),
  )(x, protected=protected)
  want = jitted(group_importance_reference, group_size=group_size, reduce=reduce)(
      x, protected=protected
  )
  assert got.shape == want.shape == (*x.shape[:-1], x.shape[-1] // group_size)
  assert got.dtype == jnp.float32
  got, want = np.asarray(got), np.asarray(want)
  np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
  assert np.isfinite(got[~np.isinf(want)]).all()
  tol = dict(atol=1e-5, rtol=1e-5) if dtype == "float32" else dict(atol=2e-2, rtol=2e-2)
  np.testing.assert_allclose(got, want, **tol)


def _numpy_group_importance(token_scores, group_size, protected, reduce):
  """float64 oracle: +inf for a group holding a protected slot, else the mean, sum or max
  of its scores (protected slots, which may hold NaN, never enter the reduction)."""
  shape = (*token_scores.shape[:-1], token_scores.shape[-1] // group_size, group_size)
  x = np.asarray(token_scores, np.float64).reshape(shape)
  p = np.asarray(protected).reshape(shape)
  value = {"mean": np.mean, "sum": np.sum, "max": np.max}[reduce](np.where(p, 0.0, x), axis=-1)
  return np.where(p.any(-1), np.inf, value)


@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_reference_matches_a_numpy_oracle(group_size):
  x, protected = scores_problem(group_size, group_size, "ragged")
  for reduce in REDUCTIONS:
    got = group_importance_reference(x, group_size, protected, reduce)
    assert got.dtype == jnp.float32
    want = _numpy_group_importance(x, group_size, protected, reduce)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)  # +inf entries compare equal


def test_hand_computed_tiny_case():
  x = jnp.array([[1.0, 2.0, 3.0, 4.0, 5.0, np.nan]], jnp.float32)
  protected = jnp.array([[False, False, False, False, False, True]])
  want = {"mean": [1.5, 3.5, np.inf], "sum": [3.0, 7.0, np.inf], "max": [2.0, 4.0, np.inf]}
  for reduce, expected in want.items():
    for impl in ("ref", "pallas"):
      got = group_importance(x, 2, protected, reduce, impl=impl, interpret=kernel_interpret())
      np.testing.assert_array_equal(got[0], expected)
  got = group_importance(x, 1, protected, "max", impl="pallas", interpret=kernel_interpret())
  np.testing.assert_array_equal(got[0], [1, 2, 3, 4, 5, np.inf])


def test_generic_interpreter_and_multiple_blocks():
  # More groups (and tokens) than one block holds: exercises padding to whole blocks.
  rng = np.random.default_rng(0)
  for group_size, n in ((4, 4 * 600), (1, 2048 + 100)):
    x = jnp.asarray(rng.normal(size=(3, n)), jnp.float32)
    protected = jnp.asarray(rng.random((3, n)) < 0.01)
    got = jitted(group_importance, group_size=group_size, impl="pallas", interpret=True)(
        x, protected=protected
    )
    want = group_importance_reference(x, group_size, protected)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(group_size=3), ValueError, "must divide the token axis"),
        (dict(group_size=0), ValueError, "positive int"),
        (dict(protected=np.zeros((2, 4), bool)), ValueError, "protected shape"),
        (dict(reduce="median"), ValueError, "reduce must be one of"),
        (dict(token_scores=np.zeros((2, 8), np.int32)), TypeError, "floating point"),
        (dict(token_scores=np.zeros((2, 8), np.float16)), TypeError, "float32 or bfloat16"),
        (dict(protected=np.zeros((2, 8), np.int32)), TypeError, "protected must be bool"),
    ],
)
def test_rejects_bad_arguments_before_launch(monkeypatch, change, error, match):
  monkeypatch.setattr(gi, "group_importance_pallas", must_not_launch)
  args = dict(
      token_scores=np.zeros((2, 8), np.float32),
      group_size=4,
      protected=np.zeros((2, 8), bool),
      reduce="mean",
  )
  args.update(change)
  args = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in args.items()}
  with pytest.raises(error, match=match):
    group_importance(**args, impl="pallas", interpret=True)


@pytest.mark.parametrize("group_size", [1, 16])
def test_kernel_lowers_for_tpu(group_size):
  x, protected = scores_problem(0, group_size, "ragged", "bfloat16")
  fn = jax.jit(
      functools.partial(
          gi.group_importance_pallas, group_size=group_size, reduce="max", interpret=False
      )
  )
  exported = jax.export.export(fn, platforms=["tpu"])(x, protected=protected)
  assert "tpu_custom_call" in exported.mlir_module()
