"""What a compressed cache costs: prefill time, decode time per token, the share of decode
time spent evicting, and the KV bytes held."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np

from kvjax.cache.pages import pages_for
from kvjax.runtime.compilation import compile_stats
from kvjax.runtime.session import decode, fork, prefill
from kvjax.spec import CompressionSpec
from kvjax._checks import check_int


def decode_cost(
    model,
    context_ids: Sequence[int],
    spec: CompressionSpec | None = None,
    *,
    decode_steps: int = 32,
    repeats: int = 3,
    seed: int = 0,
) -> dict:
  """Prefills `context_ids` (one row) under `spec`, then times greedy decode.

  Decode runs `kvjax.decode` (no stop token) for `decode_steps` steps from a fork of the
  prefilled state, `repeats` times after a warm-up, and reports the median. Eviction's
  cost is timed in the same run against the same loop with eviction off (`evict=False`:
  the policy still observes), the two alternating: `eviction_share` = (with - without) /
  with, clipped to [0, 1]; `eviction_ms_per_token` is the raw difference (noise can make
  it negative).

  Returns a dict: policy, context_tokens, budget_tokens (None for "full"), decode_steps,
  decode_ms_per_token, decode_ms_per_token_no_eviction, eviction_ms_per_token,
  eviction_share, eviction_events (eviction events within the timed steps),
  eviction_ms_per_event (an event step's extra time: the step before which a sequence passes
  its threshold, run with and without eviction from the same state, medians; None without
  events), eviction_period_steps (decode steps between events once running),
  eviction_share_steady (one event's cost over that period: the long-run share; None without
  events), kv_bytes_peak, kv_bytes_final, prefill_seconds, prefill_compile_seconds,
  decode_compile_seconds.
  """
  spec = CompressionSpec() if spec is None else spec
  ids = _context_ids(model, context_ids, decode_steps)
  check_int("repeats", repeats)
  n = len(ids)
  compiled = compile_stats()
  start = time.perf_counter()
  state = prefill(model, [ids], spec, reserve=decode_steps, seed=seed)
  prefill_compile = compile_stats()["compile_seconds"] - compiled["compile_seconds"]
  prefill_seconds = time.perf_counter() - start - prefill_compile
  plan = state.plan
  if plan.eviction is not None and decode_steps > plan.chunk:
    # Without eviction the cache grows by decode_steps tokens: the pool's slack is a chunk.
    raise ValueError(
        f"decode_steps={decode_steps} exceeds the prefill chunk ({plan.chunk} tokens), the room "
        "the cache has for decoding with eviction off; lower decode_steps"
    )
  timer = _DecodeTimer(model, state, plan.eviction is not None)
  ms, with_state = timer.per_token(decode_steps, repeats)
  with_ms = ms["with"]
  without_ms = ms.get("without", with_ms)
  # Once running, a sequence passes its threshold every `period` tokens (the margin plus
  # one, in whole groups): the steady-state share spreads one event over that period.
  cfg = state.cache.config
  period = (
      None if plan.eviction is None else pages_for(cfg.margin + 1, cfg.group_size) * cfg.group_size
  )
  events, per_event = timer.one_event(decode_steps, repeats, search=period or 0)
  steady = None
  if per_event is not None:
    cost = max(per_event, 0.0)
    steady = cost / (cost + period * without_ms)
  return {
      "policy": spec.policy.name,
      "context_tokens": n,
      "budget_tokens": None if plan.eviction is None else state.cache.config.budget,
      "decode_steps": decode_steps,
      "decode_ms_per_token": with_ms,
      "decode_ms_per_token_no_eviction": without_ms,
      "eviction_ms_per_token": with_ms - without_ms,
      "eviction_share": float(np.clip((with_ms - without_ms) / with_ms, 0.0, 1.0)),
      "eviction_events": events,
      "eviction_ms_per_event": per_event,
      "eviction_period_steps": period,
      "eviction_share_steady": steady,
      "kv_bytes_peak": with_state.peak_kv_bytes(),
      "kv_bytes_final": with_state.kv_bytes(),
      "prefill_seconds": prefill_seconds,
      "prefill_compile_seconds": prefill_compile,
      "decode_compile_seconds": timer.compile_seconds,
  }


def _context_ids(model, context_ids, decode_steps: int) -> list[int]:
  """The context as a list of token ids, checked against the model's vocabulary and its
  context (with `decode_steps` more)."""
  vocab, context = model.config.vocab_size, model.config.max_context
  if isinstance(context_ids, (str, bytes)) or not isinstance(context_ids, (Sequence, np.ndarray)):
    raise ValueError(f"context_ids must be a sequence of token ids, got {type(context_ids)}")
  ids = [int(t) for t in np.asarray(context_ids).reshape(-1)] if len(context_ids) else []
  if not ids:
    raise ValueError("context_ids is empty: decode cost needs at least one context token")
  bad = [t for t in ids if not 0 <= t < vocab]
  if bad:
    raise ValueError(f"context_ids has token ids outside [0, {vocab}): {bad[:5]}")
  check_int("decode_steps", decode_steps)
  if len(ids) + decode_steps + 1 > context:  # + 1: the step-by-step pass warms up on one more
    raise ValueError(
        f"context_ids ({len(ids)} tokens) + decode_steps ({decode_steps}) + 1 exceeds the "
        f"model context {context}"
    )
  return ids


class _DecodeTimer:
  """Times `kvjax.decode` from forks of one prefilled state, with eviction and (when the
  cache evicts) without, alternating so that drift hits both alike."""

  def __init__(self, model, state, evicts: bool):
    self.model, self.state = model, state
    self.variants = {"with": True, **({"without": False} if evicts else {})}
    self.compile_seconds = 0.0

  def run(self, name, steps, start=None):
    """Decodes `steps` tokens from a fork of `start` (the prefilled state by default)."""
    start = self.state if start is None else start
    out, result = decode(self.model, fork(start), steps, evict=self.variants[name], donate=True)
    self.compile_seconds += result.stats["compile_seconds"]
    return out, result

  def per_token(self, decode_steps: int, repeats: int) -> tuple[dict, object]:
    """Median ms per token of each variant over `repeats` runs after a warm-up, and the
    state the evicting run ends in."""
    times = {name: [] for name in self.variants}
    for round_ in range(repeats + 1):  # round 0 warms up; the order alternates each round
      for name in list(self.variants)[:: 1 if round_ % 2 else -1]:
        final, result = self.run(name, decode_steps)
        if result.stats["generated_tokens"][0] != decode_steps:
          raise RuntimeError(
              f"decode stopped after {result.stats['generated_tokens'][0]} of {decode_steps} "
              "steps"
          )
        if round_:
          times[name].append(result.stats["decode_seconds"])
        if name == "with":
          with_state = final
    return {name: 1e3 * statistics.median(t) / decode_steps for name, t in times.items()}, (
        with_state
    )

  def one_event(self, decode_steps: int, repeats: int, search: int = 0) -> tuple[int, float | None]:
    """(eviction events in `decode_steps` steps, ms of one event's step or None). Steps the
    loop one step at a time to find the steps that evict (`search` steps at least: an event
    comes once per margin, which may be longer than the timed window); then times the first
    event's step from the state just before it, with eviction and without, alternating
    `repeats` + 2 times (a single event's time is too noisy to judge a 5% share by)."""
    if "without" not in self.variants:
      return 0, None
    current, evicted, first_event = self.state, [], None
    for _ in range(max(decode_steps, search)):
      following, _ = self.run("with", 1, current)
      shorter = np.asarray(following.cache.length) < np.asarray(current.cache.length)
      evicted.append(bool(shorter.any()))  # an event drops more than the token it adds
      if evicted[-1] and first_event is None:
        first_event = current
      current = following
    if first_event is None:
      return sum(evicted[:decode_steps]), None
    event_s = {"with": [], "without": []}
    for round_ in range(repeats + 3):  # round 0 compiles the one-step loop without eviction
      for name in ("with", "without")[:: 1 if round_ % 2 else -1]:
        _, result = self.run(name, 1, first_event)
        if round_:
          event_s[name].append(result.stats["decode_seconds"])
    per_event = statistics.median(event_s["with"]) - statistics.median(event_s["without"])
    return sum(evicted[:decode_steps]), 1e3 * per_event
