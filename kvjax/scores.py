"""Score primitives (pure jnp). They are the specification the Pallas kernels must match."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from kvjax.config import GROUP_REDUCTIONS


def group_importance(
    token_scores: Float[Array, "... T"],
    group_size: int,
    protected: Bool[Array, "... T"],
    reduce: str = "mean",
) -> Float[Array, "... G"]:
  """Reduces token scores to one importance per group of `group_size` consecutive tokens.

  Groups that contain a protected token get +inf, so no eviction ever selects them.
  """
  if not isinstance(group_size, int) or group_size <= 0:
    raise ValueError(f"group_size must be a positive int, got {group_size!r}")
  t = token_scores.shape[-1]
  if t % group_size:
    raise ValueError(f"group_size={group_size} must divide the token axis T={t}")
  if protected.shape != token_scores.shape:
    raise ValueError(
        f"protected shape {protected.shape} != token_scores shape " f"{token_scores.shape}"
    )
  if reduce not in GROUP_REDUCTIONS:
    raise ValueError(f"reduce must be one of {GROUP_REDUCTIONS}, got {reduce!r}")
  grouped = token_scores.reshape(*token_scores.shape[:-1], t // group_size, group_size)
  # Protected tokens may hold NaN/garbage (e.g. unused slots); keep them out of the reduction.
  grouped_protected = protected.reshape(grouped.shape).any(-1)
  grouped = jnp.where(protected.reshape(grouped.shape), 0.0, grouped)
  value = {"mean": jnp.mean, "sum": jnp.sum, "max": jnp.max}[reduce](grouped, axis=-1)
  return jnp.where(grouped_protected, jnp.inf, value.astype(jnp.float32))
