"""`CompressionSpec`: every choice about how a cache is compressed, validated once, and the one
place where a budget becomes pages.

    spec = kvjax.CompressionSpec(policy="h2o", budget=0.25, budget_schedule="pyramid")

The same object drives `kvjax.prefill`, `kvjax.generate`, `kvjax.eval` and the CLI (whose
flags are generated from the fields below, see `kvjax.cli`).
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from kvjax.eviction.allocation import HeadAllocation
from kvjax.cache.config import GROUP_REDUCTIONS, CacheConfig
from kvjax.cache.pages import pages_for, whole_pages
from kvjax.cache.sizing import (
    capacity_bucket,
    layer_pages,
    margin,
    min_budget,
    peak_tokens,
    window_peak,
)
from kvjax._checks import check_int, is_int
from pallas_kernels.page_format import KV_DTYPES
from kvjax.policies import Full, Policy, get_policy
from kvjax.eviction.budgets import BUDGET_SCHEDULES, HEAD_BUDGETS, EvictionPlan, layer_budgets

__all__ = [
    "ATTENTION_IMPLS",
    "AUTO",
    "AUTO_RECENT",
    "COMPRESS_MODES",
    "CachePlan",
    "CompressionSpec",
]

ATTENTION_IMPLS = ("auto", "pallas", "ref")
AUTO = "auto"  # budget="auto": keep what scores above `threshold` (compress-once policies)
AUTO_RECENT = 64  # the recent window of budget="auto" when `recent` is not given
COMPRESS_MODES = ("running", "once")
# The options of a policy that count tokens or positions (kvzip's pass and lookback,
# expected attention's future positions, an observation window, a pooling kernel): each
# sizes a step or an array, so none may pass the model context (`check_context`).
_POLICY_TOKEN_OPTIONS = ("chunk", "lookback", "n_future", "window", "kernel")
# The fields that say how a policy compresses, as opposed to the cache's layout and kernels.
_POLICY_OPTIONS = ("budget", "threshold", "scorer", "allocation", "head_budget", "compress")


def _field(default, help: str, **cli):
  """A spec field; `help` and `cli` options (choices, metavar) generate its CLI flag."""
  return dataclasses.field(default=default, metadata={"help": help, **cli})


@dataclasses.dataclass(frozen=True)
class CompressionSpec:
  """How a KV cache is compressed. Frozen and hashable; every field is checked here, so a
  bad value fails before any model work, with the name the user typed."""

  policy: str | Policy = _field(
      "full", "eviction policy (a name, or a kvjax.policies.Policy); 'full' keeps every token"
  )
  budget: int | float | str | None = _field(
      None,
      "KV tokens kept per sequence (layer x row x kv head), a fraction in (0, 1) of the "
      "longest prompt, or 'auto' (keep what scores above --threshold); required by every "
      "policy but 'full'",
  )
  threshold: float | None = _field(
      None,
      "with budget='auto': keep every token whose score is above this (the kept fraction "
      "then differs per input and per head)",
  )
  budget_schedule: str = _field(
      "uniform", "per-layer budgets with the same mean", choices=BUDGET_SCHEDULES
  )
  compress: str | None = _field(
      None,
      "'running': evict while the prompt is read and during decoding; 'once': read the whole "
      "context, then keep the best tokens by one ranking (head_budget) and decode without "
      "eviction; default per policy ('once' for kvzip, learned, expected_attention)",
      choices=COMPRESS_MODES,
  )
  head_budget: str | None = _field(
      None,
      "how the budget is shared: 'uniform' (every sequence keeps the budget), 'layer' (each "
      "layer's heads share it by one ranking, with a floor per head: AdaKV), 'global' (one "
      "ranking across all layers and heads: KVzip); default 'global' for policies that "
      "compress the context once, else 'uniform'",
      choices=HEAD_BUDGETS,
  )
  scorer: str | None = _field(
      None, "trained scorer directory for policy 'learned' (default: the shipped one)"
  )
  allocation: str | HeadAllocation | None = _field(
      None,
      "a head allocation learned by `kvjax tune` (its directory): per-(layer, kv head) "
      "offsets to the policy's scores before the global ranking of a context compressed once",
  )
  sink: int = _field(4, "first tokens of every sequence, never evicted")
  recent: int | None = _field(
      None, "last tokens of every sequence, never evicted (default budget // 4)"
  )
  page_size: int = _field(16, "tokens per cache page")
  group_size: int | None = _field(
      None, "eviction granularity: 1 (tokens) or page_size (pages); default per policy"
  )
  group_reduce: str = _field(
      "mean", "how token scores combine into a group's importance", choices=GROUP_REDUCTIONS
  )
  fair: bool = _field(False, "every marked segment loses the same fraction of its tokens")
  prefill_chunk: int | None = _field(
      None,
      "prompt tokens per prefill step (eviction runs after each chunk); default 256, or 512 "
      "for a cache that evicts nothing and holds more than 2048 tokens (larger matmuls)",
  )
  attention_impl: str = _field(
      "auto",
      "attention and scoring kernels: Pallas where verified, or the jnp reference",
      choices=ATTENTION_IMPLS,
  )
  kv_dtype: str | None = _field(
      None,
      "K/V storage dtype (default: the model's); int8/int4 store codes with a float16 scale "
      "per group of channels of each token",
      choices=KV_DTYPES,
  )

  def __post_init__(self):
    def fail(msg):
      raise ValueError(f"CompressionSpec: {msg}")

    if not isinstance(self.policy, (str, Policy)):
      raise TypeError(f"CompressionSpec: policy must be a name or a Policy, got {self.policy!r}")
    if self.scorer is not None:
      if self.policy != "learned" and getattr(self.policy, "name", None) != "learned":
        fail(f"scorer={self.scorer!r} is for policy 'learned', not {self.policy!r}")
      if not isinstance(self.scorer, str):
        fail(f"scorer must be a path (str), got {self.scorer!r}")
    object.__setattr__(self, "policy", get_policy(self.policy, scorer=self.scorer))
    for name in ("sink", "page_size", "prefill_chunk"):
      value, low = getattr(self, name), 0 if name == "sink" else 1
      if name == "prefill_chunk" and value is None:
        continue
      if not is_int(value) or value < low:
        fail(f"{name} must be an int >= {low}, got {value!r}")
    if self.recent is not None and (not is_int(self.recent) or self.recent < 0):
      fail(f"recent must be an int >= 0 or None, got {self.recent!r}")
    for name in ("fair",):
      if not isinstance(getattr(self, name), bool):
        fail(f"{name} must be True or False, got {getattr(self, name)!r}")
    for name, choices in (
        ("budget_schedule", BUDGET_SCHEDULES),
        ("group_reduce", GROUP_REDUCTIONS),
        ("attention_impl", ATTENTION_IMPLS),
    ):
      if getattr(self, name) not in choices:
        fail(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
    if self.compress is not None and self.compress not in COMPRESS_MODES:
      fail(f"compress must be one of {COMPRESS_MODES} or None, got {self.compress!r}")
    if self.compress == "running" and self.policy.mode == "once":
      fail(
          f"policy {self.policy.name!r} scores a whole context at once: compress='running' "
          "does not apply"
      )
    if self.head_budget is not None and self.head_budget not in HEAD_BUDGETS:
      fail(f"head_budget must be one of {HEAD_BUDGETS} or None, got {self.head_budget!r}")
    if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
      fail(f"kv_dtype must be one of {KV_DTYPES} or None, got {self.kv_dtype!r}")
    if self.group_size is not None and self.group_size not in (1, self.page_size):
      fail(f"group_size must be 1 or page_size={self.page_size}, got {self.group_size!r}")
    budget = self.budget
    if isinstance(self.policy, Full):
      if self.allocation is not None:
        fail("allocation was given with policy 'full', which keeps every token")
      if budget is not None:
        fail(
            f"budget={budget!r} was given with policy 'full', which keeps every token; "
            "choose an evicting policy (e.g. policy='h2o') or drop the budget"
        )
      return
    if budget is None:
      fail(f"policy {self.policy.name!r} evicts to a budget: give budget= (tokens or a fraction)")
    if budget == AUTO:
      if not self.once:
        fail(
            f"budget='auto' keeps what scores above a threshold once the context is scored: "
            f"policy {self.policy.name!r} evicts while it reads; use compress='once' or "
            "kvzip, learned, expected_attention"
        )
      if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)):
        fail(f"budget='auto' needs threshold= (a number), got {self.threshold!r}")
      if not math.isfinite(self.threshold):
        fail(f"threshold must be finite, got {self.threshold!r}")
    elif self.threshold is not None:
      fail(f"threshold={self.threshold!r} applies only with budget='auto', not budget={budget!r}")
    elif isinstance(budget, str):
      fail(f"budget must be tokens, a fraction in (0, 1) or 'auto', got {budget!r}")
    elif isinstance(budget, float):
      if not 0.0 < budget < 1.0:
        fail(f"a fractional budget must be in (0, 1), got {budget}")
    elif not is_int(budget) or budget < 1:
      fail(f"budget must be a positive int (tokens) or a fraction in (0, 1), got {budget!r}")
    if self.head_budget not in (None, "uniform") and self.group != 1:
      fail(
          f"head_budget={self.head_budget!r} needs token eviction (group_size=1): block "
          "eviction cannot share a budget across heads at page granularity"
      )
    if self.once:
      for name, plain in (("budget_schedule", "uniform"), ("fair", False)):
        if getattr(self, name) != plain:
          fail(
              f"{name}={getattr(self, name)!r} does not apply to policy {self.policy.name!r}: "
              "the context is scored once and head_budget shares the budget"
          )
      if self.group != 1:
        fail(f"policy {self.policy.name!r} evicts single tokens: group_size must be 1")
    elif self.head_budget == "global":
      fail(
          f"head_budget='global' ranks a whole scored context at once: policy "
          f"{self.policy.name!r} evicts while it reads; add compress='once', or use 'layer'"
      )
    if is_int(budget):
      self._check_budget(int(budget), f"budget={budget}")
    self._check_allocation()

  def _check_allocation(self):
    allocation = self.allocation
    if allocation is None:
      return
    if isinstance(allocation, (str, os.PathLike)):
      allocation = HeadAllocation.load(allocation)
      object.__setattr__(self, "allocation", allocation)
    if not isinstance(allocation, HeadAllocation):
      raise TypeError(
          f"CompressionSpec: allocation must be a directory or a HeadAllocation, got "
          f"{type(allocation).__name__}"
      )
    if not (self.once and self.sharing == "global") or self.auto:
      raise ValueError(
          "CompressionSpec: allocation applies to a context compressed once with "
          "head_budget='global' and a budget (not 'auto'); this spec has policy "
          f"{self.policy.name!r}, compress={'once' if self.once else 'running'}, "
          f"head_budget={self.sharing!r}, budget={self.budget!r}"
      )
    if allocation.policy != self.policy.name:
      raise ValueError(
          f"CompressionSpec: the allocation {allocation.path or ''} was learned on policy "
          f"{allocation.policy!r}'s scores, not {self.policy.name!r}'s"
      )

  @property
  def evicts(self) -> bool:
    return not isinstance(self.policy, Full)

  @property
  def auto(self) -> bool:
    """budget='auto': keep the tokens scored above `threshold`."""
    return self.budget == AUTO

  @property
  def sharing(self) -> str:
    """How the budget is shared across layers and heads (`head_budget` or its default)."""
    if self.head_budget is not None:
      return self.head_budget
    return "global" if self.once else "uniform"

  @property
  def once(self) -> bool:
    """The context is read whole, then compressed once (`compress` or the policy's default)."""
    if self.compress is not None:
      return self.compress == "once" and self.evicts
    return self.policy.mode == "once"

  @property
  def group(self) -> int:
    """Eviction granularity in tokens."""
    if self.group_size is not None:
      return self.group_size
    return 1 if self.policy.granularity == "token" else self.page_size

  def replace(self, **changes) -> "CompressionSpec":
    return dataclasses.replace(self, **changes)

  def full_cache(self) -> "CompressionSpec":
    """The full cache with this spec's layout and kernels (page size, chunk, dtype, impl):
    the policy's own options (budget, threshold, scorer, sharing, mode) are dropped."""
    return self.replace(policy="full", **dict.fromkeys(_POLICY_OPTIONS))

  def to_dict(self) -> dict:
    """Plain values (the policy by name, with its options), e.g. for results files."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    out["policy"] = self.policy.spelling
    if self.allocation is not None:
      out["allocation"] = self.allocation.path or "<unsaved allocation>"
    return out

  # ---- the budget, in one place ----------------------------------------------------------

  def budget_tokens(self, length: int, *, strict: bool = False) -> int | None:
    """Tokens kept per sequence for a prompt of `length` tokens (None: the full cache): an
    int budget as given, a fraction of `length` rounded down to whole groups (>= 1 group).
    A fraction of a prompt too short for the protected tokens keeps those (the floor), so a
    spec tuned on long prompts also serves short ones; `strict` raises instead."""
    if not self.evicts or self.auto:
      return None  # 'auto': as many as score above the threshold
    if isinstance(self.budget, float):
      group = self.group
      tokens = max(group, int(self.budget * length) // group * group)
      what = f"budget={self.budget} of a {length}-token prompt ({tokens} tokens)"
      if not strict:
        while tokens < self._floor(tokens):
          tokens += group
      self._check_budget(tokens, what)
      return tokens
    return int(self.budget)

  def recent_tokens(self, budget: int) -> int:
    """The protected recent window at a budget: `recent`, or budget // 4 (whole pages for
    block eviction)."""
    if self.recent is not None:
      return self.recent
    if self.auto:
      return AUTO_RECENT
    if self.group == 1:
      return budget // 4
    return max(self.page_size, budget // 4 // self.page_size * self.page_size)

  def _floor(self, tokens: int) -> int:
    """The least budget that holds the protected sink and recent window of a `tokens` budget."""
    return min_budget(self.page_size, self.sink, self.recent_tokens(tokens), self.group)

  def _check_budget(self, tokens: int, what: str):
    group = self.group
    if group > 1 and tokens % group:
      raise ValueError(
          f"CompressionSpec: {what} must be a multiple of page_size={self.page_size} for "
          f"block eviction (policy {self.policy.name!r}); or use group_size=1"
      )
    floor = self._floor(tokens)
    if tokens < floor:
      raise ValueError(
          f"CompressionSpec: {what} cannot hold the protected sink={self.sink} and recent="
          f"{self.recent_tokens(tokens)} tokens: it needs >= {floor} at group size {group}"
      )

  def check_context(self, max_context: int) -> None:
    """ValueError unless every size this spec gives fits a model of `max_context` tokens.

    The sizes a user gives (a page, a budget in tokens, the protected sink and recent
    window, a prefill chunk, a policy's token options) shape the page tables and the pool
    `plan` makes, so one past the context would size them from the user's number instead
    of the model's: a budget of 10^8 tokens, gigabytes of pool for an 8-token prompt. None
    may pass the context: a sequence never holds more tokens. A policy option whose own
    default passes a tiny model's context (kvzip's 512-token pass, 256 tokens) may go as
    far as that default. `plan` checks this first; `kvjax.generate` and the CLI check it as
    soon as the model is known, before any work."""
    check_int("max_context", max_context)

    def refuse(what: str, value: int, note: str = "") -> None:
      raise ValueError(
          f"CompressionSpec: {what}={value} is larger than the model context of "
          f"{max_context} tokens{note}"
      )

    sizes = {
        "budget": self.budget if is_int(self.budget) else None,  # a fraction: of the prompt
        "page_size": self.page_size,
        "sink": self.sink,
        "recent": self.recent,
        "prefill_chunk": self.prefill_chunk,
    }
    for name, value in sizes.items():
      if value is not None and value > max_context:
        refuse(name, value)
    defaults = {f.name: f.default for f in dataclasses.fields(self.policy) if f.init}
    for name in _POLICY_TOKEN_OPTIONS:
      value, default = getattr(self.policy, name, None), defaults.get(name)
      if is_int(value) and is_int(default) and value > max(max_context, default):
        note = f" and than its default {default}" if default > max_context else ""
        refuse(f"policy {self.policy.name!r} option {name}", value, note=note)

  def _check_request(
      self, max_context: int, batch: int, longest: int, reserve: int, protected: int
  ) -> int:
    """`plan`'s arguments checked against the model context; the reserve clipped to it."""
    self.check_context(max_context)
    check_int("batch", batch)
    check_int("longest", longest, 0)
    check_int("reserve", reserve, 0)
    check_int("protected", protected, 0)
    if longest > max_context:
      raise ValueError(
          f"a prompt of {longest} tokens is longer than the model context {max_context}"
      )
    return min(reserve, max_context - longest)

  def _plan_once(self, shape, batch, longest, reserve, chunk, common, sliding) -> "CachePlan":
    """`plan` for a context compressed once: the whole context is prefilled before it is
    scored, so the pool holds all of it (the session compacts it once the context is
    compressed), with room after the context for one reconstruction pass (a chunk and its
    prompt), in a capacity bucket as the full cache (prompts of new lengths compile nothing
    new); a sliding layer holds its window, and a pass on top of it."""
    ps, budget, h = self.page_size, common["budget"], shape.n_kv_heads
    room = max(reserve, getattr(self.policy, "chunk", 0) + 64)
    capacity = max(
        capacity_bucket(longest + room, ps, shape.max_context),
        whole_pages(max(longest + room, budget + margin(ps, budget) + 1), ps),
    )
    held = np.where(
        sliding > 0,
        pages_for(np.minimum(window_peak(sliding, ps, max(chunk, room)), capacity), ps),
        pages_for(capacity, ps),
    )
    cfg = CacheConfig(max_tokens=capacity, num_pages=batch * h * int(held.sum()) + 1, **common)
    # Observes (its scores fill) but never evicts while the context is read.
    n = shape.n_layers
    eviction = EvictionPlan(self.policy, (budget,) * n, evict=False, impl=self.attention_impl)
    return CachePlan(cfg, eviction, chunk, self)

  def plan(
      self, shape, *, batch: int, longest: int, reserve: int, protected: int = 0
  ) -> "CachePlan":
    """Sizes the cache for `batch` rows whose longest prompt is `longest` tokens, with room
    for `reserve` more tokens per row with the full cache (decode, follow-ups).

    With eviction, page tables hold a layer's budget plus the margin (eviction runs once a
    sequence passes its budget by a sixteenth of it, at least a page: `sizing.margin`) plus
    one prefill chunk, and the pool holds exactly what the budgets allow at that peak.
    Protected tokens are never evicted: a row with more of them (`protected`, the most in
    one row) than the budget keeps them all, so its sequences are sized for them instead;
    and no sequence is sized beyond the request (`longest + reserve`), so the pool never
    exceeds the full cache's.

    Every size comes from the model's context or from a value bounded by it: the spec's
    sizes are checked against it (`check_context`), `longest` may not pass it and `reserve`
    is clipped to it, as `kvjax.prefill` clips it.
    """
    reserve = self._check_request(shape.max_context, batch, longest, reserve, protected)
    ps = self.page_size
    dtype = self.kv_dtype or shape.dtype
    capacity = capacity_bucket(longest + reserve, ps, shape.max_context)
    # 512-token chunks run ~9% faster per token than 256 (larger matmuls) but pad the last
    # chunk by 128 tokens more on average: worth it past 2048 tokens, and only where nothing
    # is evicted while the prompt is read (a running policy evicts after each chunk; a
    # compress-once policy after the whole context). The chunk follows the capacity bucket, so a
    # bucket keeps one set of compiled steps; short prompts need no full-size chunk, and
    # powers of two bound the number of compilations.
    long_chunks = (not self.evicts or self.once) and capacity > 2048
    chunk = self.prefill_chunk or (512 if long_chunks else 256)
    chunk = min(chunk, 1 << (max(longest, 1) - 1).bit_length())
    windows = shape.windows  # sliding layers hold their window, whatever the policy
    if not self.evicts:
      cfg = CacheConfig(
          page_size=ps,
          max_tokens=capacity,
          group_reduce=self.group_reduce,
          dtype=dtype,
          windows=windows,
      )
      return CachePlan(cfg, None, min(chunk, capacity), self)
    if self.auto:  # nominal: nothing is evicted before the whole context is scored
      budget = max(longest, min_budget(ps, self.sink, self.recent_tokens(0), 1))
    else:
      budget = self.budget_tokens(longest)
    group, recent = self.group, self.recent_tokens(budget)
    n, h = shape.n_layers, shape.n_kv_heads
    common = dict(
        page_size=ps,
        budget=budget,
        sink=self.sink,
        recent=recent,
        group_size=group,
        group_reduce=self.group_reduce,
        dtype=dtype,
        windows=windows,
    )
    sliding = np.asarray(windows or (0,) * n)  # [L]: a layer's window, 0 when full
    if self.once:
      return self._plan_once(shape, batch, longest, reserve, chunk, common, sliding)
    # The schedule spreads the budget over the layers that keep the context; a sliding
    # layer holds its window (its entry is the nominal budget, never used to evict).
    full = sliding == 0
    budgets = np.full(n, budget, np.int32)
    floor = min_budget(ps, self.sink, recent, group)
    budgets[full] = layer_budgets(budget, int(full.sum()), self.budget_schedule, group, floor)
    per_head = self.sharing == "layer"
    # Per head, one sequence may take its layer's whole share: H x budget.
    # The margin of the nominal budget (`CacheConfig`'s threshold), per head sharing it.
    margin_tokens = margin(ps, budget) * (h if per_head else 1)
    peak = peak_tokens(int(budgets.max()) * (h if per_head else 1), margin_tokens, chunk, protected)
    request = longest + reserve
    # A sliding layer's sequence holds its window and a chunk before it slides.
    window_peaks = np.minimum(window_peak(sliding, ps, chunk), request) * (sliding > 0)
    capacity = whole_pages(max(peak, int(window_peaks.max())), ps)
    # No sequence holds more than the request's tokens: the pool never exceeds the full
    # cache's for the same batch (short prompts under a large budget), though it holds at
    # least the budgets (`init_cache` checks). `extend` and `decode` grow it when a later
    # request needs more (`kvjax.runtime.pool.fit`).
    peaks = peak_tokens(budgets, margin_tokens, chunk, protected)  # per layer, a sequence's
    pages_per_layer = layer_pages(
        budgets, peaks, heads=h, shared=per_head, page_size=ps, request=request
    )
    window_pages = h * pages_for(window_peaks, ps)
    pages_per_layer = np.where(sliding > 0, window_pages, pages_per_layer)
    num_pages = batch * int(pages_per_layer.sum()) + 1
    cfg = CacheConfig(max_tokens=capacity, num_pages=num_pages, **common)
    eviction = EvictionPlan(
        self.policy,
        tuple(int(b) for b in budgets),
        per_head=per_head,
        fair=self.fair,
        impl=self.attention_impl,
    )
    return CachePlan(cfg, eviction, chunk, self)


@dataclasses.dataclass(frozen=True)
class CachePlan:
  """A spec resolved for one batch: the cache's configuration, the eviction plan (None for
  the full cache) and the prefill chunk. Static: jitted steps specialise on it.

  `config` is the layout a new cache is made with; a `State` keeps `None` there, since its
  cache holds the one copy of the layout (`state.cache.config`), which growth and
  compaction change."""

  config: CacheConfig | None
  eviction: EvictionPlan | None
  chunk: int
  spec: CompressionSpec

  @property
  def impl(self) -> str:
    return self.spec.attention_impl

  @property
  def compresses_after_prefill(self) -> bool:
    """A query-agnostic policy whose context is still to be scored and compressed."""
    return self.eviction is not None and self.spec.once
