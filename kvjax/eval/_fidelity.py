"""Quality of a compressed cache, measured against the full cache on the same text."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.runtime.session import decode, prefill
from kvjax.spec import CompressionSpec


def full_cache_spec(spec: CompressionSpec) -> CompressionSpec:
  """The reference: the full cache with the same layout and kernels as `spec`, its K/V in
  the model's own dtype (so a quantized or bfloat16 cache is judged with what it loses)."""
  return spec.full_cache().replace(kv_dtype=None)


def continuation_logits(
    model,
    context_ids,
    continuation_ids,
    spec: CompressionSpec,
    *,
    tokenizer=None,
    seed=0,
    stats: dict | None = None,
):
  """Logits predicting each continuation token [N, V] (the first from the last context
  position), with the context prefilled under `spec` and the continuation fed
  teacher-forced (decode-time eviction applies); and the peak KV bytes held. `tokenizer`
  is for policies that prompt the model themselves (kvzip's reconstruction prompt).
  `stats`, if given, receives `kept_fraction`: the share of the context's K/V entries
  (over layers and kv heads) still cached after prefill, and `kv_bytes`: the K/V bytes the
  state holds then."""
  context_ids, continuation_ids = list(context_ids), list(continuation_ids)
  state = prefill(
      model, [context_ids], spec, tokenizer=tokenizer, reserve=len(continuation_ids), seed=seed
  )
  if stats is not None:
    lengths = np.asarray(state.cache.length)
    read = int(state.position[0])  # context tokens read (ids, or Segments' tokens)
    stats["kept_fraction"] = float(lengths.sum() / (lengths.size * read))
    stats["kv_bytes"] = state.kv_bytes()
  first = state.logits
  if len(continuation_ids) == 1:
    return first, state.peak_kv_bytes()
  forced = jnp.asarray([continuation_ids[:-1]], jnp.int32)
  # Each forced token's logits are those it was predicted from; the state's final logits
  # predict the last continuation token.
  state, result = decode(
      model, state, forced.shape[1], forced=forced, return_logits=True, donate=True
  )
  logits = jnp.concatenate([result.logits[0], state.logits], axis=0)
  return logits, state.peak_kv_bytes()


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
    context_ids: Sequence[int],
    continuation_ids: Sequence[int],
    spec: CompressionSpec,
    *,
    reference_logits=None,
    tokenizer=None,
) -> dict:
  """Full cache vs compressed cache on the same text.

  The context is prefilled with compression; the continuation is then fed teacher-forced
  (decode-time eviction applies). Over the continuation predictions (including the first,
  from the last context position) returns `kl` = mean KL(P_full || P_compressed) in nats,
  `top1` agreement, `ppl_full` and `ppl` of the continuation tokens, `peak_kv_bytes`,
  `kept_fraction` and `kv_bytes` (held once the context is read, scales included; see
  `continuation_logits`).
  Pass `reference_logits` (from `continuation_logits` with the full cache) to reuse them.
  """
  if len(context_ids) < 1 or len(continuation_ids) < 1:
    raise ValueError(
        f"fidelity needs a non-empty context and continuation, got {len(context_ids)} and "
        f"{len(continuation_ids)} tokens"
    )
  if reference_logits is None:
    reference_logits, _ = continuation_logits(
        model, context_ids, continuation_ids, full_cache_spec(spec)
    )
  kept = {}
  logits, peak = continuation_logits(
      model, context_ids, continuation_ids, spec, tokenizer=tokenizer, stats=kept
  )
  result = compare_predictions(reference_logits, logits, np.asarray(continuation_ids))
  result["peak_kv_bytes"] = peak
  result["kept_fraction"] = kept["kept_fraction"]
  result["kv_bytes"] = kept["kv_bytes"]
  return result
