"""The kernels on quantized (int8 / int4) page pools: paged attention (TPU kernel, GPU
variant, live-blocks loop, reference) and output impact, against the references on the
dequantized float pools, with NaN-poisoned unused pages (their groups encode as NaN);
export lowering for `tpu` and `cuda`.

KVJAX_PALLAS_INTERPRET=0 runs the compiled kernels instead (on a TPU, or a GPU for the
paged-attention variant); cases that cannot compile there skip.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_helpers as kh
from kernel_helpers import release_compiled_code  # noqa: F401 (autouse fixture)

import pallas_kernels.output_impact as oi
import pallas_kernels.paged_attention as pa
from pallas_kernels import page_format as pf

KV_DTYPES = pf.QUANTIZED_DTYPES

# (page_size, group, head_dim, length_kind, q dtype, pages_per_block, kv dtype): two
# contrasting cases by default, one per K/V dtype; the whole product (both K/V dtypes, both
# kernels) under -m slow.
DEFAULT = [
    (8, 3, 64, "ragged", "float32", 1, "int8"),
    (64, 8, 128, "boundary", "bfloat16", 2, "int4"),
]
ALL = [c for c in kh.full_product() if c[4] == "float32"]
ALL_PAGES = [(*c, kv) for kv in KV_DTYPES for c in [d[:6] for d in DEFAULT] + ALL]
CASES = [pytest.param(*c) for c in DEFAULT] + [
    pytest.param(*c, marks=pytest.mark.slow) for c in dict.fromkeys(ALL_PAGES) if c not in DEFAULT
]
NAMES = kh.CASE_NAMES + ", kv_dtype"


def problem(page_size, group, head_dim, length_kind, dtype, kv_dtype, *tag):
  """(quantized args, the same with the pools dequantized to float32): q in `dtype`; the
  pools' unused slots are NaN before encoding, so their groups read back NaN."""
  q, kp, vp, table, lens = kh.case_problem(
      page_size, group, head_dim, length_kind, "float32", kv_dtype, *tag
  )
  kq, vq = pf.encode(kp, kv_dtype), pf.encode(vp, kv_dtype)
  q = q.astype(dtype)
  return (q, kq, vq, table, lens), (q, pf.decode(kq), pf.decode(vq), table, lens)


def assert_matches(got, want, dtype):
  out, probs, lse = got
  want_out, want_probs, want_lse = want
  assert out.dtype == want_out.dtype and out.shape == want_out.shape
  assert np.isfinite(np.asarray(out, np.float32)).all() and np.isfinite(probs).all()
  tol = kh.TOL[dtype]
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out, np.float32), **tol)
  np.testing.assert_allclose(probs, want_probs, **tol)
  np.testing.assert_allclose(lse, want_lse, **tol)


def reference(args):
  return kh.jitted(pa.paged_attention, impl="ref", return_lse=True)(*args)


# The TPU kernel (TPU interpreter) and the GPU variant (generic interpreter).
KERNELS = {
    "tpu": lambda: (pa.paged_attention_pallas, kh.kernel_interpret()),
    "gpu": lambda: (pa.paged_attention_pallas_gpu, kh.gpu_interpret()),
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(NAMES, CASES)
def test_kernels_dequantize_like_the_reference(
    kernel, page_size, group, head_dim, length_kind, dtype, pages_per_block, kv_dtype
):
  args, floats = problem(page_size, group, head_dim, length_kind, dtype, kv_dtype, kernel)
  fn, interpret = KERNELS[kernel]()
  got = kh.jitted(fn, interpret=interpret, pages_per_block=pages_per_block, return_lse=True)(*args)
  assert_matches(got, reference(floats), dtype)
  # The reference reads quantized pools itself, to the same values.
  assert_matches(reference(args), reference(floats), "float32")


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_prefill_chunks_read_quantized_blocks_like_floats(kv_dtype):
  """The live-blocks loop (prefill chunks, T > 1) dequantizes block by block: the same
  output and lse as on the float pools; so does the whole-table reference."""
  args, floats = problem(16, 3, 64, "boundary", "float32", kv_dtype, "chunk")
  q = jax.random.normal(jax.random.key(0), (args[0].shape[0], 5, *args[0].shape[2:]))
  num = jnp.array([5, 3, 5, 1])
  run = kh.jitted(pa.paged_attention, impl="ref", return_probs=False, return_lse=True)
  out, _, lse = run(q, *args[1:], num)
  want_out, _, want_lse = run(q, *floats[1:], num)
  np.testing.assert_allclose(out, want_out, atol=1e-5)
  np.testing.assert_allclose(lse, want_lse, atol=1e-5)
  out, probs = kh.jitted(pa.paged_attention_reference)(q, *args[1:], num)
  want_out, want_probs = kh.jitted(pa.paged_attention_reference)(q, *floats[1:], num)
  np.testing.assert_allclose(out, want_out, atol=1e-5)
  np.testing.assert_allclose(probs, want_probs, atol=1e-5)
  assert np.isfinite(out).all()


@pytest.mark.parametrize(
    "kv_dtype, where",
    [
        ("int8", "k"),
        ("int4", "v"),
        pytest.param("int8", "v", marks=pytest.mark.slow),
        pytest.param("int4", "k", marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_a_nan_in_a_live_group_reaches_the_output(kv_dtype, where):
  args, _ = problem(16, 1, 64, "full", "float32", kv_dtype, "nan")
  q, kp, vp, table, lens = args
  page = int(table[0, 0, 1])
  poisoned = lambda pool: pool.replace(zero=pool.zero.at[page, 3].set(jnp.nan))  # noqa: E731
  kp, vp = (poisoned(kp), vp) if where == "k" else (kp, poisoned(vp))
  for run in (
      kh.jitted(pa.paged_attention_pallas, interpret=kh.kernel_interpret()),
      kh.jitted(pa.paged_attention_pallas_gpu, interpret=kh.gpu_interpret()),
      kh.jitted(pa.paged_attention, impl="ref"),
  ):
    out = np.asarray(run(q, kp, vp, table, lens)[0])  # [B, 1, Hq, D]
    assert np.isnan(out[0, 0, 0]).all() and np.isfinite(out[1]).all()


@pytest.mark.parametrize(
    "kv_dtype, length_kind",
    [
        ("int8", "ragged"),
        ("int4", "boundary"),
        pytest.param("int8", "boundary", marks=pytest.mark.slow),
        pytest.param("int4", "ragged", marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_output_impact_kernel_on_quantized_pages(kv_dtype, length_kind):
  args, floats = problem(16, 3, 64, length_kind, "float32", kv_dtype, "oi")
  out, _, lse = reference(floats)
  got = kh.jitted(oi.output_impact, impl="pallas", interpret=kh.kernel_interpret())(*args, out, lse)
  want = kh.jitted(oi.output_impact_reference)(*floats, out, lse)
  assert np.isfinite(got).all()
  scale = max(1.0, float(np.abs(want).max()))
  np.testing.assert_allclose(got / scale, want / scale, atol=1e-5)
  ref_on_codes = kh.jitted(oi.output_impact_reference)(*args, out, lse)
  np.testing.assert_allclose(ref_on_codes / scale, want / scale, atol=1e-6)


def _lowering_args(kv_dtype, dtype="bfloat16"):
  q, kp, vp, table, lens = kh.paged_problem(6, 16, 2, 3, [20, 33], 3, 128, "float32")
  return q.astype(dtype), pf.encode(kp, kv_dtype), pf.encode(vp, kv_dtype), table, lens


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_kernels_lower_for_tpu(kv_dtype):
  args = _lowering_args(kv_dtype)
  fn = jax.jit(functools.partial(pa.paged_attention_pallas, interpret=False, return_lse=True))
  assert "tpu_custom_call" in jax.export.export(fn, platforms=["tpu"])(*args).mlir_module()
  out, _, lse = reference(args)
  fn = jax.jit(functools.partial(oi.output_impact_pallas, interpret=False))
  exported = jax.export.export(fn, platforms=["tpu"])(*args, out, lse)
  assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_gpu_kernel_lowers_for_cuda(kv_dtype):
  args = _lowering_args(kv_dtype)
  fn = jax.jit(functools.partial(pa.paged_attention_pallas_gpu, interpret=False, return_lse=True))
  text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text
  check = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
  exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=[check])(*args)
  assert exported.platforms == ("cuda",)


def test_mixed_pools_are_refused_before_launch():
  args, floats = problem(16, 1, 64, "full", "float32", "int8", "mixed")
  with pytest.raises(TypeError, match="stored alike"):
    pa.paged_attention(args[0], args[1], floats[2], *args[3:])
  with pytest.raises(TypeError, match="stored alike"):
    pa.paged_attention(args[0], args[1], pf.encode(floats[2], "int4"), *args[3:])
