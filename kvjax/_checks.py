"""Argument checks shared by the API boundary: one wording for one mistake."""

from __future__ import annotations

import numpy as np


def is_int(value) -> bool:
  """An int or NumPy integer, and not a bool (True is an int to Python, not to a user)."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_int(
    name: str, value, minimum: int = 1, *, maximum: int | None = None, note: str = ""
) -> None:
  """ValueError "`name` must be an int >= `minimum` (`note`)[ and <= `maximum`], got ..."
  unless `value` is."""
  if not is_int(value) or value < minimum or (maximum is not None and value > maximum):
    upper = "" if maximum is None else f" and <= {maximum}"
    raise ValueError(f"{name} must be an int >= {minimum}{note}{upper}, got {value!r}")
