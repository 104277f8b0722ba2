"""Quality of every eviction policy on the default model over real text.

    python -m kvjax.benchmarks.quality [--context 2048] [--continuation 128]
        [--budgets 512 256] [--windows 2] [--text FILE]

For each text window: the context is prefilled with compression to each budget, then the
continuation is fed teacher-forced (decode-time eviction applies). Reports mean
KL(P_full || P_compressed) in nats and top-1 agreement with the full cache over the
continuation predictions, averaged over windows, for every policy and budget, plus
per-layer (pyramid) and per-head budget variants. Default text: Debian's jargon-text
(`apt-get install jargon-text`), a public-domain dictionary of hacker slang.
"""

from __future__ import annotations

import argparse
import gzip
import pathlib
import time

import numpy as np

from kvjax import eval as E
from kvjax.policies import POLICIES

JARGON = pathlib.Path("/usr/share/doc/jargon-text/jargon.txt.gz")
VARIANT_POLICIES = ("h2o", "tova", "snapkv", "output_impact", "info_aware")


def read_text(path: str | None) -> str:
  if path is None:
    if not JARGON.exists():
      raise FileNotFoundError(f"{JARGON} not found: apt-get install jargon-text, or pass --text")
    return gzip.open(JARGON, "rt", encoding="utf-8", errors="replace").read()
  return pathlib.Path(path).read_text(encoding="utf-8", errors="replace")


def configurations(budgets, policies=None):
  def wanted(name):
    return name != "full" and (policies is None or name in policies)

  for budget in budgets:
    for name in filter(wanted, POLICIES):
      yield name, budget, "uniform", {}
    for name in filter(wanted, VARIANT_POLICIES):
      yield name, budget, "pyramid", {"budget_schedule": "pyramid"}
      yield name, budget, "per-head", {"per_head": True}


def run(model, tokenizer, text, context, continuation, budgets, windows, policies=None, log=print):
  ids = tokenizer.encode(text)
  span = context + continuation
  if len(ids) < span * windows:
    raise ValueError(f"text has {len(ids)} tokens; {windows} windows of {span} need more")
  starts = np.linspace(0, len(ids) - span, windows).astype(int)
  results = {}
  for w, start in enumerate(starts):
    ctx, cont = ids[start : start + context], ids[start + context : start + span]
    reference, full_peak = E.continuation_logits(model, ctx, cont)
    for name, budget, variant, options in configurations(budgets, policies):
      t0 = time.perf_counter()
      r = E.fidelity(
          model,
          tokenizer,
          ctx,
          cont,
          policy=name,
          budget=budget,
          reference_logits=reference,
          **options,
      )
      results.setdefault((name, budget, variant), []).append(r)
      log(
          f"window {w} {name:14s} budget={budget:4d} {variant:8s} kl={r['kl']:.4f} "
          f"top1={r['top1']:.3f} ppl={r['ppl']:.2f} (full {r['ppl_full']:.2f}) "
          f"peak={r['peak_kv_bytes'] / 2**20:.1f} MiB vs {full_peak / 2**20:.1f} "
          f"[{time.perf_counter() - t0:.1f} s]"
      )
  return {
      key: {metric: float(np.mean([r[metric] for r in rs])) for metric in rs[0]}
      for key, rs in results.items()
  }


def table(summary, budgets) -> str:
  lines = [
      "| policy | budget schedule | " + " | ".join(f"KL @{b} | top-1 @{b}" for b in budgets) + " |",
      "|---|---|" + "---:|---:|" * len(budgets),
  ]
  rows = sorted(
      {(name, variant) for name, _, variant in summary},
      key=lambda nv: (nv[1] != "uniform", nv[1], nv[0]),
  )
  for name, variant in rows:
    cells = []
    for b in budgets:
      r = summary.get((name, b, variant))
      cells.append("-" if r is None else f"{r['kl']:.4f} | {r['top1']:.3f}")
    lines.append(f"| {name} | {variant} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None):
  import models

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--context", type=int, default=2048)
  parser.add_argument("--continuation", type=int, default=128)
  parser.add_argument("--budgets", type=int, nargs="+", default=[512, 256])
  parser.add_argument("--windows", type=int, default=2)
  parser.add_argument("--text", default=None, help="UTF-8 text file (default: jargon-text)")
  parser.add_argument("--policies", nargs="+", default=None, help="default: all but full")
  args = parser.parse_args(argv)
  model, tokenizer = models.load_llama()
  summary = run(
      model,
      tokenizer,
      read_text(args.text),
      args.context,
      args.continuation,
      args.budgets,
      args.windows,
      args.policies,
  )
  print(table(summary, args.budgets))


if __name__ == "__main__":
  main()
