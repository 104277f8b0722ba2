"""`kvjax` command line."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

EXIT_USAGE = 2  # bad command line or input: nothing ran
EXIT_FAILED = 1  # the run itself failed


def _begin_work(args) -> None:
  """Marks where a command's real work begins: its first computation or write, after every
  check of the command line, the input files and the model. Before it, a ValueError,
  TypeError or OSError is the user's input refused (exit 2: nothing ran); from it on, any
  error is a failure of the run (exit 1), even a ValueError (a damaged saved state) or an
  OSError (a full disk)."""
  args.work_began = True


class _HelpFormatter(argparse.HelpFormatter):
  """Adds "(default: X)" to an option's help unless it states its default already (flags
  whose default None means "not given" say what applies instead)."""

  def _get_help_string(self, action):
    text = action.help or ""
    if "default" in text or any(action.default is d for d in (None, False, argparse.SUPPRESS)):
      return text
    return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
  """argparse with a one-line error (no usage block) and defaults in every --help."""

  def __init__(self, *args, **kwargs):
    kwargs.setdefault("formatter_class", _HelpFormatter)
    super().__init__(*args, **kwargs)

  def error(self, message):
    print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
    sys.exit(EXIT_USAGE)


# ---- the CompressionSpec and Sampling flags: one table, generated from the dataclasses ----


def _budget(text: str) -> int | float | str:
  """'512' -> 512 tokens; '0.25' -> a quarter of the prompt; 'auto' -> what scores above
  --threshold."""
  if text == "auto":
    return text
  try:
    return int(text)
  except ValueError:
    try:
      return float(text)
    except ValueError:
      raise argparse.ArgumentTypeError(
          f"budget must be tokens, a fraction or 'auto', got {text!r}"
      ) from None


_SWEPT = ("policy", "budget")  # eval/bench take several of these and run each
# eval/bench set these per configuration: the threshold where the budget is 'auto', the
# scorer where the policy is 'learned', the allocation where the policy is its own.
_PER_CONFIG = (*_SWEPT, "threshold", "scorer", "allocation")


def _flag(name: str) -> str:
  return "--" + name.replace("_", "-")


def _add_dataclass_flags(parser, cls, *, sweep: bool = False, title: str):
  """One flag per field of `cls` (CompressionSpec or Sampling), with its help and choices.
  Flags default to None: the dataclass's own defaults apply to what the user leaves out."""
  group = parser.add_argument_group(title)
  if cls.__name__ == "CompressionSpec":
    group.add_argument(
        "--spec",
        default=None,
        metavar="FILE",
        help="a tuned spec (tuned.json from `kvjax tune`); flags given with it override it",
    )
  for field in dataclasses.fields(cls):
    meta = dict(field.metadata)
    default = field.default
    help_text = meta.get("help", "") + ("" if default is None else f" (default: {default})")
    kwargs = {"default": None, "dest": field.name, "help": help_text.replace("%", "%%")}
    if field.name == "policy":
      kwargs["metavar"] = "POLICY"
      names = ", ".join(_policy_names()) + (", or 'all'" if sweep else "")
      kwargs["help"] = (
          f"{meta['help']}; one of {names}, with options after a colon where it has any "
          f"(kvzip:chunk=256) (default: {'all' if sweep else default})"
      )
    elif field.name == "budget":
      kwargs["type"] = _budget
    elif isinstance(default, bool):
      kwargs["action"] = argparse.BooleanOptionalAction
    elif "choices" in meta:
      kwargs["choices"] = meta["choices"]
    elif field.type in ("int", "int | None"):
      kwargs["type"] = int
    elif field.type in ("float", "float | None"):
      kwargs["type"] = float
    if sweep and field.name in _SWEPT:
      kwargs["nargs"] = "+"
    group.add_argument(_flag(field.name), **kwargs)


def _given(cls, args, skip=()) -> dict:
  """The fields of `cls` the user gave flags for."""
  return {
      f.name: getattr(args, f.name)
      for f in dataclasses.fields(cls)
      if f.name not in skip and getattr(args, f.name, None) is not None
  }


def _from_args(cls, args, skip=()):
  """`cls` built from the flags the user gave (the others keep the dataclass defaults)."""
  return cls(**_given(cls, args, skip))


def spec_from_args(args, sweep: bool = False):
  """The `CompressionSpec` of a parsed command line: `--spec FILE` (a tuned spec) with the
  flags given on top, or the flags alone (for eval/bench: without the fields each
  configuration sets, `_PER_CONFIG`)."""
  from kvjax.spec import CompressionSpec

  skip = _PER_CONFIG if sweep else ()
  if getattr(args, "spec", None) is None:
    return _from_args(CompressionSpec, args, skip=skip)
  from kvjax.tuning import load_spec

  tuned = load_spec(args.spec)
  given = _given(CompressionSpec, args, skip)
  if "policy" in given and given["policy"] != tuned.policy.name:
    given.setdefault("allocation", None)  # learned on the tuned policy's scores
  return tuned.replace(**given)


def check_spec_model(args, model, spec=None) -> None:
  """A tuned spec (`--spec`) must have been tuned for the model it runs with; `spec`'s
  policy (a learned scorer) and allocation must fit it too (checked here, before the work
  begins, as a usage error: `kvjax.prefill` checks them too, once it runs)."""
  if getattr(args, "spec", None) is not None:
    from kvjax.tuning import load_spec

    load_spec(args.spec, model)
  if spec is not None:
    spec.policy.check_model(model)
    if spec.allocation is not None:
      spec.allocation.check_model(model)


def _load(name: str):
  """The model and tokenizer; an unknown name or a missing file fails before "loading"."""
  import jax

  import models
  from models.registry import resolve_model

  resolve_model(name)
  start = time.perf_counter()
  print(f"loading {name} ...", file=sys.stderr, flush=True)
  model, tokenizer = models.load_llama(name)
  print(
      f"loaded {model.config.name} ({model.config.n_layers} layers) in "
      f"{time.perf_counter() - start:.1f} s on {jax.default_backend()}",
      file=sys.stderr,
      flush=True,
  )
  return model, tokenizer


def _read_prompt(args) -> str:
  """The prompt: the argument, stdin for '-', or --prompt-file; checked to be UTF-8 text."""
  from kvjax.runtime.prompts import check_text

  if (args.prompt is None) == (args.prompt_file is None):
    given = "neither was given" if args.prompt is None else "both were given"
    raise ValueError(f"give a PROMPT ('-' reads stdin) or --prompt-file FILE ({given})")
  if args.prompt_file is not None:
    from kvjax.eval import _data

    return _data.read_text(args.prompt_file)
  if args.prompt == "-":
    from kvjax.eval import _data

    return _data.read_stream(sys.stdin.buffer, "stdin")
  return check_text(args.prompt, "the prompt")


def _show_progress(args) -> bool:
  return not args.quiet and sys.stderr.isatty()


def _prefill_bar(args):
  """A progress callback for long prefills (a bar on stderr), or None."""
  if not _show_progress(args):
    return None
  from tqdm.auto import tqdm

  bar = None

  def progress(done, total):
    nonlocal bar
    if total < 1024:  # short prompts prefill in about a second: no bar
      return
    if bar is None:
      bar = tqdm(total=total, desc="prefill", unit="tok", leave=False, file=sys.stderr)
    bar.update(done - bar.n)
    if done >= total:
      bar.close()

  return progress


def _generate(args) -> int:
  """Generates a continuation of PROMPT with a model from the registry (default: SmolLM2)."""
  import json

  import kvjax

  # The whole command line is checked before the model loads.
  spec = spec_from_args(args)
  sampling = _from_args(kvjax.Sampling, args)
  if args.max_new_tokens < 1:
    raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
  mesh = kvjax.sharding.make_mesh(args.mesh)
  prompt = _read_prompt(args)
  if not prompt.strip():
    raise ValueError("the prompt is empty")
  model, tokenizer = _load(args.model)
  check_spec_model(args, model, spec)
  options = dict(
      max_new_tokens=args.max_new_tokens,
      sampling=sampling,
      chat=args.chat,
      seed=args.seed,
      progress=_prefill_bar(args),
      mesh=mesh,
  )
  # A stream checks its arguments against the model (its context length) when it is made
  # and runs nothing until it is read.
  generation = kvjax.generate(model, tokenizer, [prompt], spec, stream=True, **options)
  _begin_work(args)
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
  print(
      f"[{stats['prompt_tokens'][0]} prompt + {stats['generated_tokens'][0]} generated tokens; "
      f"{stats['kept_fraction'][0]:.0%} of the prompt's KV kept; "
      f"prefill {stats['prefill_seconds']:.2f} s; decode {stats['decode_tokens_per_s']:.1f} "
      f"tokens/s (streaming); peak KV {stats['peak_kv_bytes'] / 2**20:.1f} MiB]",
      file=sys.stderr,
  )
  return 0


def _warmup(args) -> int:
  """Fills the compiled-step store for the requests a deployment will see."""
  import kvjax
  from kvjax.runtime.warmup import default_lengths, store_path, warmup

  spec = spec_from_args(args)
  sampling = _from_args(kvjax.Sampling, args)
  for name in ("batch", "max_new_tokens"):
    if getattr(args, name) < 1:
      raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  if args.lengths is not None and min(args.lengths) < 1:
    raise ValueError(f"--lengths must be >= 1, got {min(args.lengths)}")
  store = store_path()
  model, tokenizer = _load(args.model)
  check_spec_model(args, model, spec)
  lengths = args.lengths or default_lengths(model.config.max_context, args.max_new_tokens)
  too_long = [n for n in lengths if n + args.max_new_tokens > model.config.max_context]
  if too_long:
    raise ValueError(
        f"--lengths {too_long[0]} + --max-new-tokens {args.max_new_tokens} passes the model "
        f"context {model.config.max_context}"
    )
  print(f"warming {store} for {model.config.name}: prompts of {lengths} tokens", flush=True)
  _begin_work(args)

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


# Request lengths per task when --context-tokens is not given (full run / --quick).
# The hard cases by default: a short context and one the length of the default model's
# window, leaving room in it for what is scored after the request (fidelity's 64 tokens,
# passkey's 12-token answer, multi-question's 24).
_DEFAULT_LENGTHS = {
    "fidelity": ([2048, 8128], [256]),
    "perplexity": ([2048], [256]),
    "passkey": ([2048, 8180], [512]),
    "multi_question": ([2048, 8168], [512]),
    "retention": ([1024, 2048], [256]),
    "bench": ([512, 1024, 2048, 4096, 8192], [256]),
}
_QUICK_POLICIES = ["full", "streaming", "h2o"]
# Kept fractions: compression ratios 0.5, 0.75, 0.875, 0.9 and 0.95.
_DEFAULT_BUDGETS = [0.5, 0.25, 0.125, 0.1, 0.05]
_DEFAULT_DEPTHS = [0.1, 0.25, 0.4, 0.55, 0.7, 0.85]  # x 4 trials: 24 cases per haystack


def _evaluate(args) -> int:
  """Runs one evaluation task (or `bench`) over policies x budgets x request lengths and
  writes results.json, results.md and plots into --out."""
  from kvjax.eval import _report, _sweep

  task = args.task
  quick = args.quick
  spec = spec_from_args(args, sweep=True)
  lengths = args.context_tokens or _DEFAULT_LENGTHS[task][1 if quick else 0]
  if args.spec is not None:  # the tuned setting, beside the full cache
    policies = args.policy or ["full", spec.policy.name]
    budgets = args.budget or [spec.budget]
  else:
    policies = args.policy or (_QUICK_POLICIES if quick else ["all"])
    default_budgets = [0.5, 0.25] if task == "bench" else _DEFAULT_BUDGETS
    budgets = args.budget or ([0.5] if quick else default_budgets)
  options = _eval_options(args, task, quick)
  _sweep.check_options(task, options)
  if any(n < 1 for n in lengths):
    raise ValueError(f"--context-tokens must be >= 1, got {lengths}")
  if args.threshold is not None and "auto" not in budgets:
    raise ValueError(f"--threshold {args.threshold} applies only with --budget auto")
  allocation = _sweep.sweep_allocation(spec, args.allocation, policies)
  _sweep.configuration_specs(  # every configuration, checked
      spec,
      policies,
      budgets,
      lengths,
      threshold=args.threshold,
      scorer=args.scorer,
      allocation=allocation,
      resolve=not (task == "passkey" and args.jsonl),  # lengths known once tokenized
  )
  # Files are read and the output directory checked before the model loads.
  out = _report.check_out(args.out or f"kvjax-results/{task}")
  records, text, data = _eval_data(args, task, options)
  model, tokenizer = _load(args.model)
  check_spec_model(args, model)
  if args.allocation is not None:  # a tuned spec's is checked with the spec
    allocation.check_model(model)

  def keep(partial):  # after each configuration: keep what finished
    # _sweep.run checks every configuration and the data before the first runs, and
    # records a configuration that crashes as a result: the first row is where work began.
    _begin_work(args)
    _report.write(partial, out, plot=False)

  ids, cases = None, records
  if records is not None:
    lengths = [max(len(tokenizer.encode(c["context"])) for c in records)]
  if text is not None:
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
      spec=spec,
      threshold=args.threshold,
      scorer=args.scorer,
      allocation=allocation,
      config={"command": "kvjax " + " ".join(sys.argv[1:]), "quick": quick, "data": data},
      progress=_show_progress(args),
      on_row=keep,
  )
  written = _report.write(results, out)
  print(_report.markdown(results))
  print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
  failed = sum(r["failed"] for r in results["rows"])
  if failed:
    print(f"kvjax {task}: {failed} case(s) failed; see results.md", file=sys.stderr)
    return 1
  return 0


def _eval_options(args, task: str, quick: bool) -> dict:
  """The task's own options from the command line, with --quick's smaller defaults."""
  options = {}
  if task in ("fidelity", "perplexity"):
    default_continuation = 64 if task == "fidelity" else 128
    options["continuation_tokens"] = args.continuation_tokens or (
        16 if quick else default_continuation
    )
    options["windows"] = args.windows or (1 if quick else 8)
  if task == "retention":
    options["depths"] = args.depths or ([0.5] if quick else [0.1, 0.5, 0.9])
  if task == "passkey":
    options["depths"] = args.depths or ([0.5] if quick else _DEFAULT_DEPTHS)
    options["trials"] = args.trials or (1 if quick else 4)
    if args.jsonl and args.fillers:
      raise ValueError("--fillers does not apply to --jsonl cases (their own contexts)")
    if not args.jsonl:
      options["fillers"] = args.fillers or (["repeat"] if quick else ["text", "needles"])
    if args.text and not set(options["fillers"]) & {"text", "needles"}:
      raise ValueError("passkey takes --text only as the haystack of --fillers text or needles")
  if task == "multi_question":
    options["facts"] = 4 if args.facts is None else args.facts
    options["trials"] = (1 if quick else 6) if args.trials is None else args.trials
  if task == "bench":
    options["decode_steps"] = args.decode_steps or (8 if quick else 32)
    options["repeats"] = args.repeats or (1 if quick else 3)
  return options


def _eval_data(args, task: str, options: dict) -> tuple[list | None, str | None, dict]:
  """(question records, text, a record of the data's source) of an evaluation, read from
  --jsonl / --text or the default text."""
  from kvjax.eval import _data

  records, text = None, None
  if task == "passkey" and args.jsonl:
    records = _data.read_jsonl(args.jsonl, ("context", "question", "answer"))
    if args.context_tokens:
      raise ValueError("--context-tokens does not apply to --jsonl cases (their own length)")
    data = {"kind": "jsonl", "source": args.jsonl}
  elif task == "passkey" and not set(options["fillers"]) & {"text", "needles"}:
    data = {"kind": "synthetic passkey"}
  elif args.jsonl:
    text = "\n\n".join(r["text"] for r in _data.read_jsonl(args.jsonl, ("text",)))
    data = {"kind": "jsonl", "source": args.jsonl}
  elif args.text:
    text, data = _data.read_text(args.text), {"kind": "text", "source": args.text}
  else:
    text, data = _data.default_text(), {"kind": "text", "source": _data.DEFAULT_TEXT_SOURCE}
  return records, text, data


def _add_eval_options(parser, task: str):
  parser.set_defaults(func=_evaluate, task=task)
  parser.add_argument(
      "--model", default="smollm2-135m-instruct", help="registry name, .gguf or HF dir"
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
  from kvjax.spec import CompressionSpec

  _add_dataclass_flags(
      parser, CompressionSpec, sweep=True, title="compression (policy and budget: one or several)"
  )
  if task in ("fidelity", "perplexity"):
    parser.add_argument(
        "--windows", type=int, default=None, help="text windows per length (default: 8; --quick: 1)"
    )
    default_continuation = 64 if task == "fidelity" else 128
    parser.add_argument(
        "--continuation-tokens",
        type=int,
        default=None,
        help=f"tokens scored after each window (default: {default_continuation}; --quick: 16)",
    )
  if task in ("passkey", "retention"):
    depths = " ".join(map(str, _DEFAULT_DEPTHS if task == "passkey" else [0.1, 0.5, 0.9]))
    parser.add_argument(
        "--depths",
        nargs="+",
        type=float,
        default=None,
        help=f"where the needle sits, fractions of the context (default: {depths}; --quick: 0.5)",
    )
  if task == "passkey":
    parser.add_argument(
        "--trials",
        type=int,
        default=None,
        help="keys per filler and depth (default: 4; --quick: 1)",
    )
    parser.add_argument(
        "--fillers",
        nargs="+",
        default=None,
        help="haystacks: 'repeat' (a synthetic sentence group, repeated), 'text' (a window of "
        "--text or the shipped text per case) and/or 'needles' (such a window with a key per "
        "door, three doors, one asked) (default: text needles; --quick: repeat)",
    )
  if task == "multi_question":
    parser.add_argument(
        "--facts", type=int, default=None, help="questions per context (default: 4)"
    )
    parser.add_argument(
        "--trials", type=int, default=None, help="contexts per length (default: 6; --quick: 1)"
    )
  if task == "bench":
    parser.add_argument(
        "--decode-steps",
        type=int,
        default=None,
        help="decoded tokens timed (default: 32; --quick: 8)",
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed runs, median kept (default: 3; --quick: 1)"
    )


def _train_scorer(args) -> int:
  """Trains the `learned` policy's scorer for a model on text and saves it (orbax)."""
  import pathlib

  from kvjax.eval import _data

  out = pathlib.Path(args.out or f"kvjax-scorers/{pathlib.Path(args.model).stem}")
  if out.exists() and not args.overwrite:
    raise ValueError(f"{out} exists; choose another --out or pass --overwrite")
  from kvjax.tuning import scorer_training as training

  training.check_options(
      context_tokens=args.context_tokens, windows=args.windows, held_out=args.held_out
  )
  if args.steps < 1:
    raise ValueError(f"--steps must be >= 1, got {args.steps}")
  text = _data.read_text(args.text) if args.text else _data.default_text()
  model, tokenizer = _load(args.model)
  training.check_options(
      model, context_tokens=args.context_tokens, windows=args.windows, held_out=args.held_out
  )
  ids = tokenizer.encode(text)
  _data.text_windows(ids, args.context_tokens, 0, args.windows)  # the text is long enough
  _begin_work(args)
  scorer = training.train_scorer(
      model,
      tokenizer,
      ids,
      model_name=model.config.name,
      context_tokens=args.context_tokens,
      windows=args.windows,
      held_out=args.held_out,
      steps=args.steps,
      seed=args.seed,
      progress=_show_progress(args),
  )
  path = scorer.save(out, overwrite=args.overwrite)
  m = scorer.metrics
  print(
      f"held-out ({m['held_out_windows']} windows): log-score R^2 {m['r2']:.3f}, "
      f"{m['top25_overlap']:.1%} of kvzip's best 25% tokens found; {m['total_seconds']:.0f} s"
  )
  print(f"saved {path}; use it with --policy learned --scorer {path}", file=sys.stderr)
  return 0


def _prefill_and_save(args) -> int:
  """Prefills a context file once, compresses it, and saves the state (`kvjax ask` answers
  from it)."""
  import json
  import pathlib

  import kvjax
  from kvjax.eval import _data, context_prompt

  spec = spec_from_args(args)
  if args.reserve < 0:
    raise ValueError(f"--reserve must be >= 0, got {args.reserve}")
  save = pathlib.Path(args.save)
  if (save / kvjax.persistence.CURRENT).exists() and not args.overwrite:
    raise ValueError(f"--save {save} holds a saved state; pass --overwrite to replace it")
  if save.exists() and not save.is_dir():
    raise ValueError(f"--save {save} exists and is not a directory")
  text = _data.read_text(args.context)
  if not text.strip():
    raise ValueError(f"--context {args.context} is empty")
  model, tokenizer = _load(args.model)
  check_spec_model(args, model, spec)
  prompt = context_prompt(tokenizer, tokenizer.encode(text), args.chat)
  tokens = [t for segment in prompt for t in segment.text]  # ids (context_prompt encodes)
  if len(tokens) > model.config.max_context:
    raise ValueError(
        f"--context {args.context} is {len(tokens)} tokens, longer than the model context "
        f"{model.config.max_context}"
    )
  _begin_work(args)
  start = time.perf_counter()
  state = kvjax.prefill(
      model,
      [prompt],
      spec,
      tokenizer=tokenizer,
      reserve=args.reserve,
      seed=args.seed,
      progress=_prefill_bar(args),
  )
  prefill_seconds = time.perf_counter() - start
  start = time.perf_counter()
  kvjax.save_state(
      save,
      state,
      model,
      tokenizer=tokenizer,
      tokens=[tokens],
      info={"model": args.model, "chat": args.chat, "context": str(args.context)},
      overwrite=args.overwrite,
  )
  stats = {
      "context_tokens": len(tokens),
      "kv_bytes": state.kv_bytes(),
      "full_kv_bytes": len(tokens) * state.cache.token_bytes,
      # The version just saved (the directory also keeps the one it replaced, until the next).
      "disk_bytes": sum(
          f.stat().st_size
          for f in kvjax.persistence.current_version(save).rglob("*")
          if f.is_file()
      ),
      "prefill_seconds": prefill_seconds,
      "save_seconds": time.perf_counter() - start,
  }
  if args.json:
    print(json.dumps({"path": str(save), "spec": spec.to_dict(), "stats": stats}))
  print(
      f"[{stats['context_tokens']} context tokens; KV {stats['kv_bytes'] / 2**20:.1f} MiB of "
      f"{stats['full_kv_bytes'] / 2**20:.1f} MiB full; prefill {prefill_seconds:.2f} s; saved "
      f"{save} ({stats['disk_bytes'] / 2**20:.1f} MiB) in {stats['save_seconds']:.2f} s]",
      file=sys.stderr,
  )
  return 0


def _ask(args) -> int:
  """Answers questions from a state saved by `kvjax prefill`, without reading the context
  again."""
  import json

  import kvjax
  from kvjax.eval import _data, answer_from_state

  if (args.question is None) == (args.jsonl is None):
    given = "neither was given" if args.question is None else "both were given"
    raise ValueError(f"give a QUESTION or --jsonl FILE ({given})")
  if args.max_new_tokens < 1:
    raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
  if args.jsonl is not None:
    questions = [r["question"] for r in _data.read_jsonl(args.jsonl, ("question",))]
  else:
    questions = [args.question]
  for q in questions:
    if not isinstance(q, str) or not q.strip():
      raise ValueError(f"a question must be non-empty text, got {q!r}")
  info = kvjax.state_info(args.state)  # a bad directory fails before the model loads
  saved = info.get("info") or {}
  start = time.perf_counter()
  model, tokenizer = _load(args.model or saved.get("model") or "smollm2-135m-instruct")
  model_seconds = time.perf_counter() - start
  _begin_work(args)  # the state's arrays are read from here: a damaged one is a failure
  start = time.perf_counter()
  state = kvjax.load_state(args.state, model, tokenizer=tokenizer)
  load_seconds = time.perf_counter() - start
  print(
      f"loaded the state of {info['position'][0]} tokens ({state.kv_bytes() / 2**20:.1f} MiB "
      f"of KV, policy {info['spec']['policy']}) in {load_seconds:.2f} s",
      file=sys.stderr,
  )
  chat = bool(saved.get("chat", True))
  for question in questions:
    start = time.perf_counter()
    text = answer_from_state(
        model, tokenizer, state, question, max_new_tokens=args.max_new_tokens, chat=chat
    )
    seconds = time.perf_counter() - start
    if args.json:
      record = {"question": question, "answer": text, "answer_seconds": seconds}
      record.update(model_seconds=model_seconds, load_seconds=load_seconds)
      print(json.dumps(record), flush=True)
    else:
      print(text, flush=True)
    print(f"[answered in {seconds:.2f} s]", file=sys.stderr)
  return 0


def _doctor(args) -> int:
  """Prints what this machine offers kvjax and runs the self-check; 1 if a check fails."""
  import json

  from kvjax.cli import doctor

  _begin_work(args)  # no input to check: everything is the run
  report = doctor.report()
  if not args.json:
    for key, value in report.items():
      if isinstance(value, dict):
        print(f"{key}:")
        for name, item in value.items():
          text = f"{item['runs']} ({item['why']})" if isinstance(item, dict) else item
          print(f"  {name}: {text}")
      else:
        print(f"{key}: {value}")
  checks = []
  if not args.no_self_check:
    if not args.json:
      print(
          "self-check (a tiny random model; where impl='auto' runs the reference, that is what it checks):"
      )

    def show(check):
      if not args.json:
        mark = "ok  " if check.ok else "FAIL"
        print(f"  {mark} {check.name} ({check.seconds:.1f} s): {check.detail}", flush=True)

    checks = doctor.self_check(progress=show)
  failed = [c.name for c in checks if not c.ok]
  if args.json:
    report["self_check"] = [dataclasses.asdict(c) for c in checks]
    print(json.dumps(report))
  elif checks:
    seconds = sum(c.seconds for c in checks)
    print(
        f"self-check: {len(checks) - len(failed)} of {len(checks)} passed in {seconds:.0f} s"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
  return EXIT_FAILED if failed else 0


def _tune(args) -> int:
  """Chooses the compression for a workload sample and writes a tuned spec (tuned.json,
  the learned allocation, front.png) into --out."""
  import pathlib

  from kvjax.eval import _data, _report
  from kvjax.tuning import parse_target, tune

  sources = [name for name in ("text", "jsonl", "task") if getattr(args, name) is not None]
  if len(sources) > 1:
    raise ValueError(f"give one of --text, --jsonl, --task (got {', '.join(sources)})")
  if args.target is not None and args.memory is not None:
    raise ValueError("give --target or --memory, not both")
  target = parse_target(
      f"memory={args.memory}" if args.memory is not None else (args.target or "kl=0.05")
  )
  for name in ("context_tokens", "continuation_tokens", "items", "steps"):
    if getattr(args, name) < (2 if name in ("items", "continuation_tokens") else 1):
      raise ValueError(f"--{name.replace('_', '-')} is too small: {getattr(args, name)}")
  if not 0 < args.held_out < 1:
    raise ValueError(f"--held-out must be a share in (0, 1), got {args.held_out}")
  out = _report.check_out(args.out)
  if (out / "tuned.json").exists() and not args.overwrite:
    raise ValueError(f"--out {out} holds a tuned.json; pass --overwrite to replace it")
  text = cases = None
  if args.jsonl is not None:
    cases = _data.read_jsonl(args.jsonl, ("context", "question"))
  elif args.text is not None:
    text = _data.read_text(args.text)
  elif args.task is None:
    text = _data.default_text()
  model, tokenizer = _load(args.model)
  if args.task is not None:
    cases = _task_cases(args.task, tokenizer, args.context_tokens, args.items)

  def say(line):
    # tune() checks the target, the policies and the sample before its first line: the
    # first line is where work began.
    _begin_work(args)
    if not args.quiet:
      print(line, file=sys.stderr, flush=True)

  result = tune(
      model,
      tokenizer,
      text=text,
      cases=cases,
      target=target,
      policies=args.policies,
      context_tokens=args.context_tokens,
      continuation_tokens=args.continuation_tokens,
      max_items=args.items,
      held_out=args.held_out,
      steps=args.steps,
      kv_dtypes=args.kv_dtypes,
      progress=say,
  )
  path = result.write(out)
  print(result.table())
  print(f"\nchosen: {result.why}")
  for name, check in result.held_out.items():
    metric = "kl" if "kl" in check else "accuracy"
    print(
        f"held out ({check['items']} items), {name}: {metric} {check[metric]}, "
        f"{check['kv_mib']:.2f} MiB per request; "
        f"{'meets' if check['meets_target'] else 'MISSES'} {result.target}"
    )
  print(
      f"wrote {path}, {pathlib.Path(out) / 'front.png'}; use it with --spec {path}", file=sys.stderr
  )
  return 0 if result.reachable else 1


def _task_cases(task: str, tokenizer, context_tokens: int, items: int) -> list[dict]:
  """A built-in question workload over the shipped text: pass keys hidden in real text at
  spread depths ('passkey'), or several facts per context ('multi-question')."""
  import numpy as np

  from kvjax.eval import _data, _tasks

  ids = tokenizer.encode(_data.default_text())
  if task == "passkey":
    depths = np.linspace(0.05, 0.95, items).round(3).tolist()
    cases = _tasks.passkey_cases(
        tokenizer, context_tokens, depths=depths, fillers=("text",), ids=ids
    )
    return [{"context": c["ids"], "question": c["question"], "answer": c["answer"]} for c in cases]
  facts = 4
  trials = max(1, -(-items // facts))
  cases = _tasks.multi_question_cases(tokenizer, ids, context_tokens, facts=facts, trials=trials)
  return [
      {
          "context": c["ids"],
          "question": f"{_data.FACT_QUESTION.format(subject=f['subject'])}",
          "answer": f["answer"],
      }
      for c in cases
      for f in c["facts"]
  ][:items]


def _policy_names():
  from kvjax.policies import POLICIES

  return list(POLICIES)


def _add_request_flags(parser, *, max_new_help: str) -> None:
  """The flags that shape a request: the model, compression, sampling, new tokens (one
  table for `generate` and `warmup`, which must see the same requests)."""
  import kvjax

  parser.add_argument(
      "--model",
      default="smollm2-135m-instruct",
      help="registry name, .gguf file or local HF checkpoint directory",
  )
  _add_dataclass_flags(parser, kvjax.CompressionSpec, title="compression (kvjax.CompressionSpec)")
  _add_dataclass_flags(parser, kvjax.Sampling, title="sampling (kvjax.Sampling)")
  parser.add_argument("--max-new-tokens", type=int, default=64, help=max_new_help)


def build_parser() -> argparse.ArgumentParser:
  import kvjax

  parser = _Parser(prog="kvjax", description="KV-cache compression for JAX.")
  sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
  gen = sub.add_parser("generate", help="generate text with a model (default: SmolLM2-135M)")
  gen.add_argument("prompt", nargs="?", default=None, help="the prompt; '-' reads it from stdin")
  gen.add_argument("--prompt-file", default=None, help="read the prompt from this UTF-8 file")
  gen.add_argument(
      "--quiet", action="store_true", help="no progress bar (none either when stderr is not a tty)"
  )
  _add_request_flags(gen, max_new_help="tokens to generate at most")
  gen.add_argument("--seed", type=int, default=0, help="seed of sampling and random eviction")
  gen.add_argument(
      "--chat",
      action=argparse.BooleanOptionalAction,
      default=True,
      help="wrap the prompt in the model's chat template (default: on)",
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
  warm = sub.add_parser(
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
  evaluation = sub.add_parser("eval", help="quality of compressed caches vs the full cache")
  tasks = evaluation.add_subparsers(dest="task", required=True, parser_class=_Parser)
  for task, text in (
      ("fidelity", "KL and top-1 agreement with the full cache over real text"),
      ("passkey", "pass-key retrieval accuracy (or your --jsonl questions)"),
      ("multi_question", "several questions answered from one context compressed once"),
      ("perplexity", "perplexity of real text after a compressed context"),
      ("retention", "fraction of an unprotected instruction's tokens kept"),
  ):
    _add_eval_options(tasks.add_parser(task.replace("_", "-"), help=text), task)
  _add_eval_options(
      sub.add_parser("bench", help="KV bytes, prefill and decode latency by request length"),
      "bench",
  )
  train = sub.add_parser(
      "train-scorer", help="train the 'learned' policy's scorer for a model (optax, orbax)"
  )
  train.add_argument(
      "--model", default="smollm2-135m-instruct", help="registry name, .gguf or HF dir"
  )
  train.add_argument(
      "--text", default=None, help="UTF-8 text to train on (default: the shipped text)"
  )
  train.add_argument("--context-tokens", type=int, default=2048, help="tokens per window")
  train.add_argument("--windows", type=int, default=24, help="text windows scored by kvzip")
  train.add_argument("--held-out", type=float, default=0.25, help="share of windows held out")
  train.add_argument("--steps", type=int, default=1500, help="Adam steps")
  train.add_argument("--seed", type=int, default=0, help="seed of the split and the init")
  train.add_argument("--out", default=None, help="scorer directory (default: kvjax-scorers/MODEL)")
  train.add_argument("--overwrite", action="store_true", help="replace an existing --out")
  train.add_argument("--quiet", action="store_true", help="no progress bars")
  train.set_defaults(func=_train_scorer)
  keep = sub.add_parser(
      "prefill", help="prefill and compress a context once and save it (kvjax ask answers)"
  )
  keep.add_argument("--context", required=True, help="UTF-8 text file of the context")
  keep.add_argument("--save", required=True, help="directory to save the state in")
  keep.add_argument("--overwrite", action="store_true", help="replace a state saved there")
  keep.add_argument(
      "--model", default="smollm2-135m-instruct", help="registry name, .gguf or HF dir"
  )
  _add_dataclass_flags(keep, kvjax.CompressionSpec, title="compression (kvjax.CompressionSpec)")
  keep.add_argument(
      "--reserve", type=int, default=256, help="room kept for a question and its answer (tokens)"
  )
  keep.add_argument(
      "--chat",
      action=argparse.BooleanOptionalAction,
      default=True,
      help="the context opens a chat user message; questions close it (default: on)",
  )
  keep.add_argument("--seed", type=int, default=0, help="seed of random eviction")
  keep.add_argument("--json", action="store_true", help="print one JSON object with stats")
  keep.add_argument("--quiet", action="store_true", help="no progress bar")
  keep.set_defaults(func=_prefill_and_save)
  ask = sub.add_parser("ask", help="answer questions from a state saved by kvjax prefill")
  ask.add_argument("state", help="directory written by kvjax prefill --save")
  ask.add_argument("question", nargs="?", default=None, help="the question")
  ask.add_argument("--jsonl", default=None, help='JSONL file of {"question": ...} lines')
  ask.add_argument(
      "--model", default=None, help="registry name, .gguf or HF dir (default: the one saved)"
  )
  ask.add_argument("--max-new-tokens", type=int, default=64, help="answer tokens at most")
  ask.add_argument("--json", action="store_true", help="one JSON object per question, with timings")
  ask.set_defaults(func=_ask)
  tuner = sub.add_parser(
      "tune", help="choose the compression for a workload sample (learned allocation, optax)"
  )
  data = tuner.add_mutually_exclusive_group()
  data.add_argument("--text", default=None, help="UTF-8 text sample (default: the shipped text)")
  data.add_argument(
      "--jsonl", default=None, help='question cases: {"context", "question", "answer"} per line'
  )
  data.add_argument(
      "--task",
      default=None,
      choices=("passkey", "multi-question"),
      help="a built-in question workload over the shipped text",
  )
  tuner.add_argument(
      "--target", default=None, help="kl=X (default kl=0.05) or accuracy=X, on held-out items"
  )
  tuner.add_argument(
      "--memory", default=None, help="K/V per request at most, e.g. 64MiB: the lowest KL within it"
  )
  tuner.add_argument("--out", default="tuned", help="directory for tuned.json (default: tuned)")
  tuner.add_argument("--overwrite", action="store_true", help="replace a tuned.json in --out")
  tuner.add_argument(
      "--model", default="smollm2-135m-instruct", help="registry name, .gguf or HF dir"
  )
  tuner.add_argument(
      "--policies",
      nargs="+",
      default=["kvzip", "expected_attention", "snapkv", "h2o"],
      metavar="POLICY",
      help="candidate policies (default: kvzip expected_attention snapkv h2o)",
  )
  tuner.add_argument(
      "--kv-dtypes",
      nargs="*",
      default=["int8", "int4"],
      choices=["int8", "int4"],
      metavar="KV_DTYPE",
      help="quantized K/V dtypes to try the chosen setting with (default: int8 int4; none: "
      "float only)",
  )
  tuner.add_argument("--context-tokens", type=int, default=1024, help="tokens per context")
  tuner.add_argument(
      "--continuation-tokens", type=int, default=32, help="text: tokens after each context"
  )
  tuner.add_argument("--items", type=int, default=24, help="contexts (or cases) used at most")
  tuner.add_argument("--held-out", type=float, default=0.34, help="share of items held out")
  tuner.add_argument("--steps", type=int, default=40, help="optax steps of the allocation")
  tuner.add_argument("--quiet", action="store_true", help="no progress lines")
  tuner.set_defaults(func=_tune)
  doctor = sub.add_parser(
      "doctor", help="backend, devices, versions, the implementation impl='auto' runs; a self-check"
  )
  doctor.add_argument("--json", action="store_true", help="print one JSON object")
  doctor.add_argument(
      "--no-self-check", action="store_true", help="the report only (no ~20 s self-check)"
  )
  doctor.set_defaults(func=_doctor)
  return parser


def main(argv=None) -> int:
  """Runs a command: exit 0; 2 with one line for a bad command line or input, a
  ValueError, TypeError or OSError raised before the command's work began (`_begin_work`:
  nothing ran); 1 with one line for any error after it, when the run fails
  (KVJAX_DEBUG=1 shows the traceback)."""
  import os

  args = build_parser().parse_args(argv)
  args.work_began = False  # set by _begin_work
  try:
    return args.func(args)
  except KeyboardInterrupt:
    print(f"kvjax {args.command}: interrupted", file=sys.stderr)
    return 130
  except Exception as err:  # noqa: BLE001 - one line, never a traceback
    if os.environ.get("KVJAX_DEBUG"):
      raise
    message = " ".join(str(err).split()) or type(err).__name__
    if not args.work_began and isinstance(err, (ValueError, TypeError, OSError)):
      print(f"kvjax {args.command}: error: {message}", file=sys.stderr)
      return EXIT_USAGE
    print(
        f"kvjax {args.command}: failed: {type(err).__name__}: {message} "
        "(KVJAX_DEBUG=1 shows the traceback)",
        file=sys.stderr,
    )
    return EXIT_FAILED


if __name__ == "__main__":
  sys.exit(main())
