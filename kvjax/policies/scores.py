"""Score primitives (pure jnp): output impact, attention history, entropy, layer change,
expected attention (query moments, the mean future rotation, the expected softmax).

Group importance lives with its kernel (`pallas_kernels.group_importance`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def output_impact(
    probs: Float[Array, "... T"],
    values: Float[Array, "... T D"],
    output: Float[Array, "... D"],
    *,
    eps: float = 1e-6,
) -> Float[Array, "... T"]:
  """Exact change of the attention output when token i is removed and the rest renormalised.

  O^(-i) - O = a_i / (1 - a_i) * (O - v_i), so r_i = a_i / (1 - a_i) * ||v_i - O||_2.
  Lower = safer to evict. `1 - a_i` is clamped to >= eps (a token holding all the weight).
  """
  try:  # leading axes may broadcast (e.g. one V shared by several queries)
    jnp.broadcast_shapes(values.shape[:-1], probs.shape)
    jnp.broadcast_shapes(values.shape[:-2] + values.shape[-1:], output.shape)
  except ValueError:
    raise ValueError(
        f"output_impact: probs {probs.shape}, values {values.shape} and output {output.shape} "
        "must be [..., T], [..., T, D] and [..., D]"
    ) from None
  probs = probs.astype(jnp.float32)
  distance = jnp.linalg.norm(values.astype(jnp.float32) - output[..., None, :], axis=-1)
  return probs / jnp.maximum(1.0 - probs, eps) * distance


def accumulate_history(
    history: Float[Array, "... T"], attention: Float[Array, "... T"], decay: float = 1.0
) -> Float[Array, "... T"]:
  """Attention-score history: s_i <- decay * s_i + a_i (decay 1 = plain accumulation)."""
  if not 0.0 <= decay <= 1.0:
    raise ValueError(f"decay must be in [0, 1], got {decay}")
  return decay * history + attention


def predictive_entropy(logits: Float[Array, "... V"]) -> Float[Array, "..."]:
  """Entropy in nats of softmax(logits): how uncertain the model was at each token."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  p = jnp.exp(logp)
  return -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)  # masked (-inf) logits add 0


def layer_change(
    hidden: Float[Array, "... D"], previous: Float[Array, "... D"], eps: float = 1e-6
) -> Float[Array, "..."]:
  """1 - cos(h^l, h^(l-1)): how much a layer changed a token's hidden state (in [0, 2])."""
  h, p = hidden.astype(jnp.float32), previous.astype(jnp.float32)
  cos = jnp.sum(h * p, -1) / jnp.maximum(
      jnp.linalg.norm(h, axis=-1) * jnp.linalg.norm(p, axis=-1), eps
  )
  return 1.0 - cos


def merge_moments(
    count: Float[Array, " B"],
    mean: Float[Array, "B H D"],
    m2: Float[Array, "B H D D"] | None,
    samples: Float[Array, "B T H D"],
    live: Bool[Array, "B T"],
) -> tuple[Float[Array, " B"], Float[Array, "B H D"], Float[Array, "B H D D"] | None]:
  """Count, mean and centred second moment M2 = sum_t (x_t - mean)(x_t - mean)^T of every
  sample seen so far, merged with the live new `samples` (Chan et al.'s pairwise update).

  Centred moments, not raw sums of x x^T: the covariance M2 / count then involves no
  difference of large sums, which in float32 loses the spread of queries whose mean is
  large. `m2` None: the mean only."""
  per_row = lambda x: x[:, None, None]  # noqa: E731  [B] -> [B, 1, 1]
  weight = live.astype(jnp.float32)  # [B, T]
  samples = samples.astype(jnp.float32)
  new_count = weight.sum(axis=1)  # [B]
  total = count + new_count
  new_mean = jnp.einsum("bt,bthd->bhd", weight, samples) / per_row(jnp.maximum(new_count, 1.0))
  new_share = new_count / jnp.maximum(total, 1.0)  # [B]
  delta = new_mean - mean  # [B, H, D]
  merged_mean = mean + delta * per_row(new_share)
  if m2 is None:
    return total, merged_mean, None
  centred = (samples - new_mean[:, None]) * weight[..., None, None]  # [B, T, H, D]
  new_m2 = jnp.einsum("bthd,bthe->bhde", centred, centred)
  # The spread between the two means: delta delta^T * count * new_count / total.
  between = jnp.einsum("bhd,bhe->bhde", delta, delta) * per_row(count * new_share)[..., None]
  return total, merged_mean, m2 + new_m2 + between


def mean_rotation(
    rotate: Callable[[Array, Array], Array],
    start: Int[Array, " B"],
    num_positions: int,
    head_dim: int,
) -> Float[Array, "B D D"]:
  """Rbar = mean of R_p over p in [start, start + num_positions): the average of the linear
  position encoding `rotate(x [B, T, H, D], positions [B, T])` applies at those positions.

  Column i of R_p is R_p e_i, so rotating every basis vector at every position and averaging
  gives Rbar without knowing how `rotate` works."""
  b = start.shape[0]
  basis = jnp.broadcast_to(
      jnp.eye(head_dim, dtype=jnp.float32), (b, num_positions, head_dim, head_dim)
  )  # [B, T, D (which e_i), D]
  positions = start[:, None] + jnp.arange(num_positions, dtype=start.dtype)  # [B, T]
  columns = rotate(basis, positions).astype(jnp.float32)  # [B, T, i, :] = R_p e_i
  return columns.mean(axis=1).swapaxes(-1, -2)  # [B, D, D]


def expected_attention(
    keys: Float[Array, "B Hkv N D"],
    mean: Float[Array, "B Hq D"],
    cov: Float[Array, "B Hq D D"] | None,
    valid: Bool[Array, "B Hkv N"],
    values: Float[Array, "B Hkv N D"] | None = None,
) -> Float[Array, "B Hkv N"]:
  """The attention a future query q ~ N(mean, cov) of each query head is expected to pay
  each key, averaged over the query heads of its kv head (GQA: head h reads kv head
  h // (Hq / Hkv)), times ||v_j|| when `values` are given.

  For Gaussian q, E[exp(q.k / sqrt(D))] = exp(z) with the expected logit
  z_j = mean.k_j / sqrt(D) + k_j^T cov k_j / (2 D) (the log-normal mean); the score is the
  softmax of z over the sequence's live keys. `cov` None drops the second term. Empty
  slots score 0."""
  b, hkv, n, d = keys.shape
  group = mean.shape[1] // hkv
  keys = keys.astype(jnp.float32)
  mean = mean.reshape(b, hkv, group, d)
  logits = jnp.einsum("bkgd,bknd->bkgn", mean, keys) / math.sqrt(d)  # [B, Hkv, G, N]
  if cov is not None:
    cov = cov.reshape(b, hkv, group, d, d)
    logits += jnp.einsum("bknd,bkgde,bkne->bkgn", keys, cov, keys) / (2 * d)
  # A finite floor, not -inf: a sequence with no live key stays NaN-free (its row is zeroed).
  logits = jnp.where(valid[:, :, None], logits, jnp.finfo(jnp.float32).min)
  probs = jnp.where(valid, jax.nn.softmax(logits, axis=-1).mean(axis=2), 0.0)  # [B, Hkv, N]
  if values is not None:
    probs *= jnp.linalg.norm(values.astype(jnp.float32), axis=-1)
  return probs
