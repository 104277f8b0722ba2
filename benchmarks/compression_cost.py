"""What compressing a context costs and returns: prefill time against a plain prefill, the
pool and live KV bytes against the full cache, and the kept tokens per layer-head.

    python -m benchmarks.compression_cost [--policy kvzip learned] [--budgets 0.25 0.125]

One process, default model, a context of the shipped text; the median of `--repeats` timed
prefills after a warm-up, the configurations taking turns (A B C A B C) so that machine noise
falls on all of them alike.
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
from benchmarks._common import print_table
from kvjax.eval import default_text


def main(argv=None):
  import models

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--policy", nargs="+", default=["kvzip", "learned"])
  parser.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.125])
  parser.add_argument("--context", type=int, default=2048, help="context tokens")
  parser.add_argument("--reserve", type=int, default=64, help="room kept for more tokens")
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args(argv)
  model, tokenizer = models.load_llama()
  ids = tokenizer.encode(default_text())[10000 : 10000 + args.context]
  specs = [("full", kvjax.CompressionSpec())] + [
      (f"{policy} {b:g}", kvjax.CompressionSpec(policy, budget=b))
      for policy in args.policy
      for b in args.budgets
  ]
  times = {name: [] for name, _ in specs}
  states = {}
  for i in range(args.repeats + 1):  # the first round compiles
    for name, spec in specs:
      start = time.perf_counter()
      state = kvjax.prefill(model, [ids], spec, tokenizer=tokenizer, reserve=args.reserve)
      jax.block_until_ready(state.logits)
      if i:
        times[name].append(time.perf_counter() - start)
      states[name] = state
  rows = []
  for name, _ in specs:
    state = states[name]
    cache = state.cache
    lengths = cache.length.reshape(-1)
    rows.append(
        (name, statistics.median(times[name]), cache.num_pages * cache.page_bytes,
         cache.kv_bytes(), state.peak_kv_bytes(), int(lengths.min()), int(lengths.max()))
    )  # fmt: skip
  plain, full_pool = rows[0][1], rows[0][2]
  print(f"backend={jax.default_backend()} context {len(ids)} tokens, reserve {args.reserve}")
  mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
  print_table(
      ["cache", "prefill s", "x plain prefill", "pool MiB", "live KV MiB", "pool / full",
       "peak MiB", "kept per layer-head"],
      [(n, f"{t:.2f}", f"{t / plain:.2f}", mib(p), mib(live), f"{p / full_pool:.2f}", mib(peak),
        f"{lo}..{hi}") for n, t, p, live, peak, lo, hi in rows],
  )  # fmt: skip


if __name__ == "__main__":
  main()
