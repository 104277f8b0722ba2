"""KVzip: a context's tokens scored by how much the model needs each to repeat the context."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from kvjax.cache.paged_cache import Slot, logical_view, to_host
from kvjax.cache.pages import pages_for
from kvjax.policies.base import SCORE, Policy, read_layer, require_model_method, write_layer

RECONSTRUCTION_PROMPT = "\n\nRepeat the previous context exactly.\n\n"
ATTEND_TO = ("chunk", "context")


@dataclasses.dataclass(frozen=True)
class KVzip(Policy):
  """KVzip (Kim et al., 2025), query-agnostic. After the context is prefilled (nothing
  evicted), the model is asked to repeat it, `chunk` context tokens at a time on a fork of
  the state; a KV pair's score is the largest attention it receives from those
  reconstruction queries (max over the query heads of its kv head). One ranking across all
  layers and kv heads of a row then sets how many tokens each sequence keeps, and the pool
  is re-laid out to what is kept: the compressed context serves any later question. A
  row's leading protected tokens (its `<bos>`, a chat template's opening) are kept and
  not repeated.

  `attend_to`: what a repeated chunk attends to. "chunk" (default): the sink (the first
  page), the `lookback` tokens before its span and its span, so the passes cost linear in
  the context (kvpress scores KVzip over the sink, the chunk and the repeat); "context":
  the whole context (the passes cost quadratic in it)."""

  name: ClassVar[str] = "kvzip"
  slots: ClassVar[tuple[Slot, ...]] = (SCORE,)
  reads: ClassVar[frozenset[str]] = frozenset({"key_max"})
  mode: ClassVar[str] = "once"
  chunk: int = 512  # context tokens repeated per reconstruction pass
  attend_to: str = "chunk"  # "chunk" (the sink and the chunk's own span) or "context"
  lookback: int = 0  # with "chunk": context tokens before its span that a pass also sees

  def __post_init__(self):
    if self.attend_to not in ATTEND_TO:
      raise ValueError(f"KVzip attend_to must be one of {ATTEND_TO}, got {self.attend_to!r}")
    for name, low in (("chunk", 1), ("lookback", 0)):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"KVzip {name} must be an int >= {low}, got {value!r}")
    if self.lookback and self.attend_to != "chunk":
      raise ValueError(
          f"KVzip lookback={self.lookback} applies to attend_to='chunk' (a pass that sees the "
          "whole context has nothing to look back to)"
      )

  def score_context(self, reader, state, context, progress=None):
    """Reads the context (not observing: the scores come from repeating it), then has the
    model repeat it, one chunk per pass; a key's score is the most attention any repeating
    query pays it. Each pass's tokens are dropped again: memory peaks at the context + one
    chunk. `progress` counts the tokens read, then each pass's."""
    first = to_host(state.position)  # [B] where each row's context starts
    tokenizer, max_context = reader.tokenizer, reader.shape.max_context
    prompt = tokenizer.encode(RECONSTRUCTION_PROMPT) if tokenizer is not None else []
    longest = int(context.lengths.max())
    config = state.cache.config
    local = self.attend_to == "chunk"
    if local:
      # Spans of whole pages: a pass reads its span through a window of the page table.
      chunk = max(self.chunk // config.page_size, 1) * config.page_size
      lookback = -(-self.lookback // config.page_size) * config.page_size
    else:
      chunk = min(self.chunk, max_context - longest - len(prompt))
      if chunk < 1:
        raise ValueError(
            f"policy {self.name!r} repeats the context after it: a context of {longest} "
            f"tokens leaves no room in the model context {max_context} (attend_to='chunk' "
            "repeats each chunk after its own span)"
        )
    # A row's leading protected tokens (`<bos>`, a chat template's opening) are kept whatever
    # they score, so no pass repeats them (KVzip's reference keeps them in an unscored
    # prefix). Repeated, Gemma 3's `<bos>` is a second attention sink inside the first pass:
    # measured on Gemma 3 270M, it lowered that pass's mean score by 11-28 % per full layer.
    skip = [_prefix(row) for row in context.protected]
    passes = [
        (start, [row[max(start, k) : start + chunk] for row, k in zip(context.ids, skip)])
        for start in range(0, longest, chunk)
    ]
    passes = [(start, parts) for start, parts in passes if any(parts)]  # not all prefix
    pass_tokens = [len(prompt) + max(map(len, parts)) for _, parts in passes]
    work = reader.progress(progress, longest + sum(pass_tokens))
    state = reader.read(state, context, observe=False, progress=work.part(longest))
    logits, position = state.logits, state.position
    state = state.replace(
        cache=state.cache.with_slots(score=jnp.zeros_like(state.cache.slot("score")))
    )
    # One step per pass (the pass length rounded up to a page): prefill-sized steps would
    # pad a 512 + prompt pass to three 256-token chunks, a third of them padding.
    step = pages_for(chunk + len(prompt), config.page_size) * config.page_size
    if not local:
      step = min(step, config.max_tokens - longest)
      context_length = jnp.copy(state.cache.length)  # what each whole-context pass is cut to
    for (start, parts), tokens in zip(passes, pass_tokens):
      rows = [prompt + part for part in parts]
      options = dict(
          key=jax.random.fold_in(state.key, start),
          step=f"{self.name} scoring",
          chunk=max(step, 1),
          progress=work.part(tokens),
      )
      if local:
        # The pass sits after the whole context, as a repeat does (measured: after its own
        # span instead, KL at 50 % kept is 1.7x higher), or as late as the model's context
        # allows, never before its span's end: a context that fills the model is scored
        # too (its last pass may pass the model's context by up to a prompt and a chunk;
        # only the sink's page is that far from it).
        span_end = first + np.minimum(context.lengths, start + chunk)
        latest = max_context - len(prompt) - chunk
        after = np.maximum(span_end, np.minimum(first + context.lengths, latest))
        state = state.replace(position=jax.device_put(after.astype(np.int32)))
        state = reader.read_after_span(
            state,
            rows,
            start=start,
            span=chunk,
            sink=state.plan.spec.sink,
            lookback=lookback,
            **options,
        )
      else:
        state = reader.read(state.replace(position=position), rows, scratch=True, **options)
        state = reader.cut(state, context_length)
    return state.replace(logits=logits, position=position)

  def observe(self, cache, stats):
    current = read_layer(cache, "score", stats.layer)
    return write_layer(cache, "score", stats.layer, jnp.maximum(current, self.peak(cache, stats)))

  def peak(self, cache, stats) -> Float[Array, "B Hkv N"]:
    """The most any repeating query of a kv head pays each key in this pass: attention's
    `key_max` (the per-head probabilities are never materialised)."""
    return stats.key_max


def _prefix(protected) -> int:
  """How many tokens a row's protected prefix holds (its first unprotected token's index)."""
  return next((i for i, p in enumerate(protected) if not p), len(protected))


@dataclasses.dataclass(frozen=True)
class KVzipPlus(KVzip):
  """KVzip+ (kvpress' `kvzip_plus_normalization`): a key's attention from a repeating query
  head h weighed by what its value adds to the residual stream, ||W_O^h v|| (the output
  projection's rows of head h, from the model's optional `head_output_gram`). Values differ
  in norm across layers and heads, so the one global ranking no longer compares bare
  probabilities. kvpress also divides by the norm of the query's hidden state; kvjax's seam
  hands attention q, k and v, not the layer's input, so that factor is left out."""

  name: ClassVar[str] = "kvzip_plus"
  reads: ClassVar[frozenset[str]] = frozenset({"head_probs", "head_output"})

  def check_model(self, model):
    require_model_method(
        self, model, "head_output_gram(layer)", "weighs values by the output projection"
    )

  def peak(self, cache, stats):
    # stats.head_probs: [B, Hq, T, N]; padded queries (t >= num_new) count for nothing.
    b, hq, t, n = stats.head_probs.shape
    hkv = cache.num_kv_heads
    values = jnp.repeat(logical_view(cache, cache.v_pages, stats.layer), hq // hkv, axis=1)
    # ||W_O^h v_n||^2 = v_n . G_h v_n, [B, Hq, N]; the clip absorbs rounding below zero.
    energy = jnp.einsum("bhnd,hde,bhne->bhn", values, stats.head_output, values)
    weighed = stats.head_probs * jnp.sqrt(jnp.maximum(energy, 0.0))[:, :, None, :]
    live = (jnp.arange(t) < stats.num_new[:, None])[:, None, :, None]  # [B, 1, T, 1]
    weighed = jnp.where(live, weighed, 0.0)
    return weighed.reshape(b, hkv, hq // hkv * t, n).max(axis=2)
