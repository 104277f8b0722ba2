"""How K/V values sit in a page pool: floats, or 8- and 4-bit codes with a scale and a zero
point per group of channels of each token (quantized pages, `docs/quantized_pages.md`).

A pool is either a float array [P, S, D] or a `QuantizedPages`:

    codes  [P, S, W] uint8     W = D (int8), or D / 2 (int4: byte j holds channel 2j in its
                               low nibble and channel 2j + 1 in its high nibble)
    scale  [P, S, G] float16   G = D / group: one per group of `group` channels of a token
    zero   [P, S, G] float16

Every array shares the pool's leading [P, S] axes, so whatever moves, frees, truncates,
compacts, saves or shards a token's slot (`jax.tree.map` over the pool) carries its codes
and scales with it: nothing is ever re-quantized. A group is quantized asymmetrically,
min/max:

    scale = (max - min) / (2**bits - 1)      zero = min
    code  = round((x - zero) / scale)        x ~= zero + code * scale  (error <= scale / 2)

Why per token and not per channel over a page's tokens (KIVI's keys): token eviction takes
single tokens out of pages, and a per-channel group would have to be re-quantized at every
eviction event; `docs/results/quantized_pages` measured the groupings (int8 per token: KL 0.0004 on
the full cache; int4 in groups of 16 channels: 0.031, against 0.10 for one group per token).
Unpacking repeats each byte and shifts every other lane by 4: one elementwise pass that
XLA, Mosaic and Triton all lower (Triton lowers no concatenation).

Scales are float16: a token's group of 64 int8 codes carries 4 bytes of scale and zero
(6 %), a group of 16 int4 codes 4 bytes (50 %); float16's 11-bit significand puts the zero
point within 1/16 of an int8 step. Values beyond float16's range (|x| > 65504) read back as
NaN, and a NaN or an infinity in a group makes the whole group NaN: a broken model is never
turned into plausible numbers (the session then raises `NumericsError`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Float, UInt8

__all__ = [
    "FLOAT_DTYPES",
    "INT4_GROUP",
    "KV_DTYPES",
    "Pool",
    "QUANTIZED_DTYPES",
    "Quantized",
    "QuantizedPages",
    "SCALE_DTYPE",
    "bits_of",
    "check_kv_dtype",
    "decode",
    "dequantize",
    "dequantize_tokens",
    "empty_pool",
    "encode",
    "from_parts",
    "group_of",
    "kv_dtype_of",
    "nbytes",
    "pack",
    "part_names",
    "parts",
    "quantize",
    "quantize_tokens",
    "read",
    "take",
    "token_bytes",
    "unpack",
    "write",
]

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
QUANTIZED_DTYPES = ("int8", "int4")
KV_DTYPES = FLOAT_DTYPES + QUANTIZED_DTYPES
SCALE_DTYPE = jnp.float16
INT4_GROUP = 16  # channels per scale in int4 pages (int8: a token's whole head)


@struct.dataclass
class Quantized:
  """Codes of groups of values and the (scale, zero) that read them back; `dequantize`
  names the axis the groups run along (scale and zero lack it)."""

  codes: UInt8[Array, "..."]  # unpacked: one code per value, in [0, 2**bits)
  scale: Float[Array, "..."]
  zero: Float[Array, "..."]


@struct.dataclass
class QuantizedPages:
  """A pool of quantized K (or V) pages: codes and per-token group scales, [P, S, ...] each
  (a sharded cache adds a leading shard axis to all three)."""

  codes: UInt8[Array, "P S W"]
  scale: Float[Array, "P S G"]
  zero: Float[Array, "P S G"]
  kv_dtype: str = struct.field(pytree_node=False)

  @property
  def bits(self) -> int:
    return bits_of(self.kv_dtype)

  @property
  def head_dim(self) -> int:
    return self.codes.shape[-1] * 8 // self.bits

  @property
  def shape(self) -> tuple[int, ...]:
    """The logical shape: the float pool this one stands for."""
    return (*self.codes.shape[:-1], self.head_dim)

  @property
  def ndim(self) -> int:
    return self.codes.ndim

  @property
  def group(self) -> int:
    return self.head_dim // self.scale.shape[-1]


Pool = Array | QuantizedPages


def bits_of(kv_dtype: str) -> int:
  """Bits per stored code of a quantized K/V dtype."""
  if kv_dtype not in QUANTIZED_DTYPES:
    raise ValueError(f"kv_dtype must be one of {QUANTIZED_DTYPES}, got {kv_dtype!r}")
  return 8 if kv_dtype == "int8" else 4


def kv_dtype_of(pool: Pool) -> str:
  """The K/V dtype a pool stores: a float dtype's name, or int8/int4."""
  if isinstance(pool, QuantizedPages):
    return pool.kv_dtype
  return jnp.dtype(pool.dtype).name


def group_of(head_dim: int, kv_dtype: str) -> int:
  """Channels per scale: a token's whole head in int8 pages, `INT4_GROUP` in int4 ones."""
  bits = bits_of(kv_dtype)
  if bits == 4 and (head_dim % 2 or head_dim % INT4_GROUP and head_dim > INT4_GROUP):
    raise ValueError(
        f"int4 pages need head_dim even and a multiple of {INT4_GROUP} (or smaller), "
        f"got head_dim={head_dim}"
    )
  return head_dim if bits == 8 else min(INT4_GROUP, head_dim)


def token_bytes(head_dim: int, kv_dtype: str) -> int:
  """Bytes one token's K (or V) takes in one kv head's pages, scales included."""
  if kv_dtype in FLOAT_DTYPES:
    return head_dim * jnp.dtype(kv_dtype).itemsize
  groups = head_dim // group_of(head_dim, kv_dtype)
  itemsize = jnp.dtype(SCALE_DTYPE).itemsize
  return head_dim * bits_of(kv_dtype) // 8 + 2 * groups * itemsize


def parts(pool: Pool) -> dict[str, Array]:
  """A pool's arrays by name, in the order kernels take them as operands: the float array
  as `values`; a quantized pool's `codes`, `scale` and `zero`."""
  if isinstance(pool, QuantizedPages):
    return {"codes": pool.codes, "scale": pool.scale, "zero": pool.zero}
  return {"values": pool}


def from_parts(arrays, kv_dtype: str) -> Pool:
  """The pool of `parts` (a dict by name, or its values in order: e.g. a kernel's refs)."""
  arrays = list(arrays.values()) if isinstance(arrays, dict) else list(arrays)
  if kv_dtype in QUANTIZED_DTYPES:
    return QuantizedPages(*arrays, kv_dtype)
  (values,) = arrays
  return values


def part_names(kv_dtype: str) -> tuple[str, ...]:
  """The names `parts` gives a pool of `kv_dtype`."""
  return ("codes", "scale", "zero") if kv_dtype in QUANTIZED_DTYPES else ("values",)


def check_kv_dtype(name: str, kv_dtype) -> None:
  """ValueError naming `name` unless `kv_dtype` is one of `KV_DTYPES`."""
  if kv_dtype not in KV_DTYPES:
    raise ValueError(f"{name} must be one of {KV_DTYPES}, got {kv_dtype!r}")


# ---- pools ---------------------------------------------------------------------------


def empty_pool(num_pages: int, page_size: int, head_dim: int, kv_dtype: str) -> Pool:
  """A pool of zeros (call under jit: every array is made by one program)."""
  check_kv_dtype("kv_dtype", kv_dtype)
  if kv_dtype in FLOAT_DTYPES:
    return jnp.zeros((num_pages, page_size, head_dim), kv_dtype)
  groups = head_dim // group_of(head_dim, kv_dtype)
  width = head_dim * bits_of(kv_dtype) // 8
  scales = jnp.zeros((num_pages, page_size, groups), SCALE_DTYPE)
  return QuantizedPages(
      jnp.zeros((num_pages, page_size, width), jnp.uint8), scales, scales, kv_dtype
  )


def encode(x: Float[Array, "... D"], kv_dtype: str) -> Pool:
  """Values [..., D] as a pool stores them (for `write`): cast, or quantized and packed."""
  if kv_dtype in FLOAT_DTYPES:
    return x.astype(kv_dtype)
  bits = bits_of(kv_dtype)
  q = quantize_tokens(x, bits, group_of(x.shape[-1], kv_dtype))
  return QuantizedPages(pack(q.codes, bits), q.scale, q.zero, kv_dtype)


def decode(stored: Pool, dtype=jnp.float32) -> Float[Array, "... D"]:
  """The values a pool (or slots taken from one) stands for, as `dtype`."""
  if not isinstance(stored, QuantizedPages):
    return stored.astype(dtype)
  q = Quantized(unpack(stored.codes, stored.bits), stored.scale, stored.zero)
  return dequantize_tokens(q, stored.group, dtype)


def write(pool: Pool, index, x: Float[Array, "... D"], mode: str = "drop") -> Pool:
  """`pool` with `x` ([..., D] values, one per slot of `index`) written at `index`
  (e.g. (page, offset) arrays): quantized when the pool is."""
  new = encode(x, kv_dtype_of(pool))
  return jax.tree.map(lambda a, b: a.at[index].set(b, mode=mode), pool, new)


def take(pool: Pool, index) -> Pool:
  """The slots (or pages) of `pool` at `index`, still stored (codes stay codes)."""
  return jax.tree.map(lambda a: a[index], pool)


def read(pool: Pool, index, dtype=jnp.float32) -> Float[Array, "... D"]:
  """The values at `index` ([...] pages: [..., S, D]), dequantized: the one way policies,
  references and kernels' loaders read K/V."""
  return decode(take(pool, index), dtype)


# ---- the codec -----------------------------------------------------------------------


def quantize(
    x: Float[Array, "..."], bits: int, axis: int, valid: Bool[Array, "..."] | None = None
) -> Quantized:
  """Asymmetric min/max quantization of `x` in groups along `axis`, scale and zero stored
  as `SCALE_DTYPE` (codes are computed against the stored values). `valid` (broadcast
  against `x`) leaves values out of their group's range; their codes mean nothing."""
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
  # The zero rounded down and the step up: the stored pair still spans the group's range.
  zero = _rounded(lo, -jnp.inf)
  scale = _rounded((hi - zero.astype(jnp.float32)) / levels, jnp.inf)
  finite = jnp.isfinite(lo) & jnp.isfinite(hi) & jnp.isfinite(zero) & jnp.isfinite(scale)
  zero = jnp.where(finite, zero, jnp.nan).astype(SCALE_DTYPE)
  step = scale.astype(jnp.float32)
  step = jnp.where(step > 0, step, 1.0)  # a constant group: every code 0, exact
  codes = jnp.round(
      (x - jnp.expand_dims(zero.astype(jnp.float32), axis)) / jnp.expand_dims(step, axis)
  )
  codes = jnp.clip(jnp.nan_to_num(codes), 0, levels).astype(jnp.uint8)
  return Quantized(codes, scale, zero)


def _rounded(x: Float[Array, "..."], towards: float) -> Float[Array, "..."]:
  """x as `SCALE_DTYPE`, rounded towards `towards` (+inf or -inf; NaN stays NaN)."""
  y = x.astype(SCALE_DTYPE)
  past = jnp.nextafter(y, jnp.asarray(towards, SCALE_DTYPE))
  short = y.astype(jnp.float32) < x if towards > 0 else y.astype(jnp.float32) > x
  return jnp.where(short, past, y)


def dequantize(q: Quantized, axis: int, dtype=jnp.float32) -> Float[Array, "..."]:
  """The values `q` stands for: zero + code * scale (NaN where its group held a NaN)."""
  scale = jnp.expand_dims(q.scale.astype(jnp.float32), axis)
  zero = jnp.expand_dims(q.zero.astype(jnp.float32), axis)
  return (zero + q.codes.astype(jnp.float32) * scale).astype(dtype)


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


def pack(codes: UInt8[Array, "... D"], bits: int) -> UInt8[Array, "..."]:
  """Codes as stored: int8 as they are; int4 two to a byte, channel 2j in the low nibble
  and channel 2j + 1 in the high one (even D)."""
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
  # Each byte twice, then shifted by 0 or 4 per lane: one elementwise pass (2x faster in a
  # CPU decode step than stacking the two nibbles, which XLA lowers as an interleave).
  twice = jnp.repeat(stored, 2, axis=-1)  # [..., D]
  shift = (jnp.arange(twice.shape[-1], dtype=jnp.uint8) % 2) * 4
  return (twice >> shift) & 0xF


def nbytes(pool: Pool) -> int:
  """Bytes the pool's arrays take (codes and scales)."""
  return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(pool))
