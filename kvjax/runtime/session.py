"""The session API: prefill a context, decode, append more tokens, fork, all on one state.

    spec = kvjax.CompressionSpec(policy="kvzip", budget=0.25)
    state = kvjax.prefill(model, [document], spec, tokenizer=tokenizer, chat=True)
    _, answer = kvjax.ask(model, tokenizer, state, ["Who wrote it?"], chat=True)  # state kept
    _, other = kvjax.ask(model, tokenizer, state, ["When?"], chat=True)  # same context

    state = kvjax.prefill(model, [text], spec, tokenizer=tokenizer)      # raw text, continued
    state, result = kvjax.decode(model, state, 32, stop_tokens=tokenizer.eos_ids)
    follow_up = kvjax.extend(model, state, [more_ids])           # more tokens, same cache
    a, b = kvjax.fork(follow_up, 2)                              # two independent copies

A `State` is a pytree (the paged cache, the next-token logits, positions, the sampling key),
so it can be passed to `jax.jit`, copied and saved. Its static part is the `CachePlan` the
`CompressionSpec` resolved to at prefill. No function here invalidates the state it is given
unless asked to (`donate=True`, for loops that drop the old state anyway).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from kvjax.runtime import pool, steps
from kvjax import sharding as shards
from kvjax.cache.paged_cache import check_status, init_cache, logical_view, valid_mask
from kvjax.runtime.prompts import EncodedPrompts, encode_prompts, has_text
from kvjax.runtime.tokenizer import tokenizer_for
from kvjax.runtime.sampling import Sampling, check_seed
from kvjax.seam import ModelShape, query_heads
from kvjax.spec import CompressionSpec
from kvjax.runtime.state import DecodeResult, State, copy, laid_out
from kvjax._checks import check_int


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
    chat: each text prompt is a context that opens a user message of the chat template
      (its opening, the system prompt and role markers, protected); `kvjax.ask` closes it
      with a question, protected from eviction.
    reserve: with the full cache, room for this many more tokens per row before the cache
      grows (each growth re-lays the cache out and compiles new shapes once); clipped to
      the model context.
    seed: randomness for sampling and random eviction (`jax.random.key(seed)`), when no
      `key` is given: an int in [0, 2**32 - 1].
    key: a jax random key, used instead of `seed`.
    progress: called as `progress(done, total)` as the context is read, e.g. to draw a
      progress bar: tokens of the longest prompt; for a policy that compresses the context
      once, `total` also counts its scoring (kvzip's passes, expected_attention's keys), so
      `done == total` once the context is scored.
    mesh: shard the cache and the model over devices (`kvjax.sharding`): a jax `Mesh` with
      axes ('data', 'model'), "data=2,model=2", a dict or (data, model). Rows go over
      `data`, kv heads over `model`; the model's weights are placed on the mesh (in place)
      by its `partition` rules. The state keeps the mesh: `decode`/`extend` run sharded.
  """
  spec = CompressionSpec() if spec is None else spec
  begun = begin(model, prompts, spec, tokenizer, chat, reserve, seed, key, mesh)
  return read(model, begun, tokenizer, progress)


@dataclasses.dataclass(frozen=True)
class Begun:
  """A prefill begun (`begin`): the new state, nothing read yet, and what `read` needs."""

  state: State
  encoded: EncodedPrompts
  shape: ModelShape
  reserve: int  # clipped to the model context


def read(model, begun: Begun, tokenizer=None, progress=None) -> State:
  """The rest of `prefill` after `begin`: the prompts read (and the context compressed, for
  a policy that compresses it once). Between the two, the new state's shapes are known:
  `kvjax.generate` starts compiling its decode loop there."""
  if progress is not None and not callable(progress):
    raise TypeError(f"progress must be a callable(done, total) or None, got {progress!r}")
  state, encoded = begun.state, begun.encoded
  if not state.plan.compresses_after_prefill:
    return steps.prefill_chunks(model, state, encoded, state.key, progress)
  state = _read_and_score(model, state, encoded, tokenizer, begun.shape, progress)
  return pool.compress(state, begun.reserve)


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
  """A context read whole and scored, nothing evicted (host arrays in position order: token n
  of row b at index n of every sequence; a sliding layer holds only its window's latest
  tokens, the rest not `valid`)."""

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
  begun = begin(model, prompts, spec, tokenizer, chat, 0, 0, None)
  state = _read_and_score(model, begun.state, begun.encoded, tokenizer, begun.shape)
  cache = state.cache
  check_status(cache)
  valid = np.asarray(valid_mask(cache))
  # A sliding layer has freed the pages its window passed: its tokens sit from index 0 of
  # the view, not at their positions. Every sequence is put back in position order.
  index = np.where(valid, np.asarray(logical_view(cache, cache.slot("position"))), -1)

  def ordered(view):
    return _in_position_order(np.asarray(view), index)

  return ScoredContext(
      scores=ordered(logical_view(cache, cache.slot("score"))),
      valid=ordered(valid),
      marked=ordered(logical_view(cache, cache.slot("protected"))),
      keys=ordered(logical_view(cache, cache.k_pages)),
      values=ordered(logical_view(cache, cache.v_pages)),
      logits=np.asarray(state.logits),
  )


def _in_position_order(view: np.ndarray, position: np.ndarray) -> np.ndarray:
  """view [L, B, H, N, ...] with each live entry moved to index `position` [L, B, H, N]
  (-1: not live; its index is left zero)."""
  n = view.shape[3]
  where = np.where(position >= 0, position, n)  # a dead entry goes to a dropped extra index
  where = where.reshape(where.shape + (1,) * (view.ndim - 4))
  out = np.zeros(view.shape[:3] + (n + 1,) + view.shape[4:], view.dtype)
  np.put_along_axis(out, np.broadcast_to(where, view.shape), view, axis=3)
  return out[:, :, :, :n]


def extend(model, state: State, prompts, *, tokenizer=None, donate: bool = False) -> State:
  """Appends more tokens to every row (a follow-up question, a new turn), with the state's
  compression; a row given no tokens (`[]`) is left as it is. Text is encoded as it is (no
  chat template: give the template's tokens yourself for a new chat turn)."""
  _check_state(state)
  if state.cache.mesh is not None:
    _check_placement(model, state.cache.mesh)
  shape = ModelShape.of(model)
  tokenizer = tokenizer_for(tokenizer, ["text"] if has_text(prompts) else [])
  encoded = encode_prompts(
      tokenizer, prompts, chat=False, vocab_size=shape.vocab_size, allow_empty=True, start=False
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
  state = pool.fit(state, shape, int(encoded.lengths.max()), donate)
  return steps.prefill_chunks(
      model, state, encoded, jax.random.fold_in(state.key, 1), step="extend"
  )


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
  check_int("max_new_tokens", max_new_tokens)
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
  stop = steps.stop_array(stop_tokens)
  state = pool.fit(state, shape, max_new_tokens, donate)
  return steps.run_decode(
      model, state, max_new_tokens, sampling, stop, forced, return_logits, evict
  )


def fork(state: State, num: int | None = None) -> State | list[State]:
  """Independent copies of `state` (new buffers, no recomputation), each with its own
  sampling key; `num=None` returns one copy. States are immutable, so a state that is never
  donated can also simply be reused."""
  _check_state(state)
  if num is not None:
    check_int("num", num, note=" or None")
  keys = jax.random.split(state.key, num or 1)
  copies = [copy(state).replace(key=keys[i]) for i in range(num or 1)]
  return copies[0] if num is None else copies


def begin(
    model, prompts, spec, tokenizer, chat, reserve, seed, key, mesh=None, protected_after: int = 0
) -> Begun:
  """The first part of `prefill` (its checks; the arguments are `prefill`'s): a new state
  for `prompts`, nothing read yet, with the cache `spec` plans for them (and for
  `protected_after` protected tokens a row appends next: a question read after its context,
  which eviction must hold beside the budget without growing the pool)."""
  if not isinstance(spec, CompressionSpec):
    raise TypeError(f"spec must be a kvjax.CompressionSpec, got {type(spec).__name__}")
  shape = ModelShape.of(model)
  spec.policy.check_model(model)
  if spec.allocation is not None:
    spec.allocation.check_model(model)
  check_int("reserve", reserve, 0)
  if key is None:
    check_seed(seed)
  spec.check_context(shape.max_context)  # before the prompts are encoded (`plan` again)
  needs = ["text"] * has_text(prompts) + ["chat"] * bool(chat)
  tokenizer = tokenizer_for(tokenizer, needs)
  encoded = encode_prompts(tokenizer, prompts, chat=chat, vocab_size=shape.vocab_size)
  longest = encoded.longest(shape.max_context)
  reserve = min(reserve, shape.max_context - longest)
  batch = len(encoded.ids)
  most_protected = max(sum(row) for row in encoded.protected) + protected_after
  plan = spec.plan(shape, batch=batch, longest=longest, reserve=reserve, protected=most_protected)
  policy = None if plan.eviction is None else plan.eviction.policy
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
      plan=dataclasses.replace(plan, config=None),  # the cache holds the layout
  )
  return Begun(laid_out(state), encoded, shape, reserve)


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


def _read_and_score(
    model, state: State, encoded: EncodedPrompts, tokenizer, shape, progress=None
) -> State:
  """The context read into the cache with nothing evicted, and scored as its policy says
  (`Policy.score_context`: observed while it is read, or by kvzip's reconstruction)."""
  reader = steps.ContextReader(model, tokenizer, shape)
  return state.plan.eviction.policy.score_context(reader, state, encoded, progress)
