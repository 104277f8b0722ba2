"""Do states compressed once decode at their size? Decode ms/token of each, against the
full cache over the same context and over a context of as many tokens as they keep.

    python -m benchmarks.compressed_decode [--context 8192] [--keep 0.25]
        [--policies kvzip learned expected_attention] [--steps 32] [--rounds 5]

On the default model, prefills one state per row of the table: the full cache over
`--context` tokens of text (less the decode steps), each policy compressing that context
once to `--keep` of its tokens, the full cache over a context of as many tokens as they
keep ("at their size") and over 128 tokens (what a step costs with next to no attention:
the floor). Then `--rounds` rounds, each decoding `--steps` greedy tokens from a fork of
every state (the order reversed every other round, so drift hits all alike), after a
warm-up round. Prints a markdown table: median ms/token, the median over rounds of each
round's ratio to the full cache and to the full cache at their size, the KV tokens a
sequence holds (mean) and the KV MiB held.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

if not __package__:  # `python benchmarks/NAME.py`: import from the repository root, as -m does
  sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import jax
import numpy as np

from kvjax import CompressionSpec, decode, fork, prefill
from kvjax.eval import DEFAULT_TEXT_SOURCE, default_text
from kvjax.policies import POLICIES

FLOOR_TOKENS = 128


def main(argv=None):
  import models

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--context", type=int, default=8192, help="context + decode positions")
  parser.add_argument("--keep", type=float, default=0.25, help="share of the context kept")
  parser.add_argument("--policies", nargs="+", default=["kvzip", "learned", "expected_attention"])
  parser.add_argument("--steps", type=int, default=32, help="decode steps per timed run")
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args(argv)
  for name in args.policies:
    if name not in POLICIES or not CompressionSpec(policy=name, budget=64).once:
      once = [n for n in POLICIES if n != "full" and CompressionSpec(policy=n, budget=64).once]
      parser.error(f"--policies: {name!r} does not compress once; those that do: {once}")
  if not 0 < args.keep < 1:
    parser.error(f"--keep must be in (0, 1), got {args.keep}")

  model, tokenizer = models.load_llama()
  ids = tokenizer.encode(default_text())[: args.context - args.steps - 1]
  kept = round(len(ids) * args.keep)
  print(
      f"backend={jax.default_backend()} jax={jax.__version__} model=smollm2-135m-instruct f32; "
      f"context {len(ids)} tokens ({DEFAULT_TEXT_SOURCE}), {args.keep:.0%} kept ({kept} "
      f"tokens per sequence), {args.steps} decode steps, median of {args.rounds} rounds"
  )
  rows = {"full": prefill(model, [ids], CompressionSpec(), reserve=args.steps)}
  for name in args.policies:
    spec = CompressionSpec(policy=name, budget=kept)
    rows[name] = prefill(model, [ids], spec, reserve=args.steps)
  rows[f"full, {kept}-token context"] = prefill(
      model, [ids[:kept]], CompressionSpec(), reserve=args.steps
  )
  rows[f"full, {FLOOR_TOKENS}-token context"] = prefill(
      model, [ids[:FLOOR_TOKENS]], CompressionSpec(), reserve=args.steps
  )
  at_size = f"full, {kept}-token context"

  times = {name: [] for name in rows}
  for round_ in range(args.rounds + 1):  # round 0 compiles and warms up
    for name in list(rows)[:: 1 if round_ % 2 else -1]:
      _, result = decode(model, fork(rows[name]), args.steps, donate=True)
      if result.stats["generated_tokens"][0] != args.steps:
        raise RuntimeError(f"{name}: decode stopped early")
      if round_:
        times[name].append(1e3 * result.stats["decode_seconds"] / args.steps)

  def ratio(name, base):
    return statistics.median(a / b for a, b in zip(times[name], times[base]))

  print(
      "| state | decode ms/token | / full | / full at their size | KV tokens per sequence "
      "(mean) | KV MiB |"
  )
  print("|---|---:|---:|---:|---:|---:|")
  for name, state in rows.items():
    held = np.asarray(state.cache.length).mean()
    print(
        f"| {name} | {statistics.median(times[name]):.1f} | {ratio(name, 'full'):.2f} | "
        f"{ratio(name, at_size):.2f} | {held:.0f} | {state.kv_bytes() / 2**20:.1f} |"
    )


if __name__ == "__main__":
  main()
