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
from kvjax.config import CacheConfig, min_budget
from kvjax.policies import BUDGET_SCHEDULES, EvictionPlan, Full, Policy, get_policy, layer_budgets


@dataclasses.dataclass(frozen=True)
class Segment:
  """A piece of a prompt. Protected segments are never evicted; with `fair=True` every
  segment loses the same fraction of its tokens."""

  text: str
  protected: bool = False


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


def _compiled(fn, graphdef, plan, impl, *args):
  """Ahead-of-time compiled `fn` for these argument shapes, cached, and the seconds spent
  compiling (0 on a hit): generation stats report compilation apart from run time."""
  leaves, treedef = jax.tree.flatten(args)
  key = (
      fn,
      graphdef,
      plan,
      impl,
      treedef,
      tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves),
  )
  if key in _COMPILED:
    _COMPILED.move_to_end(key)
    return _COMPILED[key], 0.0
  start = time.perf_counter()
  compiled = fn.lower(graphdef, plan, impl, *args).compile()
  _COMPILED[key] = compiled
  if len(_COMPILED) > _MAX_COMPILED:
    _COMPILED.popitem(last=False)
  return compiled, time.perf_counter() - start


@partial(jax.jit, static_argnames=("graphdef", "plan", "impl"), donate_argnames="cache")
def _prefill_chunk(
    graphdef,
    plan,
    impl,
    state,
    cache,
    tokens,
    positions,
    num_new,
    logits_at,
    protected,
    segment,
    key,
):
  """One prefill chunk; returns the logits at `logits_at`, the cache after eviction, and
  the pages held before eviction (the peak)."""
  model = nnx.merge(graphdef, state)
  logits, cache = model(
      tokens,
      positions,
      cache,
      num_new,
      logits_at=logits_at,
      policy=plan and plan.policy,
      protected=protected,
      segment=segment,
      attention_impl=impl,
  )
  peak = cache.pages_in_use().sum()
  if plan is not None:
    cache = plan.apply(cache, key)
  return logits, cache, peak


@partial(jax.jit, static_argnames=("graphdef", "plan", "impl"), donate_argnames="decode")
def _decode(graphdef, plan, impl, state, decode: DecodeState, limit, eos_ids, sampling):
  """Runs decode steps until `limit` steps, or every row is done, or the cache fails."""
  model = nnx.merge(graphdef, state)
  temperature, top_k, top_p = sampling
  max_new = decode.tokens.shape[1]

  def cond(s: DecodeState):
    return (s.step < limit) & ~s.done.all() & (s.cache.status & ~Status.OVER_BUDGET == 0)

  def body(s: DecodeState):
    key, sub, evict_key = jax.random.split(s.key, 3)
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
    logits, cache = model(
        token[:, None],
        s.position[:, None],
        s.cache,
        feed.astype(jnp.int32),
        policy=plan and plan.policy,
        attention_impl=impl,
    )
    peak_pages = jnp.maximum(s.peak_pages, cache.pages_in_use().sum())
    if plan is not None:
      cache = plan.apply(cache, evict_key)
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
        peak_pages=peak_pages,
    )

  return jax.lax.while_loop(cond, body, decode)


@dataclasses.dataclass(frozen=True)
class EncodedPrompts:
  """Token ids of a batch, with per-token protection and segment ids (0 = unmarked)."""

  ids: list[list[int]]
  protected: list[list[bool]]
  segment: list[list[int]]

  @property
  def lengths(self) -> np.ndarray:
    return np.array([len(x) for x in self.ids], np.int32)

  def padded(self, width: int):
    """([B, width] ids, protected, segment) right-padded with zeros."""
    out = [np.zeros((len(self.ids), width), dtype) for dtype in (np.int32, bool, np.int32)]
    for row in range(len(self.ids)):
      for array, values in zip(out, (self.ids[row], self.protected[row], self.segment[row])):
        array[row, : len(values)] = values
    return out


def encode_prompts(tokenizer, prompts, chat: bool, vocab_size: int) -> EncodedPrompts:
  """Encodes str / token-list / `Segment`-list prompts. With `chat`, the chat template
  wraps the text and its own tokens (system prompt, role markers) are protected."""
  if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
    raise ValueError("prompts must be a non-empty list of strings, token-id lists or segment lists")
  ids, protected, segment = [], [], []
  for i, prompt in enumerate(prompts):
    if isinstance(prompt, str):
      prompt = [Segment(prompt)]
    if prompt and all(isinstance(p, (int, np.integer)) for p in prompt):
      row = [int(t) for t in prompt]
      bad = [t for t in row if not 0 <= t < vocab_size]
      if bad:
        raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab_size}): {bad[:5]}")
      ids.append(row), protected.append([False] * len(row)), segment.append([0] * len(row))
      continue
    if not prompt or not all(isinstance(p, (Segment, str)) for p in prompt):
      raise ValueError(f"prompts[{i}] is empty or mixes token ids with text")
    parts = [p if isinstance(p, Segment) else Segment(p) for p in prompt]
    if not "".join(p.text for p in parts).strip():
      raise ValueError(f"prompts[{i}] is empty")
    pieces = [(p.text, p.protected, n + 1) for n, p in enumerate(parts)]
    if chat:
      marker = "\x00kvjax\x00"
      rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}])
      before, after = rendered.split(marker)
      pieces = [(before, True, 0), *pieces, (after, True, 0)]
    row_ids, row_protected, row_segment = [], [], []
    for text, is_protected, seg in pieces:
      piece = tokenizer.encode(text) if text else []
      row_ids += piece
      row_protected += [is_protected] * len(piece)
      row_segment += [seg] * len(piece)
    ids.append(row_ids), protected.append(row_protected), segment.append(row_segment)
  return EncodedPrompts(ids, protected, segment)


def budget_tokens(budget: int | float, length: int, group_size: int = 1) -> int:
  """Tokens kept for `budget`: an int as given, or a fraction in (0, 1) of `length` rounded
  down to whole groups (at least one group)."""
  if isinstance(budget, bool) or not isinstance(budget, (int, float, np.integer, np.floating)):
    raise TypeError(f"budget must be an int (tokens) or a float in (0, 1), got {budget!r}")
  if isinstance(budget, (float, np.floating)):
    if not 0.0 < budget < 1.0:
      raise ValueError(f"a fractional budget must be in (0, 1), got {budget}")
    return max(group_size, int(budget * length) // group_size * group_size)
  return int(budget)


@dataclasses.dataclass(frozen=True)
class CachePlan:
  """The cache configuration and eviction plan for one batch (see `plan_cache`)."""

  config: CacheConfig
  eviction: EvictionPlan | None
  chunk: int


def plan_cache(
    model,
    policy: str | Policy,
    budget: int | float | None,
    *,
    batch: int,
    longest: int,
    max_new_tokens: int,
    prefill_chunk: int = 256,
    page_size: int = 16,
    sink: int = 4,
    recent: int | None = None,
    group_size: int | None = None,
    budget_schedule: str = "uniform",
    per_head: bool = False,
    fair: bool = False,
) -> CachePlan:
  """Sizes the cache for a batch: page tables long enough for a layer's budget plus one
  chunk, and a pool holding exactly what the budgets allow at their peak.

  `budget` is tokens per sequence (per kv head and layer), or a fraction in (0, 1) of the
  longest prompt. With policy "full" it only caps the capacity (and must hold everything).
  """
  config = model.config
  policy = get_policy(policy)
  if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
    raise ValueError(f"prefill_chunk must be an int >= 1, got {prefill_chunk!r}")
  needed = longest + max_new_tokens
  # Short prompts need no full-size chunk; powers of two bound the number of compilations.
  chunk = min(prefill_chunk, 1 << (longest - 1).bit_length())
  dtype = jnp.dtype(model.embed[...].dtype).name
  if isinstance(policy, Full):
    if budget is not None:
      budget = budget_tokens(budget, longest, 1)
    if budget is not None and budget < needed:
      raise ValueError(
          f"policy 'full' keeps every token: budget={budget} cannot hold the prompt "
          f"({longest} tokens) + max_new_tokens ({max_new_tokens}) = {needed}"
      )
    capacity = -(-(budget or needed) // page_size) * page_size
    cfg = CacheConfig(page_size=page_size, max_tokens=capacity, dtype=dtype)
    return CachePlan(cfg, None, min(chunk, capacity))
  if budget is None:
    raise ValueError(f"policy {policy.name!r} evicts to a budget: pass budget=")
  if budget_schedule not in BUDGET_SCHEDULES:
    raise ValueError(f"budget_schedule must be one of {BUDGET_SCHEDULES}, got {budget_schedule!r}")
  group = group_size or (1 if policy.token_level else page_size)
  budget = budget_tokens(budget, longest, group)
  if per_head and group != 1:
    raise ValueError(
        "per_head budgets need token eviction (group_size=1): block eviction "
        "cannot split a layer's budget across heads at page granularity"
    )
  if recent is None:
    recent = budget // 4 if group == 1 else max(page_size, budget // 4 // page_size * page_size)
  n, h = config.n_layers, config.n_kv_heads
  budgets = layer_budgets(
      budget, n, budget_schedule, group, min_budget(page_size, sink, recent, group)
  )
  heads = h if per_head else 1
  margin = page_size  # eviction runs once a sequence passes its budget by a page
  # Per head, one sequence may take its layer's whole share: H x budget.
  capacity = -(-(int(budgets.max()) * heads + margin + chunk) // page_size) * page_size
  pages_per_layer = [
      h * -(-(int(b) + margin + chunk) // page_size) + (h if per_head else 0) for b in budgets
  ]
  cfg = CacheConfig(
      page_size=page_size,
      max_tokens=capacity,
      budget=budget,
      sink=sink,
      recent=recent,
      threshold=budget + margin,
      group_size=group,
      num_pages=batch * sum(pages_per_layer) + 1,
      dtype=dtype,
  )
  plan = EvictionPlan(policy, tuple(int(b) for b in budgets), per_head=per_head, fair=fair)
  return CachePlan(cfg, plan, chunk)


def prefill(
    model,
    plan: CachePlan,
    prompts: EncodedPrompts,
    key,
    cache=None,
    attention_impl="auto",
    start: int | np.ndarray = 0,
):
  """Chunked prefill of a batch with eviction after each chunk.

  `start` is the position of each row's first prompt token: pass the cache of an earlier
  prefill and its lengths to append more tokens (e.g. a question after a compressed
  context).
  Returns (logits [B, V] at each row's last prompt token, cache, peak pages held, seconds
  spent compiling).
  """
  config = model.config
  batch, chunk = len(prompts.ids), plan.chunk
  graphdef, state = nnx.split(model)
  if cache is None:
    cache = init_cache(
        plan.config, config.n_layers, batch, config.n_kv_heads, config.head_dim, chunk=chunk
    )
  lengths = prompts.lengths
  starts = np.broadcast_to(np.asarray(start, np.int32), (batch,))
  ids, protected, segment = prompts.padded(-(-int(lengths.max()) // chunk) * chunk)
  last_logits = jnp.zeros((batch, config.vocab_size), jnp.float32)
  peak, compile_seconds = 0, 0.0
  for offset in range(0, ids.shape[1], chunk):
    window = slice(offset, offset + chunk)
    num_new = np.clip(lengths - offset, 0, chunk).astype(np.int32)
    positions = starts[:, None] + np.arange(offset, offset + chunk, dtype=np.int32)
    last_index = np.clip(lengths - 1 - offset, 0, chunk - 1).astype(np.int32)
    args = (
        state,
        cache,
        ids[:, window],
        positions,
        num_new,
        last_index,
        protected[:, window],
        segment[:, window],
        jax.random.fold_in(key, int(starts.max()) + offset),
    )
    step, seconds = _compiled(_prefill_chunk, graphdef, plan.eviction, attention_impl, *args)
    compile_seconds += seconds
    logits, cache, pages = step(*args)
    ends_here = (lengths - 1 >= offset) & (lengths - 1 < offset + chunk)
    last_logits = jnp.where(ends_here[:, None], logits, last_logits)
    peak = max(peak, int(pages))
  check_status(cache)
  return jax.block_until_ready(last_logits), cache, peak, compile_seconds


def generate(
    model,
    tokenizer,
    prompts: Sequence[str] | Sequence[Sequence[int]] | Sequence[Sequence[Segment]],
    *,
    max_new_tokens: int = 64,
    policy: str | Policy = "full",
    budget: int | float | None = None,
    sink: int = 4,
    recent: int | None = None,
    group_size: int | None = None,
    budget_schedule: str = "uniform",
    per_head: bool = False,
    fair: bool = False,
    chat: bool = False,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    key: Array | None = None,
    prefill_chunk: int = 256,
    page_size: int = 16,
    attention_impl: str = "auto",
    stream: bool = False,
) -> GenerationResult | "Generation":
  """Generates continuations of a batch of prompts of different lengths.

  Args:
    model: a `models.Llama`.
    tokenizer: its `models.Tokenizer` (encodes str prompts, decodes the outputs).
    prompts: strings, token-id lists used as they are, or lists of `Segment`s (marked
      spans: protected ones are never evicted; each is a segment for `fair`).
    max_new_tokens: per row; a row also stops at any of the tokenizer's EOS ids.
    policy: a name from `kvjax.policies.POLICIES` or a `Policy`; "full" keeps every token.
    budget: KV tokens kept per sequence (layer x row x kv head), or a fraction in (0, 1)
      of the longest prompt. With "full" it must hold prompt + max_new_tokens.
    sink, recent: tokens at the start / end of every sequence that are never evicted
      (recent defaults to budget // 4).
    group_size: eviction granularity, 1 (tokens) or page_size (pages); default per policy.
    budget_schedule: "uniform" or "pyramid" per-layer budgets with the same mean.
    per_head: split each layer's budget across its kv heads by a global top-k.
    fair: each marked segment loses the same fraction of its tokens.
    chat: wrap str/segment prompts as a user message in the chat template; the template's
      own tokens (system prompt, role markers) are protected.
    temperature, top_k, top_p: sampling (temperature 0 = greedy); `key` (or `seed`) drives it.
    prefill_chunk: prompt tokens per prefill step (eviction runs after each chunk, so the
      cache peaks at budget + one page + one chunk).
    page_size: tokens per cache page.
    attention_impl: paged-attention kernel, "auto" (Pallas where supported), "pallas"
      (interpret mode off TPU) or "ref".
    stream: return a `Generation` iterator of `TokenEvent`s instead of the result.
  """
  if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
  if not temperature >= 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if not isinstance(top_k, int) or top_k < 0:
    raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
  if not 0 < top_p <= 1:
    raise ValueError(f"top_p must be in (0, 1], got {top_p}")
  config = model.config
  encoded = encode_prompts(tokenizer, prompts, chat, config.vocab_size)
  longest = int(encoded.lengths.max())
  if longest > config.max_context:
    raise ValueError(
        f"prompt of {longest} tokens is longer than the model context {config.max_context}"
    )
  if longest + max_new_tokens > config.max_context:
    raise ValueError(
        f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model "
        f"context {config.max_context}"
    )
  plan = plan_cache(
      model,
      policy,
      budget,
      batch=len(encoded.ids),
      longest=longest,
      max_new_tokens=max_new_tokens,
      prefill_chunk=prefill_chunk,
      page_size=page_size,
      sink=sink,
      recent=recent,
      group_size=group_size,
      budget_schedule=budget_schedule,
      per_head=per_head,
      fair=fair,
  )
  key = jax.random.key(seed) if key is None else key
  sampling = (jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))
  generation = Generation(
      _run(model, tokenizer, [encoded], plan, max_new_tokens, key, sampling, stream, attention_impl)
  )
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


def _run(
    model,
    tokenizer,
    phases: Sequence[EncodedPrompts],
    plan: CachePlan,
    max_new,
    key,
    sampling,
    stream,
    attention_impl,
):
  """Prefills the prompt phase by phase (each phase continues the previous one, with
  eviction in between), then decodes."""
  batch = len(phases[0].ids)
  graphdef, state = nnx.split(model)
  prefill_key, decode_key = jax.random.split(key)
  start = time.perf_counter()
  lengths, cache, peak, compile_seconds = np.zeros(batch, np.int32), None, 0, 0.0
  for phase in phases:
    last_logits, cache, phase_peak, seconds = prefill(
        model, plan, phase, prefill_key, cache, attention_impl, start=lengths
    )
    lengths, peak, compile_seconds = (
        lengths + phase.lengths,
        max(peak, phase_peak),
        compile_seconds + seconds,
    )
  prefill_seconds = time.perf_counter() - start - compile_seconds

  decode = DecodeState(
      cache=cache,
      logits=last_logits,
      tokens=jnp.zeros((batch, max_new), jnp.int32),
      num_generated=jnp.zeros((batch,), jnp.int32),
      position=jnp.asarray(lengths),
      done=jnp.zeros((batch,), bool),
      stopped=jnp.zeros((batch,), bool),
      key=decode_key,
      step=jnp.int32(0),
      peak_pages=jnp.asarray(peak, jnp.int32),
  )
  eos_ids = jnp.asarray(tokenizer.eos_ids or (-1,), jnp.int32)
  limit = jnp.int32(max_new)
  decode_steps, seconds = _compiled(
      _decode, graphdef, plan.eviction, attention_impl, state, decode, limit, eos_ids, sampling
  )
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

  cache = decode.cache
  tokens = [np.asarray(decode.tokens[row, : num_generated[row]]).tolist() for row in range(batch)]
  stopped = np.asarray(decode.stopped)
  eviction = plan.eviction
  return GenerationResult(
      texts=[tokenizer.decode(t, skip_special_tokens=True) for t in tokens],
      tokens=tokens,
      finish_reasons=["stop" if s else "length" for s in stopped],
      stats={
          "prompt_tokens": lengths.tolist(),
          "generated_tokens": num_generated.tolist(),
          "peak_kv_bytes": int(decode.peak_pages) * cache.page_bytes,
          "final_kv_bytes": cache.kv_bytes(),
          "pool_bytes": int(cache.num_pages) * cache.page_bytes,
          "prefill_seconds": prefill_seconds,
          "decode_seconds": decode_seconds,
          "compile_seconds": compile_seconds,
          "decode_tokens_per_s": float(num_generated.sum()) / max(decode_seconds, 1e-9),
          "policy": "full" if eviction is None else eviction.policy.name,
          "layer_budgets": None if eviction is None else list(eviction.layer_budget),
          "per_head": bool(eviction and eviction.per_head),
          "cache": dataclasses.asdict(plan.config),
      },
  )
