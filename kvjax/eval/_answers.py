"""Answers from a compressed context: the request a context and its questions make, the
budget resolved against it, the context prefilled and compressed once, and greedy answers to
questions appended to that state (which stays valid, so one context answers many)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvjax.runtime.prompts import chat_parts, context_prompt, encode_question
from kvjax.runtime.generation import ask as kvjax_ask
from kvjax.runtime.session import prefill
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


def at_budget(spec: CompressionSpec, length: int) -> CompressionSpec:
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


def request_tokens(tokenizer, context_ids, questions: Sequence[list[int]], chat: bool) -> int:
  """Tokens of the request for the longest of `questions` (ids) about `context_ids`."""
  return len(chat_parts(tokenizer, chat)[0]) + len(context_ids) + max(map(len, questions))


# Tokens a task answers after its request, by default: the request and they must fit the
# model's context.
ANSWER_TOKENS = {"passkey": 12, "multi_question": 24}


def check_room(model, request: int, max_new_tokens: int) -> None:
  """ValueError unless a request of `request` tokens and its answer fit the model's context."""
  limit = getattr(model.config, "max_context", None)
  if limit is not None and request + max_new_tokens > limit:
    raise ValueError(
        f"a request of {request} tokens and its answer of up to {max_new_tokens} tokens pass "
        f"the model context {limit}: give context_tokens at most {limit - max_new_tokens}"
    )


def prefill_context(
    model,
    tokenizer,
    context_ids: Sequence[int],
    questions: Sequence[list[int]],
    spec: CompressionSpec,
    *,
    max_new_tokens: int,
    chat: bool,
    seed: int,
):
  """The state after the chat template's opening and `context_ids` are prefilled and
  compressed, ready for any of `questions` (ids): the budget is resolved against the
  request for the longest one, and the cache keeps room for it and the answer."""
  longest = max(map(len, questions))
  spec = at_budget(spec, request_tokens(tokenizer, context_ids, questions, chat))
  return prefill(
      model,
      [context_prompt(tokenizer, context_ids, chat)],
      spec,
      tokenizer=tokenizer,
      reserve=longest + max_new_tokens,
      seed=seed,
  )


def answer_from_state(
    model, tokenizer, state, question: str, *, max_new_tokens: int = 32, chat: bool = True
) -> str:
  """Greedy answer to `question` about the context a state holds (prefilled as
  `context_prompt`, e.g. loaded with `kvjax.load_state`); `state` stays valid, so one
  compressed context answers many questions (`kvjax.ask`)."""
  _, result = kvjax_ask(
      model, tokenizer, state, [question], chat=chat, max_new_tokens=max_new_tokens
  )
  return result.texts[0]


def ask(model, tokenizer, state, question_ids, *, max_new_tokens: int, donate: bool):
  """(greedy answer, peak KV bytes, answer ids) for `question_ids` appended to `state`
  (`kvjax.ask`: the question protected; `donate=False` leaves `state` valid for the next)."""
  state, result = kvjax_ask(
      model, tokenizer, state, [question_ids], max_new_tokens=max_new_tokens, donate=donate
  )
  return result.texts[0], state.peak_kv_bytes(), result.tokens[0]


def answer_and_peak(
    model,
    tokenizer,
    context_ids: list[int],
    question: str,
    spec: CompressionSpec,
    *,
    max_new_tokens: int,
    chat: bool,
    seed: int = 0,
    cue: str = "",
) -> tuple[str, int]:
  """`answer`, with the peak KV bytes held (`cue`: see `encode_question`)."""
  question_ids = encode_question(tokenizer, question, chat, cue)
  state = prefill_context(
      model,
      tokenizer,
      context_ids,
      [question_ids],
      spec,
      max_new_tokens=max_new_tokens,
      chat=chat,
      seed=seed,
  )
  return ask(model, tokenizer, state, question_ids, max_new_tokens=max_new_tokens, donate=True)[:2]


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
  return answer_and_peak(
      model, tokenizer, context_ids, question, spec, max_new_tokens=max_new_tokens, chat=chat
  )[0]
