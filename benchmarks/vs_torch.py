"""kvjax against transformers (PyTorch) on the same model and token ids, in one run.

    python -m benchmarks.vs_torch [--model NAME] [--lengths 512 2048 8000] [--repeats 3]

Loads the model (default: the default model) twice from its GGUF: kvjax (Flax NNX, float32) and transformers'
`AutoModelForCausalLM` (float32, sdpa attention; from the test extras). For each prompt
length, A B A B over `--repeats` rounds: prefill tokens/s (one prompt of real text) and
greedy decode ms/token over `--decode-steps` steps, for kvjax's full cache, kvjax with
`--policy` at `--budget` and transformers; medians, and kvjax's full-cache speed over
transformers' (above 1: kvjax is faster). Then the request sequence: six prompts of different lengths, `--new-tokens` each,
first pass (kvjax compiles what its shape buckets need) and again. Prints markdown.

    python -m benchmarks.vs_torch --part sequence --cold

runs only the request sequence, with JAX's persistent compilation cache in an empty
temporary directory: the first pass then compiles everything (a new machine); without
`--cold` a fresh process loads what an earlier run stored there. With `--part all` the
sequence runs first (before anything else compiles).

    python -m benchmarks.vs_torch --part first-requests

a new user's first minutes, in one run: a fresh process with an empty cache directory runs
the sequence (first pass, again) and then the 2048-token prefill and decode rounds; a
second fresh process runs the sequence once more with the directory the first one left
(what every later process of that user sees). One table of kvjax's time against
transformers'.

When `llama-cpp-python` is installed (it is no kvjax dependency: `pip install
llama-cpp-python` builds llama.cpp from source), the table gains llama.cpp as an anchor:
the same GGUF converted once to float32 by llama.cpp's own quantize call (so that all three
run float32 weights), the torch peer's thread count, 512-token batches, timed in the same rounds.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

if not __package__:  # `python benchmarks/NAME.py`: import from the repository root, as -m does
  sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import jax
import numpy as np

import kvjax
from benchmarks._peers import (
    kvjax_decode,
    kvjax_prefill,
    load_transformers,
    torch_generate,
    torch_prefill_decode,
)
from kvjax.eval import default_text

SEQUENCE = (480, 650, 820, 990, 1160, 1330)  # the request sequence's prompt lengths


def _llama_cpp(path: pathlib.Path, n_ctx: int, threads: int):
  """llama.cpp on a float32 copy of the GGUF (as many threads as the torch peer), or None
  when llama-cpp-python is missing."""
  try:
    import llama_cpp
  except ImportError:
    return None
  f32 = pathlib.Path(tempfile.gettempdir()) / f"{path.stem}.f32.gguf"
  if not f32.exists():
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
    params.allow_requantize = True
    partial = f32.with_suffix(".partial")
    from llama_cpp._utils import suppress_stdout_stderr  # its per-tensor log

    with suppress_stdout_stderr(disable=False):
      failed = llama_cpp.llama_model_quantize(
          str(path).encode(), str(partial).encode(), ctypes.byref(params)
      )
    if failed:
      raise RuntimeError(f"llama.cpp could not convert {path} to float32")
    partial.replace(f32)
  return llama_cpp.Llama(
      model_path=str(f32),
      n_ctx=n_ctx,
      n_batch=512,
      n_ubatch=512,
      n_threads=threads,
      n_threads_batch=threads,
      verbose=False,
  )


def _llama_cpp_prefill_decode(llm, ids, steps):
  vocab = llm.n_vocab()

  def next_token():
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))

  llm.reset()
  start = time.perf_counter()
  llm.eval(ids)
  token = next_token()
  prefill = time.perf_counter() - start
  start = time.perf_counter()
  for _ in range(steps):
    llm.eval([token])
    token = next_token()
  return prefill, (time.perf_counter() - start) / steps


def main(argv=None):
  import torch
  import transformers

  from models import load_decoder, resolve_model
  from models.registry import DEFAULT_MODEL

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default=DEFAULT_MODEL, help="registry name or .gguf path")
  parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8000])
  parser.add_argument("--repeats", type=int, default=3, help="A B rounds (medians)")
  parser.add_argument("--decode-steps", type=int, default=16)
  parser.add_argument("--policy", default="h2o")
  parser.add_argument("--budget", type=int, default=256)
  parser.add_argument("--new-tokens", type=int, default=8, help="per request of the sequence")
  parser.add_argument(
      "--part", choices=("all", "table", "sequence", "first-requests"), default="all"
  )
  parser.add_argument(
      "--cold", action="store_true", help="empty compilation cache (a temporary KVJAX_CACHE_DIR)"
  )
  parser.add_argument("--cache-dir", help="kvjax's cache directory for this run (KVJAX_CACHE_DIR)")
  parser.add_argument("--passes", type=int, default=2, help="of the request sequence (1: first)")
  parser.add_argument("--json", help="also write the measurements to this file")
  args = parser.parse_args(argv)
  if args.part == "first-requests":
    return _first_requests(args)
  if args.cold:
    os.environ["KVJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvjax-cold-")
  elif args.cache_dir:
    os.environ["KVJAX_CACHE_DIR"] = args.cache_dir
  path = resolve_model(args.model).path
  model, tok = load_decoder(args.model)
  ref = load_transformers(path)
  ids = tok.encode(default_text())
  anchor = None
  if args.part != "sequence":
    anchor = _llama_cpp(path, max(args.lengths) + args.decode_steps + 8, torch.get_num_threads())
  print(
      f"# {args.model}: kvjax vs transformers {transformers.__version__} (torch {torch.__version__}, "
      f"{torch.get_num_threads()} threads), jax {jax.__version__} on {jax.default_backend()}, "
      f"{platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d')}\n"
  )
  measured = {}
  # The sequence first: in a fresh process nothing else has compiled its steps yet.
  if args.part != "table":
    measured["sequence"] = _sequence(args, model, tok, ref, ids)
  if args.part != "sequence":
    measured["table"] = _table(args, model, ref, ids, anchor)
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(measured, indent=1))


def _first_requests(args):
  """Two fresh processes over one new cache directory (see the module docstring)."""
  directory = tempfile.mkdtemp(prefix="kvjax-first-")
  common = [sys.executable, str(pathlib.Path(__file__).resolve()), "--cache-dir", directory]
  common += ["--model", args.model]
  runs = {}
  for name, extra in (
      ("empty", ["--part", "all", "--lengths", "2048", "--repeats", str(args.repeats)]),
      ("warm", ["--part", "sequence", "--passes", "1"]),
  ):
    out = pathlib.Path(directory) / f"{name}.json"
    command = common + extra + ["--json", str(out), "--decode-steps", str(args.decode_steps)]
    subprocess.run(command, check=True, stdout=sys.stderr)  # their own tables, for the log
    runs[name] = json.loads(out.read_text())
  first, again = runs["empty"]["sequence"]
  (warm,) = runs["warm"]["sequence"]
  (row,) = runs["empty"]["table"]
  print(
      "| | kvjax | transformers | kvjax time / transformers time |\n|---|---:|---:|---:|\n"
      f"| the sequence's first pass, empty cache directory | {first['kvjax']:.1f} s "
      f"| {first['transformers']:.1f} s | **{first['ratio']:.2f}** |\n"
      f"| the sequence again, same process | {again['kvjax']:.1f} s "
      f"| {again['transformers']:.1f} s | {again['ratio']:.2f} |\n"
      f"| the sequence in a second process (cache directory warm) | {warm['kvjax']:.1f} s "
      f"| {warm['transformers']:.1f} s | {warm['ratio']:.2f} |\n"
      f"| prefill {row['tokens']} tokens (median of {args.repeats}), first process "
      f"| {row['tokens'] / row['prefill_tok_s']['full']:.2f} s "
      f"| {row['tokens'] / row['prefill_tok_s']['transformers']:.2f} s "
      f"| {row['prefill_tok_s']['transformers'] / row['prefill_tok_s']['full']:.2f} |\n"
      f"| decode ms/token after {row['tokens']} tokens, first process "
      f"| {row['decode_ms']['full']:.1f} | {row['decode_ms']['transformers']:.1f} "
      f"| {row['decode_ms']['full'] / row['decode_ms']['transformers']:.2f} |\n\n"
      f"Steps compiled or loaded in the first pass: {first['steps']} ({first['loaded']} "
      f"loaded; {first['compile_seconds']:.1f} s waited), in the second process: "
      f"{warm['steps']} ({warm['loaded']} loaded; {warm['compile_seconds']:.1f} s)."
  )


def _table(args, model, ref, ids, anchor=None):
  full = kvjax.CompressionSpec()
  compressed = kvjax.CompressionSpec(policy=args.policy, budget=args.budget)
  print(
      "| prompt tokens | prefill tok/s kvjax full | kvjax "
      f"{args.policy} {args.budget} | transformers | kvjax full speed / transformers | decode "
      "ms/token kvjax full | kvjax compressed | transformers | kvjax full speed / transformers |"
      + ("" if anchor is None else " llama.cpp f32 prefill tok/s | decode ms/token |")
  )
  print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("" if anchor is None else "---:|---:|"))
  rows = []
  for n in args.lengths:
    prompt = ids[:n]
    for spec in (full, compressed):  # compile outside the timed rounds
      _, state = kvjax_prefill(model, prompt, spec, args.decode_steps)
      kvjax_decode(model, state, args.decode_steps)
    torch_prefill_decode(ref, prompt[:64], 2)
    if anchor is not None:
      _llama_cpp_prefill_decode(anchor, prompt, 2)
    names = ("full_p", "comp_p", "torch_p", "full_d", "comp_d", "torch_d", "cpp_p", "cpp_d")
    times = {k: [] for k in names}
    for _ in range(args.repeats):
      seconds, state = kvjax_prefill(model, prompt, full, args.decode_steps)
      times["full_p"].append(seconds)
      times["full_d"].append(kvjax_decode(model, state, args.decode_steps))
      del state
      prefill, decode = torch_prefill_decode(ref, prompt, args.decode_steps)
      times["torch_p"].append(prefill)
      times["torch_d"].append(decode)
      seconds, state = kvjax_prefill(model, prompt, compressed, args.decode_steps)
      times["comp_p"].append(seconds)
      times["comp_d"].append(kvjax_decode(model, state, args.decode_steps))
      del state
      if anchor is not None:
        prefill, decode = _llama_cpp_prefill_decode(anchor, prompt, args.decode_steps)
        times["cpp_p"].append(prefill)
        times["cpp_d"].append(decode)
    med = {k: statistics.median(v) for k, v in times.items() if v}
    cpp = "" if anchor is None else f" {n / med['cpp_p']:.0f} | {1e3 * med['cpp_d']:.1f} |"
    print(
        f"| {n} | {n / med['full_p']:.0f} | {n / med['comp_p']:.0f} | {n / med['torch_p']:.0f} "
        f"| {med['torch_p'] / med['full_p']:.2f} | {1e3 * med['full_d']:.1f} "
        f"| {1e3 * med['comp_d']:.1f} | {1e3 * med['torch_d']:.1f} "
        f"| {med['torch_d'] / med['full_d']:.2f} |{cpp}",
        flush=True,
    )
    rows.append(
        {
            "tokens": n,
            "prefill_tok_s": {
                "full": n / med["full_p"],
                "compressed": n / med["comp_p"],
                "transformers": n / med["torch_p"],
            },
            "decode_ms": {
                "full": 1e3 * med["full_d"],
                "compressed": 1e3 * med["comp_d"],
                "transformers": 1e3 * med["torch_d"],
            },
        }
    )
  return rows


def _sequence(args, model, tok, ref, ids):
  cache = "empty (--cold)" if args.cold else "as left by earlier runs"
  rows = []
  print(
      f"\nThe request sequence ({', '.join(map(str, SEQUENCE))} tokens, {args.new_tokens} new "
      "tokens each, greedy), seconds in all (fastest-slowest request); JAX's "
      f"persistent compilation cache {cache}:\n"
  )
  print(
      "| pass | kvjax full | kvjax steps compiled or loaded (of them loaded from the store; "
      "seconds) | transformers | kvjax / transformers |"
  )
  print("|---|---:|---:|---:|---:|")
  rng = np.random.default_rng(0)
  starts = rng.integers(0, len(ids) - max(SEQUENCE), len(SEQUENCE))
  prompts = [ids[s : s + n] for s, n in zip(starts, SEQUENCE)]
  for name in ("first", "again")[: args.passes]:
    ours, theirs, compiles, loaded, compiling = [], [], 0, 0, 0.0
    for prompt in prompts:
      start = time.perf_counter()
      result = kvjax.generate(model, tok, [prompt], max_new_tokens=args.new_tokens)
      ours.append(time.perf_counter() - start)
      compiles += result.stats["compiles"]
      loaded += result.stats["loaded"]
      compiling += result.stats["compile_seconds"]
      theirs.append(torch_generate(ref, prompt, args.new_tokens))
    print(
        f"| {name} | {sum(ours):.1f} ({min(ours):.1f}-{max(ours):.1f}) "
        f"| {compiles} ({loaded}; {compiling:.1f}) "
        f"| {sum(theirs):.1f} ({min(theirs):.1f}-{max(theirs):.1f}) "
        f"| {sum(ours) / sum(theirs):.2f} |",
        flush=True,
    )
    rows.append(
        {
            "pass": name,
            "kvjax": sum(ours),
            "transformers": sum(theirs),
            "ratio": sum(ours) / sum(theirs),
            "steps": compiles,
            "loaded": loaded,
            "compile_seconds": compiling,
        }
    )
  return rows


if __name__ == "__main__":
  main()
