"""`kvjax generate` (text from a prompt) and `kvjax warmup` (the compiled steps of the
requests a deployment will see, stored ahead of them)."""

from __future__ import annotations

import argparse
import sys
import time

from kvjax.cli import common
from kvjax.cli.spec_flags import add_dataclass_flags, check_spec_model, from_args, spec_from_args
from models.registry import DEFAULT_MODEL


def add_parsers(subparsers) -> None:
  _add_generate_parser(subparsers)
  _add_warmup_parser(subparsers)


def _add_request_flags(parser, *, max_new_help: str) -> None:
  """The flags that shape a request: the model, compression, sampling, new tokens (one
  table for `generate` and `warmup`, which must see the same requests)."""
  import kvjax

  common.add_model_flag(parser, "registry name, .gguf file or local HF checkpoint directory")
  add_dataclass_flags(parser, kvjax.CompressionSpec, title="compression (kvjax.CompressionSpec)")
  add_dataclass_flags(parser, kvjax.Sampling, title="sampling (kvjax.Sampling)")
  parser.add_argument("--max-new-tokens", type=int, default=64, help=max_new_help)


def _add_generate_parser(subparsers) -> None:
  gen = subparsers.add_parser(
      "generate", help=f"generate text with a model (default: {DEFAULT_MODEL})"
  )
  gen.add_argument(
      "prompt",
      nargs="?",
      default=None,
      help="the prompt ('-' reads it from stdin); with --context, the question about it",
  )
  gen.add_argument("--prompt-file", default=None, help="read the prompt from this UTF-8 file")
  gen.add_argument(
      "--context",
      default=None,
      metavar="FILE",
      help="a UTF-8 document the prompt asks about ('-' reads stdin): it is read and "
      "compressed, then the question is read after it, never evicted",
  )
  gen.add_argument(
      "--quiet", action="store_true", help="no progress bar (none either when stderr is not a tty)"
  )
  _add_request_flags(gen, max_new_help="tokens to generate at most")
  gen.add_argument("--seed", type=int, default=0, help="seed of sampling and random eviction")
  gen.add_argument(
      "--chat",
      action=argparse.BooleanOptionalAction,
      default=None,
      help="wrap the prompt in the model's chat template (default: on where the model has one; "
      "instruction-tuned models carry one, base models complete text)",
  )
  gen.add_argument(
      "--json", action="store_true", help="print one JSON object with text, tokens, stats"
  )
  gen.add_argument(
      "--mesh",
      default=None,
      help="shard the cache and the model over devices, e.g. model=2 (kv heads) or "
      "data=2,model=2; on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N",
  )
  gen.set_defaults(func=_generate)


def _add_warmup_parser(subparsers) -> None:
  warm = subparsers.add_parser(
      "warmup",
      help="compile and store the steps of the requests a deployment will see (Docker, Colab)",
      description="Runs one request per prompt length on filler tokens with these settings, "
      "so that the compiled-step store in the cache directory ($KVJAX_CACHE_DIR, else "
      "~/.cache/kvjax) holds their steps: later processes load them instead of compiling. "
      "Use the flags `kvjax generate` will get (compression, sampling, --max-new-tokens); "
      "steps are stored per backend and device, so warm on the machine type that serves.",
  )
  _add_request_flags(warm, max_new_help="as given to generate")
  warm.add_argument("--batch", type=int, default=1, help="prompts per request")
  warm.add_argument(
      "--lengths",
      type=int,
      nargs="+",
      default=None,
      help="prompt lengths in tokens; default: 32, 64, 128 and the longest prompt of each "
      "2048-token capacity bucket up to the model context",
  )
  warm.set_defaults(func=_warmup)


def _read_prompt(args) -> str:
  """The prompt: the argument, stdin for '-', or --prompt-file; checked to be UTF-8 text."""
  from kvjax.runtime.prompts import check_text

  if (args.prompt is None) == (args.prompt_file is None):
    given = "neither was given" if args.prompt is None else "both were given"
    raise ValueError(f"give a PROMPT ('-' reads stdin) or --prompt-file FILE ({given})")
  if args.prompt == "-" and args.context == "-":
    raise ValueError("only one of PROMPT and --context can read stdin ('-')")
  if args.prompt_file is not None:
    return common.read_text_file(args.prompt_file)
  if args.prompt == "-":
    return common.read_stdin()
  return check_text(args.prompt, "the prompt")


def _read_context(args) -> str | None:
  """--context's document (stdin for '-'), or None."""
  if args.context is None:
    return None
  text = common.read_stdin() if args.context == "-" else common.read_text_file(args.context)
  if not text.strip():
    raise ValueError(f"--context {args.context} is empty")
  return text


def _generate(args) -> int:
  """Generates a continuation of PROMPT with a model from the registry."""
  import json

  import kvjax

  from kvjax.runtime.sampling import check_seed

  # The whole command line is checked before the model loads; the sizes the model bounds
  # (its context) once it has loaded, before the work.
  spec = spec_from_args(args)
  sampling = from_args(kvjax.Sampling, args)
  if args.max_new_tokens < 1:
    raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
  check_seed(args.seed, "--seed")
  mesh = kvjax.sharding.make_mesh(args.mesh)
  prompt = _read_prompt(args)
  if not prompt.strip():
    raise ValueError("the prompt is empty")
  context = _read_context(args)
  model, tokenizer = common.load_model(args.model)
  check_spec_model(args, model, spec)
  options = dict(
      context=context,
      max_new_tokens=args.max_new_tokens,
      sampling=sampling,
      chat=common.wants_chat(args, tokenizer),
      seed=args.seed,
      progress=common.prefill_bar(args, spec),
      mesh=mesh,
  )
  # A stream checks its arguments against the model (its context length) when it is made
  # and runs nothing until it is read.
  generation = kvjax.generate(model, tokenizer, [prompt], spec, stream=True, **options)
  common.begin_work(args)
  if args.json:
    # Not the stream: --json decodes all tokens in one call, the stream one by one.
    result = kvjax.generate(model, tokenizer, [prompt], spec, **options)
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
  for event in generation:
    sys.stdout.write(event.text)
    sys.stdout.flush()
  print()
  stats = generation.result.stats
  common.print_summary(
      common.tokens_part(stats),
      *common.kv_parts(stats),
      f"prefill {stats['prefill_seconds']:.2f} s",
      f"decode {stats['decode_tokens_per_s']:.1f} tokens/s (streaming)",
  )
  return 0


def _warmup(args) -> int:
  """Fills the compiled-step store for the requests a deployment will see."""
  import kvjax
  from kvjax.runtime.warmup import default_lengths, store_path, warmup

  spec = spec_from_args(args)
  sampling = from_args(kvjax.Sampling, args)
  for name in ("batch", "max_new_tokens"):
    if getattr(args, name) < 1:
      raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  if args.lengths is not None and min(args.lengths) < 1:
    raise ValueError(f"--lengths must be >= 1, got {min(args.lengths)}")
  store = store_path()
  model, tokenizer = common.load_model(args.model)
  check_spec_model(args, model, spec)
  lengths = args.lengths or default_lengths(model.config.max_context, args.max_new_tokens)
  too_long = [n for n in lengths if n + args.max_new_tokens > model.config.max_context]
  if too_long:
    raise ValueError(
        f"--lengths {too_long[0]} + --max-new-tokens {args.max_new_tokens} passes the model "
        f"context {model.config.max_context}"
    )
  print(f"warming {store} for {model.config.name}: prompts of {lengths} tokens", flush=True)
  common.begin_work(args)

  def report(row):
    print(
        f"{row['length']:>6} tokens: {row['compiled']} steps compiled, {row['loaded']} loaded "
        f"from the store, {row['seconds']:.1f} s",
        flush=True,
    )

  start = time.perf_counter()
  rows = warmup(
      model,
      tokenizer,
      spec,
      lengths=lengths,
      batch=args.batch,
      max_new_tokens=args.max_new_tokens,
      sampling=sampling,
      report=report,
  )
  compiled = sum(row["compiled"] for row in rows)
  loaded = sum(row["loaded"] for row in rows)
  print(
      f"done in {time.perf_counter() - start:.1f} s: {compiled} steps compiled and stored, "
      f"{loaded} already there"
  )
  return 0
