"""`kvjax tune` (choose the compression for a workload sample and write a tuned spec) and
`kvjax train-scorer` (train the 'learned' policy's scorer for a model)."""

from __future__ import annotations

import sys

from kvjax.cli import common


def add_train_scorer_parser(subparsers) -> None:
  train = subparsers.add_parser(
      "train-scorer", help="train the 'learned' policy's scorer for a model (optax, orbax)"
  )
  common.add_model_flag(train)
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


# How long the default run takes, measured (`kvjax tune --out tuned`, 2026-12-07; its steps'
# times are `kvjax.tuning._eta.STEP_SECONDS`).
DEFAULT_RUN_TIME = (
    "the default run (SmolLM2-135M-Instruct, the shipped text, 24 items of 1024 + 32 tokens) "
    "took 31 min on a 2-core AMD EPYC CPU shared with other work; it grows with --items, "
    "--context-tokens and the model"
)


def add_tune_parser(subparsers) -> None:
  tuner = subparsers.add_parser(
      "tune",
      help="choose the compression for a workload sample (learned allocation, optax)",
      description="Measures candidate policies, budgets, a learned head allocation and "
      "quantized pages on a workload sample, chooses the setting that meets --target with the "
      "least memory (or, with --memory, the lowest KL within it), checks it on held-out items "
      f"and writes tuned.json and front.png into --out. How long: {DEFAULT_RUN_TIME}. It "
      'prints its progress on stderr, with an estimate of the time left ("about 12 min '
      'left").',
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
  common.add_model_flag(tuner)
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
  from kvjax.runtime.sampling import check_seed

  check_seed(args.seed, "--seed")
  text = _data.read_text(args.text) if args.text else _data.default_text()
  model, tokenizer = common.load_model(args.model)
  training.check_options(
      model, context_tokens=args.context_tokens, windows=args.windows, held_out=args.held_out
  )
  ids = tokenizer.encode(text)
  _data.text_windows(ids, args.context_tokens, 0, args.windows)  # the text is long enough
  common.begin_work(args)
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
      progress=common.show_progress(args),
  )
  path = scorer.save(out, overwrite=args.overwrite)
  m = scorer.metrics
  print(
      f"held-out ({m['held_out_windows']} windows): log-score R^2 {m['r2']:.3f}, "
      f"{m['top25_overlap']:.1%} of kvzip's best 25% tokens found; {m['total_seconds']:.0f} s"
  )
  print(f"saved {path}; use it with --policy learned --scorer {path}", file=sys.stderr)
  return 0


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
  model, tokenizer = common.load_model(args.model)
  if args.task is not None:
    cases = _task_cases(args.task, tokenizer, args.context_tokens, args.items)

  def say(line):
    # tune() checks the target, the policies and the sample before its first line: the
    # first line is where work began.
    common.begin_work(args)
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
    keep = ("question", "cue", "answer")
    return [{"context": c["ids"], **{k: c[k] for k in keep}} for c in cases]
  facts = 4
  trials = max(1, -(-items // facts))
  cases = _tasks.multi_question_cases(tokenizer, ids, context_tokens, facts=facts, trials=trials)
  return [
      {
          "context": c["ids"],
          "question": _data.FACT_QUESTION.format(subject=f["subject"]),
          "cue": _data.FACT_CUE.format(subject=f["subject"]),
          "answer": f["answer"],
      }
      for c in cases
      for f in c["facts"]
  ][:items]
