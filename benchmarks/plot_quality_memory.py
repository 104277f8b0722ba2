"""Quality against memory: KL(full || compressed) against the K/V MiB a request holds, drawn
from `results.json` files of `kvjax eval fidelity` runs already made (nothing is measured).

    python -m benchmarks.plot_quality_memory
    python -m benchmarks.plot_quality_memory RUN [RUN ...] [--budgets 0.5 0.25 0.125] \
        [--out docs/results/quality/quality_vs_memory.png]

A RUN is the path of a fidelity `results.json`, optionally followed by `::` and the rows to
draw from it, separated by `;`, each a policy name or `policy=label` (the label may hold
commas and colons): `runs/results.json::full;h2o=h2o (mine)`. Without `::`, every row of the
run is drawn, labelled by its policy and, for quantized pages, its `kv_dtype`. Rows are kept
at `--budgets` (kept fractions; the full cache always). Each label's rows form one curve in
two panels sharing the KL axis: the request's peak K/V bytes (`peak_kv_bytes`, every run
records them) and the bytes held once the context is read and compressed (`kv_bytes`,
recorded by runs from 2026-12-04 on; a label without them is left out of that panel). A
full cache with KL 0 is a vertical line (a log axis has no 0).

The runs must measure the same thing, or their points cannot share a plot: the script
refuses runs that differ in task, model, context tokens, windows, continuation tokens,
data or the full cache's perplexity on those windows (which pins the windows themselves).

The defaults are 2048-token fidelity runs of the default model, the same 8 windows x 64
continuation tokens each: h2o and snapkv from quality/eviction_margin/before.json (the same
numbers as quality/fidelity, with the bytes held), expected_attention from quality/fidelity,
the full cache, kvzip (chunk passes) and learned from quality/learned_scorer/fidelity,
kvzip's whole-context passes (`kvzip:attend_to=context`) in float32 and in int8 pages and
the full cache in int8 from quantized_pages/fidelity_float32_kvzip and fidelity_int8. The
picture in the README is the default command's output.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import pathlib
import sys

from kvjax_store import files

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = "docs/results"
DEFAULT_RUNS = (
    f"{RESULTS}/quality/learned_scorer/fidelity/results.json::full=full cache;kvzip;learned",
    f"{RESULTS}/quality/eviction_margin/before.json::h2o;snapkv",
    f"{RESULTS}/quality/fidelity/results.json::expected_attention",
    f"{RESULTS}/quantized_pages/fidelity_float32_kvzip/results.json::"
    "kvzip=kvzip:attend_to=context",
    f"{RESULTS}/quantized_pages/fidelity_int8/results.json::"
    "full=full cache, int8 pages;kvzip=kvzip:attend_to=context, int8 pages",
)
DEFAULT_BUDGETS = (0.5, 0.25, 0.125)
DEFAULT_OUT = f"{RESULTS}/quality/quality_vs_memory.png"
MIB = 2**20
# What every run must share (config keys), and the tolerance on the full cache's perplexity.
SAME = ("context_tokens", "windows", "continuation_tokens", "data")
PPL_RTOL = 1e-4


def parse_run(text: str) -> tuple[pathlib.Path, dict[str, str] | None]:
  """`PATH[::policy[=label];...]` -> (path, {policy: label} or None for every row)."""
  path, _, select = text.partition("::")
  if not select:
    return pathlib.Path(path), None
  chosen = {}
  for item in filter(None, (s.strip() for s in select.split(";"))):
    policy, _, label = item.partition("=")
    chosen[policy.strip()] = label.strip() or policy.strip()
  return pathlib.Path(path), chosen


def load(path: pathlib.Path) -> dict:
  if not path.is_absolute() and not path.exists():
    path = ROOT / path
  try:
    run = json.loads(path.read_text())
  except OSError as e:
    raise SystemExit(f"plot_quality_memory: cannot read {path}: {e.strerror}") from None
  if run.get("task") != "fidelity":
    raise SystemExit(f"plot_quality_memory: {path} is a {run.get('task')!r} run, not fidelity")
  run["_path"] = path
  return run


def full_ppl(run: dict) -> float | None:
  """The full cache's perplexity on the run's windows (every row carries it)."""
  for row in run["rows"]:
    value = (row.get("metrics") or {}).get("ppl_full")
    if value is not None:
      return value
  return None


def check_comparable(runs: list[dict]) -> None:
  first = runs[0]
  if len(first["config"].get("context_tokens") or ()) != 1:
    raise SystemExit(
        f"plot_quality_memory: {first['_path']} holds several context lengths; draw one"
    )
  for run in runs[1:]:
    for key in SAME:
      if run["config"].get(key) != first["config"].get(key):
        raise SystemExit(
            f"plot_quality_memory: {run['_path']} and {first['_path']} differ in {key}: "
            f"{run['config'].get(key)!r} against {first['config'].get(key)!r}"
        )
    if run["model"]["name"] != first["model"]["name"]:
      raise SystemExit(f"plot_quality_memory: {run['_path']} is another model's run")
    a, b = full_ppl(run), full_ppl(first)
    if a is None or b is None or abs(a - b) > PPL_RTOL * b:
      raise SystemExit(
          f"plot_quality_memory: the full cache's perplexity differs ({a} in {run['_path']}, "
          f"{b} in {first['_path']}): not the same windows"
      )


def series(
    runs: list[tuple[dict, dict[str, str] | None]], budgets: tuple[float, ...]
) -> dict[str, list[dict]]:
  """{label: [row, ...]} in the order given, each row's metrics with its budget."""
  out: dict[str, list[dict]] = {}
  for run, chosen in runs:
    dtype = run["config"].get("spec", {}).get("kv_dtype")
    found = set()
    for row in run["rows"]:
      policy = row["policy"]
      if chosen is not None and policy not in chosen:
        continue
      found.add(policy)
      if row["budget"] is not None and not any(
          isinstance(row["budget"], (int, float)) and math.isclose(row["budget"], b)
          for b in budgets
      ):
        continue
      if chosen is not None:
        label = chosen[policy]
      else:
        label = policy if dtype in (None, "float32") else f"{policy}, {dtype} pages"
      metrics = row.get("metrics") or {}
      if metrics.get("kl") is None or metrics.get("peak_kv_bytes") is None:
        continue  # every case of the row failed
      out.setdefault(label, []).append({"budget": row["budget"], **metrics})
    missing = set(chosen or ()) - found
    if missing:
      raise SystemExit(f"plot_quality_memory: no rows for {sorted(missing)} in {run['_path']}")
  return out


def draw(curves: dict[str, list[dict]], runs: list[dict], out: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  cfg = runs[0]["config"]
  fig, axes = plt.subplots(1, 2, figsize=(11, 5.6), dpi=100, sharey=True)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  positive = [r["kl"] for rows in curves.values() for r in rows if r["kl"] > 0]
  panels = (
      (axes[0], "peak_kv_bytes", "peak K/V MiB during the request"),
      (axes[1], "kv_bytes", "K/V MiB held once the context is read (and compressed)"),
  )
  for i, (label, rows) in enumerate(curves.items()):
    color = colors[i % len(colors)]
    for ax, key, _ in panels:
      have = [r for r in rows if r.get(key) is not None]
      zero = [r for r in have if r["kl"] == 0]
      for r in zero:  # the full cache: KL 0 has no place on a log axis
        ax.axvline(
            r[key] / MIB,
            color=color,
            linestyle="--",
            linewidth=1.2,
            label=f"{label} (KL 0)" if ax is axes[0] else None,
        )
        ax.annotate(
            f"{label}: KL 0, {r[key] / MIB:.1f} MiB",
            (r[key] / MIB, min(positive)),
            rotation=90,
            va="bottom",
            ha="right",
            fontsize=7,
            color=color,
        )
      have = sorted((r for r in have if r["kl"] > 0), key=lambda r: -(r["budget"] or 1.0))
      if not have:
        continue
      x = [r[key] / MIB for r in have]
      y = [r["kl"] for r in have]
      ax.plot(
          x,
          y,
          "o-",
          color=color,
          linewidth=1.3,
          markersize=5,
          label=label if ax is axes[0] and not zero else None,
      )
      for r, xi in zip(have, x):
        ax.annotate(
            f"{r['budget']:g}" if r["budget"] is not None else "all",
            (xi, r["kl"]),
            textcoords="offset points",
            xytext=(4, 3),
            fontsize=7,
            color=color,
        )
  for ax, _, xlabel in panels:
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_xlim(left=0)
    ax.grid(True, which="both", alpha=0.3)
  axes[0].set_ylabel("KL(full || compressed), nats, log scale")
  fig.suptitle(
      f"Quality against memory, {runs[0]['model']['name']}, {cfg['context_tokens'][0]}-token "
      f"contexts\n(the same {cfg['windows']} windows x {cfg['continuation_tokens']} scored "
      "tokens in every run; numbers by the points: the kept fraction)",
      fontsize=10,
  )
  fig.legend(loc="lower center", ncol=4, fontsize=8, frameon=False)
  fig.tight_layout(rect=(0, 0.1, 1, 1))
  # Rendered to bytes and written atomically, like every file kvjax writes (a temporary
  # beside `out`, renamed over it: a symlink planted at `out` is replaced, never followed).
  image = io.BytesIO()
  fig.savefig(image, format=out.suffix.removeprefix(".").lower() or "png")
  plt.close(fig)
  out.parent.mkdir(parents=True, exist_ok=True)
  files.write_bytes(out, image.getvalue())


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
      "runs",
      nargs="*",
      default=list(DEFAULT_RUNS),
      help="results.json paths, each optionally PATH::policy[=label];...",
  )
  parser.add_argument(
      "--budgets",
      type=float,
      nargs="+",
      default=list(DEFAULT_BUDGETS),
      help="kept fractions to draw (the full cache always)",
  )
  parser.add_argument("--out", default=DEFAULT_OUT, help="the PNG to write")
  args = parser.parse_args(argv)
  parsed = [parse_run(r) for r in args.runs]
  runs = [(load(path), chosen) for path, chosen in parsed]
  check_comparable([run for run, _ in runs])
  curves = series(runs, tuple(args.budgets))
  out = pathlib.Path(args.out)
  if args.out == DEFAULT_OUT:  # the repository's picture, wherever the script runs from
    out = ROOT / DEFAULT_OUT
  draw(curves, [run for run, _ in runs], out)
  for label, rows in curves.items():
    cells = ", ".join(
        f"{r['budget'] if r['budget'] is not None else 'all'}: KL {r['kl']:.4g} at "
        f"{r['peak_kv_bytes'] / MIB:.1f} MiB peak"
        + (f", {r['kv_bytes'] / MIB:.1f} held" if r.get("kv_bytes") is not None else "")
        for r in rows
    )
    print(f"{label}: {cells}")
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
