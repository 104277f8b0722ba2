"""`kvjax chat`: a conversation with a model loaded once, over a context read and compressed
once, as `ollama run` keeps a model warm. Each question is read after the conversation so
far, protected from eviction, and answered (`kvjax.ask`); /reset goes back to the
compressed context."""

from __future__ import annotations

import sys
import time

from kvjax.cli import common
from kvjax.cli.spec_flags import add_dataclass_flags, check_spec_model, from_args, spec_from_args

COMMANDS = "/reset (back to the compressed context), /stats (the last turn), /quit (or Ctrl-D)"
# Room kept after the compressed context for a question (with the template's tokens around
# it) besides its answer, before the pool grows (new shapes, compiled once).
QUESTION_ROOM = 256


def add_parsers(subparsers) -> None:
  import kvjax

  chat = subparsers.add_parser(
      "chat",
      help="answer question after question, the model loaded and the context compressed once",
      description="An interactive conversation: the model loads once and the context "
      "(--context FILE, else the chat template's system prompt) is read and compressed once; "
      "then each line of stdin is a question, answered on stdout after the conversation so "
      f"far. Commands: {COMMANDS}. Loading lines and per-answer summaries go to stderr.",
  )
  chat.add_argument(
      "--context",
      default=None,
      metavar="FILE",
      help="a UTF-8 document the conversation is about: it opens the first user message, "
      "and is read and compressed once",
  )
  common.add_model_flag(chat, "registry name, .gguf file or local HF checkpoint directory")
  add_dataclass_flags(chat, kvjax.CompressionSpec, title="compression (kvjax.CompressionSpec)")
  add_dataclass_flags(chat, kvjax.Sampling, title="sampling (kvjax.Sampling)")
  chat.add_argument("--max-new-tokens", type=int, default=256, help="answer tokens at most")
  chat.add_argument("--seed", type=int, default=0, help="seed of sampling and random eviction")
  chat.add_argument(
      "--quiet", action="store_true", help="no progress bar (none either when stderr is not a tty)"
  )
  chat.set_defaults(func=_chat)


class ContextFull(Exception):
  """A question that, with room for its answer, would pass the model context."""


class Conversation:
  """One conversation: the compressed context (`start`: kept, never donated, so /reset
  returns to it) and the state after the last answer (`state`)."""

  def __init__(self, model, tokenizer, start, *, about_document, max_new_tokens, sampling):
    from kvjax.seam import ModelShape

    self.model, self.tokenizer = model, tokenizer
    self.start = self.state = start
    self.turns = 0
    self.max_context = ModelShape.of(model).max_context
    self._about_document = about_document  # `start` ends inside a user message, else before one
    self._max_new_tokens, self._sampling = max_new_tokens, sampling

  def reset(self) -> None:
    self.state, self.turns = self.start, 0

  def position(self) -> int:
    """Tokens of the conversation so far (the context's, evicted ones included)."""
    return _position(self.state)

  def encode(self, question: str) -> list[int]:
    """The ids of `question` as the next user turn; ValueError for text that is not UTF-8."""
    from kvjax.runtime.prompts import chat_request, encode_follow_up, encode_question

    if self.turns:  # closes the assistant's turn (its stop token is not cached), opens the user's
      return encode_follow_up(self.tokenizer, question)
    if self._about_document:  # closes the user message the document opened
      return encode_question(self.tokenizer, question, True)
    return chat_request(self.tokenizer, [{"role": "user", "content": question}])[1]

  def ask(self, ids: list[int]):
    """The `GenerationResult` of the question `ids` asked after the conversation so far,
    which then holds it and its answer; ContextFull, the conversation unchanged, when it and
    its answer would pass the model context."""
    import kvjax

    position = self.position()
    if position + len(ids) + self._max_new_tokens > self.max_context:
      raise ContextFull(
          f"the conversation holds {position} tokens: this question ({len(ids)} tokens) and "
          f"its answer (up to {self._max_new_tokens}) would pass the model context "
          f"{self.max_context}; /reset goes back to the compressed context"
      )
    # donate=False: `self.state` stays valid (it may be `start`), and an interrupted answer
    # leaves the conversation where it was.
    state, result = kvjax.ask(
        self.model,
        self.tokenizer,
        self.state,
        [ids],
        max_new_tokens=self._max_new_tokens,
        sampling=self._sampling,
    )
    self.state, self.turns = state, self.turns + 1
    return result


def _chat(args) -> int:
  """Loads the model, compresses the context once, then answers the questions of stdin."""
  import kvjax
  from kvjax.runtime.sampling import check_seed

  spec = spec_from_args(args)
  sampling = from_args(kvjax.Sampling, args)
  if args.max_new_tokens < 1:
    raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
  check_seed(args.seed, "--seed")
  if args.context == "-":
    raise ValueError("--context cannot read stdin ('-'): kvjax chat reads the questions there")
  document = None
  if args.context is not None:
    document = common.read_text_file(args.context)
    if not document.strip():
      raise ValueError(f"--context {args.context} is empty")
  model, tokenizer = common.load_model(args.model)
  if getattr(tokenizer, "chat_template", None) is None:
    raise ValueError(
        f"{args.model} has no chat template (a base model): kvjax chat needs a chat model; "
        "use kvjax generate"
    )
  check_spec_model(args, model, spec)
  context = _context(args, model, tokenizer, document)
  common.begin_work(args)
  start = time.perf_counter()
  state = kvjax.prefill(
      model,
      [context],
      spec,
      tokenizer=tokenizer,
      reserve=QUESTION_ROOM + args.max_new_tokens,
      seed=args.seed,
      progress=common.prefill_bar(args, spec),
  )
  common.print_summary(*_context_parts(model, state, spec, time.perf_counter() - start))
  conversation = Conversation(
      model,
      tokenizer,
      state,
      about_document=document is not None,
      max_new_tokens=args.max_new_tokens,
      sampling=sampling,
  )
  return _converse(conversation)


def _context(args, model, tokenizer, document):
  """The prompt prefilled once. With a document: the chat template's opening of a user
  message (protected), then the document, which the first question closes. Without: the
  template's part before the first user message (its system prompt), read as token ids.
  ValueError, before any work, where no question would fit in the model context after it."""
  from kvjax.runtime.prompts import chat_request, context_prompt
  from kvjax.seam import ModelShape

  if document is not None:
    context = context_prompt(tokenizer, tokenizer.encode(document), True)
    tokens = sum(len(segment.text) for segment in context)  # ids: context_prompt encodes
    name = f"--context {args.context}"
  else:
    # The part before a user message does not depend on what the message says.
    context, _ = chat_request(tokenizer, [{"role": "user", "content": "?"}])
    tokens = len(context)
    name = "the chat template's system prompt"
    if not context:
      raise ValueError(
          f"the chat template of {args.model} writes nothing before the first user message: "
          "give --context FILE"
      )
  max_context = ModelShape.of(model).max_context
  if tokens + 1 + args.max_new_tokens > max_context:
    raise ValueError(
        f"{name} is {tokens} tokens: with --max-new-tokens {args.max_new_tokens} no question "
        f"fits in the model context {max_context}"
    )
  return context


def _context_parts(model, state, spec, seconds: float) -> list[str]:
  """The summary of the compressed context: its tokens, the K/V held and the prefill time."""
  from kvjax.runtime.generation import held_stats
  from kvjax.seam import ModelShape

  stats = {**held_stats(state, ModelShape.of(model)), "compressed_once": spec.once}
  return [f"{_position(state)} context tokens", *common.kv_parts(stats), f"prefill {seconds:.2f} s"]


def _position(state) -> int:
  """Tokens a one-row state has read (its evicted ones included)."""
  import numpy as np

  return int(np.asarray(state.position).max())


def _converse(conversation: Conversation) -> int:
  """Answers each question of stdin, runs the commands; exit 0 at /quit, EOF or Ctrl-C at
  the prompt. Ctrl-C while an answer is computed drops that answer and its question: the
  conversation stays as it was before them."""
  interactive = sys.stdin.isatty()
  if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 refuse one question
    sys.stdin.reconfigure(errors="surrogateescape")
  if interactive:
    print(f"ask a question; {COMMANDS}", file=sys.stderr)
  last = None  # (result, seconds, turn) of the last answer, for /stats
  for line in _lines(interactive):
    if line in ("/quit", "/bye", "/exit"):
      break
    if not line or _command(line, conversation, last):
      continue
    try:
      ids = conversation.encode(line)
    except ValueError as err:  # not UTF-8, or a template that refuses the turn
      print(f"kvjax chat: error: {err}", file=sys.stderr)
      continue
    start = time.perf_counter()
    try:
      result = conversation.ask(ids)
    except ContextFull as err:
      print(f"kvjax chat: {err}", file=sys.stderr)
      continue
    except KeyboardInterrupt:
      print("\nanswer interrupted; the conversation is as it was before it", file=sys.stderr)
      continue
    seconds = time.perf_counter() - start
    print(result.texts[0], flush=True)
    last = (result, seconds, conversation.turns)
    common.print_summary(*_turn_parts(result, seconds))
  return 0


def _command(line: str, conversation: Conversation, last) -> bool:
  """Runs `line` if it is a command (/reset, /stats, /help; an unknown one is named):
  whether it was one. A line with a space is a question, even one that starts with /."""
  if not line.startswith("/") or " " in line:
    return False
  if line == "/reset":
    conversation.reset()
    print("back to the compressed context", file=sys.stderr)
  elif line == "/stats" and last is None:
    print("no question answered yet", file=sys.stderr)
  elif line == "/stats":
    common.print_summary(*_stats_parts(conversation, *last))
  else:
    unknown = "" if line in ("/help", "/?") else f"unknown command {line}; "
    print(f"{unknown}commands: {COMMANDS}", file=sys.stderr)
  return True


def _lines(interactive: bool):
  """The user's lines, stripped: read with a `>>> ` prompt (and line editing) on a terminal,
  as they come otherwise (piped questions keep stdout to the answers). Ends at EOF or at
  Ctrl-C."""
  if interactive:
    try:
      import readline  # noqa: F401 - input() then edits lines and keeps a history
    except ImportError:
      pass
  while True:
    try:
      line = input(">>> ") if interactive else sys.stdin.readline()
    except (EOFError, KeyboardInterrupt):
      print(file=sys.stderr)  # the terminal's cursor is after the prompt
      return
    if not interactive and not line:
      return
    yield line.strip()


def _turn_parts(result, seconds: float) -> list[str]:
  """One answer's summary: `N question + M generated tokens; KV held ...; X s`."""
  stats = result.stats
  parts = [
      f"{stats['question_tokens'][0]} question + {stats['generated_tokens'][0]} generated tokens",
      # The peaks are the conversation's, reached once (scoring the context): /stats has them.
      *common.kv_parts({**stats, "context_peak_kv_bytes": 0, "peak_kv_bytes": 0}),
      f"{seconds:.2f} s",
  ]
  if result.finish_reasons[0] == "length":
    parts.append("stopped at --max-new-tokens")
  return parts


def _stats_parts(conversation: Conversation, result, seconds: float, turn: int) -> list[str]:
  """/stats: the last turn's tokens (the conversation before it as context), the K/V held
  and the peak, its speed, and how much of the model context the conversation uses."""
  stats = result.stats
  return [
      f"turn {turn}: {common.tokens_part(stats)}",
      *common.kv_parts(stats),
      f"decode {stats['decode_tokens_per_s']:.1f} tokens/s",
      f"{seconds:.2f} s",
      f"{conversation.position()} of {conversation.max_context} context tokens used",
  ]
