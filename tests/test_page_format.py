"""The codec of quantized pages: error within half a stored step, exact constant groups, free
slots out of the range, NaN kept, 4-bit packing, bytes per token, pool writes and reads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import page_format as pf


def _keys(seed=0, tokens=48, head_dim=64):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(tokens, head_dim)).astype(np.float32)
  x[:, 2] *= 40.0  # an outlier channel, as keys have
  return jnp.asarray(x)


@pytest.mark.parametrize("kv_dtype", pf.QUANTIZED_DTYPES)
def test_round_trip_error_is_at_most_half_a_stored_step(kv_dtype):
  x = _keys()
  bits, group = pf.bits_of(kv_dtype), pf.group_of(64, kv_dtype)
  q = pf.quantize_tokens(x, bits, group)
  assert q.codes.dtype == jnp.uint8 and int(q.codes.max()) <= (1 << bits) - 1
  assert q.scale.dtype == pf.SCALE_DTYPE and q.scale.shape == (48, 64 // group)
  back = pf.dequantize_tokens(q, group)
  step = jnp.repeat(q.scale.astype(jnp.float32), group, axis=-1)
  assert bool((jnp.abs(back - x) <= step / 2 * (1 + 1e-3) + 1e-6).all())
  # The stored zero is rounded down and the step up: the group's range stays covered, so
  # its extremes come back within a step (no clipping).
  lo = x.reshape(48, -1, group).min(-1)
  assert bool((q.zero.astype(jnp.float32) <= lo).all())


def test_int4_groups_of_channels_keep_a_quiet_group_beside_an_outlier():
  """Groups of 16 channels give the quiet channels their own step, which one group per
  token cannot (the outlier channel sets the token's whole range)."""
  x = _keys()
  per_group = pf.dequantize_tokens(pf.quantize_tokens(x, 4, 16), 16)
  per_token = pf.dequantize_tokens(pf.quantize_tokens(x, 4, 64), 64)
  quiet = slice(16, 64)  # groups without the outlier channel 2
  assert float(jnp.abs(per_group - x)[:, quiet].max()) < float(
      jnp.abs(per_token - x)[:, quiet].max() / 5
  )


def test_a_constant_group_is_exact_and_free_slots_are_out_of_the_range():
  x = jnp.full((1, 4, 6), 3.25, jnp.float32).at[0, 3].set(1e6)  # slot 3 is free: garbage
  valid = jnp.array([True, True, True, False])[None, :, None]
  q = pf.quantize(x, 8, axis=1, valid=valid)
  back = pf.dequantize(q, 1)
  np.testing.assert_array_equal(back[0, :3], x[0, :3])  # scale 0: exact
  assert float(q.scale.astype(jnp.float32).max()) == 0.0
  # A group with no valid slot at all (an empty page) reads back zeros, not garbage.
  none = pf.quantize(x, 8, axis=1, valid=jnp.zeros((1, 4, 1), bool))
  assert float(jnp.abs(pf.dequantize(none, 1)).max()) == 0.0


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf, -1e5])
@pytest.mark.parametrize("kv_dtype", pf.QUANTIZED_DTYPES)
def test_a_non_finite_or_unrepresentable_value_makes_its_group_nan(bad, kv_dtype):
  """NaN, an infinity, or a value past float16's range (the scale's dtype): the group reads
  back NaN, never plausible numbers; the other groups are untouched."""
  x = _keys().at[5, 3].set(bad)
  back = pf.decode(pf.encode(x, kv_dtype))
  group = pf.group_of(64, kv_dtype)
  assert bool(jnp.isnan(back[5, :group]).all())
  assert int(jnp.isnan(back).sum()) == group


def test_int4_codes_pack_two_to_a_byte_and_unpack_exactly():
  codes = jax.random.randint(jax.random.key(0), (3, 16, 8), 0, 16).astype(jnp.uint8)
  stored = pf.pack(codes, 4)
  assert stored.shape == (3, 16, 4) and stored.dtype == jnp.uint8
  np.testing.assert_array_equal(pf.unpack(stored, 4), codes)
  assert stored[0, 0, 1] == codes[0, 0, 2] | (codes[0, 0, 3] << 4)  # neighbours, low first
  np.testing.assert_array_equal(pf.pack(codes, 8), codes)  # int8: as they are


@pytest.mark.parametrize(
    "kv_dtype, head_dim, expected",
    [
        ("float32", 64, 256),
        ("bfloat16", 64, 128),
        ("int8", 64, 64 + 4),  # one float16 scale and zero per token
        ("int8", 128, 128 + 4),
        ("int4", 64, 32 + 4 * 4),  # a scale and zero per 16 channels
        ("int4", 128, 64 + 8 * 4),
        ("int4", 8, 4 + 4),  # a head narrower than a group: one group
    ],
)
def test_token_bytes_count_the_scales(kv_dtype, head_dim, expected):
  assert pf.token_bytes(head_dim, kv_dtype) == expected
  pool = pf.empty_pool(5, 16, head_dim, kv_dtype)
  assert pf.nbytes(pool) == 5 * 16 * expected
  assert pool.shape == (5, 16, head_dim) and pf.kv_dtype_of(pool) == kv_dtype


@pytest.mark.parametrize("kv_dtype", pf.KV_DTYPES)
def test_write_then_read_gives_the_encoded_values_at_their_slots(kv_dtype):
  pool = pf.empty_pool(4, 8, 32, kv_dtype)
  x = jax.random.normal(jax.random.key(1), (2, 3, 32))  # [B, T, D]
  page = jnp.array([[1, 1, 3], [2, 2, 4]])  # 4: out of range, dropped
  offset = jnp.array([[0, 1, 7], [5, 6, 0]])
  pool = pf.write(pool, (page, offset), x)
  want = pf.decode(pf.encode(x, kv_dtype))
  got = pf.read(pool, (page, offset))
  np.testing.assert_array_equal(got[:, :2], want[:, :2])
  np.testing.assert_array_equal(got[0, 2], want[0, 2])
  # Reading whole pages through a table gives [.., S, D].
  assert pf.read(pool, jnp.array([[1, 2]])).shape == (1, 2, 8, 32)
  untouched = pf.read(pool, (jnp.array([1]), jnp.array([2])))
  assert float(jnp.abs(untouched).max()) == 0.0


@pytest.mark.parametrize("kv_dtype", pf.KV_DTYPES)
def test_parts_name_a_pools_arrays_and_rebuild_it(kv_dtype):
  pool = pf.empty_pool(3, 8, 32, kv_dtype)
  parts = pf.parts(pool)
  assert tuple(parts) == pf.part_names(kv_dtype)
  rebuilt = pf.from_parts(parts, kv_dtype)
  assert jax.tree.structure(rebuilt) == jax.tree.structure(pool)
  assert pf.from_parts(list(parts.values()), kv_dtype).shape == pool.shape


def test_bad_arguments_name_the_limit():
  with pytest.raises(ValueError, match="kv_dtype must be one of"):
    pf.bits_of("int2")
  with pytest.raises(ValueError, match="kv_dtype must be one of"):
    pf.empty_pool(2, 16, 64, "fp4")
  with pytest.raises(ValueError, match="group must divide"):
    pf.quantize_tokens(jnp.zeros((2, 10)), 8, 4)
  with pytest.raises(ValueError, match="head_dim even and a multiple of 16"):
    pf.group_of(40, "int4")
  with pytest.raises(ValueError, match="last axis must be even"):
    pf.pack(jnp.zeros((2, 3), jnp.uint8), 4)
