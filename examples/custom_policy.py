"""A new eviction score in a few lines: keep the tokens whose values are largest.

    python examples/custom_policy.py

A policy is a frozen dataclass; `scores` gives one score per cached slot (higher = keep),
read in logical order with `logical_view`. `register` makes it selectable by name.
"""

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

import kvjax
import models
from kvjax.cache import logical_view
from kvjax.policies import Policy, read_layer, register, write_layer


@register
@dataclasses.dataclass(frozen=True)
class ValueNorm(Policy):
  """Keeps the tokens with the largest value norm: removing them moves outputs most."""

  name: ClassVar[str] = "vnorm"

  def scores(self, cache, key):
    return jnp.linalg.norm(logical_view(cache, cache.v_pages).astype(jnp.float32), axis=-1)


@register
@dataclasses.dataclass(frozen=True)
class RecentAttention(Policy):
  """Attention history that forgets: s <- 0.5 s + attention of this step."""

  name: ClassVar[str] = "recent_attention"

  def observe(self, cache, stats):
    history = read_layer(cache, cache.score, stats.layer)
    updated = 0.5 * history + stats.probs.sum(axis=2)  # probs: [B, Hkv, T, N]
    return cache.replace(score=write_layer(cache, cache.score, stats.layer, updated))


if __name__ == "__main__":
  model, tokenizer = models.load_llama()
  prompt = "Summarise the rules of chess in three sentences. " * 8
  for policy in ("vnorm", "recent_attention"):
    result = kvjax.generate(model, tokenizer, [prompt], chat=True, policy=policy, budget=64,
                            max_new_tokens=24)
    print(f"{policy}: {result.texts[0]!r}\n  peak KV {result.stats['peak_kv_bytes'] / 2**20:.2f} MiB")
