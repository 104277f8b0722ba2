"""`State`: a batch of sequences mid-generation, everything needed to continue them, and how
it is copied and laid out over a device mesh."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from kvjax import sharding as shards
from kvjax.cache.paged_cache import PagedKVCache
from kvjax.spec import CachePlan, CompressionSpec


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
  """What `decode` returns beside the new state: per row the generated token ids and why it
  finished, the logits when asked for (`return_logits=True`), and timing `stats`."""

  tokens: list[list[int]]  # generated ids per row, stop token excluded
  finish_reasons: list[
      str
  ]  # "stop" (a stop token), "length" (max_new_tokens), "done" (stopped before)
  logits: Array | None  # [B, N, V]: the logits each token was chosen from (return_logits=True)
  stats: dict  # decode_seconds, compile_seconds, compiles, loaded, decode_tokens_per_s


def copy(tree):
  """A copy of every array in `tree` (new buffers), PRNG keys included."""

  def one(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(jnp.copy(jax.random.key_data(x)))
    return jnp.copy(x)

  return jax.tree.map(one, tree)


def laid_out(tree):
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
