"""`kvjax tune`: picks the compression for a workload from a sample of it.

    result = kvjax.tune(model, tokenizer, text=sample, target="kl=0.05")
    result.write("tuned/")            # tuned.json, allocation/, front.png
    spec = kvjax.load_spec("tuned/tuned.json", model)

The sample becomes items (a context, then a continuation: the next text, or a question and
the full cache's answer), split into a tuning part and a held-out part. On the tuning part:

1. every candidate policy at budgets spaced in log space (compress-once policies exactly and
   cheaply from one scoring of each context, `_relax`; the others by real runs), which gives
   each policy's smallest budget that meets the target (the "best fixed setting");
2. for the best compress-once policy, a head allocation learned with optax (`_search.
   learn_allocation`: offsets per layer and kv head through a soft, annealed keep-mask,
   minimising KL to the full cache at the budget), trained on one half of the tuning items
   and judged on the other, and the smallest budget that meets the target with it, in
   whole pages; page sizes are compared on the kept counts;
3. the chosen setting with quantized K/V pages (`kv_dtypes`, int8 and int4): a quantized
   token takes a fraction of the bytes, so a larger budget in int8 may hold less than the
   float setting; each dtype's smallest budget meeting the target is measured by real runs
   (quantization changes what attention reads: the relaxation cannot see it), and kept
   where it holds fewer bytes.

The chosen setting is the one that meets the target with the least memory (or, for a memory
target, the lowest KL within it). The held-out part then checks the chosen setting and the
best fixed one with the real pipeline (`kvjax.prefill`, teacher-forced continuations or
generated answers): the numbers a user should believe.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvjax_store import files as _files
from kvjax.fingerprint import model_fingerprint
from kvjax.seam import ModelShape
from kvjax.spec import CompressionSpec
from kvjax.tuning import _search
from pallas_kernels.page_format import QUANTIZED_DTYPES, token_bytes
from kvjax.tuning._spec_file import FORMAT, load_spec, spec_record
from kvjax.tuning._workload import question_items, split, text_items
from kvjax._checks import check_int

__all__ = ["Target", "TuneResult", "load_spec", "parse_target", "tune"]

METRICS = ("kl", "accuracy", "memory")
_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6}


@dataclasses.dataclass(frozen=True)
class Target:
  """What the tuned setting must meet: mean KL to the full cache at most `value` (nats per
  prediction), answer accuracy at least `value`, or K/V bytes held per request at most
  `value` (then the lowest KL within it) for any request of the sample's lengths: kept
  tokens rounded up to whole pages, whatever their spread over heads."""

  metric: str
  value: float

  def __post_init__(self):
    if self.metric not in METRICS:
      raise ValueError(f"target metric must be one of {METRICS}, got {self.metric!r}")
    if not np.isfinite(self.value) or self.value <= 0:
      raise ValueError(f"target {self.metric} must be a positive number, got {self.value!r}")
    if self.metric == "accuracy" and self.value > 1:
      raise ValueError(f"target accuracy is a share in (0, 1], got {self.value}")

  def meets(self, point: "Point") -> bool:
    """On tuning items, with a margin for the items not seen: mean KL plus one standard
    error over items (a setting picked at the edge of a few items' mean misses on others
    about half the time); for accuracy (answers equal to the full cache's, every answer
    token's top prediction, and correct) the Wilson lower bound at one standard error, which
    is n/(n+1) for n of n; for memory the most bytes any request of these lengths can hold."""
    m = point.measured
    if self.metric == "kl":
      return m.kl + m.kl_se <= self.value
    if self.metric == "accuracy":
      if self.value >= 1:  # no finite sample bounds a share at 1: every item must agree
        return point.accuracy >= 1
      return accuracy_bound(point.accuracy, point.items) >= self.value - 1e-9
    return m.kv_bytes_bound <= self.value

  def __str__(self):
    if self.metric == "memory":
      return f"memory <= {self.value / 2**20:.2f} MiB per request"
    return f"{self.metric} {'<=' if self.metric == 'kl' else '>='} {self.value:g}"


def accuracy_bound(share: float, n: int, z: float = 1.0) -> float:
  """Wilson score lower bound of a share measured on n items (z standard errors)."""
  if not 0 <= share <= 1:
    raise ValueError(f"share must be in [0, 1], got {share!r}")
  check_int("n", n, 0, note=" (items measured)")
  if n == 0:
    return 0.0
  centre = share + z * z / (2 * n)
  spread = z * np.sqrt(share * (1 - share) / n + z * z / (4 * n * n))
  return float((centre - spread) / (1 + z * z / n))


def items_for_accuracy(value: float) -> int:
  """The fewest tuning items whose perfect score bounds accuracy >= value (n/(n+1))."""
  if not 0 < value <= 1:
    raise ValueError(f"accuracy value must be in (0, 1], got {value!r}")
  return int(np.ceil(value / (1 - value) - 1e-9)) if value < 1 else 0


def parse_target(text: str) -> Target:
  """'kl=0.03', 'accuracy=0.95' or 'memory=64MiB' (also 'memory=0.5GiB', bytes)."""
  match = re.fullmatch(r"\s*(kl|accuracy|memory)\s*=\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*", text)
  if not match:
    raise ValueError(f"target must be kl=X, accuracy=X or memory=SIZE (e.g. 64MiB), got {text!r}")
  metric, number, unit = match.groups()
  try:
    value = float(number)
  except ValueError:
    raise ValueError(f"target {metric}: {number!r} is not a number") from None
  if metric == "memory":
    if unit.lower() not in _UNITS:
      raise ValueError(f"memory unit must be one of B, KiB, MiB, GiB, kB, MB; got {unit!r}")
    value *= _UNITS[unit.lower()]
  elif unit:
    raise ValueError(f"target {metric} takes no unit, got {unit!r}")
  return Target(metric, value)


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
    _files.write_text(path, json.dumps(record, indent=1) + "\n")
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


def tune(
    model,
    tokenizer,
    *,
    text: str | Sequence[int] | None = None,
    cases: Sequence[dict] | None = None,
    target: str | Target = "kl=0.05",
    policies: Sequence[str] = ("kvzip", "expected_attention", "snapkv", "h2o"),
    context_tokens: int = 1024,
    continuation_tokens: int = 32,
    max_items: int = 24,
    held_out: float = 0.34,
    steps: int = 40,
    page_sizes: Sequence[int] = (8, 16, 32),
    kv_dtypes: Sequence[str] = ("int8", "int4"),
    progress: Callable[[str], None] | None = print,
) -> TuneResult:
  """Chooses a `CompressionSpec` for a workload sample (see the module docstring).

  Args:
    text: continuation-fidelity sample (the target is then usually `kl=`).
    cases: question cases, {"context": text or ids, "question", "answer" (optional)}.
    target: `Target` or 'kl=X' | 'accuracy=X' | 'memory=SIZE'.
    policies: candidates (compress-once ones are scored exactly; the others run for real).
    context_tokens, continuation_tokens, max_items: text windows, evenly spread.
    held_out: share of the items kept for the final check.
    steps: optax steps of each half's allocation.
    kv_dtypes: quantized K/V dtypes to try the chosen setting with (() for none).
  """
  for kv_dtype in kv_dtypes:
    if kv_dtype not in QUANTIZED_DTYPES:
      raise ValueError(f"kv_dtypes must hold some of {QUANTIZED_DTYPES}, got {kv_dtype!r}")
  started = time.perf_counter()
  say = progress or (lambda _: None)
  target = parse_target(target) if isinstance(target, str) else target
  once, running = _check_request(model, text, cases, target, policies)
  if cases is not None:
    cases = list(cases)[:max_items]  # read once: an iterator is not consumed twice
    _check_accuracy_sample(target, len(cases), held_out)
  items = _items(
      model, tokenizer, text, cases, target, say, context_tokens, continuation_tokens, max_items
  )
  tune_items, held_items = split(items, held_out)
  items = tune_items + held_items
  tune_idx = list(range(len(tune_items)))
  say(
      f"{len(items)} items ({len(tune_items)} to tune on, {len(held_items)} held out); "
      f"target {target}"
  )
  search = _Search(model, tokenizer, items, target, say, once)
  timing = {"calibrate_s": round(time.perf_counter() - started, 1)}
  # 1. Every policy with its defaults: the best fixed setting.
  fixed, best_once = search.fixed_settings(once, running, tune_idx)
  baseline = _best(fixed.values(), target)
  timing["fixed_s"] = round(time.perf_counter() - started - timing["calibrate_s"], 1)

  # 2. A learned allocation for the best compress-once policy, at its budget.
  learn_started = time.perf_counter()
  start_from = (best_once or _closest(search.tried, target)).spec
  policy = start_from.policy.name
  learned, judge = search.learned_setting(policy, start_from.budget, tune_idx, steps)
  plain = fixed.get(policy)
  if learned is not None and (plain is None or _better(learned, plain, target)):
    learned = search.at_best_page_size(learned, page_sizes, tune_idx, judge)
  else:
    learned = None
  timing["learn_s"] = round(time.perf_counter() - learn_started, 1)
  chosen, why = _choose(learned, plain, baseline, policy, target)
  reachable = chosen is not None
  if not reachable:
    chosen = _closest(search.tried, target)
    why = (
        f"no setting tried meets {target} (the best: {chosen.spec.policy.name} at budget "
        f"{chosen.spec.budget}, KL {chosen.measured.kl:.4f}); the target is not reachable "
        "with these policies: the closest setting is written, marked unreachable"
    )
  # 3. The chosen setting with quantized pages, where it holds less.
  if reachable and kv_dtypes:
    quantized_started = time.perf_counter()
    quantized = search.quantized_setting(chosen, kv_dtypes, tune_idx[:8])
    timing["kv_dtype_s"] = round(time.perf_counter() - quantized_started, 1)
    if quantized is not None:
      chosen = quantized
      why += (
          f"; stored as {quantized.spec.kv_dtype} pages it meets {target} at budget "
          f"{quantized.spec.budget} in {quantized.measured.kv_bytes / 2**20:.2f} MiB (real runs "
          f"on {quantized.items} items)"
      )
  say(why)

  # 4. The held-out check, with the real pipeline.
  check_started = time.perf_counter()
  held = search.held_out_check(chosen.spec, baseline, list(range(len(tune_items), len(items))))
  timing["held_out_s"] = round(time.perf_counter() - check_started, 1)
  timing["total_s"] = round(time.perf_counter() - started, 1)
  return TuneResult(
      spec=chosen.spec,
      target=target,
      reachable=reachable,
      why=why,
      chosen=chosen,
      baseline=baseline,
      front=_pareto(search.tried),
      points=search.tried,
      held_out=held,
      sample={
          "items": len(items),
          "tune_items": len(tune_items),
          "held_out_items": len(held_items),
          "kind": "text" if text is not None else "questions",
          "context_tokens": [len(it.ids) for it in items],
          "sample_tokens": len(tokenizer.encode(text)) if isinstance(text, str) else None,
      },
      timing=timing,
      model=str(getattr(model.config, "name", type(model).__name__)),
      fingerprint=model_fingerprint(model),
  )


def _items(
    model, tokenizer, text, cases, target, say, context_tokens, continuation_tokens, max_items
):
  """The workload's items: windows of the text sample, or the question cases answered by
  the full cache."""
  if text is not None:
    return text_items(
        tokenizer,
        text,
        context_tokens=context_tokens,
        continuation_tokens=continuation_tokens,
        max_items=max_items,
    )
  items = question_items(model, tokenizer, cases, progress=say)
  if target.metric == "accuracy":
    full_accuracy = np.mean([it.correct(it.full_answer) for it in items])
    say(f"full cache: accuracy {full_accuracy:.2f} on {len(items)} cases")
  return items


def _check_request(model, text, cases, target, policies) -> tuple[list[str], list[str]]:
  """(compress-once, running) policy names; errors for a request that cannot run, before
  any work."""
  if not isinstance(target, Target):
    raise TypeError(f"target must be a str or kvjax.tuning.Target, got {type(target).__name__}")
  if (text is None) == (cases is None):
    raise ValueError("give a text sample (text=) or question cases (cases=), not both or neither")
  if target.metric == "accuracy" and text is not None:
    raise ValueError(
        "target accuracy needs question cases (cases=); a text sample takes kl= or memory="
    )
  for p in policies:
    CompressionSpec(policy=p, budget=0.5)  # unknown names fail here
  once = [p for p in policies if CompressionSpec(policy=p, budget=0.5).once]
  if not once:
    raise ValueError(f"policies {list(policies)} include no compress-once policy (e.g. kvzip)")
  ModelShape.of(model)  # TypeError for what is not a kvjax model, before any work
  return once, [p for p in policies if p not in once]


def _check_accuracy_sample(target: Target, num_cases: int, held_out: float) -> None:
  """An accuracy target needs enough tuning items to be told apart from chance."""
  if target.metric != "accuracy":
    return
  n_tune = len(split([None] * num_cases, held_out)[0])
  need = items_for_accuracy(target.value)
  if n_tune < need:
    raise ValueError(
        f"target {target} needs at least {need} tuning items (a perfect score on n items "
        f"bounds accuracy at n/(n+1)); {num_cases} cases hold out "
        f"{held_out:g} and leave {n_tune}: give about {int(np.ceil(need / (1 - held_out))) + 1} "
        "cases (max_items, --items)"
    )


class _Search:
  """The search's measurements on one calibrated workload: every point tried is kept."""

  def __init__(self, model, tokenizer, items, target: Target, say, once: list[str]):
    self.model, self.tokenizer, self.target, self.say = model, tokenizer, target, say
    self.cal = _search.calibrate(model, tokenizer, items, once, progress=say)
    self.full_ok = np.asarray([it.correct(it.full_answer) if it.question else True for it in items])
    self.lengths = sorted({it.budget_length for it in items})
    self.grid = _search.fractions()
    self.tried: list[Point] = []

  def measure(self, spec, index, learned=False, judge=None) -> Point:
    # The relaxation scores float K/V: quantized pages are measured by real runs.
    if spec.once and (spec.kv_dtype or "float32") not in QUANTIZED_DTYPES:
      m = _search.evaluate_once(self.model, self.cal, spec, index, judge)
    else:
      m = _search.evaluate_running(self.model, self.cal, spec, index, self.tokenizer)
    agree = np.asarray(m.agree_items) & self.full_ok[np.asarray(index)]
    accuracy = float(agree.mean()) if self.cal.items[0].question else None
    point = Point(spec, m, accuracy, learned, len(index))
    self.tried.append(point)
    self.say(
        f"  {spec.policy.name} budget {spec.budget} {'learned' if learned else spec.sharing}"
        + (f" {spec.kv_dtype}" if spec.kv_dtype else "")
        + ": "
        f"KL {m.kl:.4f}, {m.kv_bytes / 2**20:.2f} MiB"
        + ("" if accuracy is None else f", accuracy {accuracy:.2f}")
    )
    return point

  def smallest_meeting(self, make_spec, index, learned=False, judge=None) -> Point | None:
    """The least-memory budget of the grid (refined by bisection) that meets the target;
    for a memory target the largest budget within it."""
    target, best, below = self.target, None, None
    for rho in self.grid:
      spec = _spec_or_none(make_spec, rho, self.lengths)
      if spec is None:
        continue
      point = self.measure(spec, index, learned, judge)
      ok = target.meets(point)
      if target.metric == "memory":
        if not ok:
          break
        best = point
      elif ok:
        best = point
        break
      else:
        below = rho
    if best is not None and below is not None and target.metric != "memory":
      lo, hi = below, best.spec.budget
      for _ in range(3):
        mid = round((lo + hi) / 2, 4)
        spec = _spec_or_none(make_spec, mid, self.lengths)
        if spec is None:
          break
        point = self.measure(spec, index, learned, judge)
        if target.meets(point):
          best, hi = point, mid
        else:
          lo = mid
    return best

  def fixed_settings(self, once, running, tune_idx) -> tuple[dict, Point | None]:
    """Per policy, the least-memory default setting meeting the target (None: none does),
    and the best compress-once one."""
    fixed = {}
    for p in once:
      self.say(f"{p}: budgets {self.grid[0]}..{self.grid[-1]}")
      make = lambda rho, p=p: CompressionSpec(policy=p, budget=rho)  # noqa: E731
      fixed[p] = self.smallest_meeting(make, tune_idx)
    best_once = _best(fixed.values(), self.target)
    running_idx = tune_idx[:8]  # running policies prefill each item: a subset bounds the time
    for p in running:  # only where it could beat the best so far: at or below its budget
      if best_once is None:
        break
      self.say(f"{p}: at budget {best_once.spec.budget} (runs each of {len(running_idx)} items)")
      point = self.measure(CompressionSpec(policy=p, budget=best_once.spec.budget), running_idx)
      fixed[p] = point if self.target.meets(point) else None
    return fixed, best_once

  def learned_setting(self, policy, at, tune_idx, steps) -> tuple[Point | None, dict]:
    """`policy` with a head allocation learned at budget `at`, cross-fitted: one allocation
    per half of the tuning items, each judging the other half, so every tuning item is
    judged by an allocation that never saw it; the spec gets their mean. Returns the
    least-memory budget meeting the target (None: none does) and the judge of each item."""
    halves = (tune_idx[0::2], tune_idx[1::2]) if len(tune_idx) > 1 else (tune_idx, tune_idx)
    per_half = []
    for k, half in enumerate(halves):
      self.say(
          f"learning a head allocation for {policy} at budget {at}, half {k + 1} of 2 "
          f"({len(half)} items, {steps} optax steps)"
      )
      per_half.append(
          _search.learn_allocation(
              self.model,
              self.cal,
              CompressionSpec(policy=policy, budget=at),
              index=half,
              steps=steps,
              progress=self.say,
          )
      )
    allocation = _search.mean_allocation(per_half)
    judge = {i: per_half[1 - k] for k, half in enumerate(halves) for i in half}
    if len(tune_idx) == 1:
      judge = {tune_idx[0]: per_half[0]}
    learned = self.smallest_meeting(
        lambda rho: CompressionSpec(policy=policy, budget=rho, allocation=allocation),
        tune_idx,
        learned=True,
        judge=judge,
    )
    return learned, judge

  def at_best_page_size(self, point, page_sizes, index, judge) -> Point:
    """The chosen compress-once setting at the page size that holds the least (pages round
    each head's kept tokens up; the kept tokens, hence quality, do not change)."""
    best = point
    for size in page_sizes:
      if size == point.spec.page_size:
        continue
      spec = _spec_or_none(
          lambda _, size=size: point.spec.replace(page_size=size), None, self.lengths
      )
      if spec is None:
        continue
      candidate = self.measure(spec, index, point.learned, judge)
      if self.target.meets(candidate) and _better(candidate, best, self.target):
        best = candidate
    return best

  def quantized_setting(self, chosen: Point, kv_dtypes, index) -> Point | None:
    """`chosen`'s policy, allocation and page size with K/V stored as each of `kv_dtypes`:
    budgets from the chosen one upwards while they could hold fewer bytes than the chosen
    setting, measured by real runs on `index`; the best point meeting the target that
    beats `chosen` (None: none does). Quantized pages lose a little quality at the same
    budget, so no smaller budget is tried."""
    shape, spec = self.cal.shape, chosen.spec
    float_bytes = token_bytes(shape.head_dim, spec.kv_dtype or shape.dtype)
    best = None
    for kv_dtype in kv_dtypes:
      cheaper = float_bytes / token_bytes(shape.head_dim, kv_dtype)
      budgets = [spec.budget] + [
          rho for rho in self.grid if spec.budget < rho < spec.budget * cheaper
      ]
      self.say(f"{spec.policy.name} with {kv_dtype} pages: budgets {budgets}")
      for rho in budgets:
        candidate = _spec_or_none(
            lambda rho, kv=kv_dtype: spec.replace(budget=rho, kv_dtype=kv), rho, self.lengths
        )
        if candidate is None:
          continue
        point = self.measure(candidate, index, chosen.learned)
        meets = self.target.meets(point)
        if meets and _better(point, best or chosen, self.target):
          best = point
        if meets != (self.target.metric == "memory"):  # quality: the first that meets
          break
    return best

  def held_out_check(self, spec, baseline: Point | None, held_idx) -> dict:
    """The chosen spec (and the best fixed one, when another) on the held-out items, through
    the real pipeline."""
    references = {}  # the full cache's logits per held-out item, computed once
    check = lambda s: _search.held_out_check(  # noqa: E731
        self.model, self.tokenizer, self.cal, s, held_idx, references
    )
    held = {"chosen": check(spec)}
    if baseline is not None and baseline.spec != spec:
      held["baseline"] = check(baseline.spec)
    for name, result in held.items():
      result["meets_target"] = _held_meets(self.target, result)
      self.say(f"held out ({len(held_idx)} items), {name}: {result}")
    return held


def _choose(learned, plain, baseline, policy, target) -> tuple[Point | None, str]:
  """The learned setting (given where it beats `policy`'s default ranking, `plain`), else
  the best fixed setting; with why, in words. (None, "") when neither meets the target."""
  if learned is not None:
    return learned, (
        f"{policy} with the learned head allocation meets {target} on tuning items (each judged "
        f"by an allocation learned without it) at budget {learned.spec.budget} "
        f"({learned.measured.kv_bytes / 2**20:.2f} MiB), where {policy}'s default ranking needs "
        + (
            "more than any budget tried"
            if plain is None
            else f"budget {plain.spec.budget} ({plain.measured.kv_bytes / 2**20:.2f} MiB)"
        )
    )
  if baseline is not None:
    return baseline, (
        f"the learned allocation did not beat {policy}'s default ranking on held-in items; "
        f"{baseline.spec.policy.name} at budget {baseline.spec.budget} is the least memory "
        f"meeting {target}"
    )
  return None, ""


def _spec_or_none(make_spec, rho, lengths):
  """`make_spec(rho)`, or None where its budget is too small for the protected tokens of
  some item (of `lengths` tokens)."""
  try:
    spec = make_spec(rho)
    for length in lengths:
      spec.budget_tokens(length, strict=True)
    return spec
  except ValueError:
    return None


def _cost(point: Point, target: Target) -> float:
  """Lower is better: memory for quality targets, KL for a memory target."""
  return point.measured.kl if target.metric == "memory" else point.measured.kv_bytes


def _better(a: Point, b: Point, target: Target) -> bool:
  """`a` costs less; within 1% (the same budget, pages rounded apart), the lower KL."""
  ca, cb = _cost(a, target), _cost(b, target)
  if abs(ca - cb) <= 0.01 * max(abs(cb), 1e-12):
    return a.measured.kl < b.measured.kl
  return ca < cb


def _best(points, target: Target) -> Point | None:
  points = [p for p in points if p is not None]
  return min(points, key=lambda p: _cost(p, target)) if points else None


def _closest(points: Sequence[Point], target: Target) -> Point:
  """The point nearest to meeting the target (lowest KL, or highest accuracy)."""
  if target.metric == "accuracy":
    return max(points, key=lambda p: (p.accuracy, -p.measured.kl))
  if target.metric == "memory":
    return min(points, key=lambda p: p.measured.kv_bytes_bound)
  return min(points, key=lambda p: p.measured.kl)


def _pareto(points: Sequence[Point]) -> list[Point]:
  """The points no other point (measured on the same items) beats on both memory and KL."""
  front = []
  for p in points:
    if not any(
        q.measured.kv_bytes <= p.measured.kv_bytes
        and q.measured.kl <= p.measured.kl
        and (q.measured.kv_bytes < p.measured.kv_bytes or q.measured.kl < p.measured.kl)
        for q in points
    ):
      front.append(p)
  return sorted(front, key=lambda p: p.measured.kv_bytes)


def _held_meets(target: Target, result: dict) -> bool:
  if target.metric == "kl":
    return result["kl"] <= target.value
  if target.metric == "accuracy":
    return result["accuracy"] >= target.value
  return result["kv_bytes_max"] <= target.value


def plot_front(result: TuneResult, path: pathlib.Path) -> pathlib.Path:
  """Quality vs memory of every setting tried (a line per policy, with and without the
  learned allocation), the chosen and the best fixed one."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
  by_kind = {}
  for p in result.points:
    key = f"{p.spec.policy.name}{' + learned allocation' if p.learned else ''}"
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
  for p, label, style in ((result.chosen, "chosen", "*"), (result.baseline, "best fixed", "s")):
    if p is not None:
      ax.scatter(
          [p.measured.kv_bytes / 2**20],
          [max(p.measured.kl, 1e-6)],
          marker=style,
          s=160,
          zorder=5,
          label=label,
          edgecolors="black",
      )
  if result.target.metric == "kl":
    ax.axhline(result.target.value, color="gray", linestyle="--", label=str(result.target))
  elif result.target.metric == "memory":
    ax.axvline(result.target.value / 2**20, color="gray", linestyle="--", label=str(result.target))
  ax.set_yscale("log")
  ax.set_xlabel("K/V MiB held per request (mean over the items measured)")
  ax.set_ylabel("KL(full || compressed), nats")
  ax.set_title(f"kvjax tune: {result.model}")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
  return path
