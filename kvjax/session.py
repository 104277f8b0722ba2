"""The session API: prefill a context, decode, append more tokens, fork, all on one state.

    spec = kvjax.CompressionSpec(policy="h2o", budget=512)
    state = kvjax.prefill(model, [document], spec, tokenizer=tokenizer, chat=True)
    state, result = kvjax.decode(model, state, 32, stop_tokens=tokenizer.eos_ids)
    follow_up = kvjax.extend(model, state, [question_ids])     # another turn, same cache
    a, b = kvjax.fork(follow_up, 2)                              # two independent copies

A `State` is a pytree (the paged cache, the next-token logits, positions, the sampling key),
so it can be passed to `jax.jit`, copied and saved. Its static part is the `CachePlan` the
`CompressionSpec` resolved to at prefill. No function here invalidates the state it is given
unless asked to (`donate=True`, for loops that drop the old state anyway).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from kvjax import pages
from kvjax.cache import (
    WARNINGS,
    NumericsError,
    PagedKVCache,
    Status,
    check_status,
    init_cache,
    logical_view,
    valid_mask,
)
from kvjax import sharding as shards
from kvjax.compilation import compile_stats, compiled

from kvjax.eviction import truncate as _truncate_cache
from kvjax.policies import evict_once
from kvjax.prompts import EncodedPrompts, encode_prompts
from kvjax.seam import ModelShape, forward, query_heads
from kvjax.spec import CachePlan, CompressionSpec, capacity_bucket


@dataclasses.dataclass(frozen=True)
class Sampling:
  """Greedy when temperature == 0; else temperature, then top-k (0 = off), then top-p."""

  temperature: float = dataclasses.field(default=0.0, metadata={"help": "0 = greedy"})
  top_k: int = dataclasses.field(
      default=0, metadata={"help": "keep the k likeliest tokens; 0 = off"}
  )
  top_p: float = dataclasses.field(
      default=1.0, metadata={"help": "keep the smallest set of tokens with this much mass"}
  )

  def __post_init__(self):
    if isinstance(self.temperature, bool) or not (
        isinstance(self.temperature, (int, float)) and self.temperature >= 0
    ):
      raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
    if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
      raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
    if isinstance(self.top_p, bool) or not (
        isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1
    ):
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

  def arrays(self):
    """Traced (not static) values: changing them does not recompile."""
    values = (np.float32(self.temperature), np.int32(self.top_k), np.float32(self.top_p))
    return tuple(jax.device_put(x) for x in values)  # no eager op: nothing to compile


@struct.dataclass
class State:
  """A batch of sequences mid-generation: everything needed to continue them."""

  cache: PagedKVCache
  logits: Float[Array, "B V"]  # next-token logits of each row
  position: Int[Array, " B"]  # position of the next token of each row (= tokens seen)
  done: Bool[Array, " B"]  # the row stopped at a stop token; new tokens re-open it
  key: Array  # sampling and eviction randomness
  peak_pages: Int[Array, ""]  # most pages held at once so far
  plan: CachePlan = struct.field(pytree_node=False)

  @property
  def batch_size(self) -> int:
    return self.logits.shape[0]

  @property
  def spec(self) -> CompressionSpec:
    return self.plan.spec

  def kv_bytes(self) -> int:
    """Host-side: bytes of K and V held now."""
    return self.cache.kv_bytes()

  def peak_kv_bytes(self) -> int:
    return int(self.peak_pages) * self.cache.page_bytes


@dataclasses.dataclass
class DecodeResult:
  tokens: list[list[int]]  # generated ids per row, stop token excluded
  finish_reasons: list[
      str
  ]  # "stop" (a stop token), "length" (max_new_tokens), "done" (stopped before)
  logits: Array | None  # [B, N, V]: the logits each token was chosen from (return_logits=True)
  stats: dict  # decode_seconds, compile_seconds, compiles, loaded, decode_tokens_per_s


def _evict(eviction, cache: PagedKVCache, key) -> PagedKVCache:
  """`eviction.apply` on every shard of the cache (on the cache itself on one device)."""
  return shards.on_shards(eviction.apply, cache, key, specs=(P(),))


def _policy(plan: CachePlan):
  return None if plan.eviction is None else plan.eviction.policy


@functools.partial(jax.jit, static_argnames=("graphdef", "plan"), donate_argnames="cache")
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
):
  """One prefill chunk; returns the rows' last logits (the logits at `logits_at` where the
  row's prompt `ends_here`), the cache after eviction, and the peak of pages held (before
  eviction). The bookkeeping between chunks is done here, not by eager ops: each of those
  would compile a small program in a fresh process."""
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
  if plan.eviction is not None:
    cache = _evict(plan.eviction, cache, jax.random.fold_in(key, key_offset))
  last_logits = jnp.where(ends_here[:, None], logits, last_logits)
  return shards.rows(last_logits, cache.mesh), shards.constrain(cache), peak


def _nonfinite(logits: Float[Array, "B V"], rows: Bool[Array, " B"]) -> Bool[Array, ""]:
  """Whether any of `rows` has a NaN or Inf among its logits."""
  return (rows & ~jnp.isfinite(logits).all(-1)).any()


def _check(cache: PagedKVCache, logits, step: str) -> None:
  """`check_status`, after raising `NumericsError` for non-finite logits with the rows."""
  if Status(int(cache.status)) & Status.NONFINITE_LOGITS:
    rows = np.flatnonzero(~np.isfinite(shards.to_host(logits)).all(-1)).tolist()
    raise NumericsError(
        f"{step}: the model gave non-finite logits (NaN or Inf) for rows {rows}; a token "
        "drawn from them would be meaningless (a broken checkpoint, or an overflow in a "
        "low-precision dtype: try float32)"
    )
  check_status(cache)


def _prefill_chunk_returns(params, cache, last_logits, peak, *_):
  return last_logits, cache, peak  # `_prefill_chunk`'s output structure (`compiled`)


@struct.dataclass
class _Decoding:
  state: State
  tokens: Int[Array, "B N"]  # generated ids (N = max_new_tokens)
  num_generated: Int[Array, " B"]
  stopped: Bool[Array, " B"]  # stopped at a stop token in this call
  step: Int[Array, ""]
  recorded: Float[Array, "B N V"] | None  # the logits each token was chosen from


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


@functools.partial(jax.jit, static_argnames=("graphdef", "evict"), donate_argnames="decoding")
def _decode(params, decoding: _Decoding, stop_tokens, sampling, forced, *, graphdef, evict):
  """Decode steps until every row has its tokens or stopped, or the cache fails. Every
  emitted token is fed, so the state continues after the last one."""
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
    if forced is None:
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
    logits, cache = forward(
        model,
        token[:, None],
        s.position[:, None],
        s.cache,
        emit.astype(jnp.int32),
        policy=_policy(plan),
        attention_impl=plan.impl,
    )
    # Rows whose new logits are not finite stop the loop with them (`cond`), undrawn.
    cache = cache.raise_status(_nonfinite(logits[:, 0], emit), Status.NONFINITE_LOGITS)
    peak_pages = jnp.maximum(s.peak_pages, cache.pages_in_use().sum())
    if eviction is not None:
      cache = _evict(eviction, cache, evict_key)
    state = s.replace(
        cache=shards.constrain(cache),
        logits=shards.rows(jnp.where(emit[:, None], logits[:, 0], s.logits), cache.mesh),
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

  return _laid_out(jax.lax.while_loop(cond, body, decoding))


def _decode_returns(params, decoding, *_):
  return decoding  # `_decode`'s output structure (`compiled`)


def _laid_out(tree):
  """A `State` or `_Decoding` with its arrays in the mesh layout of its cache: the cache's
  own, per-row arrays over `data`, the rest replicated. Inside jit a constraint, on the
  host a placement; nothing on one device. Compiled steps then hand each other arrays of
  one sharding (no second compilation for a sharding the first call did not see)."""
  state = tree if isinstance(tree, State) else tree.state
  mesh = state.cache.mesh
  if mesh is None:
    return tree
  row, one = (lambda x: shards.rows(x, mesh)), (lambda x: shards.replicated(x, mesh))  # noqa: E731
  state = state.replace(
      cache=shards.constrain(state.cache)
      if isinstance(state.cache.length, jax.core.Tracer)
      else shards.place(state.cache),
      logits=row(state.logits),
      position=row(state.position),
      done=row(state.done),
      key=one(state.key),
      peak_pages=one(state.peak_pages),
  )
  if isinstance(tree, State):
    return state
  return tree.replace(
      state=state,
      tokens=row(tree.tokens),
      num_generated=row(tree.num_generated),
      stopped=row(tree.stopped),
      step=one(tree.step),
      recorded=None if tree.recorded is None else row(tree.recorded),
  )


# ---- the public API ------------------------------------------------------------------------


def prefill(
    model,
    prompts,
    spec: CompressionSpec | None = None,
    *,
    tokenizer=None,
    chat: bool = False,
    reserve: int = 256,
    seed: int = 0,
    key: Array | None = None,
    progress: Callable[[int, int], None] | None = None,
    mesh=None,
) -> State:
  """Prefills a batch of prompts into a compressed cache, in chunks with eviction after each.

  Args:
    model: any model with the kvjax seam (`model.run`, see `kvjax.seam`).
    prompts: per row a str, token ids, or a list of str/`Segment` (marked spans).
    spec: the `CompressionSpec` (default: the full cache).
    tokenizer: encodes text (and the chat template); not needed for token ids.
    chat: wrap text prompts as a user message in the chat template; the template's own
      tokens are protected.
    reserve: with the full cache, room for this many more tokens per row before the cache
      grows (each growth re-lays the cache out and compiles new shapes once).
    seed, key: randomness for sampling and random eviction.
    progress: called as `progress(tokens_read, tokens_total)` (of the longest prompt) after
      each prefill chunk, e.g. to draw a progress bar.
    mesh: shard the cache and the model over devices (`kvjax.sharding`): a jax `Mesh` with
      axes ('data', 'model'), "data=2,model=2", a dict or (data, model). Rows go over
      `data`, kv heads over `model`; the model's weights are placed on the mesh (in place)
      by its `partition` rules. The state keeps the mesh: `decode`/`extend` run sharded.
  """
  spec = CompressionSpec() if spec is None else spec
  if progress is not None and not callable(progress):
    raise TypeError(f"progress must be a callable(done, total) or None, got {progress!r}")
  state, encoded, shape, reserve = _begin(
      model, prompts, spec, tokenizer, chat, reserve, seed, key, mesh
  )
  if not state.plan.compresses_after_prefill:
    return _prefill(model, state, encoded, state.key, progress)
  state = _read_and_score(model, state, encoded, tokenizer, shape, progress)
  return _compress(state, reserve)


def context_scores(
    model, prompts, spec: CompressionSpec, *, tokenizer=None, chat: bool = False
) -> tuple[np.ndarray, np.ndarray]:
  """What a policy that compresses the context once (kvzip, learned, expected_attention)
  thinks of every token of `prompts` before it evicts anything: scores [L, B, H, N] in
  logical order (token n of row b at index n) and the mask of live tokens [L, B, H, N]."""
  scored = scored_context(model, prompts, spec, tokenizer=tokenizer, chat=chat)
  return scored.scores, scored.valid


@dataclasses.dataclass(frozen=True)
class ScoredContext:
  """A context read whole and scored, nothing evicted (host arrays, logical order: token n
  of row b at index n of every sequence)."""

  scores: np.ndarray  # [L, B, H, N] float32: the policy's scores, higher = keep
  valid: np.ndarray  # [L, B, H, N] bool: live tokens
  marked: np.ndarray  # [L, B, H, N] bool: tokens the prompt protects (Segment(protected=True))
  keys: np.ndarray  # [L, B, H, N, D]: cached keys (position-encoded) of the full context
  values: np.ndarray  # [L, B, H, N, D]
  logits: np.ndarray  # [B, V]: the prediction after each row's last token


def scored_context(
    model, prompts, spec: CompressionSpec, *, tokenizer=None, chat: bool = False
) -> ScoredContext:
  """`context_scores` with the cached K/V and marks (what `kvjax.tune` learns from)."""
  if not isinstance(spec, CompressionSpec) or not spec.once:
    raise ValueError(
        "context_scores needs a CompressionSpec whose policy compresses the context once "
        f"(e.g. kvzip, learned, expected_attention), got {spec!r}"
    )
  state, encoded, shape, _ = _begin(model, prompts, spec, tokenizer, chat, 0, 0, None)
  state = _read_and_score(model, state, encoded, tokenizer, shape)
  cache = state.cache
  check_status(cache)
  return ScoredContext(
      scores=np.asarray(logical_view(cache, cache.slot("score"))),
      valid=np.asarray(valid_mask(cache)),
      marked=np.asarray(logical_view(cache, cache.slot("protected"))),
      keys=np.asarray(logical_view(cache, cache.k_pages)),
      values=np.asarray(logical_view(cache, cache.v_pages)),
      logits=np.asarray(state.logits),
  )


def extend(model, state: State, prompts, *, tokenizer=None, donate: bool = False) -> State:
  """Appends more tokens to every row (a follow-up question, a new turn), with the state's
  compression; a row given no tokens (`[]`) is left as it is. Text is encoded as it is (no
  chat template: give the template's tokens yourself for a new chat turn)."""
  _check_state(state)
  if state.cache.mesh is not None:
    _check_placement(model, state.cache.mesh)
  shape = ModelShape.of(model)
  encoded = encode_prompts(
      tokenizer, prompts, chat=False, vocab_size=shape.vocab_size, allow_empty=True
  )
  if len(encoded.ids) != state.batch_size:
    raise ValueError(f"prompts has {len(encoded.ids)} rows; the state has {state.batch_size}")
  if not encoded.lengths.any():
    raise ValueError("prompts adds no token to any row")
  # Segment ids continue the state's, so fair eviction tells the turns apart.
  offset = int(state.cache.slot("segment").max())
  encoded = dataclasses.replace(
      encoded, segment=[[s + offset if s else 0 for s in row] for row in encoded.segment]
  )
  state = _fit(state, shape, int(encoded.lengths.max()), donate)
  return _prefill(model, state, encoded, jax.random.fold_in(state.key, 1), step="extend")


def decode(
    model,
    state: State,
    max_new_tokens: int,
    *,
    sampling: Sampling = Sampling(),
    stop_tokens=(),
    forced=None,
    return_logits: bool = False,
    evict: bool = True,
    donate: bool = False,
) -> tuple[State, DecodeResult]:
  """Generates up to `max_new_tokens` per row from `state` in one jitted loop.

  Args:
    sampling: a `Sampling` (greedy by default); the state's key drives it.
    stop_tokens: ids that end a row (excluded from its tokens); e.g. `tokenizer.eos_ids`.
    forced: token ids [B, max_new_tokens] to feed instead of sampling (teacher forcing);
      with `return_logits`, the logits predicting each of them.
    return_logits: also return the logits each token was chosen from, [B, N, V].
    evict: False keeps the policy observing but never evicts (to time eviction's cost);
      the cache then grows by max_new_tokens, within one prefill chunk of headroom.
    donate: reuse the state's buffers (the given state is invalid afterwards).
  Returns the state after the last generated token (every token is in the cache) and
  a `DecodeResult`.
  """
  _check_state(state)
  if state.cache.mesh is not None:
    _check_placement(model, state.cache.mesh)
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
  if not isinstance(sampling, Sampling):
    raise TypeError(f"sampling must be a kvjax.Sampling, got {type(sampling).__name__}")
  shape = ModelShape.of(model)
  b = state.batch_size
  if forced is not None:
    forced = jnp.asarray(forced)
    if forced.shape != (b, max_new_tokens) or not jnp.issubdtype(forced.dtype, jnp.integer):
      raise ValueError(
          f"forced must be integer [B, max_new_tokens] = ({b}, {max_new_tokens}), got "
          f"{forced.shape} {forced.dtype}"
      )
    forced = forced.astype(jnp.int32)
  stop = np.asarray(list(stop_tokens) or [-1], np.int32)
  if stop.ndim != 1:
    raise ValueError(f"stop_tokens must be a list of ids, got {stop_tokens!r}")
  state = _fit(state, shape, max_new_tokens, donate)
  vocab = state.logits.shape[-1]
  decoding = _Decoding(
      state=state,
      tokens=jax.device_put(np.zeros((b, max_new_tokens), np.int32)),
      num_generated=jax.device_put(np.zeros((b,), np.int32)),
      stopped=jax.device_put(np.zeros((b,), bool)),
      step=jax.device_put(np.int32(0)),
      recorded=jnp.zeros((b, max_new_tokens, vocab), jnp.float32) if return_logits else None,
  )
  decoding = _laid_out(decoding)
  was_done = shards.to_host(state.done)
  graphdef, params = nnx.split(model)
  before = compile_stats()
  mesh = state.cache.mesh
  args = (
      params,
      decoding,
      shards.replicated(jax.device_put(stop), mesh),
      shards.replicated(sampling.arrays(), mesh),
      None if forced is None else shards.rows(forced, mesh),
  )
  steps = compiled(_decode, {"graphdef": graphdef, "evict": evict}, *args, returns=_decode_returns)
  start = time.perf_counter()
  decoding = jax.block_until_ready(steps(*args))
  seconds = time.perf_counter() - start
  _check(decoding.state.cache, decoding.state.logits, "decode")
  num_generated = shards.to_host(decoding.num_generated)
  all_tokens, stopped = shards.to_host(decoding.tokens), shards.to_host(decoding.stopped)
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
  return decoding.state, result


def fork(state: State, num: int | None = None) -> State | list[State]:
  """Independent copies of `state` (new buffers, no recomputation), each with its own
  sampling key; `num=None` returns one copy. States are immutable, so a state that is never
  donated can also simply be reused."""
  _check_state(state)
  if num is not None and (isinstance(num, bool) or not isinstance(num, int) or num < 1):
    raise ValueError(f"num must be an int >= 1 or None, got {num!r}")
  keys = jax.random.split(state.key, num or 1)
  copies = [_copy(state).replace(key=keys[i]) for i in range(num or 1)]
  return copies[0] if num is None else copies


# ---- internals -----------------------------------------------------------------------------


def _begin(model, prompts, spec, tokenizer, chat, reserve, seed, key, mesh=None):
  """A new state for `prompts` (nothing read yet) with the cache `spec` plans for them;
  returns (state, encoded prompts, model shape, reserve clipped to the model context)."""
  if not isinstance(spec, CompressionSpec):
    raise TypeError(f"spec must be a kvjax.CompressionSpec, got {type(spec).__name__}")
  shape = ModelShape.of(model)
  spec.policy.check_model(model)
  if spec.allocation is not None:
    spec.allocation.check_model(model)
  if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
    raise ValueError(f"reserve must be an int >= 0, got {reserve!r}")
  encoded = encode_prompts(tokenizer, prompts, chat=chat, vocab_size=shape.vocab_size)
  longest = int(encoded.lengths.max())
  if longest > shape.max_context:
    raise ValueError(
        f"prompt of {longest} tokens is longer than the model context {shape.max_context}"
    )
  reserve = min(reserve, shape.max_context - longest)
  batch = len(encoded.ids)
  most_protected = max(sum(row) for row in encoded.protected)
  plan = spec.plan(shape, batch=batch, longest=longest, reserve=reserve, protected=most_protected)
  policy = _policy(plan)
  slots = () if policy is None else policy.slots
  dims = (shape.n_layers, batch, shape.n_kv_heads, shape.head_dim)
  mesh = shards.make_mesh(mesh)
  if mesh is not None:
    shards.check_mesh(mesh, batch=batch, kv_heads=shape.n_kv_heads)
    shards.check_policy(policy)
    if spec.allocation is not None:
      raise ValueError("a learned head allocation is not sharded yet: run it without a mesh")
    if shards.model_mesh(model) != mesh:
      shards.shard_model(model, mesh)
    shares_heads = plan.eviction is not None and plan.eviction.per_head
    plan = dataclasses.replace(
        plan, config=shards.shard_config(plan.config, mesh, shares_heads=shares_heads)
    )
    cache = shards.sharded_cache(plan.config, mesh, *dims, chunk=plan.chunk, slots=slots)
  else:
    _check_placement(model, None)
    extra = {}
    if policy is not None and policy.keeps_extra:  # only then: Hq costs an abstract model call
      extra = policy.init_extra(
          shape.n_layers, batch, shape.n_kv_heads, query_heads(model), shape.head_dim
      )
    cache = init_cache(plan.config, *dims, chunk=plan.chunk, slots=slots, extra=extra)
  # Host-made arrays: device transfers, no eager op to compile on a first call. The
  # prefill's eviction keys are folded from `key` per chunk; decoding splits it per step.
  state = State(
      cache=cache,
      logits=jax.device_put(np.zeros((batch, shape.vocab_size), np.float32)),
      position=jax.device_put(np.zeros((batch,), np.int32)),
      done=jax.device_put(np.zeros((batch,), bool)),
      key=jax.random.key(seed) if key is None else key,
      peak_pages=jax.device_put(np.int32(0)),
      plan=plan,
  )
  return _laid_out(state), encoded, shape, reserve


def _copy(tree):
  """A copy of every array in `tree` (new buffers), PRNG keys included."""

  def copy(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(jnp.copy(jax.random.key_data(x)))
    return jnp.copy(x)

  return jax.tree.map(copy, tree)


def _check_placement(model, mesh) -> None:
  """ValueError when the model's weights live on another mesh than the cache (a cache of
  one device with weights spread over several, or a sharded one on another mesh)."""
  placed = shards.model_mesh(model)
  if placed is not None and mesh is None and placed.size == 1:
    return  # weights on one device's mesh serve a one-device cache
  if placed != mesh:
    where = "one device" if mesh is None else f"the mesh {dict(mesh.shape)}"
    there = "one device" if placed is None else f"the mesh {dict(placed.shape)}"
    raise ValueError(
        f"the model's weights are on {there} and the state's cache on {where}: prefill "
        "with the model's mesh (mesh=), or load the model again for one device"
    )


def _check_state(state):
  if not isinstance(state, State):
    raise TypeError(f"state must be a kvjax.State (from kvjax.prefill), got {type(state).__name__}")


def _prefill(
    model, state: State, encoded: EncodedPrompts, key, progress=None, step: str = "prefill"
) -> State:
  """Chunked prefill of `encoded` after each row's current position (donates `state`);
  `progress(tokens_read, tokens_total)` after each chunk; `step` names it in errors."""
  plan, chunk = state.plan, state.plan.chunk
  graphdef, params = nnx.split(model)
  lengths = encoded.lengths
  starts = shards.to_host(state.position)
  mesh = state.cache.mesh
  row = lambda x: shards.rows(x, mesh)  # noqa: E731
  ids, protected, segment = encoded.padded(-(-int(lengths.max()) // chunk) * chunk)
  # The peak stays on device: reading it per chunk would stall dispatch of the next chunk.
  last_logits, cache, peak = state.logits, state.cache, state.peak_pages
  statics = {"graphdef": graphdef, "plan": plan}
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
  _check(cache, last_logits, step)
  added = lengths > 0
  state = state.replace(
      cache=cache,
      logits=jax.block_until_ready(last_logits),
      position=jax.device_put((starts + lengths).astype(np.int32)),
      done=jax.device_put(shards.to_host(state.done) & ~added),
      peak_pages=peak,
  )
  return _laid_out(state)


def _fit(state: State, shape: ModelShape, more: int, donate: bool) -> State:
  """The state, owned by the caller's next step (copied unless `donate`), with room for
  `more` tokens per row: past the model's context is an error; a cache that keeps every
  token (the full cache, or a context compressed once) grows when it is too short: longer
  page tables, more pages (new shapes, compiled once). An evicting cache's pool, sized
  for the first request, grows to what its budgets (and its protected tokens) hold."""
  furthest = int(shards.to_host(state.position).max()) + more
  if furthest > shape.max_context:
    raise ValueError(
        f"the state's rows reach position {furthest - more}; {more} more tokens pass the "
        f"model context {shape.max_context}"
    )
  if not donate:
    state = _copy(state)
  cache, cfg = state.cache, state.cache.config
  ps = cfg.page_size
  # Per shard (one on a single device): each shard's pool serves its own sequences.
  length = shards.blocks(cache, shards.to_host(cache.length))  # [G, L, b, h]
  num_free = np.atleast_1d(shards.to_host(cache.pages.num_free))  # [G]
  held = pages.pages_for(length, ps)
  shard_total = lambda x: x.sum(axis=(1, 2, 3))  # noqa: E731
  eviction = state.plan.eviction
  if eviction is not None:
    # Eviction holds a sequence at its budget (x heads when they share it) + one page of
    # margin + one chunk; a sequence already past that (protected tokens are never
    # evicted) may grow by a margin and a chunk before eviction brings it back.
    heads = cache.num_kv_heads if eviction.per_head else 1
    margin = ps + state.plan.chunk
    peak = np.asarray(eviction.layer_budget)[:, None, None] * heads + margin
    target = np.minimum(length + more, np.maximum(peak, length + margin))
    needed = shard_total(np.maximum(pages.pages_for(target, ps) - held, 0))
    capacity = max(cfg.max_tokens, pages.pages_for(int(target.max()), ps) * ps)
    if (needed <= num_free).all() and capacity == cfg.max_tokens:
      return state
    return _grow(state, capacity, int(np.maximum(needed - num_free, 0).max()))
  needed = shard_total(pages.pages_for(length + more, ps) - held)
  capacity = cfg.max_tokens
  if int(length.max()) + more <= capacity and (needed <= num_free).all():
    return state
  # Grow by at least half of what each sequence can hold, so growth is rare.
  room = max(more, capacity // 2)
  top = math.ceil(shape.max_context / ps) * ps
  if int(length.max()) + more > capacity:
    capacity = min(capacity_bucket(int(length.max()) + room, ps, shape.max_context), top)
  needed = shard_total(pages.pages_for(np.minimum(length + room, capacity), ps) - held)
  return _grow(state, capacity, int(np.maximum(needed - num_free, 0).max()))


def _grow(state: State, capacity: int, extra: int) -> State:
  """The state with page tables for `capacity` tokens per sequence and `extra` more free
  pages in every shard's pool (new shapes, compiled once)."""
  cache, cfg = state.cache, state.cache.config
  num_free = np.atleast_1d(shards.to_host(cache.pages.num_free))  # [G]
  p = cache.num_pages

  axis = 0 if cache.mesh is None else 1  # the pool axis ([G, P, ...] when sharded)

  def pad(x, value):  # `extra` pages of `value` after every shard's pool
    more = jnp.full((*x.shape[:axis], extra, *x.shape[axis + 1 :]), value, x.dtype)
    return jnp.concatenate([x, more], axis=axis)

  old_free = shards.per_shard(cache, shards.to_host(cache.pages.free_pages))  # [G, P]
  free = pages.grown_free_stacks(old_free, num_free, extra)
  table = cache.page_table
  new_cfg = dataclasses.replace(cfg, max_tokens=capacity, num_pages=p + extra)
  grown = cache.replace(
      k_pages=pad(cache.k_pages, 0),
      v_pages=pad(cache.v_pages, 0),
      slots={s.name: pad(cache.slots[s.name], s.empty) for s in cache.slot_specs},
      pages=cache.pages.replace(
          table=jnp.concatenate(
              [
                  table,
                  jnp.full(
                      (*table.shape[:-1], new_cfg.max_pages - cfg.max_pages),
                      pages.NULL_PAGE,
                      jnp.int32,
                  ),
              ],
              axis=-1,
          ),
          free_pages=jnp.asarray(shards.from_per_shard(cache, free)),
          num_free=jnp.asarray(shards.from_per_shard(cache, (num_free + extra).astype(np.int32))),
      ),
      config=new_cfg,
  )
  return state.replace(
      cache=shards.place(grown), plan=dataclasses.replace(state.plan, config=new_cfg)
  )


# ---- a context compressed once ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _ContextReader:
  """What a policy's `score_context` may do with a context before it is compressed: read
  tokens into the state (observing, or not) and cut the cache back."""

  model: object
  tokenizer: object
  shape: ModelShape

  def read(
      self, state, encoded, *, observe=True, key=None, step="prefill", chunk=None, progress=None
  ) -> State:
    """`encoded` read after each row's tokens, the policy observing (unless not `observe`)
    and nothing evicted; `chunk`: tokens per compiled step instead of the plan's."""
    plan = state.plan
    reading = plan if observe else dataclasses.replace(plan, eviction=None)
    if chunk is not None:
      reading = dataclasses.replace(reading, chunk=chunk)
    key = state.key if key is None else key
    state = _prefill(self.model, state.replace(plan=reading), encoded, key, progress, step=step)
    return state.replace(plan=plan)

  def cut(self, state, length) -> State:
    """The state with every sequence cut back to `length` tokens (their pages freed)."""
    return state.replace(cache=_truncate(state.cache, length))


def _read_and_score(
    model, state: State, encoded: EncodedPrompts, tokenizer, shape, progress=None
) -> State:
  """The context read into the cache with nothing evicted, and scored as its policy says
  (`Policy.score_context`: observed while it is read, or by kvzip's reconstruction)."""
  reader = _ContextReader(model, tokenizer, shape)
  return state.plan.eviction.policy.score_context(reader, state, encoded, progress)


def _compress(state: State, reserve: int) -> State:
  """Evicts every sequence of a scored context to its share of the budget
  (`spec.head_budget`, or the tokens above `spec.threshold`), and re-lays the pool out to
  what is kept (+ `reserve`)."""
  plan = state.plan
  spec = plan.spec
  threshold = jnp.float32(spec.threshold if spec.auto else 0.0)  # traced: no recompile
  cache = evict_once(
      state.cache,
      threshold,
      jax.random.fold_in(state.key, 2),
      policy=plan.eviction.policy,
      sharing=spec.sharing,
      auto=spec.auto,
      impl=plan.impl,
      allocation=spec.allocation,
  )
  check_status(cache)
  # The context is compressed once: later tokens are kept (no observation, no eviction), so
  # the policy's state that is not per token is dropped with its memory.
  cache = _compact_pool(cache, reserve).replace(extra={})
  compressed = dataclasses.replace(plan, config=cache.config, eviction=None)
  peak = max(int(state.peak_pages), int(cache.pages_in_use().sum()))
  return state.replace(cache=cache, plan=compressed, peak_pages=jnp.int32(peak))


@jax.jit
def _truncate(cache: PagedKVCache, length) -> PagedKVCache:
  """The cache cut back to `length` tokens per sequence (on every shard)."""
  cut = shards.on_shards(
      _truncate_cache, cache, length, specs=(P(None, shards.DATA, shards.MODEL),)
  )
  return shards.constrain(cut)


def _compact_pool(cache: PagedKVCache, reserve: int) -> PagedKVCache:
  """The cache in a pool of exactly its live pages, plus room for `reserve` more tokens per
  sequence: evicted memory is returned, not only marked free. A sharded cache compacts
  every shard's pool on its own; they share one size (the largest need)."""
  length = shards.blocks(cache, shards.to_host(cache.length))  # [G, L, b, h]
  table = shards.blocks(cache, shards.to_host(cache.page_table))  # [G, L, b, h, M]
  # Shard g's new pool: its null page, its live pages in table order, then free pages.
  num_pages, live, gather, packed, free = pages.compact_plan(
      table, length, cache.config.page_size, reserve
  )
  used = np.arange(num_pages) <= live[:, None]  # [G, num_pages]

  def compact(x, empty):
    if cache.mesh is None:  # one pool: its live pages, then fresh free pages
      kept = x[jnp.asarray(gather[0, : 1 + live[0]])]
      fresh = jnp.full((num_pages - 1 - live[0], *x.shape[1:]), empty, x.dtype)
      return jnp.concatenate([kept, fresh])
    kept = jax.vmap(lambda pool, ids: pool[ids])(x, jnp.asarray(gather))
    mask = jnp.asarray(used.reshape(*used.shape, *([1] * (kept.ndim - 2))))
    return jnp.where(mask, kept, jnp.asarray(empty, x.dtype))

  compacted = cache.replace(
      k_pages=compact(cache.k_pages, 0),
      v_pages=compact(cache.v_pages, 0),
      slots={s.name: compact(cache.slots[s.name], s.empty) for s in cache.slot_specs},
      pages=cache.pages.replace(
          table=jnp.asarray(shards.unblocks(cache, packed)),
          free_pages=jnp.asarray(shards.from_per_shard(cache, free)),
          num_free=jnp.asarray(
              shards.from_per_shard(cache, (num_pages - 1 - live).astype(np.int32))
          ),
      ),
      config=dataclasses.replace(cache.config, num_pages=num_pages),
  )
  return shards.place(compacted)
