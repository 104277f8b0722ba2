"""Batched generation: chunked prefill into the paged cache, then decode in one `lax.while_loop`.

    model, tokenizer = models.load_llama()
    result = kvjax.generate(model, tokenizer, ["What is the capital of France?"], chat=True)
    print(result.texts[0], result.stats)

`stream=True` returns an iterator of `TokenEvent`s instead (one host round trip per token,
by design); its `.result` holds the `GenerationResult` once it is exhausted.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterator, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jaxtyping import Array, Bool, Float, Int

from kvjax.cache import PagedKVCache, Status, check_status, init_cache
from kvjax.config import CacheConfig

POLICIES = ("full",)


@dataclasses.dataclass(frozen=True)
class TokenEvent:
  """One generated token of one row (streaming mode); `text` is the new decoded text."""

  row: int
  token: int
  text: str


@dataclasses.dataclass
class GenerationResult:
  texts: list[str]
  tokens: list[list[int]]  # generated ids per row, stop token excluded
  finish_reasons: list[str]  # "stop" (an EOS id) or "length" (max_new_tokens)
  stats: dict


@struct.dataclass
class DecodeState:
  cache: PagedKVCache
  logits: Float[Array, "B V"]  # next-token logits of each row
  tokens: Int[Array, "B N"]  # generated ids (N = max_new_tokens)
  num_generated: Int[Array, " B"]
  position: Int[Array, " B"]  # position of the next token fed to the model
  done: Bool[Array, " B"]
  stopped: Bool[Array, " B"]  # done because of an EOS id (not the length limit)
  key: Array
  step: Int[Array, ""]
  peak_pages: Int[Array, ""]  # most pages held at once


def sample(logits: Float[Array, "B V"], key, temperature, top_k, top_p) -> Int[Array, " B"]:
  """Greedy when temperature == 0; else temperature, then top-k (0 = off), then top-p."""

  def stochastic(logits):
    scaled = logits / jnp.maximum(temperature, 1e-6)
    ranked = jnp.sort(scaled, axis=-1)[:, ::-1]  # [B, V] descending
    v = logits.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    ranked = jnp.where(jnp.arange(v) < k, ranked, -jnp.inf)
    probs = jax.nn.softmax(ranked, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p
    cutoff = jnp.take_along_axis(ranked, keep.sum(-1, keepdims=True) - 1, axis=-1)  # [B, 1]
    return jax.random.categorical(key, jnp.where(scaled >= cutoff, scaled, -jnp.inf), axis=-1)

  greedy = lambda logits: jnp.argmax(logits, axis=-1)  # noqa: E731
  return jax.lax.cond(temperature > 0, stochastic, greedy, logits).astype(jnp.int32)


_COMPILED: collections.OrderedDict = collections.OrderedDict()
_MAX_COMPILED = 16


def _compiled(fn, graphdef, *args):
  """Ahead-of-time compiled `fn` for these argument shapes, cached, and the seconds spent
  compiling (0 on a hit): generation stats report compilation apart from run time."""
  leaves, treedef = jax.tree.flatten(args)
  key = (fn, graphdef, treedef, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves))
  if key in _COMPILED:
    _COMPILED.move_to_end(key)
    return _COMPILED[key], 0.0
  start = time.perf_counter()
  compiled = fn.lower(graphdef, *args).compile()
  _COMPILED[key] = compiled
  if len(_COMPILED) > _MAX_COMPILED:
    _COMPILED.popitem(last=False)
  return compiled, time.perf_counter() - start


@partial(jax.jit, static_argnames="graphdef", donate_argnames="cache")
def _prefill_chunk(graphdef, state, cache, tokens, positions, num_new, logits_at):
  model = nnx.merge(graphdef, state)
  return model(tokens, positions, cache, num_new, logits_at=logits_at)


@partial(jax.jit, static_argnames="graphdef", donate_argnames="decode")
def _decode(graphdef, state, decode: DecodeState, limit, eos_ids, sampling):
  """Runs decode steps until `limit` steps, or every row is done, or the cache fails."""
  model = nnx.merge(graphdef, state)
  temperature, top_k, top_p = sampling
  max_new = decode.tokens.shape[1]

  def cond(s: DecodeState):
    return (s.step < limit) & ~s.done.all() & (s.cache.status & ~Status.OVER_BUDGET == 0)

  def body(s: DecodeState):
    key, sub = jax.random.split(s.key)
    token = sample(s.logits, sub, temperature, top_k, top_p)
    live = ~s.done
    stop = live & jnp.isin(token, eos_ids)
    emit = live & ~stop
    tokens = s.tokens.at[jnp.arange(token.shape[0]), s.num_generated].set(
        jnp.where(emit, token, 0), mode="drop"
    )
    num_generated = s.num_generated + emit
    done = s.done | stop | (num_generated >= max_new)
    feed = ~done  # finished rows append nothing
    logits, cache = model(token[:, None], s.position[:, None], s.cache, feed.astype(jnp.int32))
    return DecodeState(
        cache=cache,
        logits=jnp.where(feed[:, None], logits[:, 0], s.logits),
        tokens=tokens,
        num_generated=num_generated,
        position=s.position + feed,
        done=done,
        stopped=s.stopped | stop,
        key=key,
        step=s.step + 1,
        peak_pages=jnp.maximum(s.peak_pages, cache.pages_in_use().sum()),
    )

  return jax.lax.while_loop(cond, body, decode)


def _validate(model, prompts, max_new_tokens, policy, temperature, top_k, top_p, prefill_chunk):
  if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
    raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
  if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
  if policy not in POLICIES:
    raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
  if not temperature >= 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if not isinstance(top_k, int) or top_k < 0:
    raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
  if not 0 < top_p <= 1:
    raise ValueError(f"top_p must be in (0, 1], got {top_p}")
  if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
    raise ValueError(f"prefill_chunk must be an int >= 1, got {prefill_chunk!r}")


def _encode(tokenizer, prompts, chat: bool, vocab_size: int) -> list[list[int]]:
  ids = []
  for i, prompt in enumerate(prompts):
    if isinstance(prompt, str):
      if not prompt.strip():
        raise ValueError(f"prompts[{i}] is empty")
      if chat:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
      ids.append(tokenizer.encode(prompt))
    else:
      ids.append([int(t) for t in prompt])
      if not ids[-1]:
        raise ValueError(f"prompts[{i}] is an empty token list")
      bad = [t for t in ids[-1] if not 0 <= t < vocab_size]
      if bad:
        raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab_size}): {bad[:5]}")
  return ids


def generate(
    model,
    tokenizer,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 64,
    policy: str = "full",
    budget: int | None = None,
    chat: bool = False,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    key: Array | None = None,
    prefill_chunk: int = 256,
    page_size: int = 16,
    stream: bool = False,
) -> GenerationResult | "Generation":
  """Generates continuations of a batch of prompts of different lengths.

  Args:
    model: a `models.Llama`.
    tokenizer: its `models.Tokenizer` (encodes str prompts, decodes the outputs).
    prompts: strings, or token-id lists used as they are.
    max_new_tokens: per row; a row also stops at any of the tokenizer's EOS ids.
    policy: cache policy; "full" keeps every token.
    budget: KV tokens per sequence; with "full" it must hold prompt + max_new_tokens.
    chat: wrap each str prompt as a user message in the model's chat template.
    temperature, top_k, top_p: sampling (temperature 0 = greedy); `key` (or `seed`) drives it.
    prefill_chunk: prompt tokens per prefill step.
    page_size: tokens per cache page.
    stream: return a `Generation` iterator of `TokenEvent`s instead of the result.
  """
  _validate(model, prompts, max_new_tokens, policy, temperature, top_k, top_p, prefill_chunk)
  config = model.config
  ids = _encode(tokenizer, prompts, chat, config.vocab_size)
  lengths = np.array([len(x) for x in ids], np.int32)
  longest = int(lengths.max())
  if longest > config.max_context:
    raise ValueError(
        f"prompt of {longest} tokens is longer than the model context {config.max_context}"
    )
  if longest + max_new_tokens > config.max_context:
    raise ValueError(
        f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model "
        f"context {config.max_context}"
    )
  needed = longest + max_new_tokens
  if budget is not None and budget < needed:
    raise ValueError(
        f"policy 'full' keeps every token: budget={budget} cannot hold the prompt "
        f"({longest} tokens) + max_new_tokens ({max_new_tokens}) = {needed}"
    )
  capacity = -(-(budget or needed) // page_size) * page_size
  cache_config = CacheConfig(page_size=page_size, max_tokens=capacity, dtype=_dtype_name(model))
  # Short prompts need no full-size chunk; powers of two bound the number of compilations.
  chunk = min(prefill_chunk, 1 << (longest - 1).bit_length(), capacity)
  key = jax.random.key(seed) if key is None else key
  sampling = (jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))
  run = _run(
      model, tokenizer, ids, lengths, cache_config, max_new_tokens, chunk, key, sampling, stream
  )
  generation = Generation(run)
  if stream:
    return generation
  for _ in generation:
    pass
  return generation.result


def _dtype_name(model) -> str:
  return jnp.dtype(model.embed[...].dtype).name


class Generation:
  """Iterator of `TokenEvent`s; `.result` is the `GenerationResult` once exhausted."""

  def __init__(self, run: Iterator):
    self._run = run
    self.result: GenerationResult | None = None

  def __iter__(self):
    self.result = yield from self._run


def _run(model, tokenizer, ids, lengths, cache_config, max_new, chunk, key, sampling, stream):
  config = model.config
  batch = len(ids)
  graphdef, state = nnx.split(model)
  cache = init_cache(
      cache_config, config.n_layers, batch, config.n_kv_heads, config.head_dim, chunk=chunk
  )
  longest = int(lengths.max())
  padded = np.zeros((batch, -(-longest // chunk) * chunk), np.int32)
  for row, row_ids in enumerate(ids):
    padded[row, : len(row_ids)] = row_ids

  last_logits = jnp.zeros((batch, config.vocab_size), jnp.float32)
  peak, compile_seconds, start = 0, 0.0, time.perf_counter()
  for offset in range(0, padded.shape[1], chunk):
    num_new = np.clip(lengths - offset, 0, chunk).astype(np.int32)
    positions = np.broadcast_to(np.arange(offset, offset + chunk, dtype=np.int32), (batch, chunk))
    last_index = np.clip(lengths - 1 - offset, 0, chunk - 1).astype(np.int32)
    args = (state, cache, padded[:, offset : offset + chunk], positions, num_new, last_index)
    prefill, seconds = _compiled(_prefill_chunk, graphdef, *args)
    compile_seconds += seconds
    logits, cache = prefill(*args)
    ends_here = (lengths - 1 >= offset) & (lengths - 1 < offset + chunk)
    last_logits = jnp.where(ends_here[:, None], logits, last_logits)
    peak = max(peak, int(cache.pages_in_use().sum()))
  check_status(cache)
  jax.block_until_ready(last_logits)
  prefill_seconds = time.perf_counter() - start - compile_seconds

  decode = DecodeState(
      cache=cache,
      logits=last_logits,
      tokens=jnp.zeros((batch, max_new), jnp.int32),
      num_generated=jnp.zeros((batch,), jnp.int32),
      position=jnp.asarray(lengths),
      done=jnp.zeros((batch,), bool),
      stopped=jnp.zeros((batch,), bool),
      key=key,
      step=jnp.int32(0),
      peak_pages=jnp.asarray(peak, jnp.int32),
  )
  eos_ids = jnp.asarray(tokenizer.eos_ids or (-1,), jnp.int32)
  limit = jnp.int32(max_new)
  decode_steps, seconds = _compiled(_decode, graphdef, state, decode, limit, eos_ids, sampling)
  compile_seconds += seconds
  start = time.perf_counter()
  if stream:
    texts = [""] * batch
    while not bool(decode.done.all()):
      before = np.asarray(decode.num_generated)
      decode = decode_steps(state, decode, decode.step + 1, eos_ids, sampling)
      check_status(decode.cache)
      after, tokens = np.asarray(decode.num_generated), np.asarray(decode.tokens)
      for row in np.flatnonzero(after > before):
        text = tokenizer.decode(tokens[row, : after[row]].tolist())
        yield TokenEvent(int(row), int(tokens[row, after[row] - 1]), text[len(texts[row]) :])
        texts[row] = text
  else:
    decode = decode_steps(state, decode, limit, eos_ids, sampling)
    check_status(decode.cache)
  num_generated = np.asarray(decode.num_generated)
  decode_seconds = time.perf_counter() - start

  tokens = [np.asarray(decode.tokens[row, : num_generated[row]]).tolist() for row in range(batch)]
  stopped = np.asarray(decode.stopped)
  return GenerationResult(
      texts=[tokenizer.decode(t, skip_special_tokens=True) for t in tokens],
      tokens=tokens,
      finish_reasons=["stop" if s else "length" for s in stopped],
      stats={
          "prompt_tokens": lengths.tolist(),
          "generated_tokens": num_generated.tolist(),
          "peak_kv_bytes": int(decode.peak_pages) * cache.page_bytes,
          "pool_bytes": int(2 * decode.cache.k_pages.size * decode.cache.k_pages.dtype.itemsize),
          "prefill_seconds": prefill_seconds,
          "decode_seconds": decode_seconds,
          "compile_seconds": compile_seconds,
          "decode_tokens_per_s": float(num_generated.sum()) / max(decode_seconds, 1e-9),
          "policy": "full",
          "cache": dataclasses.asdict(cache_config),
      },
  )
