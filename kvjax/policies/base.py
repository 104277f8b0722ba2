"""The policy interface: what a policy declares, the hooks the session calls, the registry.

A policy is a frozen dataclass (hashable, so jitted code specialises on it) that declares

  name       the name `CompressionSpec(policy=...)` and the CLI select it by (`register`)
  slots      the per-token state it keeps in the cache (name, dtype, empty value): the cache
             allocates it, eviction moves and clears it with K/V
  reads      what its `observe` hooks read beyond the cache: a subset of READS. Undeclared,
             a policy that overrides `observe` reads {"probs"}; nothing else is computed
             for it (attention then reads only live pages, without probabilities)
  mode       "running" (evicts while the prompt is read and during decoding) or "once"
             (reads the whole context, then keeps the best by one ranking of all of it)
  granularity  "token" or "page": the eviction granularity it defaults to

and overrides any of these hooks, all pure functions of the cache:

  init_extra(...)              state that is not per token (kept in `cache.extra`)
  observe(cache, stats)        after each layer's attention: update the score history
  observe_layer(cache, ...)    after each layer: per-token signals from hidden states
  observe_logits(cache, ...)   after the model's head (reads "logits"): per-token signals
  scores(cache, key)           at an eviction event: per-slot scores [L, B, H, N], higher = keep
  score_context(reader, ...)   ("once") how the context is read and scored before the
                               ranking: read it observing (the default), or more (KVzip)
  check_model(model)           refuse a model it cannot score, before any work
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kvjax.cache.paged_cache import PagedKVCache, Slot, logical_view, valid_mask
from kvjax.cache.pages import token_slots

READS = frozenset({"probs", "head_probs", "key_max", "lse", "logits", "head_output"})
MODES = ("running", "once")
GRANULARITIES = ("token", "page")


@dataclasses.dataclass(frozen=True)
class AttentionStats:
  """What one layer's attention saw, for `Policy.observe` (N = cache.config.max_tokens)."""

  layer: Int[Array, ""]
  q: Float[Array, "B T Hq D"]
  out: Float[Array, "B T Hq D"]
  probs: Float[Array, "B Hkv T N"] | None  # summed over the query heads of each kv head;
  # None for a policy that does not read them (`Policy.reads`)
  head_probs: Float[Array, "B Hq T N"] | None  # only when the policy asks for it
  num_new: Int[Array, " B"]
  lse: Float[Array, "B T Hq"] | None = None  # per-query-head log-sum-exp, if asked for
  impl: str = "auto"  # the model's attention_impl, for policies that call kernels
  positions: Int[Array, "B T"] | None = None  # the chunk's token positions
  # The model's position encoding, `rotate(x [B, T, H, D], positions [B, T])`, None when the
  # model does not expose it (an optional part of the seam, see kvjax.seam).
  rotate: Callable[[Array, Array], Array] | None = None
  # The layer's output projection per query head as a Gram matrix, W_O^h (W_O^h)^T, so that
  # ||W_O^h v|| = sqrt(v . G_h v): what head h's value v adds to the residual stream; from
  # the optional seam method `model.head_output_gram(layer)`, when the policy reads
  # "head_output".
  head_output: Float[Array, "Hq D D"] | None = None
  # The most attention any live query of each kv head's query heads pays each slot cached
  # before the chunk (reads "key_max"; 0 for the chunk's own slots, which a KVzip pass cuts
  # afterwards): what `head_probs` reduce to for a max there, without materialising them.
  key_max: Float[Array, "B Hkv N"] | None = None


SCORE = Slot("score", "float32", 0.0)  # a policy's running per-token score


def read_layer(cache: PagedKVCache, name: str, layer) -> Array:
  """The per-slot array `name` of one layer in logical order: [B, H, N]."""
  return logical_view(cache, cache.slot(name), layer)


def write_layer(cache: PagedKVCache, name: str, layer, values: Float[Array, "B H N"]):
  """The cache with logical-order `values` written to one layer's live slots of `name`."""
  x = cache.slot(name)
  pages, offsets = cache.pages.slots(cache.config.page_size, layer)  # [B, H, N], [N]
  pages = jnp.where(valid_mask(cache, layer), pages, cache.num_pages)
  return cache.with_slots(**{name: x.at[pages, offsets].set(values.astype(x.dtype), mode="drop")})


def write_new_tokens(
    cache: PagedKVCache, name: str, layer, values: Float[Array, "B T *H"], num_new, *, add=False
):
  """The cache with per-token `values` set (or added) in slot `name` for the tokens just
  appended to one layer: the last num_new[b] tokens of every kv head of row b (`values`
  [B, T] for all kv heads alike, or [B, T, H] per kv head)."""
  b, t = values.shape[:2]
  page, offset = token_slots(
      cache.page_table[layer],
      cache.length[layer] - num_new[:, None],
      num_new,
      t,
      cache.config.page_size,
      cache.num_pages,
  )
  values = jnp.broadcast_to(values if values.ndim == 3 else values[..., None], page.shape)
  at = cache.slot(name).at[page, offset]
  return cache.with_slots(
      **{name: at.add(values, mode="drop") if add else at.set(values, mode="drop")}
  )


@dataclasses.dataclass(frozen=True)
class Policy:
  """Base policy: no state, no observation; `scores` reads the "score" slot if declared."""

  name: ClassVar[str] = "base"
  slots: ClassVar[tuple[Slot, ...]] = ()  # per-token state this policy keeps in the cache
  reads: ClassVar[frozenset[str]] = frozenset()  # see the module docstring
  mode: ClassVar[str] = "running"
  granularity: ClassVar[str] = "token"

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if "reads" not in cls.__dict__:
      cls.reads = _inherited_reads(cls)
    if not cls.reads <= READS or cls.mode not in MODES or cls.granularity not in GRANULARITIES:
      raise TypeError(
          f"policy {cls.__name__}: reads must be a subset of {sorted(READS)}, mode one of "
          f"{MODES}, granularity one of {GRANULARITIES}; got {set(cls.reads)}, "
          f"{cls.mode!r}, {cls.granularity!r}"
      )

  @property
  def keeps_extra(self) -> bool:
    """Keeps state that is not per token (`init_extra` overridden): the session then asks
    the model for its query heads and puts that state in `cache.extra`."""
    return type(self).init_extra is not Policy.init_extra

  @property
  def spelling(self) -> str:
    """The policy's name with its options that differ from the defaults, as `get_policy`
    reads it back ("kvzip:attend_to=context"; options that are not a bool, int, float or
    str are not spelled)."""
    options = [
        f"{f.name}={str(value).lower() if isinstance(value, bool) else value}"
        for f in dataclasses.fields(self)
        if f.init
        and type(f.default) in (bool, int, float, str)
        and (value := getattr(self, f.name)) != f.default
    ]
    return self.name + (":" + ",".join(options) if options else "")

  def check_model(self, model) -> None:
    """Raises ValueError when this policy cannot score `model` (e.g. a scorer trained for
    another model). Called by `kvjax.prefill` before any work."""

  def init_extra(
      self, num_layers: int, batch: int, num_kv_heads: int, num_query_heads: int, head_dim: int
  ) -> dict[str, Array]:
    """The initial state this policy keeps beside the cache that is not per token (arrays by
    name, e.g. statistics per layer and row): the session puts it in `cache.extra`, every
    cache operation carries it, eviction leaves it alone."""
    return {}

  def observe(self, cache: PagedKVCache, stats: AttentionStats) -> PagedKVCache:
    return cache

  def observe_layer(self, cache, layer, hidden_in, hidden_out, num_new) -> PagedKVCache:
    return cache

  def observe_logits(self, cache, logits, num_new) -> PagedKVCache:
    return cache

  def scores(self, cache: PagedKVCache, key) -> Float[Array, "L B H N"]:
    return logical_view(cache, cache.slot(SCORE.name))

  def score_context(self, reader, state, context, progress=None):
    """A context compressed once (`mode == "once"`): the state with `context` read and
    scored, nothing evicted yet. `reader` (from the session) reads tokens into a state
    (`reader.read(state, encoded, observe=True, ...)`), reads tokens after one span of the
    context only (`reader.read_after_span`), cuts a cache back (`reader.cut(state,
    length)`) and runs `self.score_layer(cache, model, layer, next_position)` on every
    layer (`reader.score_layers`). `progress(done, total)` must cover all of it:
    `reader.progress(progress, total)` splits it into parts, one per read or pass. By
    default the policy observes while the context is read."""
    return reader.read(state, context, progress=progress)


def require_model_method(policy: Policy, model, signature: str, why: str) -> None:
  """Raises ValueError when `model` lacks the optional seam method `signature` names
  ("rotate(x, positions)"), which `policy` needs because it `why`."""
  if not callable(getattr(model, signature.split("(")[0], None)):
    raise ValueError(
        f"policy {policy.name!r} {why}: {type(model).__name__} has no `{signature}` method "
        "(an optional part of the seam, see docs/integration.md)"
    )


def _inherited_reads(cls) -> frozenset[str]:
  """What an undeclared subclass reads: its parent's, or {"probs"} where it is the first to
  override `observe` (probabilities are what an attention hook usually reads)."""
  parent = next(c for c in cls.__mro__[1:] if issubclass(c, Policy))
  if "observe" in cls.__dict__ and parent.observe is Policy.observe and not parent.reads:
    return frozenset({"probs"})
  return parent.reads


POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
  """Makes a policy class selectable by its `name` (usable as a decorator)."""
  POLICIES[cls.name] = cls
  return cls


def get_policy(policy: str | Policy, *, scorer: str | None = None) -> Policy:
  """The policy of a name (or the policy itself), with options after a colon:
  "kvzip:chunk=256,attend_to=context" (each a field of the policy's class with a bool, int,
  float or str default); `scorer`: a trained scorer's directory for 'learned'."""
  if isinstance(policy, Policy):
    return policy
  name, _, options = str(policy).partition(":")
  if name not in POLICIES:
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
  cls = POLICIES[name]
  kwargs = _policy_options(cls, options) if options else {}
  if scorer is not None:
    kwargs["scorer"] = scorer
  return cls(**kwargs)


def _policy_options(cls: type[Policy], options: str) -> dict:
  """ "k=v,k=v" parsed by the types of `cls`'s defaults; ValueError naming a bad one."""
  fields = {
      f.name: f.default
      for f in dataclasses.fields(cls)
      if f.init and type(f.default) in (bool, int, float, str)
  }
  kwargs = {}
  for item in options.split(","):
    key, eq, text = item.partition("=")
    if not eq or key not in fields:
      known = ", ".join(f"{k}=" for k in fields) or "none"
      raise ValueError(f"policy {cls.name!r}: bad option {item!r}; its options: {known}")
    kind = type(fields[key])
    try:
      if kind is bool:
        if text.lower() not in ("true", "false"):
          raise ValueError
        kwargs[key] = text.lower() == "true"
      else:
        kwargs[key] = kind(text)
    except ValueError:
      raise ValueError(
          f"policy {cls.name!r}: option {key} must be {'an' if kind is int else 'a'} "
          f"{kind.__name__}, got {text!r}"
      ) from None
  return kwargs
