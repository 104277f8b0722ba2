"""What `tune` returns: every point it measured, the choice and why, the held-out check;
written as a tuned spec (`tuned.json`, the allocation, `front.png`)."""

from __future__ import annotations

import dataclasses
import io
import json
import pathlib

from kvjax.spec import CompressionSpec
from kvjax.tuning import _search
from kvjax.tuning._spec_file import FORMAT, spec_record
from kvjax.tuning._target import Target
from kvjax_store import files


@dataclasses.dataclass
class Point:
  """A setting tried on the tuning items and what it measured."""

  spec: CompressionSpec
  measured: _search.Measured
  accuracy: float | None
  learned: bool = False
  items: int = 0  # tuning items it was measured on

  def record(self) -> dict:
    m = self.measured
    return {
        "policy": self.spec.policy.name,
        "budget": self.spec.budget,
        "head_budget": self.spec.sharing,
        "page_size": self.spec.page_size,
        "kv_dtype": self.spec.kv_dtype,
        "learned_allocation": self.learned,
        "kl": round(m.kl, 6),
        "kl_se": round(m.kl_se, 6),
        "accuracy": None if self.accuracy is None else round(self.accuracy, 4),
        "kv_mib": round(m.kv_bytes / 2**20, 4),
        "kv_mib_max": round(m.kv_bytes_max / 2**20, 4),
        "kept_fraction": round(m.kept_fraction, 4),
        "items": self.items,
    }


@dataclasses.dataclass
class TuneResult:
  """What `tune` chose and measured; `write(dir)` saves it as a tuned spec."""

  spec: CompressionSpec  # the chosen setting (its allocation, if learned, in memory)
  target: Target
  reachable: bool
  why: str
  chosen: Point
  baseline: Point | None  # the best fixed setting (a policy with its defaults) that meets it
  front: list[Point]  # the points no other beats on both memory and KL
  points: list[Point]  # every setting tried
  held_out: dict  # {"chosen": {...}, "baseline": {...}}: real-pipeline checks
  sample: dict
  timing: dict
  model: str
  fingerprint: str

  def write(self, out: str | pathlib.Path, *, plot: bool = True) -> pathlib.Path:
    """`out`/tuned.json (+ allocation/, front.png); returns the tuned.json path."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    allocation_dir = None
    if self.spec.allocation is not None:
      self.spec.allocation.save(out / "allocation", overwrite=True)
      allocation_dir = "allocation"
    record = {
        "format": FORMAT,
        "spec": spec_record(self.spec, allocation_dir),
        "model": self.model,
        "fingerprint": self.fingerprint,
        "target": {
            "metric": self.target.metric,
            "value": self.target.value,
            "reachable": self.reachable,
        },
        "chosen": self.chosen.record(),
        "why": self.why,
        "baseline": None if self.baseline is None else self.baseline.record(),
        "held_out": self.held_out,
        "front": [p.record() for p in self.front],
        "points": [p.record() for p in self.points],
        "sample": self.sample,
        "timing": self.timing,
    }
    path = out / "tuned.json"
    files.write_text(path, json.dumps(record, indent=1) + "\n")
    if plot:
      plot_front(self, out / "front.png")
    return path

  def table(self) -> str:
    """The Pareto front (and the chosen and baseline points) as a text table."""
    rows = [
        "policy              budget   alloc    items  KV MiB  kept    KL        acc",
    ]
    shown = list(self.front)
    for p in (self.chosen, self.baseline):
      if p is not None and p not in shown:
        shown.append(p)
    for p in sorted(shown, key=lambda p: p.measured.kv_bytes):
      r = p.record()
      mark = " <- chosen" if p is self.chosen else (" <- best fixed" if p is self.baseline else "")
      acc = "" if r["accuracy"] is None else f"{r['accuracy']:.2f}"
      rows.append(
          f"{r['policy']:<18} {r['budget']!s:>7}  {'learned' if p.learned else r['head_budget']:<7} "
          f"{p.items:>5} {r['kv_mib']:>8.2f}  {r['kept_fraction']:.3f}  {r['kl']:<8.4f}  {acc:>4}{mark}"
      )
    return "\n".join(rows)


def plot_front(result: TuneResult, path: pathlib.Path) -> pathlib.Path:
  """Writes `front_figure(result)` to `path` (PNG)."""
  fig = front_figure(result)  # selects the Agg backend before pyplot is imported here
  import matplotlib.pyplot as plt

  # Written atomically like tuned.json (a temporary beside it, renamed over it: a symlink
  # planted at `path` is replaced, never followed).
  try:
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
  finally:
    plt.close(fig)
  files.write_bytes(path, png.getvalue())
  return path


def front_figure(result: TuneResult):
  """Quality vs memory of every setting tried (a line per policy, with and without the
  learned allocation), the target, the best fixed setting and the chosen one, marked and
  labelled with what it is and why it was chosen. The caller closes the figure."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(9.6, 4.2), dpi=110)
  by_kind = {}
  for p in result.points:
    # A line per setting kind: quantized pages hold a budget in fewer bytes, so on their
    # kind's float line they would zigzag back.
    key = f"{p.spec.policy.name}{' + learned allocation' if p.learned else ''}"
    key += f", {p.spec.kv_dtype} pages" if p.spec.kv_dtype else ""
    by_kind.setdefault(key, []).append(p)
  for key, points in sorted(by_kind.items()):
    per_budget = {(p.spec.budget, p.spec.page_size): p for p in points}
    points = sorted(per_budget.values(), key=lambda p: p.measured.kv_bytes)
    ax.plot(
        [p.measured.kv_bytes / 2**20 for p in points],
        [max(p.measured.kl, 1e-6) for p in points],
        marker="o",
        label=key,
    )
  # The chosen setting: starred, named beside the star, and described in the legend (what
  # it is and why it was chosen), where a box beside the star would hide other points.
  chosen = f"chosen: {_setting(result.chosen)}\n{_reason(result)}"
  for p, label, style in ((result.baseline, "best fixed", "s"), (result.chosen, chosen, "*")):
    if p is not None:
      ax.scatter(
          *_xy(p),
          marker=style,
          s=240 if p is result.chosen else 160,
          zorder=5,
          label=label,
          edgecolors="black",
      )
  ax.annotate(
      "chosen",
      xy=_xy(result.chosen),
      xytext=(9, -3),
      textcoords="offset points",
      fontsize=8,
      fontweight="bold",
      zorder=6,
  )
  if result.target.metric == "kl":
    ax.axhline(result.target.value, color="gray", linestyle="--", label=str(result.target))
  elif result.target.metric == "memory":
    ax.axvline(result.target.value / 2**20, color="gray", linestyle="--", label=str(result.target))
  ax.set_yscale("log")
  ax.set_xlabel("K/V MiB held per request (mean over the items measured)")
  ax.set_ylabel("KL(full || compressed), nats")
  ax.set_title(f"kvjax tune: {result.model}")
  # Beside the axes, not on them: inside, the legend hid measured points.
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
  return fig


def _xy(point: Point) -> tuple[float, float]:
  """Where a point is drawn: its mean MiB and KL (floored for the log axis)."""
  return point.measured.kv_bytes / 2**20, max(point.measured.kl, 1e-6)


def _setting(point: Point) -> str:
  """'kvzip + learned allocation, budget 0.19, page 8, int8 pages'."""
  spec = point.spec
  parts = [spec.policy.name + (" + learned allocation" if point.learned else "")]
  parts.append(f"budget {spec.budget}, page {spec.page_size}")
  if spec.kv_dtype:
    parts.append(f"{spec.kv_dtype} pages")
  return ", ".join(parts)


def _reason(result: TuneResult) -> str:
  """Why the chosen point, in a few words: what the target asked of it."""
  m = result.chosen.measured
  held = f"{m.kv_bytes / 2**20:.2f} MiB, KL {m.kl:.4f}"
  if not result.reachable:
    return f"{held}; the closest to {result.target} (not reached)"
  if result.target.metric == "memory":
    return f"{held}: the lowest KL within {result.target.value / 2**20:.2f} MiB"
  return f"{held}: the least memory with {result.target}"
