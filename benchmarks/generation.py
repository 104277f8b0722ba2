"""Prefill and decode throughput of the default model: kvjax paged cache vs a dense cache.

    python -m benchmarks.generation [--prompt-tokens 1024] [--contexts 1024 4096]

Both paths run the same `models.Llama` weights and layer code (`Llama.run`); only the KV
storage and attention differ: the paged cache with its allocator and reference paged
attention, or plain `[L, B, Hkv, N, D]` buffers updated with `dynamic_update_slice`. Prefill
is chunked (256 tokens); decode is greedy, `--steps` tokens inside one jitted `fori_loop`.
Medians of `--repeats` runs, both paths timed alternately in one process.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import statistics
import sys
import time

if not __package__:  # `python benchmarks/NAME.py`: import from the repository root, as -m does
  sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvjax
import models
from benchmarks._common import print_table
from kvjax.seam import forward


def dense_attend(q, k, v, state, layer, *, num_new):
  """Dense KV storage: write this chunk at `length`, then attend causally."""
  k_cache, v_cache, length = state  # [L, B, Hkv, N, D], [L, B, Hkv, N, D], []
  b, t, hq, d = q.shape
  hkv, n = k_cache.shape[2], k_cache.shape[3]
  g = hq // hkv
  at = (layer, 0, 0, length, 0)
  k_cache = jax.lax.dynamic_update_slice(k_cache, k.transpose(0, 2, 1, 3)[None], at)
  v_cache = jax.lax.dynamic_update_slice(v_cache, v.transpose(0, 2, 1, 3)[None], at)
  k_l, v_l = k_cache[layer], v_cache[layer]  # [B, Hkv, N, D]
  q_BxKxQxD = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * g, d)
  logits = jnp.einsum("bkqd,bknd->bkqn", q_BxKxQxD * d**-0.5, k_l)
  query_pos = length + jnp.repeat(jnp.arange(t), g)  # [T*G]
  logits = jnp.where(jnp.arange(n) <= query_pos[:, None], logits, -1e30)
  out = jnp.einsum("bkqn,bknd->bkqd", jax.nn.softmax(logits, axis=-1), v_l)
  out = out.reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, hq, d)
  return out, (k_cache, v_cache, length + jnp.where(layer == k_cache.shape[0] - 1, num_new, 0))


@functools.partial(jax.jit, static_argnames="graphdef", donate_argnames="kv")
def _paged_chunk(graphdef, params, kv, tokens, positions):
  num_new = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
  logits, kv = forward(nnx.merge(graphdef, params), tokens, positions, kv, num_new)
  return logits[:, -1], kv


@functools.partial(jax.jit, static_argnames="graphdef", donate_argnames="kv")
def _dense_chunk(graphdef, params, kv, tokens, positions):
  model = nnx.merge(graphdef, params)
  attend = functools.partial(dense_attend, num_new=tokens.shape[1])
  logits, kv = model.run(tokens, positions, kv, attend)
  return logits[:, -1], kv


def _decode_loop(chunk_fn, steps):
  @functools.partial(jax.jit, static_argnames="graphdef", donate_argnames="kv")
  def loop(graphdef, params, kv, token, position):
    def body(_, carry):
      kv, token, position = carry
      logits, kv = chunk_fn.__wrapped__(graphdef, params, kv, token[:, None], position[:, None])
      return kv, jnp.argmax(logits, -1).astype(jnp.int32), position + 1

    return jax.lax.fori_loop(0, steps, body, (kv, token, position))

  return loop


def _fresh_paged(model, capacity):
  c = model.config
  cfg = kvjax.CacheConfig(page_size=16, max_tokens=capacity)
  return kvjax.init_cache(cfg, c.n_layers, 1, c.n_kv_heads, c.head_dim, chunk=256)


def _fresh_dense(model, capacity):
  c = model.config
  shape = (c.n_layers, 1, c.n_kv_heads, capacity, c.head_dim)
  return (jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.int32(0))


def _prefill(chunk_fn, graphdef, params, kv, ids, chunk=256):
  for start in range(0, ids.shape[1], chunk):
    tokens = ids[:, start : start + chunk]
    positions = jnp.arange(start, start + tokens.shape[1], dtype=jnp.int32)[None]
    logits, kv = chunk_fn(graphdef, params, kv, tokens, positions)
  return jax.block_until_ready((logits, kv))


def run(prompt_tokens=1024, contexts=(1024, 4096), steps=16, repeats=3):
  model, _ = models.load_llama()
  graphdef, params = nnx.split(model)
  rng = np.random.default_rng(0)
  vocab = model.config.vocab_size
  paths = {"kvjax": (_paged_chunk, _fresh_paged), "dense": (_dense_chunk, _fresh_dense)}
  rows = []

  # Prefill throughput.
  ids = jnp.asarray(rng.integers(0, vocab, (1, prompt_tokens)), jnp.int32)
  capacity = -(-prompt_tokens // 256) * 256
  times = {name: [] for name in paths}
  for repeat in range(repeats + 1):  # the first round compiles
    last_logits = {}
    for name, (chunk_fn, fresh) in paths.items():
      kv = fresh(model, capacity)
      start = time.perf_counter()
      last_logits[name], _ = _prefill(chunk_fn, graphdef, params, kv, ids)
      if repeat:
        times[name].append(time.perf_counter() - start)
    # Same model, same tokens: a benchmark of a wrong computation is worthless.
    np.testing.assert_allclose(last_logits["kvjax"], last_logits["dense"], atol=2e-3)
  prefill = {name: prompt_tokens / statistics.median(t) for name, t in times.items()}
  rows.append((f"prefill {prompt_tokens} tokens", prefill["kvjax"], prefill["dense"]))

  # Decode throughput at each context length.
  for context in contexts:
    ids = jnp.asarray(rng.integers(0, vocab, (1, context)), jnp.int32)
    capacity = -(-(context + steps * (repeats + 1)) // 256) * 256
    times = {name: [] for name in paths}
    states = {}
    for name, (chunk_fn, fresh) in paths.items():
      logits, kv = _prefill(chunk_fn, graphdef, params, fresh(model, capacity), ids)
      token = jnp.argmax(logits, -1).astype(jnp.int32)
      states[name] = (_decode_loop(chunk_fn, steps), kv, token, jnp.full((1,), context, jnp.int32))
    for repeat in range(repeats + 1):
      for name, (loop, kv, token, position) in states.items():
        start = time.perf_counter()
        kv, token, position = jax.block_until_ready(loop(graphdef, params, kv, token, position))
        if repeat:
          times[name].append(time.perf_counter() - start)
        states[name] = (loop, kv, token, position)
    decode = {name: steps / statistics.median(t) for name, t in times.items()}
    rows.append((f"decode at {context} context", decode["kvjax"], decode["dense"]))
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--prompt-tokens", type=int, default=1024)
  parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
  parser.add_argument("--steps", type=int, default=16, help="decode steps per timed loop")
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  print(f"backend={jax.default_backend()} jax={jax.__version__} model=smollm2-135m-instruct f32")
  rows = run(args.prompt_tokens, args.contexts, args.steps, args.repeats)
  print_table(
      ["measurement", "kvjax tokens/s", "dense tokens/s", "kvjax/dense"],
      [
          (label, f"{paged:.1f}", f"{dense:.1f}", f"{paged / dense:.2f}")
          for label, paged, dense in rows
      ],
  )


if __name__ == "__main__":
  main()
