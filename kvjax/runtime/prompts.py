"""Prompts as kvjax takes them: strings, token ids, or lists of marked `Segment`s."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Segment:
  """A piece of a prompt: text, or token ids used as they are. Protected segments are never
  evicted; with `fair=True` every segment loses the same fraction of its tokens."""

  text: str | tuple[int, ...]
  protected: bool = False

  def __post_init__(self):
    text = self.text
    if isinstance(text, (np.ndarray, list, tuple)) and not isinstance(text, str):
      ids = np.asarray(text).reshape(-1) if len(text) else np.zeros(0, np.int32)
      if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"Segment: token ids must be integers, got dtype {ids.dtype}")
      object.__setattr__(self, "text", tuple(int(t) for t in ids))
    elif not isinstance(text, str):
      raise TypeError(
          f"Segment: text must be a str or a sequence of token ids, got {type(text).__name__}"
      )
    if not isinstance(self.protected, bool):
      raise TypeError(f"Segment: protected must be True or False, got {self.protected!r}")


@dataclasses.dataclass(frozen=True)
class EncodedPrompts:
  """Token ids of a batch, with per-token protection and segment ids (0 = unmarked)."""

  ids: list[list[int]]
  protected: list[list[bool]]
  segment: list[list[int]]

  @classmethod
  def unmarked(cls, ids: list[list[int]]) -> "EncodedPrompts":
    """Rows of token ids with nothing protected and no segment."""
    return cls(ids, [[False] * len(row) for row in ids], [[0] * len(row) for row in ids])

  @property
  def lengths(self) -> np.ndarray:
    return np.array([len(x) for x in self.ids], np.int32)

  def longest(self, max_context: int, new_tokens: int = 0) -> int:
    """The longest row's length; ValueError when it, or it and `new_tokens` to generate,
    pass the model context."""
    longest = int(self.lengths.max())
    if longest > max_context:
      raise ValueError(f"prompt of {longest} tokens is longer than the model context {max_context}")
    if longest + new_tokens > max_context:
      raise ValueError(
          f"prompt ({longest} tokens) + max_new_tokens ({new_tokens}) exceeds the model "
          f"context {max_context}"
      )
    return longest

  def padded(self, width: int):
    """([B, width] ids, protected, segment) right-padded with zeros."""
    out = [np.zeros((len(self.ids), width), dtype) for dtype in (np.int32, bool, np.int32)]
    for row in range(len(self.ids)):
      for array, values in zip(out, (self.ids[row], self.protected[row], self.segment[row])):
        array[row, : len(values)] = values
    return out


def has_text(prompts) -> bool:
  """Whether `prompts` (or a context) hold any text to encode (str or a Segment of text),
  not only token ids; an `EncodedPrompts` is encoded already."""
  if isinstance(prompts, str):
    return True
  if isinstance(prompts, Segment):
    return isinstance(prompts.text, str)
  if isinstance(prompts, (EncodedPrompts, np.ndarray)) or not isinstance(prompts, Sequence):
    return False
  return any(has_text(p) for p in prompts if not isinstance(p, (int, np.integer)))


def check_text(text: str, name: str) -> str:
  """`text` if it can be encoded as UTF-8; a ValueError naming `name` and the offending
  character otherwise (a lone surrogate, e.g. an undecodable byte of a command line)."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as err:
    bad = text[err.start]
    byte = f" (byte 0x{ord(bad) - 0xDC00:02x})" if 0xDC80 <= ord(bad) <= 0xDCFF else ""
    raise ValueError(
        f"{name} is not valid UTF-8 text: character {err.start} is {bad!r}{byte}; "
        "pass UTF-8 text"
    ) from None
  return text


def _is_token_ids(prompt) -> bool:
  if isinstance(prompt, np.ndarray):
    return prompt.ndim == 1 and (prompt.size == 0 or np.issubdtype(prompt.dtype, np.integer))
  return bool(prompt) and all(isinstance(p, (int, np.integer)) for p in prompt)


def encode_prompts(
    tokenizer,
    prompts,
    *,
    chat: bool,
    vocab_size: int,
    allow_empty: bool = False,
    start: bool = True,
) -> EncodedPrompts:
  """Encodes str / token-id (list or 1-D array) / `Segment`-list prompts. With `chat`, each
  text prompt is a context that opens a user message of the chat template (`context_prompt`:
  the template's opening protected, the context compressible); a question closes it later
  (`encode_question`, `kvjax.ask`). `allow_empty` lets rows add nothing (a follow-up for some rows only). A text
  prompt that `start`s a sequence begins with the tokenizer's BOS where its `add_bos` says
  so (Gemma's), protected, unless the chat template wrote it; token ids are used as given.
  Prompts encoded already (`generate` checks them before `prefill`) are used as they are."""
  if isinstance(prompts, EncodedPrompts):
    return prompts
  if (
      isinstance(prompts, (str, bytes))
      or not isinstance(prompts, (Sequence, np.ndarray))
      or len(prompts) == 0
  ):
    raise ValueError("prompts must be a non-empty list of strings, token-id lists or segment lists")
  ids, protected, segment = [], [], []
  for i, prompt in enumerate(prompts):
    if isinstance(prompt, (str, Segment)):
      prompt = [prompt]
    given_ids = _is_token_ids(prompt)
    if given_ids:
      row = [int(t) for t in np.asarray(prompt).reshape(-1)]
      pieces = [(row, False, 0)]
    elif allow_empty and len(prompt) == 0:
      pieces = []
    else:
      if not isinstance(prompt, (Sequence, np.ndarray)) or not prompt:
        raise ValueError(f"prompts[{i}] is empty")
      if not all(isinstance(p, (Segment, str)) for p in prompt):
        raise ValueError(
            f"prompts[{i}] must be a str, token ids, or a list of str/Segment; it mixes "
            f"{sorted({type(p).__name__ for p in prompt})}"
        )
      parts = [p if isinstance(p, Segment) else Segment(p) for p in prompt]
      if (
          not any(isinstance(p.text, tuple) and p.text for p in parts)
          and not "".join(p.text for p in parts if isinstance(p.text, str)).strip()
      ):
        raise ValueError(f"prompts[{i}] is empty")
      pieces = [(p.text, p.protected, n + 1) for n, p in enumerate(parts)]
      if chat:
        if tokenizer is None:
          raise ValueError("chat=True needs a tokenizer")
        if getattr(tokenizer, "chat_template", None) is None:
          raise ValueError("chat=True: the tokenizer has no chat template (a base model)")
        pieces = [(chat_parts(tokenizer, True)[0], True, 0), *pieces]
    row_ids, row_protected, row_segment = [], [], []
    for text, is_protected, seg in pieces:
      if isinstance(text, str):
        if text and tokenizer is None:
          raise ValueError(f"prompts[{i}] has text: pass tokenizer= (or give token ids)")
        check_text(text, f"prompts[{i}]")
        piece = tokenizer.encode(text) if text else []
      else:
        piece = list(text)
      row_ids += piece
      row_protected += [is_protected] * len(piece)
      row_segment += [seg] * len(piece)
    bos = getattr(tokenizer, "bos_id", None)
    if start and not given_ids and pieces and getattr(tokenizer, "add_bos", False):
      if row_ids[:1] != [bos]:
        row_ids, row_protected = [bos, *row_ids], [True, *row_protected]
        row_segment = [0, *row_segment]
    bad = [t for t in row_ids if not 0 <= t < vocab_size]
    if bad:
      raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab_size}): {bad[:5]}")
    if not row_ids and not allow_empty:
      raise ValueError(f"prompts[{i}] is empty")
    ids.append(row_ids), protected.append(row_protected), segment.append(row_segment)
  return EncodedPrompts(ids, protected, segment)


_MARKER = "\x00kvjax\x00"  # stands for a message's content in a rendered template


def _render_around(tokenizer, messages, add_generation_prompt=True) -> tuple[str, str]:
  """The rendered chat template before and after the last message's content, which
  `messages` gives as `_MARKER`."""
  rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
  if rendered.count(_MARKER) != 1:
    raise ValueError("the chat template does not render a message's content as it is given")
  before, after = rendered.split(_MARKER)
  return before, after


def chat_parts(tokenizer, chat: bool) -> tuple[list[int], list[int]]:
  """Token ids of the chat template before and after the user's message; none where `chat`
  is off or the model has no template (a base model reads the request as plain text)."""
  if not chat or getattr(tokenizer, "chat_template", None) is None:
    return [], []
  before, after = _render_around(tokenizer, [{"role": "user", "content": _MARKER}])
  return tokenizer.encode(before), tokenizer.encode(after)


def _user_turn_opening(tokenizer) -> str:
  """The text a chat template writes before a user message's content when the turn before
  it has closed (ChatML's "<|im_start|>user\\n", Gemma's "<start_of_turn>user\\n"): what sits
  between an assistant message and the next user message, less what closes the assistant's.
  "" where the template does not tell them apart."""
  m1, m2, m3 = (_MARKER.replace("kvjax", f"kvjax{i}") for i in (1, 2, 3))
  try:
    turns = [{"role": "user", "content": m1}, {"role": "assistant", "content": m2}]
    closing = tokenizer.apply_chat_template(turns, add_generation_prompt=False).split(m2)[-1]
    rendered = tokenizer.apply_chat_template(
        [*turns, {"role": "user", "content": m3}], add_generation_prompt=False
    )
  except ValueError:  # a template that refuses these turns: no opening is told apart
    return ""
  between = rendered.split(m2)[-1].split(m3)[0]
  return between[len(closing) :] if between.startswith(closing) else ""


def context_prompt(tokenizer, context, chat: bool) -> list[Segment]:
  """The prompt a context is read as before its question (`encode_question`): in chat mode the
  template's opening of a user message (protected: the system prompt and role markers),
  then the context, which the question closes; else the context alone (a sequence's `<bos>`
  comes first where the tokenizer starts sequences with one). `context`: text or ids."""
  ids = tokenizer.encode(check_text(context, "context")) if isinstance(context, str) else context
  ids = [int(t) for t in np.asarray(ids).reshape(-1)]
  if not ids:
    raise ValueError("context is empty")
  opening, _ = chat_parts(tokenizer, chat)
  return [Segment(opening, protected=True), Segment(ids)]


# A question to a model read as plain text (a base model, no chat template) is framed as
# few-shot evaluations of base models frame it, and a built-in task cues the answer with the
# words its needle uses ("The pass key is"): uncued, a base model tends to continue the
# document or to start every number with a 1 (Gemma 3 270M: 1 of 6 cases right, cued 6 of 6).
PLAIN_QUESTION = "\n\nQuestion: {question}\nAnswer:"


def encode_question(tokenizer, question: str, chat: bool, cue: str = "") -> list[int]:
  """Token ids of `question` after a context (`context_prompt`): in the chat template where
  the model has one (closing the user's message, then the generation prompt), else as plain
  text, followed by `cue` if any."""
  if not isinstance(question, str) or not question.strip():
    raise ValueError(f"a question must be non-empty text, got {question!r}")
  check_text(question, "question")
  if chat and getattr(tokenizer, "chat_template", None) is not None:
    return tokenizer.encode("\n\n" + question) + chat_parts(tokenizer, chat)[1]
  return tokenizer.encode(PLAIN_QUESTION.format(question=question) + (f" {cue}" if cue else ""))


def chat_request(tokenizer, messages) -> tuple[list[int], list[int]]:
  """(context ids, question ids) of a chat: the question is the last user message with the
  template's tokens around it (its turn's opening, its closing) and the generation prompt;
  the context is everything before it (a system prompt, earlier turns, a `<bos>`). A chat
  whose last message is not the user's has no question: all of it is context. Read apart,
  the context may be compressed and the question never is."""
  if not messages:
    raise ValueError("messages is empty")
  *earlier, last = [dict(m) for m in messages]
  if last.get("role") != "user":
    text = tokenizer.apply_chat_template([*earlier, last], add_generation_prompt=True)
    return tokenizer.encode(text), []
  content = check_text(last.get("content", ""), "the last user message")
  before, after = _render_around(tokenizer, [*earlier, {"role": "user", "content": _MARKER}])
  opening = _user_turn_opening(tokenizer)
  if opening and before.endswith(opening):
    before, question = before[: len(before) - len(opening)], opening + content + after
  else:
    question = content + after
  return (tokenizer.encode(before) if before else []), tokenizer.encode(question)


def encode_follow_up(tokenizer, question: str) -> list[int]:
  """Token ids of a next user turn after an answer (the answer's stop token is not cached):
  the template's closing of the assistant's message and opening of the user's, `question`,
  then its closing and the generation prompt. Protected like any question (`kvjax.ask`)."""
  if not isinstance(question, str) or not question.strip():
    raise ValueError(f"a question must be non-empty text, got {question!r}")
  check_text(question, "question")
  m1, m2 = (_MARKER.replace("kvjax", f"kvjax{i}") for i in (1, 2))
  turns = [
      {"role": "user", "content": m1},
      {"role": "assistant", "content": m2},
      {"role": "user", "content": _MARKER},
  ]
  between, after = _render_around(tokenizer, turns)
  between = between.split(m2)[-1]
  return tokenizer.encode(between) + tokenizer.encode(question) + tokenizer.encode(after)


@dataclasses.dataclass(frozen=True)
class EncodedRequest:
  """A batch's prompts as they are read: `context` first (and compressed), then `question`
  (protected, never evicted; None where no row has one)."""

  context: EncodedPrompts
  question: EncodedPrompts | None

  @property
  def lengths(self) -> np.ndarray:
    q = 0 if self.question is None else self.question.lengths
    return self.context.lengths + q

  @property
  def longest_question(self) -> int:
    return 0 if self.question is None else int(self.question.lengths.max())


def _is_chat(prompt) -> bool:
  """A conversation: a list of {"role": ..., "content": ...} messages."""
  return (
      isinstance(prompt, Sequence)
      and not isinstance(prompt, str)
      and len(prompt) > 0
      and all(isinstance(m, Mapping) for m in prompt)
  )


def encode_request(tokenizer, prompts, context, chat: bool, vocab_size: int) -> EncodedRequest:
  """The context rows and the question rows of `kvjax.generate`'s prompts: with `context`,
  the context (`context_prompt`) then each prompt as a question (`encode_question`); in chat
  mode without it, each chat split at its last user message (`chat_request`); raw text and
  token ids all context; marked segments as marked, in a user message closed by the
  template (protected)."""
  if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
    raise ValueError(
        "prompts must be a non-empty list of strings, token-id lists, segment lists or chats"
    )
  if context is not None:
    contexts = _contexts(context, len(prompts))
    rows = [context_prompt(tokenizer, c, chat) for c in contexts]
    questions = []
    for i, q in enumerate(prompts):
      if isinstance(q, str):
        questions.append(encode_question(tokenizer, q, chat))
      elif len(q) and all(isinstance(t, (int, np.integer)) for t in q):
        questions.append([int(t) for t in q])
      else:
        raise ValueError(f"prompts[{i}]: with context=, a prompt is a question (str or ids)")
    return _encoded(rows, questions, vocab_size, tokenizer)
  if not chat:
    if any(_is_chat(p) for p in prompts):
      raise ValueError("a prompt given as chat messages needs chat=True")
    return EncodedRequest(
        encode_prompts(tokenizer, prompts, chat=False, vocab_size=vocab_size), None
    )
  if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
    raise ValueError("chat=True needs a tokenizer with a chat template")
  rows, questions = [], []
  for i, prompt in enumerate(prompts):
    if isinstance(prompt, str) or _is_chat(prompt):
      messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
      if isinstance(prompt, str) and not prompt.strip():
        raise ValueError(f"prompts[{i}] is empty")
      ctx, question = chat_request(tokenizer, messages)
      if ctx:
        rows.append([Segment(ctx)])
        questions.append(question)
      else:  # nothing before the question: it is read first, protected
        rows.append([Segment(question, protected=True)])
        questions.append([])
    elif _is_token_ids(prompt):
      rows.append(prompt)  # ids are read as they are
      questions.append([])
    else:  # marked segments: the user's marks, inside a user message closed by the template
      before, after = chat_parts(tokenizer, True)
      parts = [prompt] if isinstance(prompt, Segment) else list(prompt)
      rows.append([Segment(before), *parts, Segment(after, protected=True)])
      questions.append([])
  return _encoded(rows, questions, vocab_size, tokenizer)


def _contexts(context, rows: int) -> list:
  """One context per row: `context` for all (text or ids) or one per prompt."""
  if isinstance(context, str) or _is_token_ids(context):
    return [context] * rows
  if isinstance(context, Sequence) and len(context) == rows:
    if all(isinstance(c, str) or _is_token_ids(c) for c in context):
      return list(context)
  raise ValueError(
      f"context must be text or token ids (one context for every prompt), or a list of "
      f"{rows} of them (one per prompt); got {type(context).__name__}"
  )


def _encoded(rows, questions, vocab_size, tokenizer) -> EncodedRequest:
  context = encode_prompts(tokenizer, rows, chat=False, vocab_size=vocab_size)
  if not any(questions):
    return EncodedRequest(context, None)
  question = encode_prompts(
      tokenizer,
      [[Segment(q, protected=True)] if q else [] for q in questions],
      chat=False,
      vocab_size=vocab_size,
      allow_empty=True,
      start=False,
  )
  return EncodedRequest(context, question)
