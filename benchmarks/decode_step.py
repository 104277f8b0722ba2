"""Decode-step cost of every policy against the full cache, and eviction's share of it.

    python -m benchmarks.decode_step [--context 8192] [--budget 1024] [--steps 32]

On the default model, prefills `--context` less the decode steps (`--steps`, or the steps to
the first eviction event when more) tokens of text (so that the context and the decode
steps fit the model's window) under each policy at `--budget` tokens per
sequence, then times `--steps` greedy decode steps (`kvjax.eval.decode_cost`): median
decode ms/token, its ratio to the full cache, and eviction's share of a step, amortised over
the steps (timed against the same loop with eviction off, in the same run). The window
starts with the cache at its budget, so it sees fewer events than a long run does; the
steady-state share puts the cost of one event (the step that evicts, run with and without
eviction from the same state, medians) over the period between events (the eviction margin
plus one token, in whole groups: a sixteenth of the budget, at least a page;
`kvjax.CacheConfig.margin`). Prints a markdown table. The issue's
goal: eviction under 5% of step time.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

if not __package__:  # `python benchmarks/NAME.py`: import from the repository root, as -m does
  sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import jax

from kvjax import CacheConfig, CompressionSpec
from kvjax.eval import DEFAULT_TEXT_SOURCE, decode_cost, default_text
from kvjax.policies import POLICIES

GOAL = 0.05  # eviction's share of a decode step


def _margin(page_size: int, budget: int) -> int:
  """Tokens a sequence passes its budget by before eviction runs (`CacheConfig.margin`, the
  default threshold's: a sixteenth of the budget in whole pages, at least one page)."""
  room = -(-(2 * budget + page_size) // page_size) * page_size  # any capacity past threshold
  return CacheConfig(page_size=page_size, max_tokens=room, budget=budget, group_size=1).margin


def main(argv=None):
  import models

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--context", type=int, default=8192, help="context + decode positions")
  parser.add_argument("--budget", type=int, default=1024, help="KV tokens per sequence")
  parser.add_argument("--steps", type=int, default=32, help="decode steps per timed loop")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--policies", nargs="+", default=None, help="default: all (full always)")
  parser.add_argument("--attention-impl", default="auto", choices=("auto", "pallas", "ref"))
  args = parser.parse_args(argv)
  names = [
      "full",
      *(n for n in POLICIES if n != "full" and (not args.policies or n in args.policies)),
  ]
  unknown = set(args.policies or ()) - set(POLICIES)
  if unknown:
    parser.error(f"unknown policies {sorted(unknown)}; known: {', '.join(POLICIES)}")

  model, tokenizer = models.load_llama()
  # Room after the context for the timed steps, and for the steps to the first event
  # (`decode_cost` looks that far for one): the margin plus a page.
  page = CompressionSpec().page_size
  room = max(args.steps, _margin(page, args.budget) + page + 1)
  ids, source = tokenizer.encode(default_text())[: args.context - room - 1], DEFAULT_TEXT_SOURCE
  print(
      f"backend={jax.default_backend()} jax={jax.__version__} model=smollm2-135m-instruct f32; "
      f"context {len(ids)} tokens ({source}) + {args.steps} decode steps, budget {args.budget} "
      f"tokens/sequence, median of {args.repeats}"
  )
  rows = []
  for name in names:
    budget = None if name == "full" else args.budget
    spec = CompressionSpec(policy=name, budget=budget, attention_impl=args.attention_impl)
    rows.append(decode_cost(model, ids, spec, decode_steps=args.steps, repeats=args.repeats))
  full_ms = rows[0]["decode_ms_per_token"]
  print(
      "| policy | decode ms/token | / full | eviction ms/token | eviction share | "
      f"evictions in {args.steps} steps | ms/eviction | steady-state share | < {GOAL:.0%} | "
      "KV MiB held (peak) | prefill s |"
  )
  print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
  for r in rows:
    evicts, share, events = r["policy"] != "full", r["eviction_share"], r["eviction_events"]
    raw = f"{r['eviction_ms_per_token']:+.2f}" if evicts else "-"
    per_event, steady = r["eviction_ms_per_event"], r["eviction_share_steady"]
    per_event = None if per_event is None else max(per_event, 0.0)
    judged = share if steady is None else steady
    goal = ("yes" if judged < GOAL else "NO") if evicts else "-"
    print(
        f"| {r['policy']} | {r['decode_ms_per_token']:.1f} | "
        f"{r['decode_ms_per_token'] / full_ms:.2f} | {raw} | {share:.1%} | "
        f"{events if evicts else '-'} | {'-' if per_event is None else f'{per_event:.0f}'} | "
        f"{'-' if steady is None else f'{steady:.1%}'} | {goal} | "
        f"{r['kv_bytes_final'] / 2**20:.1f} ({r['kv_bytes_peak'] / 2**20:.1f}) | "
        f"{r['prefill_seconds']:.1f} |"
    )


if __name__ == "__main__":
  main()
