"""The codec of quantized pages: error within half a step, exact constant groups, free slots
out of the range, NaN kept, 4-bit packing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import page_format as pf


def _keys_and_values(seed=0, pages=3, page_size=16, head_dim=8):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(pages, page_size, head_dim)).astype(np.float32)
  x[:, :, 2] *= 40.0  # an outlier channel, as keys have
  return jnp.asarray(x)


@pytest.mark.parametrize("kv_dtype", pf.QUANTIZED_DTYPES)
@pytest.mark.parametrize(
    "axis", [1, 2]
)  # keys: per channel over a page's tokens; values: per token
def test_round_trip_error_is_at_most_half_a_step(kv_dtype, axis):
  x = _keys_and_values()
  bits = pf.bits_of(kv_dtype)
  q = pf.quantize(x, bits, axis)
  assert q.codes.dtype == jnp.uint8 and int(q.codes.max()) <= (1 << bits) - 1
  error = jnp.abs(pf.dequantize(q, axis) - x)
  half_step = jnp.expand_dims(q.scale, axis) / 2
  assert bool((error <= half_step * (1 + 1e-5) + 1e-6).all())
  # The range is the group's own: its min and max come back (nearly) exactly.
  back = pf.dequantize(q, axis)
  np.testing.assert_allclose(back.min(axis), x.min(axis), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(back.max(axis), x.max(axis), rtol=1e-5, atol=1e-5)


def test_per_channel_groups_keep_a_quiet_channel_beside_an_outlier():
  """Grouping keys per channel gives the quiet channels their own small step, which
  per-token groups cannot (the outlier channel sets a token's whole range)."""
  x = _keys_and_values()
  per_channel = jnp.abs(pf.dequantize(pf.quantize(x, 4, 1), 1) - x)[..., 0].max()
  per_token = jnp.abs(pf.dequantize(pf.quantize(x, 4, 2), 2) - x)[..., 0].max()
  assert float(per_channel) < float(per_token) / 5


def test_a_constant_group_is_exact_and_free_slots_are_out_of_the_range():
  x = jnp.full((1, 4, 6), 3.25, jnp.float32).at[0, 3].set(1e6)  # slot 3 is free: garbage
  valid = jnp.array([True, True, True, False])[None, :, None]
  q = pf.quantize(x, 8, axis=1, valid=valid)
  back = pf.dequantize(q, 1)
  np.testing.assert_array_equal(back[0, :3], x[0, :3])  # scale 0: exact
  assert float(q.scale.max()) == 0.0
  # A group with no valid slot at all (an empty page) reads back zeros, not garbage.
  none = pf.quantize(x, 8, axis=1, valid=jnp.zeros((1, 4, 1), bool))
  assert float(jnp.abs(pf.dequantize(none, 1)).max()) == 0.0


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_a_non_finite_value_makes_its_group_nan_never_plausible_numbers(bad):
  x = _keys_and_values().at[1, 5, 3].set(bad)
  for axis in (1, 2):
    back = pf.dequantize(pf.quantize(x, 8, axis), axis)
    group = back[1, :, 3] if axis == 1 else back[1, 5, :]
    assert bool(jnp.isnan(group).all()), axis
    assert int(jnp.isnan(back).sum()) == group.size  # the other groups are untouched


def test_int4_codes_pack_two_to_a_byte_and_unpack_exactly():
  codes = jax.random.randint(jax.random.key(0), (3, 16, 8), 0, 16).astype(jnp.uint8)
  stored = pf.pack(codes, 4)
  assert stored.shape == (3, 16, 4) and stored.dtype == jnp.uint8
  np.testing.assert_array_equal(pf.unpack(stored, 4), codes)
  assert stored[0, 0, 0] == codes[0, 0, 0] | (codes[0, 0, 1] << 4)  # low nibble first
  np.testing.assert_array_equal(pf.pack(codes, 8), codes)  # int8: as they are
  assert pf.stored_width(64, "int4") == 32 and pf.stored_width(64, "int8") == 64


def test_bad_arguments_name_the_limit():
  with pytest.raises(ValueError, match="kv_dtype must be one of"):
    pf.bits_of("int2")
  with pytest.raises(ValueError, match="last axis must be even"):
    pf.pack(jnp.zeros((2, 3), jnp.uint8), 4)
  with pytest.raises(ValueError, match="head_dim must be even, got 7"):
    pf.stored_width(7, "int4")


@pytest.mark.parametrize("bits, group", [(8, 64), (4, 16), (4, 64)])
def test_per_token_groups_of_channels_round_trip_within_half_a_step(bits, group):
  x = jax.random.normal(jax.random.key(1), (2, 5, 3, 64)) * jnp.linspace(0.1, 30.0, 64)
  q = pf.quantize_tokens(x, bits, group)
  assert q.codes.shape == x.shape and q.scale.shape == (2, 5, 3, 64 // group)
  error = jnp.abs(pf.dequantize_tokens(q, group) - x).reshape(2, 5, 3, -1, group)
  assert bool((error <= q.scale[..., None] / 2 * (1 + 1e-5) + 1e-6).all())
  with pytest.raises(ValueError, match="group must divide the 64 channels, got group=24"):
    pf.quantize_tokens(x, bits, 24)


def test_smoothing_brings_every_key_channel_to_unit_range_and_back():
  k = _keys_and_values().at[:, :, 5].set(0.0)  # [P, S, D]: a dead channel
  valid = jnp.arange(16) < 12  # the last 4 slots are free: their garbage is ignored
  k = k.at[:, 12:].set(1e9)
  factors = pf.smoothing(k, valid[None, :].repeat(3, 0))  # [P, D]
  assert factors.shape == (3, 8) and float(factors[0, 5]) == 1.0
  smoothed = k[:, :12] / factors[:, None]
  assert float(jnp.abs(smoothed).max()) == 1.0
  np.testing.assert_allclose(smoothed * factors[:, None], k[:, :12], rtol=1e-6)
