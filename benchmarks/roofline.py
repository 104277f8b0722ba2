"""Prefill and decode against what the machine can do (a roofline), kvjax and transformers
side by side, in one run.

    python -m benchmarks.roofline [--model NAME] [--prefill-tokens 2048]
        [--contexts 2048 8000] [--repeats 3] [--decode-steps 16] [--json FILE]

The machine's limits, measured here:
- the float32 matmul rate at the model's own shapes: every linear layer of a prefill
  (rows = the prompt, as transformers computes it, and rows = kvjax's prefill chunk), timed
  in jax and in torch; the rate is the shapes' FLOPs over their summed medians, and the
  limit is the better library's;
- the memory bandwidth: a streaming read (sum) of a 256 MiB float32 array, jax and torch,
  the better of the two.

The model's costs, counted from its config: FLOPs per prefill token (its linear layers,
plus attention over the keys each query sees: every earlier token on a full layer, the
window on a sliding one; the logits of the last token only) and bytes read per decode
token (float32 weights once, the tied or separate head included, plus the K/V the step
reads). Prefill is reported as achieved FLOP/s over the matmul rate, decode as the
bandwidth bound (bytes / bandwidth) over the measured ms/token; both are shares of the
limit (1.0 = at the limit). Timings: A B A B over `--repeats` rounds, medians.

`--no-peer` skips transformers (its prefill and decode), `--limits-only` measures only the
machine. Prints markdown; `--json` also writes every number.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
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
from benchmarks.decode_attention import streaming_read
from benchmarks._peers import kvjax_decode, kvjax_prefill, load_transformers
from benchmarks._peers import torch_prefill_decode
from kvjax.eval import default_text
from pallas_kernels.gpu_check import median_seconds

STREAM_BYTES = 256 << 20  # well past any CPU's last-level cache


@dataclasses.dataclass(frozen=True)
class ModelCosts:
  """What one token costs a decoder of `config` (a `models.ModelConfig`), in float32."""

  config: object

  @property
  def linear_shapes(self) -> list[tuple[int, int]]:
    """(in, out) of each linear layer of one decoder layer (q, k, v, o, gate, up, down)."""
    c = self.config
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    return [(c.d_model, q), (c.d_model, kv), (c.d_model, kv), (q, c.d_model)] + [
        (c.d_model, c.ffn_dim),
        (c.d_model, c.ffn_dim),
        (c.ffn_dim, c.d_model),
    ]

  @property
  def layer_weights(self) -> int:
    """Linear weights of all layers (elements)."""
    return self.config.n_layers * sum(i * o for i, o in self.linear_shapes)

  def windows(self) -> list[int | None]:
    """Per layer, its sliding window (None: a full layer)."""
    c = self.config
    types = c.layer_types or ("full",) * c.n_layers
    return [c.sliding_window if t == "sliding" else None for t in types]

  def attention_flops(self, tokens: int) -> float:
    """FLOPs of a causal prefill's attention over `tokens` (QK^T and PV, 4 H D per key)."""
    c = self.config
    total = 0.0
    for window in self.windows():
      p = np.arange(1, tokens + 1, dtype=np.float64)
      seen = p if window is None else np.minimum(p, window)
      total += 4.0 * c.n_heads * c.head_dim * seen.sum()
    return total

  def prefill_flops(self, tokens: int) -> dict:
    """FLOPs of a prefill of `tokens`: linear layers, attention, the last token's logits."""
    c = self.config
    return {
        "linear": 2.0 * self.layer_weights * tokens,
        "attention": self.attention_flops(tokens),
        "logits": 2.0 * c.d_model * c.vocab_size,
    }

  def decode_bytes(self, context: int, kv_bytes_per_value: int = 4) -> dict:
    """Bytes one decode step reads after `context` tokens: the layers' weights, the head
    (vocab x d, tied or not) and the K/V of every layer (a sliding layer's window only)."""
    c = self.config
    kv_tokens = sum(context if w is None else min(context, w) for w in self.windows())
    return {
        "weights": 4.0 * self.layer_weights,
        "head": 4.0 * c.vocab_size * c.d_model,
        "kv": 2.0 * kv_tokens * c.n_kv_heads * c.head_dim * kv_bytes_per_value,
    }


def matmul_rate(shapes: list[tuple[int, int, int]], repeats: int = 5, torch_too=True) -> dict:
  """FLOP/s of float32 matmuls [m, k] @ [k, n] summed over `shapes` (with repeats), in jax
  and in torch (`torch_too` and installed): each library's total FLOPs over its summed
  medians."""
  import collections

  counts = collections.Counter(shapes)
  flops = sum(2.0 * m * k * n * times for (m, k, n), times in counts.items())
  rng = np.random.default_rng(0)
  rates = {}
  dot = jax.jit(jnp.matmul)
  seconds = 0.0
  for (m, k, n), times in counts.items():
    a = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
    b = jnp.asarray(rng.standard_normal((k, n), dtype=np.float32))
    seconds += times * median_seconds(dot, a, b, iters=repeats)
  rates["jax"] = flops / seconds
  try:
    import torch
  except ImportError:
    torch_too = False
  if not torch_too:
    return rates
  seconds = 0.0
  with torch.no_grad():
    for (m, k, n), times in counts.items():
      a, b = torch.randn(m, k), torch.randn(k, n)
      seconds += times * median_seconds(torch.mm, a, b, iters=repeats)
  rates["torch"] = flops / seconds
  return rates


def stream_bandwidth(repeats: int = 5, torch_too=True) -> dict:
  """Bytes/s of a streaming read (a sum) of a STREAM_BYTES float32 array, jax and torch
  (`torch_too` and installed)."""
  rates = {"jax": streaming_read(STREAM_BYTES, repeats)}
  try:
    import torch
  except ImportError:
    torch_too = False
  if not torch_too:
    return rates
  y = torch.ones(STREAM_BYTES // 4)
  rates["torch"] = STREAM_BYTES / median_seconds(torch.sum, y, iters=repeats)
  return rates


def machine_limits(costs: ModelCosts, rows: list[int], repeats: int) -> dict:
  """The matmul rate at the model's linear shapes with each of `rows` as m, and the
  streaming bandwidth; each with the better library named. torch only on a CPU backend
  (jax's device is what the limit is for; a torch on another device is not measured)."""
  shapes = [(m, k, n) for m in rows for k, n in costs.linear_shapes]
  torch_too = jax.default_backend() == "cpu"
  matmul = matmul_rate(shapes, repeats, torch_too)
  stream = stream_bandwidth(repeats, torch_too)
  best = lambda rates: max(rates.items(), key=lambda kv: kv[1])  # noqa: E731
  return {
      "matmul_flops": matmul,
      "matmul_limit": best(matmul),
      "bandwidth_bytes": stream,
      "bandwidth_limit": best(stream),
      "matmul_rows": rows,
  }


def _better(first: dict, second: dict) -> dict:
  """Per library, the higher of two measurements of the machine's limits."""
  out = dict(first)
  for name in ("matmul_flops", "bandwidth_bytes"):
    out[name] = {lib: max(first[name][lib], second[name][lib]) for lib in first[name]}
  best = lambda rates: max(rates.items(), key=lambda kv: kv[1])  # noqa: E731
  out["matmul_limit"], out["bandwidth_limit"] = best(out["matmul_flops"]), best(
      out["bandwidth_bytes"]
  )
  return out


def _prefill_rows(model, ids, steps, ref, repeats):
  spec = kvjax.CompressionSpec()
  seconds, state = kvjax_prefill(model, ids, spec, steps)  # compile outside the rounds
  chunk = state.plan.chunk
  del state
  if ref is not None:
    torch_prefill_decode(ref, ids[:64], 1)
  ours, theirs = [], []
  for _ in range(repeats):
    seconds, state = kvjax_prefill(model, ids, spec, steps)
    ours.append(seconds)
    del state
    if ref is not None:
      theirs.append(torch_prefill_decode(ref, ids, 0)[0])
  return chunk, statistics.median(ours), (statistics.median(theirs) if theirs else None)


def _decode_rows(model, ids, steps, ref, repeats):
  spec = kvjax.CompressionSpec()
  _, state = kvjax_prefill(model, ids, spec, steps)
  kvjax_decode(model, state, steps)  # compile the decode loop (its step count is static)
  ours, theirs = [], []
  for _ in range(repeats):
    _, state = kvjax_prefill(model, ids, spec, steps)
    ours.append(kvjax_decode(model, state, steps))
    del state
    if ref is not None:
      theirs.append(torch_prefill_decode(ref, ids, steps)[1])
  return statistics.median(ours), (statistics.median(theirs) if theirs else None)


def _report(args, config, costs, limits, measured, chunk, threads) -> dict:
  """Prints the machine's limits and the measured rows against them; returns every number."""
  (mm_lib, mm_rate), (bw_lib, bw_rate) = limits["matmul_limit"], limits["bandwidth_limit"]
  print(
      f"# Roofline: {getattr(config, 'name', args.model)}, float32, jax {jax.__version__} on "
      f"{jax.default_backend()} ({platform.processor() or platform.machine()}, "
      f"{os.cpu_count()} CPUs; torch threads {threads}), {time.strftime('%Y-%m-%d')}\n"
  )
  print_table(
      ["machine", "jax", "torch", "limit (better)"],
      [
          [
              f"float32 matmul GFLOP/s at the model's linear shapes (rows {', '.join(map(str, limits['matmul_rows']))})",
              f"{limits['matmul_flops']['jax'] / 1e9:.1f}",
              f"{limits['matmul_flops'].get('torch', float('nan')) / 1e9:.1f}",
              f"{mm_rate / 1e9:.1f} ({mm_lib})",
          ],
          [
              f"streaming read GB/s ({STREAM_BYTES >> 20} MiB)",
              f"{limits['bandwidth_bytes']['jax'] / 1e9:.1f}",
              f"{limits['bandwidth_bytes'].get('torch', float('nan')) / 1e9:.1f}",
              f"{bw_rate / 1e9:.1f} ({bw_lib})",
          ],
      ],
  )
  n = args.prefill_tokens
  flops = costs.prefill_flops(n)
  total_flops = sum(flops.values())
  print(
      f"\nModel: {costs.layer_weights / 1e6:.1f} M layer weights, head {config.vocab_size} x "
      f"{config.d_model}; a {n}-token prefill is {total_flops / 1e9:.1f} GFLOP "
      f"({flops['linear'] / total_flops:.0%} linear, {flops['attention'] / total_flops:.0%} "
      "attention).\n"
  )
  out = {
      "model": getattr(config, "name", args.model),
      "jax": jax.__version__,
      "backend": jax.default_backend(),
      "date": time.strftime("%Y-%m-%d"),
      "limits": limits,
      "prefill_tokens": n,
      "prefill_flops": flops,
      "kvjax_chunk": chunk,
  }
  if not args.limits_only:
    table = []
    for who in ("kvjax", "transformers"):
      seconds = measured["prefill_seconds"][who]
      if seconds is None:
        continue
      achieved = total_flops / seconds
      table.append(
          [
              f"prefill {n} tokens, {who}",
              f"{n / seconds:.0f} tok/s",
              f"{achieved / 1e9:.1f} GFLOP/s",
              f"{mm_rate / 1e9:.1f} GFLOP/s",
              f"{achieved / mm_rate:.2f}",
          ]
      )
    out["decode_bytes"] = {}
    for context, seconds in measured["decode_seconds"].items():
      step_bytes = costs.decode_bytes(context)
      out["decode_bytes"][context] = step_bytes
      bound = sum(step_bytes.values()) / bw_rate
      for who in ("kvjax", "transformers"):
        if seconds[who] is None:
          continue
        table.append(
            [
                f"decode after {context} tokens, {who}",
                f"{1e3 * seconds[who]:.1f} ms/token",
                f"{sum(step_bytes.values()) / 2**20:.0f} MiB read",
                f"{1e3 * bound:.1f} ms/token",
                f"{bound / seconds[who]:.2f}",
            ]
        )
    print_table(["", "measured", "work", "limit", "share of the limit"], table)
    out["measured"] = measured
  return out


def main(argv=None):
  from models import load_decoder, resolve_model
  from models.registry import DEFAULT_MODEL

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default=DEFAULT_MODEL, help="registry name or .gguf path")
  parser.add_argument("--prefill-tokens", type=int, default=2048)
  parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8000])
  parser.add_argument("--repeats", type=int, default=3, help="A B rounds (medians)")
  parser.add_argument("--decode-steps", type=int, default=16)
  parser.add_argument("--no-peer", action="store_true", help="kvjax only (no transformers)")
  parser.add_argument("--limits-only", action="store_true", help="measure the machine only")
  parser.add_argument("--json", help="also write every number to this file")
  args = parser.parse_args(argv)
  for name in ("prefill_tokens", "repeats", "decode_steps"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be at least 1")
  if any(n < 1 for n in args.contexts):
    parser.error("--contexts must be positive token counts")

  model, tok = load_decoder(args.model)
  config = model.config
  longest = max([args.prefill_tokens, *args.contexts]) + args.decode_steps
  if longest > config.max_context:
    parser.error(
        f"--contexts/--prefill-tokens: {longest} tokens past the model's context "
        f"{config.max_context}"
    )
  costs = ModelCosts(config)
  ids = tok.encode(default_text())
  if len(ids) < longest:
    raise SystemExit(f"the shipped text holds {len(ids)} tokens; {longest} needed")
  ref = None
  if not (args.no_peer or args.limits_only):
    ref = load_transformers(resolve_model(args.model).path)
  threads = None
  try:
    import torch

    threads = torch.get_num_threads()
  except ImportError:
    pass

  # The machine before and after the model runs, the better of the two (this machine's
  # speed drifts over minutes; a limit is what it reached). The rows of the matmul shapes:
  # the prompt (transformers computes it whole) and kvjax's prefill chunk.
  chunk = None
  if not args.limits_only:
    # (also compiles the prefill outside the rounds)
    prompt = ids[: args.prefill_tokens]
    chunk = kvjax_prefill(model, prompt, kvjax.CompressionSpec(), args.decode_steps)[1].plan.chunk
  rows = sorted({args.prefill_tokens} | ({chunk} if chunk else set()))
  before = machine_limits(costs, rows, max(args.repeats, 5))
  measured = {}
  if not args.limits_only:
    chunk, ours, theirs = _prefill_rows(
        model, ids[: args.prefill_tokens], args.decode_steps, ref, args.repeats
    )
    measured["prefill_seconds"] = {"kvjax": ours, "transformers": theirs}
    measured["decode_seconds"] = {}
    for n in args.contexts:
      measured["decode_seconds"][n] = dict(
          zip(
              ("kvjax", "transformers"),
              _decode_rows(model, ids[:n], args.decode_steps, ref, args.repeats),
          )
      )
  limits, after = before, None
  if not args.limits_only:
    after = machine_limits(costs, rows, max(args.repeats, 5))
    limits = _better(before, after)

  out = _report(args, config, costs, limits, measured, chunk, threads)
  out["limits_before_and_after"] = [before, after]  # how far the machine drifted meanwhile
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(out, indent=1, default=str))
  return out


if __name__ == "__main__":
  main()
