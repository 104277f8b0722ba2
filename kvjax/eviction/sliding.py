"""Sliding-window layers: a layer whose query sees only its `window` latest keys (Gemma 3's
local layers, Mistral's) holds only what a next query can still see. After each step its
sequences free their oldest whole pages; what remains is a run of consecutive positions,
which is what the window mask of paged attention (an index bound) relies on, so no policy
evicts from these layers (`EvictionPlan`, `evict_once` leave them alone)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool

from kvjax.cache.paged_cache import PagedKVCache, one_device
from kvjax.cache.sizing import passed_pages


def in_window(behind, window):
  """Whether a query sees a key `behind` positions before it (0: itself) on a layer of
  `window` (0: a full layer, every earlier key): 0 <= behind < window. Arrays broadcast."""
  return (behind >= 0) & ((window == 0) | (behind < window))


def full_layers(cache: PagedKVCache) -> Bool[Array, " L"]:
  """[L] the layers that keep the context (no window): the ones policies compress."""
  windows = cache.config.windows or (0,) * cache.num_layers
  return jnp.asarray([w == 0 for w in windows])


def slide(cache: PagedKVCache) -> PagedKVCache:
  """Every sequence of a sliding layer frees its leading whole pages that hold none of the
  `window - 1` latest tokens (the ones a next query sees besides itself); the rest of its
  table moves to the front, nothing else moves. A cache without windows is returned as is."""
  one_device(cache, "slide")
  cfg = cache.config
  if not cfg.sliding:
    return cache
  window = jnp.asarray(cfg.windows, jnp.int32)[:, None, None]  # [L, 1, 1]
  pages = jnp.where(window > 0, passed_pages(cache.length, window, cfg.page_size), 0)  # [L, B, H]
  stale = jnp.arange(cfg.max_pages) < pages[..., None]  # [L, B, H, M]
  return jax.lax.cond(
      pages.any(), lambda c: c.freed(*c.pages.drop(stale, cfg.page_size)), lambda c: c, cache
  )
