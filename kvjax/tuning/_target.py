"""What a tuned setting must meet (`Target`: a KL, an accuracy or a memory bound) and how a
measured point is judged against it."""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from kvjax._checks import check_int

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

  def meets(self, point) -> bool:
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
