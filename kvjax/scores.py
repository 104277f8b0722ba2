"""Score primitives (pure jnp): output impact, attention history, entropy, layer change.

Group importance lives with its kernel (`pallas_kernels.group_importance`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


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
