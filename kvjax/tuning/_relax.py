"""The differentiable relaxation the tuner learns a head allocation with, and the exact
(hard) evaluation of any allocation, both on precomputed contexts.

A context compressed once keeps, from the full context's K/V, a subset chosen by one ranking
of (transformed) policy scores plus a per-(layer, kv head) offset. Its K/V are those of the
full prefill (nothing is recomputed after eviction), so the continuation's logits under any
keep-mask are one forward pass of the continuation alone, attending to the context's K/V
through a mask. Here the mask is a bias on the attention logits:

  hard:   0 for kept tokens, -inf for evicted ones  (equal to what `kvjax.prefill` keeps,
          up to float reordering; `tests/test_tune.py` compares them)
  soft:   log sigmoid((z + offset[l, h] - tau) / temperature), with `tau` set per context
          so that the expected kept count is the budget

The loss is KL(full cache || masked) on the continuation; its gradient moves the offsets.

A sliding-window layer (Gemma 3's local layers, Mistral's) is as the real cache holds it: a
continuation query at position p sees the context keys past p - window, whatever the
policy; its mask is the window, never a ranking's, and no budget is spent there (as
`kvjax.eviction.evict_once` leaves those layers alone). The full cache's reference is the
same model: its sliding layers see their windows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from kvjax.eviction.budgets import head_budgets
from kvjax.eviction.sliding import in_window

NEG = -1e9  # the logit bias of a dropped token (finite: no inf - inf in gradients)


@dataclasses.dataclass(frozen=True)
class Batch:
  """Items padded to one shape. B items, context N, continuation T (positions scored)."""

  keys: Float[Array, "L B H N D"]  # the full context's cached keys (position-encoded)
  values: Float[Array, "L B H N D"]
  valid: Bool[Array, "B N"]  # live context tokens
  fixed: Bool[Array, "B N"]  # never evicted: marked, sink, recent
  tokens: Int[Array, "B T"]  # the continuation fed after the context (its last token is not)
  positions: Int[Array, "B T"]
  weights: Float[Array, "B T"]  # which predictions count (0: padding, or not scored)
  teacher: Float[Array, "B T V"]  # full-cache log-probabilities of each prediction
  kept: Int[Array, " B"]  # tokens the budget keeps per item, over the full layers and heads
  window: Int[Array, " L"]  # each layer's sliding window (0: a full layer, which policies rank)

  @property
  def full(self) -> Bool[Array, " L"]:
    """The layers that keep the context and that policies compress."""
    return self.window == 0


jax.tree_util.register_dataclass(
    Batch,
    data_fields=[f.name for f in dataclasses.fields(Batch)],
    meta_fields=[],
)


def masked_attend(batch: Batch, bias):
  """An `attend` (see kvjax.seam) over the batch's fixed context [L, B, H, N, D] whose
  tokens carry the logit bias [L, B, H, N], then the new tokens themselves, causally; a
  sliding layer's queries see only the keys inside their window."""
  keys, values = batch.keys, batch.values
  n = keys.shape[3]
  # [B, T, N]: how far each context key (at position j) lies behind each query.
  ctx_behind = batch.positions[:, :, None] - jnp.arange(n)[None, None, :]
  own_behind = batch.positions[:, :, None] - batch.positions[:, None, :]  # [B, T, T]

  def attend(q, k, v, state, layer):
    b, t, hq, d = q.shape
    h = k.shape[2]
    window = batch.window[layer]
    rows = q.reshape(b, t, h, hq // h, d).astype(jnp.float32) * d**-0.5  # [B, T, H, G, D]
    ctx = jnp.einsum("bthgd,bhnd->bhgtn", rows, keys[layer].astype(jnp.float32))
    ctx_seen = in_window(ctx_behind, window)  # [B, T, N]
    ctx = jnp.where(ctx_seen[:, None, None], ctx + bias[layer][:, :, None, None, :], NEG)
    own = jnp.einsum("bthgd,bshd->bhgts", rows, k.astype(jnp.float32))
    own_seen = in_window(own_behind, window)  # [B, T, T]
    own = jnp.where(own_seen[:, None, None], own, NEG)
    top = jax.lax.stop_gradient(jnp.maximum(ctx.max(-1), own.max(-1)))[..., None]
    p_ctx, p_own = jnp.exp(ctx - top), jnp.exp(own - top)
    total = p_ctx.sum(-1) + p_own.sum(-1)  # [B, H, G, T]
    out = jnp.einsum("bhgtn,bhnd->bthgd", p_ctx, values[layer].astype(jnp.float32))
    out = out + jnp.einsum("bhgts,bshd->bthgd", p_own, v.astype(jnp.float32))
    out = out / jnp.moveaxis(total, -1, 1)[..., None]
    return out.reshape(b, t, hq, d).astype(q.dtype), state

  return attend


def continuation_logprobs(graphdef, params, batch: Batch, bias) -> Float[Array, "B T V"]:
  """Log-probabilities of the continuation's predictions with the context masked by `bias`."""
  model = nnx.merge(graphdef, params)
  logits, _ = model.run(batch.tokens, batch.positions, None, masked_attend(batch, bias))
  return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def kl_per_item(teacher, logprobs, weights) -> Float[Array, " B"]:
  """Weighted mean over positions of KL(teacher || logprobs)."""
  kl = jnp.sum(jnp.exp(teacher) * (teacher - logprobs), axis=-1)  # [B, T]
  return (kl * weights).sum(-1) / jnp.maximum(weights.sum(-1), 1e-9)


# ---- masks -------------------------------------------------------------------------------


def full_bias(batch: Batch, num_layers: int, num_heads: int):
  """Everything kept: the full cache."""
  bias = jnp.where(batch.valid, 0.0, NEG)[None, :, None, :]
  return jnp.broadcast_to(bias, (num_layers, *batch.valid.shape[:1], num_heads, bias.shape[-1]))


def hard_keep(
    ranked: Float[Array, "L B H N"], batch: Batch, sharing: str
) -> Bool[Array, "L B H N"]:
  """What a context compressed once keeps: each sequence's count from
  `kvjax.eviction.head_budgets` (the library's own; a budget on the full layers only), then
  its best tokens by the ranking, fixed ones first, ties to the earlier index (as
  `kvjax.eviction.fixed_shape.evict` picks them). A sliding layer keeps what it holds: its
  window is the attention's mask."""
  _, b, h, _ = ranked.shape
  full = batch.full[:, None, None, None]  # [L, 1, 1, 1]
  fixed = jnp.broadcast_to(batch.fixed[None, :, None, :], ranked.shape)
  valid = jnp.broadcast_to(batch.valid[None, :, None, :], ranked.shape)
  per_sequence = batch.kept // (jnp.maximum(batch.full.sum(), 1) * h)  # the spec's budget
  counts = jnp.stack(
      [
          head_budgets(
              ranked[:, i : i + 1],
              fixed[:, i : i + 1],
              valid[:, i : i + 1] & full,
              jnp.where(batch.full, per_sequence[i], 0),
              sharing,
          )[:, 0]
          for i in range(b)
      ],
      axis=1,
  )  # [L, B, H]
  x = jnp.where(fixed & valid, jnp.inf, jnp.where(valid, ranked, -jnp.inf))
  order = jnp.argsort(-x, axis=-1, stable=True)
  rank = jnp.argsort(order, axis=-1)
  return ((rank < counts[..., None]) | ~full) & valid


def soft_log_keep(
    ranked: Float[Array, "L B H N"], batch: Batch, temperature
) -> Float[Array, "L B H N"]:
  """log of a soft keep-mask whose expected kept count per item is its budget: sigmoid of
  (ranked - tau) / temperature, tau found by bisection; fixed tokens (and a sliding layer's)
  kept, invalid dropped.
  The gradient through tau is the implicit one (tau moves so the count stays the budget)."""
  fixed = batch.fixed[None, :, None, :]
  valid = batch.valid[None, :, None, :]
  full = batch.full[:, None, None, None]
  free = valid & ~fixed & full  # a sliding layer's tokens are outside the ranking
  target = batch.kept - jnp.broadcast_to(fixed & valid & full, ranked.shape).sum((0, 2, 3))
  x = jnp.where(free, ranked, 0.0)

  def count(tau):  # [B]
    z = (jax.lax.stop_gradient(x) - tau[None, :, None, None]) / temperature
    return jnp.where(free, jax.nn.sigmoid(z), 0.0).sum((0, 2, 3))

  lo = jnp.where(free, x, jnp.inf).min((0, 2, 3)) - 30.0 * temperature
  hi = jnp.where(free, x, -jnp.inf).max((0, 2, 3)) + 30.0 * temperature
  lo, hi = jax.lax.stop_gradient(lo), jax.lax.stop_gradient(hi)

  def step(_, bounds):
    lo, hi = bounds
    mid = (lo + hi) / 2
    more = count(mid) > target  # keeps too many: raise tau
    return jnp.where(more, mid, lo), jnp.where(more, hi, mid)

  lo, hi = jax.lax.fori_loop(0, 50, step, (lo, hi))
  tau0 = (lo + hi) / 2
  # d tau / d x_i = s'_i / sum s' (implicit function theorem on count(tau) = target).
  slope = jax.lax.stop_gradient(
      jnp.where(free, jax.nn.sigmoid((x - tau0[None, :, None, None]) / temperature), 0.0)
  )
  slope = slope * (1 - slope)
  weighted = (slope * x).sum((0, 2, 3)) / jnp.maximum(slope.sum((0, 2, 3)), 1e-12)
  tau = tau0 + weighted - jax.lax.stop_gradient(weighted)
  log_keep = jax.nn.log_sigmoid((x - tau[None, :, None, None]) / temperature)
  return jnp.where(free, log_keep, jnp.where(valid, 0.0, NEG))


# ---- jitted entry points -----------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("graphdef", "sharing"))
def hard_eval(graphdef, params, batch: Batch, ranked, sharing: str):
  """(KL per item [B], argmax agreement per item [B] (1 when every scored prediction's top
  token is the full cache's), kept tokens per sequence [L, B, H]) under the hard mask."""
  keep = hard_keep(ranked, batch, sharing)
  logprobs = continuation_logprobs(graphdef, params, batch, jnp.where(keep, 0.0, NEG))
  kl = kl_per_item(batch.teacher, logprobs, batch.weights)
  same = (jnp.argmax(logprobs, -1) == jnp.argmax(batch.teacher, -1)) | (batch.weights == 0)
  return kl, same.all(-1), keep.sum(-1)


@functools.partial(jax.jit, static_argnames=("graphdef", "num_layers", "num_heads"))
def teacher_logprobs(graphdef, params, batch: Batch, *, num_layers: int, num_heads: int):
  return continuation_logprobs(graphdef, params, batch, full_bias(batch, num_layers, num_heads))


def relaxed_loss(offsets, graphdef, params, batch: Batch, z, temperature, l2):
  """Mean KL to the full cache under the soft mask of z + offsets (offsets centred: the
  ranking depends only on their differences), plus `l2` x their mean square (a few
  calibration items must not pull the policy's own ranking far)."""
  offsets = centred(offsets, batch.full)
  ranked = z + offsets[:, None, :, None]
  bias = soft_log_keep(ranked, batch, temperature)
  logprobs = continuation_logprobs(graphdef, params, batch, bias)
  square = (offsets**2).sum() / jnp.maximum(batch.full.sum() * offsets.shape[1], 1)
  return kl_per_item(batch.teacher, logprobs, batch.weights).mean() + l2 * square


def centred(offsets: Float[Array, "L H"], full: Bool[Array, " L"]) -> Float[Array, "L H"]:
  """Offsets less their mean over the full layers, 0 on sliding ones (outside every ranking:
  nothing there may drift or pull the mean)."""
  full = full[:, None]
  mean = jnp.where(full, offsets, 0.0).sum() / jnp.maximum(full.sum() * offsets.shape[1], 1)
  return jnp.where(full, offsets - mean, 0.0)


def pad_stack(arrays: list[np.ndarray], axis: int, fill) -> np.ndarray:
  """Stacks arrays on a new leading axis, padding dimension `axis` (of each) to the longest."""
  longest = max(a.shape[axis] for a in arrays)
  out = []
  for a in arrays:
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, longest - a.shape[axis])
    out.append(np.pad(a, pad, constant_values=fill))
  return np.stack(out)
