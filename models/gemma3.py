"""Gemma 3 text decoder in Flax NNX, through the same seam as `models.Llama`.

What differs from Llama (transformers' `Gemma3ForCausalLM`): embeddings scaled by
sqrt(d_model); q and k normalised per head before RoPE; a norm after attention and after the
MLP as well as before each (the residual adds the normalised output); a GELU (tanh) gated MLP;
RoPE with base `rope_local_theta` on the sliding layers and `rope_theta` on the full ones;
the attention scaled by `query_pre_attn_scalar**-0.5`. Norm weights are held as the factor
they scale by (Gemma's 1 + w; the loaders add the 1, as llama.cpp's GGUF files store it).

The window of a sliding layer is not applied here: the model attends through `attend` and
publishes the windows as `config.layer_windows` for the cache to apply.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from models.config import ModelConfig
from models.registry import DEFAULT_MODEL
from models.llama import (
    Llama,
    RopeFrequencies,
    apply_rope,
    linear,
    rms_norm,
    rope_inverse_frequencies,
)


class Gemma3(Llama):
  """Decoder: `model.run(tokens, positions, kv_state, attend) -> (logits, kv_state)`; weights,
  `from_params`, sharding rules and `head_output_gram` as `Llama`'s; `rotate` is the full
  layers' RoPE (base `rope_theta`), the layers compress-once policies score."""

  def __init__(self, config: ModelConfig, **kwargs):
    if config.family != "gemma3":
      raise ValueError(f"Gemma3 needs a config of family 'gemma3', got {config.family!r}")
    super().__init__(config, **kwargs)
    local = config.rope_local_theta or config.rope_theta
    self.local_inv_freq = RopeFrequencies(
        jnp.asarray(rope_inverse_frequencies(config, theta=local))
    )

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
    """As `Llama.run`."""
    c = self.config
    b, t = tokens.shape
    if positions.shape != (b, t):
      raise ValueError(f"positions shape {positions.shape} != tokens shape {(b, t)}")
    embed = self.embed[...]
    h = embed[tokens] * jnp.asarray(math.sqrt(c.d_model), embed.dtype)  # [B, T, d]
    sliding = jnp.asarray([w > 0 for w in c.layer_windows])  # [L]
    inv_freqs = jnp.stack([self.inv_freq[...], self.local_inv_freq[...]])  # [2, D/2]
    # kvjax's attention scales by head_dim**-0.5; q carries the rest of Gemma's scale.
    q_scale = math.sqrt(c.head_dim / (c.query_pre_attn_scalar or c.head_dim))
    layers = [{name: p[...] for name, p in layer.items()} for layer in self.layers]
    eps = c.rms_eps

    def qkv(w, h):
      x = rms_norm(h, w["attn_norm"], eps)
      q = linear(x, w["wq"]).reshape(b, t, c.n_heads, c.head_dim)
      k = linear(x, w["wk"]).reshape(b, t, c.n_kv_heads, c.head_dim)
      v = linear(x, w["wv"]).reshape(b, t, c.n_kv_heads, c.head_dim)
      return rms_norm(q, w["q_norm"], eps), rms_norm(k, w["k_norm"], eps), v

    def output_and_mlp(w, h, out):
      attn = linear(out.reshape(b, t, -1).astype(h.dtype), w["wo"])
      h = h + rms_norm(attn, w["post_attn_norm"], eps)
      x = rms_norm(h, w["mlp_norm"], eps)
      gate = jax.nn.gelu(linear(x, w["w_gate"]), approximate=True)
      return h + rms_norm(linear(gate * linear(x, w["w_up"]), w["w_down"]), w["post_mlp_norm"], eps)

    def with_weights(index, fn, *args):  # in place, as in `Llama.run`
      return jax.lax.switch(index, [lambda *a, w=w: fn(w, *a) for w in layers], *args)

    def layer(carry, index):
      h, kv_state = carry
      q, k, v = with_weights(index, qkv, h)
      inv_freq = inv_freqs[sliding[index].astype(jnp.int32)]
      q = apply_rope(q, positions, inv_freq)
      if q_scale != 1.0:
        q = q * jnp.asarray(q_scale, q.dtype)
      k = apply_rope(k, positions, inv_freq)
      out, kv_state = attend(q, k, v, kv_state, index)
      h_out = with_weights(index, output_and_mlp, h, out)
      if after_layer is not None:
        kv_state = after_layer(kv_state, index, h, h_out)
      return (h_out, kv_state), None

    (h, kv_state), _ = jax.lax.scan(layer, (h, kv_state), jnp.arange(c.n_layers))
    if logits_at is not None:
      h = h[jnp.arange(b), logits_at]  # [B, d]
    h = rms_norm(h, self.final_norm[...], eps)
    return (h @ embed.T).astype(jnp.float32), kv_state


def build(config: ModelConfig, params, dtype=jnp.float32) -> Llama:
  """The decoder of `config.family` (`Llama` or `Gemma3`) from canonical loader params."""
  return (Gemma3 if config.family == "gemma3" else Llama).from_params(config, params, dtype)


def load_decoder(name_or_path: str = DEFAULT_MODEL, dtype=jnp.float32, *, cache=True):
  """(decoder, Tokenizer) from a registry name, a .gguf file or a local HF checkpoint dir,
  whatever its family; `cache` as in `models.load_model`."""
  from models.registry import load_model

  config, params, tokenizer = load_model(name_or_path, cache=cache)
  return build(config, params, dtype), tokenizer
