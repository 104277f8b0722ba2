"""Results of an evaluation sweep: the JSON schema ("kvjax-results/1", documented in
docs/eval.md and checked by `validate`), Markdown tables and PNG plots."""

from __future__ import annotations

import datetime
import io
import json
import pathlib
import platform
import tempfile

import jax
import numpy as np

from kvjax_store import files as _files
from kvjax.seam import model_record

SCHEMA = "kvjax-results/1"

METRICS = {
    "fidelity": ("kl", "top1", "ppl", "ppl_full", "kept_fraction", "kv_bytes", "peak_kv_bytes"),
    "passkey": ("accuracy", "correct", "peak_kv_bytes"),
    "multi_question": ("accuracy", "correct", "questions", "peak_kv_bytes"),
    "perplexity": ("ppl", "ppl_full", "peak_kv_bytes"),
    "retention": ("retention", "retained_all", "peak_kv_bytes"),
    "bench": (
        "kv_bytes_peak",
        "kv_bytes_final",
        "prefill_seconds",
        "decode_ms_per_token",
        "eviction_share",
    ),
}

# Quality metrics plotted against the budget; cost metrics against the request length.
QUALITY_PLOTS = {
    "fidelity": ("kl", "top1"),
    "passkey": ("accuracy",),
    "multi_question": ("accuracy",),
    "perplexity": ("ppl",),
    "retention": ("retention",),
}
LABELS = {
    "kl": "KL(full || compressed), nats",
    "top1": "top-1 agreement with the full cache",
    "accuracy": "accuracy (fraction of answers correct)",
    "ppl": "perplexity of the continuation",
    "retention": "instruction tokens kept (fraction)",
}
COST_PLOTS = {
    "kv_bytes_peak": "peak KV cache (MiB)",
    "prefill_seconds": "prefill (s)",
    "decode_ms_per_token": "decode (ms / token)",
}

_ROW_FIELDS = {
    "policy": str,
    "budget": (int, float, str, type(None)),  # str: only "auto" (keep what scores above)
    "budget_tokens": (int, type(None)),
    "context_tokens": int,
    "cases": int,
    "failed": int,
    "errors": list,
    "seconds": (int, float),
    "metrics": dict,
}


def environment() -> dict:
  """Versions and backend recorded with every result."""
  import flax
  import jaxlib

  from kvjax._version import __version__

  devices = jax.devices()
  return {
      "versions": {
          "kvjax": __version__,
          "jax": jax.__version__,
          "jaxlib": jaxlib.__version__,
          "flax": flax.__version__,
          "numpy": np.__version__,
          "python": platform.python_version(),
      },
      "backend": {
          "platform": jax.default_backend(),
          "device_kind": devices[0].device_kind,
          "device_count": len(devices),
      },
  }


def new_results(task: str, model, config: dict) -> dict:
  if task not in METRICS:
    raise ValueError(f"task must be one of {sorted(METRICS)}, got {task!r}")
  return {
      "schema": SCHEMA,
      "task": task,
      "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      **environment(),
      "model": model_record(model),  # any model with the seam, not only models.Llama
      "config": config,
      "rows": [],
  }


def validate(results: dict) -> None:
  """Raises ValueError naming the first field that does not follow the schema."""

  def need(ok, what):
    if not ok:
      raise ValueError(f"results do not follow {SCHEMA}: {what}")

  need(isinstance(results, dict), "not a JSON object")
  need(results.get("schema") == SCHEMA, f"schema is {results.get('schema')!r}")
  task = results.get("task")
  need(task in METRICS, f"task is {task!r}")
  for field in ("created", "versions", "backend", "model", "config", "rows"):
    need(field in results, f"missing {field!r}")
  need(all(isinstance(results["versions"].get(k), str) for k in ("kvjax", "jax")), "versions")
  need(isinstance(results["backend"].get("platform"), str), "backend.platform")
  need(isinstance(results["rows"], list), "rows is not a list")
  for i, row in enumerate(results["rows"]):
    for field, kind in _ROW_FIELDS.items():
      need(field in row, f"rows[{i}] lacks {field!r}")
      need(
          isinstance(row[field], kind) and not isinstance(row[field], bool),
          f"rows[{i}].{field} = {row[field]!r}",
      )
    need(
        not isinstance(row["budget"], str) or row["budget"] == "auto",
        f"rows[{i}].budget = {row['budget']!r}",
    )
    need(
        0 <= row["failed"] <= row["cases"],
        f"rows[{i}] failed/cases = {row['failed']}/{row['cases']}",
    )
    need(len(row["errors"]) == row["failed"], f"rows[{i}] has {len(row['errors'])} errors")
    need(
        set(row["metrics"]) == set(METRICS[task]),
        f"rows[{i}].metrics keys {sorted(row['metrics'])}",
    )
    for name, value in row["metrics"].items():
      need(
          value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)),
          f"rows[{i}].metrics.{name} = {value!r}",
      )


def _fmt(name: str, value) -> str:
  if value is None:
    return "-"
  if "bytes" in name:
    return f"{value / 2**20:.1f} MiB"
  if name in ("accuracy", "top1", "retention", "retained_all", "eviction_share", "kept_fraction"):
    return f"{100 * value:.1f}%"
  if name in ("correct", "questions"):
    return str(int(value))
  return f"{value:.4g}"


def markdown(results: dict) -> str:
  """Tables per request length: one row per policy and budget, failures shown."""
  task, rows = results["task"], results["rows"]
  metrics = METRICS[task]
  lines = [
      f"# kvjax {task}: {results['model']['name']}",
      "",
      f"kvjax {results['versions']['kvjax']}, jax {results['versions']['jax']}, backend "
      f"{results['backend']['platform']} ({results['backend']['device_kind']}), {results['created']}",
  ]
  if "command" in results["config"]:
    lines += ["", f"Command: `{results['config']['command']}`"]
  baseline = {r["context_tokens"]: r for r in rows if r["policy"] == "full"}
  # Answer tasks show the full cache's accuracy beside their own; bench rows their decode
  # time relative to the full cache at the same request length.
  answered = task in ("passkey", "multi_question")
  extra = ["full-cache accuracy"] if answered else ["decode vs full"] if task == "bench" else []
  for length in sorted({r["context_tokens"] for r in rows}):
    lines += ["", f"## {length} tokens", ""]
    header = ["policy", "budget", "kept tokens", *metrics, *extra, "errors"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * 3 + "---:|" * (len(header) - 3)]
    for r in (r for r in rows if r["context_tokens"] == length):
      base = baseline.get(length)
      cells = [
          r["policy"],
          "-" if r["budget"] is None else str(r["budget"]),
          _kept_tokens(r),
          *(_fmt(m, r["metrics"][m]) for m in metrics),
      ]
      if answered:
        cells.append("-" if base is None else _fmt("accuracy", base["metrics"]["accuracy"]))
      if task == "bench":
        ratio = None
        if base and base["metrics"]["decode_ms_per_token"] and r["metrics"]["decode_ms_per_token"]:
          ratio = r["metrics"]["decode_ms_per_token"] / base["metrics"]["decode_ms_per_token"]
        cells.append("-" if ratio is None else f"{ratio:.2f}x")
      cells.append(f"{r['failed']}/{r['cases']}")
      lines.append("| " + " | ".join(cells) + " |")
  failures = [r for r in rows if r["failed"]]
  if failures:
    lines += ["", "## Errors (cases that crashed; they count as wrong)", ""]
    for r in failures:
      for error in r["errors"]:
        lines.append(f"- {r['policy']} budget={r['budget']} @{r['context_tokens']}: {error}")
  return "\n".join(lines) + "\n"


def plots(results: dict, out: pathlib.Path) -> list[pathlib.Path]:
  """PNG plots: quality vs budget per policy (one panel per request length), or cost vs
  request length per policy for `bench`. Returns the files written."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  task, rows = results["task"], results["rows"]
  written = []
  if task == "bench":
    for metric, axis_label in COST_PLOTS.items():
      fig, ax = plt.subplots(figsize=(6, 4))
      for label, series in _by_policy(rows, "context_tokens", with_budget=True).items():
        ys = [r["metrics"][metric] for r in series]
        if "bytes" in metric:
          ys = [None if y is None else y / 2**20 for y in ys]
        ax.plot([r["context_tokens"] for r in series], ys, marker="o", label=label)
      ax.set_xscale("log", base=2)
      lengths = sorted({r["context_tokens"] for r in rows})
      ax.set_xticks(lengths, [str(n) for n in lengths])
      ax.set_xlabel("request length (tokens)")
      ax.set_ylabel(axis_label)
      ax.set_title(f"{axis_label} by request length ({results['model']['name']})")
      ax.legend(fontsize=7)
      written.append(_save(fig, out / f"{metric}_vs_length.png"))
    return written
  lengths = sorted({r["context_tokens"] for r in rows})
  for metric in QUALITY_PLOTS[task]:
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
    for ax, length in zip(axes[0], lengths):
      # budget='auto' rows keep a different amount per input: no point on a budget axis.
      at_length = [r for r in rows if r["context_tokens"] == length and r["budget"] != "auto"]
      for label, series in _by_policy(at_length, "budget_tokens").items():
        if label == "full":
          if series[0]["metrics"][metric] is not None:
            ax.axhline(series[0]["metrics"][metric], color="k", linestyle="--", label="full")
          continue
        xs = [r["budget_tokens"] for r in series]
        ax.plot(xs, [r["metrics"][metric] for r in series], marker="o", label=label)
      ax.set_xlabel("budget (tokens kept per sequence)")
      ax.set_ylabel(LABELS[metric])
      ax.set_title(f"{task}, {length}-token requests")
      ax.legend(fontsize=7)
    written.append(_save(fig, out / f"{metric}_vs_budget.png"))
  return written


def _kept_tokens(row) -> str:
  if row["budget"] == "auto":
    return "above threshold"
  return "all" if row["budget_tokens"] is None else str(row["budget_tokens"])


def _by_policy(rows, x: str, with_budget: bool = False) -> dict[str, list[dict]]:
  """Rows grouped by policy (and budget, for cost curves), each sorted by `x`."""
  groups = {}
  for r in rows:
    label = r["policy"]
    if with_budget and r["policy"] != "full":
      label += f" @{r['budget']}"
    groups.setdefault(label, []).append(r)
  return {k: sorted(v, key=lambda r: r[x] or 0) for k, v in groups.items()}


def _save(fig, path: pathlib.Path) -> pathlib.Path:
  """`fig` as a PNG at `path`, written atomically like every file of the results (a
  temporary beside it, renamed over it: a symlink planted at `path` is replaced, never
  followed)."""
  import matplotlib.pyplot as plt

  try:
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
  finally:
    plt.close(fig)
  _files.write_bytes(path, png.getvalue())
  return path


def check_out(out: str | pathlib.Path) -> pathlib.Path:
  """`out` as a directory results can be written to (created if missing), checked before
  any work: a sweep must not run for an hour and then fail to save."""
  out = pathlib.Path(out)
  try:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out, prefix=".kvjax-write-check-"):
      pass
  except OSError as err:
    raise ValueError(f"--out {str(out)!r} is not a writable directory: {err.strerror}") from None
  return out


def write(results: dict, out: str | pathlib.Path, *, plot: bool = True) -> list[pathlib.Path]:
  """Writes results.json, results.md and (with `plot`) the plots into `out`, each file
  atomically; returns the paths. A sweep calls it after each configuration (plot=False),
  so what finished is kept whatever happens to the rest."""
  validate(results)
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  _files.write_text(out / "results.json", json.dumps(results, indent=1) + "\n")
  _files.write_text(out / "results.md", markdown(results))
  return [out / "results.json", out / "results.md", *(plots(results, out) if plot else [])]
