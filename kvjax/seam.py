"""The seam between a Flax model and kvjax: what a model exposes, and what kvjax plugs in.

A model is compressible when it has

    model.config   with int attributes n_layers, n_kv_heads, head_dim, vocab_size, max_context
    model.run(tokens, positions, kv_state, attend, *, after_layer=None, logits_at=None)
        tokens, positions  [B, T] int32 (positions: the RoPE position of each token)
        attend(q [B, T, Hq, D], k [B, T, Hkv, D], v [B, T, Hkv, D], kv_state, layer)
            -> (out [B, T, Hq, D], kv_state)          called once per layer, in layer order;
                                                      q and k already position-encoded
        after_layer(kv_state, layer, h_in [B, T, d], h_out [B, T, d]) -> kv_state   (optional)
        returns (logits [B, T, V] float32, or [B, V] at token index logits_at[b], kv_state)

and, optionally (policies that reason about queries at other positions need it, e.g.
expected_attention),

    model.rotate(x [B, T, H, D], positions [B, T]) -> x position-encoded at `positions`
        the same linear map `run` applies to q and k (RoPE); rotate(x, -p) undoes rotate(x, p)

and (policies that weigh a value by what it adds to the residual stream: kvzip_plus)

    model.head_output_gram(layer) -> G [Hq, D, D]      (layer may be traced)
        W_O^h (W_O^h)^T for each query head h, where W_O^h [D, d] is the rows of the layer's
        output projection that head h's attention output meets: ||W_O^h v|| = sqrt(v.G_h v)

The model knows nothing of pages or policies: kvjax's `attend` appends K/V to the paged cache,
runs paged attention and feeds the policy; `after_layer` lets a policy read hidden states.
`docs/integration.md` walks through it; `examples/custom_model.py` is a model written from
scratch that plugs in.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Int

from kvjax.cache.paged_cache import PagedKVCache, append_layer
from kvjax.fingerprint import model_fingerprint
from kvjax.policies import AttentionStats, Policy
from kvjax.sharding import DATA, MODEL, on_shards
from pallas_kernels.paged_attention import paged_attention, paged_attention_key_max

__all__ = [
    "ModelShape",
    "forward",
    "model_record",
    "query_heads",
]

_SHAPE_FIELDS = ("n_layers", "n_kv_heads", "head_dim", "vocab_size", "max_context")


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """What kvjax needs to know of a model to size its cache."""

  n_layers: int
  n_kv_heads: int
  head_dim: int
  vocab_size: int
  max_context: int
  dtype: str  # the model's parameter dtype: the cache's default K/V dtype
  # Per layer, a sliding layer's window (0: a full layer); from the optional
  # `config.layer_windows`, empty without it.
  windows: tuple[int, ...] = ()

  @property
  def layer_windows(self) -> tuple[int, ...]:
    """Each layer's window, 0 for a full layer (all 0 on a model without windows)."""
    return self.windows or (0,) * self.n_layers

  @classmethod
  def of(cls, model) -> "ModelShape":
    """Reads the seam attributes; TypeError naming what a model lacks."""
    config = getattr(model, "config", None)
    if not callable(getattr(model, "run", None)) or config is None:
      raise TypeError(
          f"{type(model).__name__} is not a kvjax model: it needs a `config` and a "
          "`run(tokens, positions, kv_state, attend, *, after_layer, logits_at)` method "
          "(see docs/integration.md)"
      )
    values = {}
    for name in _SHAPE_FIELDS:
      value = getattr(config, name, None)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise TypeError(
            f"{type(model).__name__}.config.{name} must be a positive int, got {value!r} "
            f"(a kvjax model's config has {', '.join(_SHAPE_FIELDS)})"
        )
      values[name] = value
    windows = tuple(getattr(config, "layer_windows", None) or ())
    if windows and (
        len(windows) != values["n_layers"]
        or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in windows)
    ):
      raise TypeError(
          f"{type(model).__name__}.config.layer_windows must give an int >= 0 (0: a full "
          f"layer) for each of its {values['n_layers']} layers, got {windows!r}"
      )
    values["windows"] = windows if any(windows) else ()
    floats = [
        x.dtype
        for x in jax.tree.leaves(nnx.state(model, nnx.Param))
        if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    return cls(**values, dtype=jnp.dtype(floats[0] if floats else jnp.float32).name)


def query_heads(model) -> int:
  """Hq, the query heads of the q that `model.run` hands `attend`: read from one abstract
  call on one token (shapes only: nothing is computed or compiled)."""
  graphdef, state = nnx.split(model)
  seen = []

  def attend(q, k, v, kv_state, layer):
    seen.append(q.shape[2])
    return q, kv_state

  def run(state):
    one = jnp.zeros((1, 1), jnp.int32)
    return nnx.merge(graphdef, state).run(one, one, None, attend)[0]

  jax.eval_shape(run, state)
  return seen[0]


def model_record(model) -> dict:
  """What a saved state or a results file records of its model: its name, the fingerprint
  of its weights and its `ModelShape`, as JSON reads it back (the windows a list)."""
  shape = dataclasses.asdict(ModelShape.of(model))
  return {
      "name": getattr(model.config, "name", type(model).__name__),
      "fingerprint": model_fingerprint(model),
      **shape,
      "windows": list(shape["windows"]),
  }


def _layer_attention(model, policy: Policy | None, reads: frozenset, attention_impl: str):
  """One layer's attention over the paged cache, run per shard: append the new K/V, attend
  (returning what the policy reads), and let the policy observe."""
  per_head = "head_probs" in reads
  want_key_max = "key_max" in reads
  want_lse = "lse" in reads or want_key_max
  want_probs = "probs" in reads or per_head

  def attend_here(cache, q, k, v, positions, num_new, protected, segment, layer, *gram):
    cache = append_layer(cache, layer, k, v, positions, num_new, protected, segment)
    windows = cache.config.windows
    window = jnp.asarray(windows, jnp.int32)[layer] if any(windows) else None
    out, probs, *lse = paged_attention(
        q,
        cache.k_pages,
        cache.v_pages,
        cache.page_table[layer],
        cache.length[layer],
        num_new,
        per_query_head=per_head,
        return_lse=want_lse,
        # When nothing reads the probabilities, attention reads only the live pages
        # instead of the whole page table.
        return_probs=want_probs,
        impl=attention_impl,
        window=window,
    )
    if policy is not None:
      head_probs = probs if per_head else None
      if per_head:  # [B, Hq, T, N] -> summed per kv head
        probs = probs.reshape(q.shape[0], cache.num_kv_heads, -1, *probs.shape[2:]).sum(axis=2)
      lse = lse[0] if lse else None
      key_max = None
      if want_key_max:  # from the lse of the attention just run: one more QK^T per block
        key_max = paged_attention_key_max(
            q, cache.k_pages, cache.page_table[layer], cache.length[layer], num_new, lse,
            window=window, before_chunk=True,
        )  # fmt: skip
      stats = AttentionStats(
          layer if cache.mesh is None else jnp.asarray(layer),
          q,
          out,
          probs,
          head_probs,
          num_new,
          lse,
          attention_impl,
          positions=positions,
          rotate=getattr(model, "rotate", None),
          head_output=gram[0] if gram else None,
          key_max=key_max,
      )
      cache = policy.observe(cache, stats)
    return cache, out

  return attend_here


def forward(
    model,
    tokens: Int[Array, "B T"],
    positions: Int[Array, "B T"],
    cache: PagedKVCache,
    num_new: Int[Array, " B"],
    *,
    policy: Policy | None = None,
    protected: Bool[Array, "B T"] | None = None,
    segment: Int[Array, "B T"] | None = None,
    logits_at: Int[Array, " B"] | None = None,
    attention_impl: str = "auto",
) -> tuple[Array, PagedKVCache]:
  """Runs T tokens per row through `model.run` over the paged cache (pure; call under jit).

  Row b contributes its first `num_new[b]` tokens; the rest are padding that is neither
  cached nor attended to. `policy` observes each layer's attention (and, if it asks, hidden
  states and logits); `protected`/`segment` mark the new tokens. Returns the logits ([B, T, V],
  or [B, V] at `logits_at`) and the cache.
  """
  b, t = tokens.shape
  shape = ModelShape.of(model)
  if cache.num_layers != shape.n_layers or cache.num_kv_heads != shape.n_kv_heads:
    raise ValueError(
        f"cache has {cache.num_layers} layers x {cache.num_kv_heads} kv heads; the model "
        f"needs {shape.n_layers} x {shape.n_kv_heads}"
    )
  if cache.config.windows != shape.windows:
    raise ValueError(
        f"the model's sliding windows per layer are {shape.windows or 'none'}; the cache's "
        f"are {cache.config.windows or 'none'} (make it with CacheConfig(windows=...) from "
        "the model's config.layer_windows)"
    )
  reads = frozenset() if policy is None else policy.reads
  attend_here = _layer_attention(model, policy, reads, attention_impl)

  # On a sharded cache every cache operation runs per shard, on its rows and kv heads (with
  # their query heads); the model around it runs under GSPMD.
  heads = P(DATA, None, MODEL, None)
  row = P(DATA, None)

  def attend(q, k, v, cache, layer):
    # The Gram matrices, when read, are computed here (under GSPMD, from whole weights) and
    # split over the model axis with the query heads.
    gram = (model.head_output_gram(layer),) if "head_output" in reads else ()
    cache, out = on_shards(
        attend_here,
        cache,
        q,
        k,
        v,
        positions,
        num_new,
        protected,
        segment,
        layer if cache.mesh is None else jnp.asarray(layer),
        *gram,
        specs=(heads, heads, heads, row, P(DATA), row, row, P(), *[P(MODEL)] * len(gram)),
        out_specs=heads,
    )
    return out, cache

  after_layer = None
  if policy is not None:

    def after_layer(cache, layer, h_in, h_out):
      return on_shards(
          lambda c, layer, h_in, h_out, n: policy.observe_layer(c, layer, h_in, h_out, n),
          cache,
          layer if cache.mesh is None else jnp.asarray(layer),
          h_in,
          h_out,
          num_new,
          specs=(P(), row, row, P(DATA)),
      )

  full_logits = "logits" in reads
  logits, cache = model.run(
      tokens,
      positions,
      cache,
      attend,
      after_layer=after_layer,
      logits_at=None if full_logits else logits_at,
  )
  if full_logits:
    cache = on_shards(
        lambda c, logits, n: policy.observe_logits(c, logits, n),
        cache,
        logits,
        num_new,
        specs=(P(DATA), P(DATA)),
    )
    if logits_at is not None:
      logits = logits[jnp.arange(b), logits_at]
  return logits, cache
