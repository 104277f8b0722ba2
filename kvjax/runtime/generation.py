"""Generation in one call, on the session API: a context read (and compressed), a question
read after it and never evicted, then the answer decoded.

    model, tokenizer = models.load_llama()
    result = kvjax.generate(model, tokenizer, ["What is the capital of France?"], chat=True)
    result = kvjax.generate(model, tokenizer, ["Who signed it?"], spec, context=report, chat=True)
    print(result.texts[0], result.stats)

`stream=True` returns an iterator of `TokenEvent`s instead (one host round trip per token,
by design); its `.result` holds the `GenerationResult` once it is exhausted. `ask` answers
questions about a state already prefilled (`kvjax.prefill`, `kvjax.load_state`).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np
from jaxtyping import Array

from kvjax.cache.pages import pages_for
from kvjax.cache.paged_cache import to_host
from kvjax.cache.sizing import full_cache_bytes
from kvjax.runtime.prompts import (
    EncodedPrompts,
    EncodedRequest,
    Segment,
    _is_token_ids,
    encode_question,
    encode_request,
    has_text,
)
from kvjax.runtime.tokenizer import tokenizer_for
from kvjax.seam import ModelShape
from pallas_kernels import page_format
from kvjax.sharding import num_shards
from kvjax.runtime import session, steps
from kvjax.runtime.compilation import compile_stats
from kvjax.runtime.sampling import Sampling, check_seed
from kvjax.runtime.session import decode
from kvjax.runtime.state import State
from kvjax.spec import CompressionSpec
from kvjax._checks import check_int


@dataclasses.dataclass(frozen=True)
class TokenEvent:
  """One generated token of one row (streaming mode) and the text it completes. A row's
  `text` pieces concatenate to exactly its final text: a token that ends inside a
  multi-byte character adds "" until the character is complete. `token` is None for a
  row's last piece when its generation ended inside a character."""

  row: int
  token: int | None
  text: str


class TextStream:
  """One row's generated text, piece by piece: `push` token ids, get the text they
  complete; `finish` returns the rest. The pieces concatenate to exactly
  `tokenizer.decode(ids, skip_special_tokens=True)`."""

  def __init__(self, tokenizer):
    self._tokenizer = tokenizer
    self._ids: list[int] = []
    self._sent = ""

  def push(self, ids) -> str:
    self._ids += list(ids)
    text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
    # A token can end inside a multi-byte character, which decodes to U+FFFD until the
    # next tokens complete it: hold trailing replacement characters back.
    stable = text.rstrip("\ufffd")
    if len(stable) <= len(self._sent) or not stable.startswith(self._sent):
      return ""
    piece, self._sent = stable[len(self._sent) :], stable
    return piece

  def finish(self) -> str:
    """The text not sent yet (replacement characters that no later token completed)."""
    text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
    piece, self._sent = text[len(self._sent) :], text
    return piece


@dataclasses.dataclass
class GenerationResult:
  """What `generate` and `ask` return (and a streaming `Generation` holds once done): per
  row the generated text, its token ids and why it finished, and the run's `stats`: tokens
  of the context, the question and the answer; `kv_bytes_held` after the prompt was read
  (the context compressed, the question after it) against `full_kv_bytes`, what the full
  cache holds for the same tokens; `context_peak_kv_bytes`, the most held while the context
  was read and scored, and `peak_kv_bytes` over the whole request; seconds, compiles, the
  spec; `compression_skipped`: why the full cache ran instead, or None."""

  texts: list[str] | None  # None without a tokenizer
  tokens: list[list[int]]  # generated ids per row, stop token excluded
  finish_reasons: list[str]  # "stop" (an EOS id) or "length" (max_new_tokens)
  stats: dict


class CompressionSkipped(UserWarning):
  """A request whose budget could not save a page of K/V ran with the full cache."""


def skip_reason(spec: CompressionSpec, request: EncodedRequest, max_new: int) -> str | None:
  """Why compressing this request cannot save a page of any sequence (then the full cache
  runs instead), or None. A sequence of a compress-once policy holds its context's budget,
  the question and the answer; one of a running policy holds at most its budget, or its
  protected tokens and sink where they are more. The full cache holds every token."""
  if not spec.evicts or spec.auto:
    return None
  ps = spec.page_size
  context = request.context.lengths
  question = request.lengths - context
  protected = np.array([sum(row) for row in request.context.protected])
  budget = spec.budget_tokens(int(context.max()))
  full = request.lengths + max_new
  if spec.once:
    held = np.minimum(context, np.maximum(budget, protected)) + question + max_new
  else:
    held = np.minimum(full, np.maximum(budget, protected + question + spec.sink))
  if (pages_for(held, ps) < pages_for(full, ps)).any():
    return None
  longest = int(np.argmax(request.lengths))
  asked = f" + {int(question[longest])} question (protected)" if question.any() else ""
  return (
      f"compression skipped: {spec.policy.name} at budget {spec.budget} cannot save a "
      f"{ps}-token page of this request ({int(context[longest])} context{asked} + {max_new} "
      "new tokens); the full cache was used"
  )


def generate(
    model,
    tokenizer,
    prompts,
    spec: CompressionSpec | None = None,
    *,
    context=None,
    max_new_tokens: int = 64,
    sampling: Sampling = Sampling(),
    chat: bool = False,
    seed: int = 0,
    key: Array | None = None,
    stream: bool = False,
    progress: Callable[[int, int], None] | None = None,
    mesh=None,
    stop_tokens=None,
) -> GenerationResult | "Generation":
  """Generates continuations of a batch of prompts of different lengths.

  What is compressed and what never is: with `context`, the context is read and compressed
  and each prompt is a question read after it, protected from eviction by every policy for
  the rest of the request (the same tokens as `prefill` + `ask`). Without it, in chat mode
  the last user message (with the template's tokens around it and the generation prompt)
  is that question and the system prompt and earlier turns are the context; raw text
  (`chat=False`) is all context. Where the budget cannot save a page of the request (a
  prompt too short for it), the full cache runs instead, with a `CompressionSkipped`
  warning saying why, and `stats["compression_skipped"]` says so too.

  Args:
    model: a `models.Llama`, or any model with the kvjax seam (`kvjax.seam`).
    tokenizer: encodes text and the chat template, decodes the outputs: kvjax's contract
      (`kvjax.runtime.tokenizer.TokenizerLike`), a `tokenizers.Tokenizer` or a transformers
      tokenizer (`kvjax.as_tokenizer`). None with token-id prompts: the outputs are then
      ids only (`texts` is None) and `stop_tokens` must be given.
    prompts: per row a string, a chat (a list of {"role", "content"} messages, `chat=True`),
      token ids used as they are, or a list of `Segment`s (marked spans: protected ones are
      never evicted; each is a segment for `fair`).
    spec: the `CompressionSpec` (default: the full cache); a fractional budget is of the
      context's tokens.
    context: a document the prompts ask about (text or ids), the same for every row, or a
      list of one per row; in chat mode it opens the user's message and the question closes it.
    max_new_tokens: per row; a row also stops at any of the tokenizer's EOS ids.
    sampling: a `Sampling` (greedy by default); `key` (or `seed`, an int in
      [0, 2**32 - 1]) drives it.
    chat: use the model's chat template (see above).
    stream: return a `Generation` iterator of `TokenEvent`s instead of the result.
    progress: `progress(tokens_read, tokens_total)` as the context is read and scored.
    mesh: shard the cache and the model over devices, e.g. "data=2,model=2" (`prefill`).
    stop_tokens: ids that end a row (default: the tokenizer's `eos_ids`); `()` runs every
      row to `max_new_tokens`.
  """
  check_int("max_new_tokens", max_new_tokens)
  if not isinstance(sampling, Sampling):
    raise TypeError(f"sampling must be a kvjax.Sampling, got {type(sampling).__name__}")
  spec = CompressionSpec() if spec is None else spec
  if not isinstance(spec, CompressionSpec):
    raise TypeError(f"spec must be a kvjax.CompressionSpec, got {type(spec).__name__}")
  if key is None:
    check_seed(seed)
  shape = ModelShape.of(model)
  # Here, not in the stream: a stream runs nothing until it is read, and the CLI counts an
  # error from it as a failed run. Every size the cache gets is bounded by the model.
  spec.check_context(shape.max_context)
  if tokenizer is None:
    _stop_tokens(None, stop_tokens)  # names what is missing first
  tokenizer = tokenizer_for(tokenizer, _needs(tokenizer, prompts, context, chat, stop_tokens))
  stop_tokens = _stop_tokens(tokenizer, stop_tokens)
  request = encode_request(tokenizer, prompts, context, chat, shape.vocab_size)
  EncodedPrompts.unmarked([[0] * int(request.lengths.max())]).longest(
      shape.max_context, max_new_tokens
  )
  skipped = skip_reason(spec, request, max_new_tokens)
  if skipped:
    warnings.warn(skipped, CompressionSkipped, stacklevel=2)
  key = jax.random.key(seed) if key is None else key
  run = _run(
      model,
      tokenizer,
      request,
      spec.full_cache() if skipped else spec,
      shape,
      max_new_tokens,
      sampling,
      key,
      stream,
      progress,
      mesh,
      stop_tokens,
  )
  generation = Generation(run, skipped, spec)
  if stream:
    return generation
  for _ in generation:
    pass
  return generation.result


class Generation:
  """Iterator of `TokenEvent`s; `.result` is the `GenerationResult` once exhausted."""

  def __init__(self, run: Iterator, skipped: str | None = None, spec=None):
    self._run = run
    self._skipped, self._spec = skipped, spec
    self.result: GenerationResult | None = None

  def __iter__(self):
    self.result = yield from self._run
    if self._skipped:  # the spec asked for, and why the full cache ran instead
      self.result.stats.update(compression_skipped=self._skipped, spec=self._spec.to_dict())


def _needs(tokenizer, prompts, context, chat: bool, stop_tokens) -> list[str]:
  """What `generate` asks of its tokenizer: encoding where any text is given, the chat
  template in chat mode, decoding where one is given (texts are returned), EOS ids where no
  `stop_tokens` are."""
  needs = ["text"] if has_text(prompts) or has_text(context) else []
  if chat:
    needs.append("chat")
  if tokenizer is not None:
    needs.append("decode")
  if stop_tokens is None:
    needs.append("stop")
  return needs


def _stop_tokens(tokenizer, stop_tokens) -> tuple[int, ...]:
  """`stop_tokens` as ids, or the tokenizer's EOS ids when none are given."""
  if stop_tokens is None and tokenizer is None:
    raise TypeError(
        "without a tokenizer, give stop_tokens= (the ids that end a row; () runs every row "
        "to max_new_tokens)"
    )
  if stop_tokens is None:
    return tuple(int(t) for t in tokenizer.eos_ids)
  if isinstance(stop_tokens, (str, bytes)) or not isinstance(stop_tokens, Sequence):
    raise TypeError(f"stop_tokens must be a list of token ids, got {stop_tokens!r}")
  if not all(isinstance(t, (int, np.integer)) and t >= 0 for t in stop_tokens):
    raise ValueError(f"stop_tokens must be token ids (ints >= 0), got {list(stop_tokens)!r}")
  return tuple(int(t) for t in stop_tokens)


def _run(
    model, tokenizer, request, spec, shape, max_new, sampling, key, stream, progress, mesh, stops
):
  compiled = compile_stats()
  start = time.perf_counter()
  ahead = (1 if stream else max_new, sampling, steps.stop_array(stops))
  state, context_peak = _read(model, tokenizer, request, spec, max_new, key, mesh, progress, ahead)
  prefill_seconds = time.perf_counter() - start
  prefill_seconds -= compile_stats()["compile_seconds"] - compiled["compile_seconds"]
  _, result = yield from _answer(
      model,
      tokenizer,
      state,
      spec,
      shape,
      max_new,
      sampling,
      stream,
      compiled,
      prefill_seconds,
      context_tokens=request.context.lengths,
      context_peak=context_peak,
      stop_tokens=stops,
  )
  return result


def _read(model, tokenizer, request, spec, max_new, key, mesh=None, progress=None, ahead=None):
  """(the state after a request's prompt is read, the most K/V it held while its context
  was read and scored): the context read and compressed, then the question read after it,
  protected, with room for `max_new` more tokens per row. `ahead`: the decode loop's
  (steps, sampling, stop ids) to compile while the prompt is read."""
  question = request.longest_question
  begun = session.begin(
      model,
      request.context,
      spec,
      tokenizer=tokenizer,
      chat=False,
      reserve=question + max_new,
      seed=0,
      key=key,
      mesh=mesh,
      protected_after=question,
  )
  if ahead is not None and not begun.state.plan.compresses_after_prefill:
    # Else compaction changes the shapes. The decode loop compiles in the background while
    # the prompt is read: on a 2-core CPU a first request of a new shape bucket then waits
    # ~1 s less.
    steps.compile_decode_ahead(model, begun.state, *ahead)
  state = session.read(model, begun, tokenizer, progress)
  context_peak = state.peak_kv_bytes()
  if request.question is not None:
    state = session.extend(model, state, request.question, donate=True)
  return state, context_peak


def held_stats(state, shape: ModelShape, context_peak: int | None = None) -> dict:
  """What a state holds against the full cache for the same tokens: `kv_bytes_held`,
  `full_kv_bytes`, the share of the prompt's K/V entries kept per row (`kept_fraction`,
  over layers and kv heads) and `context_peak_kv_bytes` (the most held while the context
  was read and scored)."""
  cache = state.cache
  lengths = to_host(state.position)
  held = to_host(cache.length)  # [L, B, H]
  kept = held.sum(axis=(0, 2)) / (held.shape[0] * held.shape[2] * np.maximum(lengths, 1))
  page_bytes = 2 * cache.config.page_size * page_format.token_bytes(shape.head_dim, shape.dtype)
  full = full_cache_bytes(
      lengths,
      shape.layer_windows,
      kv_heads=shape.n_kv_heads,
      page_size=cache.config.page_size,
      page_bytes=page_bytes,
  )
  return {
      "kept_fraction": [round(float(k), 4) for k in kept],
      "kv_bytes_held": cache.kv_bytes(),
      "full_kv_bytes": full,
      "context_peak_kv_bytes": state.peak_kv_bytes() if context_peak is None else context_peak,
  }


def _answer(
    model,
    tokenizer,
    state,
    spec,
    shape,
    max_new,
    sampling,
    stream,
    compiled,
    prefill_seconds,
    *,
    context_tokens,
    context_peak,
    stop_tokens,
):
  """Decodes `max_new` tokens after a state whose prompt is read, yielding `TokenEvent`s
  when streaming; returns the state after the answer and the `GenerationResult` (its
  `texts` None without a tokenizer)."""
  lengths = to_host(state.position)
  held = held_stats(state, shape, context_peak)
  batch = state.batch_size
  if stream:
    tokens, reasons = [[] for _ in range(batch)], ["length"] * batch
    streams = [TextStream(tokenizer) if tokenizer is not None else None for _ in range(batch)]
    decode_seconds = 0.0
    for _ in range(max_new):
      if bool(to_host(state.done).all()):
        break
      state, step = decode(model, state, 1, sampling=sampling, stop_tokens=stop_tokens, donate=True)
      decode_seconds += step.stats["decode_seconds"]
      for row, new in enumerate(step.tokens):
        if step.finish_reasons[row] == "stop":
          reasons[row] = "stop"
        if new:
          tokens[row] += new
          yield TokenEvent(row, new[-1], streams[row].push(new) if streams[row] else "")
    for row, stream in enumerate(streams):
      if stream is not None and (rest := stream.finish()):
        yield TokenEvent(row, None, rest)
  else:
    state, result = decode(
        model, state, max_new, sampling=sampling, stop_tokens=stop_tokens, donate=True
    )
    tokens, reasons = result.tokens, result.finish_reasons
    decode_seconds = result.stats["decode_seconds"]
  cache, plan = state.cache, state.plan
  eviction = plan.eviction
  generated = [len(t) for t in tokens]
  context_tokens = np.asarray(context_tokens)
  return state, GenerationResult(
      texts=None
      if tokenizer is None
      else [tokenizer.decode(t, skip_special_tokens=True) for t in tokens],
      tokens=tokens,
      finish_reasons=reasons,
      stats={
          "prompt_tokens": lengths.tolist(),
          "context_tokens": context_tokens.tolist(),
          "question_tokens": (lengths - context_tokens).tolist(),
          "generated_tokens": generated,
          **held,
          "peak_kv_bytes": state.peak_kv_bytes(),
          "final_kv_bytes": cache.kv_bytes(),
          "pool_bytes": int(cache.num_pages) * num_shards(cache.mesh) * cache.page_bytes,
          "mesh": None if cache.mesh is None else dict(cache.mesh.shape),
          "prefill_seconds": prefill_seconds,
          "decode_seconds": decode_seconds,
          "compile_seconds": compile_stats()["compile_seconds"] - compiled["compile_seconds"],
          "compiles": compile_stats()["compiles"] - compiled["compiles"],
          "loaded": compile_stats()["loaded"] - compiled["loaded"],
          "decode_tokens_per_s": float(sum(generated)) / max(decode_seconds, 1e-9),
          "policy": spec.policy.name,
          "layer_budgets": None if eviction is None else list(eviction.layer_budget),
          "head_budget": spec.sharing if spec.evicts else None,
          "compressed_once": spec.once,
          "compression_skipped": None,
          "spec": spec.to_dict(),
          "cache": dataclasses.asdict(cache.config),
      },
  )


def ask(
    model,
    tokenizer,
    state,
    questions,
    *,
    chat: bool = False,
    max_new_tokens: int = 64,
    sampling: Sampling = Sampling(),
    cue: str = "",
    donate: bool = False,
    stop_tokens=None,
) -> tuple[State, GenerationResult]:
  """Answers questions about the context a state holds (`kvjax.prefill`, `kvjax.load_state`):
  each row's question is read after the context, protected (no policy evicts it while the
  answer is generated), in chat mode closing the user message the context opened; then
  the answer is decoded. `state` stays valid unless `donate`, so one compressed context
  answers many questions.

  Args:
    questions: one per row of the state: text, or token ids used as they are (a str for a
      one-row state).
    chat: as the state was prefilled (`prefill(chat=True)`): the question closes the user
      message and the template's generation prompt follows; else it is framed as plain
      text ("Question: ... Answer:", then `cue`).
    max_new_tokens: tokens of the answer at most.
    sampling: as `generate`'s; the state's key drives it.
    stop_tokens: as `generate`'s.
  Returns the state after the answer and a `GenerationResult` (its stats: the question's
  and answer's tokens, the K/V held before the answer against the full cache's).
  """
  if not isinstance(state, State):
    raise TypeError(f"state must be a kvjax.State (from kvjax.prefill), got {type(state).__name__}")
  check_int("max_new_tokens", max_new_tokens)
  if not isinstance(sampling, Sampling):
    raise TypeError(f"sampling must be a kvjax.Sampling, got {type(sampling).__name__}")
  if isinstance(questions, str):
    questions = [questions]
  if not isinstance(questions, Sequence) or len(questions) != state.batch_size:
    raise ValueError(
        f"questions must give one question per row of the state ({state.batch_size}), got "
        f"{questions!r}"
    )
  text = any(isinstance(q, str) for q in questions)
  needs = ["text"] * text + ["chat"] * (chat and text) + ["decode"] * (tokenizer is not None)
  if tokenizer is None:
    _stop_tokens(None, stop_tokens)  # names what is missing first
  tokenizer = tokenizer_for(tokenizer, needs + ["stop"] * (stop_tokens is None))
  stop_tokens = _stop_tokens(tokenizer, stop_tokens)
  ids = []
  for i, q in enumerate(questions):
    if isinstance(q, str):
      ids.append(encode_question(tokenizer, q, chat, cue))
    elif _is_token_ids(q):
      ids.append([int(t) for t in q])
    else:
      raise ValueError(f"questions[{i}] must be text or token ids, got {q!r}")
  shape = ModelShape.of(model)
  spec = state.plan.spec
  compiled = compile_stats()
  start = time.perf_counter()
  before = to_host(state.position)
  state = session.extend(model, state, [[Segment(q, protected=True)] for q in ids], donate=donate)
  seconds = time.perf_counter() - start
  seconds -= compile_stats()["compile_seconds"] - compiled["compile_seconds"]
  run = _answer(
      model,
      tokenizer,
      state,
      spec,
      shape,
      max_new_tokens,
      sampling,
      False,
      compiled,
      seconds,
      context_tokens=before,
      context_peak=None,
      stop_tokens=stop_tokens,
  )
  try:
    while True:
      next(run)
  except StopIteration as done:
    return done.value
