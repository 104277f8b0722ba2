"""How K/V values are stored in a page: as floats, or as 8- or 4-bit codes with a float scale
and zero point per group (issue 33's quantized pages; this module is their codec).

A group is a run of values quantized together, asymmetric min/max:

    scale = (max - min) / (2**bits - 1)      zero = min
    code  = round((x - zero) / scale)        x ~= zero + code * scale  (error <= scale / 2)

Pages group per token (`quantize_tokens`: the channels of one token, in groups of `group`
channels), so a token's codes and scales move with it: eviction, compaction, saving and
sharding never re-quantize. Key outliers sit in a few channels (KIVI, KVQuant); instead of
grouping keys per channel over a page's tokens, which token eviction would have to
re-quantize at every event, keys are first divided by a per-sequence factor per channel
(`smoothing`), which attention folds into the query. `docs/results/issue33` measured the
choices: int8 KL 0.00012 smoothed vs 0.00032 per channel; int4 0.017 smoothed in groups
of 16 channels vs 0.068 per channel.

A group whose values are all equal has scale 0 and is exact. A NaN or an infinity in a
group makes the whole group NaN when read back, so a broken model is never turned into
plausible numbers. 4-bit codes are packed two to a byte along the last axis (low nibble
first).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, UInt8

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
QUANTIZED_DTYPES = ("int8", "int4")


@dataclasses.dataclass(frozen=True)
class Quantized:
  """Codes of a group of values and the (scale, zero) that read them back. `axis` is the
  axis the groups run along in the unpacked codes (scale and zero lack it)."""

  codes: UInt8[Array, "..."]  # unpacked: one code per value, in [0, 2**bits)
  scale: Float[Array, "..."]
  zero: Float[Array, "..."]


def bits_of(kv_dtype: str) -> int:
  """Bits per stored code of a quantized K/V dtype."""
  if kv_dtype not in QUANTIZED_DTYPES:
    raise ValueError(f"kv_dtype must be one of {QUANTIZED_DTYPES}, got {kv_dtype!r}")
  return 8 if kv_dtype == "int8" else 4


def quantize(
    x: Float[Array, "..."], bits: int, axis: int, valid: Bool[Array, "..."] | None = None
) -> Quantized:
  """Asymmetric min/max quantization of `x` in groups along `axis`. `valid` (broadcast
  against `x`) leaves values out of their group's range (the free slots of a page); their
  codes are clipped into range and mean nothing."""
  x = x.astype(jnp.float32)
  levels = (1 << bits) - 1
  if valid is None:
    lo, hi = x.min(axis=axis), x.max(axis=axis)
  else:
    valid = jnp.broadcast_to(valid, x.shape)
    empty = ~valid.any(axis=axis)  # a group of free slots only: (0, 0)
    # jnp.min/max propagate NaN: a NaN among a group's valid values makes it NaN.
    lo = jnp.where(empty, 0.0, jnp.where(valid, x, jnp.inf).min(axis=axis))
    hi = jnp.where(empty, 0.0, jnp.where(valid, x, -jnp.inf).max(axis=axis))
  scale = (hi - lo) / levels
  step = jnp.where(scale > 0, scale, 1.0)  # a constant group: every code 0, exact
  codes = jnp.round((x - jnp.expand_dims(lo, axis)) / jnp.expand_dims(step, axis))
  codes = jnp.clip(jnp.nan_to_num(codes), 0, levels).astype(jnp.uint8)
  return Quantized(codes, scale, lo)


def quantize_tokens(x: Float[Array, "... D"], bits: int, group: int) -> Quantized:
  """Each token's D channels quantized in groups of `group` channels: codes [..., D],
  scale and zero [..., D / group]."""
  d = x.shape[-1]
  if group < 1 or d % group:
    raise ValueError(f"group must divide the {d} channels, got group={group}")
  q = quantize(x.reshape(*x.shape[:-1], d // group, group), bits, axis=-1)
  return Quantized(q.codes.reshape(x.shape), q.scale, q.zero)


def dequantize_tokens(q: Quantized, group: int, dtype=jnp.float32) -> Float[Array, "... D"]:
  """The values `quantize_tokens` stands for."""
  codes = q.codes.reshape(*q.codes.shape[:-1], -1, group)
  return dequantize(Quantized(codes, q.scale, q.zero), -1, dtype).reshape(q.codes.shape)


def smoothing(k: Float[Array, "... T D"], valid: Bool[Array, "... T"] | None = None):
  """Per-channel factors that bring every key channel to [-1, 1]: the absolute maximum over
  the (valid) tokens, [..., D]. A channel that is all zeros gets 1 (nothing to scale)."""
  k = jnp.abs(k.astype(jnp.float32))
  if valid is not None:
    k = jnp.where(valid[..., None], k, 0.0)
  top = k.max(axis=-2)
  return jnp.where(top > 0, top, 1.0)


def dequantize(q: Quantized, axis: int, dtype=jnp.float32) -> Float[Array, "..."]:
  """The values `q` stands for: zero + code * scale (NaN where its group held a NaN)."""
  scale, zero = jnp.expand_dims(q.scale, axis), jnp.expand_dims(q.zero, axis)
  return (zero + q.codes.astype(jnp.float32) * scale).astype(dtype)


def pack(codes: UInt8[Array, "... D"], bits: int) -> UInt8[Array, "..."]:
  """Codes as stored: int8 as they are, int4 two to a byte along the last axis (even D)."""
  if bits == 8:
    return codes
  if codes.shape[-1] % 2:
    raise ValueError(f"4-bit codes pack in pairs: the last axis must be even, got {codes.shape}")
  pairs = codes.reshape(*codes.shape[:-1], -1, 2)
  return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(jnp.uint8)


def unpack(stored: UInt8[Array, "..."], bits: int) -> UInt8[Array, "... D"]:
  """The codes `pack` stored."""
  if bits == 8:
    return stored
  low, high = stored & 0xF, stored >> 4
  return jnp.stack([low, high], axis=-1).reshape(*stored.shape[:-1], -1).astype(jnp.uint8)


def stored_width(head_dim: int, kv_dtype: str) -> int:
  """Bytes one token's K (or V) codes take in a page row of `head_dim` channels."""
  if bits_of(kv_dtype) == 8:
    return head_dim
  if head_dim % 2:
    raise ValueError(
        f"int4 pages pack two channels to a byte: head_dim must be even, got {head_dim}"
    )
  return head_dim // 2
