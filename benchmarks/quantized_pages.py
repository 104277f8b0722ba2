"""Prefill and decode with quantized K/V pages against float32 pages, full cache, one run.

    python -m benchmarks.quantized_pages [--context 8000] [--steps 32] [--repeats 5]

On the default model, prefills `--context` tokens of the shipped text into a full cache
stored as each of `--kv-dtypes`, then decodes `--steps` greedy tokens from that state. After
one warm-up of each (compilation), the dtypes take turns, `--repeats` rounds (A B C A B C
...), so that drift on a noisy machine hits them alike: the medians of prefill seconds and
decode ms/token, their ratios to float32 in the same run, and the K/V bytes each holds
(scales included). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

if not __package__:  # `python benchmarks/NAME.py`: import from the repository root, as -m does
  sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import jax

import kvjax
from kvjax.eval import default_text
from pallas_kernels.page_format import KV_DTYPES

DTYPES = ("float32", "int8", "int4")


def _time_prefill(model, ids, spec, steps):
  start = time.perf_counter()
  state = kvjax.prefill(model, [ids], spec, reserve=steps)
  jax.block_until_ready(state.logits)
  return state, time.perf_counter() - start


def _time_decode(model, state, steps):
  start = time.perf_counter()
  _, result = kvjax.decode(model, kvjax.fork(state), steps)
  return (time.perf_counter() - start) * 1000 / steps, result.tokens[0]


def main(argv=None):
  import models

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--context", type=int, default=8000, help="context tokens")
  parser.add_argument("--steps", type=int, default=32, help="decode steps per timed loop")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--kv-dtypes", nargs="+", default=list(DTYPES), choices=KV_DTYPES)
  args = parser.parse_args(argv)
  dtypes = ["float32", *(d for d in args.kv_dtypes if d != "float32")]

  model, tokenizer = models.load_llama()
  ids = tokenizer.encode(default_text())[: args.context]
  specs = {d: kvjax.CompressionSpec(kv_dtype=d) for d in dtypes}
  states, tokens = {}, {}
  for d, spec in specs.items():  # warm-up: compiles every step once
    states[d], _ = _time_prefill(model, ids, spec, args.steps)
    _, tokens[d] = _time_decode(model, states[d], args.steps)
  prefill_s = {d: [] for d in dtypes}
  decode_ms = {d: [] for d in dtypes}
  for _ in range(args.repeats):
    for d in dtypes:
      states[d], seconds = _time_prefill(model, ids, specs[d], args.steps)
      prefill_s[d].append(seconds)
      decode_ms[d].append(_time_decode(model, states[d], args.steps)[0])
  print(
      f"backend={jax.default_backend()} jax={jax.__version__} model=smollm2-135m-instruct f32; "
      f"context {len(ids)} tokens, full cache, {args.steps} decode steps, medians of "
      f"{args.repeats} interleaved rounds"
  )
  print(
      "| K/V dtype | prefill s | / float32 | decode ms/token | / float32 | K/V MiB held | "
      "/ float32 | greedy tokens = float32's |"
  )
  print("|---|---:|---:|---:|---:|---:|---:|---|")
  med = lambda xs: statistics.median(xs)  # noqa: E731
  for d in dtypes:
    held = states[d].kv_bytes()
    print(
        f"| {d} | {med(prefill_s[d]):.2f} | {med(prefill_s[d]) / med(prefill_s['float32']):.3f} | "
        f"{med(decode_ms[d]):.1f} | {med(decode_ms[d]) / med(decode_ms['float32']):.3f} | "
        f"{held / 2**20:.1f} | {held / states['float32'].kv_bytes():.3f} | "
        f"{sum(a == b for a, b in zip(tokens[d], tokens['float32']))}/{args.steps} |"
    )


if __name__ == "__main__":
  main()
