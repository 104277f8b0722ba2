"""Hybrid caches: sliding-window layers (Gemma 3's local layers, Mistral's) hold only the pages
their window needs, freed inside jit as a sequence moves on, while the full layers keep the
context under the chosen policy. Parity with transformers over several windows is in
tests/models/test_families_parity.py; here the cache's own behaviour on a tiny Gemma 3."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.cache.sizing import window_peak
from kvjax.testing import ByteTokenizer, assert_cache_invariants, tiny_gemma3, tiny_llama

WINDOW = 8
PROMPT = "the quick brown fox jumps over the lazy dog, " * 4  # 180 bytes: many windows long


@pytest.fixture(scope="module")
def gemma():
  return tiny_gemma3(window=WINDOW, max_context=1024, qk_scale=3.0), ByteTokenizer()


def _positions(cache, layer, row, head):
  """Original positions of one sequence's tokens, in cache order."""
  view = kvjax.logical_view(cache, cache.slot("position"))
  return np.asarray(view[layer, row, head, : int(cache.length[layer, row, head])])


def _assert_windows_hold_their_latest_tokens(state, model):
  """Each sliding sequence holds a run of consecutive positions ending at the row's last
  token, at least the window's and at most its peak's (`window_peak`)."""
  cache, ps = state.cache, state.cache.config.page_size
  assert_cache_invariants(cache)
  for layer, window in enumerate(model.config.layer_windows):
    if not window:
      continue
    for row in range(cache.length.shape[1]):
      end = int(state.position[row])
      for head in range(cache.num_kv_heads):
        held = _positions(cache, layer, row, head)
        assert min(end, window - 1) <= len(held) <= window_peak(window, ps, 0)
        np.testing.assert_array_equal(held, np.arange(end - len(held), end))


def test_slide_frees_only_the_pages_a_window_has_passed():
  """Direct cache operations: after appends, `slide` frees a sliding layer's leading whole
  pages that its next query cannot see; the full layer is untouched; pages go back."""
  cfg = kvjax.CacheConfig(page_size=4, max_tokens=64, windows=(6, 0))
  cache = kvjax.init_cache(cfg, 2, 2, 1, 4, chunk=20)
  k = jnp.ones((2, 2, 20, 1, 4))
  positions = jnp.broadcast_to(jnp.arange(20), (2, 20))
  cache = kvjax.append(cache, k, k, positions)
  free = int(cache.pages.num_free)
  cache = kvjax.eviction.slide(cache)
  # 20 tokens, the next query sees 5 of them: 15 may go, 3 whole pages (12 tokens).
  np.testing.assert_array_equal(np.asarray(cache.length), [[[8], [8]], [[20], [20]]])
  assert int(cache.pages.num_free) == free + 2 * 3
  np.testing.assert_array_equal(_positions(cache, 0, 1, 0), np.arange(12, 20))
  np.testing.assert_array_equal(_positions(cache, 1, 1, 0), np.arange(20))
  assert_cache_invariants(cache)
  assert kvjax.eviction.slide(cache) is not None  # nothing more to free: unchanged
  np.testing.assert_array_equal(np.asarray(kvjax.eviction.slide(cache).length), cache.length)


def test_a_cache_without_the_models_windows_is_refused(gemma):
  model, _ = gemma
  cache = kvjax.init_cache(kvjax.CacheConfig(page_size=4, max_tokens=32), 3, 1, 2, 8)
  tokens = jnp.zeros((1, 2), jnp.int32)
  with pytest.raises(ValueError, match=r"sliding windows per layer are \(8, 8, 0\)"):
    kvjax.seam.forward(model, tokens, tokens, cache, jnp.array([2]))


def test_the_full_cache_holds_the_full_layers_and_a_window_on_the_others(gemma):
  """A prompt many windows long: the full layers keep it all, the sliding layers their
  window; the pool is sized for that (peak far under a cache of every layer at full length),
  and prefill + extend + decode equals one prefill of everything."""
  model, tok = gemma
  long = PROMPT * 4  # 720 tokens
  spec = kvjax.CompressionSpec(prefill_chunk=64)  # a sliding layer holds a chunk at its peak
  state = kvjax.prefill(model, [long], spec, tokenizer=tok)
  _assert_windows_hold_their_latest_tokens(state, model)
  n = len(long)
  assert np.asarray(state.cache.length)[2].min() == n  # the full layer
  token_bytes = 2 * 8 * 4  # K and V, head_dim 8, float32: per kv head
  all_layers = 3 * 2 * n * token_bytes  # every layer at full length (the `gemma` layout)
  assert state.cache.kv_bytes() < 0.4 * all_layers
  # The pool itself: the full layer's capacity and a window's peak on each sliding layer,
  # against every layer at that capacity.
  cfg = state.cache.config
  pool = (state.cache.num_pages - 1) * cfg.page_size * token_bytes
  assert pool < 0.5 * 3 * 2 * cfg.max_tokens * token_bytes
  state = kvjax.prefill(model, [PROMPT], tokenizer=tok)
  state = kvjax.extend(model, state, [" and runs far away"], tokenizer=tok)
  state, first = kvjax.decode(model, state, 6, return_logits=True)
  _assert_windows_hold_their_latest_tokens(state, model)
  whole = kvjax.prefill(model, [PROMPT + " and runs far away"], tokenizer=tok)
  whole, second = kvjax.decode(model, whole, 6, return_logits=True)
  assert first.tokens == second.tokens
  np.testing.assert_allclose(first.logits, second.logits, atol=1e-4)


@pytest.mark.parametrize(
    "policy, budget",
    [
        ("h2o", 16),  # kvzip on a hybrid model runs by default in the save/load test
        *(
            pytest.param(*case, marks=pytest.mark.slow)
            for case in [("kvzip", 0.5), ("snapkv", 16), ("expected_attention", 0.25)]
        ),
    ],
)
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_policies_compress_the_full_layers_and_leave_the_windows(gemma, policy, budget):
  model, tok = gemma
  spec = kvjax.CompressionSpec(policy=policy, budget=budget)
  state = kvjax.prefill(model, [PROMPT], spec, tokenizer=tok)
  _assert_windows_hold_their_latest_tokens(state, model)
  full = np.asarray(state.cache.length)[2]  # the one full layer, [B, H]
  n = len(PROMPT)
  if isinstance(budget, float):  # compressed once: the layer's heads share its budget
    assert full.sum() == round(budget * n) * full.size
  else:
    assert full.max() <= budget + state.cache.config.margin
  state, result = kvjax.decode(model, state, 8)
  assert len(result.tokens[0]) == 8
  _assert_windows_hold_their_latest_tokens(state, model)


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_a_hybrid_state_saves_loads_and_continues_identically(gemma, tmp_path):
  model, tok = gemma
  spec = kvjax.CompressionSpec(policy="kvzip", budget=0.5)
  state = kvjax.prefill(model, [PROMPT], spec, tokenizer=tok)
  kvjax.save_state(tmp_path / "s", state, model, tokenizer=tok)
  loaded = kvjax.load_state(tmp_path / "s", model, tokenizer=tok)
  assert loaded.cache.config.windows == (WINDOW, WINDOW, 0)
  a, b = kvjax.fork(loaded, 2)
  (_, want), (_, got), (_, again) = (kvjax.decode(model, s, 6) for s in (state, a, b))
  assert got.tokens == want.tokens == again.tokens


@pytest.mark.slow  # -m slow
def test_int8_pages_on_a_hybrid_model_stay_close_to_float(gemma):
  model, tok = gemma
  spec = kvjax.CompressionSpec(policy="h2o", budget=16)
  logits = []
  for kv_dtype in (None, "int8"):
    state = kvjax.prefill(
        model, [PROMPT], spec if kv_dtype is None else spec.replace(kv_dtype="int8"), tokenizer=tok
    )
    _assert_windows_hold_their_latest_tokens(state, model)
    logits.append(np.asarray(state.logits))
  assert np.abs(logits[0] - logits[1]).max() < 0.05 * np.abs(logits[0]).max()


def test_a_model_without_windows_makes_a_cache_without_them():
  state = kvjax.prefill(tiny_llama(max_context=256), [PROMPT], tokenizer=ByteTokenizer())
  assert state.cache.config.windows == () and not state.cache.config.sliding


@pytest.mark.parametrize(
    "windows, match",
    [((8, -1), "windows must be a tuple of ints >= 0"), ("88", "windows must be a tuple of ints")],
)
def test_bad_windows_are_refused(windows, match):
  with pytest.raises(ValueError, match=match):
    kvjax.CacheConfig(windows=windows)


def test_windows_for_another_number_of_layers_are_refused():
  with pytest.raises(ValueError, match=r"windows gives 2 layers' windows; .* num_layers=3"):
    kvjax.init_cache(kvjax.CacheConfig(page_size=4, max_tokens=32, windows=(8, 0)), 3, 1, 1, 4)


def test_a_model_with_bad_layer_windows_is_refused(gemma):
  """The seam reads `config.layer_windows`: one int >= 0 per layer, or a TypeError."""
  model, _ = gemma
  sizes = dict(n_layers=3, n_kv_heads=2, head_dim=8, vocab_size=259, max_context=64)
  for windows in [(8, 0), (8, -1, 0)]:
    config = type("Config", (), dict(sizes, layer_windows=windows))()
    stand_in = type("Model", (), {"run": model.run, "config": config})()
    with pytest.raises(TypeError, match=r"layer_windows must give an int >= 0 .* 3 layers"):
      kvjax.ModelShape.of(stand_in)


def test_a_budget_past_the_window_fits_a_pool_sized_by_the_windows():
  # A sliding layer is never evicted, so the budget check counts its window, not the budget.
  cfg = kvjax.CacheConfig(page_size=4, max_tokens=64, budget=32, windows=(8, 0))
  cache = kvjax.init_cache(cfg, num_layers=2, batch_size=1, num_kv_heads=1, head_dim=4, chunk=4)
  assert cache.k_pages.shape[0] == cfg.pool_pages(2, 4)
  needed = 8 // 4 + 32 // 4 + 1  # the window's pages, the budget's, the null page
  small = dataclasses.replace(cfg, num_pages=needed - 1)
  with pytest.raises(ValueError, match=f"cannot hold budget=32 .* need >= {needed}"):
    kvjax.init_cache(small, num_layers=2, batch_size=1, num_kv_heads=1, head_dim=4, chunk=4)


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_a_running_budget_below_the_window_sizes_the_tables_for_the_window():
  # The sliding layers hold their window of 64 while the full layer keeps 16 tokens: the
  # page tables are as wide as the window's peak, not the budget's.
  model, tok = tiny_gemma3(window=64, max_context=1024), ByteTokenizer()
  spec = kvjax.CompressionSpec(policy="h2o", budget=16, page_size=4, prefill_chunk=8)
  state = kvjax.prefill(model, [PROMPT], spec, tokenizer=tok)
  assert state.cache.config.max_tokens >= window_peak(64, 4, 0)
  _assert_windows_hold_their_latest_tokens(state, model)
  assert np.asarray(state.cache.length)[2].max() <= 16 + state.cache.config.margin
  state, result = kvjax.decode(model, state, 4)
  assert len(result.tokens[0]) == 4
  _assert_windows_hold_their_latest_tokens(state, model)
