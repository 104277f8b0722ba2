"""The compiled steps of a session and the host loops that run them: a prefill chunk (the
model over a chunk of every row, the policy observing, eviction after it) and the decode
loop (sampling, the model, eviction, until every row has its tokens), each compiled once
per shape (`kvjax.runtime.compilation`); the numerics and status checks after them; the reader a
policy's `score_context` reads a context with."""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from kvjax import sharding as shards
from kvjax.cache.paged_cache import WARNINGS, NumericsError, PagedKVCache, Status, check_status, to_host
from kvjax.runtime.compilation import compile_ahead, compile_stats, compiled
from kvjax.eviction.fixed_shape import truncate as truncate_cache
from kvjax.eviction.sliding import full_layers, slide as slide_windows
from kvjax.cache.sizing import window_peak
from kvjax.cache.pages import pages_for
from kvjax.runtime.prompts import EncodedPrompts
from kvjax.runtime.sampling import Sampling, greedy_token, sample
from kvjax.seam import ModelShape, forward
from kvjax.spec import CachePlan
from kvjax.runtime.state import DecodeResult, State, laid_out


def _evict(eviction, cache: PagedKVCache, key, row_budget=None) -> PagedKVCache:
  """`eviction.apply` on every shard of the cache (on the cache itself on one device)."""
  if row_budget is not None:  # a served batch: one device (`kvjax.serving`)
    return eviction.apply(cache, key, row_budget)
  return shards.on_shards(eviction.apply, cache, key, specs=(P(),))


def _slide(cache: PagedKVCache) -> PagedKVCache:
  """Sliding-window layers free the pages their windows have passed (`slide`), per shard."""
  if not cache.config.sliding:
    return cache
  return shards.on_shards(slide_windows, cache)


def _policy(plan: CachePlan):
  return None if plan.eviction is None else plan.eviction.policy


@functools.partial(jax.jit, static_argnames=("graphdef", "plan", "slide"), donate_argnames="cache")
def _prefill_chunk(
    params,
    cache,
    last_logits,
    peak,
    tokens,
    positions,
    num_new,
    logits_at,
    ends_here,
    protected,
    segment,
    key,
    key_offset,
    *,
    graphdef,
    plan,
    slide=True,
):
  """One prefill chunk; returns the rows' last logits (the logits at `logits_at` where the
  row's prompt `ends_here`), the cache after eviction, and the peak of pages held (before
  eviction). The bookkeeping between chunks is done here, not by eager ops: each of those
  would compile a small program in a fresh process. Sliding layers free what their window
  passed, unless not `slide` (a scratch read that is cut away again)."""
  model = nnx.merge(graphdef, params)
  logits, cache = forward(
      model,
      tokens,
      positions,
      cache,
      num_new,
      logits_at=logits_at,
      policy=_policy(plan),
      protected=protected,
      segment=segment,
      attention_impl=plan.impl,
  )
  # A row's next token comes from these logits: NaN or Inf stops the request (on the host).
  cache = cache.raise_status(_nonfinite(logits, ends_here), Status.NONFINITE_LOGITS)
  # The sum in the carried dtype: an int64 sum (jax_enable_x64) would change the next
  # chunk's argument types and compile the step again.
  peak = jnp.maximum(peak, cache.pages_in_use().sum(dtype=peak.dtype))
  if slide:
    cache = _slide(cache)
  if plan.eviction is not None:
    cache = _evict(plan.eviction, cache, jax.random.fold_in(key, key_offset))
  last_logits = jnp.where(ends_here[:, None], logits, last_logits)
  return shards.rows(last_logits, cache.mesh), shards.constrain(cache), peak


def _prefill_chunk_returns(params, cache, last_logits, peak, *_):
  return last_logits, cache, peak  # `_prefill_chunk`'s output structure (`compiled`)


def _nonfinite(logits: Float[Array, "B V"], rows: Bool[Array, " B"]) -> Bool[Array, ""]:
  """Whether any of `rows` has a NaN or Inf among its logits."""
  return (rows & ~jnp.isfinite(logits).all(-1)).any()


def check(cache: PagedKVCache, logits, step: str) -> None:
  """`check_status`, after raising `NumericsError` for non-finite logits with the rows."""
  if Status(int(cache.status)) & Status.NONFINITE_LOGITS:
    rows = np.flatnonzero(~np.isfinite(to_host(logits)).all(-1)).tolist()
    raise NumericsError(
        f"{step}: the model gave non-finite logits (NaN or Inf) for rows {rows}; a token "
        "drawn from them would be meaningless (a broken checkpoint, or an overflow in a "
        "low-precision dtype: try float32)"
    )
  check_status(cache)


def prefill_chunks(
    model,
    state: State,
    encoded: EncodedPrompts,
    key,
    progress=None,
    step: str = "prefill",
    slide: bool = True,
) -> State:
  """Chunked prefill of `encoded` after each row's current position (donates `state`);
  `progress(tokens_read, tokens_total)` after each chunk; `step` names it in errors;
  `slide`: whether sliding layers free what their windows passed (not in a scratch read)."""
  plan, chunk = state.plan, state.plan.chunk
  graphdef, params = nnx.split(model)
  lengths = encoded.lengths
  starts = to_host(state.position)
  mesh = state.cache.mesh
  row = lambda x: shards.rows(x, mesh)  # noqa: E731
  ids, protected, segment = encoded.padded(-(-int(lengths.max()) // chunk) * chunk)
  # The peak stays on device: reading it per chunk would stall dispatch of the next chunk.
  last_logits, cache, peak = state.logits, state.cache, state.peak_pages
  statics = {"graphdef": graphdef, "plan": plan, "slide": slide and state.cache.config.sliding}
  key = shards.replicated(key, mesh)  # once: every chunk folds its offset into it
  for offset in range(0, ids.shape[1], chunk):
    window = slice(offset, offset + chunk)
    num_new = np.clip(lengths - offset, 0, chunk).astype(np.int32)
    positions = starts[:, None] + np.arange(offset, offset + chunk, dtype=np.int32)
    last_index = np.clip(lengths - 1 - offset, 0, chunk - 1).astype(np.int32)
    args = (
        params,
        cache,
        last_logits,
        peak,
        row(ids[:, window]),
        row(positions),
        row(num_new),
        row(last_index),
        row((lengths - 1 >= offset) & (lengths - 1 < offset + chunk)),
        row(protected[:, window]),
        row(segment[:, window]),
        key,
        shards.replicated(np.uint32(int(starts.max()) + offset), mesh),
    )
    run_chunk = compiled(_prefill_chunk, statics, *args, returns=_prefill_chunk_returns)
    last_logits, cache, peak = run_chunk(*args)
    if progress is not None:
      progress(min(offset + chunk, int(lengths.max())), int(lengths.max()))
  check(cache, last_logits, step)
  added = lengths > 0
  state = state.replace(
      cache=cache,
      logits=jax.block_until_ready(last_logits),
      position=jax.device_put((starts + lengths).astype(np.int32)),
      done=jax.device_put(to_host(state.done) & ~added),
      peak_pages=peak,
  )
  return laid_out(state)


def feed(model, state: State, token, emit, eviction, evict_key, row_budget=None):
  """One decode step's cache work: `token` [B] appended where `emit` [B] at each row's
  position, the logits after it [B, V], sliding windows slid and `eviction` (None: none)
  run, with per-row budgets where given (`EvictionPlan.apply`). Returns (logits, cache,
  pages held before anything was freed)."""
  logits, cache = forward(
      model,
      token[:, None],
      state.position[:, None],
      state.cache,
      emit.astype(jnp.int32),
      policy=_policy(state.plan),
      attention_impl=state.plan.impl,
  )
  held = cache.pages_in_use().sum()
  cache = _slide(cache)
  if eviction is not None:
    cache = _evict(eviction, cache, evict_key, row_budget)
  return logits[:, 0], cache, held


@struct.dataclass
class _Decoding:
  state: State
  tokens: Int[Array, "B N"]  # generated ids (N = max_new_tokens)
  num_generated: Int[Array, " B"]
  stopped: Bool[Array, " B"]  # stopped at a stop token in this call
  step: Int[Array, ""]
  recorded: Float[Array, "B N V"] | None  # the logits each token was chosen from


@functools.partial(
    jax.jit, static_argnames=("graphdef", "evict", "greedy"), donate_argnames="decoding"
)
def _decode(params, decoding: _Decoding, stop_tokens, sampling, forced, *, graphdef, evict, greedy):
  """Decode steps until every row has its tokens or stopped, or the cache fails. Every
  emitted token is fed, so the state continues after the last one. `greedy` (temperature
  0) leaves the sampler out of the program: a fifth of the loop's compile time on CPU."""
  model = nnx.merge(graphdef, params)
  temperature, top_k, top_p = sampling
  max_new = decoding.tokens.shape[1]
  plan = decoding.state.plan
  eviction = plan.eviction if evict else None
  rows = jnp.arange(decoding.tokens.shape[0])

  def live(d: _Decoding):
    return ~d.state.done & (d.num_generated < max_new)

  def cond(d: _Decoding):
    ok = d.state.cache.status & ~WARNINGS == 0
    return live(d).any() & ok

  def body(d: _Decoding):
    s = d.state
    key, sub, evict_key = jax.random.split(s.key, 3)
    if forced is None and greedy:
      token = greedy_token(s.logits)
    elif forced is None:
      token = sample(s.logits, sub, temperature, top_k, top_p)
    else:
      token = forced[rows, jnp.minimum(d.num_generated, max_new - 1)]
    active = live(d)
    stop = active & jnp.isin(token, stop_tokens)
    emit = active & ~stop
    tokens = d.tokens.at[rows, d.num_generated].set(jnp.where(emit, token, 0), mode="drop")
    recorded = d.recorded
    if recorded is not None:
      recorded = recorded.at[rows, d.num_generated].set(s.logits, mode="drop")
    logits, cache, held = feed(model, s, token, emit, eviction, evict_key)
    # Rows whose new logits are not finite stop the loop with them (`cond`), undrawn.
    cache = cache.raise_status(_nonfinite(logits, emit), Status.NONFINITE_LOGITS)
    peak_pages = jnp.maximum(s.peak_pages, held)
    state = s.replace(
        cache=shards.constrain(cache),
        logits=shards.rows(jnp.where(emit[:, None], logits, s.logits), cache.mesh),
        position=s.position + emit,
        done=s.done | stop,
        key=key,
        peak_pages=peak_pages,
    )
    return _Decoding(
        state=state,
        tokens=tokens,
        num_generated=d.num_generated + emit,
        stopped=d.stopped | stop,
        step=d.step + 1,
        recorded=recorded,
    )

  return laid_out(jax.lax.while_loop(cond, body, decoding))


def _decode_returns(params, decoding, *_):
  return decoding  # `_decode`'s output structure (`compiled`)


def _chunk_free(state: State, like: State | None = None) -> State:
  """The state with the prefill chunk it was planned with set to one token (the loop appends
  one per step), or back to `like`'s: states that differ only by it (short prompts prefill
  in chunks of their own power of two) share one compiled loop."""
  plan_chunk, cache_chunk = (1, 1) if like is None else (like.plan.chunk, like.cache.chunk)
  return state.replace(
      plan=dataclasses.replace(state.plan, chunk=plan_chunk),
      cache=state.cache.replace(chunk=cache_chunk),
  )


def stop_array(stop_tokens) -> np.ndarray:
  """Stop ids as the decode loop takes them ([-1] for none)."""
  stop = np.asarray(list(stop_tokens) or [-1], np.int32)
  if stop.ndim != 1:
    raise ValueError(f"stop_tokens must be a list of ids, got {stop_tokens!r}")
  return stop


def _decode_call(
    model, state: State, max_new_tokens: int, sampling: Sampling, stop, forced, return_logits, evict
):
  """The decode loop's arguments (the state's arrays, fresh token buffers) and static
  values."""
  state = _chunk_free(state)
  b = state.batch_size
  vocab = state.logits.shape[-1]
  decoding = _Decoding(
      state=state,
      tokens=jax.device_put(np.zeros((b, max_new_tokens), np.int32)),
      num_generated=jax.device_put(np.zeros((b,), np.int32)),
      stopped=jax.device_put(np.zeros((b,), bool)),
      step=jax.device_put(np.int32(0)),
      recorded=jnp.zeros((b, max_new_tokens, vocab), jnp.float32) if return_logits else None,
  )
  graphdef, params = nnx.split(model)
  mesh = state.cache.mesh
  args = (
      params,
      laid_out(decoding),
      shards.replicated(jax.device_put(stop), mesh),
      shards.replicated(sampling.arrays(), mesh),
      None if forced is None else shards.rows(forced, mesh),
  )
  return args, {"graphdef": graphdef, "evict": evict, "greedy": sampling.greedy}


def compile_decode_ahead(
    model, state: State, max_new_tokens: int, sampling: Sampling, stop, evict=True
) -> None:
  """Starts compiling, in the background, the decode loop `run_decode` will run on `state`
  once it is prefilled (same shapes; no forced tokens, no logits recorded): e.g. while the
  prompt is read. Nothing of `state` is read or kept."""
  args, statics = _decode_call(model, state, max_new_tokens, sampling, stop, None, False, evict)
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=x.sharding, weak_type=getattr(x, "weak_type", False)
      ),
      args,
  )
  compile_ahead(_decode, statics, *abstract, returns=_decode_returns)


def run_decode(
    model,
    state: State,
    max_new_tokens: int,
    sampling: Sampling,
    stop,
    forced,
    return_logits,
    evict,
) -> tuple[State, DecodeResult]:
  """`decode` after its checks: the compiled loop over a state with room for the tokens
  (donated), its status checked, the tokens and stats read back."""
  b = state.batch_size
  was_done = to_host(state.done)
  before = compile_stats()
  args, statics = _decode_call(
      model, state, max_new_tokens, sampling, stop, forced, return_logits, evict
  )
  loop = compiled(_decode, statics, *args, returns=_decode_returns)
  start = time.perf_counter()
  decoding = jax.block_until_ready(loop(*args))
  seconds = time.perf_counter() - start
  check(decoding.state.cache, decoding.state.logits, "decode")
  num_generated = to_host(decoding.num_generated)
  all_tokens, stopped = to_host(decoding.tokens), to_host(decoding.stopped)
  after = compile_stats()
  result = DecodeResult(
      tokens=[all_tokens[row, : num_generated[row]].tolist() for row in range(b)],
      finish_reasons=[
          "done" if was_done[row] else "stop" if stopped[row] else "length" for row in range(b)
      ],
      logits=decoding.recorded,
      stats={
          "generated_tokens": num_generated.tolist(),
          "decode_seconds": seconds,
          "decode_tokens_per_s": float(num_generated.sum()) / max(seconds, 1e-9),
          "compiles": after["compiles"] - before["compiles"],
          "loaded": after["loaded"] - before["loaded"],
          "compile_seconds": after["compile_seconds"] - before["compile_seconds"],
      },
  )
  return _chunk_free(decoding.state, like=state), result


class WorkProgress:
  """`callback(done, total)` over work made of several parts (a context read, then the
  passes that score it), in one unit (tokens processed: read, or scored): each part
  reports its own progress, counted after the parts before it, against the whole's
  `total`, so a bar reaches its end when the last part does. A policy gets one from
  `ContextReader.progress`."""

  def __init__(self, callback, total: int):
    self._callback, self.total, self._claimed = callback, int(total), 0

  def part(self, size: int):
    """The callback for the next part, `size` units of the total: it takes the part's own
    `(done, of)` (tokens of a read, layers of a scoring pass) and reports the whole's. None
    when nobody listens."""
    if self._callback is None:
      return None
    before, size = self._claimed, int(size)
    self._claimed += size

    def report(done, of):
      self._callback(min(before + size * min(done, of) // max(of, 1), self.total), self.total)

    return report


def _score_layer_returns(params, cache, *_):
  return cache  # `_score_layer`'s output structure (`compiled`)


@functools.partial(jax.jit, static_argnames=("graphdef", "policy"), donate_argnames="cache")
def _score_layer(params, cache, layer, next_position, *, graphdef, policy):
  """`policy.score_layer` on one layer (traced: one program for every layer), per shard."""
  model = nnx.merge(graphdef, params)
  scored = shards.on_shards(
      lambda c, layer, after: policy.score_layer(c, model, layer, after),
      cache,
      layer,
      next_position,
      specs=(P(), P(shards.DATA)),
  )
  return shards.constrain(scored)


@dataclasses.dataclass(frozen=True)
class ContextReader:
  """What a policy's `score_context` may do with a context before it is compressed: read
  tokens into the state (observing, or not; after the whole context, or after one span of
  it) and cut the cache back. What it reads is an `EncodedPrompts`, or rows of token ids
  (nothing protected)."""

  model: object
  tokenizer: object
  shape: ModelShape

  def read(
      self,
      state,
      encoded,
      *,
      observe=True,
      key=None,
      step="prefill",
      chunk=None,
      progress=None,
      scratch=False,
  ) -> State:
    """`encoded` read after each row's tokens, the policy observing (unless not `observe`)
    and nothing evicted; `chunk`: tokens per compiled step instead of the plan's;
    `scratch`: tokens that are cut away again (`cut`), so sliding layers keep everything
    meanwhile (what they free is gone)."""
    encoded = _encoded(encoded)
    plan = state.plan
    reading = plan if observe else dataclasses.replace(plan, eviction=None)
    if chunk is not None:
      reading = dataclasses.replace(reading, chunk=chunk)
    key = state.key if key is None else key
    state = prefill_chunks(
        self.model,
        state.replace(plan=reading),
        encoded,
        key,
        progress,
        step=step,
        slide=not scratch,
    )
    return state.replace(plan=plan)

  def cut(self, state, length) -> State:
    """The state with every sequence cut back to `length` tokens (their pages freed)."""
    return state.replace(cache=truncate(state.cache, length))

  def progress(self, callback, total: int) -> WorkProgress:
    """`callback(done, total)` shared by the parts of a policy's scoring (`WorkProgress`):
    `total` counts every part, e.g. the context's tokens plus each pass's."""
    return WorkProgress(callback, total)

  def score_layers(self, state, policy, progress=None) -> State:
    """The state with `policy.score_layer(cache, model, layer, next_position)` run on each
    layer in turn (one compiled step, per shard), after the context is read: scores from
    what the policy observed while reading. `next_position` [B]: the position after each
    row's last token. `progress(layers_done, layers)` after each layer."""
    graphdef, params = nnx.split(self.model)
    mesh = state.cache.mesh
    cache, layers = state.cache, state.cache.num_layers
    next_position = shards.rows(state.position, mesh)
    for layer in range(layers):
      args = (params, cache, shards.replicated(np.int32(layer), mesh), next_position)
      statics = {"graphdef": graphdef, "policy": policy}
      step = compiled(_score_layer, statics, *args, returns=_score_layer_returns)
      cache = step(*args)
      if progress is not None:
        progress(layer + 1, layers)
    return state.replace(cache=cache)

  def read_after_span(
      self, state, encoded, *, start: int, span: int, sink: int, lookback: int = 0, **read_options
  ) -> State:
    """`encoded` read (as `read` does, observing) after only the first `sink` tokens and
    the tokens `start - lookback:start + span` of each row's context, then cut away again:
    the new tokens attend to that stretch, not to the whole context, so a pass costs what
    the stretch does. `start`, `span` and `lookback` are whole pages; `sink` is rounded up
    to whole pages. The context's pages stay in place: the pass reads them through a window
    of the page table (`PageTable.window`), and the table is put back afterwards."""
    cache = state.cache
    ps = cache.config.page_size
    if start % ps or span % ps or lookback % ps or span < ps or lookback < 0:
      raise ValueError(
          f"start={start}, span={span} and lookback={lookback} must be whole pages of {ps} "
          "tokens (span at least one)"
      )
    encoded = _encoded(encoded)
    sink_pages = pages_for(sink, ps)
    pages = (lookback + span) // ps
    # Room for the new tokens after a span whose last page may be partly filled, and for
    # one compiled step of them.
    step = read_options.get("chunk") or state.plan.chunk
    room = max(pages_for(int(encoded.lengths.max()), ps) + 1, pages_for(step, ps))
    # A sliding layer's pass sees its own window (after the context, as a repeat would):
    # its whole table, which `slide` keeps under a window's peak.
    windows = cache.config.windows
    held = max((pages_for(window_peak(w, ps, 0), ps) for w in windows if w), default=0)
    width = max(sink_pages + pages, held) + room
    window = _window(
        cache,
        np.int32(max(start - lookback, 0) // ps),
        np.int32(start + span),
        sink_pages=sink_pages,
        pages=pages,
        width=width,
        entries=max(sink_pages + pages, held),
    )
    length = jnp.copy(window.length)  # the window's own tokens (its cache is donated)
    window = window.replace(
        config=dataclasses.replace(cache.config, max_tokens=width * ps, budget=None, threshold=None)
    )
    read = self.read(state.replace(cache=window), encoded, scratch=True, **read_options)
    cut = truncate(read.cache, length)
    restored = cut.replace(config=cache.config, pages=cache.pages.unwindow(cut.pages))
    return read.replace(cache=restored)


def _encoded(prompts) -> EncodedPrompts:
  return prompts if isinstance(prompts, EncodedPrompts) else EncodedPrompts.unmarked(prompts)


@functools.partial(jax.jit, static_argnames=("sink_pages", "pages", "width", "entries"))
def _window(
    cache: PagedKVCache, first_page, end, *, sink_pages: int, pages: int, width: int, entries: int
):
  """`cache` with a window of its page table (`PageTable.window`), `width` entries: each
  sequence's first `sink_pages` pages, then its tokens from page `first_page` up to token
  `end` (at most `pages` pages of them); from page 0 when `first_page` is within the sink.
  A sliding layer's sequences keep their whole tables (their first `entries` pages)."""
  ps = cache.config.page_size
  near = first_page <= sink_pages  # the stretch starts in (or just after) the sink
  head = jnp.arange(entries)
  span = jnp.where(near, head, jnp.where(head < sink_pages, head, first_page + head - sink_pages))
  span = jnp.where(head < sink_pages + pages, span, cache.config.max_pages)  # past: null
  capped = jnp.minimum(cache.length, end)  # [L, B, H]
  length = jnp.where(
      near,
      capped,
      jnp.minimum(cache.length, sink_pages * ps) + jnp.clip(capped - first_page * ps, 0, None),
  )
  full = full_layers(cache)  # [L]
  per_layer = jnp.where(full[:, None], span[None, :], head[None, :])  # [L, entries]
  length = jnp.where(full[:, None, None], length, cache.length)
  return cache.replace(pages=cache.pages.window(per_layer, length, width))


@jax.jit
def truncate(cache: PagedKVCache, length) -> PagedKVCache:
  """The cache cut back to `length` tokens per sequence (on every shard)."""
  cut = shards.on_shards(truncate_cache, cache, length, specs=(P(None, shards.DATA, shards.MODEL),))
  return shards.constrain(cut)
