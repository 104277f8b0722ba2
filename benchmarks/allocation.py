"""A learned head allocation (`kvjax tune`) against the hand allocations, on held-out text.

    python -m benchmarks.allocation --spec tuned/tuned.json [--items 24]
        [--context-tokens 1024] [--continuation-tokens 32] [--held-out 0.34]
        [--running snapkv h2o]

Rebuilds the tuner's text items (the shipped text unless --text; the same windows and split
as `kvjax tune` with the same options) and uses only the held-out ones: items the allocation
was neither trained nor chosen on. Reports, at the tuned budget (equal memory up to page
rounding):

- the tuned spec; the same policy with its default ranking ('global'), with AdaKV's
  per-layer sharing ('layer') and with every head keeping the budget ('uniform');
- the `--running` policies with the uniform and the pyramid layer schedule;

then KL against budget for the tuned allocation and the default ranking, and the memory each
needs to reach the tuned spec's KL target (log-log interpolation between budgets).

Every setting runs through the public pipeline on every held-out item
(`kvjax.eval.continuation_logits`: the context prefilled and compressed by `kvjax.prefill`
at the budget resolved for its length, then the continuation teacher-forced), and its
predictions of the continuation but the first are compared with the full cache's, as the
tuner scores them (the first is predicted before a compress-once policy compresses). For the
compress-once settings these are the masks of the tuner's exact relaxation
(tests/test_tune.py), which is internal to `kvjax.tuning`: this script prefills every setting
instead, which takes longer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

if not __package__:  # `python benchmarks/NAME.py`: import from the repository root, as -m does
  sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import numpy as np


def _memory_at(points, target):
  """Bytes at which KL crosses `target`, interpolated in log-log between measured budgets
  (points: [(bytes, kl)] sorted by bytes); None when no measured budget reaches it."""
  for (b0, k0), (b1, k1) in zip(points, points[1:]):
    if k0 > target >= k1:
      t = (np.log(k0) - np.log(target)) / (np.log(k0) - np.log(k1))
      return float(np.exp(np.log(b0) + t * (np.log(b1) - np.log(b0))))
  return points[0][0] if points and points[0][1] <= target else None


def text_items(ids, context_tokens, continuation_tokens, max_items):
  """`kvjax tune`'s items of a text sample: (context, continuation) windows, at most
  `max_items`, disjoint and spread evenly over the text."""
  span = context_tokens + continuation_tokens
  count = min(max_items, len(ids) // span)
  if count < 2:
    raise SystemExit(
        f"the text has {len(ids)} tokens: it needs at least 2 windows of {context_tokens} + "
        f"{continuation_tokens} tokens"
    )
  starts = np.linspace(0, len(ids) - span, count).astype(int).tolist()
  return [(ids[s : s + context_tokens], ids[s + context_tokens : s + span]) for s in starts]


def held_out(items, share):
  """The items `kvjax tune` holds out: every k-th, at least one, never all."""
  n = len(items)
  count = min(n - 1, max(1, round(n * share)))
  index = set(np.linspace(n - 1, 0, count).round().astype(int).tolist())
  return [item for i, item in enumerate(items) if i in index]


def budgets(low: float, high: float, count: int) -> list[float]:
  """Budgets (fractions of the context) spaced evenly in log space, as the tuner's grid."""
  return [round(float(x), 4) for x in np.geomspace(low, high, count)]


@dataclasses.dataclass(frozen=True)
class Measured:
  kl: float  # mean over items of the mean KL(full || compressed) per scored prediction
  kl_se: float  # its standard error over items
  kv_bytes: float  # mean K/V bytes held per item once its context is read
  kept_fraction: float  # mean share of the context's K/V entries kept


def measure(model, tokenizer, items, references, spec) -> Measured:
  """`spec` on every item through the real pipeline, against the full cache's logits."""
  from kvjax.eval import compare_predictions, continuation_logits, resolve_budget

  kls, held, kept = [], [], []
  for (context, continuation), reference in zip(items, references):
    tokens = resolve_budget(spec, len(context))  # a fraction of the context, as the tuner's
    stats = {}
    logits, _ = continuation_logits(
        model,
        context,
        continuation,
        spec if tokens is None else spec.replace(budget=tokens),
        tokenizer=tokenizer,
        stats=stats,
    )
    scored = compare_predictions(reference[1:], logits[1:], np.asarray(continuation[1:]))
    kls.append(scored["kl"])
    held.append(stats["kv_bytes"])
    kept.append(stats["kept_fraction"])
  kls = np.asarray(kls, np.float64)
  return Measured(
      kl=float(kls.mean()),
      kl_se=float(kls.std(ddof=1) / np.sqrt(len(kls))) if len(kls) > 1 else 0.0,
      kv_bytes=float(np.mean(held)),
      kept_fraction=float(np.mean(kept)),
  )


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
  from benchmarks._common import read_text
  from kvjax import CompressionSpec, load_spec
  from kvjax.eval import continuation_logits, default_text

  model, tokenizer = models.load_llama()
  tuned = load_spec(args.spec, model)
  record = json.loads(pathlib.Path(args.spec).read_text())
  target = record["target"]
  text = read_text(args.text) if args.text else default_text()
  items = text_items(
      tokenizer.encode(text), args.context_tokens, args.continuation_tokens, args.items
  )
  held = held_out(items, args.held_out)
  sample = record.get("sample") or {}
  if (sample.get("items"), sample.get("held_out_items")) != (len(items), len(held)):
    print(
        f"note: {args.spec} was tuned on {sample.get('items')} items "
        f"({sample.get('held_out_items')} held out); these options give {len(items)} "
        f"({len(held)} held out): not the tuner's held-out items"
    )
  start = time.perf_counter()
  references = [
      continuation_logits(model, context, continuation, CompressionSpec())[0]
      for context, continuation in held
  ]
  print(
      f"full-cache references of {len(held)} held-out items in "
      f"{time.perf_counter() - start:.0f} s",
      flush=True,
  )
  budget = tuned.budget
  rows = []

  def row(name, spec):
    started = time.perf_counter()
    measured = measure(model, tokenizer, held, references, spec)
    print(f"  {name}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    rows.append(
        f"| {name} | {spec.budget} | {measured.kv_bytes / 2**20:.2f} | "
        f"{measured.kept_fraction:.3f} | {measured.kl:.4f} ± {measured.kl_se:.4f} |"
    )
    return measured

  plain = tuned.replace(allocation=None, page_size=16)
  row(f"{tuned.policy.name} + learned allocation (page {tuned.page_size})", tuned)
  row(f"{tuned.policy.name} + learned allocation (page 16)", tuned.replace(page_size=16))
  for sharing in ("global", "layer", "uniform"):
    row(f"{tuned.policy.name}, head_budget={sharing}", plain.replace(head_budget=sharing))
  for policy in args.running:
    for schedule in ("uniform", "pyramid"):
      spec = CompressionSpec(policy=policy, budget=budget, budget_schedule=schedule)
      row(f"{policy}, budget_schedule={schedule}", spec)
  print(
      f"\nHeld-out items: {len(held)} windows of {args.context_tokens} + "
      f"{args.continuation_tokens} tokens; budget {budget} of each context.\n"
  )
  print("| setting | budget | KV MiB per request | kept | KL (± s.e.) |")
  print("|---|---:|---:|---:|---:|")
  print("\n".join(rows))

  grid = budgets(0.08, 0.45, 8)
  curves = {"learned": [], "default": []}
  for rho in grid:
    for name, spec in (
        ("learned", tuned.replace(budget=rho)),
        ("default", plain.replace(budget=rho)),
    ):
      m = measure(model, tokenizer, held, references, spec)
      curves[name].append((m.kv_bytes, m.kl))
  print("\n| budget | default KL | default MiB | learned KL | learned MiB |")
  print("|---:|---:|---:|---:|---:|")
  for rho, (db, dk), (lb, lk) in zip(grid, curves["default"], curves["learned"]):
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
