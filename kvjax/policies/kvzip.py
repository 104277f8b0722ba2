"""KVzip: a context's tokens scored by how much the model needs each to repeat the context."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.cache import Slot
from kvjax.pages import pages_for
from kvjax.policies.base import SCORE, Policy, read_layer, write_layer
from kvjax.prompts import EncodedPrompts

RECONSTRUCTION_PROMPT = "\n\nRepeat the previous context exactly.\n\n"


@dataclasses.dataclass(frozen=True)
class KVzip(Policy):
  """KVzip (Kim et al., 2025), query-agnostic. After the context is prefilled (nothing
  evicted), the model is asked to repeat it, `chunk` context tokens at a time on a fork of
  the state; a KV pair's score is the largest attention it receives from those
  reconstruction queries (max over the query heads of its kv head). One ranking across all
  layers and kv heads of a row then sets how many tokens each sequence keeps, and the pool
  is re-laid out to what is kept: the compressed context serves any later question."""

  name: ClassVar[str] = "kvzip"
  slots: ClassVar[tuple[Slot, ...]] = (SCORE,)
  reads: ClassVar[frozenset[str]] = frozenset({"head_probs"})
  mode: ClassVar[str] = "once"
  chunk: int = 512  # context tokens repeated per reconstruction pass

  def score_context(self, reader, state, context, progress=None):
    """Reads the context (not observing: the scores come from repeating it), then has the
    model repeat it after itself, one chunk per pass; a key's score is the most attention
    any repeating query pays it. Each pass's tokens are dropped again: memory peaks at the
    context + one chunk."""
    state = reader.read(state, context, observe=False, progress=progress)
    tokenizer, max_context = reader.tokenizer, reader.shape.max_context
    prompt = tokenizer.encode(RECONSTRUCTION_PROMPT) if tokenizer is not None else []
    longest = int(context.lengths.max())
    chunk = min(self.chunk, max_context - longest - len(prompt))
    if chunk < 1:
      raise ValueError(
          f"policy {self.name!r} repeats the context after it: a context of {longest} tokens "
          f"leaves no room in the model context {max_context}"
      )
    context_length = jnp.copy(state.cache.length)
    logits, position = state.logits, state.position
    state = state.replace(
        cache=state.cache.with_slots(score=jnp.zeros_like(state.cache.slot("score")))
    )
    # One step per pass (the pass length rounded up to a page): prefill-sized steps would
    # pad a 512 + prompt pass to three 256-token chunks, a third of them padding.
    config = state.cache.config
    step = min(
        pages_for(chunk + len(prompt), config.page_size) * config.page_size,
        config.max_tokens - longest,
    )
    for start in range(0, longest, chunk):
      rows = [prompt + row[start : start + chunk] for row in context.ids]
      piece = EncodedPrompts(rows, [[False] * len(r) for r in rows], [[0] * len(r) for r in rows])
      state = reader.read(
          state,
          piece,
          key=jax.random.fold_in(state.key, start),
          step=f"{self.name} scoring",
          chunk=max(step, 1),
      )
      state = reader.cut(state, context_length).replace(position=position)
    return state.replace(logits=logits)

  def observe(self, cache, stats):
    # stats.head_probs: [B, Hq, T, N]; padded queries (t >= num_new) count for nothing.
    b, hq, t, n = stats.head_probs.shape
    live = (jnp.arange(t) < stats.num_new[:, None])[:, None, :, None]  # [B, 1, T, 1]
    probs = jnp.where(live, stats.head_probs, 0.0)
    peak = probs.reshape(b, cache.num_kv_heads, hq // cache.num_kv_heads * t, n).max(axis=2)
    current = read_layer(cache, "score", stats.layer)
    return write_layer(cache, "score", stats.layer, jnp.maximum(current, peak))
