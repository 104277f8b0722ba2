"""The search over settings on one calibrated workload: each policy's smallest budget that
meets the target, a learned head allocation, page sizes, quantized pages, and the held-out
check; and how one setting is preferred to another."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvjax.spec import CompressionSpec
from kvjax.tuning import _search
from kvjax.tuning._result import Point
from kvjax.tuning._target import Target
from pallas_kernels.page_format import QUANTIZED_DTYPES, token_bytes


class Search:
  """The search's measurements on one calibrated workload: every point tried is kept."""

  def __init__(self, model, tokenizer, items, target: Target, say, once: list[str], item_done=None):
    """`item_done(done, total)`: after each item is scored (`_search.calibrate`)."""
    self.model, self.tokenizer, self.target, self.say = model, tokenizer, target, say
    self.cal = _search.calibrate(model, tokenizer, items, once, progress=say, item_done=item_done)
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
      spec = spec_or_none(make_spec, rho, self.lengths)
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
      best = self.bisect(make_spec, below, best, index, 3, learned, judge)
    return best

  def bisect(self, make_spec, missing, meeting, index, steps, learned=False, judge=None):
    """`steps` bisection steps between a budget that misses the target and the point
    `meeting` it: the least-budget point found that meets it."""
    lo, hi = missing, meeting.spec.budget
    for _ in range(steps):
      mid = round((lo + hi) / 2, 4)
      spec = spec_or_none(make_spec, mid, self.lengths)
      if spec is None:
        break
      point = self.measure(spec, index, learned, judge)
      if self.target.meets(point):
        meeting, hi = point, mid
      else:
        lo = mid
    return meeting

  def fixed_settings(self, once, running, tune_idx) -> tuple[dict, Point | None]:
    """Per policy, the least-memory default setting meeting the target (None: none does),
    and the best compress-once one."""
    fixed = {}
    for p in once:
      self.say(f"{p}: budgets {self.grid[0]}..{self.grid[-1]}")
      make = lambda rho, p=p: CompressionSpec(policy=p, budget=rho)  # noqa: E731
      fixed[p] = self.smallest_meeting(make, tune_idx)
    best_once = best(fixed.values(), self.target)
    running_idx = tune_idx[:8]  # running policies prefill each item: a subset bounds the time
    for p in running:  # only where it could beat the best so far: at or below its budget
      if best_once is None:
        break
      self.say(f"{p}: at budget {best_once.spec.budget} (runs each of {len(running_idx)} items)")
      point = self.measure(CompressionSpec(policy=p, budget=best_once.spec.budget), running_idx)
      if self.target.meets(point) and self.target.metric != "memory":
        point = self.lowered(p, point, running_idx)
      fixed[p] = point if self.target.meets(point) else None
    return fixed, best_once

  def lowered(self, policy, meeting: Point, index) -> Point:
    """A running policy that meets the target at a budget, at the least budget that still
    does: the grid's budgets below it from the top down (real runs: each prefills every
    item) until one misses, then two bisection steps between."""
    make = lambda rho: CompressionSpec(policy=policy, budget=rho)  # noqa: E731
    for rho in sorted((r for r in self.grid if r < meeting.spec.budget), reverse=True):
      spec = spec_or_none(make, rho, self.lengths)
      if spec is None:
        break
      point = self.measure(spec, index)
      if not self.target.meets(point):
        return self.bisect(make, rho, meeting, index, 2)
      meeting = point
    return meeting

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
      spec = spec_or_none(
          lambda _, size=size: point.spec.replace(page_size=size), None, self.lengths
      )
      if spec is None:
        continue
      candidate = self.measure(spec, index, point.learned, judge)
      if self.target.meets(candidate) and better(candidate, best, self.target):
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
        candidate = spec_or_none(
            lambda rho, kv=kv_dtype: spec.replace(budget=rho, kv_dtype=kv), rho, self.lengths
        )
        if candidate is None:
          continue
        point = self.measure(candidate, index, chosen.learned)
        meets = self.target.meets(point)
        if meets and better(point, best or chosen, self.target):
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
      result["meets_target"] = held_meets(self.target, result)
      self.say(f"held out ({len(held_idx)} items), {name}: {result}")
    return held


def choose(learned, plain, baseline, policy, target) -> tuple[Point | None, str]:
  """The learned setting (given where it beats `policy`'s default ranking, `plain`), else
  the best fixed setting; with why, in words: for a quality target the least memory that
  meets it, for a memory target the lowest KL within it. (None, "") when neither meets the
  target."""
  within = target.metric == "memory"
  if learned is not None and (baseline is None or better(learned, baseline, target)):
    if within:
      judged = "(each tuning item judged by an allocation learned without it)"
      return learned, (
          f"{policy} with the learned head allocation has the lowest KL within {limit(target)}"
          f": {at(learned, kl=True)} {judged}, where {policy}'s default ranking "
          + ("fits at no budget tried" if plain is None else f"reaches {at(plain, kl=True)}")
      )
    return learned, (
        f"{policy} with the learned head allocation meets {target} on tuning items (each judged "
        f"by an allocation learned without it) at {at(learned)}, where {policy}'s default ranking needs "
        + ("more than any budget tried" if plain is None else at(plain))
    )
  if baseline is not None:
    if learned is None:
      beaten = f"the learned allocation did not beat {policy}'s default ranking on held-in items"
    elif within:
      beaten = f"{policy} with a learned allocation reaches {at(learned, kl=True)}"
    else:
      beaten = f"{policy} with a learned allocation needs {at(learned)}"
    name = baseline.spec.policy.name
    if within:
      return baseline, (
          f"{beaten}; {name} has the lowest KL within {limit(target)}: {at(baseline, kl=True)}"
      )
    return baseline, f"{beaten}; {name} at {at(baseline)} is the least memory meeting {target}"
  return None, ""


def limit(target: Target) -> str:
  """A memory target as a bound: '8.00 MiB per request'."""
  return f"{target.value / 2**20:.2f} MiB per request"


def at(point: Point, kl: bool = False) -> str:
  """'budget 0.19 (7.91 MiB)', or with `kl` 'KL 0.0408 at budget 0.19 (7.91 MiB)'."""
  where = f"budget {point.spec.budget} ({point.measured.kv_bytes / 2**20:.2f} MiB)"
  return f"KL {point.measured.kl:.4f} at {where}" if kl else where


def spec_or_none(make_spec, rho, lengths):
  """`make_spec(rho)`, or None where its budget is too small for the protected tokens of
  some item (of `lengths` tokens)."""
  try:
    spec = make_spec(rho)
    for length in lengths:
      spec.budget_tokens(length, strict=True)
    return spec
  except ValueError:
    return None


def cost(point: Point, target: Target) -> float:
  """Lower is better: memory for quality targets, KL for a memory target."""
  return point.measured.kl if target.metric == "memory" else point.measured.kv_bytes


def better(a: Point, b: Point, target: Target) -> bool:
  """`a` costs less; within 1% (the same budget, pages rounded apart), the lower KL."""
  ca, cb = cost(a, target), cost(b, target)
  if abs(ca - cb) <= 0.01 * max(abs(cb), 1e-12):
    return a.measured.kl < b.measured.kl
  return ca < cb


def best(points, target: Target) -> Point | None:
  points = [p for p in points if p is not None]
  return min(points, key=lambda p: cost(p, target)) if points else None


def closest(points: Sequence[Point], target: Target) -> Point:
  """The point nearest to meeting the target (lowest KL, or highest accuracy)."""
  if target.metric == "accuracy":
    return max(points, key=lambda p: (p.accuracy, -p.measured.kl))
  if target.metric == "memory":
    return min(points, key=lambda p: p.measured.kv_bytes_bound)
  return min(points, key=lambda p: p.measured.kl)


def pareto(points: Sequence[Point]) -> list[Point]:
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


def held_meets(target: Target, result: dict) -> bool:
  if target.metric == "kl":
    return result["kl"] <= target.value
  if target.metric == "accuracy":
    return result["accuracy"] >= target.value
  return result["kv_bytes_max"] <= target.value
