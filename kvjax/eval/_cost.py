"""What a compressed cache costs: prefill time, decode time per token, the share of decode
time spent evicting, and the KV bytes held."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.cache import check_status
from kvjax.generation import DecodeState, EncodedPrompts, _compiled, _decode, plan_cache, prefill
from kvjax.policies import Policy

_GREEDY = (jnp.float32(0.0), jnp.int32(0), jnp.float32(1.0))  # temperature, top_k, top_p
_NO_EOS = jnp.asarray([-1], jnp.int32)  # no id stops a row: every step runs


def _check_positive_int(name, value):
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def decode_cost(
    model,
    context_ids: Sequence[int],
    *,
    policy: str | Policy = "full",
    budget: int | float | None = None,
    decode_steps: int = 32,
    repeats: int = 3,
    seed: int = 0,
    attention_impl: str = "auto",
    **plan_options,
) -> dict:
  """Prefills `context_ids` (one row) under `policy`/`budget`, then times greedy decode.

  Decode runs the generation loop (`kvjax.generation._decode`, no EOS stop) for
  `decode_steps` steps from the prefilled cache, `repeats` times after a warm-up, and
  reports the median. Eviction's cost is timed in the same run against the same loop with
  the eviction off (`EvictionPlan(evict=False)`: the policy still observes), the two
  alternating: `eviction_share` = (with - without) / with, clipped to [0, 1];
  `eviction_ms_per_token` is the raw difference (noise can make it negative).
  `plan_options` go to `plan_cache` (sink, recent, group_size, budget_schedule, ...).

  Returns a dict: policy, context_tokens, budget_tokens (None for "full"), decode_steps,
  decode_ms_per_token, decode_ms_per_token_no_eviction, eviction_ms_per_token,
  eviction_share, eviction_events (eviction events within the timed steps),
  eviction_ms_per_event (an event step's extra time, from the steps run one at a time; None
  without events), eviction_period_steps (decode steps between events once running),
  eviction_share_steady (one event's cost over that period: the long-run share; None without
  events), kv_bytes_peak, kv_bytes_final, prefill_seconds, prefill_compile_seconds,
  decode_compile_seconds.
  """
  config = model.config
  if isinstance(context_ids, (str, bytes)) or not isinstance(context_ids, (Sequence, np.ndarray)):
    raise ValueError(f"context_ids must be a sequence of token ids, got {type(context_ids)}")
  ids = [int(t) for t in np.asarray(context_ids).reshape(-1)] if len(context_ids) else []
  if not ids:
    raise ValueError("context_ids is empty: decode cost needs at least one context token")
  bad = [t for t in ids if not 0 <= t < config.vocab_size]
  if bad:
    raise ValueError(f"context_ids has token ids outside [0, {config.vocab_size}): {bad[:5]}")
  _check_positive_int("decode_steps", decode_steps)
  _check_positive_int("repeats", repeats)
  n = len(ids)
  if n + decode_steps > config.max_context:
    raise ValueError(
        f"context_ids ({n} tokens) + decode_steps ({decode_steps}) exceeds the model context "
        f"{config.max_context}"
    )
  plan = plan_cache(
      model, policy, budget, batch=1, longest=n, max_new_tokens=decode_steps, **plan_options
  )
  if plan.eviction is not None and decode_steps > plan.chunk:
    # Without eviction the cache grows by decode_steps tokens: the pool's slack is a chunk.
    raise ValueError(
        f"decode_steps={decode_steps} exceeds the prefill chunk ({plan.chunk} tokens), the room "
        "the cache has for decoding with eviction off; lower decode_steps"
    )

  encoded = EncodedPrompts([ids], [[False] * n], [[0] * n])
  prefill_key, decode_key = jax.random.split(jax.random.key(seed))
  start = time.perf_counter()
  last_logits, cache, peak, prefill_compile = prefill(
      model, plan, encoded, prefill_key, attention_impl=attention_impl
  )
  prefill_seconds = time.perf_counter() - start - prefill_compile

  def fresh() -> DecodeState:
    """The post-prefill state, copied: `_decode` donates (overwrites) its input."""
    return jax.block_until_ready(
        DecodeState(
            cache=jax.tree.map(jnp.copy, cache),
            logits=jnp.copy(last_logits),
            tokens=jnp.zeros((1, decode_steps), jnp.int32),
            num_generated=jnp.zeros((1,), jnp.int32),
            position=jnp.full((1,), n, jnp.int32),
            done=jnp.zeros((1,), bool),
            stopped=jnp.zeros((1,), bool),
            key=jax.random.clone(decode_key),
            step=jnp.int32(0),
            peak_pages=jnp.asarray(peak, jnp.int32),
        )
    )

  graphdef, state = nnx.split(model)
  limit = jnp.int32(decode_steps)
  plans = {"with": plan.eviction}
  if plan.eviction is not None:
    plans["without"] = dataclasses.replace(plan.eviction, evict=False)
  loops, decode_compile = {}, 0.0
  for name, eviction in plans.items():
    loops[name], seconds = _compiled(
        _decode, graphdef, eviction, attention_impl, state, fresh(), limit, _NO_EOS, _GREEDY
    )
    decode_compile += seconds

  def run(name, steps=limit, decode=None):
    decode = fresh() if decode is None else decode
    begin = time.perf_counter()
    decode = jax.block_until_ready(loops[name](state, decode, steps, _NO_EOS, _GREEDY))
    elapsed = time.perf_counter() - begin
    check_status(decode.cache)
    return decode, elapsed

  times = {name: [] for name in loops}
  for round_ in range(repeats + 1):  # round 0 warms up; the order alternates each round
    for name in list(loops)[:: 1 if round_ % 2 else -1]:
      decode, elapsed = run(name)
      if int(decode.step) != decode_steps:
        raise RuntimeError(f"decode stopped after {int(decode.step)} of {decode_steps} steps")
      if round_:
        times[name].append(elapsed)
      if name == "with":
        final = decode
  ms = {name: 1e3 * statistics.median(t) / decode_steps for name, t in times.items()}
  with_ms = ms["with"]
  without_ms = ms.get("without", with_ms)

  # Step the same loop one step at a time: which steps evict, and what an event costs (the
  # event steps against the others; steadier under load than the loop difference).
  events, per_event = 0, None
  if plan.eviction is not None:
    decode, step_ms, evicted = fresh(), [], []
    for step in range(decode_steps):
      before = np.asarray(decode.cache.length)
      decode, elapsed = run("with", jnp.int32(step + 1), decode)
      step_ms.append(1e3 * elapsed)
      evicted.append(bool((np.asarray(decode.cache.length) < before).any()))  # drops > 1
    events = sum(evicted)
    if 0 < events < decode_steps:
      event_ms = statistics.median(t for t, e in zip(step_ms, evicted) if e)
      per_event = event_ms - statistics.median(t for t, e in zip(step_ms, evicted) if not e)

  # Once running, a sequence passes its threshold every `period` tokens (the margin plus
  # one, in whole groups): the steady-state share spreads one event over that period.
  steady, period = None, None
  if per_event is not None:
    cfg = plan.config
    period = -(-(cfg.threshold - cfg.budget + 1) // cfg.group_size) * cfg.group_size
    cost = max(per_event, 0.0)
    steady = cost / (cost + period * without_ms)
  page_bytes = final.cache.page_bytes
  return {
      "policy": "full" if plan.eviction is None else plan.eviction.policy.name,
      "context_tokens": n,
      "budget_tokens": None if plan.eviction is None else plan.config.budget,
      "decode_steps": decode_steps,
      "decode_ms_per_token": with_ms,
      "decode_ms_per_token_no_eviction": without_ms,
      "eviction_ms_per_token": with_ms - without_ms,
      "eviction_share": float(np.clip((with_ms - without_ms) / with_ms, 0.0, 1.0)),
      "eviction_events": events,
      "eviction_ms_per_event": per_event,
      "eviction_period_steps": period,
      "eviction_share_steady": steady,
      "kv_bytes_peak": int(final.peak_pages) * page_bytes,
      "kv_bytes_final": final.cache.kv_bytes(),
      "prefill_seconds": prefill_seconds,
      "prefill_compile_seconds": prefill_compile,
      "decode_compile_seconds": decode_compile,
  }
