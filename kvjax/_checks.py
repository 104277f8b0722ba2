"""Argument checks shared by the API boundary: one wording for one mistake."""

from __future__ import annotations

import numpy as np


def is_int(value) -> bool:
  """An int or NumPy integer, and not a bool (True is an int to Python, not to a user)."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int = 1, *, note: str = "") -> None:
  """ValueError "`name` must be an int >= `minimum` (`note`), got ..." unless `value` is."""
  if not is_int(value) or value < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}{note}, got {value!r}")
