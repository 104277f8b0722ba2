"""How many tokens and pages a cache is sized for: the one home of the capacity buckets, the
eviction margin, the peak a sequence reaches under eviction, the pool a layer needs and the
pages a request takes in a served batch's pool (`ServedRows`). `CompressionSpec.plan` sizes a
new cache with it, `kvjax.runtime.pool.fit` grows one with it, `CacheConfig` takes its
default threshold from it and the serving engine admits requests by it, so they cannot
drift apart.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.cache.pages import pages_for, whole_pages

BUCKET_TOKENS = 2048  # capacities are multiples of this (bounded by the model context)


def capacity_bucket(tokens: int, page_size: int, max_context: int) -> int:
  """The capacity a full cache gets for `tokens`: a multiple of `BUCKET_TOKENS`, in whole
  pages, at most the model context (rounded to a page). Capacities shape the compiled
  steps: a service sees four per model of 8192 tokens, and a first request of any length
  up to 2048 compiles the steps of all the others (on a 2-core CPU a bucket's steps take
  ~2 s to compile, a 480-token prompt ~0.4 s to read). Attention reads only the live
  pages (prefill: the live blocks; decode: the narrowest power-of-two prefix of the table
  that holds them), so the padding costs memory (under `BUCKET_TOKENS` tokens per
  sequence), not time."""
  size = whole_pages(max(tokens, 1), BUCKET_TOKENS)
  return min(whole_pages(size, page_size), whole_pages(max_context, page_size))


def growth_room(more: int, capacity: int) -> int:
  """Tokens per sequence a full cache makes room for when it grows to hold `more`: at least
  half of what it holds now, so growth (new shapes, compiled once) is rare."""
  return max(more, capacity // 2)


MARGIN_SHARE = 16  # eviction runs once per budget / MARGIN_SHARE new tokens


def margin(page_size: int, budget: int) -> int:
  """Tokens a sequence may pass its budget by before eviction runs: a sixteenth of the
  budget in whole pages, at least one page. An event ranks and moves every kept token, so
  its cost grows with the budget; so does the number of new tokens it is amortised over,
  and eviction's share of a decode step stays flat (one page at every budget made it 5-6 %
  of a step at budget 1024)."""
  return max(1, budget // (MARGIN_SHARE * page_size)) * page_size


def peak_tokens(budget, margin_tokens, chunk: int, floor=0):
  """Tokens a sequence holds at its peak under eviction: its budget (or `floor`, tokens
  eviction cannot remove: protected tokens, or what it holds already), the margin its
  cache evicts at (`CacheConfig.margin`), and one chunk appended before eviction runs.
  Ints or NumPy arrays."""
  peak = np.maximum(budget, floor) + margin_tokens + chunk
  return int(peak) if np.ndim(peak) == 0 else peak


def passed_pages(length, window, page_size: int):
  """Leading pages of a sliding layer's sequence of `length` tokens that hold none of the
  `window - 1` latest (the ones a next query sees besides itself): what `slide` frees.
  Ints, NumPy or jax arrays (a window > 0)."""
  past = length - (window - 1)
  return past * (past > 0) // page_size


def window_peak(window, page_size: int, chunk: int):
  """Tokens a sliding layer's sequence holds at its peak: the `window - 1` latest a next
  query sees besides itself, up to a page more (whole pages are freed: `slide`), and one
  chunk appended before they are. Ints or NumPy arrays."""
  return window - 1 + page_size - 1 + chunk


def layer_pages(budget, peak, *, heads: int, shared: bool, page_size: int, request: int):
  """Pages one row's layer needs at its peak, for a sequence's `budget` and its `peak`
  tokens (`peak_tokens`; ints, or NumPy arrays of one per layer): each of its `heads`
  sequences at its own peak (`shared`: the heads share the layer's `heads x budget` tokens,
  so the pages are counted over the layer, plus a partly filled page per head), and never
  more than the request (`request` tokens per sequence, at least the budget): the pool never
  exceeds the full cache's for the same batch."""
  evicting = heads * pages_for(peak, page_size) + (heads if shared else 0)
  return np.minimum(evicting, heads * pages_for(np.maximum(request, budget), page_size))


def held_pages_bound(
    length: int, budget: int | None, *, sequences: int, page_size: int, once: bool
) -> int:
  """Most pages `sequences` sequences hold once a context of `length` tokens is read: all
  of it without a budget; a context compressed once keeps `budget x sequences` tokens in
  all, each sequence rounding up by less than a page; a running policy lets each sequence
  pass its budget by the margin before it evicts."""
  if budget is None:
    return sequences * pages_for(length, page_size)
  if once:
    return (budget * sequences + sequences * (page_size - 1)) // page_size
  return sequences * pages_for(budget + margin(page_size, budget), page_size)


def compacted_pages(need: int, bound: int) -> int:
  """Pages a pool compacted to a context compressed once gets for the `need` of one
  request: `bound`, the most its plan lets it hold (`held_pages_bound` + the reserve),
  whenever the need fits, so that every request of a plan has one pool size and its decode
  loop compiles once (an exact fit compiled one per request: ~3 s each on a 2-core CPU);
  past the bound (protected tokens beyond the budget, a shard whose kv heads took more than
  their share; a bound of 0: none), the need rounded up to an eighth of the bound."""
  if need <= bound:
    return bound
  step = max(1, bound // 8)
  return -(-need // step) * step


def min_budget(page_size: int, sink: int, recent: int, group_size: int) -> int:
  """Smallest budget eviction can always reach with the sink and recent tokens protected."""
  if group_size == 1:
    return max(1, sink + recent)
  # Block eviction keeps every page that touches the sink or the recent window, plus the
  # partially filled tail page.
  return (pages_for(sink, page_size) + pages_for(recent, page_size) + 1) * page_size


def full_cache_bytes(lengths, windows, *, kv_heads: int, page_size: int, page_bytes: int) -> int:
  """Bytes of K/V the full cache holds after reading `lengths` tokens per row (ints): every
  kv head of a full layer (window 0) holds them all, a sliding layer what its window has not
  passed (`passed_pages`), in whole pages of `page_bytes` (K and V of one kv head's page), as
  `PagedKVCache.kv_bytes` counts them: what compression's savings are measured against."""
  total = 0
  for n in np.asarray(lengths, np.int64).reshape(-1):
    for window in windows:
      held = n - passed_pages(n, window, page_size) * page_size if window else n
      total += pages_for(int(held), page_size)
  return int(total) * kv_heads * page_bytes


# ---- a request in a served batch (kvjax.serving) ------------------------------------------


def kept_floor(page_size: int, sink: int, recent: int, group_size: int, protected: int = 0) -> int:
  """Tokens a sequence holds however it evicts: its sink, its recent window and its
  `protected` tokens, in whole groups (one group more for a protected span that starts
  mid-group)."""
  floor = min_budget(page_size, sink, recent, group_size)
  if protected and group_size > 1:
    return floor + (pages_for(protected, group_size) + 1) * group_size
  return floor + protected


_KEEPS_ALL = np.iinfo(np.int32).max // 2  # a threshold no sequence passes (eviction's NEVER)


@dataclasses.dataclass(frozen=True)
class ServedRows:
  """The pages a request takes in the pool of a served batch (`kvjax.serving`): the one
  count that admission reserves, the engine checks and the batch enforces.

  A request is read (prefilled) in a cache of its own, with its own plan, then inserted into
  a row of the pool holding what it kept, and decodes there one token a step: each step
  appends before the layer cuts the sequence back, a full layer by the batch's eviction once
  it passes the row's budget and the batch's `margin` (tokens), a sliding layer (a window > 0
  in `windows`, [L]) by freeing the pages its window passed. What the row holds at its peak
  is what it needs."""

  windows: tuple[int, ...]
  kv_heads: int
  page_size: int
  margin: int  # 0 where the batch evicts nothing

  def thresholds(self, row_budget: int | None) -> np.ndarray:
    """[L] the most tokens a sequence holds between two decode steps: on a full layer the
    row's budget and the margin (`row_budget` None: the row keeps every token), on a
    sliding layer its window's latest tokens and up to a page more."""
    windows = np.asarray(self.windows, np.int64)
    full = _KEEPS_ALL if row_budget is None else row_budget + self.margin
    return np.where(windows > 0, window_peak(windows, self.page_size, 1) - 1, full)

  def peak_pages(self, kept, new_tokens: int, row_budget: int | None) -> np.ndarray:
    """[L, H] pages each sequence holds at its peak, inserted holding `kept` tokens ([L, H],
    or [L] for every kv head) and generating up to `new_tokens`. The step that passes a
    threshold holds one token more than it, and so does the first step of a sequence
    inserted above it (a prompt read with a larger margin, or budget, than the row's)."""
    kept = np.asarray(kept, np.int64)
    kept = np.broadcast_to(
        kept[:, None] if kept.ndim == 1 else kept, (len(self.windows), self.kv_heads)
    )
    cap = np.maximum(kept, self.thresholds(row_budget)[:, None]) + 1
    return pages_for(np.minimum(kept + new_tokens, cap), self.page_size)

  def read_bound(
      self, prompt: int, *, budgets=None, margin_tokens: int = 0, floor: int = 0
  ) -> np.ndarray:
    """[L] the most tokens a sequence of each layer holds once a prompt of `prompt` tokens is
    read in chunks: all of them where nothing evicts (`budgets` None); under a running
    policy, which evicts after a chunk once a sequence passes its layer's budget (`budgets`,
    [L]) and the reading plan's `margin_tokens`, back to the budget or to `floor` (what it
    cannot evict: `kept_floor`), the budget and that margin, or the floor; on a sliding
    layer, which slides after each chunk, its window's latest tokens and up to a page more."""
    windows = np.asarray(self.windows, np.int64)
    if budgets is None:
      full = np.full(windows.shape, prompt, np.int64)
    else:
      full = np.maximum(np.asarray(budgets, np.int64) + margin_tokens, floor)
    sliding = window_peak(windows, self.page_size, 1) - 1
    return np.minimum(prompt, np.where(windows > 0, sliding, full))

  def once_bound(self, prompt: int, new_tokens: int, *, budget: int, floor: int) -> int:
    """Pages a row holds at its peak, at most, for a prompt of `prompt` tokens compressed
    once when read, before it is read: its full layers' sequences keep `budget` tokens each
    on average (a ranking shared across them may give one more and another less, so they
    are counted together, with a partly filled page each), or `floor` each where that is
    more, and grow by `new_tokens` each, keeping them; a sliding layer's hold its window.
    Never more than the full cache's."""
    every = self.peak_pages(self.read_bound(prompt), new_tokens, None)
    sliding = np.asarray(self.windows) > 0
    full = int((~sliding).sum()) * self.kv_heads
    kept = pages_for(full * (max(budget, floor) + new_tokens), self.page_size) + full
    return min(int(every.sum()), int(every[sliding].sum()) + kept)
