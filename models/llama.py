"""Llama-family decoder in Flax NNX, with attention left to the caller.

`Llama.run` is the seam kvjax plugs into (see `docs/integration.md`): the model computes q, k,
v per layer and calls an `attend` function it is given; it knows nothing of caches or
policies, so this package imports nothing from kvjax. The layers run under `lax.scan` (one
copy of the attention in the program, whatever the depth); each layer's weights are arrays
of their own, read through a `lax.switch` on the layer index (see `run`). Linear weights
are stored `[in, out]` (`y = x @ w`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int

from models.config import ModelConfig, check_params
from models.registry import DEFAULT_MODEL

# Tensor-parallel rules (Megatron-style) over a mesh axis named "model": the projections
# that make heads (and the MLP's hidden units) are split on their output axis, the ones
# that read them back on their input axis, so each device computes its own heads and one
# all-reduce per block joins them. Anything unnamed is replicated.
_SPLIT_OUT = ("wq", "wk", "wv", "bq", "bk", "bv", "w_gate", "w_up", "lm_head")
_SPLIT_IN = ("wo", "w_down")


class RopeFrequencies(nnx.Variable):
  """Inverse RoPE frequencies [head_dim // 2]: derived from the config, not trained."""


def rope_inverse_frequencies(
    config: ModelConfig, divisors: np.ndarray | None = None, *, theta: float | None = None
) -> np.ndarray:
  """[head_dim // 2] float32 for base `theta` (default `config.rope_theta`), with Llama-3
  scaling or llama.cpp's frequency divisors."""
  hd = config.head_dim
  base = config.rope_theta if theta is None else theta
  inv = 1.0 / base ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
  if divisors is not None:
    inv = inv / divisors.astype(np.float64)
  elif config.rope_scaling is not None:
    s = config.rope_scaling
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    mid = (1 - smooth) * inv / s.factor + smooth * inv
    inv = np.where(
        wavelen > low_wavelen, inv / s.factor, np.where(wavelen < high_wavelen, inv, mid)
    )
  return inv.astype(np.float32)


def apply_rope(x: Float[Array, "B T H D"], positions: Int[Array, "B T"], inv_freq) -> Array:
  """Half-rotation RoPE (the HF layout the loaders produce)."""
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def linear(x: Float[Array, "... n"], w: Float[Array, "n m"]) -> Float[Array, "... m"]:
  """`x @ w`, computed over at least two rows: XLA:CPU generates a kernel of its own for
  each one-row product (a matrix-vector product) and calls its matrix library for the
  rest. A single-token decode step of a 30-layer model holds 210 such products, 1 s of
  compilation; with a second (zero) row they take none, at the same speed per token."""
  if math.prod(x.shape[:-1]) != 1:
    return x @ w
  rows = jnp.concatenate([x.reshape(1, -1), jnp.zeros((1, x.shape[-1]), x.dtype)])
  return (rows @ w)[:1].reshape(*x.shape[:-1], w.shape[-1])


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (normed * weight).astype(x.dtype)


class Llama(nnx.Module):
  """Decoder: `model.run(tokens, positions, kv_state, attend) -> (logits, kv_state)`."""

  def __init__(
      self,
      config: ModelConfig,
      *,
      rngs: nnx.Rngs | None = None,
      dtype=jnp.float32,
      params: dict[str, np.ndarray] | None = None,
  ):
    """Random weights from `rngs` (tests and benchmarks), or a checkpoint's canonical
    `params` (`[out, in]` linear weights, as the loaders give them; `Llama.from_params`)."""
    if (rngs is None) == (params is None):
      raise ValueError("Llama needs rngs= (random weights) or params= (a checkpoint's), not both")
    self.config = config
    self.dtype = dtype
    c = config
    init = jax.nn.initializers.normal(0.02)

    def weight(name: str, shape: tuple[int, ...], norm: bool = False) -> nnx.Param:
      if params is not None:
        w = params[name]
        return nnx.Param(jnp.asarray(w.T if w.ndim == 2 else w, dtype))  # [out, in] -> [in, out]
      return nnx.Param(jnp.ones(shape, dtype) if norm else init(rngs.params(), shape, dtype))

    self.embed = nnx.Param(
        jnp.asarray(params["embed"], dtype)
        if params is not None
        else init(rngs.params(), (c.vocab_size, c.d_model), dtype)
    )
    shapes = c.param_shapes()  # [out, in] for linear weights

    def layer_weights(i: int) -> nnx.Dict:
      prefix = f"layers.{i}."
      names = [k.removeprefix(prefix) for k in shapes if k.startswith(prefix)]
      return nnx.Dict(
          {n: weight(prefix + n, shapes[prefix + n][::-1], norm=n.endswith("norm")) for n in names}
      )

    self.layers = nnx.List([layer_weights(i) for i in range(c.n_layers)])
    self.final_norm = weight("final_norm", (c.d_model,), norm=True)
    self.lm_head = None if c.tie_embeddings else weight("lm_head", (c.d_model, c.vocab_size))
    divisors = None if params is None else params.get("rope_freqs")
    self.inv_freq = RopeFrequencies(jnp.asarray(rope_inverse_frequencies(c, divisors)))

  @classmethod
  def from_params(
      cls, config: ModelConfig, params: dict[str, np.ndarray], dtype=jnp.float32
  ) -> "Llama":
    """Builds the model from canonical loader params (`[out, in]` linear weights)."""
    check_params(config, params, "params", optional=("rope_freqs",))
    return cls(config, dtype=dtype, params=params)

  @staticmethod
  def partition(path: tuple[str, ...], shape: tuple[int, ...]) -> PartitionSpec | None:
    """How the parameter at `path` is laid out over a mesh axis "model" (the seam's optional
    sharding rules, read by `kvjax.sharding.shard_model`); None: replicated."""
    name = path[-1]
    if name in _SPLIT_OUT:
      return PartitionSpec(*([None] * (len(shape) - 1)), "model")
    if name in _SPLIT_IN:
      return PartitionSpec("model", None)
    return None

  def rotate(self, x: Float[Array, "B T H D"], positions: Int[Array, "B T"]) -> Array:
    """x rotated by RoPE at `positions`, as `run` rotates q and k; a negative position undoes
    the rotation at the opposite one (the seam's optional `rotate`)."""
    return apply_rope(x, positions, self.inv_freq[...])

  def head_output_gram(self, layer) -> Float[Array, "H D D"]:
    """W_O^h (W_O^h)^T of layer `layer` (may be traced) for each query head h: the seam's
    optional `head_output_gram` (||W_O^h v||^2 = v.G_h v)."""
    c = self.config

    def gram(w):
      wo = w["wo"].reshape(c.n_heads, c.head_dim, -1).astype(jnp.float32)  # [H, D, d]
      return jnp.einsum("hde,hfe->hdf", wo, wo)

    weights = [{"wo": layer_params["wo"][...]} for layer_params in self.layers]
    return jax.lax.switch(layer, [functools.partial(gram, w) for w in weights])

  def run(
      self,
      tokens: Int[Array, "B T"],
      positions: Int[Array, "B T"],
      kv_state,
      attend,
      *,
      after_layer=None,
      logits_at: Int[Array, " B"] | None = None,
  ) -> tuple[Float[Array, "..."], object]:
    """The decoder with a pluggable cache.

    `attend(q [B, T, H, D], k [B, T, K, D], v [B, T, K, D], kv_state, layer) -> (out
    [B, T, H, D], kv_state)` stores K/V and attends (q, k rotated); `after_layer(kv_state,
    layer, h_in [B, T, d], h_out [B, T, d]) -> kv_state` may record per-token signals.
    Returns logits [B, T, V] float32, or [B, V] at token index `logits_at[b]`, and the
    kv_state. kvjax plugs in its paged cache; benchmarks plug in a dense one."""
    c = self.config
    b, t = tokens.shape
    if positions.shape != (b, t):
      raise ValueError(f"positions shape {positions.shape} != tokens shape {(b, t)}")
    inv_freq = self.inv_freq[...]
    h = self.embed[...][tokens]  # [B, T, d]
    layers = [{name: p[...] for name, p in layer.items()} for layer in self.layers]

    def qkv(w, h):
      x = rms_norm(h, w["attn_norm"], c.rms_eps)
      q, k, v = linear(x, w["wq"]), linear(x, w["wk"]), linear(x, w["wv"])
      if c.qkv_bias:
        q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
      q = q.reshape(b, t, c.n_heads, c.head_dim)
      k = k.reshape(b, t, c.n_kv_heads, c.head_dim)
      if c.qk_norm:  # Qwen3: each head normalised before RoPE
        q, k = rms_norm(q, w["q_norm"], c.rms_eps), rms_norm(k, w["k_norm"], c.rms_eps)
      return q, k, v.reshape(b, t, c.n_kv_heads, c.head_dim)

    def output_and_mlp(w, h, out):
      h = h + linear(out.reshape(b, t, -1).astype(h.dtype), w["wo"])
      x = rms_norm(h, w["mlp_norm"], c.rms_eps)
      return h + linear(jax.nn.silu(linear(x, w["w_gate"])) * linear(x, w["w_up"]), w["w_down"])

    def with_weights(index, fn, *args):
      # Layer `index`'s weights without copying them: a scan over stacked weights slices
      # (copies) a layer per step, which doubles a decode step's memory traffic on CPU;
      # a switch over per-layer arrays reads them in place, and only the matmuls are
      # repeated per layer, so compile time barely grows with depth.
      return jax.lax.switch(index, [functools.partial(fn, w) for w in layers], *args)

    def layer(carry, index):
      h, kv_state = carry
      q, k, v = with_weights(index, qkv, h)
      q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
      out, kv_state = attend(q, k, v, kv_state, index)
      h_out = with_weights(index, output_and_mlp, h, out)
      if after_layer is not None:
        kv_state = after_layer(kv_state, index, h, h_out)
      return (h_out, kv_state), None

    (h, kv_state), _ = jax.lax.scan(layer, (h, kv_state), jnp.arange(c.n_layers))
    if logits_at is not None:
      h = h[jnp.arange(b), logits_at]  # [B, d]
    h = rms_norm(h, self.final_norm[...], c.rms_eps)
    head = self.embed[...].T if self.lm_head is None else self.lm_head[...]
    return (h @ head).astype(jnp.float32), kv_state


def load_llama(name_or_path: str = DEFAULT_MODEL, dtype=jnp.float32, *, cache=True):
  """(Llama, Tokenizer) from a registry name, a .gguf file or a local HF checkpoint dir of
  a Llama-family model; `cache`: keep the converted weights in kvjax's cache directory
  (`models.load_model`). `models.load_decoder` loads any family."""
  from models.registry import load_model

  config, params, tokenizer = load_model(name_or_path, cache=cache)
  if config.family != "llama":
    raise ValueError(
        f"{name_or_path!r} is a {config.family} model, not a Llama-family one: load it with "
        "models.load_decoder"
    )
  return Llama.from_params(config, params, dtype), tokenizer
