"""How many tokens and pages a cache is sized for: the one home of the capacity buckets, the
eviction margin, the peak a sequence reaches under eviction and the pool a layer needs.
`CompressionSpec.plan` sizes a new cache with it, `kvjax.runtime.pool.fit` grows one with it, and
`CacheConfig` takes its default threshold from it, so the three cannot drift apart.
"""

from __future__ import annotations

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
