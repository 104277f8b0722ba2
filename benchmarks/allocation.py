"""A learned head allocation (`kvjax tune`) against the hand allocations, on held-out text.

    python -m benchmarks.allocation --spec tuned/tuned.json [--items 24]
        [--context-tokens 1024] [--continuation-tokens 32] [--held-out 0.34]
        [--running snapkv h2o]

Rebuilds the tuner's text items (the shipped text unless --text; the same windows and split
as `kvjax tune` with the same options) and uses only the held-out ones: items the allocation
was neither trained nor chosen on. Reports, at the tuned budget (equal memory up to page
rounding):

- the tuned spec; the same policy with its default ranking ('global'), with AdaKV's
  per-layer sharing ('layer') and with every head keeping the budget ('uniform'), exactly
  (masks over the full context's K/V: equal to `kvjax.prefill`'s, tests/test_tune.py);
- the `--running` policies with the uniform and the pyramid layer schedule, run for real;

then KL against budget for the tuned allocation and the default ranking, and the memory each
needs to reach the tuned spec's KL target (log-log interpolation between budgets).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np


def _memory_at(points, target):
  """Bytes at which KL crosses `target`, interpolated in log-log between measured budgets
  (points: [(bytes, kl)] sorted by bytes); None when no measured budget reaches it."""
  for (b0, k0), (b1, k1) in zip(points, points[1:]):
    if k0 > target >= k1:
      t = (np.log(k0) - np.log(target)) / (np.log(k0) - np.log(k1))
      return float(np.exp(np.log(b0) + t * (np.log(b1) - np.log(b0))))
  return points[0][0] if points and points[0][1] <= target else None


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--spec", required=True, help="tuned.json written by kvjax tune")
  parser.add_argument("--text", default=None, help="the tuning sample (default: shipped text)")
  parser.add_argument("--items", type=int, default=24)
  parser.add_argument("--context-tokens", type=int, default=1024)
  parser.add_argument("--continuation-tokens", type=int, default=32)
  parser.add_argument("--held-out", type=float, default=0.34)
  parser.add_argument("--running", nargs="*", default=["snapkv", "h2o"])
  args = parser.parse_args(argv)

  import models
  from kvjax.eval import _data
  from kvjax.tuning import _search, _workload, load_spec

  model, tokenizer = models.load_llama()
  tuned = load_spec(args.spec, model)
  record = json.loads(pathlib.Path(args.spec).read_text())
  target = record["target"]
  text = _data.read_text(args.text) if args.text else _data.default_text()
  items = _workload.text_items(
      tokenizer,
      text,
      context_tokens=args.context_tokens,
      continuation_tokens=args.continuation_tokens,
      max_items=args.items,
  )
  _, held = _workload.split(items, args.held_out)
  start = time.perf_counter()
  cal = _search.calibrate(model, tokenizer, held, [tuned.policy.name])
  print(f"calibrated {len(held)} held-out items in {time.perf_counter() - start:.0f} s")
  budget = tuned.budget
  rows = []

  def row(name, spec, measured):
    rows.append(
        f"| {name} | {spec.budget} | {measured.kv_bytes / 2**20:.2f} | "
        f"{measured.kept_fraction:.3f} | {measured.kl:.4f} ± {measured.kl_se:.4f} |"
    )
    return measured

  plain = tuned.replace(allocation=None, page_size=16)
  results = {
      "tuned": row(
          f"{tuned.policy.name} + learned allocation (page {tuned.page_size})",
          tuned,
          _search.evaluate_once(model, cal, tuned),
      ),
      "tuned16": row(
          f"{tuned.policy.name} + learned allocation (page 16)",
          tuned.replace(page_size=16),
          _search.evaluate_once(model, cal, tuned.replace(page_size=16)),
      ),
  }
  for sharing in ("global", "layer", "uniform"):
    spec = plain.replace(head_budget=sharing)
    results[sharing] = row(
        f"{tuned.policy.name}, head_budget={sharing}", spec, _search.evaluate_once(model, cal, spec)
    )
  from kvjax.spec import CompressionSpec

  for policy in args.running:
    for schedule in ("uniform", "pyramid"):
      spec = CompressionSpec(policy=policy, budget=budget, budget_schedule=schedule)
      results[f"{policy}-{schedule}"] = row(
          f"{policy}, budget_schedule={schedule}",
          spec,
          _search.evaluate_running(model, cal, spec, tokenizer=tokenizer),
      )
  print(
      f"\nHeld-out items: {len(held)} windows of {args.context_tokens} + "
      f"{args.continuation_tokens} tokens; budget {budget} of each context.\n"
  )
  print("| setting | budget | KV MiB per request | kept | KL (± s.e.) |")
  print("|---|---:|---:|---:|---:|")
  print("\n".join(rows))

  curves = {"learned": [], "default": []}
  for rho in _search.fractions(0.08, 0.45, 8):
    for name, spec in (
        ("learned", tuned.replace(budget=rho)),
        ("default", plain.replace(budget=rho)),
    ):
      m = _search.evaluate_once(model, cal, spec)
      curves[name].append((m.kv_bytes, m.kl))
  print("\n| budget | default KL | default MiB | learned KL | learned MiB |")
  print("|---:|---:|---:|---:|---:|")
  for rho, (db, dk), (lb, lk) in zip(
      _search.fractions(0.08, 0.45, 8), curves["default"], curves["learned"]
  ):
    print(f"| {rho} | {dk:.4f} | {db / 2**20:.2f} | {lk:.4f} | {lb / 2**20:.2f} |")
  if target["metric"] == "kl":
    need = {k: _memory_at(sorted(v), target["value"]) for k, v in curves.items()}
    if need["learned"] and need["default"]:
      print(
          f"\nMemory to reach KL {target['value']} on these held-out items: default ranking "
          f"{need['default'] / 2**20:.2f} MiB, learned allocation {need['learned'] / 2**20:.2f} "
          f"MiB ({1 - need['learned'] / need['default']:.0%} less)"
      )
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
