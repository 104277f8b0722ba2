"""Quality of a compressed cache, measured against the full cache on the same text."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.generation import EncodedPrompts, plan_cache, prefill
from kvjax.policies import Policy


@functools.partial(jax.jit, static_argnames=("graphdef", "plan"), donate_argnames="cache")
def _teacher_forced(graphdef, plan, state, cache, tokens, start, key):
  """Feeds `tokens` [B, N] one at a time from position `start`, evicting as generation
  would; returns the next-token logits after each [B, N, V]."""
  model = nnx.merge(graphdef, state)
  b = tokens.shape[0]

  def step(cache, xs):
    token, i = xs
    logits, cache = model(
        token[:, None], jnp.full((b, 1), start + i, jnp.int32), cache, policy=plan and plan.policy
    )
    if plan is not None:
      cache = plan.apply(cache, jax.random.fold_in(key, i))
    return cache, logits[:, 0]

  n = tokens.shape[1]
  cache, logits = jax.lax.scan(step, cache, (tokens.T, jnp.arange(n)))
  return logits.transpose(1, 0, 2), cache


def continuation_logits(
    model, context_ids, continuation_ids, *, policy="full", budget=None, seed=0, **plan_options
):
  """Logits predicting each continuation token [N, V] (the first from the last context
  position), with the context prefilled under `policy`/`budget` and the continuation fed
  teacher-forced; and the peak KV pages held."""
  context_ids, continuation_ids = list(context_ids), list(continuation_ids)
  plan = plan_cache(
      model,
      policy,
      budget,
      batch=1,
      longest=len(context_ids),
      max_new_tokens=len(continuation_ids),
      **plan_options,
  )
  encoded = EncodedPrompts([context_ids], [[False] * len(context_ids)], [[0] * len(context_ids)])
  key = jax.random.key(seed)
  last, cache, peak, _ = prefill(model, plan, encoded, key)
  graphdef, state = nnx.split(model)
  tokens = jnp.asarray([continuation_ids[:-1]], jnp.int32)
  logits, cache = _teacher_forced(
      graphdef, plan.eviction, state, cache, tokens, jnp.int32(len(context_ids)), key
  )
  peak = max(peak, int(cache.pages_in_use().sum()))
  return jnp.concatenate([last, logits[0]], axis=0), peak * cache.page_bytes


def compare_predictions(reference_logits, logits, targets) -> dict:
  """KL(P_ref || P) in nats (mean over positions), top-1 agreement, and the perplexity of
  `targets` under each."""
  ref = jax.nn.log_softmax(jnp.asarray(reference_logits, jnp.float32), axis=-1)
  got = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
  kl = jnp.sum(jnp.exp(ref) * (ref - got), axis=-1)
  top1 = jnp.argmax(ref, -1) == jnp.argmax(got, -1)
  targets = jnp.asarray(targets)[:, None]
  nll_ref = -jnp.take_along_axis(ref, targets, -1).mean()
  nll = -jnp.take_along_axis(got, targets, -1).mean()
  return {
      "kl": float(jnp.maximum(kl, 0.0).mean()),
      "top1": float(top1.mean()),
      "ppl_full": float(jnp.exp(nll_ref)),
      "ppl": float(jnp.exp(nll)),
  }


def fidelity(
    model,
    tokenizer,
    context_ids: Sequence[int],
    continuation_ids: Sequence[int],
    *,
    policy: str | Policy = "full",
    budget: int | float | None = None,
    reference_logits=None,
    **plan_options,
) -> dict:
  """Full cache vs compressed cache on the same text.

  The context is prefilled with compression; the continuation is then fed teacher-forced
  (decode-time eviction applies). Over the continuation predictions (including the first,
  from the last context position) returns `kl` = mean KL(P_full || P_compressed) in nats,
  `top1` agreement, `ppl_full` and `ppl` of the continuation tokens, and `peak_kv_bytes`.
  Pass `reference_logits` (from `continuation_logits` with the full cache) to reuse them.
  """
  del tokenizer  # ids are given; kept in the signature for the text-level helpers
  if len(context_ids) < 1 or len(continuation_ids) < 1:
    raise ValueError(
        f"fidelity needs a non-empty context and continuation, got {len(context_ids)} and "
        f"{len(continuation_ids)} tokens"
    )
  if reference_logits is None:
    reference_logits, _ = continuation_logits(model, context_ids, continuation_ids, **plan_options)
  logits, peak = continuation_logits(
      model, context_ids, continuation_ids, policy=policy, budget=budget, **plan_options
  )
  result = compare_predictions(reference_logits, logits, np.asarray(continuation_ids))
  result["peak_kv_bytes"] = peak
  return result
