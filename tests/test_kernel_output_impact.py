"""Pallas output-impact kernel against its reference, and the reference against
kvjax.policies.scores.output_impact (interpret mode off TPU)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_helpers as kh
from kernel_helpers import release_compiled_code  # noqa: F401 (autouse fixture)

import pallas_kernels.output_impact as oi
from kvjax.policies import scores
from pallas_kernels.output_impact import output_impact, output_impact_reference
from pallas_kernels.paged_attention import paged_attention


def _with_attention(args):
  """(q, k, v, table, lengths, out, lse) with out/lse from the reference attention."""
  out, _, lse = kh.jitted(paged_attention, impl="ref", return_lse=True)(*args)
  return (*args, out, lse)


@pytest.mark.parametrize(kh.CASE_NAMES, kh.CASES)
# squared (DropKV) over the whole product is slow; the worked example checks it by default.
@pytest.mark.parametrize("squared", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_kernel_matches_reference(
    page_size, group, head_dim, length_kind, dtype, pages_per_block, squared
):
  args = _with_attention(kh.case_problem(page_size, group, head_dim, length_kind, dtype, "oi"))
  got = kh.jitted(
      output_impact,
      impl="pallas",
      interpret=kh.kernel_interpret(),
      pages_per_block=pages_per_block,
      squared=squared,
  )(*args)
  want = kh.jitted(output_impact_reference, squared=squared)(*args)
  live = kh.live_slots(args)  # [B, Hkv, N]
  assert got.shape == want.shape == live.shape
  assert got.dtype == jnp.float32 and np.isfinite(got).all()
  # r carries a/(1-a) (up to 1/eps for a lone token): compare relative to the scale of r.
  tol = kh.TOL[dtype]
  scale = max(1.0, float(np.abs(want).max()))
  np.testing.assert_allclose(got / scale, want / scale, **tol)
  assert (np.asarray(got)[~live] == 0).all()


def _reference_and_scores(q, kp, vp, table, lens):
  """output_impact_reference, and the same numbers through kvjax.policies.scores.output_impact
  (softmax probabilities per query head, logical V, output O)."""
  out, head_probs, lse = paged_attention(
      q, kp, vp, table, lens, impl="ref", per_query_head=True, return_lse=True
  )
  r = output_impact_reference(q, kp, vp, table, lens, out, lse)
  (b, hkv, m), d = table.shape, q.shape[-1]
  n, group = m * kp.shape[1], q.shape[2] // hkv
  live = (jnp.arange(n) < lens[..., None])[..., None]
  values = jnp.where(live, vp[table].reshape(b, hkv, n, d), 0.0)
  values = jnp.repeat(values, group, axis=1)[:, :, None]  # [B, Hq, 1, N, D]
  want = scores.output_impact(head_probs, values, out.transpose(0, 2, 1, 3))  # [B, Hq, 1, N]
  return r, want.reshape(b, hkv, group, n).sum(axis=2)


@pytest.mark.parametrize("page_size, group, length_kind", [(8, 3, "ragged"), (16, 8, "boundary")])
def test_reference_agrees_with_kvjax_scores(page_size, group, length_kind):
  lengths, m = kh.lengths_for(length_kind, page_size)
  args = kh.paged_problem(1, page_size, 2, group, lengths, m, 64)
  r, want = jax.jit(_reference_and_scores)(*args)
  assert np.abs(r).max() > 0
  np.testing.assert_allclose(r, want, atol=1e-5, rtol=1e-5)


def test_hand_computed_worked_example():
  # ARCHITECTURE.md: a = (0.05, 0.20, 0.75), v = (100, 10, 10) -> O = 14.5,
  # r = (4.5, 1.125, 13.5). d = 1, scale 1, q = 1, k_i = log a_i, so lse = log(sum a) = 0.
  a = np.array([0.05, 0.20, 0.75])
  k_pages = np.full((4, 2, 1), np.nan, np.float32)  # page 0 = null, all else poisoned
  v_pages = np.full((4, 2, 1), np.nan, np.float32)
  k_pages[3, :, 0], v_pages[3, :, 0] = np.log(a[:2]), [100.0, 10.0]
  k_pages[1, 0, 0], v_pages[1, 0, 0] = np.log(a[2]), 10.0
  args = (
      jnp.ones((1, 1, 1, 1), jnp.float32),
      jnp.asarray(k_pages),
      jnp.asarray(v_pages),
      jnp.array([[[3, 1, 0]]], jnp.int32),  # logical order: page 3, page 1, (null)
      jnp.array([[3]], jnp.int32),
      jnp.full((1, 1, 1, 1), 14.5, jnp.float32),
      jnp.zeros((1, 1, 1), jnp.float32),
  )
  want = np.array([4.5, 1.125, 13.5, 0.0, 0.0, 0.0])
  for squared, expected in ((False, want), (True, want**2)):  # DropKV: 20.25, 1.265625, 182.25
    np.testing.assert_allclose(
        output_impact_reference(*args, scale=1.0, squared=squared)[0, 0], expected, rtol=1e-5
    )
    got = output_impact(
        *args,
        scale=1.0,
        squared=squared,
        impl="pallas",
        interpret=kh.kernel_interpret(),
        pages_per_block=1,
    )
    np.testing.assert_allclose(got[0, 0], expected, rtol=1e-5)


def test_generic_interpreter_and_padding_rows():
  # A row whose lse is +inf (a padding query) scores 0 everywhere.
  args = list(_with_attention(kh.paged_problem(8, 8, 2, 3, [13, 20], 3, 64)))
  args[6] = args[6].at[1].set(jnp.inf)
  got = kh.jitted(output_impact, impl="pallas", interpret=True)(*args)
  want = kh.jitted(output_impact_reference)(*args)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  assert (np.asarray(got)[1] == 0).all() and (np.asarray(got)[0] > 0).any()


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(out=np.zeros((1, 1, 4, 7), np.float32)), ValueError, "out must have q's shape"),
        (dict(lse=np.zeros((1, 4), np.float32)), ValueError, r"lse must be \[B, 1, Hq\]"),
        (
            dict(q=np.zeros((1, 2, 4, 8), np.float32), out=np.zeros((1, 2, 4, 8), np.float32)),
            ValueError,
            r"T == 1",
        ),
        (dict(v_pages=np.zeros((5, 2, 8), np.float32)), ValueError, "v_pages shape"),
        (dict(page_table=np.full((1, 2, 3), 5, np.int32)), ValueError, r"in \[0, P=5\)"),
        (dict(k_pages=np.zeros((5, 4, 8), np.float16)), TypeError, "float32 or bfloat16"),
        (dict(out=np.zeros((1, 1, 4, 8), np.float16)), TypeError, "float32 or bfloat16"),
        (dict(lse=np.zeros((1, 1, 4), np.int32)), TypeError, "lse must be floating point"),
    ],
)
def test_rejects_bad_arguments_before_launch(monkeypatch, change, error, match):
  monkeypatch.setattr(oi, "output_impact_pallas", kh.must_not_launch)
  out, lse = np.zeros((1, 1, 4, 8), np.float32), np.zeros((1, 1, 4), np.float32)
  args = kh.small_paged_args(change, out=out, lse=lse)
  with pytest.raises(error, match=match):
    output_impact(**args, impl="pallas", interpret=True)


def test_kernel_lowers_for_tpu():
  args = _with_attention(kh.paged_problem(6, 16, 2, 3, [20, 33], 3, 128, "bfloat16"))
  fn = jax.jit(functools.partial(oi.output_impact_pallas, interpret=False))
  assert "tpu_custom_call" in jax.export.export(fn, platforms=["tpu"])(*args).mlir_module()
