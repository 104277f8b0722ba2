"""Every file `kvjax eval` and `kvjax tune` write into an output directory goes through the
atomic writer (`kvjax_store.files.write_bytes`: a temporary beside the target, renamed over
it), plots included: a symlink someone planted in the directory (another user's, shared) is
replaced by the file, never followed to overwrite what it points at (issue 45, finding 4)."""

from __future__ import annotations

import json
import pathlib

import pytest

pytest.importorskip("matplotlib")

from kvjax.eval import _report  # noqa: E402
from kvjax.spec import CompressionSpec  # noqa: E402
from kvjax.tuning._result import Point, TuneResult  # noqa: E402
from kvjax.tuning._search import Measured  # noqa: E402
from kvjax.tuning._target import Target  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"
OUTSIDE = b"not kvjax's file: it must stay as it is\n"


def _plant(out: pathlib.Path, names, outside: pathlib.Path) -> dict[str, pathlib.Path]:
  """A symlink `out/<name>` to a file of its own under `outside` for each name."""
  out.mkdir(parents=True, exist_ok=True)
  outside.mkdir(parents=True, exist_ok=True)
  targets = {}
  for name in names:
    targets[name] = outside / f"target-of-{name}"
    targets[name].write_bytes(OUTSIDE)
    (out / name).symlink_to(targets[name])
  return targets


def _assert_replaced_not_followed(out: pathlib.Path, targets: dict[str, pathlib.Path]) -> None:
  for name, target in targets.items():
    assert target.read_bytes() == OUTSIDE, f"{name} was written through the symlink"
    written = out / name
    assert not written.is_symlink() and written.is_file(), name
    if name.endswith(".png"):
      assert written.read_bytes().startswith(PNG), name


def _fidelity_results() -> dict:
  """A fidelity sweep's results (two budgets of one policy beside the full cache at two
  lengths): what `_report.write` takes, without running a sweep."""
  rows = []
  for length in (64, 128):
    for policy, budget, kl, top1 in (("full", None, 0.0, 1.0), ("h2o", 0.5, 0.2, 0.8)) + (
        ("h2o", 0.25, 0.5, 0.6),
    ):
      metrics = dict.fromkeys(_report.METRICS["fidelity"])
      metrics.update(kl=kl, top1=top1, ppl=10.0, ppl_full=10.0, kept_fraction=budget or 1.0)
      metrics.update(kv_bytes=length * 1024 * (budget or 1.0), peak_kv_bytes=length * 1024)
      rows.append(
          {
              "policy": policy,
              "budget": budget,
              "budget_tokens": None if budget is None else int(length * budget),
              "context_tokens": length,
              "cases": 2,
              "failed": 0,
              "errors": [],
              "seconds": 1.0,
              "metrics": metrics,
          }
      )
  results = {
      "schema": _report.SCHEMA,
      "task": "fidelity",
      "created": "2026-01-01T00:00:00+00:00",
      "versions": {"kvjax": "0", "jax": "0"},
      "backend": {"platform": "cpu", "device_kind": "cpu", "device_count": 1},
      "model": {"name": "tiny"},
      "config": {},
      "rows": rows,
  }
  _report.validate(results)
  return results


def test_eval_plots_replace_a_planted_symlink_instead_of_following_it(tmp_path):
  out = tmp_path / "out"
  targets = _plant(out, ["top1_vs_budget.png", "kl_vs_budget.png"], tmp_path / "outside")
  written = _report.plots(_fidelity_results(), out)
  assert sorted(p.name for p in written) == sorted(targets)
  _assert_replaced_not_followed(out, targets)


def test_every_file_eval_writes_replaces_a_planted_symlink(tmp_path):
  """results.json, results.md and the plots: what `kvjax eval --out DIR` writes."""
  out = tmp_path / "out"
  names = ["results.json", "results.md", "top1_vs_budget.png", "kl_vs_budget.png"]
  targets = _plant(out, names, tmp_path / "outside")
  written = _report.write(_fidelity_results(), out)
  assert sorted(p.name for p in written) == sorted(names)
  _assert_replaced_not_followed(out, targets)
  assert json.loads((out / "results.json").read_text())["task"] == "fidelity"


def test_bench_plots_replace_a_planted_symlink(tmp_path):
  results = _fidelity_results()
  results["task"] = "bench"
  for row in results["rows"]:
    row["metrics"] = dict.fromkeys(_report.METRICS["bench"], 1.0)
  out = tmp_path / "out"
  names = [f"{metric}_vs_length.png" for metric in _report.COST_PLOTS]
  targets = _plant(out, names, tmp_path / "outside")
  assert sorted(p.name for p in _report.plots(results, out)) == sorted(names)
  _assert_replaced_not_followed(out, targets)


def _point(budget: float, kl: float, mib: float) -> Point:
  kv_bytes = int(mib * 2**20)
  measured = Measured(
      kl=kl,
      kl_se=kl / 10,
      agree=1.0,
      kv_bytes=kv_bytes,
      kv_bytes_max=kv_bytes,
      kv_bytes_bound=kv_bytes,
      kept_fraction=budget,
      kl_items=(kl,),
      agree_items=(True,),
  )
  return Point(CompressionSpec(policy="h2o", budget=budget), measured, None, items=1)


def _tune_result() -> TuneResult:
  """What `tune` returns for three settings measured (made here, not by tuning)."""
  points = [_point(0.25, 0.4, 1.0), _point(0.5, 0.1, 2.0), _point(0.75, 0.02, 3.0)]
  return TuneResult(
      spec=points[1].spec,
      target=Target("kl", 0.2),
      reachable=True,
      why="the least memory that meets kl <= 0.2",
      chosen=points[1],
      baseline=points[1],
      front=points,
      points=points,
      held_out={},
      sample={},
      timing={},
      model="tiny",
      fingerprint="0" * 16,
  )


def test_tune_writes_front_png_and_tuned_json_replacing_planted_symlinks(tmp_path):
  out = tmp_path / "tuned"
  targets = _plant(out, ["tuned.json", "front.png"], tmp_path / "outside")
  path = _tune_result().write(out)
  assert path == out / "tuned.json"
  _assert_replaced_not_followed(out, targets)
  assert json.loads(path.read_text())["chosen"]["budget"] == 0.5


def test_the_quality_memory_benchmark_plot_replaces_a_planted_symlink(tmp_path):
  from benchmarks import plot_quality_memory

  rows = [
      {"budget": None, "kl": 0.0, "peak_kv_bytes": 4 * 2**20, "kv_bytes": 4 * 2**20},
      {"budget": 0.5, "kl": 0.1, "peak_kv_bytes": 3 * 2**20, "kv_bytes": 2 * 2**20},
      {"budget": 0.25, "kl": 0.3, "peak_kv_bytes": 3 * 2**20, "kv_bytes": 2**20},
  ]
  config = {"context_tokens": [256], "windows": 2, "continuation_tokens": 8}
  runs = [{"model": {"name": "tiny"}, "config": config}]
  out = tmp_path / "plots"
  targets = _plant(out, ["quality_vs_memory.png"], tmp_path / "outside")
  plot_quality_memory.draw({"h2o": rows}, runs, out / "quality_vs_memory.png")
  _assert_replaced_not_followed(out, targets)
