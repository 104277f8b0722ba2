"""Policies that need no observation: keep everything, the stream's ends, low key norms, or
a random draw."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.cache.paged_cache import logical_view, read_pages
from kvjax.policies.base import Policy
from kvjax.sharding import shard_key


@dataclasses.dataclass(frozen=True)
class Full(Policy):
  """Keeps every token (no budget)."""

  name: ClassVar[str] = "full"


@dataclasses.dataclass(frozen=True)
class Streaming(Policy):
  """StreamingLLM: the sink tokens plus the most recent window."""

  name: ClassVar[str] = "streaming"

  def scores(self, cache, key):
    return jnp.broadcast_to(
        jnp.arange(cache.config.max_tokens, dtype=jnp.float32),
        (*cache.length.shape, cache.config.max_tokens),
    )


@dataclasses.dataclass(frozen=True)
class KeyNorm(Policy):
  """Keeps the tokens with the smallest key L2 norm (low-norm keys draw attention)."""

  name: ClassVar[str] = "knorm"

  def scores(self, cache, key):
    # Norms over the pool, then their logical order: gathering [P, S] scalars instead of
    # every cached key's [D] row.
    return -logical_view(cache, jnp.linalg.norm(read_pages(cache.k_pages), axis=-1))


@dataclasses.dataclass(frozen=True)
class Random(Policy):
  """Uniformly random scores at every eviction event (a floor for the others)."""

  name: ClassVar[str] = "random"

  def scores(self, cache, key):
    # On a sharded cache each shard draws its own (drawing the whole batch's on every device
    # to keep a block would cost [L, B, H, N] per device), so a mesh evicts other tokens
    # than one device: equally random.
    return jax.random.uniform(shard_key(key), (*cache.length.shape, cache.config.max_tokens))
