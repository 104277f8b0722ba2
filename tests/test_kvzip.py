"""KVzip: query-agnostic scores from the model repeating its context, one global ranking
across layers and kv heads, and a pool re-laid out to what is kept."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import policies
from kvjax.eviction import budgets
from kvjax.policies import AttentionStats
from kvjax.runtime.prompts import Segment
from kvjax.testing import (
    ByteTokenizer,
    assert_cache_invariants,
    assert_compressed_once,
    tiny_gemma3,
    tiny_llama,
)

CONTEXT = "The vault code is 4812. Remember it while the filler goes on and on. " * 4


@pytest.fixture(scope="module")
def tiny():
  return tiny_llama(max_context=1024, n_layers=2), ByteTokenizer()


def test_score_is_the_largest_attention_any_pass_pays_each_key():
  """A pass hands KVzip attention's `key_max` (the most any live query of a kv head's
  query heads pays each key; tests/test_paged_attention.py checks it against the
  per-head probabilities); the score keeps the largest over the passes."""
  cfg = kvjax.CacheConfig(page_size=4, max_tokens=16, budget=4, sink=0, recent=0, group_size=1)
  cache = kvjax.init_cache(cfg, 1, 1, 2, 4, chunk=8, slots=policies.KVzip.slots)
  k = jnp.zeros((1, 1, 8, 2, 4))
  cache = kvjax.append(cache, k, k, jnp.arange(8)[None])
  assert policies.KVzip.reads == {"key_max"}  # the probabilities are never asked for
  for key_max in ([[0.3, 0.0], [0.0, 0.2]], [[0.6, 0.1], [0.0, 0.1]]):  # two passes
    peak = np.zeros((1, 2, 16), np.float32)
    peak[0, :, 2], peak[0, :, 5] = np.asarray(key_max).T
    stats = AttentionStats(
        layer=jnp.int32(0),
        q=jnp.zeros((1, 3, 4, 4)),
        out=jnp.zeros((1, 3, 4, 4)),
        probs=None,
        head_probs=None,
        num_new=jnp.array([2], jnp.int32),
        key_max=jnp.asarray(peak),
    )
    cache = policies.KVzip().observe(cache, stats)
  score = np.asarray(kvjax.logical_view(cache, cache.slot("score")))[0, 0]  # [H, N]
  expected = np.zeros((2, 16), np.float32)
  expected[0, 2], expected[0, 5], expected[1, 5] = 0.6, 0.1, 0.2
  np.testing.assert_allclose(score, expected)


# One row, 2 layers x 2 heads x 4 slots; budget 2 per sequence. [L=2, B=1, H=2, N=4]
SCORES = jnp.asarray([[[[9, 8, 7, 6], [0, 0, 0, 1]]], [[[5, 4, 0, 0], [0, 0, 3, 0]]]], jnp.float32)
PROTECTED = jnp.zeros(SCORES.shape, bool).at[1, 0, 1, 0].set(True)
VALID = jnp.ones(SCORES.shape, bool)


@pytest.mark.parametrize(
    "sharing, expected",
    [
        # 8 best of the row, the protected one counted in: 9 8 7 6 | - | 5 4 | protected 3.
        ("global", [[4, 0], [2, 2]]),
        # Per layer 4 best across its 2 heads, after each head's own best floor(0.5 x 2) = 1:
        # layer 0: head 1's 1 first, then 9 8 7; layer 1: 5, protected + 3, then 4.
        ("layer", [[3, 1], [2, 2]]),
        ("uniform", [[2, 2], [2, 2]]),
    ],
)
def test_head_budgets_share_the_budget_as_asked(sharing, expected):
  counts = budgets.head_budgets(SCORES, PROTECTED, VALID, jnp.array([2, 2]), sharing, floor=0.5)
  np.testing.assert_array_equal(np.asarray(counts)[:, 0], expected)


def test_threshold_counts_exactly_the_tokens_above_it_and_the_protected():
  counts = budgets.head_budgets(SCORES, PROTECTED, VALID, 2, "global", threshold=4.0)
  # Above 4: 9 8 7 6 | - | 5 | -; protected slot (score 0) of layer 1, head 1 counts in.
  np.testing.assert_array_equal(np.asarray(counts)[:, 0], [[4, 0], [1, 1]])


def test_kvzip_prefill_compresses_unevenly_and_returns_the_memory(tiny):
  model, tokenizer = tiny
  c = model.config
  spec = kvjax.CompressionSpec(policy="kvzip", budget=0.25, sink=4, recent=8)
  state = kvjax.prefill(model, [CONTEXT], spec, tokenizer=tokenizer, reserve=16)
  n = len(tokenizer.encode(CONTEXT))
  cache = state.cache
  assert_compressed_once(state, n)
  # The pool holds the kept pages plus room for the reserve, not the whole context.
  sequences = c.n_layers * c.n_kv_heads
  full_pages = sequences * -(-n // spec.page_size)
  assert cache.num_pages - 1 <= int(cache.pages_in_use().sum()) + sequences * (-(-16 // 16) + 1)
  assert cache.num_pages - 1 < full_pages / 2
  # It answers: a follow-up and decoding work on the compressed state.
  state = kvjax.extend(model, state, [" What is the code?"], tokenizer=tokenizer)
  state, result = kvjax.decode(model, state, 24)
  assert len(result.tokens[0]) == 24
  assert_cache_invariants(state.cache)


def test_kvzip_scores_come_from_the_reconstruction(tiny, monkeypatch):
  """Every context token is scored by the repeat passes; a token the model attends to more
  while repeating ranks higher than one it ignores (checked on the score slot directly)."""
  model, tokenizer = tiny
  from kvjax.runtime import steps

  seen = []
  real = steps.prefill_chunks

  def spy(model, state, encoded, key, progress=None, **kwargs):
    seen.append(encoded.ids[0])
    starts.append(int(np.asarray(state.position)[0]))
    return real(model, state, encoded, key, progress, **kwargs)

  starts = []

  monkeypatch.setattr(steps, "prefill_chunks", spy)
  spec = kvjax.CompressionSpec(policy=policies.KVzip(chunk=64), budget=64, sink=4, recent=8)
  ids = tokenizer.encode(CONTEXT)
  kvjax.prefill(model, [ids], spec, tokenizer=tokenizer)
  prompt = tokenizer.encode(kvjax.policies.kvzip.RECONSTRUCTION_PROMPT)
  assert seen[0] == ids  # the context itself, then one pass per 64-token chunk
  assert seen[1:] == [prompt + ids[i : i + 64] for i in range(0, len(ids), 64)]
  # Every pass is placed after the whole context (the model's window has room for it).
  assert starts == [0] + [len(ids)] * (len(seen) - 1)


@pytest.mark.parametrize("attend_to", ["chunk", pytest.param("context", marks=pytest.mark.slow)])
def test_the_passes_repeat_the_context_after_its_protected_prefix(monkeypatch, attend_to):
  """A row's leading protected tokens (`<bos>`, a chat template's opening) are kept whatever
  they score, and no pass repeats them: repeated, Gemma 3's `<bos>` is a second attention
  sink inside the first pass (KVzip's reference keeps them in an unscored prefix)."""
  model, tokenizer = tiny_gemma3(window=16, max_context=1024), ByteTokenizer()
  from kvjax.runtime import steps

  seen, real = [], steps.prefill_chunks

  def spy(model, state, encoded, key, progress=None, **kwargs):
    seen.append(encoded.ids[0])
    return real(model, state, encoded, key, progress, **kwargs)

  monkeypatch.setattr(steps, "prefill_chunks", spy)
  prefix, ids = [2, 40, 41], tokenizer.encode(CONTEXT)[:100]
  policy = policies.KVzip(chunk=64, attend_to=attend_to)
  spec = kvjax.CompressionSpec(policy=policy, budget=0.5, sink=4, recent=8)
  prompts = [[Segment(prefix, protected=True), Segment(ids)]]
  state = kvjax.prefill(model, prompts, spec, tokenizer=tokenizer)
  row = prefix + ids
  repeat = tokenizer.encode(kvjax.policies.kvzip.RECONSTRUCTION_PROMPT)
  assert seen == [row, repeat + row[3:64], repeat + row[64:128]]
  full = np.asarray(kvjax.eviction.full_layers(state.cache))
  positions = np.asarray(kvjax.logical_view(state.cache, state.cache.slot("position")))
  valid = np.asarray(kvjax.valid_mask(state.cache))
  for layer in np.flatnonzero(full):  # the prefix is kept on every full layer
    for head in range(valid.shape[2]):
      assert {0, 1, 2} <= set(positions[layer, 0, head][valid[layer, 0, head]].tolist())


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"budget_schedule": "pyramid"}, "budget_schedule='pyramid' does not apply"),
        ({"fair": True}, "fair=True does not apply"),
        ({"group_size": 16}, "evicts single tokens"),
    ],
)
def test_kvzip_refuses_options_the_global_ranking_replaces(changes, match):
  with pytest.raises(ValueError, match=match):
    kvjax.CompressionSpec(policy="kvzip", budget=64, **changes)


def test_truncate_drops_the_tail_and_returns_its_pages():
  cfg = kvjax.CacheConfig(page_size=4, max_tokens=32)
  cache = kvjax.init_cache(cfg, 1, 2, 1, 4, chunk=16, slots=policies.KVzip.slots)
  k = jnp.ones((1, 2, 14, 1, 4))
  cache = kvjax.append(cache, k, k, jnp.broadcast_to(jnp.arange(14), (2, 14)), jnp.array([14, 9]))
  cut = kvjax.eviction.fixed_shape.truncate(cache, jnp.array([[[6], [9]]]))
  np.testing.assert_array_equal(np.asarray(cut.length)[0, :, 0], [6, 9])
  assert kvjax.read_sequence(cut, 0, 0, 0)[2].tolist() == list(range(6))
  assert int(cut.pages_in_use().sum()) == 2 + 3
  assert_cache_invariants(cut)


@dataclasses.dataclass(frozen=True)
class _SecondSpanOnly(policies.KVzip):
  """kvzip with one reconstruction pass: tokens 64:128 of each row, attending to the sink
  page, the `lookback` tokens before the span and the span only
  (`ContextReader.read_after_span`)."""

  def score_context(self, reader, state, context, progress=None):
    state = reader.read(state, context, observe=False)
    state = state.replace(
        cache=state.cache.with_slots(score=jnp.zeros_like(state.cache.slot("score")))
    )
    rows = [row[64:128] or [1] for row in context.ids]  # a row shorter than 64: one token
    piece = kvjax.runtime.prompts.EncodedPrompts(
        rows, [[False] * len(r) for r in rows], [[0] * len(r) for r in rows]
    )
    position = state.position
    state = reader.read_after_span(
        state, piece, start=64, span=64, sink=4, lookback=self.lookback, chunk=80
    )
    return state.replace(position=position)


@pytest.mark.parametrize("lookback", [0, 32])
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_a_chunk_pass_scores_only_the_sink_page_and_its_own_stretch(tiny, lookback):
  model, tokenizer = tiny
  long, short = tokenizer.encode(CONTEXT)[:200], tokenizer.encode(CONTEXT)[:50]
  policy = _SecondSpanOnly(chunk=64, lookback=lookback)
  spec = kvjax.CompressionSpec(policy=policy, budget=0.5, sink=4, recent=8)
  scores, valid = kvjax.runtime.session.context_scores(
      model, [long, short], spec, tokenizer=tokenizer
  )
  # The table is back as it was: every context token live, nothing past it.
  np.testing.assert_array_equal(valid[:, 0].sum(-1), 200)
  np.testing.assert_array_equal(valid[:, 1].sum(-1), 50)
  seen = scores > 0  # [L, B, H, N]: attention probabilities are positive where attended
  stretch = np.zeros(scores.shape[-1], bool)
  stretch[:16] = stretch[64 - lookback : 128] = True  # the sink's page, lookback and span
  assert seen[:, 0][..., stretch[:200].nonzero()[0]].all()
  assert not seen[:, 0][..., ~stretch].any()
  # The short row ends before the span: its pass saw its sink page and its lookback only.
  assert seen[:, 1][..., stretch[:50].nonzero()[0]].all()
  assert not seen[:, 1][
      ..., ~stretch[: scores.shape[-1]] | (np.arange(scores.shape[-1]) >= 50)
  ].any()


@pytest.mark.slow  # ~9 s: -m slow
def test_chunk_and_context_reconstruction_agree_when_one_chunk_holds_the_context(tiny):
  model, tokenizer = tiny
  ids = tokenizer.encode(CONTEXT)[:120]
  got = {
      attend_to: kvjax.runtime.session.context_scores(
          model,
          [ids],
          kvjax.CompressionSpec(
              policy=policies.KVzip(chunk=128, attend_to=attend_to), budget=0.5, sink=4, recent=8
          ),
          tokenizer=tokenizer,
      )[0]
      for attend_to in ("chunk", "context")
  }
  np.testing.assert_allclose(got["chunk"], got["context"], rtol=1e-5, atol=1e-7)


def test_kvzip_refuses_a_bad_attend_to():
  with pytest.raises(ValueError, match="attend_to must be one of"):
    policies.KVzip(attend_to="everything")
  for bad in ({"chunk": 0}, {"chunk": 1.5}, {"lookback": -16}, {"lookback": True}):
    with pytest.raises(ValueError, match=f"KVzip {next(iter(bad))} must be an int >="):
      policies.KVzip(**bad)
  with pytest.raises(ValueError, match="lookback=512 applies to attend_to='chunk'"):
    policies.get_policy("kvzip:attend_to=context,lookback=512")


def test_a_span_read_refuses_a_span_that_is_not_whole_pages(tiny):
  model, tokenizer = tiny
  reader = kvjax.runtime.steps.ContextReader(model, tokenizer, kvjax.seam.ModelShape.of(model))
  state = kvjax.prefill(model, [CONTEXT[:40]], kvjax.CompressionSpec(), tokenizer=tokenizer)
  for bad in (
      {"start": 8, "span": 16},
      {"start": 16, "span": 0},
      {"start": 16, "span": 16, "lookback": 3},
  ):
    with pytest.raises(ValueError, match="must be whole pages of 16 tokens"):
      reader.read_after_span(state, None, sink=4, **{"lookback": 0, **bad})


def test_head_output_gram_gives_the_norm_of_what_a_value_adds_to_the_residual(tiny):
  model, _ = tiny
  c = model.config
  v = np.random.default_rng(0).normal(size=(5, c.head_dim)).astype(np.float32)
  for layer in (0, 1):
    gram = np.asarray(model.head_output_gram(jnp.int32(layer)))  # [Hq, D, D]
    wo = np.asarray(model.layers[layer]["wo"][...]).reshape(c.n_heads, c.head_dim, -1)
    for h in range(c.n_heads):
      direct = np.linalg.norm(v @ wo[h], axis=-1)
      via_gram = np.sqrt(np.einsum("nd,de,ne->n", v, gram[h], v))
      np.testing.assert_allclose(via_gram, direct, rtol=1e-4)


def test_kvzip_plus_weighs_each_key_by_its_value_through_the_output_projection():
  cfg = kvjax.CacheConfig(page_size=4, max_tokens=8)
  cache = kvjax.init_cache(cfg, 1, 1, 1, 2, chunk=8, slots=policies.KVzipPlus.slots)
  v = jnp.asarray([[3.0, 4.0], [1.0, 0.0], [0.0, 2.0]])[None, :, None, :]  # [1, 3, 1, 2]
  cache = kvjax.append(cache, jnp.zeros_like(v)[None], v[None], jnp.arange(3)[None])
  head_probs = jnp.asarray([[[[0.5, 0.3, 0.2, 0, 0, 0, 0, 0]], [[0.1, 0.8, 0.1, 0, 0, 0, 0, 0]]]])
  gram = jnp.stack([jnp.eye(2), 4 * jnp.eye(2)])  # head 1's output doubles a value's norm
  stats = AttentionStats(
      layer=jnp.int32(0),
      q=jnp.zeros((1, 1, 2, 2)),
      out=jnp.zeros((1, 1, 2, 2)),
      probs=head_probs.sum(1, keepdims=True),
      head_probs=head_probs,
      num_new=jnp.array([1], jnp.int32),
      head_output=gram,
  )
  cache = policies.KVzipPlus().observe(cache, stats)
  score = np.asarray(kvjax.logical_view(cache, cache.slot("score")))[0, 0, 0, :3]
  # max over the two query heads of prob x ||W_O^h v||: norms 5, 1, 2 (head 0), doubled (1).
  np.testing.assert_allclose(score, [max(0.5 * 5, 0.1 * 10), max(0.3, 0.8 * 2), max(0.4, 0.1 * 4)])


def test_kvzip_plus_compresses_and_refuses_a_model_without_the_projection(tiny):
  model, tokenizer = tiny
  spec = kvjax.CompressionSpec(policy="kvzip_plus", budget=0.25, sink=4, recent=8)
  state = kvjax.prefill(model, [CONTEXT], spec, tokenizer=tokenizer, reserve=16)
  assert_compressed_once(state, len(tokenizer.encode(CONTEXT)))

  class NoProjection:

    def __init__(self, model):
      self.config, self.run = model.config, model.run

  with pytest.raises(ValueError, match="head_output_gram"):
    spec.policy.check_model(NoProjection(model))


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_chunk_reconstruction_scores_a_context_that_fills_the_model(tiny):
  """Each pass follows its own span, so a context the length of the model's window is
  scored; repeating it after the whole context would leave no room."""
  model, tokenizer = tiny
  ids = (tokenizer.encode(CONTEXT) * 4)[: model.config.max_context - 8]
  spec = kvjax.CompressionSpec(policy="kvzip", budget=0.25, sink=4, recent=8)
  state = kvjax.prefill(model, [ids], spec, tokenizer=tokenizer, reserve=4)
  assert_compressed_once(state, len(ids))
  with pytest.raises(ValueError, match="leaves no room in the model context"):
    kvjax.prefill(model, [ids], spec.replace(policy="kvzip:attend_to=context"), tokenizer=tokenizer)
