"""Full-cache prefill and decode with attention over the live pages vs the whole page table.

    python -m benchmarks.live_pages --path live|whole-table [--lengths 512 2048]

One path per process (run them alternately, A B A B): "whole-table" patches the reference
(`paged_attention_reference` + its lse) in where kvjax takes `paged_attention_live_blocks`
(prefill chunks; decode steps read the live prefix of the table on both paths).
Prints, per prompt length, prefill tokens/s and decode ms/token (medians after a warm-up).
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

import pallas_kernels.paged_attention as attention


def _whole_table(q, k_pages, v_pages, table, lengths, num_queries=None, *, scale=None, **_):
  out, _ = attention.paged_attention_reference(
      q, k_pages, v_pages, table, lengths, num_queries, scale=scale
  )
  lse = attention.paged_attention_lse_reference(
      q, k_pages, table, lengths, num_queries, scale=scale
  )
  return out, lse


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--path", choices=("live", "whole-table"), required=True)
  parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--decode-steps", type=int, default=16)
  args = parser.parse_args(argv)
  if args.path == "whole-table":
    attention.paged_attention_live_blocks = _whole_table
  import kvjax
  from kvjax.eval import default_text
  from models import load_llama

  model, tok = load_llama()
  ids = tok.encode(default_text())
  for n in args.lengths:
    prefill, decode = [], []
    for _ in range(args.repeats + 1):  # the first compiles
      start = time.perf_counter()
      state = kvjax.prefill(model, [ids[:n]], reserve=args.decode_steps)
      jax.block_until_ready(state.logits)
      prefill.append(time.perf_counter() - start)
      _, result = kvjax.decode(model, state, args.decode_steps)
      decode.append(result.stats["decode_seconds"] / args.decode_steps)
    print(
        f"{args.path} {n} tokens: prefill {n / statistics.median(prefill[1:]):.0f} tok/s, "
        f"decode {1e3 * statistics.median(decode[1:]):.1f} ms/token",
        flush=True,
    )


if __name__ == "__main__":
  main()
