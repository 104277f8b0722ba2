"""Your own Flax NNX model, made compressible through kvjax's seam.

    python examples/custom_model.py

The decoder below is written from scratch (it is not `models.Llama`): a plain list of
pre-norm blocks with RoPE, grouped-query attention and a GELU MLP. To plug into kvjax it needs two things (docs/integration.md):

  1. `config` with n_layers, n_kv_heads, head_dim, vocab_size, max_context;
  2. `run(tokens, positions, kv_state, attend, *, after_layer=None, logits_at=None)`, which
     computes q, k, v per layer and hands them to `attend` instead of attending itself;

and, optionally, `rotate(x, positions)`: its position encoding, for policies that reason
about queries at other positions (expected_attention).

`__call__` is the same model with its own dense causal attention, no cache: the script
checks that greedy tokens through the seam with the full cache equal the model's own, then
generates with h2o at a budget.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvjax
from kvjax.testing import ByteTokenizer


@dataclasses.dataclass(frozen=True)
class TinyConfig:
  vocab_size: int = 259
  d_model: int = 64
  n_layers: int = 3
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 16
  max_context: int = 1024


def rope(x, positions, base=10000.0):
  """Half-rotation RoPE on [B, T, H, D] at integer positions [B, T]."""
  d = x.shape[-1]
  inv = 1.0 / base ** (jnp.arange(0, d, 2) / d)
  angle = positions[..., None, None] * inv  # [B, T, 1, D/2]
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate(
      [x1 * jnp.cos(angle) - x2 * jnp.sin(angle), x2 * jnp.cos(angle) + x1 * jnp.sin(angle)],
      axis=-1,
  )


class Block(nnx.Module):

  def __init__(self, c: TinyConfig, rngs: nnx.Rngs):
    self.c = c
    self.norm1 = nnx.LayerNorm(c.d_model, rngs=rngs)
    self.q = nnx.Linear(c.d_model, c.n_heads * c.head_dim, rngs=rngs)
    self.kv = nnx.Linear(c.d_model, 2 * c.n_kv_heads * c.head_dim, rngs=rngs)
    self.out = nnx.Linear(c.n_heads * c.head_dim, c.d_model, rngs=rngs)
    self.norm2 = nnx.LayerNorm(c.d_model, rngs=rngs)
    self.up = nnx.Linear(c.d_model, 4 * c.d_model, rngs=rngs)
    self.down = nnx.Linear(4 * c.d_model, c.d_model, rngs=rngs)

  def qkv(self, h, positions):
    """q [B, T, H, D], k and v [B, T, K, D] of the hidden states h [B, T, d]."""
    b, t, _ = h.shape
    c = self.c
    x = self.norm1(h)
    q = self.q(x).reshape(b, t, c.n_heads, c.head_dim)
    k, v = jnp.split(self.kv(x).reshape(b, t, 2 * c.n_kv_heads, c.head_dim), 2, axis=2)
    return rope(q, positions), rope(k, positions), v

  def finish(self, h, attended):
    """The residual stream after attention `attended` [B, T, H, D] and the MLP."""
    h = h + self.out(attended.reshape(*h.shape[:2], -1))
    return h + self.down(jax.nn.gelu(self.up(self.norm2(h))))


class TinyDecoder(nnx.Module):

  def __init__(self, c: TinyConfig, rngs: nnx.Rngs):
    self.config = c
    self.embed = nnx.Embed(c.vocab_size, c.d_model, rngs=rngs)
    self.blocks = nnx.List([Block(c, rngs) for _ in range(c.n_layers)])
    self.norm = nnx.LayerNorm(c.d_model, rngs=rngs)

  def rotate(self, x, positions):
    """The optional part of the seam: the RoPE `run` applies to q and k."""
    return rope(x, positions)

  def run(self, tokens, positions, kv_state, attend, *, after_layer=None, logits_at=None):
    """The kvjax seam: attention is `attend`'s job (here: kvjax's paged cache)."""
    h = self.embed(tokens)  # [B, T, d]
    for layer, block in enumerate(self.blocks):  # a Python loop: `layer` is an int
      q, k, v = block.qkv(h, positions)
      attended, kv_state = attend(q, k, v, kv_state, layer)
      h_in, h = h, block.finish(h, attended)
      if after_layer is not None:
        kv_state = after_layer(kv_state, layer, h_in, h)
    if logits_at is not None:
      h = h[jnp.arange(h.shape[0]), logits_at]  # [B, d]
    return self.embed.attend(self.norm(h)).astype(jnp.float32), kv_state

  def __call__(self, tokens):
    """The same model with its own dense causal attention over `tokens` [B, T]: logits."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)

    def dense_attend(q, k, v, state, layer):
      g = q.shape[2] // k.shape[2]
      k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
      logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
      causal = jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool))
      weights = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
      return jnp.einsum("bhqk,bkhd->bqhd", weights, v), state

    return self.run(tokens, positions, None, dense_attend)[0]


def plain_greedy(model: TinyDecoder, ids: list[int], n: int) -> list[int]:
  """n greedy tokens with the model's own attention (the whole sequence each step, padded
  to one length so that it compiles once: causal attention ignores the padding after the
  last token)."""
  forward = nnx.jit(lambda model, tokens: model(tokens))
  width = len(ids) + n
  out = list(ids)
  for _ in range(n):
    padded = jnp.asarray([out + [0] * (width - len(out))])
    out.append(int(jnp.argmax(forward(model, padded)[0, len(out) - 1])))
  return out[len(ids) :]


def main():
  model = TinyDecoder(TinyConfig(), nnx.Rngs(0))
  tokenizer = ByteTokenizer()
  prompt = "The seam lets any decoder use a compressed cache. " * 4
  ids = tokenizer.encode(prompt)

  full = kvjax.generate(model, tokenizer, [ids], max_new_tokens=8)
  own = plain_greedy(model, ids, 8)
  print(f"full cache through the seam == the model's own attention: {full.tokens[0] == own}")

  spec = kvjax.CompressionSpec(policy="h2o", budget=64, sink=4, recent=16, prefill_chunk=64)
  h2o = kvjax.generate(model, tokenizer, [ids], spec, max_new_tokens=16)
  print(
      f"prompt {len(ids)} tokens; h2o at budget 64 kept peak "
      f"{h2o.stats['peak_kv_bytes'] / 2**10:.0f} KiB vs full {full.stats['peak_kv_bytes'] / 2**10:.0f} KiB"
  )
  print(f"h2o tokens: {h2o.tokens[0]}")
  state = kvjax.prefill(model, [ids], spec)
  state, result = kvjax.decode(model, state, 8)
  print(f"session API: {len(result.tokens[0])} tokens, {state.kv_bytes() / 2**10:.0f} KiB held")
  if full.tokens[0] != own:
    raise SystemExit("mismatch between the seam and the model's own attention")
  np.testing.assert_array_less(h2o.stats["peak_kv_bytes"], full.stats["peak_kv_bytes"])


if __name__ == "__main__":
  main()
