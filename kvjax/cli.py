"""`kvjax` command line."""

from __future__ import annotations

import argparse
import sys
import time


def _demo(args) -> int:
  """Streams a synthetic prompt through a bounded paged cache and reports what it did."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import kvjax
  from pallas_kernels.paged_attention import paged_attention_reference

  cfg = kvjax.CacheConfig(
      page_size=args.page_size,
      max_tokens=args.max_tokens,
      budget=args.budget,
      sink=args.sink,
      recent=args.recent,
      group_size=1 if args.token_eviction else None,
  )
  layers, batch, kv_heads, q_heads, head_dim = 4, 2, 3, 9, 64
  cache = kvjax.init_cache(cfg, layers, batch, kv_heads, head_dim, chunk=args.chunk)
  rng = np.random.default_rng(args.seed)

  @jax.jit
  def step(cache, k, v, q, positions, num_new):
    cache = kvjax.append(cache, k, v, positions, num_new)
    _, probs = paged_attention_reference(
        q, cache.k_pages, cache.v_pages, cache.page_table[0], cache.length[0], num_new
    )
    # Attention-history score on layer 0 (every layer uses it here: a demo, not a model).
    history = kvjax.logical_view(cache, cache.score)[0] + probs.sum(axis=2)
    scores = jnp.broadcast_to(history, cache.length.shape + history.shape[-1:])
    peak = cache.pages_in_use().sum()
    return kvjax.evict(cache, scores=scores), peak

  start, peak_bytes = time.perf_counter(), 0
  for offset in range(0, args.tokens, args.chunk):
    t = min(args.chunk, args.tokens - offset)
    k = jnp.asarray(rng.normal(size=(layers, batch, args.chunk, kv_heads, head_dim)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(batch, args.chunk, q_heads, head_dim)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(offset, offset + args.chunk), (batch, args.chunk))
    cache, peak = step(cache, k, k, q, positions.astype(jnp.int32), jnp.full((batch,), t))
    peak_bytes = max(peak_bytes, int(peak) * cache.page_bytes)
  kvjax.check_status(cache)
  elapsed = time.perf_counter() - start
  full_bytes = layers * batch * kv_heads * 2 * args.tokens * head_dim * 4
  _, _, kept = kvjax.read_sequence(cache, 0, 0, 0)
  print(
      f"streamed {args.tokens} tokens x {batch} rows x {layers} layers x {kv_heads} kv heads "
      f"in chunks of {args.chunk} ({elapsed:.2f} s on {jax.default_backend()})"
  )
  print(
      f"cache: budget={cfg.budget} sink={cfg.sink} recent={cfg.recent} "
      f"page_size={cfg.page_size} group_size={cfg.group_size} pool={cache.num_pages} pages"
  )
  print(
      f"tokens held per sequence: {int(cache.length.max())}; pages in use "
      f"{int(cache.pages_in_use().sum())} of {cache.num_pages - 1}"
  )
  print(
      f"KV bytes held: {int(cache.kv_bytes()):,} (peak {peak_bytes:,}) vs full cache "
      f"{full_bytes:,} ({full_bytes / max(int(cache.kv_bytes()), 1):.1f}x smaller)"
  )
  shown = kept.tolist() if len(kept) <= 16 else kept[:8].tolist() + ["..."] + kept[-8:].tolist()
  print(f"positions kept in layer 0, row 0, head 0 ({len(kept)}): {shown}")
  return 0


def _generate(args) -> int:
  """Generates a continuation of PROMPT with a model from the registry (default: SmolLM2)."""
  import json

  import jax

  import kvjax
  import models

  start = time.perf_counter()
  print(f"loading {args.model} ...", file=sys.stderr, flush=True)
  model, tokenizer = models.load_llama(args.model)
  print(
      f"loaded {model.config.name} ({model.config.n_layers} layers) in "
      f"{time.perf_counter() - start:.1f} s on {jax.default_backend()}",
      file=sys.stderr,
      flush=True,
  )
  options = dict(
      max_new_tokens=args.max_new_tokens,
      policy=args.policy,
      budget=args.budget,
      sink=args.sink,
      recent=args.recent,
      budget_schedule=args.budget_schedule,
      per_head=args.per_head,
      chat=args.chat,
      temperature=args.temperature,
      top_k=args.top_k,
      top_p=args.top_p,
      seed=args.seed,
      prefill_chunk=args.prefill_chunk,
  )
  if args.json:
    result = kvjax.generate(model, tokenizer, [args.prompt], **options)
    print(
        json.dumps(
            {
                "text": result.texts[0],
                "tokens": result.tokens[0],
                "finish_reason": result.finish_reasons[0],
                "stats": result.stats,
            }
        )
    )
    return 0
  generation = kvjax.generate(model, tokenizer, [args.prompt], stream=True, **options)
  for event in generation:
    print(event.text, end="", flush=True)
  print()
  stats = generation.result.stats
  print(
      f"[{stats['prompt_tokens'][0]} prompt + {stats['generated_tokens'][0]} generated tokens; "
      f"prefill {stats['prefill_seconds']:.2f} s; decode {stats['decode_tokens_per_s']:.1f} "
      f"tokens/s (streaming); peak KV {stats['peak_kv_bytes'] / 2**20:.1f} MiB]",
      file=sys.stderr,
  )
  return 0


# Request lengths per task when --context-tokens is not given (full run / --quick).
_DEFAULT_LENGTHS = {
    "fidelity": ([1024, 2048], [256]),
    "perplexity": ([2048], [256]),
    "passkey": ([1024, 2048], [512]),
    "retention": ([1024, 2048], [256]),
    "bench": ([512, 1024, 2048, 4096, 8192], [256]),
}
_QUICK_POLICIES = ["full", "streaming", "h2o"]


def _evaluate(args) -> int:
  """Runs one evaluation task (or `bench`) over policies x budgets x request lengths and
  writes results.json, results.md and plots into --out."""
  import pathlib

  import jax

  import models
  from kvjax.eval import _data, _report, _sweep

  task = args.task
  quick = args.quick
  lengths = args.context_tokens or _DEFAULT_LENGTHS[task][1 if quick else 0]
  policies = args.policy or (_QUICK_POLICIES if quick else ["all"])
  budgets = args.budget or ([0.5] if quick else [0.5, 0.25])
  options = {"sink": args.sink, "page_size": args.page_size}
  if args.recent is not None:
    options["recent"] = args.recent
  if task in ("fidelity", "perplexity"):
    default_continuation = 64 if task == "fidelity" else 128
    options["continuation_tokens"] = args.continuation_tokens or (
        16 if quick else default_continuation
    )
    options["windows"] = args.windows or (1 if quick else 2)
  if task in ("passkey", "retention"):
    options["depths"] = args.depths or ([0.5] if quick else [0.1, 0.5, 0.9])
  if task == "passkey":
    options["trials"] = args.trials or 1
  if task == "bench":
    options["decode_steps"] = args.decode_steps or (8 if quick else 32)
    options["repeats"] = args.repeats or (1 if quick else 3)

  start = time.perf_counter()
  print(f"loading {args.model} ...", file=sys.stderr, flush=True)
  model, tokenizer = models.load_llama(args.model)
  print(
      f"loaded {model.config.name} in {time.perf_counter() - start:.1f} s on "
      f"{jax.default_backend()}",
      file=sys.stderr,
      flush=True,
  )
  ids, cases = None, None
  if task == "passkey":
    if args.text:
      raise ValueError("passkey uses a synthetic filler or --jsonl question records, not --text")
    if args.jsonl:
      cases = _data.read_jsonl(args.jsonl, ("context", "question", "answer"))
      if args.context_tokens:
        raise ValueError("--context-tokens does not apply to --jsonl cases (their own length)")
      lengths = [max(len(tokenizer.encode(c["context"])) for c in cases)]
    data = {"kind": "jsonl", "source": args.jsonl} if cases else {"kind": "synthetic passkey"}
  else:
    if args.jsonl:
      records = _data.read_jsonl(args.jsonl, ("text",))
      text, data = "\n\n".join(r["text"] for r in records), {"kind": "jsonl", "source": args.jsonl}
    elif args.text:
      text, data = _data.read_text(args.text), {"kind": "text", "source": args.text}
    else:
      text, data = _data.default_text(), {"kind": "text", "source": _data.DEFAULT_TEXT_SOURCE}
    ids = tokenizer.encode(text)
    data["tokens"] = len(ids)
  results = _sweep.run(
      task,
      model,
      tokenizer,
      policies=policies,
      budgets=budgets,
      context_tokens=lengths,
      ids=ids,
      cases=cases,
      options=options,
      config={"command": "kvjax " + " ".join(sys.argv[1:]), "quick": quick, "data": data},
      progress=not args.quiet,
  )
  out = pathlib.Path(args.out or f"kvjax-results/{task}")
  written = _report.write(results, out)
  print(_report.markdown(results))
  print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
  failed = sum(r["failed"] for r in results["rows"])
  if failed:
    print(f"kvjax {task}: {failed} case(s) failed; see results.md", file=sys.stderr)
    return 1
  return 0


def _add_eval_options(parser, task: str):
  parser.set_defaults(func=_evaluate, task=task)
  parser.add_argument(
      "--model", default="smollm2-135m-instruct", help="registry name, .gguf or HF dir"
  )
  parser.add_argument(
      "--policy",
      nargs="+",
      default=None,
      help=f"one or several of {', '.join(_policy_names())}, or 'all' (default: all)",
  )
  parser.add_argument(
      "--budget",
      nargs="+",
      type=_budget,
      default=None,
      help="KV tokens kept per sequence, or fractions of the request like 0.25 (default: 0.5 0.25)",
  )
  lengths, quick_lengths = _DEFAULT_LENGTHS[task]
  parser.add_argument(
      "--context-tokens",
      nargs="+",
      type=int,
      default=None,
      help=f"request lengths in tokens (default: {lengths}; --quick: {quick_lengths})",
  )
  data = parser.add_mutually_exclusive_group()
  data.add_argument("--text", default=None, help="UTF-8 text file (default: the shipped text)")
  data.add_argument(
      "--jsonl",
      default=None,
      help='JSONL file: {"context", "question", "answer"} per line for passkey, {"text"} otherwise',
  )
  parser.add_argument(
      "--out", default=None, help=f"output directory (default: kvjax-results/{task})"
  )
  parser.add_argument("--quick", action="store_true", help="a small run (CI)")
  parser.add_argument("--quiet", action="store_true", help="no progress bar")
  parser.add_argument("--sink", type=int, default=4)
  parser.add_argument("--recent", type=int, default=None, help="default budget // 4")
  parser.add_argument("--page-size", type=int, default=16)
  if task in ("fidelity", "perplexity"):
    parser.add_argument("--windows", type=int, default=None, help="text windows per length")
    parser.add_argument("--continuation-tokens", type=int, default=None)
  if task in ("passkey", "retention"):
    parser.add_argument("--depths", nargs="+", type=float, default=None)
  if task == "passkey":
    parser.add_argument("--trials", type=int, default=None, help="keys per depth")
  if task == "bench":
    parser.add_argument("--decode-steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)


def _policy_names():
  from kvjax.policies import POLICIES

  return list(POLICIES)


def _budget(text: str) -> int | float:
  """'512' -> 512 tokens; '0.25' -> a quarter of the prompt."""
  try:
    return int(text)
  except ValueError:
    try:
      return float(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"budget must be tokens or a fraction, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="kvjax", description="KV-cache compression for JAX.")
  sub = parser.add_subparsers(dest="command", required=True)
  gen = sub.add_parser("generate", help="generate text with a model (default: SmolLM2-135M)")
  gen.add_argument("prompt")
  gen.add_argument(
      "--model",
      default="smollm2-135m-instruct",
      help="registry name, .gguf file or local HF checkpoint directory",
  )
  gen.add_argument("--policy", default="full", help=f"cache policy: {', '.join(_policy_names())}")
  gen.add_argument(
      "--budget",
      type=_budget,
      default=None,
      help="KV tokens kept per sequence, or a fraction of the prompt like 0.25",
  )
  gen.add_argument("--sink", type=int, default=4, help="first tokens never evicted")
  gen.add_argument(
      "--recent", type=int, default=None, help="last tokens never evicted " "(default budget // 4)"
  )
  gen.add_argument("--budget-schedule", choices=("uniform", "pyramid"), default="uniform")
  gen.add_argument(
      "--per-head",
      action="store_true",
      help="split each layer's budget across kv heads by global top-k",
  )
  gen.add_argument("--max-new-tokens", type=int, default=64)
  gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  gen.add_argument("--top-k", type=int, default=0, help="0 = off")
  gen.add_argument("--top-p", type=float, default=1.0)
  gen.add_argument("--seed", type=int, default=0)
  gen.add_argument("--prefill-chunk", type=int, default=256)
  gen.add_argument(
      "--chat",
      action=argparse.BooleanOptionalAction,
      default=True,
      help="wrap the prompt in the model's chat template (default: on)",
  )
  gen.add_argument(
      "--json", action="store_true", help="print one JSON object with text, tokens, stats"
  )
  gen.set_defaults(func=_generate)
  demo = sub.add_parser("demo", help="stream synthetic tokens through a bounded paged cache")
  demo.add_argument("--tokens", type=int, default=2048)
  demo.add_argument("--chunk", type=int, default=128)
  demo.add_argument("--budget", type=int, default=256)
  demo.add_argument("--sink", type=int, default=4)
  demo.add_argument("--recent", type=int, default=32)
  demo.add_argument("--page-size", type=int, default=16)
  demo.add_argument("--max-tokens", type=int, default=1024)
  demo.add_argument("--token-eviction", action="store_true", help="group_size=1 instead of pages")
  demo.add_argument("--seed", type=int, default=0)
  demo.set_defaults(func=_demo)
  evaluation = sub.add_parser("eval", help="quality of compressed caches vs the full cache")
  tasks = evaluation.add_subparsers(dest="task", required=True)
  for task, text in (
      ("fidelity", "KL and top-1 agreement with the full cache over real text"),
      ("passkey", "pass-key retrieval accuracy (or your --jsonl questions)"),
      ("perplexity", "perplexity of real text after a compressed context"),
      ("retention", "fraction of an unprotected instruction's tokens kept"),
  ):
    _add_eval_options(tasks.add_parser(task, help=text), task)
  _add_eval_options(
      sub.add_parser("bench", help="KV bytes, prefill and decode latency by request length"),
      "bench",
  )
  return parser


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  try:
    return args.func(args)
  except (ValueError, FileNotFoundError) as err:  # bad input: one clear line, no traceback
    print(f"kvjax {args.command}: error: {err}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
