"""Batched generation in one call, on the session API: `prefill`, then `decode`.

    model, tokenizer = models.load_llama()
    result = kvjax.generate(model, tokenizer, ["What is the capital of France?"], chat=True)
    print(result.texts[0], result.stats)

`stream=True` returns an iterator of `TokenEvent`s instead (one host round trip per token,
by design); its `.result` holds the `GenerationResult` once it is exhausted.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np
from jaxtyping import Array

from kvjax.runtime.prompts import Segment, encode_prompts
from kvjax.seam import ModelShape
from kvjax.cache.paged_cache import to_host
from kvjax.sharding import num_shards
from kvjax.runtime import session, steps
from kvjax.runtime.compilation import compile_stats
from kvjax.runtime.sampling import Sampling, check_seed
from kvjax.runtime.session import decode
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
  """What `generate` returns (and a streaming `Generation` holds once done): per row the
  generated text, its token ids and why it finished, and the run's `stats` (tokens read and
  kept, KV bytes such as `peak_kv_bytes`, seconds, compiles, the spec)."""

  texts: list[str]
  tokens: list[list[int]]  # generated ids per row, stop token excluded
  finish_reasons: list[str]  # "stop" (an EOS id) or "length" (max_new_tokens)
  stats: dict


def generate(
    model,
    tokenizer,
    prompts: Sequence[str] | Sequence[Sequence[int]] | Sequence[Sequence[Segment]],
    spec: CompressionSpec | None = None,
    *,
    max_new_tokens: int = 64,
    sampling: Sampling = Sampling(),
    chat: bool = False,
    seed: int = 0,
    key: Array | None = None,
    stream: bool = False,
    progress: Callable[[int, int], None] | None = None,
    mesh=None,
) -> GenerationResult | "Generation":
  """Generates continuations of a batch of prompts of different lengths.

  Args:
    model: a `models.Llama`, or any model with the kvjax seam (`kvjax.seam`).
    tokenizer: encodes str prompts and the chat template, decodes the outputs.
    prompts: strings, token-id lists used as they are, or lists of `Segment`s (marked
      spans: protected ones are never evicted; each is a segment for `fair`).
    spec: the `CompressionSpec` (default: the full cache).
    max_new_tokens: per row; a row also stops at any of the tokenizer's EOS ids.
    sampling: a `Sampling` (greedy by default); `key` (or `seed`, an int in
      [0, 2**32 - 1]) drives it.
    chat: wrap str/segment prompts as a user message in the chat template; the template's
      own tokens (system prompt, role markers) are protected.
    stream: return a `Generation` iterator of `TokenEvent`s instead of the result.
    progress: `progress(tokens_read, tokens_total)` after each prefill chunk (`prefill`).
    mesh: shard the cache and the model over devices, e.g. "data=2,model=2" (`prefill`).
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
  encoded = encode_prompts(tokenizer, prompts, chat=chat, vocab_size=shape.vocab_size)
  encoded.longest(shape.max_context, max_new_tokens)
  key = jax.random.key(seed) if key is None else key
  run = _run(
      model,
      tokenizer,
      encoded,
      spec,
      shape,
      max_new_tokens,
      sampling,
      key,
      stream,
      progress,
      mesh,
  )
  generation = Generation(run)
  if stream:
    return generation
  for _ in generation:
    pass
  return generation.result


class Generation:
  """Iterator of `TokenEvent`s; `.result` is the `GenerationResult` once exhausted."""

  def __init__(self, run: Iterator):
    self._run = run
    self.result: GenerationResult | None = None

  def __iter__(self):
    self.result = yield from self._run


def _run(model, tokenizer, encoded, spec, shape, max_new, sampling, key, stream, progress, mesh):
  compiled = compile_stats()
  start = time.perf_counter()
  stop_tokens = tuple(tokenizer.eos_ids or ())
  begun = session.begin(
      model,
      encoded,
      spec,
      tokenizer=tokenizer,
      chat=False,
      reserve=max_new,
      seed=0,
      key=key,
      mesh=mesh,
  )
  if not begun.state.plan.compresses_after_prefill:  # else compaction changes the shapes
    # The decode loop compiles in the background while the prompt is read: on a 2-core
    # CPU a first request of a new shape bucket then waits ~1 s less.
    steps.compile_decode_ahead(
        model, begun.state, 1 if stream else max_new, sampling, steps.stop_array(stop_tokens)
    )
  state = session.read(model, begun, tokenizer, progress)
  lengths = to_host(state.position)
  held = to_host(state.cache.length)  # [L, B, H] after prefill
  # Per row: the share of its prompt's K/V entries (over layers and kv heads) still cached.
  kept = held.sum(axis=(0, 2)) / (held.shape[0] * held.shape[2] * np.maximum(lengths, 1))
  prefill_seconds = time.perf_counter() - start
  prefill_seconds -= compile_stats()["compile_seconds"] - compiled["compile_seconds"]
  batch = state.batch_size
  if stream:
    tokens, reasons = [[] for _ in range(batch)], ["length"] * batch
    streams = [TextStream(tokenizer) for _ in range(batch)]
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
          yield TokenEvent(row, new[-1], streams[row].push(new))
    for row, stream in enumerate(streams):
      if rest := stream.finish():
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
  return GenerationResult(
      texts=[tokenizer.decode(t, skip_special_tokens=True) for t in tokens],
      tokens=tokens,
      finish_reasons=reasons,
      stats={
          "prompt_tokens": lengths.tolist(),
          "kept_fraction": [round(float(k), 4) for k in kept],
          "generated_tokens": generated,
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
          "spec": spec.to_dict(),
          "cache": dataclasses.asdict(cache.config),
      },
  )
