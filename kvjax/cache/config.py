"""Cache configuration: sizes, budget and protection, validated once at construction."""

from __future__ import annotations

import dataclasses

from kvjax.cache.pages import pages_for
from kvjax.cache.sizing import margin, min_budget, window_peak
from pallas_kernels.group_importance import REDUCTIONS as GROUP_REDUCTIONS
from pallas_kernels.page_format import KV_DTYPES


@dataclasses.dataclass(frozen=True)
class CacheConfig:
  """Static description of a paged KV cache.

  Attributes:
    page_size: tokens per physical page.
    max_tokens: logical capacity of one sequence (page-table length x page_size).
    budget: tokens a sequence keeps after eviction; None keeps everything (full cache).
    sink: the first `sink` tokens of every sequence are never evicted.
    recent: the last `recent` tokens of every sequence are never evicted.
    threshold: eviction runs once a sequence holds more than this many tokens;
      defaults to `budget` + a sixteenth of it in whole pages, at least one
      (`kvjax.cache.sizing.margin`), so eviction is amortised over that many new tokens.
    group_size: eviction granularity: `page_size` drops whole pages (a page-table
      operation), 1 drops single tokens and compacts the survivors.
    group_reduce: how token scores combine into a group's importance: mean, sum or max.
    num_pages: physical pool size including the reserved null page 0; None sizes
      the pool so that every sequence can reach `max_tokens` (no eviction) or
      `threshold` plus one chunk (with eviction), see `pool_pages`.
    dtype: storage dtype of K and V: a float dtype, or int8/int4 (quantized pages with a
      float16 scale and zero per group of channels of each token, `pallas_kernels.page_format`).
    windows: per layer, the keys a query of a sliding-window layer sees (itself included),
      0 for a layer that sees every earlier key; empty: every layer full. A sliding layer
      holds only what its window needs: its oldest whole pages are freed as the sequence
      moves on (`kvjax.eviction.slide`), and no policy evicts from it.
  """

  page_size: int = 16
  max_tokens: int = 2048
  budget: int | None = None
  sink: int = 0
  recent: int = 0
  threshold: int | None = None
  group_size: int | None = None
  group_reduce: str = "mean"
  num_pages: int | None = None
  dtype: str = "float32"
  windows: tuple[int, ...] = ()

  def __post_init__(self):
    def fail(msg):
      raise ValueError(f"CacheConfig: {msg}")

    for name in ("page_size", "max_tokens"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        fail(f"{name} must be a positive int, got {value!r}")
    for name in ("sink", "recent"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        fail(f"{name} must be a non-negative int, got {value!r}")
    if self.max_tokens % self.page_size:
      fail(f"page_size={self.page_size} must divide max_tokens={self.max_tokens}")
    if self.dtype not in KV_DTYPES:
      fail(f"dtype must be one of {KV_DTYPES}, got {self.dtype!r}")
    if self.group_reduce not in GROUP_REDUCTIONS:
      fail(f"group_reduce must be one of {GROUP_REDUCTIONS}, got {self.group_reduce!r}")
    group_size = self.page_size if self.group_size is None else self.group_size
    if group_size not in (1, self.page_size):
      fail(f"group_size must be 1 or page_size={self.page_size}, got {self.group_size!r}")
    object.__setattr__(self, "group_size", group_size)
    if isinstance(self.windows, (str, bytes)) or not hasattr(self.windows, "__iter__"):
      fail(f"windows must be a tuple of ints >= 0, got {self.windows!r}")
    windows = tuple(self.windows)
    if not all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in windows):
      fail(f"windows must be a tuple of ints >= 0 (0: a full layer), got {self.windows!r}")
    object.__setattr__(self, "windows", windows)

    if self.budget is None:
      if self.threshold is not None:
        fail(f"threshold={self.threshold} needs a budget (budget=None keeps every token)")
    else:
      if not isinstance(self.budget, int) or isinstance(self.budget, bool) or self.budget <= 0:
        fail(f"budget must be a positive int or None, got {self.budget!r}")
      if self.budget < self.min_budget:
        fail(
            f"budget={self.budget} cannot hold the protected tokens: sink={self.sink}, "
            f"recent={self.recent}, page_size={self.page_size}, group_size={group_size} "
            f"need budget >= {self.min_budget}"
        )
      if group_size > 1 and self.budget % group_size:
        fail(f"group_size={group_size} must divide budget={self.budget} for block eviction")
      threshold = (
          self.budget + margin(self.page_size, self.budget)
          if self.threshold is None
          else self.threshold
      )
      if not isinstance(threshold, int) or isinstance(threshold, bool):
        fail(f"threshold must be an int, got {threshold!r}")
      if not self.budget <= threshold < self.max_tokens:
        fail(
            f"threshold={threshold} must satisfy budget={self.budget} <= threshold < "
            f"max_tokens={self.max_tokens} (room is needed to append before evicting)"
        )
      object.__setattr__(self, "threshold", threshold)
    if self.num_pages is not None and (
        not isinstance(self.num_pages, int)
        or isinstance(self.num_pages, bool)
        or self.num_pages < 2
    ):
      fail(f"num_pages must be an int >= 2 (page 0 is reserved), got {self.num_pages!r}")

  @property
  def max_pages(self) -> int:
    """Page-table length of one sequence."""
    return self.max_tokens // self.page_size

  @property
  def evicts(self) -> bool:
    return self.budget is not None

  @property
  def margin(self) -> int | None:
    """Tokens a sequence may pass its budget by before eviction runs (`threshold - budget`);
    per-layer budgets keep it."""
    return None if self.budget is None else self.threshold - self.budget

  @property
  def min_budget(self) -> int:
    """Smallest budget that eviction can always reach with sink and recent protected."""
    return min_budget(self.page_size, self.sink, self.recent, self.group_size)

  @property
  def sliding(self) -> bool:
    """Whether any layer has a sliding window."""
    return any(self.windows)

  def pages_per_sequence(self, chunk: int = 1, window: int = 0) -> int:
    """Pages one sequence can hold at its peak when appending `chunk` tokens at a time (on
    a layer of that `window`, 0 for a full one)."""
    peak = self.max_tokens if not self.evicts else min(self.threshold + chunk, self.max_tokens)
    if window:
      peak = min(window_peak(window, self.page_size, chunk), self.max_tokens)
    return pages_for(peak, self.page_size)

  def pool_pages(self, num_sequences: int, chunk: int = 1) -> int:
    """Physical pages (null page included) needed by `num_sequences` sequences (spread
    evenly over the layers, when `windows` gives them)."""
    if self.num_pages is not None:
      return self.num_pages
    if not self.windows:
      return num_sequences * self.pages_per_sequence(chunk) + 1
    per_layer = num_sequences // len(self.windows)
    return sum(per_layer * self.pages_per_sequence(chunk, w) for w in self.windows) + 1
