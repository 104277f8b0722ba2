"""One layer of a KVzip pass at SmolLM2-135M's shapes (9 query heads, 3 kv heads, head dim
64, pages of 16): 528 queries (a 16-token prompt and a 512-token chunk) after a 528-slot
stretch (the sink's page and the chunk's span), so 1056 live slots. Times the pass's
attention (the live blocks, which also give the lse) and `paged_attention_key_max` over
every live slot or only the slots before the chunk (`before_chunk`, what the seam asks for
since 2026-12-06), in 512- and 256-slot blocks; one process, taking turns, `--rounds` rounds.

    python docs/results/compression_cost/key_max_pass.py [--rounds 15]
"""

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import paged_attention as pa

B, HQ, HKV, D, S, T, BEFORE = 1, 9, 3, 64, 16, 528, 528


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=15)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  m = (BEFORE + T) // S
  k_pages = jnp.asarray(rng.standard_normal((HKV * m + 1, S, D), np.float32))
  v_pages = jnp.asarray(rng.standard_normal((HKV * m + 1, S, D), np.float32))
  table = jnp.asarray((1 + np.arange(HKV * m)).reshape(1, HKV, m), jnp.int32)
  q = jnp.asarray(rng.standard_normal((B, T, HQ, D), np.float32))
  lengths = jnp.full((B, HKV), BEFORE + T, jnp.int32)
  num_queries = jnp.full((B,), T, jnp.int32)
  attention = jax.jit(
      lambda q: pa.paged_attention_live_blocks(q, k_pages, v_pages, table, lengths, num_queries)
  )
  _, lse = attention(q)

  def key_max(block_tokens, before_chunk):
    options = {"block_tokens": block_tokens, "before_chunk": before_chunk}
    return jax.jit(
        lambda q: pa.paged_attention_key_max(
            q, k_pages, table, lengths, num_queries, lse, **options
        )
    )

  runs = {
      "attention (live blocks, 512-slot blocks)": attention,
      "key_max, every live slot, 512-slot blocks (before)": key_max(512, False),
      "key_max, every live slot, 256-slot blocks": key_max(256, False),
      "key_max, slots before the chunk, 512-slot blocks": key_max(512, True),
      "key_max, slots before the chunk, 256-slot blocks (now)": key_max(256, True),
  }
  every = runs["key_max, every live slot, 512-slot blocks (before)"](q)
  before = runs["key_max, slots before the chunk, 256-slot blocks (now)"](q)
  assert np.allclose(every[..., :BEFORE], before[..., :BEFORE]) and not before[..., BEFORE:].any()
  times = {name: [] for name in runs}
  for _ in range(args.rounds):
    for name, run in runs.items():
      start = time.perf_counter()
      jax.block_until_ready(run(q))
      times[name].append(time.perf_counter() - start)
  print(f"jax {jax.__version__}; one layer, ms (min / median of {args.rounds})")
  print("| | min ms | median ms |\n|---|---:|---:|")
  for name, ts in times.items():
    print(f"| {name} | {min(ts) * 1e3:.2f} | {statistics.median(ts) * 1e3:.2f} |")


if __name__ == "__main__":
  main()
