"""Generation sharded over several processes (hosts) with `jax.distributed`.

Every process runs this same script; together they form one mesh over all their devices,
and `kvjax.generate(..., mesh=...)` runs the same code path as on one host.

  # Try it on one machine: 2 processes x 2 CPU devices, a (data=2, model=2) mesh.
  python examples/multihost.py --local-processes 2 --mesh data=2,model=2 --check

  # Multi-node GPU: one process per node (or per GPU), the same command on each node.
  python examples/multihost.py --coordinator node0:1234 --num-processes 4 --process-id $RANK \\
      --mesh data=4,model=8 --model smollm2-135m-instruct

  # A TPU pod slice: `jax.distributed.initialize()` finds the coordinator itself.
  python examples/multihost.py --mesh data=4,model=4

`--check` also generates on one device (in each process, before sharding) and compares.
The tiny random model (`--model tiny`, the default) has 2 kv heads: `model` may be 1 or 2;
SmolLM2-135M has 3 kv heads.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

PROMPTS = ["the quick brown fox jumps over the lazy dog", "hello from every process", "abc " * 8]


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--mesh", default="data=2,model=2", help="e.g. data=2,model=2")
  parser.add_argument("--model", default="tiny", help="'tiny' (random) or a registry name")
  parser.add_argument("--policy", default="h2o", help="compression policy")
  parser.add_argument("--budget", type=int, default=24, help="tokens per sequence")
  parser.add_argument("--max-new-tokens", type=int, default=12)
  parser.add_argument("--check", action="store_true", help="compare with one device")
  parser.add_argument(
      "--local-processes", type=int, default=0, help="spawn N processes on this machine"
  )
  parser.add_argument("--devices-per-process", type=int, default=2, help="with --local-processes")
  parser.add_argument("--port", type=int, default=12355, help="coordinator port (local runs)")
  parser.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
  parser.add_argument("--num-processes", type=int, default=None)
  parser.add_argument("--process-id", type=int, default=None)
  return parser.parse_args(argv)


def spawn(args) -> int:
  """Starts `--local-processes` copies of this script with forced CPU devices; returns the
  first non-zero exit status (0 when every process succeeded)."""
  env = dict(
      os.environ,
      XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices_per_process}",
      JAX_PLATFORMS="cpu",
  )
  passed = [
      f"--mesh={args.mesh}",
      f"--model={args.model}",
      f"--policy={args.policy}",
      f"--budget={args.budget}",
      f"--max-new-tokens={args.max_new_tokens}",
  ] + (["--check"] if args.check else [])
  procs = [
      subprocess.Popen(
          [sys.executable, __file__, *passed]
          + [
              f"--coordinator=localhost:{args.port}",
              f"--num-processes={args.local_processes}",
              f"--process-id={i}",
          ],
          env=env,
      )
      for i in range(args.local_processes)
  ]
  codes = [p.wait(timeout=900) for p in procs]
  return next((c for c in codes if c), 0)


def load(name):
  if name == "tiny":
    from kvjax.testing import ByteTokenizer, tiny_llama

    return tiny_llama(max_context=256, qk_scale=20), ByteTokenizer()
  from models import load_llama

  return load_llama(name)


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.local_processes:
    return spawn(args)

  import jax

  if jax.config.jax_platforms in (None, "", "cpu") and args.coordinator:
    # CPU devices of several processes talk through gloo.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if args.coordinator or args.num_processes:
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  else:
    jax.distributed.initialize()  # TPU pods and managed clusters: found from the environment

  import kvjax

  me = jax.process_index()
  mesh = kvjax.make_mesh(args.mesh)
  rows = mesh.shape["data"] * max(1, -(-len(PROMPTS) // mesh.shape["data"]))
  prompts = (PROMPTS * rows)[:rows]
  spec = (
      kvjax.CompressionSpec()
      if args.policy == "full"
      else kvjax.CompressionSpec(policy=args.policy, budget=args.budget, page_size=8)
  )
  expected = None
  if args.check:  # one device of this process, a model of its own (not the sharded one)
    model, tokenizer = load(args.model)
    expected = kvjax.generate(
        model, tokenizer, prompts, spec, max_new_tokens=args.max_new_tokens
    ).tokens
  model, tokenizer = load(args.model)
  result = kvjax.generate(
      model, tokenizer, prompts, spec, max_new_tokens=args.max_new_tokens, mesh=mesh
  )
  print(
      f"process {me}/{jax.process_count()}: {jax.device_count()} devices "
      f"({jax.local_device_count()} here), mesh {dict(mesh.shape)}, "
      f"{result.stats['final_kv_bytes']} KV bytes in all; row 0: {result.texts[0]!r}",
      flush=True,
  )
  if expected is not None:
    if result.tokens != expected:
      print(f"process {me}: sharded tokens differ from one device", flush=True)
      return 1
    print(f"process {me}: sharded generation agrees with one device", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
