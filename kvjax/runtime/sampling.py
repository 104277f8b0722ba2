"""Sampling: greedy, or temperature, top-k and top-p. The values are traced: changing them
compiles nothing, except a switch between greedy (temperature 0) and sampling, which the
decode loop compiles once each (greedy leaves the sampler out of the program)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from kvjax._checks import check_int, is_int
from jaxtyping import Array, Float, Int

TOP_K_MAX = 2**31 - 1  # top_k is an int32 of the compiled step
TEMPERATURE_MAX = float(np.finfo(np.float32).max)  # and the temperature a float32
# `jax.random.key(seed)` keeps 32 bits of a seed (without x64): 2**32 would give seed 0's
# key, and a seed past 64 bits fails with an OverflowError deep in jax.
SEED_MAX = 2**32 - 1


def check_seed(seed, name: str = "seed") -> None:
  """ValueError unless `seed` is an int in [0, SEED_MAX], the seeds that give distinct keys
  (`name`: as the caller spells it, e.g. --seed)."""
  if not is_int(seed) or not 0 <= seed <= SEED_MAX:
    raise ValueError(f"{name} must be an int in [0, {SEED_MAX}], got {seed!r}")


@dataclasses.dataclass(frozen=True)
class Sampling:
  """Greedy when temperature == 0; else temperature, then top-k (0 = off), then top-p."""

  temperature: float = dataclasses.field(default=0.0, metadata={"help": "0 = greedy"})
  top_k: int = dataclasses.field(
      default=0, metadata={"help": "keep the k likeliest tokens; 0 = off"}
  )
  top_p: float = dataclasses.field(
      default=1.0, metadata={"help": "keep the smallest set of tokens with this much mass"}
  )

  def __post_init__(self):
    if isinstance(self.temperature, bool) or not (
        isinstance(self.temperature, (int, float)) and self.temperature >= 0
    ):
      raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
    if not self.temperature <= TEMPERATURE_MAX:  # inf (or a larger int) is no float32
      raise ValueError(
          f"temperature must be a finite float32 (<= {TEMPERATURE_MAX:.4g}), got "
          f"{self.temperature!r}"
      )
    check_int("top_k", self.top_k, 0, maximum=TOP_K_MAX, note=" (0 = off)")
    if isinstance(self.top_p, bool) or not (
        isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1
    ):
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

  @property
  def greedy(self) -> bool:
    """Temperature 0: the likeliest token (`greedy_token`), no randomness."""
    return self.temperature == 0

  def arrays(self):
    """Traced (not static) values: changing them does not recompile."""
    values = (np.float32(self.temperature), np.int32(self.top_k), np.float32(self.top_p))
    return tuple(jax.device_put(x) for x in values)  # no eager op: nothing to compile


def greedy_token(logits: Float[Array, "B V"]) -> Int[Array, " B"]:
  """The likeliest token of every row."""
  return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _stochastic(logits, key, temperature, top_k, top_p) -> Int[Array, " B"]:
  """Temperature, then top-k (0 = off), then top-p; each a scalar or one value per row [B, 1]."""
  scaled = logits / jnp.maximum(temperature, 1e-6)
  ranked = jnp.sort(scaled, axis=-1)[:, ::-1]  # [B, V] descending
  v = logits.shape[-1]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
  ranked = jnp.where(jnp.arange(v) < k, ranked, -jnp.inf)
  probs = jax.nn.softmax(ranked, axis=-1)
  # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
  keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p
  cutoff = jnp.take_along_axis(ranked, keep.sum(-1, keepdims=True) - 1, axis=-1)  # [B, 1]
  kept = jnp.where(scaled >= cutoff, scaled, -jnp.inf)
  if key.ndim == 0:
    return jax.random.categorical(key, kept, axis=-1)
  # One key per row (a served batch's requests, each from its own seed).
  return jax.vmap(lambda k, row: jax.random.categorical(k, row))(key, kept)


def sample(logits: Float[Array, "B V"], key, temperature, top_k, top_p) -> Int[Array, " B"]:
  """Greedy when temperature == 0; else temperature, then top-k (0 = off), then top-p."""

  def stochastic(logits):
    return _stochastic(logits, key, temperature, top_k, top_p)

  return jax.lax.cond(temperature > 0, stochastic, greedy_token, logits).astype(jnp.int32)


def sample_rows(
    logits: Float[Array, "B V"],
    key,
    temperature: Float[Array, " B"],
    top_k: Int[Array, " B"],
    top_p: Float[Array, " B"],
) -> Int[Array, " B"]:
  """`sample` with every row's own values (requests of a served batch): a row at
  temperature 0 takes its likeliest token; the sampler runs only if some row samples.
  `key`: one key for the batch, or one per row ([B]: a row's draws depend on its key only)."""
  greedy = greedy_token(logits)

  def stochastic(logits):
    drawn = _stochastic(logits, key, temperature[:, None], top_k[:, None], top_p[:, None])
    return jnp.where(temperature > 0, drawn.astype(jnp.int32), greedy)

  return jax.lax.cond((temperature > 0).any(), stochastic, lambda _: greedy, logits)
