"""`kvjax prefill` (compress a context once and save the state) and `kvjax ask` (answer
questions from a saved state without reading the context again)."""

from __future__ import annotations

import argparse
import sys
import time

from kvjax.cli import common
from kvjax.cli.spec_flags import add_dataclass_flags, check_spec_model, spec_from_args
from models.registry import DEFAULT_MODEL


def add_parsers(subparsers) -> None:
  _add_prefill_parser(subparsers)
  _add_ask_parser(subparsers)


def _add_prefill_parser(subparsers) -> None:
  from kvjax.spec import CompressionSpec

  keep = subparsers.add_parser(
      "prefill", help="prefill and compress a context once and save it (kvjax ask answers)"
  )
  keep.add_argument("--context", required=True, help="UTF-8 text file of the context")
  keep.add_argument("--save", required=True, help="directory to save the state in")
  keep.add_argument("--overwrite", action="store_true", help="replace a state saved there")
  common.add_model_flag(keep)
  add_dataclass_flags(keep, CompressionSpec, title="compression (kvjax.CompressionSpec)")
  keep.add_argument(
      "--reserve",
      type=int,
      default=256,
      help="room kept for a question and its answer (tokens; at most what the model context "
      "leaves after the context)",
  )
  keep.add_argument(
      "--chat",
      action=argparse.BooleanOptionalAction,
      default=None,
      help="the context opens a chat user message; questions close it (default: on where the "
      "model has a chat template)",
  )
  keep.add_argument("--seed", type=int, default=0, help="seed of random eviction")
  keep.add_argument("--json", action="store_true", help="print one JSON object with stats")
  keep.add_argument("--quiet", action="store_true", help="no progress bar")
  keep.set_defaults(func=_prefill_and_save)


def _add_ask_parser(subparsers) -> None:
  ask = subparsers.add_parser("ask", help="answer questions from a state saved by kvjax prefill")
  ask.add_argument("state", help="directory written by kvjax prefill --save")
  ask.add_argument("question", nargs="?", default=None, help="the question")
  ask.add_argument("--jsonl", default=None, help='JSONL file of {"question": ...} lines')
  ask.add_argument(
      "--model",
      default=None,
      help="registry name, .gguf or HF dir (default: the one kvjax prefill recorded); it must "
      "have the weights the state was saved with",
  )
  ask.add_argument("--max-new-tokens", type=int, default=64, help="answer tokens at most")
  ask.add_argument("--json", action="store_true", help="one JSON object per question, with timings")
  ask.set_defaults(func=_ask)


def _prefill_and_save(args) -> int:
  """Prefills a context file once, compresses it, and saves the state (`kvjax ask` answers
  from it)."""
  import json
  import pathlib

  import kvjax
  from kvjax.runtime.generation import held_stats
  from kvjax.runtime.prompts import context_prompt
  from kvjax.runtime.sampling import check_seed
  from kvjax.seam import ModelShape

  spec = spec_from_args(args)
  if args.reserve < 0:
    raise ValueError(f"--reserve must be >= 0, got {args.reserve}")
  check_seed(args.seed, "--seed")
  # What `kvjax ask` loads by default, from any directory (an unknown name fails here).
  source = common.model_source(args.model)
  save = pathlib.Path(args.save)
  if (save / kvjax.persistence.CURRENT).exists() and not args.overwrite:
    raise ValueError(f"--save {save} holds a saved state; pass --overwrite to replace it")
  if save.exists() and not save.is_dir():
    raise ValueError(f"--save {save} exists and is not a directory")
  text = common.read_text_file(args.context)
  if not text.strip():
    raise ValueError(f"--context {args.context} is empty")
  model, tokenizer = common.load_model(args.model)
  check_spec_model(args, model, spec)
  args.chat = common.wants_chat(args, tokenizer)
  prompt = context_prompt(tokenizer, tokenizer.encode(text), args.chat)
  tokens = [t for segment in prompt for t in segment.text]  # ids (context_prompt encodes)
  if len(tokens) > model.config.max_context:
    raise ValueError(
        f"--context {args.context} is {len(tokens)} tokens, longer than the model context "
        f"{model.config.max_context}"
    )
  common.begin_work(args)
  start = time.perf_counter()
  state = kvjax.prefill(
      model,
      [prompt],
      spec,
      tokenizer=tokenizer,
      reserve=args.reserve,
      seed=args.seed,
      progress=common.prefill_bar(args, spec),
  )
  prefill_seconds = time.perf_counter() - start
  start = time.perf_counter()
  kvjax.save_state(
      save,
      state,
      model,
      tokenizer=tokenizer,
      tokens=[tokens],
      info={"model": source, "chat": args.chat, "context": str(args.context)},
      overwrite=args.overwrite,
  )
  stats = {
      "context_tokens": len(tokens),
      **held_stats(state, ModelShape.of(model)),
      "compressed_once": spec.once,
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
  common.print_summary(
      f"{stats['context_tokens']} context tokens",
      *common.kv_parts(stats),
      f"prefill {prefill_seconds:.2f} s",
      f"saved {save} ({common.mib(stats['disk_bytes'])} MiB) in {stats['save_seconds']:.2f} s",
  )
  return 0


def _ask(args) -> int:
  """Answers questions from a state saved by `kvjax prefill`, without reading the context
  again."""
  import json
  import os

  import kvjax
  from kvjax.eval import _data

  if args.question is None and args.jsonl is None and not os.path.isdir(args.state):
    raise ValueError(
        f"the state folder is missing: {args.state!r} is not a directory (kvjax ask STATE "
        "QUESTION: STATE is the folder kvjax prefill --save wrote)"
    )
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
  name = args.model or _recorded_model(args.state, saved)
  start = time.perf_counter()
  model, tokenizer = common.load_model(name)
  model_seconds = time.perf_counter() - start
  _check_weights(args.state, info, model, name)
  furthest = max(info["position"]) + args.max_new_tokens
  if furthest > model.config.max_context:
    raise ValueError(
        f"--max-new-tokens {args.max_new_tokens} after the state's {max(info['position'])} "
        f"tokens passes the model context {model.config.max_context}"
    )
  common.begin_work(args)  # the state's arrays are read from here: a damaged one is a failure
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
    _, result = kvjax.ask(
        model, tokenizer, state, [question], chat=chat, max_new_tokens=args.max_new_tokens
    )
    seconds = time.perf_counter() - start
    text, stats = result.texts[0], result.stats
    if args.json:
      record = {"question": question, "answer": text, "answer_seconds": seconds}
      record.update(model_seconds=model_seconds, load_seconds=load_seconds, stats=stats)
      print(json.dumps(record), flush=True)
    else:
      print(text, flush=True)
    common.print_summary(
        f"{stats['question_tokens'][0]} question + {stats['generated_tokens'][0]} generated "
        "tokens",
        *common.kv_parts({**stats, "context_peak_kv_bytes": 0, "peak_kv_bytes": 0}),
        f"answered in {seconds:.2f} s",
    )
  return 0


def _recorded_model(path, saved: dict) -> str:
  """The model `kvjax prefill` recorded in the state's info (a registry name or an
  absolute path: `common.model_source`), or the default model where none was recorded;
  ValueError, before anything loads, when it names nothing here (a state saved by an older
  kvjax with a relative path, a checkpoint moved since)."""
  recorded = saved.get("model")
  if recorded is None:
    return DEFAULT_MODEL
  if not isinstance(recorded, str):
    raise ValueError(f"{path}: the recorded model {recorded!r} is not a name; pass --model")
  try:
    common.model_source(recorded)
  except (ValueError, OSError) as err:
    raise ValueError(
        f"{path} was prefilled with model {recorded!r}, not found from here ({err}); pass "
        "--model"
    ) from None
  return recorded


def _check_weights(path, info: dict, model, name: str) -> None:
  """ValueError, before the state's arrays are read, when `model` lacks the weights the
  state was saved with (`kvjax.load_state` checks the same, as a damaged state's failure)."""
  from kvjax.fingerprint import model_fingerprint

  saved = info.get("model") or {}
  fingerprint = model_fingerprint(model)
  if saved.get("fingerprint") != fingerprint:
    raise ValueError(
        f"{path} was saved for model {saved.get('name')!r} with weights "
        f"{str(saved.get('fingerprint'))[:12]}; the model {name!r} has other weights "
        f"({fingerprint[:12]}): pass the one it was saved with as --model"
    )
