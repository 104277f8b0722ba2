"""Quantized pages in the cache: appending quantizes, and every operation that moves, frees,
truncates, grows or compacts tokens carries their codes and scales with them (nothing is
re-quantized); bytes count the scales; the session decodes from int8/int4 caches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.testing import ByteTokenizer, assert_cache_invariants, tiny_llama
from pallas_kernels import page_format as pf


def _filled(kv_dtype, n=20, group_size=None, budget=None, layers=2, heads=2, d=32, seed=0):
  cfg = kvjax.CacheConfig(
      page_size=4,
      max_tokens=64,
      budget=budget,
      sink=1 if budget else 0,
      recent=1 if budget else 0,
      group_size=group_size,
      dtype=kv_dtype,
  )
  cache = kvjax.init_cache(cfg, layers, 1, heads, d, chunk=n)
  k, v = jax.random.normal(jax.random.key(seed), (2, layers, 1, n, heads, d))
  k = k * jnp.arange(1, d + 1) / 4  # channels of different scales
  return kvjax.append(cache, k, v, jnp.arange(n)[None]), k, v


def _sequence(cache, layer=0, head=0):
  return kvjax.read_sequence(cache, layer, 0, head)


@pytest.mark.parametrize("kv_dtype", pf.QUANTIZED_DTYPES)
def test_append_quantizes_and_reads_back_the_encoded_values(kv_dtype):
  cache, k, v = _filled(kv_dtype)
  assert isinstance(cache.k_pages, pf.QuantizedPages) and cache.kv_dtype == kv_dtype
  assert cache.head_dim == 32 and cache.k_pages.shape == (cache.num_pages, 4, 32)
  got_k, got_v, positions = _sequence(cache, layer=1, head=1)
  np.testing.assert_array_equal(got_k, pf.decode(pf.encode(k[1, 0, :, 1], kv_dtype)))
  np.testing.assert_array_equal(got_v, pf.decode(pf.encode(v[1, 0, :, 1], kv_dtype)))
  assert positions.tolist() == list(range(20))
  # Error within the codec's bound: a few percent of each token's range.
  rel = np.abs(got_k - k[1, 0, :, 1]).max() / np.abs(k).max()
  assert rel < (0.005 if kv_dtype == "int8" else 0.05)
  assert_cache_invariants(cache)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", *pf.QUANTIZED_DTYPES])
def test_page_and_kv_bytes_include_the_scales(kv_dtype):
  cache, _, _ = _filled(kv_dtype)
  per_token = pf.token_bytes(32, kv_dtype)
  assert cache.page_bytes == 2 * 4 * per_token
  assert cache.token_bytes == 2 * 2 * 2 * per_token  # K and V, 2 layers, 2 kv heads
  assert cache.kv_bytes() == 2 * 2 * 5 * cache.page_bytes  # 20 tokens: 5 pages each
  # The pool's arrays take exactly what page_bytes says per page.
  assert pf.nbytes(cache.k_pages) + pf.nbytes(cache.v_pages) == cache.num_pages * cache.page_bytes


@pytest.mark.parametrize(
    "kv_dtype, group_size",
    [
        ("int8", 4),
        ("int4", 1),
        pytest.param("int8", 1, marks=pytest.mark.slow),
        pytest.param("int4", 4, marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_eviction_moves_codes_and_scales_with_their_tokens(kv_dtype, group_size):
  """The same eviction on a float32 and a quantized cache keeps the same tokens, and the
  quantized cache's kept values are exactly their first encoding: scales travelled with
  their tokens (token eviction moves them between pages)."""
  ref, k, _ = _filled("float32", group_size=group_size, budget=12)
  cache, _, _ = _filled(kv_dtype, group_size=group_size, budget=12)
  scores = jax.random.uniform(jax.random.key(3), (2, 1, 2, 64))
  ref, cache = kvjax.evict(ref, scores=scores), kvjax.evict(cache, scores=scores)
  assert_cache_invariants(cache)
  for layer, head in [(0, 0), (1, 1)]:
    want_k, want_v, want_pos = _sequence(ref, layer, head)
    got_k, got_v, got_pos = _sequence(cache, layer, head)
    assert got_pos.tolist() == want_pos.tolist() and len(got_pos) == 12
    np.testing.assert_array_equal(got_k, pf.decode(pf.encode(jnp.asarray(want_k), kv_dtype)))
    np.testing.assert_array_equal(got_v, pf.decode(pf.encode(jnp.asarray(want_v), kv_dtype)))


@pytest.mark.parametrize("kv_dtype", pf.QUANTIZED_DTYPES)
def test_truncate_frees_pages_whose_scales_the_next_owner_overwrites(kv_dtype):
  cache, _, _ = _filled(kv_dtype)
  before = _sequence(cache, 0, 1)
  cut = kvjax.eviction.fixed_shape.truncate(cache, jnp.full((2, 1, 2), 9, jnp.int32))
  assert_cache_invariants(cut)
  k, v, pos = _sequence(cut, 0, 1)
  np.testing.assert_array_equal(k, before[0][:9])
  np.testing.assert_array_equal(v, before[1][:9])
  # New tokens land on the freed slots with scales of their own.
  x = jnp.full((2, 1, 3, 2, 32), 7.0)
  grown = kvjax.append(cut, x, x, jnp.arange(9, 12)[None])
  k, _, pos = _sequence(grown, 0, 1)
  assert pos.tolist() == list(range(12))
  np.testing.assert_array_equal(k[9:], 7.0)  # a constant token is exact


MODEL = dict(max_context=512, qk_scale=20.0)


@pytest.fixture(scope="module")
def model():
  return tiny_llama(**MODEL)


@pytest.mark.parametrize(
    "policy, budget",
    [
        ("full", None),
        # Compressed policies under -m slow (the behaviour record runs kvzip on int4 pages).
        pytest.param("kvzip", 0.25, marks=pytest.mark.slow),
        *(pytest.param(p, 48, marks=pytest.mark.slow) for p in ("h2o", "knorm", "tova")),
    ],
)
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_the_session_decodes_from_quantized_pages_close_to_float(model, policy, budget):
  """Prefill (several chunks), extend and decode with int8 and int4 pages under each policy:
  the cache keeps its dtype and invariants through eviction, growth and compaction
  (compress-once), the logits stay finite, and the pages held cost the dtype's bytes. With
  the full cache the logits stay close to float32's, int8 closer than int4 (with eviction,
  quantization may change which tokens a random model keeps)."""
  context = np.random.default_rng(0).integers(3, 250, 300).tolist()
  logits, held = {}, {}
  for kv_dtype in ("float32", "int8", "int4"):
    spec = kvjax.CompressionSpec(policy, budget=budget, sink=2, kv_dtype=kv_dtype)
    state = kvjax.prefill(model, [context], spec, tokenizer=ByteTokenizer())
    state = kvjax.extend(model, state, [[5, 6, 7, 8]])
    state, out = kvjax.decode(model, state, 6, return_logits=True)
    assert state.cache.kv_dtype == kv_dtype
    assert_cache_invariants(state.cache)
    logits[kv_dtype] = np.asarray(out.logits, np.float32)
    held[kv_dtype] = state.kv_bytes()
  assert all(np.isfinite(x).all() for x in logits.values())
  if policy == "full":
    err8 = np.abs(logits["int8"] - logits["float32"]).max()
    err4 = np.abs(logits["int4"] - logits["float32"]).max()
    scale = np.abs(logits["float32"]).max()
    assert err8 < 0.02 * scale and err8 < err4 / 10, (err8, err4, scale)
  # As many pages held, each in fewer bytes (head_dim 8: 32 bytes a token in float32,
  # 8 + 4 in int8, 4 + 4 in int4).
  for kv_dtype in ("int8", "int4"):
    ratio = pf.token_bytes(8, "float32") / pf.token_bytes(8, kv_dtype)
    assert held["float32"] / held[kv_dtype] == pytest.approx(ratio, rel=0.05)


def test_a_bad_kv_dtype_is_refused_with_the_choices():
  with pytest.raises(ValueError, match="int8"):
    kvjax.CacheConfig(dtype="int2")
  with pytest.raises(ValueError, match="int4"):
    kvjax.CompressionSpec(kv_dtype="fp4")
