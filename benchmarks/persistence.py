"""Compress once, ask many: a saved compressed state against prefilling the context again,
and the weight cache's first and later model loads.

    python -m benchmarks.persistence [--context-tokens 8000] [--policy kvzip]
        [--budget 0.25] [--repeats 3] [--max-new-tokens 24]

Part 1 (one process, the default model): a context of real text (the shipped text) with
a fact in its middle is prefilled and compressed (`context_prompt`), saved with
`kvjax.save_state`, and then a question is answered, alternately (A B A B, medians):
  A: prefill and compress the context again, then answer;
  B: `kvjax.load_state` the saved state, then answer.
Both answers must be the same text. C, for reference: the same context prefilled into the
full cache (nothing compressed, nothing saved), then answered. Reported: KV bytes of the full cache for the context,
of the compressed state, and the state's bytes on disk; seconds of each step; B's speed-up.

Part 2 (fresh processes): loading the default model with an empty kvjax cache directory
(converts the GGUF and stores the weights) and again (reads the stored weights); each
pair gets a new directory. Prints markdown.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

if not __package__:  # `python benchmarks/NAME.py`: import from the repository root, as -m does
  sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

FACT = " The vault code is 48213. "
QUESTION = "What is the vault code?"

_LOAD = """
import time
start = time.perf_counter()
import jax
from models import load_llama
imported = time.perf_counter()
model, tokenizer = load_llama()
jax.block_until_ready(model.embed[...])
print(imported - start, time.perf_counter() - imported)
"""


def _context_ids(tokenizer, tokens: int) -> list[int]:
  from kvjax.eval import default_text

  ids = tokenizer.encode(default_text())[:tokens]
  fact = tokenizer.encode(FACT)
  middle = (tokens - len(fact)) // 2
  return ids[:middle] + fact + ids[middle : tokens - len(fact)]


def compress_once_ask_many(args) -> list[str]:
  import jax

  import kvjax
  from kvjax.eval import answer_from_state, context_prompt
  from models import load_llama

  model, tokenizer = load_llama()
  spec = kvjax.CompressionSpec(policy=args.policy, budget=args.budget)
  prompt = context_prompt(tokenizer, _context_ids(tokenizer, args.context_tokens))
  directory = pathlib.Path(tempfile.mkdtemp(prefix="kvjax-state-"))
  path = directory / "state"

  def prefill():
    return kvjax.prefill(
        model, [prompt], spec, tokenizer=tokenizer, reserve=64 + args.max_new_tokens
    )

  def prefill_full():
    return kvjax.prefill(
        model,
        [prompt],
        kvjax.CompressionSpec(),
        tokenizer=tokenizer,
        reserve=64 + args.max_new_tokens,
    )

  def answer(state):
    return answer_from_state(model, tokenizer, state, QUESTION, max_new_tokens=args.max_new_tokens)

  state = prefill()  # compiles every step once
  start = time.perf_counter()
  kvjax.save_state(path, state, model, tokenizer=tokenizer)
  save_seconds = time.perf_counter() - start
  expected = answer(state)
  answer(kvjax.load_state(path, model, tokenizer=tokenizer))  # the loaded shapes, compiled
  answer(prefill_full())
  times = {k: [] for k in ("prefill", "load", "answer_a", "answer_b", "full", "answer_c")}
  for _ in range(args.repeats):
    start = time.perf_counter()
    state = jax.block_until_ready(prefill())
    times["prefill"].append(time.perf_counter() - start)
    start = time.perf_counter()
    text_a = answer(state)
    times["answer_a"].append(time.perf_counter() - start)
    start = time.perf_counter()
    loaded = jax.block_until_ready(kvjax.load_state(path, model, tokenizer=tokenizer))
    times["load"].append(time.perf_counter() - start)
    start = time.perf_counter()
    text_b = answer(loaded)
    times["answer_b"].append(time.perf_counter() - start)
    start = time.perf_counter()
    full = jax.block_until_ready(prefill_full())
    times["full"].append(time.perf_counter() - start)
    start = time.perf_counter()
    answer(full)
    times["answer_c"].append(time.perf_counter() - start)
    del full
    if not text_a == text_b == expected:
      raise AssertionError(f"answers differ: {text_a!r} / {text_b!r} / {expected!r}")
  med = {k: statistics.median(v) for k, v in times.items()}
  cache = state.cache
  tokens = len([t for segment in prompt for t in segment.text])
  per_token = cache.token_bytes
  disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
  shutil.rmtree(directory)
  again = med["prefill"] + med["answer_a"]
  kept = med["load"] + med["answer_b"]
  mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
  return [
      f"Context of {tokens} tokens (the shipped text, a fact in the middle), {args.policy} at "
      f"budget {args.budget}; question {QUESTION!r}, answer {expected!r} both ways; medians of "
      f"{args.repeats}, A B C A B C in one process.",
      "",
      "| | value |",
      "|---|---:|",
      f"| full cache KV for the context | {mib(tokens * per_token)} |",
      f"| compressed state KV | {mib(state.kv_bytes())} ({state.kv_bytes() / (tokens * per_token):.1%}) |",
      f"| saved state on disk | {mib(disk)} ({disk / (tokens * per_token):.1%} of the full KV) |",
      f"| save_state | {save_seconds:.2f} s |",
      f"| A: prefill + compress the context | {med['prefill']:.2f} s |",
      f"| A: answer | {med['answer_a']:.2f} s |",
      f"| B: load_state | {med['load']:.2f} s |",
      f"| B: answer | {med['answer_b']:.2f} s |",
      f"| **A total / B total** | **{again:.2f} s / {kept:.2f} s = {again / kept:.1f}x** |",
      f"| C: full-cache prefill + answer (reference) | {med['full']:.2f} s + "
      f"{med['answer_c']:.2f} s = {med['full'] + med['answer_c']:.2f} s |",
      f"| C total / B total | {(med['full'] + med['answer_c']) / kept:.1f}x |",
  ]


def weight_loads(repeats: int) -> list[str]:
  runs = {"first": [], "later": []}
  for _ in range(repeats):
    root = tempfile.mkdtemp(prefix="kvjax-weights-")
    env = {**os.environ, "KVJAX_CACHE_DIR": root}
    for bucket in runs.values():
      out = subprocess.run(
          [sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True, check=True
      )
      bucket.append([float(x) for x in out.stdout.split()[-2:]])
    shutil.rmtree(root)
  med = {k: [statistics.median(x[i] for x in v) for i in (0, 1)] for k, v in runs.items()}
  (imp_a, load_a), (imp_b, load_b) = med["first"], med["later"]
  return [
      f"Default model load in a fresh process, medians of {repeats} pairs (each pair with an "
      "empty cache directory):",
      "",
      "| | imports | `load_llama()` | total |",
      "|---|---:|---:|---:|",
      f"| first load (GGUF converted, weights stored) | {imp_a:.2f} s | {load_a:.2f} s | "
      f"{imp_a + load_a:.2f} s |",
      f"| later load (stored weights read) | {imp_b:.2f} s | {load_b:.2f} s | "
      f"{imp_b + load_b:.2f} s |",
      f"| first / later | | {load_a / load_b:.1f}x | {(imp_a + load_a) / (imp_b + load_b):.1f}x |",
  ]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--context-tokens", type=int, default=8000)
  parser.add_argument("--policy", default="kvzip")
  parser.add_argument("--budget", type=float, default=0.25)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--max-new-tokens", type=int, default=24)
  parser.add_argument("--part", choices=("all", "state", "weights"), default="all")
  args = parser.parse_args(argv)
  lines = []
  if args.part in ("all", "state"):
    lines += compress_once_ask_many(args) + [""]
  if args.part in ("all", "weights"):
    lines += weight_loads(args.repeats)
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
