"""One layer's prefill attention at SmolLM2-135M's shapes (9 query heads, 3 kv heads, head
dim 64, pages of 16): 2048 tokens in four 512-token chunks over the paged cache, as
`kvjax.prefill` runs it, against

- the same block schedule with the softmax taken out (the two matmuls per block only): what
  the live-blocks loop costs beyond its matmuls;
- torch's `scaled_dot_product_attention(is_causal=True)` over the 2048 tokens at once (its
  fused flash-attention CPU kernel, what transformers' sdpa path runs).

All in one process, taking turns (A B C A B C), `--rounds` rounds; prints min and median ms
per layer and GFLOP/s of the causal work (4 * 2048 * 2049 / 2 * 9 * 64 FLOP).

    python docs/results/speed/prefill_split/attention_layer.py [--rounds 15]
"""

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[4]))

import jax
import jax.numpy as jnp
import numpy as np
import torch

from pallas_kernels.paged_attention import blocks as pa

B, HQ, HKV, D, S, N, CHUNK = 1, 9, 3, 64, 16, 2048, 512


def matmuls_only(q, k_pages, v_pages, page_table, lengths, num_queries, block_tokens=512):
  """The live-blocks loop's matmuls over the same blocks, no softmax (not attention)."""
  hkv = page_table.shape[1]
  ppb, _, width, table = pa._blocks_of(page_table, k_pages.shape[1], block_tokens)
  rows = pa._query_rows(q, hkv, None)

  def block(j, acc):
    k = pa._read_block(k_pages, table, j, ppb)
    v = pa._read_block(v_pages, table, j, ppb)
    return acc + jnp.einsum("bkqn,bknd->bkqd", jnp.einsum("bkqd,bknd->bkqn", rows, k), v)

  trips = -(-jnp.max(lengths) // width)
  return jax.lax.fori_loop(0, trips, block, jnp.zeros(rows.shape, jnp.float32))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=15)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  m = N // S
  k_pages = jnp.asarray(rng.standard_normal((HKV * m + 1, S, D), np.float32))
  v_pages = jnp.asarray(rng.standard_normal((HKV * m + 1, S, D), np.float32))
  table = jnp.asarray((1 + np.arange(HKV * m)).reshape(1, HKV, m), jnp.int32)
  qs = [jnp.asarray(rng.standard_normal((B, CHUNK, HQ, D), np.float32)) for _ in range(N // CHUNK)]
  num_queries = jnp.full((B,), CHUNK, jnp.int32)

  def chunks(fn):
    step = jax.jit(lambda q, lengths: fn(q, k_pages, v_pages, table, lengths, num_queries))

    def run():
      outs = [step(q, jnp.full((B, HKV), (c + 1) * CHUNK, jnp.int32)) for c, q in enumerate(qs)]
      jax.block_until_ready(outs)

    return run

  tq = torch.randn(1, HQ, N, D)
  tk, tv = torch.randn(1, HKV, N, D), torch.randn(1, HKV, N, D)

  def torch_sdpa():
    with torch.no_grad():
      torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)

  runs = {
      "kvjax live blocks (512-slot blocks)": chunks(pa.paged_attention_live_blocks),
      "same blocks, matmuls only": chunks(matmuls_only),
      "torch sdpa, causal, 2048 at once": torch_sdpa,
  }
  times = {name: [] for name in runs}
  for run in runs.values():
    run()
  for _ in range(args.rounds):
    for name, run in runs.items():
      start = time.perf_counter()
      run()
      times[name].append(time.perf_counter() - start)
  flops = 4 * N * (N + 1) / 2 * HQ * D
  print(f"jax {jax.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads)")
  print("| one layer, 2048 tokens | min ms | median ms | GFLOP/s (median) |")
  print("|---|---:|---:|---:|")
  for name, ts in times.items():
    med = statistics.median(ts)
    print(f"| {name} | {min(ts) * 1e3:.1f} | {med * 1e3:.1f} | {flops / med / 1e9:.0f} |")


if __name__ == "__main__":
  main()
