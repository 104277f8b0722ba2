"""KV memory of every policy on a long prompt: peak within budget + one page + one chunk?

    python -m benchmarks.policy_memory [--prompt-tokens 2048] [--budget 0.25]

Runs `kvjax.generate` on the default model with a prompt of real text (jargon-text, or
`--text FILE`) for every policy at the budget, then the budget variants (pyramid per-layer,
per-head) beside a uniform budget equal to the pyramid's largest layer budget: the memory a
masked cache, sized for its largest layer, would hold. Prints peak and final KV bytes and
pages, and whether each peak is within the bound.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

if not __package__:  # `python benchmarks/NAME.py`: import from the repository root, as -m does
  sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import kvjax
from benchmarks._common import read_text
from kvjax.eval import default_text
from kvjax.policies import POLICIES


def main(argv=None):
  import models

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--prompt-tokens", type=int, default=2048)
  parser.add_argument("--budget", type=float, default=0.25)
  parser.add_argument("--prefill-chunk", type=int, default=256)
  parser.add_argument("--max-new-tokens", type=int, default=8)
  parser.add_argument("--text", default=None)
  args = parser.parse_args(argv)
  model, tokenizer = models.load_llama()
  c = model.config
  text = default_text() if args.text is None else read_text(args.text)
  ids = tokenizer.encode(text)[: args.prompt_tokens]
  budget = int(args.budget * len(ids))
  page = 16
  token_bytes = 2 * c.head_dim * 4
  sequences = c.n_layers * c.n_kv_heads

  def bound(b):  # each sequence at its peak under eviction, in whole pages: its budget, the
    # margin its cache evicts at (the default threshold) and one chunk appended before that
    room = -(-(2 * b + args.prefill_chunk + page) // page) * page  # capacity past the peak
    config = kvjax.CacheConfig(page_size=page, max_tokens=room, budget=b, group_size=1)
    return sequences * config.pages_per_sequence(args.prefill_chunk) * page * token_bytes

  def report(label, variant, options, budget_for_bound):
    kwargs = {} if label == "full" else {"budget": options.pop("budget", budget)}
    spec = kvjax.CompressionSpec(
        policy=label, prefill_chunk=args.prefill_chunk, page_size=page, **kwargs, **options
    )
    stats = kvjax.generate(model, tokenizer, [ids], spec, max_new_tokens=args.max_new_tokens).stats
    limit = None if stats["layer_budgets"] is None else bound(budget_for_bound(stats))
    within = "-" if limit is None else ("yes" if stats["peak_kv_bytes"] <= limit else "NO")
    print(
        f"| {label} | {variant} | {stats['peak_kv_bytes'] / 2**20:.2f} | "
        f"{'-' if limit is None else f'{limit / 2**20:.2f}'} | {within} | "
        f"{stats['final_kv_bytes'] / 2**20:.2f} | {stats['final_kv_bytes'] // (page * token_bytes)} |"
    )
    return stats

  print(
      f"prompt {len(ids)} tokens, budget {budget} tokens/sequence "
      f"({args.budget:.0%}), chunk {args.prefill_chunk}, {sequences} sequences"
  )
  print("| policy | variant | peak KV MiB | bound MiB | within | final KV MiB | final pages |")
  print("|---|---|---:|---:|---|---:|---:|")
  for name in POLICIES:
    report(name, "uniform", {}, lambda stats: budget)
  widest = lambda stats: max(stats["layer_budgets"])  # noqa: E731
  pyramid = report("h2o", "budget_schedule=pyramid", {"budget_schedule": "pyramid"}, widest)
  top = widest(pyramid)
  report("h2o", f"uniform at the pyramid's largest layer budget ({top})", {"budget": top}, widest)
  report("h2o", "head_budget=layer", {"head_budget": "layer"}, lambda stats: budget)


if __name__ == "__main__":
  main()
