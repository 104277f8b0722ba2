"""Pallas paged decode attention (TPU kernel and GPU variant) against its reference
(interpret mode on CPU).

KVJAX_PALLAS_INTERPRET=0 runs the compiled kernels instead: the TPU kernel on a TPU, the
GPU variant on a GPU (through the dispatcher too); cases that cannot compile there skip.
The helpers shared with the other kernel test files are in kernel_helpers.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from kernel_helpers import (  # noqa: F401 (release_compiled_code: autouse fixture)
    CASE_NAMES,
    CASES,
    DTYPES,
    TOL,
    case_params,
    case_problem,
    compiled_kernels,
    full_product,
    gpu_interpret,
    jitted,
    kernel_interpret,
    lengths_for,
    live_slots,
    must_not_launch,
    paged_problem,
    release_compiled_code,
    small_paged_args,
)

from pallas_kernels.paged_attention import dispatch as pa
from pallas_kernels.paged_attention import (
    paged_attention,
    paged_attention_lse_reference,
    paged_attention_pallas_gpu,
    paged_attention_reference,
    resolve_impl,
)


def assert_decode_matches_reference(got, args, dtype):
  """A decode kernel's (out, probs, lse) for `args` against the references: dtype, shapes,
  finite values within TOL[dtype] (+inf lse rows compare equal), zero probs at dead slots."""
  out, probs, lse = got
  want_out, want_probs = jitted(paged_attention_reference)(*args)
  want_lse = jitted(paged_attention_lse_reference)(args[0], args[1], args[3], args[4])
  live = live_slots(args)  # [B, Hkv, N]
  assert out.dtype == want_out.dtype and out.shape == want_out.shape
  assert probs.shape == want_probs.shape == (live.shape[0], 2, 1, live.shape[2])
  assert np.isfinite(np.asarray(out, np.float32)).all() and np.isfinite(probs).all()
  tol = TOL[dtype]
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out, np.float32), **tol)
  np.testing.assert_allclose(probs, want_probs, **tol)
  np.testing.assert_allclose(lse, want_lse, **tol)
  assert (np.asarray(probs)[:, :, 0][~live] == 0).all()


@pytest.mark.parametrize(CASE_NAMES, CASES)
def test_kernel_matches_reference(page_size, group, head_dim, length_kind, dtype, pages_per_block):
  args = case_problem(page_size, group, head_dim, length_kind, dtype)
  got = jitted(
      paged_attention,
      impl="pallas",
      interpret=kernel_interpret(gpu_variant=True),
      pages_per_block=pages_per_block,
      return_lse=True,
  )(*args)
  assert_decode_matches_reference(got, args, dtype)


@pytest.mark.parametrize(
    "page_size, group, head_dim, dtype", [(16, 3, 64, "float32"), (8, 8, 128, "bfloat16")]
)
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_per_query_head_probabilities(page_size, group, head_dim, dtype):
  lengths, m = lengths_for("ragged", page_size)
  args = paged_problem(3, page_size, 2, group, lengths, m, head_dim, dtype)
  out, probs = jitted(
      paged_attention,
      impl="pallas",
      interpret=kernel_interpret(gpu_variant=True),
      per_query_head=True,
  )(*args)
  want_out, want_probs = jitted(paged_attention_reference, per_query_head=True)(*args)
  assert probs.shape == want_probs.shape == (len(lengths), 2 * group, 1, m * page_size)
  np.testing.assert_allclose(probs, want_probs, **TOL[dtype])
  np.testing.assert_allclose(
      np.asarray(out, np.float32), np.asarray(want_out, np.float32), **TOL[dtype]
  )


def test_padding_queries_and_generic_interpreter():
  # num_queries = 0 marks a padding row: nothing visible, zeros out, lse = +inf. Runs the
  # generic (non-TPU) interpreter, which is what impl="pallas" uses on CPU by default.
  args = paged_problem(5, 8, 2, 3, [13, 20], 3, 64)
  num_queries = jnp.array([1, 0], jnp.int32)
  interpret = kernel_interpret(gpu_variant=True) if compiled_kernels() else True
  out, probs, lse = jitted(paged_attention, impl="pallas", interpret=interpret, return_lse=True)(
      *args, num_queries
  )
  want_out, want_probs = jitted(paged_attention_reference)(*args, num_queries)
  np.testing.assert_allclose(out, want_out, atol=1e-5)
  np.testing.assert_allclose(probs, want_probs, atol=1e-5)
  assert (np.asarray(out)[1] == 0).all() and (np.asarray(probs)[1] == 0).all()
  assert np.isinf(np.asarray(lse)[1]).all() and np.isfinite(np.asarray(lse)[0]).all()


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_a_nan_in_a_live_key_or_value_reaches_the_output(where):
  """A NaN model's K/V must not be dropped as if masked (zeros: a silent wrong answer): every
  implementation gives NaN for the queries that read it, finite values elsewhere."""
  args = list(paged_problem(11, 8, 2, 3, [13, 20], 3, 64))
  table = np.asarray(args[3])
  pool = np.array(args[1 if where == "k" else 2])
  pool[table[0, 0, 1], 2] = np.nan  # row 0, kv head 0, slot 10 (live)
  args[1 if where == "k" else 2] = jnp.asarray(pool)
  outputs = {
      "reference": jitted(paged_attention_reference)(*args)[0],
      "live blocks": jitted(pa.paged_attention_live_blocks, block_tokens=8)(*args)[0],
      "pallas": jitted(
          paged_attention, impl="pallas", interpret=kernel_interpret(gpu_variant=True)
      )(*args)[0],
      "gpu variant": jitted(paged_attention_pallas_gpu, interpret=gpu_interpret(), num_splits=2)(
          *args
      )[0],
  }
  for name, out in outputs.items():
    out = np.asarray(out)  # [B, 1, Hq, D]; query heads 0-2 read kv head 0
    assert np.isnan(out[0, 0, :3]).all(), name
    assert np.isfinite(out[0, 0, 3:]).all() and np.isfinite(out[1]).all(), name


def test_hand_computed_tiny_case():
  # One kv head, one query head, d=1: logits = q * k / 1 = (0, log 3) -> probs (1/4, 3/4).
  if compiled_kernels() and jax.default_backend() == "gpu":
    pytest.skip("d=1 and page size 1 are below the GPU variant's tiles (see the GPU case)")
  k_pages = jnp.array([[[np.nan]], [[0.0]], [[1.0]]], jnp.float32)  # page 0 = null
  v_pages = jnp.array([[[np.nan]], [[4.0]], [[8.0]]], jnp.float32)
  q = jnp.full((1, 1, 1, 1), np.log(3.0), jnp.float32)
  table = jnp.array([[[2, 1, 0]]], jnp.int32)  # logical order: page 2 then page 1
  out, probs, lse = paged_attention(
      q,
      k_pages,
      v_pages,
      table,
      jnp.array([[2]]),
      impl="pallas",
      interpret=kernel_interpret(gpu_variant=True),
      pages_per_block=1,
      return_lse=True,
  )
  np.testing.assert_allclose(probs[0, 0, 0], [0.75, 0.25, 0.0], rtol=1e-6)
  np.testing.assert_allclose(out[0, 0, 0], [0.75 * 8 + 0.25 * 4], rtol=1e-6)
  np.testing.assert_allclose(lse[0, 0, 0], np.log(4.0), rtol=1e-6)  # log(e^log3 + e^0)


def test_prefill_chunks_fall_back_to_the_reference(monkeypatch):
  monkeypatch.setattr(pa, "paged_attention_pallas", must_not_launch)
  monkeypatch.setattr(pa, "paged_attention_pallas_gpu", must_not_launch)
  rng = np.random.default_rng(2)
  q, kp, vp, table, lens = paged_problem(2, 8, 2, 3, [20, 9], 3, 64)
  q = jnp.asarray(rng.normal(size=(2, 4, 6, 64)), jnp.float32)
  got = paged_attention(q, kp, vp, table, lens, impl="pallas", interpret=True)
  want = paged_attention_reference(q, kp, vp, table, lens)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(q=np.zeros((1, 1, 4), np.float32)), ValueError, r"q must be \[B, T, Hq, D\]"),
        (dict(k_pages=np.zeros((5, 4, 7), np.float32)), ValueError, r"k_pages must be"),
        (dict(v_pages=np.zeros((5, 2, 8), np.float32)), ValueError, "v_pages shape"),
        (dict(page_table=np.zeros((1, 3, 3), np.int32)), ValueError, "multiple of kv heads"),
        (dict(lengths=np.zeros((1,), np.int32)), ValueError, r"lengths must be \[B, Hkv\]"),
        (dict(page_table=np.full((1, 2, 3), 5, np.int32)), ValueError, r"in \[0, P=5\)"),
        (dict(page_table=np.full((1, 2, 3), -1, np.int32)), ValueError, r"in \[0, P=5\)"),
        (dict(q=np.zeros((1, 1, 4, 8), np.float16)), TypeError, "float32 or bfloat16"),
        (dict(k_pages=np.zeros((5, 4, 8), np.float16)), TypeError, "float32 or bfloat16"),
        (dict(q=np.zeros((1, 1, 4, 8), np.int32)), TypeError, "q must be floating point"),
        (dict(page_table=np.zeros((1, 2, 3), np.float32)), TypeError, "must be integer"),
    ],
)
def test_rejects_bad_arguments_before_launch(monkeypatch, change, error, match):
  monkeypatch.setattr(pa, "paged_attention_pallas", must_not_launch)
  monkeypatch.setattr(pa, "paged_attention_pallas_gpu", must_not_launch)
  with pytest.raises(error, match=match):
    paged_attention(**small_paged_args(change), impl="pallas", interpret=True)


def test_out_of_range_table_is_rejected_on_the_reference_path_too():
  args = small_paged_args(dict(page_table=np.full((1, 2, 3), 9, np.int32)))
  with pytest.raises(ValueError, match=r"in \[0, P=5\)"):
    paged_attention(**args, impl="ref")


def test_traced_page_table_skips_the_range_check():
  args = paged_problem(4, 8, 2, 1, [9], 2, 64)
  out, _ = jax.jit(functools.partial(paged_attention, impl="pallas", interpret=True))(*args)
  want, _ = jitted(paged_attention_reference)(*args)
  np.testing.assert_allclose(out, want, atol=1e-5)


def test_auto_picks_the_reference_on_cpu(monkeypatch):
  if jax.default_backend() != "cpu":
    pytest.skip("checks the CPU choice")
  monkeypatch.setattr(pa, "paged_attention_pallas", must_not_launch)
  monkeypatch.setattr(pa, "paged_attention_pallas_gpu", must_not_launch)
  args = paged_problem(4, 8, 2, 1, [9], 2, 64)
  np.testing.assert_array_equal(paged_attention(*args)[0], paged_attention_reference(*args)[0])


@pytest.mark.parametrize(
    "backend, impl, interpret, gpu_kernel, expected",
    [
        ("tpu", "auto", None, False, (True, False)),
        ("tpu", "pallas", True, False, (True, True)),
        ("gpu", "auto", None, False, (False, False)),
        ("cpu", "auto", None, False, (False, False)),
        ("cpu", "pallas", None, False, (True, True)),
        ("gpu", "pallas", None, False, (True, True)),
        ("cpu", "ref", None, False, (False, False)),
        # Ops with a GPU variant (paged attention): compiled on GPU, auto still the reference.
        ("gpu", "auto", None, True, (False, False)),
        ("gpu", "pallas", None, True, (True, False)),
        ("gpu", "pallas", True, True, (True, True)),
        ("cpu", "pallas", None, True, (True, True)),
        ("tpu", "auto", None, True, (True, False)),
    ],
)
def test_resolve_impl(monkeypatch, backend, impl, interpret, gpu_kernel, expected):
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  monkeypatch.delenv("KVJAX_PALLAS_INTERPRET", raising=False)
  assert resolve_impl(impl, interpret, gpu_kernel=gpu_kernel) == expected


def test_resolve_impl_rejects_unknown_impl_and_uncompilable_backends(monkeypatch):
  with pytest.raises(ValueError, match="impl must be one of"):
    resolve_impl("triton", None)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  with pytest.raises(NotImplementedError, match="TPU-style"):
    resolve_impl("pallas", False)
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  with pytest.raises(NotImplementedError, match="cpu"):
    resolve_impl("pallas", False, gpu_kernel=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_lowers_for_tpu(dtype):
  # Cross-platform lowering runs the Pallas -> Mosaic lowering rules without a TPU (the
  # Mosaic compiler itself only runs on a TPU host).
  args = paged_problem(6, 16, 2, 3, [20, 33], 3, 128, dtype)
  fn = jax.jit(functools.partial(pa.paged_attention_pallas, interpret=False, return_lse=True))
  exported = jax.export.export(fn, platforms=["tpu"])(*args)
  assert "tpu_custom_call" in exported.mlir_module()


# ---------------------------------------------------------------------------------------
# GPU variant (Triton-style): the same product, in the generic interpreter on CPU.


def gpu_default_subset():
  """Three cases covering each page size, group, head dim, dtype and pages_per_block, three
  length kinds and num_splits choices (interpret mode is slow; the product runs under
  -m slow)."""
  return [
      (8, 1, 64, "ragged", "float32", 1, 4),
      (16, 3, 128, "boundary", "bfloat16", None, None),
      (64, 8, 64, "full", "float32", 2, 3),
  ]


def gpu_full_product():
  splits = (None, 1, 2, 4)
  return [(*c, splits[i % len(splits)]) for i, c in enumerate(full_product())]


GPU_CASES = case_params(gpu_default_subset(), gpu_full_product())


@pytest.mark.parametrize(CASE_NAMES + ", num_splits", GPU_CASES)
def test_gpu_kernel_matches_reference(
    page_size, group, head_dim, length_kind, dtype, pages_per_block, num_splits
):
  args = case_problem(page_size, group, head_dim, length_kind, dtype)
  got = jitted(
      paged_attention_pallas_gpu,
      interpret=gpu_interpret(),
      pages_per_block=pages_per_block,
      num_splits=num_splits,
      return_lse=True,
  )(*args)
  assert_decode_matches_reference(got, args, dtype)


def test_gpu_kernel_per_query_head_and_padding_queries():
  # Per-query-head probabilities, and num_queries = 0 (a padding row): zeros, lse = +inf.
  args = paged_problem(7, 8, 2, 3, [13, 20, 5], 4, 64)
  num_queries = jnp.array([1, 0, 1], jnp.int32)
  out, probs, lse = jitted(
      paged_attention_pallas_gpu,
      interpret=gpu_interpret(),
      per_query_head=True,
      return_lse=True,
      num_splits=2,
  )(*args, num_queries)
  want_out, want_probs = jitted(paged_attention_reference, per_query_head=True)(*args, num_queries)
  assert probs.shape == want_probs.shape == (3, 6, 1, 32)
  np.testing.assert_allclose(out, want_out, atol=1e-5)
  np.testing.assert_allclose(probs, want_probs, atol=1e-5)
  assert (np.asarray(out)[1] == 0).all() and (np.asarray(probs)[1] == 0).all()
  assert np.isinf(np.asarray(lse)[1]).all() and np.isfinite(np.asarray(lse)[[0, 2]]).all()


def test_gpu_kernel_hand_computed_case():
  # The tiny hand case at the GPU tiles (D = 16, S = 16; only component 0 is non-zero). 17
  # live slots: page 2 then page 1, read through the table. Logits (scale 1): log 3 at
  # slot 0, 0 at the other 16, so probs 3/19 and 1/19; out (3 * 8 + 4) / 19; lse log 19.
  k_pages = np.full((3, 16, 16), np.nan, np.float32)  # page 0 = null, unused slots NaN
  v_pages = np.full((3, 16, 16), np.nan, np.float32)
  k_pages[2], v_pages[2], k_pages[1, 0], v_pages[1, 0] = 0.0, 0.0, 0.0, 0.0
  k_pages[2, 0, 0], v_pages[2, 0, 0], v_pages[1, 0, 0] = 1.0, 8.0, 4.0
  q = np.zeros((1, 1, 1, 16), np.float32)
  q[..., 0] = np.log(3.0)
  out, probs, lse = paged_attention_pallas_gpu(
      jnp.asarray(q),
      jnp.asarray(k_pages),
      jnp.asarray(v_pages),
      jnp.array([[[2, 1, 0]]], jnp.int32),
      jnp.array([[17]], jnp.int32),
      scale=1.0,
      pages_per_block=1,
      return_lse=True,
      interpret=gpu_interpret(),
  )
  want_probs = np.r_[3.0, np.ones(16), np.zeros(31)] / 19.0
  np.testing.assert_allclose(probs[0, 0, 0], want_probs, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(out[0, 0, 0], [28.0 / 19.0] + [0.0] * 15, rtol=1e-6)
  np.testing.assert_allclose(lse[0, 0, 0], np.log(19.0), rtol=1e-6)


def test_dispatcher_runs_the_gpu_variant_on_gpu(monkeypatch):
  # On a GPU backend impl="pallas" takes the GPU variant (here in the generic interpreter);
  # a TPU InterpretParams keeps the TPU kernel; shapes below the GPU tiles raise first.
  if compiled_kernels():
    pytest.skip("fakes the GPU backend for the interpreter")
  args = paged_problem(8, 16, 2, 3, [20, 33], 3, 64)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.delenv("KVJAX_PALLAS_INTERPRET", raising=False)
  calls = []
  gpu_fn = pa.paged_attention_pallas_gpu
  monkeypatch.setattr(
      pa, "paged_attention_pallas_gpu", lambda *a, **k: calls.append(k) or gpu_fn(*a, **k)
  )
  out, probs = paged_attention(*args, impl="pallas", interpret=True)
  assert len(calls) == 1 and calls[0]["interpret"] is True
  want_out, want_probs = paged_attention_reference(*args)
  np.testing.assert_allclose(out, want_out, atol=1e-5)
  np.testing.assert_allclose(probs, want_probs, atol=1e-5)

  monkeypatch.setattr(pa, "paged_attention_pallas_gpu", must_not_launch)
  np.testing.assert_array_equal(paged_attention(*args)[0], want_out)  # auto: the reference
  monkeypatch.setattr(pa, "paged_attention_pallas", lambda *a, **k: "tpu kernel")
  assert paged_attention(*args, impl="pallas", interpret=pltpu.InterpretParams()) == "tpu kernel"

  small = small_paged_args()  # D = 8, S = 4
  with pytest.raises(ValueError, match="power-of-two head dim >= 16"):
    paged_attention(**small, impl="pallas", interpret=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_kernel_lowers_for_cuda(dtype):
  # Cross-platform lowering runs the Pallas -> Triton IR lowering on CPU (no GPU needed):
  # the module carries the Triton kernel as a custom call that XLA compiles on the device.
  args = paged_problem(6, 16, 2, 3, [20, 33], 3, 128, dtype)
  fn = jax.jit(functools.partial(paged_attention_pallas_gpu, interpret=False, return_lse=True))
  text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text
  # jax.export needs the safety check off: the Triton custom call has no stability guarantee.
  check = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
  exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=[check])(*args)
  assert exported.platforms == ("cuda",)


@pytest.mark.parametrize(
    "page_size, max_pages, requested, itemsize, expected",
    [
        (16, 64, None, 2, 8),  # 128 tokens of bf16
        (16, 64, None, 4, 4),  # 64 tokens of f32
        (8, 64, 1, 2, 2),  # raised to the 16 tokens tl.dot needs
        (64, 64, 3, 2, 4),  # raised to a power of two
        (16, 3, None, 2, 4),  # no larger than the (power-of-two padded) table
        (8, 1, None, 2, 2),  # ... but never below 16 tokens
    ],
)
def test_gpu_pages_per_block(page_size, max_pages, requested, itemsize, expected):
  assert pa.gpu_pages_per_block(page_size, max_pages, requested, itemsize) == expected
