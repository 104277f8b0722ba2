"""Admission planning for the served batch: what a request needs of it, known once, before
the request waits. No rows, no thread: the engine (`_engine`) admits what `Admission` plans.

`Admission.plan` (the engine's `check`) plans a request once: its prompt encoded, its own
plan (its budget, a fraction resolved on its prompt, its margin), the budget its row keeps,
and the pages its row holds at its peak (`kvjax.cache.sizing.ServedRows`: what its plan
keeps of the prompt, plus its new tokens under its row's budget, or its window on a sliding
layer): `Planned`. A request whose plan could never fit the pool is refused
(`RequestTooLarge`, naming the limit), and one whose spec the batch cannot decode
(`Unservable`, naming the spec's field); `check_servable` refuses a server's spec so, before
any model is loaded.

Protected tokens (a chat's question, `Segment(protected=True)`) are never evicted: a running
policy's row keeps them beside its budget (`row_budget`), and admission counts them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvjax.cache.paged_cache import to_host
from kvjax.cache.sizing import ServedRows, kept_floor
from kvjax.eviction.budgets import NEVER
from kvjax.runtime.prompts import EncodedPrompts, encode_prompts
from kvjax.seam import ModelShape
from kvjax.spec import CachePlan, CompressionSpec


class RequestTooLarge(ValueError):
  """The request's plan could never fit the pool, or passes the rows' length (HTTP 400)."""

  def __init__(self, message: str, field: str):
    super().__init__(message)
    self.field = field


class Unservable(ValueError):
  """A spec the served batch cannot decode, naming the `CompressionSpec` field that makes it
  so: refused when the engine starts (the server's spec: `kvjax serve` names the flag), or
  when a request asks for it (HTTP 400 naming `compression.<field>`)."""

  def __init__(self, field: str, value, reason: str):
    super().__init__(f"{field}={value!r} cannot be served: {reason}")
    self.field, self.value, self.reason = field, value, reason


def check_servable(spec: CompressionSpec) -> None:
  """Raises `Unservable` unless rows of a served batch can decode under `spec` as the
  server's spec, before any model is loaded. A running policy's rows evict each sequence to
  its row's own budget on every full layer (`EvictionPlan.apply` with row budgets): not a
  budget a layer's kv heads share, nor one a schedule spreads over the layers."""
  if not spec.evicts or spec.once:
    return  # the rows keep what their requests hold
  if spec.sharing != "uniform":
    raise Unservable(
        "head_budget",
        spec.sharing,
        "a served row evicts each of its sequences to the row's own budget; a budget its "
        "layer's kv heads share would need one ranking per layer of every row (use 'uniform')",
    )
  if spec.budget_schedule != "uniform":
    raise Unservable(
        "budget_schedule",
        spec.budget_schedule,
        "a served row keeps one budget on every full layer while it decodes, so a schedule "
        "would hold only while the prompt is read (use 'uniform')",
    )


@dataclasses.dataclass(frozen=True)
class Planned:
  """A request as `Admission.plan` planned it, once: admission, the read and the insertion all use
  this. `encoded`: its prompt, encoded; `plan`: its own cache's plan (None: it continues a
  stored context, whose plan it keeps); `row_budget`: the budget its row keeps on the full
  layers while it decodes (None: every token); `pages`: the most pages its row holds at its
  peak, as known before its prompt is read (its reservation until then)."""

  encoded: EncodedPrompts
  plan: CachePlan | None
  row_budget: int | None
  pages: int


@dataclasses.dataclass(frozen=True, eq=False)
class Admission:
  """Plans requests for one served batch (see the module docstring). The engine builds it
  with its model, shape and tokenizer, the server's `spec`, whether its rows evict with that
  spec's policy (`running`), the batch cache's `sink`, `recent`, `group_size` and
  `page_size`, its rows' `sizing`, the tokens a row holds (`max_tokens`), the pool's usable
  pages (`capacity`) and a page's bytes (`page_bytes`)."""

  model: object
  shape: ModelShape
  tokenizer: object
  spec: CompressionSpec
  running: bool
  sink: int
  recent: int
  group_size: int
  page_size: int
  sizing: ServedRows
  max_tokens: int
  capacity: int
  page_bytes: int

  def row_budget(self, spec: CompressionSpec, prompt_tokens: int, protected: int = 0) -> int:
    """The running budget a request's row keeps on the full layers (`NEVER`: all): its
    spec's, or what eviction can always reach beside `protected` tokens where that is more
    (eviction keeps them, the sink and the recent window whatever the budget)."""
    if spec.once or not spec.evicts:
      return NEVER
    # Rows evict with the batch's sink, recent window and groups (the server's spec's).
    floor = kept_floor(self.page_size, self.sink, self.recent, self.group_size, protected)
    return max(spec.budget_tokens(prompt_tokens), floor)

  def _pages_bound(self, request, plan, row_budget, new_tokens: int) -> int:
    """The most pages a request's row holds at its peak, generating `new_tokens`, before its
    prompt is read: what its own `plan` keeps of the prompt at most (`ServedRows`)."""
    sizing, n = self.sizing, request.prompt_tokens
    if request.context is not None:  # the context as kept, and the prompt after it
      held = to_host(request.context.cache.length)[:, 0] + n  # [L, H]
      kept = np.minimum(held, sizing.read_bound(int(held.max()))[:, None])
      return int(sizing.peak_pages(kept, new_tokens, None).sum())
    if plan.eviction is None:  # the full cache
      return int(sizing.peak_pages(sizing.read_bound(n), new_tokens, row_budget).sum())
    cfg = plan.config
    floor = kept_floor(
        cfg.page_size, cfg.sink, cfg.recent, cfg.group_size, request.protected_tokens
    )
    if plan.spec.once:  # budget='auto' plans a budget of the whole prompt: the full cache
      return sizing.once_bound(n, new_tokens, budget=cfg.budget, floor=floor)
    # Read with its own plan: its layers' budgets, its margin (the batch's may be smaller).
    kept = sizing.read_bound(
        n, budgets=plan.eviction.layer_budget, margin_tokens=cfg.margin, floor=floor
    )
    return int(sizing.peak_pages(kept, new_tokens, row_budget).sum())

  def _check_layout(self, spec: CompressionSpec) -> None:
    """`Unservable` unless a request's cache under `spec` can move into this batch's pool."""
    for field in ("kv_dtype", "page_size"):
      if getattr(spec, field) != getattr(self.spec, field):
        raise Unservable(
            field, getattr(spec, field), f"this server's pages have {getattr(self.spec, field)}"
        )

  def _check_spec(self, spec: CompressionSpec) -> None:
    """`Unservable` unless this batch's rows can decode a request under `spec`."""
    check_servable(spec)
    if spec.evicts and not spec.once and (not self.running or spec.policy != self.spec.policy):
      running = self.spec.policy.name if self.running else "no running policy"
      raise Unservable(
          "policy",
          spec.policy.name,
          f"it evicts while decoding, and this server's rows decode with {running}: ask "
          "for that one (any budget), the full cache, or a policy that compresses the "
          "context once",
      )
    try:
      spec.policy.check_model(self.model)  # a learned scorer trained for another model
    except ValueError as err:
      raise Unservable("policy", spec.policy.name, str(err).splitlines()[0]) from None

  def plan(self, request) -> Planned:
    """The plan of `request` (an engine `Request`; its `prompt_tokens` and `protected_tokens`
    set); raises `Unservable` or `RequestTooLarge` (naming the field and the limit), or a
    ValueError, unless it can ever run here."""
    spec = request.spec
    if request.context is None:
      spec.check_context(self.shape.max_context)  # a value out of range first: bad input
      self._check_spec(spec)
    self._check_layout(spec)
    encoded = encode_prompts(
        self.tokenizer,
        [request.prompt],
        chat=False,
        vocab_size=self.shape.vocab_size,
        start=request.context is None,
    )
    request.prompt_tokens = n = int(encoded.lengths[0])
    request.protected_tokens = protected = int(sum(encoded.protected[0]))
    held = n
    if request.context is not None:
      held += int(to_host(request.context.position)[0])  # the row holds the context too
    if held + request.max_tokens > self.max_tokens:
      raise RequestTooLarge(
          f"a prompt of {held} tokens and max_tokens={request.max_tokens} pass the "
          f"{self.max_tokens} tokens a row holds",
          "max_tokens" if held < self.max_tokens else "prompt",
      )
    plan, row_budget = None, None
    if request.context is None:
      # The request's own plan, as `prefill` makes it (the spec's own checks too).
      plan = spec.plan(self.shape, batch=1, longest=n, reserve=0, protected=protected)
      budget = self.row_budget(spec, n, protected)
      row_budget = None if budget >= NEVER else budget
    pages = self._pages_bound(request, plan, row_budget, request.max_tokens)
    if pages > self.capacity:
      # The prompt alone, or only with its new tokens, passes the pool.
      alone = self._pages_bound(request, plan, row_budget, 0)
      raise RequestTooLarge(
          f"the request needs {pages} pages of {self.page_bytes} bytes at its peak; the pool "
          f"holds {self.capacity} (kv_memory {self.capacity * self.page_bytes} bytes)",
          "prompt" if alone > self.capacity else "max_tokens",
      )
    return Planned(encoded, plan, row_budget, pages)
