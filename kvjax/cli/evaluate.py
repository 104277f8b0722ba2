"""`kvjax eval TASK` (quality of compressed caches against the full cache) and `kvjax bench`
(memory and latency): a sweep over policies x budgets x request lengths, written to --out."""

from __future__ import annotations

import sys

from kvjax.cli import common
from kvjax.cli.spec_flags import add_dataclass_flags, check_spec_model, spec_from_args

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
_EVAL_TASKS = (
    ("fidelity", "KL and top-1 agreement with the full cache over real text"),
    ("passkey", "pass-key retrieval accuracy (or your --jsonl questions)"),
    ("multi_question", "several questions answered from one context compressed once"),
    ("perplexity", "perplexity of real text after a compressed context"),
    ("retention", "fraction of an unprotected instruction's tokens kept"),
)


def add_parsers(subparsers) -> None:
  evaluation = subparsers.add_parser("eval", help="quality of compressed caches vs the full cache")
  tasks = evaluation.add_subparsers(dest="task", required=True, parser_class=common.Parser)
  for task, text in _EVAL_TASKS:
    _add_eval_options(tasks.add_parser(task.replace("_", "-"), help=text), task)
  _add_eval_options(
      subparsers.add_parser("bench", help="KV bytes, prefill and decode latency by request length"),
      "bench",
  )


def _add_eval_options(parser, task: str) -> None:
  """The flags of `task`: where the run reads and writes, the swept compression, the task's
  own options."""
  from kvjax.spec import CompressionSpec

  parser.set_defaults(func=_evaluate, task=task)
  _add_run_flags(parser, task)
  add_dataclass_flags(
      parser, CompressionSpec, sweep=True, title="compression (policy and budget: one or several)"
  )
  _add_task_flags(parser, task)


def _add_run_flags(parser, task: str) -> None:
  """The model, the request lengths, the data, the output directory, --quick, --quiet."""
  common.add_model_flag(parser)
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


def _add_task_flags(parser, task: str) -> None:
  """The options of `task` alone (`_eval_options` reads them)."""
  for flag, options in _task_flags(task):
    parser.add_argument(flag, default=None, **options)


def _task_flags(task: str) -> list[tuple[str, dict]]:
  """(flag, argparse options) of `task`'s own options, in the order its help lists them."""
  flags = []
  if task in ("fidelity", "perplexity"):
    continuation = 64 if task == "fidelity" else 128
    flags += [
        ("--windows", _count("text windows per length (default: 8; --quick: 1)")),
        (
            "--continuation-tokens",
            _count(f"tokens scored after each window (default: {continuation}; --quick: 16)"),
        ),
    ]
  if task in ("passkey", "retention"):
    depths = " ".join(map(str, _DEFAULT_DEPTHS if task == "passkey" else [0.1, 0.5, 0.9]))
    where = f"where the needle sits, fractions of the context (default: {depths}; --quick: 0.5)"
    flags.append(("--depths", dict(nargs="+", type=float, help=where)))
  if task == "passkey":
    haystacks = (
        "haystacks: 'repeat' (a synthetic sentence group, repeated), 'text' (a window of "
        "--text or the shipped text per case) and/or 'needles' (such a window with a key per "
        "door, three doors, one asked) (default: text needles; --quick: repeat)"
    )
    flags += [
        ("--trials", _count("keys per filler and depth (default: 4; --quick: 1)")),
        ("--fillers", dict(nargs="+", help=haystacks)),
    ]
  if task == "multi_question":
    flags += [
        ("--facts", _count("questions per context (default: 4)")),
        ("--trials", _count("contexts per length (default: 6; --quick: 1)")),
    ]
  if task == "bench":
    flags += [
        ("--decode-steps", _count("decoded tokens timed (default: 32; --quick: 8)")),
        ("--repeats", _count("timed runs, median kept (default: 3; --quick: 1)")),
    ]
  return flags


def _count(help: str) -> dict:
  return dict(type=int, help=help)


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
  configurations, _ = _sweep.configuration_specs(  # every configuration, checked
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
  model, tokenizer = common.load_model(args.model)
  check_spec_model(args, model)
  for configuration in configurations.values():  # sizes within the model context
    configuration.check_context(model.config.max_context)
  if args.allocation is not None:  # a tuned spec's is checked with the spec
    allocation.check_model(model)

  def keep(partial):  # after each configuration: keep what finished
    # _sweep.run checks every configuration and the data before the first runs, and
    # records a configuration that crashes as a result: the first row is where work began.
    common.begin_work(args)
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
      progress=common.show_progress(args),
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
