"""Helpers shared by the Pallas kernel tests and the paged-attention reference tests:
NaN-poisoned paged problems, the case product, the choice of interpreter, small valid
arguments for the argument checks.

Imported as `kernel_helpers` (pytest puts tests/ on sys.path, tests/ being no package).
"""

import functools
import itertools
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

PAGE_SIZES = (8, 16, 64)
GROUPS = (1, 3, 8)
HEAD_DIMS = (64, 128)
LENGTH_KINDS = ("one", "boundary", "full", "ragged")
DTYPES = ("float32", "bfloat16")
PAGES_PER_BLOCK = (None, 1, 2)
TOL = {"float32": dict(atol=1e-5, rtol=0), "bfloat16": dict(atol=2e-2, rtol=2e-2)}


def compiled_kernels() -> bool:
  return os.environ.get("KVJAX_PALLAS_INTERPRET", "1") == "0"


def kernel_interpret(gpu_variant: bool = False):
  """What the tests pass as `interpret`: the TPU interpreter (uninitialised memory reads as
  NaN, out-of-bounds reads raise) unless KVJAX_PALLAS_INTERPRET=0 asks for compiled kernels:
  on a TPU, or on a GPU where the op has a GPU variant that the dispatcher picks there
  (`gpu_variant`, paged attention); elsewhere the test skips."""
  if compiled_kernels():
    backend = jax.default_backend()
    if backend != "tpu" and not (gpu_variant and backend == "gpu"):
      pytest.skip(f"this Pallas kernel is TPU-style; {backend} cannot compile it")
    return False
  return pltpu.InterpretParams(uninitialized_memory="nan", out_of_bounds_reads="raise")


def gpu_interpret():
  """`interpret` for the GPU variant: the generic interpreter (outputs start as NaN; the TPU
  interpreter does not run Triton-style kernels), or compiled on a GPU with
  KVJAX_PALLAS_INTERPRET=0."""
  if compiled_kernels():
    if jax.default_backend() != "gpu":
      pytest.skip(f"the GPU variant compiles for GPUs only, not {jax.default_backend()}")
    return False
  return True


def lengths_for(kind, page_size):
  """(lengths of the batch rows, pages per table) of a length pattern."""
  ps = page_size
  return {
      "one": ([1], 2),
      "boundary": ([ps, ps + 1, 2 * ps - 1, 2 * ps], 3),
      "full": ([3 * ps, 3 * ps], 3),  # every table entry in use
      "ragged": ([1, 3 * ps, 2 * ps + 3, 0], 4),  # includes an empty sequence
  }[kind]


def paged_pool(rng, page_size, hkv, group, lengths, max_pages, d, num_pages, t=1):
  """A NaN-poisoned pool of `num_pages` pages: the null page 0, pages no sequence owns and
  slots past each length are NaN; each sequence's pages are drawn from a shuffled free list.
  Returns numpy q [B, T, Hq, D], k_pages, v_pages [P, S, D], table [B, Hkv, M],
  lengths [B, Hkv], and the dense K and V [length, D] of each (row, kv head)."""
  b = len(lengths)
  k_pages = np.full((num_pages, page_size, d), np.nan, np.float32)
  v_pages = np.full((num_pages, page_size, d), np.nan, np.float32)
  table = np.zeros((b, hkv, max_pages), np.int32)
  free = list(rng.permutation(np.arange(1, num_pages)))
  dense_k, dense_v = {}, {}
  for bi, n in enumerate(lengths):
    for h in range(hkv):
      ks = rng.normal(size=(n, d)).astype(np.float32)
      vs = rng.normal(size=(n, d)).astype(np.float32)
      dense_k[bi, h], dense_v[bi, h] = ks, vs
      for p in range(-(-n // page_size)):
        page = free.pop()
        table[bi, h, p] = page
        rows = slice(p * page_size, min((p + 1) * page_size, n))
        k_pages[page, : rows.stop - rows.start] = ks[rows]
        v_pages[page, : rows.stop - rows.start] = vs[rows]
  q = rng.normal(size=(b, t, hkv * group, d)).astype(np.float32)
  lens = np.repeat(np.asarray(lengths, np.int32)[:, None], hkv, axis=1)
  return q, k_pages, v_pages, table, lens, dense_k, dense_v


def paged_problem(seed, page_size, hkv, group, lengths, max_pages, d, dtype="float32"):
  """A decode problem on a `paged_pool` with two pages no sequence owns. Returns jnp arrays
  (q, k_pages, v_pages, table, lens), q and the pools in `dtype`."""
  owned = sum(-(-n // page_size) for n in lengths) * hkv
  rng = np.random.default_rng(seed)
  q, kp, vp, table, lens, _, _ = paged_pool(
      rng, page_size, hkv, group, lengths, max_pages, d, num_pages=1 + owned + 2
  )
  dt = jnp.dtype(dtype)
  arrays = (jnp.asarray(q, dt), jnp.asarray(kp, dt), jnp.asarray(vp, dt))
  return (*arrays, jnp.asarray(table), jnp.asarray(lens))


def case_problem(page_size, group, head_dim, length_kind, dtype, *tag):
  """The `paged_problem` of one case (2 kv heads), seeded by the case (and `tag`)."""
  lengths, m = lengths_for(length_kind, page_size)
  seed = zlib.crc32(repr((*tag, page_size, group, head_dim, length_kind, dtype)).encode())
  return paged_problem(seed, page_size, 2, group, lengths, m, head_dim, dtype)


def live_slots(args):
  """[B, Hkv, N] numpy mask of the slots below each length of a problem's arguments."""
  _, k_pages, _, table, lens = args[:5]
  return np.arange(table.shape[-1] * k_pages.shape[1]) < np.asarray(lens)[..., None]


def full_product():
  cases = list(itertools.product(PAGE_SIZES, GROUPS, HEAD_DIMS, LENGTH_KINDS, DTYPES))
  return [(*c, PAGES_PER_BLOCK[i % len(PAGES_PER_BLOCK)]) for i, c in enumerate(cases)]


def default_subset():
  """A covering subset of the product that interpret mode runs quickly: every page size,
  group, head dim, length kind and dtype at least once (the whole product runs under
  -m slow)."""
  picks = [
      (8, 1, 64, "ragged", "float32"),
      (16, 3, 128, "boundary", "bfloat16"),
      (16, 8, 128, "one", "float32"),
      (64, 8, 64, "full", "bfloat16"),
  ]
  return [c for c in full_product() if c[:5] in picks]


def case_params(cases_default, cases_all):
  """Default cases, plus the rest of the full product marked slow."""
  slow = [c for c in cases_all if c not in cases_default]
  return [pytest.param(*c) for c in cases_default] + [
      pytest.param(*c, marks=pytest.mark.slow) for c in slow
  ]


CASES = case_params(default_subset(), full_product())
CASE_NAMES = "page_size, group, head_dim, length_kind, dtype, pages_per_block"


@functools.cache
def jitted(fn, **static):
  return jax.jit(functools.partial(fn, **static))


@pytest.fixture(autouse=True)
def release_compiled_code():
  """Drops compiled executables after each test: hundreds of interpret-mode kernels kept
  alive in one process have crashed the XLA CPU compiler (segfault) in the slow set.
  Autouse in the test modules that import it."""
  yield
  jitted.cache_clear()
  jax.clear_caches()


def must_not_launch(*args, **kwargs):
  raise AssertionError("the kernel was launched")


def small_paged_args(change=None, **extra):
  """Small valid paged arguments as jnp arrays: q [1, 1, 4, 8], pools [5, 4, 8], page table
  [1, 2, 3] and lengths [1, 2], plus `extra`, then `change` applied; None stays None."""
  args = dict(
      q=np.zeros((1, 1, 4, 8), np.float32),
      k_pages=np.zeros((5, 4, 8), np.float32),
      v_pages=np.zeros((5, 4, 8), np.float32),
      page_table=np.zeros((1, 2, 3), np.int32),
      lengths=np.zeros((1, 2), np.int32),
      **extra,
  )
  args.update(change or {})
  return {name: None if x is None else jnp.asarray(x) for name, x in args.items()}
