"""Evaluation tasks built on `fidelity` and generation: answers, passkey retrieval,
multi-question answering from one compressed context, perplexity, instruction retention.

Each task takes a `kvjax.CompressionSpec` (its `budget` in tokens, or a fraction in (0, 1)
of the request length) and returns a dict of metrics with `cases`,
`failed` and `errors`: a case that crashes is counted as failed and its error kept, never
dropped. Bad arguments raise before any case runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import numpy as np

from kvjax.cache.paged_cache import logical_view, valid_mask
from kvjax.eval import _data
from kvjax.eval._fidelity import continuation_logits, fidelity, full_cache_spec
from kvjax.runtime.prompts import Segment
from kvjax.eval._answers import (
    ANSWER_TOKENS,
    answer_and_peak,
    ask,
    at_budget,
    check_room,
    encode_question,
    prefill_context,
    request_tokens,
    resolve_budget,
    run_cases,
)
from kvjax.runtime.session import prefill
from kvjax.spec import CompressionSpec
from kvjax._checks import check_int

# Haystacks of a passkey case: the repeated synthetic filler; real text; real text with a
# key per door (`_data.DOORS`), one door asked.
FILLERS = ("repeat", "text", "needles")
TEXT_FILLERS = ("text", "needles")  # the ones that take windows of real text


def check_depths(depths):
  """Raises ValueError unless `depths` is a non-empty list of fractions in [0, 1]."""
  if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
    raise ValueError(f"depths must be a non-empty list of fractions in [0, 1], got {depths!r}")


def check_counts(**counts):
  """Raises ValueError for a count (trials=, facts=, ...) that is not an int >= 1."""
  for name, value in counts.items():
    check_int(name, value)


def check_facts(facts: int) -> None:
  """Raises ValueError unless `facts` is an int in [1, one per subject]."""
  check_counts(facts=facts)
  if facts > len(_data.FACT_SUBJECTS):
    raise ValueError(f"facts must be <= {len(_data.FACT_SUBJECTS)} (one subject each), got {facts}")


def check_fillers(fillers: Sequence[str]) -> tuple[str, ...]:
  """`fillers` as a tuple; ValueError unless it is a non-empty list of `FILLERS` names."""
  if isinstance(fillers, str) or not fillers or any(f not in FILLERS for f in fillers):
    raise ValueError(f"fillers must be a non-empty list of {', '.join(FILLERS)}, got {fillers!r}")
  return tuple(fillers)


def _default_ids(tokenizer) -> list[int]:
  """The shipped default text, tokenized (the text when a task is given none)."""
  return tokenizer.encode(_data.default_text())


def passkey_case(
    tokenizer,
    context_tokens: int,
    depth: float,
    key: str,
    chat: bool = True,
    text: Sequence[int] | None = None,
    *,
    others: Sequence[tuple[str, str]] = (),
    door: str | None = None,
    question: str = _data.PASSKEY_QUESTION,
    cue: str = "",
):
  """Context ids (the pass key at `depth` of a haystack: the repeated synthetic filler, or
  the first tokens of `text` ids) sized so that the whole request (template, context,
  question) is `context_tokens` tokens. With a `door`, the key is that door's and `others`
  ((door, key) pairs) are placed too, spread evenly from `depth` around the text. `cue`
  starts a plain-text model's answer (`encode_question`)."""
  if door is None:
    needle = tokenizer.encode(_data.PASSKEY_NEEDLE.format(key=key))
    rest = []
  else:
    needle = tokenizer.encode(_data.DOOR_NEEDLE.format(door=door, key=key))
    rest = [tokenizer.encode(_data.DOOR_NEEDLE.format(door=d, key=k)) for d, k in others]
  intro = tokenizer.encode(_data.PASSKEY_INTRO)
  question = encode_question(tokenizer, question, chat, cue)
  fixed = request_tokens(tokenizer, intro + needle + sum(rest, []), [question], chat)
  if context_tokens <= fixed:
    raise ValueError(
        f"context_tokens={context_tokens} is too short for a passkey request: the template, "
        f"instructions, keys and question alone take {fixed} tokens"
    )
  room = context_tokens - fixed
  if text is None:
    length = room + len(intro) + len(needle)
    return _data.fill_to(tokenizer, intro, _data.PASSKEY_FILLER, length, needle, depth)[0]
  if len(text) < room:
    raise ValueError(f"a text window of {len(text)} tokens is too short for {room} filler tokens")
  # The other keys at depth + 1/n, + 2/n, ... around the text (kept off its very ends).
  spread = [0.05 + 0.9 * ((depth + (i + 1) / (len(rest) + 1)) % 1.0) for i in range(len(rest))]
  inserts = [(needle, depth), *zip(rest, spread)]
  return intro + _data.embed(tokenizer, text[:room], inserts)[0]


def passkey_cases(
    tokenizer,
    context_tokens: int,
    *,
    depths: Sequence[float] = (0.1, 0.5, 0.9),
    trials: int = 1,
    fillers: Sequence[str] = ("repeat",),
    seed: int = 0,
    ids: Sequence[int] | None = None,
) -> list[dict]:
  """The synthetic passkey cases, fillers x depths x trials: dicts with filler, depth,
  answer (the key), question and ids (the context). "text" cases take disjoint windows of
  `ids` (default: the shipped text), one per case."""
  check_depths(depths)
  check_counts(trials=trials)
  fillers = check_fillers(fillers)
  # Keys are drawn in this order, so the "repeat" cases keep the keys they had before
  # fillers existed.
  rng = np.random.default_rng(seed)
  cases = [
      {"filler": f, "depth": float(d), "answer": str(rng.integers(10000, 100000))}
      for f in fillers
      for d in depths
      for _ in range(trials)
  ]
  # The doors' keys and the door asked come from a stream of their own, so the cases of
  # the other fillers keep their keys.
  doors = np.random.default_rng([seed, 1])
  in_text = [c for c in cases if c["filler"] in TEXT_FILLERS]
  if in_text:
    ids = _default_ids(tokenizer) if ids is None else ids
    for case, window in zip(in_text, _data.windows(ids, context_tokens, len(in_text))):
      case["text"] = window
  for case in cases:
    door, others = None, ()
    question, cue = _data.PASSKEY_QUESTION, _data.PASSKEY_CUE
    if case["filler"] == "needles":
      order = doors.permutation(len(_data.DOORS))
      door = _data.DOORS[order[0]]
      others = [(_data.DOORS[i], str(doors.integers(10000, 100000))) for i in order[1:]]
      question = _data.DOOR_QUESTION.format(door=door)
      cue = _data.DOOR_CUE.format(door=door)
      case["door"] = door
    case["ids"] = passkey_case(
        tokenizer,
        context_tokens,
        case["depth"],
        case["answer"],
        text=case.pop("text", None),
        door=door,
        others=others,
        question=question,
        cue=cue,
    )
    case["question"], case["cue"] = question, cue
  return cases


def _first_number(text: str | None) -> str | None:
  match = re.search(r"\d+", text or "")
  return match.group(0) if match else None


def passkey(
    model,
    tokenizer,
    *,
    context_tokens: int,
    spec: CompressionSpec | None = None,
    depths: Sequence[float] = (0.1, 0.5, 0.9),
    trials: int = 1,
    fillers: Sequence[str] = ("repeat",),
    ids: Sequence[int] | None = None,
    seed: int = 0,
    max_new_tokens: int = ANSWER_TOKENS["passkey"],
    cases: Sequence[dict] | None = None,
    progress: Callable | None = None,
) -> dict:
  """Retrieval accuracy: a 5-digit pass key hidden at each depth of a haystack request of
  `context_tokens` tokens, `trials` keys per filler and depth; correct when the first number
  of the greedy answer is the key. `fillers` are the haystacks: "repeat" (a synthetic
  sentence group, repeated) and "text" (a window of real text, `ids` or the shipped text,
  per case). `cases` (dicts with context, question, answer) replaces the synthetic ones:
  correct when the expected answer appears in the model's answer.
  """
  if cases is None:
    cases = passkey_cases(
        tokenizer,
        context_tokens,
        depths=depths,
        trials=trials,
        fillers=fillers,
        seed=seed,
        ids=ids,
    )
  else:
    cases = [{**c, "ids": tokenizer.encode(c["context"])} for c in cases]
  for case in cases:  # bad budgets and lengths fail here, before any case runs
    question = encode_question(tokenizer, case["question"], True, case.get("cue", ""))
    request = request_tokens(tokenizer, case["ids"], [question], True)
    resolve_budget(spec, request)
    check_room(model, request, max_new_tokens)

  def run(case):
    text, peak = answer_and_peak(
        model,
        tokenizer,
        case["ids"],
        case["question"],
        spec,
        max_new_tokens=max_new_tokens,
        chat=True,
        seed=seed,
        cue=case.get("cue", ""),
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
              "filler": c.get("filler"),
              "depth": c.get("depth"),
              **({"door": c["door"]} if "door" in c else {}),
              "expected": c["answer"],
              "answer": None if r is None else r["answer"],
          }
          for c, r in zip(cases, results)
      ],
  }


def multi_question_case(
    tokenizer,
    text: Sequence[int],
    context_tokens: int,
    facts: Sequence[tuple[str, str]],
    chat: bool = True,
) -> dict:
  """One context for `multi_question`: the first tokens of `text` (ids) with a fact
  sentence per (subject, key) of `facts` at evenly spread depths (0.1 to 0.9 of the text),
  sized so that the request for the longest question is `context_tokens` tokens.

  Returns {"ids": the context, "facts": [{"subject", "answer" (the key), "depth", "at" (the
  fact's first index in ids), "question_ids"}] in the order given}."""
  n = len(facts)
  depths = [round(d, 3) for d in np.linspace(0.1, 0.9, n).tolist()] if n > 1 else [0.5]
  inserts = [tokenizer.encode(_data.FACT.format(subject=s, key=k)) for s, k in facts]
  questions = [
      encode_question(
          tokenizer,
          _data.FACT_QUESTION.format(subject=s),
          chat,
          _data.FACT_CUE.format(subject=s),
      )
      for s, _ in facts
  ]
  fixed = request_tokens(tokenizer, [], questions, chat) + sum(map(len, inserts))
  room = context_tokens - fixed
  if room < 1:
    raise ValueError(
        f"context_tokens={context_tokens} is too short for {n} facts: the template, facts "
        f"and longest question alone take {fixed} tokens"
    )
  if len(text) < room:
    raise ValueError(f"a text window of {len(text)} tokens is too short for {room} text tokens")
  ids, starts = _data.embed(tokenizer, text[:room], list(zip(inserts, depths)))
  return {
      "ids": ids,
      "facts": [
          {"subject": s, "answer": k, "depth": d, "at": at, "question_ids": q}
          for (s, k), d, at, q in zip(facts, depths, starts, questions)
      ],
  }


def multi_question_cases(
    tokenizer,
    ids: Sequence[int],
    context_tokens: int,
    *,
    facts: int = 4,
    trials: int = 6,
    seed: int = 0,
) -> list[dict]:
  """`trials` `multi_question_case`s, each in its own window of `ids`, with `facts`
  distinct subjects and distinct random 5-digit keys."""
  check_facts(facts)
  check_counts(trials=trials)
  subjects = _data.FACT_SUBJECTS
  rng = np.random.default_rng(seed)
  cases = []
  for text in _data.windows(ids, context_tokens, trials):
    chosen = rng.choice(len(subjects), facts, replace=False)
    keys = rng.choice(90000, facts, replace=False) + 10000
    pairs = [(subjects[i], str(k)) for i, k in zip(chosen, keys)]
    cases.append(multi_question_case(tokenizer, text, context_tokens, pairs))
  return cases


def multi_question(
    model,
    tokenizer,
    ids: Sequence[int] | None = None,
    *,
    context_tokens: int,
    spec: CompressionSpec | None = None,
    facts: int = 4,
    trials: int = 6,
    seed: int = 0,
    max_new_tokens: int = ANSWER_TOKENS["multi_question"],
    progress: Callable | None = None,
) -> dict:
  """Query-agnostic compression: one context compressed once, then several questions.

  Each of `trials` contexts is a window of real text (`ids`; default: the shipped text)
  with `facts` facts ("The code of the red door is 48213.") at evenly spread depths,
  `context_tokens` tokens with the longest question. The context is prefilled and
  compressed once (the budget a fraction of that request); every fact's question is then
  appended (protected) to a copy of that same state and answered greedily; correct when the
  first number of the answer is the fact's code. `accuracy` is over all questions; a
  crashed context counts all its questions wrong. `answers` has one record per question.
  """
  ids = _default_ids(tokenizer) if ids is None else ids
  cases = multi_question_cases(
      tokenizer, ids, context_tokens, facts=facts, trials=trials, seed=seed
  )
  for case in cases:  # bad budgets and lengths fail here, before any case runs
    questions = [f["question_ids"] for f in case["facts"]]
    request = request_tokens(tokenizer, case["ids"], questions, True)
    resolve_budget(spec, request)
    check_room(model, request, max_new_tokens)

  def run(case):
    questions = [f["question_ids"] for f in case["facts"]]
    state = prefill_context(
        model,
        tokenizer,
        case["ids"],
        questions,
        spec,
        max_new_tokens=max_new_tokens,
        chat=True,
        seed=seed,
    )
    # Not donated: every question starts from the same compressed context.
    return [
        ask(model, tokenizer, state, q, max_new_tokens=max_new_tokens, donate=False)[:2]
        for q in questions
    ]

  results, errors = run_cases(cases, run, progress)
  answers = [
      {
          "case": i,
          "subject": fact["subject"],
          "depth": fact["depth"],
          "expected": fact["answer"],
          "answer": None if result is None else result[j][0],
      }
      for i, (case, result) in enumerate(zip(cases, results))
      for j, fact in enumerate(case["facts"])
  ]
  correct = sum(_first_number(a["answer"]) == a["expected"] for a in answers)
  peaks = [peak for result in results if result is not None for _, peak in result]
  return {
      "accuracy": correct / len(answers),  # a crashed context's questions count as wrong
      "correct": correct,
      "questions": len(answers),
      "peak_kv_bytes": max(peaks, default=None),
      "cases": len(cases),
      "failed": len(errors),
      "errors": errors,
      "answers": answers,
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
  start = _data.document_start(tokenizer)
  pairs = _data.text_windows(list(ids), context_tokens, continuation_tokens, windows, start)
  spec = at_budget(spec, context_tokens)
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
      "kept_fraction": mean("kept_fraction"),
      "kv_bytes": mean("kv_bytes"),
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
  check_depths(depths)
  instruction_ids = tokenizer.encode(instruction)
  if len(ids) < context_tokens:
    raise ValueError(f"text has {len(ids)} tokens; context_tokens={context_tokens} need more")
  spec = at_budget(spec, context_tokens)

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
