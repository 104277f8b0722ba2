"""Evaluation tasks built on `fidelity` and generation: answers, passkey retrieval,
perplexity, instruction retention.

Each task takes a `kvjax.CompressionSpec` (its `budget` in tokens, or a fraction in (0, 1)
of the request length) and returns a dict of metrics with `cases`,
`failed` and `errors`: a case that crashes is counted as failed and its error kept, never
dropped. Bad arguments raise before any case runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import numpy as np

from kvjax.cache import logical_view, valid_mask
from kvjax.eval import _data
from kvjax.eval._fidelity import continuation_logits, fidelity, full_cache_spec
from kvjax.prompts import Segment
from kvjax.session import decode, extend, prefill
from kvjax.spec import CompressionSpec


def resolve_budget(spec: CompressionSpec | None, length: int) -> int | None:
  """Tokens kept per sequence for a request of `length` tokens (None: the full cache).

  Raises ValueError for a budget larger than the request or one that cannot hold the
  protected sink + recent tokens."""
  spec = CompressionSpec() if spec is None else spec
  tokens = spec.budget_tokens(length)
  if tokens is not None and tokens > length:
    raise ValueError(
        f"budget={spec.budget} ({tokens} tokens) is larger than the request of {length} "
        "tokens: nothing would be evicted; use policy 'full' or a smaller budget"
    )
  return tokens


def _at_budget(spec: CompressionSpec, length: int) -> CompressionSpec:
  """`spec` with its budget in tokens for a request of `length` tokens."""
  spec = CompressionSpec() if spec is None else spec
  tokens = resolve_budget(spec, length)
  return spec if tokens is None else spec.replace(budget=tokens)


def run_cases(cases: Sequence, fn: Callable, progress: Callable | None = None):
  """Runs `fn` on every case; returns (results, errors) with None for a crashed case."""
  results, errors = [], []
  for case in cases:
    try:
      results.append(fn(case))
    except Exception as err:  # noqa: BLE001 - a crashed case is reported, not skipped
      results.append(None)
      errors.append(f"{type(err).__name__}: {err}")
    if progress is not None:
      progress()
  return results, errors


def _chat_parts(tokenizer, chat: bool) -> tuple[list[int], list[int]]:
  """Token ids of the chat template before and after the user's message."""
  if not chat:
    return [], []
  marker = "\x00kvjax\x00"
  before, after = tokenizer.apply_chat_template([{"role": "user", "content": marker}]).split(marker)
  return tokenizer.encode(before), tokenizer.encode(after)


def _question_ids(tokenizer, question: str, chat: bool) -> list[int]:
  return tokenizer.encode("\n\n" + question) + _chat_parts(tokenizer, chat)[1]


def _answer(
    model,
    tokenizer,
    context_ids: list[int],
    question: str,
    spec: CompressionSpec,
    *,
    max_new_tokens: int,
    chat: bool,
    seed: int = 0,
) -> tuple[str, int]:
  """`answer`, with the peak KV bytes held."""
  opening, _ = _chat_parts(tokenizer, chat)
  question_ids = _question_ids(tokenizer, question, chat)
  request = len(opening) + len(context_ids) + len(question_ids)
  spec = _at_budget(spec, request)
  # The template's own tokens and the question are protected: the question stays cached
  # while the answer is generated; only the context competes for the budget.
  context = [Segment(opening, protected=True), Segment(list(context_ids))]
  state = prefill(
      model,
      [context],
      spec,
      tokenizer=tokenizer,
      reserve=len(question_ids) + max_new_tokens,
      seed=seed,
  )
  state = extend(model, state, [[Segment(question_ids, protected=True)]], donate=True)
  state, result = decode(
      model, state, max_new_tokens, stop_tokens=tokenizer.eos_ids or (), donate=True
  )
  text = tokenizer.decode(result.tokens[0], skip_special_tokens=True)
  return text, state.peak_kv_bytes()


def answer(
    model,
    tokenizer,
    context: str | Sequence[int],
    question: str,
    spec: CompressionSpec | None = None,
    *,
    max_new_tokens: int = 32,
    chat: bool = True,
) -> str:
  """Greedy answer to `question` about `context`.

  The context (after the chat template's opening) is prefilled and compressed to the
  budget (a fraction is of the whole request's tokens); the question is then appended,
  protected from eviction, and the answer generated (decode-time eviction applies).
  """
  if not isinstance(question, str) or not question.strip():
    raise ValueError("question must be a non-empty string")
  context_ids = tokenizer.encode(context) if isinstance(context, str) else list(context)
  if not context_ids:
    raise ValueError("context is empty")
  spec = CompressionSpec() if spec is None else spec
  return _answer(
      model, tokenizer, context_ids, question, spec, max_new_tokens=max_new_tokens, chat=chat
  )[0]


def _check_depths(depths):
  if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
    raise ValueError(f"depths must be a non-empty list of fractions in [0, 1], got {depths!r}")


def passkey_case(tokenizer, context_tokens: int, depth: float, key: str, chat: bool = True):
  """Context ids (filler with the pass key at `depth`) sized so that the whole request
  (template, context, question) is `context_tokens` tokens."""
  opening, _ = _chat_parts(tokenizer, chat)
  overhead = len(opening) + len(_question_ids(tokenizer, _data.PASSKEY_QUESTION, chat))
  needle = tokenizer.encode(_data.PASSKEY_NEEDLE.format(key=key))
  intro = tokenizer.encode(_data.PASSKEY_INTRO)
  fixed = overhead + len(intro) + len(needle)
  if context_tokens <= fixed:
    raise ValueError(
        f"context_tokens={context_tokens} is too short for a passkey request: the template, "
        f"instructions, key and question alone take {fixed} tokens"
    )
  ids, _ = _data.fill_to(
      tokenizer,
      intro,
      _data.PASSKEY_FILLER,
      context_tokens - overhead,
      needle,
      depth,
  )
  return ids


def _first_number(text: str) -> str | None:
  match = re.search(r"\d+", text)
  return match.group(0) if match else None


def passkey(
    model,
    tokenizer,
    *,
    context_tokens: int,
    spec: CompressionSpec | None = None,
    depths: Sequence[float] = (0.1, 0.5, 0.9),
    trials: int = 1,
    seed: int = 0,
    max_new_tokens: int = 12,
    cases: Sequence[dict] | None = None,
    progress: Callable | None = None,
) -> dict:
  """Retrieval accuracy: a 5-digit pass key hidden at each depth of a synthetic filler
  request of `context_tokens` tokens, `trials` keys per depth; correct when the first number
  of the greedy answer is the key. `cases` (dicts with context, question, answer) replaces
  the synthetic ones: correct when the expected answer appears in the model's answer.
  """
  if cases is None:
    _check_depths(depths)
    if not isinstance(trials, int) or trials < 1:
      raise ValueError(f"trials must be an int >= 1, got {trials!r}")
    rng = np.random.default_rng(seed)
    cases = [
        {"depth": float(d), "answer": str(rng.integers(10000, 100000))}
        for d in depths
        for _ in range(trials)
    ]
    for case in cases:
      case["ids"] = passkey_case(tokenizer, context_tokens, case["depth"], case["answer"])
      case["question"] = _data.PASSKEY_QUESTION
  else:
    cases = [{**c, "ids": tokenizer.encode(c["context"])} for c in cases]
  for case in cases:  # bad budgets fail here, before any case runs
    opening, _ = _chat_parts(tokenizer, True)
    request = (
        len(opening) + len(case["ids"]) + len(_question_ids(tokenizer, case["question"], True))
    )
    resolve_budget(spec, request)

  def run(case):
    text, peak = _answer(
        model,
        tokenizer,
        case["ids"],
        case["question"],
        spec,
        max_new_tokens=max_new_tokens,
        chat=True,
        seed=seed,
    )
    if "depth" in case:
      correct = _first_number(text) == case["answer"]
    else:
      correct = case["answer"].strip().lower() in text.lower()
    return {"correct": correct, "answer": text, "peak_kv_bytes": peak}

  results, errors = run_cases(cases, run, progress)
  done = [r for r in results if r is not None]
  correct = sum(r["correct"] for r in done)
  return {
      "accuracy": correct / len(cases),  # a crashed case counts as wrong
      "correct": correct,
      "peak_kv_bytes": max((r["peak_kv_bytes"] for r in done), default=None),
      "cases": len(cases),
      "failed": len(errors),
      "errors": errors,
      "answers": [
          {
              "depth": c.get("depth"),
              "expected": c["answer"],
              "answer": None if r is None else r["answer"],
          }
          for c, r in zip(cases, results)
      ],
  }


def windowed_fidelity(
    model,
    tokenizer,
    ids: Sequence[int],
    *,
    context_tokens: int,
    continuation_tokens: int = 64,
    windows: int = 2,
    spec: CompressionSpec | None = None,
    references: dict | None = None,
    progress: Callable | None = None,
) -> dict:
  """`fidelity` over `windows` disjoint windows of `ids`: mean `kl` and `top1`, pooled
  `ppl` and `ppl_full` (windows have equal lengths), the largest `peak_kv_bytes`.

  `references` (a dict, filled on first use) caches the full-cache logits per window, so a
  sweep over policies runs the full cache once per window.
  """
  pairs = _data.text_windows(list(ids), context_tokens, continuation_tokens, windows)
  spec = _at_budget(spec, context_tokens)
  reference = full_cache_spec(spec)
  references = {} if references is None else references

  def run(pair):
    context, continuation = pair
    key = (tuple(context), tuple(continuation), reference)
    if key not in references:
      references[key] = continuation_logits(model, context, continuation, reference)[0]
    return fidelity(
        model, context, continuation, spec, reference_logits=references[key], tokenizer=tokenizer
    )

  results, errors = run_cases(pairs, run, progress)
  done = [r for r in results if r is not None]
  mean = lambda name: float(np.mean([r[name] for r in done])) if done else None  # noqa: E731
  pooled = lambda name: (  # noqa: E731
      float(np.exp(np.mean([np.log(r[name]) for r in done]))) if done else None
  )
  return {
      "kl": mean("kl"),
      "top1": mean("top1"),
      "ppl": pooled("ppl"),
      "ppl_full": pooled("ppl_full"),
      "peak_kv_bytes": max((r["peak_kv_bytes"] for r in done), default=None),
      "cases": len(pairs),
      "failed": len(errors),
      "errors": errors,
  }


def perplexity(
    model,
    tokenizer,
    ids: Sequence[int],
    *,
    context_tokens: int,
    continuation_tokens: int = 128,
    windows: int = 2,
    spec: CompressionSpec | None = None,
    **options,
) -> dict:
  """Perplexity of real continuations after a compressed context (`ppl`), next to the
  full cache's (`ppl_full`), over `windows` disjoint windows of `ids`."""
  result = windowed_fidelity(
      model,
      tokenizer,
      ids,
      context_tokens=context_tokens,
      continuation_tokens=continuation_tokens,
      windows=windows,
      spec=spec,
      **options,
  )
  return {k: v for k, v in result.items() if k not in ("kl", "top1")}


def instruction_retention(
    model,
    tokenizer,
    ids: Sequence[int],
    *,
    context_tokens: int,
    spec: CompressionSpec | None = None,
    instruction: str = _data.RETENTION_INSTRUCTION,
    depths: Sequence[float] = (0.1, 0.5, 0.9),
    seed: int = 0,
    progress: Callable | None = None,
) -> dict:
  """Fraction of an instruction's tokens still cached after a request of `context_tokens`
  tokens (text from `ids` with the instruction at each depth) is prefilled and compressed.

  The instruction is marked as a segment but not protected: this measures whether the
  policy keeps it by itself. `retention` is averaged over layers, kv heads and depths;
  `retained_all` is the fraction of sequences (layer x head x depth) holding all of it.
  """
  _check_depths(depths)
  instruction_ids = tokenizer.encode(instruction)
  if len(ids) < context_tokens:
    raise ValueError(f"text has {len(ids)} tokens; context_tokens={context_tokens} need more")
  spec = _at_budget(spec, context_tokens)

  def run(depth):
    room = context_tokens - len(instruction_ids)
    if room < 1:
      raise ValueError(f"context_tokens={context_tokens} cannot hold the instruction")
    at = int(round(depth * room))
    # Segments 1, 2, 3: text before, the instruction (not protected), text after.
    row = [Segment(list(ids[:at])), Segment(instruction_ids), Segment(list(ids[at:room]))]
    state = prefill(model, [row], spec, tokenizer=tokenizer, reserve=1, seed=seed)
    cache = state.cache
    kept = (logical_view(cache, cache.slot("segment")) == 2) & valid_mask(cache)  # [L, B, H, N]
    per_sequence = np.asarray(kept.sum(-1)) / len(instruction_ids)  # [L, B, H]
    return {
        "retention": float(per_sequence.mean()),
        "retained_all": float((per_sequence >= 1.0).mean()),
        "peak_kv_bytes": state.peak_kv_bytes(),
    }

  results, errors = run_cases(list(depths), run, progress)
  done = [r for r in results if r is not None]
  return {
      "retention": float(np.mean([r["retention"] for r in done])) if done else None,
      "retained_all": float(np.mean([r["retained_all"] for r in done])) if done else None,
      "peak_kv_bytes": max((r["peak_kv_bytes"] for r in done), default=None),
      "cases": len(depths),
      "failed": len(errors),
      "errors": errors,
  }
