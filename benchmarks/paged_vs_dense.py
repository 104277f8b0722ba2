"""One decode step (append one token + attention) on a paged cache vs a dense contiguous cache.

    python -m benchmarks.paged_vs_dense [--sizes 1024 4096 16384] [--steps 32]

Both caches hold the same tokens; shapes follow SmolLM2-135M (9 query heads, 3 kv heads,
head_dim 64) for one layer. Steps run inside one jitted `fori_loop` with the cache donated,
as in a generation loop, so appends update in place. Prints the median time per step of
each and the ratio paged/dense, all measured in one run.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

if not __package__:  # `python benchmarks/NAME.py`: import from the repository root, as -m does
  sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from benchmarks._common import print_table
from pallas_kernels.paged_attention import paged_attention_reference


def dense_step(state, q, k, v):
  """Dense baseline on [B, Hkv, N, D] buffers.

  It attends over the old tokens plus the new one and writes the new one last: on XLA:CPU
  that order lets the update happen in place (write-then-read made XLA copy the buffers,
  2x slower at 16k tokens).
  """
  k_cache, v_cache, length = state
  b, hkv, n, d = k_cache.shape
  g = q.shape[2] // hkv
  q_BxKxGxD = q[:, 0].reshape(b, hkv, g, d) * d**-0.5
  logits = jnp.einsum("bkgd,bknd->bkgn", q_BxKxGxD, k_cache)
  logits = jnp.where(jnp.arange(n) < length, logits, -1e30)
  logit_new = jnp.einsum("bkgd,bkd->bkg", q_BxKxGxD, k[:, 0])[..., None]
  probs = jax.nn.softmax(jnp.concatenate([logits, logit_new], axis=-1), axis=-1)
  # Unwritten dense slots are zeros, never NaN: no V mask is needed.
  out = (
      jnp.einsum("bkgn,bknd->bkgd", probs[..., :-1], v_cache)
      + probs[..., -1:] * v[:, 0][:, :, None]
  )
  k_cache = jax.lax.dynamic_update_slice(k_cache, k.transpose(0, 2, 1, 3), (0, 0, length, 0))
  v_cache = jax.lax.dynamic_update_slice(v_cache, v.transpose(0, 2, 1, 3), (0, 0, length, 0))
  return (k_cache, v_cache, length + 1), out.reshape(b, 1, hkv * g, d)


def paged_step(cache, q, k, v):
  """Paged: write the token through the allocator, then attend through the page table."""
  position = cache.length[0, :, :1]
  cache = kvjax.append_layer(cache, 0, k, v, position)
  out, _ = paged_attention_reference(
      q, cache.k_pages, cache.v_pages, cache.page_table[0], cache.length[0]
  )
  return cache, out


def _decode_loop(step, inputs, steps):
  """A jitted loop of `steps` decode steps with the state donated (updated in place)."""

  def loop(state):
    def body(_, carry):
      state, checksum = carry
      state, out = step(state, *inputs)
      return state, checksum + out.sum()

    return jax.lax.fori_loop(0, steps, body, (state, jnp.float32(0)))

  return jax.jit(loop, donate_argnums=0)


def _interleaved_medians(loops_and_states, steps, repeats):
  """Median seconds per step of each loop, timed alternately so drift hits all alike."""
  loops = [loop for loop, _ in loops_and_states]
  states = [jax.block_until_ready(loop(state))[0] for loop, state in loops_and_states]
  times = [[] for _ in loops]
  for _ in range(repeats):
    for i, loop in enumerate(loops):
      start = time.perf_counter()
      states[i], _ = jax.block_until_ready(loop(states[i]))
      times[i].append(time.perf_counter() - start)
  return [statistics.median(t) / steps for t in times]


def run(sizes, steps=32, repeats=15, batch=1, hq=9, hkv=3, d=64, page_size=16):
  rng = np.random.default_rng(0)
  rows = []
  for n in sizes:
    total = steps * (repeats + 1)  # tokens appended over all timed and warm-up loops
    capacity = -(-(n + total) // page_size) * page_size  # in whole pages
    k0 = jnp.asarray(rng.normal(size=(1, batch, n, hkv, d)), jnp.float32)
    v0 = jnp.asarray(rng.normal(size=(1, batch, n, hkv, d)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(batch, 1, hq, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(batch, 1, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(batch, 1, hkv, d)), jnp.float32)

    def fresh_paged():
      cfg = kvjax.CacheConfig(page_size=page_size, max_tokens=capacity)
      cache = kvjax.init_cache(cfg, 1, batch, hkv, d)
      return kvjax.append(cache, k0, v0, jnp.broadcast_to(jnp.arange(n), (batch, n)))

    def fresh_dense():
      pad = ((0, 0), (0, 0), (0, capacity - n), (0, 0))
      return (
          jnp.pad(k0[0].transpose(0, 2, 1, 3), pad),
          jnp.pad(v0[0].transpose(0, 2, 1, 3), pad),
          jnp.int32(n),
      )

    # Same tokens, same answer: a benchmark of a wrong computation is worthless.
    out_paged = jax.jit(paged_step)(fresh_paged(), q, k, v)[1]
    out_dense = jax.jit(dense_step)(fresh_dense(), q, k, v)[1]
    np.testing.assert_allclose(out_paged, out_dense, atol=1e-4)

    paged, dense = _interleaved_medians(
        [
            (_decode_loop(paged_step, (q, k, v), steps), fresh_paged()),
            (_decode_loop(dense_step, (q, k, v), steps), fresh_dense()),
        ],
        steps,
        repeats,
    )
    rows.append((n, paged * 1e3, dense * 1e3, paged / dense))
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384])
  parser.add_argument("--steps", type=int, default=32, help="decode steps per timed loop")
  parser.add_argument("--repeats", type=int, default=15, help="timed loops (median is quoted)")
  parser.add_argument("--batch", type=int, default=1)
  args = parser.parse_args(argv)
  print(f"backend={jax.default_backend()} jax={jax.__version__} batch={args.batch}")
  rows = run(args.sizes, args.steps, args.repeats, batch=args.batch)
  print_table(
      ["cached tokens", "paged ms/step", "dense ms/step", "paged/dense"],
      [(n, f"{paged:.3f}", f"{dense:.3f}", f"{ratio:.2f}") for n, paged, dense, ratio in rows],
      numeric_from=0,
  )


if __name__ == "__main__":
  main()
