"""How long a tune has left, said as it goes ("about 12 min left").

A tune's steps take very different times (scoring every item, the budget search, learning
an allocation, quantized pages, the held-out check), and how many measurements a step makes
is only known as it makes them (bisection stops early). So the estimate comes from the share
of a whole run each step took in a recorded default run, scaled by this run's own elapsed
time: the share of the work done so far is the shares of the finished steps plus the
current step's share times its own progress (items scored, when it has a count)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

# Each step's seconds in the default `kvjax tune` (SmolLM2-135M-Instruct, the shipped text,
# 24 items; kvzip, expected_attention, snapkv, h2o; int8 and int4 pages), measured on a
# 2-core AMD EPYC CPU shared with other work (load average 1.4-4.3), 2026-12-07: 30.8 min in
# all (`timing` in its tuned.json). Only their ratios matter: the ratios of an earlier run
# estimated that run's time left at each step's start within 30 %. A load that changes as
# a run goes makes it worse (one under load 5-9 took 87 min, its steps 1.0-4.5x as long).
STEP_SECONDS = {
    "calibrate": 478.3,
    "fixed": 231.6,
    "learn": 290.8,
    "kv_dtype": 487.9,
    "held_out": 357.6,
}
STEPS = tuple(STEP_SECONDS)
FIRST_ESTIMATE_AT = 0.04  # of the work: the first item's time is mostly compilation
EVERY_S = 120.0  # between estimates inside one step


class Clock:
  """Says, through `say`, about how long the run has left: at each step's start and, inside
  a step with a count (`advance`), once enough is done to extrapolate, then every `every_s`
  seconds. `steps`: the steps this run has, in order (some of `seconds`' keys, each step's
  time in a recorded run)."""

  def __init__(
      self,
      say: Callable[[str], None],
      steps: Sequence[str] = STEPS,
      *,
      now: Callable[[], float] = time.perf_counter,
      every_s: float = EVERY_S,
      seconds: Mapping[str, float] = STEP_SECONDS,
  ):
    if not steps or any(s not in seconds for s in steps):
      raise ValueError(f"steps must be some of {list(seconds)}, got {list(steps)}")
    self._say, self._now, self._every_s = say, now, every_s
    total = sum(seconds[s] for s in steps)
    self._shares = {s: seconds[s] / total for s in steps}
    self._order = list(steps)
    self._started = now()
    self._done = 0.0  # share of the work in the steps before the current one
    self._current: str | None = None
    self._last_said: float | None = None

  def step(self, name: str) -> None:
    """`name` begins: every step before it is finished (or skipped: a target no setting
    meets tries no quantized pages). Says the estimate from the second step on (the first
    has nothing measured yet)."""
    if name not in self._shares:
      raise ValueError(f"step must be one of {self._order}, got {name!r}")
    self._done = sum(self._shares[s] for s in self._order[: self._order.index(name)])
    self._current = name
    if self._done > 0:
      self._tell(self._done)

  def advance(self, done: int, total: int) -> None:
    """`done` of the current step's `total` units are finished."""
    if self._current is None or total <= 0:
      return
    fraction = self._done + self._shares[self._current] * min(done / total, 1.0)
    due = self._last_said is None or self._now() - self._last_said >= self._every_s
    if fraction >= FIRST_ESTIMATE_AT and due:
      self._tell(fraction)

  def left_s(self, fraction: float) -> float:
    """Seconds left when `fraction` of the work is done: the elapsed time scaled by what
    remains."""
    elapsed = self._now() - self._started
    return elapsed * (1.0 - fraction) / max(fraction, 1e-9)

  def _tell(self, fraction: float) -> None:
    self._last_said = self._now()
    self._say(f"{about(self.left_s(fraction))} left (estimated from the time so far)")


def about(seconds: float) -> str:
  """'under a minute', 'about 1 min', 'about 12 min'."""
  if seconds < 60:
    return "under a minute"
  return f"about {round(seconds / 60)} min"
