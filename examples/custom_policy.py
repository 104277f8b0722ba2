"""New eviction scores in a few lines, one of them with per-token state of its own.

    python examples/custom_policy.py            # the default model
    python examples/custom_policy.py --tiny     # a tiny random model (CI)

A policy is a frozen dataclass: `scores` gives one score per cached slot (higher = keep),
`observe` sees each layer's attention, and `slots` declares the per-token arrays the policy
keeps in the cache (name, dtype, value in an empty slot). The cache allocates them and
eviction moves them with K/V: nothing outside this file changes. `register` makes a policy
selectable by name, in Python and on the command line once this file is imported:

    kvjax generate --policy-module examples/custom_policy.py --policy vnorm --budget 64 \
        --context document.txt "Summarise it in one sentence."
"""

import argparse
import dataclasses
from typing import ClassVar

import jax.numpy as jnp

import kvjax
from kvjax.policies import Policy, read_layer, register, write_layer


@register
@dataclasses.dataclass(frozen=True)
class ValueNorm(Policy):
  """Keeps the tokens with the largest value norm: removing them moves outputs most."""

  name: ClassVar[str] = "vnorm"

  def scores(self, cache, key):
    return jnp.linalg.norm(kvjax.logical_view(cache, cache.v_pages).astype(jnp.float32), axis=-1)


@register
@dataclasses.dataclass(frozen=True)
class PeakAttention(Policy):
  """Keeps the tokens whose largest attention from any single query was highest, and
  counts how often each was attended above `floor` (its own per-token state, a tie-break)."""

  name: ClassVar[str] = "peak_attention"
  slots: ClassVar[tuple[kvjax.Slot, ...]] = (
      kvjax.Slot("peak", "float32", 0.0),
      kvjax.Slot("hits", "int32", 0),
  )
  floor: float = 0.05

  def observe(self, cache, stats):
    # stats.probs: [B, Hkv, T, N], summed over the query heads of each kv head.
    peak = jnp.maximum(read_layer(cache, "peak", stats.layer), stats.probs.max(axis=2))
    hits = read_layer(cache, "hits", stats.layer) + (stats.probs > self.floor).sum(axis=2)
    cache = write_layer(cache, "peak", stats.layer, peak)
    return write_layer(cache, "hits", stats.layer, hits)

  def scores(self, cache, key):
    peak = kvjax.logical_view(cache, cache.slot("peak"))
    hits = kvjax.logical_view(cache, cache.slot("hits")).astype(jnp.float32)
    return peak + 1e-3 * hits


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tiny", action="store_true", help="a tiny random model (no weights)")
  args = parser.parse_args(argv)
  if args.tiny:
    from kvjax.testing import ByteTokenizer, tiny_llama

    model, tokenizer, chat, budget = tiny_llama(max_context=512), ByteTokenizer(), False, 48
  else:
    import models

    model, tokenizer = models.load_llama()
    chat, budget = True, 64
  document = "Chess is played on a board of 64 squares by two players. " * (4 if args.tiny else 8)
  question = "Summarise the rules of chess in three sentences."
  for policy in ("vnorm", "peak_attention"):
    spec = kvjax.CompressionSpec(policy=policy, budget=budget)
    # The document is compressed; the question, read after it, never is.
    result = kvjax.generate(
        model, tokenizer, [question], spec, context=document, chat=chat, max_new_tokens=24
    )
    print(f"{policy}: {result.texts[0]!r}")
    print(f"  peak KV {result.stats['peak_kv_bytes'] / 2**20:.2f} MiB at budget {budget}")


if __name__ == "__main__":
  main()
