"""Decode attention against the device's memory bandwidth: one query token over N cached
tokens, dense and paged, float and int8 pages, as a share of the measured streaming read.

    python -m benchmarks.decode_attention [--tokens 4096 32768] [--batch 8] [--kv-heads 8]
        [--group 4] [--head-dim 128] [--page-size 16] [--dtype bfloat16] [--iters 20]

Decode attention reads every cached K/V value once, so its limit is the memory bandwidth:
the bytes it must read (live K/V, scales of quantized pages included, q, the page table)
over the time, against the device's streaming read of a large array (a jitted sum, the
same program style) and, where the device is known, its nominal peak. Rows: `dense`
([B, Hkv, N, D] buffers, an einsum), `paged` (`paged_attention`, the dispatcher's choice:
the reference off TPU), `paged kernel` on a GPU/TPU (impl="pallas": the Triton or Mosaic
kernel), each with float pages and with int8 pages (`paged` only: a dense int8 layout is
not a kvjax cache). Page order is shuffled, as in a pool after evictions. Medians of
`--iters` calls after a warm-up; prints markdown, `--json` writes the rows.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys

if not __package__:  # `python benchmarks/NAME.py`: import from the repository root, as -m does
  sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import jax
import jax.numpy as jnp

from benchmarks._common import print_table
from pallas_kernels import page_format
from pallas_kernels.gpu_check import median_seconds
from pallas_kernels.paged_attention import paged_attention

# Nominal HBM bandwidth (bytes/s) by `device_kind`, from the vendors' data sheets; the
# measured streaming read is the limit the table divides by, these are for the reader.
NOMINAL_BANDWIDTH = {
    "NVIDIA H100 80GB HBM3": 3.35e12,
    "NVIDIA H100 PCIe": 2.0e12,
    "NVIDIA H200": 4.8e12,
    "NVIDIA A100-SXM4-80GB": 2.04e12,
    "NVIDIA A100-SXM4-40GB": 1.56e12,
    "TPU v4": 1.2e12,
    "TPU v5 lite": 8.2e11,
    "TPU v5e": 8.2e11,
    "TPU v5p": 2.76e12,
    "TPU v6 lite": 1.64e12,
}


def streaming_read(nbytes: int, iters: int) -> float:
  """Bytes/s of a jitted sum over a float32 array of `nbytes` on the default device."""
  x = jnp.ones((nbytes // 4,), jnp.float32)
  return nbytes / median_seconds(jax.jit(jnp.sum), x, iters=iters)


def _dense_attention(q, k, v):
  # q [B, 1, Hq, D], k/v [B, Hkv, N, D] -> [B, 1, Hq, D]
  b, _, hq, d = q.shape
  hkv = k.shape[1]
  rows = q.reshape(b, hkv, hq // hkv, d).astype(jnp.float32) * d**-0.5
  logits = jnp.einsum("bkgd,bknd->bkgn", rows, k.astype(jnp.float32))
  out = jnp.einsum("bkgn,bknd->bkgd", jax.nn.softmax(logits, axis=-1), v.astype(jnp.float32))
  return out.reshape(b, 1, hq, d).astype(q.dtype)


def problem(key, tokens, batch, kv_heads, group, head_dim, page_size, dtype):
  """q, dense k/v [B, Hkv, N, D], the same values in shuffled pages, table and lengths."""
  m = -(-tokens // page_size)
  kq, kk, kv, kp = jax.random.split(key, 4)
  shape = (batch, kv_heads, m * page_size, head_dim)
  k = jax.random.normal(kk, shape, dtype)
  v = jax.random.normal(kv, shape, dtype)
  q = jax.random.normal(kq, (batch, 1, kv_heads * group, head_dim), dtype)
  pages = batch * kv_heads * m
  order = jax.random.permutation(kp, pages) + 1  # page 0 stays unused
  table = order.reshape(batch, kv_heads, m).astype(jnp.int32)

  def paged(x):
    flat = x.reshape(pages, page_size, head_dim)
    pool = jnp.zeros((pages + 1, page_size, head_dim), dtype)
    return pool.at[order].set(flat)

  lengths = jnp.full((batch, kv_heads), tokens, jnp.int32)
  return q, k[:, :, :tokens], v[:, :, :tokens], paged(k), paged(v), table, lengths


def run(args) -> dict:
  backend = jax.default_backend()
  device = jax.devices()[0]
  kind = getattr(device, "device_kind", backend)
  dtype = jnp.dtype(args.dtype)
  stream = streaming_read(args.stream_mib << 20, args.iters)
  rows = []
  for tokens in args.tokens:
    q, k, v, kp, vp, table, lengths = problem(
        jax.random.key(tokens), tokens, args.batch, args.kv_heads, args.group, args.head_dim,
        args.page_size, dtype,
    )  # fmt: skip
    extra = q.size * dtype.itemsize + table.size * 4 + lengths.size * 4
    cases = [
        ("dense", args.dtype, jax.jit(_dense_attention), (q, k, v), 2 * k.size * dtype.itemsize)
    ]
    kp8, vp8 = page_format.encode(kp, "int8"), page_format.encode(vp, "int8")
    live = lambda pool: page_format.nbytes(pool) * tokens // (pool.shape[0] * pool.shape[1])  # noqa: E731
    impls = [("paged", "auto")]
    if backend in ("gpu", "tpu"):
      impls.append(("paged kernel", "pallas"))
    for name, impl in impls:
      for pages, label in (((kp, vp), args.dtype), ((kp8, vp8), "int8")):
        fn = jax.jit(
            functools.partial(paged_attention, impl=impl, return_probs=False)
        )  # (out, None)
        nbytes = (
            live(pages[0]) * args.batch * args.kv_heads
            + live(pages[1]) * args.batch * args.kv_heads
        )
        cases.append((name, label, fn, (q, *pages, table, lengths), nbytes))
    for name, label, fn, fn_args, kv_bytes in cases:
      try:
        seconds = median_seconds(fn, *fn_args, iters=args.iters)
      except Exception as e:  # noqa: BLE001  a kernel that does not lower here is a row, not a crash
        rows.append(
            dict(tokens=tokens, case=name, pages=label, error=f"{type(e).__name__}: {e}"[:200])
        )
        continue
      nbytes = kv_bytes + extra
      rows.append(
          dict(
              tokens=tokens, case=name, pages=label, seconds=seconds, bytes=nbytes,
              bandwidth=nbytes / seconds, share=nbytes / seconds / stream,
          )  # fmt: skip
      )
  return dict(
      backend=backend, device=kind, jax=jax.__version__, stream_bandwidth=stream,
      nominal_bandwidth=NOMINAL_BANDWIDTH.get(kind), rows=rows,
      shape=dict(batch=args.batch, kv_heads=args.kv_heads, group=args.group,
                 head_dim=args.head_dim, page_size=args.page_size, dtype=args.dtype),
  )  # fmt: skip


def report(result) -> str:
  """The result as markdown."""
  lines = []
  nominal = result["nominal_bandwidth"]
  s = result["shape"]
  lines.append(
      f"Device {result['device']} ({result['backend']}, jax {result['jax']}): streaming read "
      f"{result['stream_bandwidth'] / 1e9:.1f} GB/s measured"
      + (f", {nominal / 1e9:.0f} GB/s nominal" if nominal else "")
      + f". Batch {s['batch']}, {s['kv_heads']} kv heads x {s['group']} query heads each, "
      f"head_dim {s['head_dim']}, pages of {s['page_size']} tokens.\n"
  )
  import io
  import contextlib

  table = io.StringIO()
  with contextlib.redirect_stdout(table):
    print_table(
        ["tokens", "case", "pages", "ms", "MB read", "GB/s", "share of the streaming read"]
        + (["share of nominal"] if nominal else []),
        [
            [r["tokens"], r["case"], r["pages"], "-", "-", "-", r["error"]]
            + (["-"] if nominal else [])
            if "error" in r
            else [
                r["tokens"], r["case"], r["pages"], f"{1e3 * r['seconds']:.3f}",
                f"{r['bytes'] / 1e6:.1f}", f"{r['bandwidth'] / 1e9:.1f}", f"{r['share']:.2f}",
            ]  # fmt: skip
            + ([f"{r['bandwidth'] / nominal:.2f}"] if nominal else [])
            for r in result["rows"]
        ],
        numeric_from=3,
    )
  lines.append(table.getvalue())
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--kv-heads", type=int, default=8)
  parser.add_argument("--group", type=int, default=4, help="query heads per kv head")
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--page-size", type=int, default=16)
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--stream-mib", type=int, default=1024, help="streaming read's array")
  parser.add_argument("--json", help="also write the result to this file")
  args = parser.parse_args(argv)
  for name in ("batch", "kv_heads", "group", "head_dim", "page_size", "iters", "stream_mib"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be at least 1")
  if any(t < 1 for t in args.tokens):
    parser.error("--tokens must be positive")
  result = run(args)
  print(report(result))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
  return result


if __name__ == "__main__":
  main()
