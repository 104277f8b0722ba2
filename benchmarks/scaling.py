"""Memory per device of a sharded cache and model, for shapes too large for this machine.

Nothing runs on devices: the numbers come from kvjax's own sizing. `CompressionSpec.plan`
sizes the pool as `kvjax.prefill` would, the pool of one shard is its share of the
sequences (`kvjax.sharding`), and `jax.eval_shape` of `init_cache` for one shard's rows and
kv heads gives the bytes of every array a device holds (pool, slots, its page-table block).
Weights per device follow the Llama partition rules (`models.Llama.partition`).

    python -m benchmarks.scaling            # the table of docs/scaling.md
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import types

if not __package__:  # `python benchmarks/NAME.py`: import from the repository root, as -m does
  sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import jax

from kvjax import CompressionSpec, ModelShape, init_cache
from kvjax.sharding import shard_config
from models import Llama, ModelConfig


def _llama3(name: str, d_model: int, n_layers: int, n_heads: int, ffn_dim: int) -> ModelConfig:
  """A Llama 3 shape: 8 kv heads of 128 (so the model axis goes up to 8), 128k vocabulary
  and context, untied embeddings."""
  return ModelConfig(
      vocab_size=128256,
      d_model=d_model,
      n_layers=n_layers,
      n_heads=n_heads,
      n_kv_heads=8,
      head_dim=128,
      ffn_dim=ffn_dim,
      max_context=131072,
      name=name,
      tie_embeddings=False,
  )


MODELS = {
    "Llama-3-8B": _llama3("llama-3-8b", 4096, 32, 32, 14336),
    "Llama-3-70B": _llama3("llama-3-70b", 8192, 80, 64, 28672),
}
MESHES = ((1, 8), (8, 8))  # (data, model): 8 and 64 devices
CONTEXTS = (32768, 131072)
BATCH = 8
GiB = 2**30


def cache_bytes_per_device(
    config: ModelConfig, spec: CompressionSpec, *, batch, context, data, model, dtype="bfloat16"
) -> int:
  """Bytes of the cache arrays one device holds for `batch` rows of `context` tokens."""
  shape = ModelShape(
      config.n_layers, config.n_kv_heads, config.head_dim, config.vocab_size, context + 256, dtype
  )
  plan = spec.plan(shape, batch=batch, longest=context, reserve=256)
  # The plan's pool is the batch's: one shard holds its share (a mesh's shape is enough).
  cfg = shard_config(plan.config, types.SimpleNamespace(shape={"data": data, "model": model}))
  slots = () if plan.eviction is None else plan.eviction.policy.slots
  one_shard = jax.eval_shape(
      lambda: init_cache(
          cfg,
          config.n_layers,
          batch // data,
          config.n_kv_heads // model,
          config.head_dim,
          chunk=plan.chunk,
          slots=slots,
      )
  )
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(one_shard))


def weight_bytes_per_device(config: ModelConfig, model: int, dtype_bytes: int = 2) -> int:
  """Parameter bytes on one device: split by the Llama rules over `model`, else whole."""
  total = 0
  for name, shape in config.param_shapes().items():
    size = math.prod(shape)
    spec = Llama.partition(tuple(name.split(".")), shape[::-1])  # [out, in] -> [in, out]
    split = spec is not None and all(
        n % model == 0 for axis, n in zip(spec, shape[::-1]) if axis is not None
    )
    total += size * dtype_bytes // (model if split else 1)
  return total


def table() -> str:
  specs = {
      "full": CompressionSpec(),
      "h2o, budget 25%": CompressionSpec(policy="h2o", budget=0.25),
  }
  lines = [
      "| model | devices (data x model) | batch | context | cache | KV cache per device "
      "| weights per device |",
      "|---|---|---:|---:|---|---:|---:|",
  ]
  for name, config in MODELS.items():
    for data, model in MESHES:
      weights = weight_bytes_per_device(config, model)
      for context in CONTEXTS:
        for label, spec in specs.items():
          kv = cache_bytes_per_device(
              config, spec, batch=BATCH, context=context, data=data, model=model
          )
          lines.append(
              f"| {name} | {data * model} ({data} x {model}) | {BATCH} | {context:,} | {label} "
              f"| {kv / GiB:.2f} GiB | {weights / GiB:.2f} GiB |"
          )
  return "\n".join(lines)


def main(argv=None) -> None:
  argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
  print(table())


if __name__ == "__main__":
  main()
