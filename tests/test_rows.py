"""Rows as slots (kvjax.cache.rows): a request prefilled in its own cache moves into a row of a
shared batch, a released row gives every page back, and nothing of it can be read again."""

import jax
import numpy as np
import pytest

import kvjax
from kvjax.cache import NULL_PAGE
from kvjax.cache.rows import insert_row, release_row
from kvjax.testing import (
    ByteTokenizer,
    assert_cache_invariants,
    tiny_gemma3,
    tiny_llama,
)

insert = jax.jit(insert_row)
release = jax.jit(release_row)
PROMPTS = ["the quick brown fox jumps over the lazy dog", "a short one", "zz top " * 9]


def _request(model, prompt, spec):
  return kvjax.prefill(model, [prompt], spec, tokenizer=ByteTokenizer()).cache


def _batch(model, source, rows=3, num_pages=64, max_tokens=128):
  """An empty batch cache of `rows` rows laid out as `source` (same slots and storage)."""
  config = kvjax.CacheConfig(
      page_size=source.config.page_size,
      max_tokens=max_tokens,
      num_pages=num_pages,
      dtype=source.config.dtype,
      windows=source.config.windows,
  )
  c = model.config
  return kvjax.init_cache(
      config, c.n_layers, rows, c.n_kv_heads, c.head_dim, slots=source.slot_specs
  )


def _same_sequences(cache, row, source):
  for layer in range(cache.num_layers):
    for head in range(cache.num_kv_heads):
      ours, theirs = (
          kvjax.read_sequence(cache, layer, row, head),
          kvjax.read_sequence(source, layer, 0, head),
      )
      for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # the served batch inserts and releases rows in the default suite
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_inserted_rows_hold_the_requests_and_released_rows_give_every_page_back(kv_dtype):
  model = tiny_llama(max_context=256, qk_scale=20)
  spec = kvjax.CompressionSpec(page_size=8, kv_dtype=kv_dtype)
  sources = [_request(model, p, spec) for p in PROMPTS]
  cache = _batch(model, sources[0])
  free = int(cache.pages.num_free)
  cache = insert(cache, 2, sources[0])
  cache = insert(cache, 0, sources[1])
  assert_cache_invariants(cache)
  _same_sequences(cache, 2, sources[0])
  _same_sequences(cache, 0, sources[1])
  assert int(np.asarray(cache.length)[:, 1].sum()) == 0
  held = cache.pages_in_use().sum()
  assert free - int(cache.pages.num_free) == held
  # Released: every page back; reused by another request, which reads as its own.
  cache = release(cache, 2)
  assert_cache_invariants(cache)
  assert int(np.asarray(cache.length)[:, 2].sum()) == 0
  assert (np.asarray(cache.page_table)[:, 2] == NULL_PAGE).all()
  cache = insert(cache, 2, sources[2])
  assert_cache_invariants(cache)
  _same_sequences(cache, 2, sources[2])
  _same_sequences(cache, 0, sources[1])
  cache = release(cache, 1)  # holds nothing: gives nothing back
  for row in (0, 2):
    cache = release(cache, row)
  assert int(cache.pages.num_free) == free


def test_a_request_that_does_not_fit_changes_nothing_and_says_why():
  model = tiny_llama(max_context=256, qk_scale=20)
  source = _request(model, PROMPTS[2], kvjax.CompressionSpec(page_size=8))
  small = _batch(model, source, num_pages=4)
  before = jax.tree.leaves(small)
  after = insert(small, 1, source)
  with pytest.raises(kvjax.CacheError, match="OUT_OF_PAGES|pool"):
    kvjax.check_status(after)
  for a, b in zip(
      before, jax.tree.leaves(after.replace(pages=after.pages.replace(status=small.pages.status)))
  ):
    np.testing.assert_array_equal(a, b)
  narrow = insert(_batch(model, source, max_tokens=16), 1, source)  # 63 tokens > 16
  with pytest.raises(kvjax.CacheError, match="OVER_CAPACITY|max_tokens"):
    kvjax.check_status(narrow)


@pytest.mark.slow
def test_a_hybrid_request_moves_with_its_windows():
  model = tiny_gemma3(window=8, max_context=256, qk_scale=3.0)
  source = _request(
      model, PROMPTS[0], kvjax.CompressionSpec(page_size=4, policy="kvzip", budget=0.5)
  )
  cache = insert(_batch(model, source), 1, source)
  assert_cache_invariants(cache)
  _same_sequences(cache, 1, source)


def test_caches_of_another_layout_are_refused():
  model = tiny_llama(max_context=256, qk_scale=20)
  source = _request(model, PROMPTS[0], kvjax.CompressionSpec(page_size=8))
  other = _request(model, PROMPTS[0], kvjax.CompressionSpec(page_size=16))
  with pytest.raises(ValueError, match="page_size=16 cannot be inserted into one with page_size=8"):
    insert_row(_batch(model, source), 0, other)
  quantized = _request(model, PROMPTS[0], kvjax.CompressionSpec(page_size=8, kv_dtype="int8"))
  with pytest.raises(ValueError, match="kv_dtype='int8'"):
    insert_row(_batch(model, source), 0, quantized)
