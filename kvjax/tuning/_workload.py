"""A workload sample as the tuner sees it: items (a context, then a continuation), read from
text (windows: continuation fidelity) or from questions (answers about a context compressed
before the question arrives), and each item's calibration data."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from kvjax.eval._data import document_start, text_windows
from kvjax.runtime.prompts import Segment


@dataclasses.dataclass(frozen=True)
class Item:
  """One calibration or held-out case.

  The context (`ids`; `marked` tokens are protected) is prefilled and compressed, then
  `continuation` is fed teacher-forced; predictions from index `scored_from` of the
  continuation on count (text: all of them; questions: those of the answer)."""

  ids: tuple[int, ...]
  marked: tuple[bool, ...]
  continuation: tuple[int, ...]
  scored_from: int
  budget_length: int  # the length a fractional budget is resolved against (as kvjax.eval does)
  question: str | None = None
  answer: str | None = None  # expected answer text: accuracy counts answers containing it
  full_answer: str | None = None  # the full cache's greedy answer

  def correct(self, text: str) -> bool:
    """An answer is right when it contains the expected answer, or (none given) when it is
    the full cache's."""
    if self.answer is not None:
      return self.answer.strip().lower() in text.lower()
    return text.strip() == (self.full_answer or "").strip()

  @property
  def prompt(self) -> list[Segment]:
    """The context as `kvjax.prefill` takes it: runs of marked and unmarked ids."""
    out, start = [], 0
    for i in range(1, len(self.ids) + 1):
      if i == len(self.ids) or self.marked[i] != self.marked[start]:
        out.append(Segment(self.ids[start:i], protected=self.marked[start]))
        start = i
    return out


def text_items(
    tokenizer,
    text: str | Sequence[int],
    *,
    context_tokens: int = 1024,
    continuation_tokens: int = 64,
    max_items: int = 16,
) -> list[Item]:
  """Windows of `context_tokens` followed by `continuation_tokens`, evenly spread over the
  text (at most `max_items`, disjoint)."""
  ids = tokenizer.encode(text) if isinstance(text, str) else list(text)
  count = min(max_items, len(ids) // (context_tokens + continuation_tokens))
  if count < 2:
    raise ValueError(
        f"the text has {len(ids)} tokens: tuning needs at least 2 windows of "
        f"{context_tokens} + {continuation_tokens} tokens; give more text or a smaller "
        "context_tokens"
    )
  return [
      Item(
          ids=tuple(context),
          marked=(False,) * len(context),
          continuation=tuple(continuation),
          scored_from=0,
          budget_length=len(context),
      )
      for context, continuation in text_windows(
          ids, context_tokens, continuation_tokens, count, document_start(tokenizer)
      )
  ]


def question_items(
    model,
    tokenizer,
    cases: Sequence[dict],
    *,
    max_new_tokens: int = 24,
    progress: Callable[[str], None] | None = None,
) -> list[Item]:
  """Items for question cases ({"context": str or ids, "question", "answer"?, "cue"?: how a
  plain-text model's answer starts, see `kvjax.eval._answers.encode_question`}): the context
  as `kvjax.eval.context_prompt` prefills it (the template's opening protected), then the
  question and the full cache's greedy answer, whose predictions are scored."""
  from kvjax.eval._answers import ask, context_prompt, encode_question, request_tokens
  from kvjax.runtime.session import prefill

  items = []
  for i, case in enumerate(cases):
    if case.get("answer") is not None and not isinstance(case["answer"], str):
      raise ValueError(f"case {i}: 'answer' must be a string, got {case['answer']!r}")
    context = case["context"]
    context_ids = tokenizer.encode(context) if isinstance(context, str) else list(context)
    question_ids = encode_question(tokenizer, case["question"], True, case.get("cue", ""))
    prompt = context_prompt(tokenizer, context_ids)
    state = prefill(model, [prompt], tokenizer=tokenizer, reserve=len(question_ids) + 64)
    text, _, tokens = ask(
        model, tokenizer, state, question_ids, max_new_tokens=max_new_tokens, donate=True
    )
    if not tokens:
      raise ValueError(f"case {i}: the full cache answers nothing to {case['question']!r}")
    items.append(
        Item(
            ids=tuple(t for segment in prompt for t in segment.text),
            marked=tuple(segment.protected for segment in prompt for _ in segment.text),
            continuation=tuple(question_ids) + tuple(tokens),
            scored_from=len(question_ids),
            budget_length=request_tokens(tokenizer, context_ids, [question_ids], True),
            question=case["question"],
            answer=case.get("answer"),
            full_answer=text,
        )
    )
    if progress is not None:
      progress(f"full-cache answer {i + 1}/{len(cases)}: {text!r}")
  return items


def split(items: Sequence[Item], held_out: float) -> tuple[list[Item], list[Item]]:
  """(tune, held-out): every k-th item held out, at least one of each."""
  n = len(items)
  if n < 2:
    raise ValueError(f"tuning needs at least 2 items (one to tune on, one held out), got {n}")
  n_held = min(n - 1, max(1, round(n * held_out)))
  held_idx = set(np.linspace(n - 1, 0, n_held).round().astype(int).tolist())
  tune = [it for i, it in enumerate(items) if i not in held_idx]
  held = [it for i, it in enumerate(items) if i in held_idx]
  return tune, held
