"""Accelerator check for the kvjax Pallas kernels: tests without interpret mode, then a
micro-benchmark of kernel vs reference.

  python -m pallas_kernels.gpu_check             # on a CUDA (or TPU) machine with jax
  python -m pallas_kernels.gpu_check --dry-run   # anywhere: interpret mode, tiny sizes

Steps:
1. The kernel test files with KVJAX_PALLAS_INTERPRET=0 (compiled kernels). On a GPU that
   compiles the paged-attention GPU variant (Triton): its own tests and the dispatcher's
   kernel-vs-reference cases (impl="pallas" takes it on GPU). The output-impact and
   group-importance kernels are TPU-style (scalar-prefetched page tables), which neither
   GPU lowering supports, so their kernel cases skip with that reason. `--full` adds the
   slow full product.
2. With `--interpret-too`, on backends that cannot compile every kernel, the same tests in
   interpret mode, executed by the accelerator's XLA backend (the kernel logic under that
   backend's numerics; costs minutes).
3. A micro-benchmark at 4k/32k/128k cached tokens per sequence: time per call (median) of
   the reference (what impl="auto" runs off TPU) and of the kernel where it compiles (on a
   GPU: the paged-attention GPU variant, `--num-splits` to override its split count), and
   the achieved GB/s against the bytes the kernel must read (live K/V pages, q, page table;
   for output impact also O and lse; for group importance the scores and protection mask).
   The dry run times both paged-attention variants in interpret mode (`paged_attn_gpu` is
   the GPU variant).
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import statistics
import subprocess
import sys
import time

TEST_FILES = (
    "tests/test_kernel_paged_attention.py",
    "tests/test_kernel_output_impact.py",
    "tests/test_kernel_group_importance.py",
)
REPO = pathlib.Path(__file__).resolve().parents[1]


def run_tests(interpret: bool, extra: list[str]) -> int:
  env = dict(os.environ, KVJAX_PALLAS_INTERPRET="1" if interpret else "0")
  cmd = [sys.executable, "-m", "pytest", *TEST_FILES, "-q", "-rs", "-p", "no:cacheprovider"]
  cmd += extra
  mode = "interpret mode" if interpret else "compiled kernels (KVJAX_PALLAS_INTERPRET=0)"
  print(f"\n== kernel tests, {mode}: {' '.join(cmd[1:])}", flush=True)
  start = time.perf_counter()
  rc = subprocess.call(cmd, cwd=REPO, env=env)
  print(f"== exit code {rc} after {time.perf_counter() - start:.1f} s", flush=True)
  return rc


def median_seconds(fn, *args, iters: int) -> float:
  """Median wall time of `fn(*args)` over `iters` calls after a warm-up call (compile,
  allocate); results are waited for (`jax.block_until_ready`). The benchmarks time with it
  too."""
  import jax

  jax.block_until_ready(fn(*args))  # compile + warm up
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _problem(key, batch, kv_heads, group, head_dim, page_size, tokens, dtype):
  """A full pool in shuffled page order (every sequence holds `tokens` tokens)."""
  import jax
  import jax.numpy as jnp

  m = -(-tokens // page_size)
  num_pages = batch * kv_heads * m + 1
  kq, kk, kv, kp = jax.random.split(key, 4)
  k_pages = jax.random.normal(kk, (num_pages, page_size, head_dim), dtype)
  v_pages = jax.random.normal(kv, (num_pages, page_size, head_dim), dtype)
  table = (jax.random.permutation(kp, num_pages - 1) + 1).reshape(batch, kv_heads, m)
  lengths = jnp.full((batch, kv_heads), tokens, jnp.int32)
  q = jax.random.normal(kq, (batch, 1, kv_heads * group, head_dim), dtype)
  return q, k_pages, v_pages, table.astype(jnp.int32), lengths


def benchmark(args) -> list[dict]:
  import jax
  import jax.numpy as jnp

  from pallas_kernels.group_importance import group_importance
  from pallas_kernels.output_impact import output_impact
  from pallas_kernels.paged_attention import paged_attention, paged_attention_pallas_gpu

  backend = jax.default_backend()
  interpret = True if args.dry_run else None
  gpu_attention = functools.partial(
      paged_attention_pallas_gpu, num_splits=args.num_splits, interpret=bool(args.dry_run)
  )
  dtype = jnp.dtype(args.dtype)
  b, hkv, g, d, ps = args.batch, args.kv_heads, args.group, args.head_dim, args.page_size
  rows = []
  for tokens in args.tokens:
    q, kp, vp, table, lengths = _problem(jax.random.key(tokens), b, hkv, g, d, ps, tokens, dtype)
    live_kv = 2 * b * hkv * tokens * d * dtype.itemsize
    base = live_kv + q.size * dtype.itemsize + table.size * 4 + lengths.size * 4
    attn_ref = jax.jit(functools.partial(paged_attention, impl="ref", return_lse=True))
    out, _, lse = attn_ref(q, kp, vp, table, lengths)
    scores = jax.random.uniform(jax.random.key(1), (1, b, hkv, table.shape[-1] * ps))
    protected = jnp.arange(scores.shape[-1]) >= tokens - 64
    protected = jnp.broadcast_to(protected, scores.shape)
    attn_args = (q, kp, vp, table, lengths)
    # (name, op, args, kwargs, bytes read, kernel: None = the dispatcher's impl="pallas")
    ops = []
    if backend == "gpu":
      ops.append(("paged_attention", paged_attention, attn_args, {}, base, gpu_attention))
    else:
      ops.append(("paged_attention", paged_attention, attn_args, {}, base, None))
      if args.dry_run:
        ops.append(("paged_attn_gpu", paged_attention, attn_args, {}, base, gpu_attention))
    ops += [
        (
            "output_impact",
            output_impact,
            (q, kp, vp, table, lengths, out, lse),
            {},
            base + out.size * dtype.itemsize + lse.size * 4,
            None,
        ),
        (
            "group_importance",
            group_importance,
            (scores, ps, protected),
            {},
            scores.size * 4 + protected.size,
            None,
        ),
    ]
    for name, fn, op_args, kw, nbytes, kernel in ops:
      if name == "group_importance":
        ref = jax.jit(functools.partial(fn, impl="ref"), static_argnums=1)
      else:
        ref = jax.jit(functools.partial(fn, impl="ref", **kw))
      row = dict(op=name, tokens=tokens, bytes=nbytes)
      row["ref_s"] = median_seconds(ref, *op_args, iters=args.iters)
      kernel_runs = kernel is not None or backend == "tpu" or args.dry_run
      if kernel is not None:
        row["kernel_s"] = median_seconds(jax.jit(kernel), *op_args, iters=args.iters)
      elif kernel_runs:
        kfn = functools.partial(fn, impl="pallas", interpret=interpret, **kw)
        kern = jax.jit(kfn, static_argnums=1) if name == "group_importance" else jax.jit(kfn)
        row["kernel_s"] = median_seconds(kern, *op_args, iters=args.iters)
      rows.append(row)
      print(_format_row(row, kernel_runs, backend), flush=True)
  return rows


def _header() -> str:
  return (
      f"{'op':<17}{'tokens':>8}{'read MB':>10}{'ref ms':>10}{'kernel ms':>11}"
      f"{'ref GB/s':>10}{'kern GB/s':>11}{'speedup':>9}"
  )


def _format_row(row, kernel_runs, backend) -> str:
  mb = row["bytes"] / 1e6
  ref_ms, ref_gbs = row["ref_s"] * 1e3, row["bytes"] / row["ref_s"] / 1e9
  if kernel_runs:
    k_ms, k_gbs = row["kernel_s"] * 1e3, row["bytes"] / row["kernel_s"] / 1e9
    kernel = f"{k_ms:>11.3f}{ref_gbs:>10.1f}{k_gbs:>11.1f}{row['ref_s'] / row['kernel_s']:>8.2f}x"
  else:
    kernel = f"{'n/a':>11}{ref_gbs:>10.1f}{'n/a':>11}{'':>9}"
  return f"{row['op']:<17}{row['tokens']:>8}{mb:>10.2f}{ref_ms:>10.3f}{kernel}"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dry-run", action="store_true", help="interpret mode, tiny sizes")
  parser.add_argument("--skip-tests", action="store_true")
  parser.add_argument("--skip-bench", action="store_true")
  parser.add_argument("--full", action="store_true", help="compiled tests: the slow product too")
  parser.add_argument(
      "--interpret-too", action="store_true", help="then the tests in interpret mode (minutes)"
  )
  parser.add_argument("--num-splits", type=int, default=None, help="GPU variant split count")
  parser.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=None)
  parser.add_argument("--batch", type=int, default=None)
  parser.add_argument("--kv-heads", type=int, default=None)
  parser.add_argument("--group", type=int, default=4, help="query heads per kv head")
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--page-size", type=int, default=16)
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  parser.add_argument("--iters", type=int, default=None)
  args = parser.parse_args(argv)
  if args.dry_run:
    args.tokens = args.tokens or [64, 256]
    args.batch, args.kv_heads = args.batch or 1, args.kv_heads or 2
    args.head_dim, args.iters = min(args.head_dim, 64), args.iters or 2
  else:
    args.tokens = args.tokens or [4096, 32768, 131072]
    args.batch, args.kv_heads, args.iters = args.batch or 4, args.kv_heads or 8, args.iters or 20

  import jax

  backend = jax.default_backend()
  device = jax.devices()[0]
  print(f"jax {jax.__version__}, backend {backend}, device {device.device_kind}", flush=True)
  if backend not in ("gpu", "tpu") and not args.dry_run:
    print("no accelerator: run with --dry-run (interpret mode at tiny sizes)")
    return 2
  if backend == "gpu":
    print(
        "note: paged attention runs its GPU variant (Triton) compiled; output impact and "
        "group importance are TPU-style (scalar prefetch), so their compiled kernel cases "
        "skip; impl='auto' uses the reference on GPU until this check has passed here"
    )

  status = 0
  if not args.skip_tests:
    if args.dry_run:  # the subprocess path, quickly: hand-computed cases in interpret mode
      status |= run_tests(True, ["-k", "hand_computed"])
    else:
      status |= run_tests(False, ["-m", "slow or not slow"] if args.full else [])
      if backend != "tpu" and args.interpret_too:
        status |= run_tests(True, [])
  if not args.skip_bench:
    print(
        f"\n== benchmark: batch {args.batch}, kv heads {args.kv_heads}, group {args.group}, "
        f"head dim {args.head_dim}, page size {args.page_size}, {args.dtype}, median of "
        f"{args.iters}" + (" (interpret mode: timings meaningless)" if args.dry_run else ""),
        flush=True,
    )
    print(_header(), flush=True)
    benchmark(args)
  return status


if __name__ == "__main__":
  sys.exit(main())
