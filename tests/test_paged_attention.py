import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import paged_pool, small_paged_args

from pallas_kernels.paged_attention import paged_attention_reference


def _paged_problem(rng, page_size, hkv, group, lengths, t, d=16, extra_pages=3):
  """Random pool with NaN everywhere a sequence does not own, pages shuffled; numpy
  (q, k_pages, v_pages, page_table, lengths, dense_k, dense_v)."""
  b = len(lengths)
  m = max(-(-max(lengths) // page_size), 1) + 1
  num_pages = b * hkv * m + extra_pages
  return paged_pool(rng, page_size, hkv, group, lengths, m, d, num_pages, t=t)


def _dense_attention(q, dense_k, dense_v, lengths, num_queries, hkv, window=0):
  """float64 attention over contiguous K/V: query t of row b sees its first
  lengths[b] - num_queries[b] + t + 1 tokens (the last `window` of them, if > 0)."""
  b, t, hq, d = q.shape
  group = hq // hkv
  out = np.zeros((b, t, hq, d))
  probs = np.zeros((b, hkv, t, max(lengths)))
  for bi in range(b):
    for ti in range(num_queries[bi]):
      visible = lengths[bi] - num_queries[bi] + ti + 1
      for hi in range(hq):
        kv = hi // group
        first = max(0, visible - window) if window else 0
        k = dense_k[bi, kv][first:visible].astype(np.float64)
        v = dense_v[bi, kv][first:visible].astype(np.float64)
        logits = k @ q[bi, ti, hi].astype(np.float64) / np.sqrt(d)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        out[bi, ti, hi] = p @ v
        probs[bi, kv, ti, first:visible] += p
  return out, probs


@pytest.mark.parametrize(
    "page_size, group, lengths, t",
    [
        (ps, g, lengths, t)
        for ps, g in itertools.product((1, 4, 16), (1, 3, 4))
        for lengths, t in (
            ([1], 1),  # a single token
            ([ps], 1),  # exactly one page
            ([ps + 1, 2 * ps - 1], 1),  # page boundaries
            ([3 * ps, 1, 2 * ps + 3], 1),  # ragged batch, full pages
            ([3 * ps + 2, 2 * ps], 5 if ps > 1 else 2),  # prefill chunks, causal inside
        )
    ],
)
def test_matches_dense_attention_with_nan_poisoned_pool(page_size, group, lengths, t):
  rng = np.random.default_rng(page_size * 100 + group * 10 + len(lengths) + t)
  hkv = 2
  t = min(t, min(lengths))
  q, kp, vp, table, lens, dk, dv = _paged_problem(rng, page_size, hkv, group, lengths, t)
  num_queries = np.full((len(lengths),), t, np.int32)
  out, probs = jax.jit(paged_attention_reference)(q, kp, vp, table, lens, num_queries)
  want_out, want_probs = _dense_attention(q, dk, dv, lengths, num_queries, hkv)
  assert np.isfinite(out).all() and np.isfinite(probs).all()
  np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=0)
  np.testing.assert_allclose(probs[..., : max(lengths)], want_probs, atol=1e-5, rtol=0)
  assert (probs[..., max(lengths) :] == 0).all()


@pytest.mark.parametrize(
    "page_size, lengths, t, window",
    [
        (4, [13, 6, 20], 5, 3),  # a window narrower than the chunk
        *(
            pytest.param(*case, marks=pytest.mark.slow)
            for case in [
                (4, [13, 6, 20], 5, 8),  # the window's edge inside a page, before the chunk
                (1, [9, 30], 4, 7),
                (16, [40, 3], 6, 17),  # a window past some rows' lengths: everything visible
            ]
        ),
        (4, [13, 6, 20], 1, 5),  # decode
    ],
)
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_a_sliding_window_sees_only_its_latest_keys_on_every_reference_path(
    page_size, lengths, t, window
):
  """The reference, its lse, the live-blocks loop and the live prefix agree with dense
  attention over each query's last `window` keys (a traced window too); window 0 is full."""
  from pallas_kernels.paged_attention import (
      paged_attention,
      paged_attention_live_blocks,
      paged_attention_lse_reference,
  )

  rng = np.random.default_rng(window * 10 + t)
  hkv = 2
  q, kp, vp, table, lens, dk, dv = _paged_problem(rng, page_size, hkv, 3, lengths, t)
  num = np.minimum(np.full((len(lengths),), t, np.int32), lengths)
  want_out, want_probs = _dense_attention(q, dk, dv, lengths, num, hkv, window)
  out, probs = jax.jit(paged_attention_reference)(q, kp, vp, table, lens, num, window=window)
  np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=0)
  np.testing.assert_allclose(probs[..., : max(lengths)], want_probs, atol=1e-5, rtol=0)
  lse = paged_attention_lse_reference(q, kp, table, lens, num, window=window)
  for block_tokens in (1, 8, 512):
    got, got_lse = paged_attention_live_blocks(
        q, kp, vp, table, lens, num, window=jnp.int32(window), block_tokens=block_tokens
    )
    np.testing.assert_allclose(got, want_out, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got_lse, lse, atol=1e-5, rtol=0)
  traced = jax.jit(
      lambda w: paged_attention(q, kp, vp, table, lens, num, return_lse=True, window=w)
  )
  got, got_probs, got_lse = traced(jnp.int32(window))  # decode: the live prefix
  np.testing.assert_allclose(got, want_out, atol=1e-5, rtol=0)
  np.testing.assert_allclose(got_lse, lse, atol=1e-5, rtol=0)
  full_out, _ = _dense_attention(q, dk, dv, lengths, num, hkv)
  np.testing.assert_allclose(traced(jnp.int32(0))[0], full_out, atol=1e-5, rtol=0)


def test_ragged_queries_padding_rows_are_zero():
  rng = np.random.default_rng(7)
  q, kp, vp, table, lens, dk, dv = _paged_problem(rng, 4, 1, 2, [9, 6], 4)
  num_queries = np.array([4, 2], np.int32)
  out, probs = paged_attention_reference(q, kp, vp, table, lens, num_queries)
  want_out, want_probs = _dense_attention(q, dk, dv, [9, 6], num_queries, 1)
  np.testing.assert_allclose(out, want_out, atol=1e-5)
  np.testing.assert_allclose(probs[..., :9], want_probs, atol=1e-5)
  assert (np.asarray(out)[1, 2:] == 0).all() and (np.asarray(probs)[1, :, 2:] == 0).all()


def test_hand_computed_tiny_case():
  # One kv head, one query head, d=1: logits = q * k / 1 = (0, log 3) -> probs (1/4, 3/4).
  k_pages = jnp.array([[[np.nan]], [[0.0]], [[1.0]]], jnp.float32)  # page 0 = null
  v_pages = jnp.array([[[np.nan]], [[4.0]], [[8.0]]], jnp.float32)
  q = jnp.full((1, 1, 1, 1), np.log(3.0), jnp.float32)
  table = jnp.array([[[2, 1, 0]]], jnp.int32)  # logical order: page 2 then page 1
  out, probs = paged_attention_reference(q, k_pages, v_pages, table, jnp.array([[2]]))
  np.testing.assert_allclose(probs[0, 0, 0], [0.75, 0.25, 0.0], rtol=1e-6)
  np.testing.assert_allclose(out[0, 0, 0], [0.75 * 8 + 0.25 * 4], rtol=1e-6)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(q=np.zeros((1, 1, 4), np.float32)), ValueError, r"q must be \[B, T, Hq, D\]"),
        (
            dict(k_pages=np.zeros((5, 4, 7), np.float32)),
            ValueError,
            r"k_pages must be \[P, S, D=8\]",
        ),
        (dict(v_pages=np.zeros((5, 2, 8), np.float32)), ValueError, "v_pages shape"),
        (dict(page_table=np.zeros((2, 2, 3), np.int32)), ValueError, r"page_table must be \[B=1"),
        (
            dict(page_table=np.zeros((1, 3, 3), np.int32)),
            ValueError,
            "Hq=4 must be a multiple of kv heads Hkv=3",
        ),
        (dict(lengths=np.zeros((1,), np.int32)), ValueError, r"lengths must be \[B, Hkv\]"),
        (dict(num_queries=np.zeros((2,), np.int32)), ValueError, r"num_queries must be \[B\]"),
        (dict(page_table=np.zeros((1, 2, 3), np.float32)), TypeError, "page_table must be integer"),
        (dict(q=np.zeros((1, 1, 4, 8), np.int32)), TypeError, "q must be floating point"),
    ],
)
def test_rejects_bad_arguments(change, error, match):
  with pytest.raises(error, match=match):
    paged_attention_reference(**small_paged_args(change, num_queries=None))


@pytest.mark.parametrize("group_size", [1, 4])
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_attention_over_an_evicted_cache_matches_its_surviving_tokens(group_size):
  import kvjax

  rng = np.random.default_rng(11)
  l, b, hkv, d, t = 1, 2, 2, 8, 30
  cfg = kvjax.CacheConfig(
      page_size=4, max_tokens=48, budget=12, sink=1, recent=2, group_size=group_size
  )
  cache = kvjax.init_cache(cfg, l, b, hkv, d, chunk=t)
  k = jnp.asarray(rng.normal(size=(l, b, t, hkv, d)), jnp.float32)
  cache = kvjax.append(cache, k, -k, jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.array([30, 21]))
  cache = kvjax.evict(cache, scores=jnp.asarray(rng.random((l, b, hkv, 48)), jnp.float32))
  # Poison every free page so that only owned slots can reach the result.
  free = cache.pages.free_pages[: int(cache.pages.num_free)]
  cache = cache.replace(
      k_pages=cache.k_pages.at[free].set(np.nan), v_pages=cache.v_pages.at[free].set(np.nan)
  )
  q = jnp.asarray(rng.normal(size=(b, 1, hkv * 2, d)), jnp.float32)
  out, probs = paged_attention_reference(
      q, cache.k_pages, cache.v_pages, cache.page_table[0], cache.length[0]
  )
  dense_k, dense_v = {}, {}
  for bi in range(b):
    for h in range(hkv):
      dense_k[bi, h], dense_v[bi, h], _ = kvjax.read_sequence(cache, 0, bi, h)
  lengths = [int(cache.length[0, bi, 0]) for bi in range(b)]
  want_out, want_probs = _dense_attention(np.asarray(q), dense_k, dense_v, lengths, [1, 1], hkv)
  np.testing.assert_allclose(out, want_out, atol=1e-5)
  np.testing.assert_allclose(probs[..., : max(lengths)], want_probs, atol=1e-5)


def _live_block_cases():
  """Page sizes x query groups x sequence shapes x block sizes (a page per block .. every
  page in one block); by default seven of them that take every page size, group, shape and
  block size at least once (the whole product is in the slow set)."""
  cases = []
  for ps, g in itertools.product((1, 4, 16), (1, 3)):
    for i, (lengths, t) in enumerate(
        (
            ([1], 1),
            ([ps + 1, 2 * ps - 1], 1),
            ([3 * ps, 1, 2 * ps + 3], 1),
            ([3 * ps + 2, 2 * ps], 5 if ps > 1 else 2),
            ([0, 2 * ps], 1),  # an empty sequence
        )
    ):
      for j, bt in enumerate((1, 16, 256)):
        # by default seven cases: every page size, group, shape and block size once or more
        default = (i + g + ps) % 3 == j and (i + (g == 3)) % 2 == 0
        default = default and ((i + ps) % 2 == 1 or (i, ps) == (4, 1))
        marks = () if default else (pytest.mark.slow,)
        cases.append(pytest.param(ps, g, lengths, t, bt, marks=marks))
  return cases


@pytest.mark.parametrize("page_size, group, lengths, t, block_tokens", _live_block_cases())
def test_live_blocks_match_the_reference_with_nan_poisoned_pool(
    page_size, group, lengths, t, block_tokens
):
  from pallas_kernels.paged_attention import (
      paged_attention_live_blocks,
      paged_attention_lse_reference,
  )

  rng = np.random.default_rng(page_size * 100 + group * 10 + len(lengths) + t + block_tokens)
  t = max(1, min(t, min(x for x in lengths if x) or 1))
  q, k_pages, v_pages, table, lens, _, _ = _paged_problem(
      rng, page_size, 2, group, [max(x, 1) for x in lengths], t
  )
  lens = np.asarray(lens).copy()
  lens[np.asarray(lengths) == 0] = 0
  num_queries = np.where(np.asarray(lengths) == 0, 0, t).astype(np.int32)
  args = tuple(map(jnp.asarray, (q, k_pages, v_pages, table, lens, num_queries)))
  out, lse = jax.jit(paged_attention_live_blocks, static_argnames="block_tokens")(
      *args, block_tokens=block_tokens
  )
  ref_out, _ = paged_attention_reference(*args)
  ref_lse = paged_attention_lse_reference(args[0], args[1], args[3], args[4], args[5])
  assert not np.isnan(np.asarray(out)).any()
  np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)


def _key_max_cases():
  """Layouts x windows x block sizes; six spread over them by default, the product under -m
  slow."""
  cases = []
  for i, (ps, g, lengths, t, window, bt, before) in enumerate(
      itertools.product(
          (1, 4), (1, 3), ([3, 9], [13, 1, 8]), (1, 3), (0, 5), (4, 256), (False, True)
      )
  ):
    marks = () if i % 23 == 0 else (pytest.mark.slow,)
    cases.append(pytest.param(ps, g, lengths, t, window, bt, before, marks=marks))
  return cases


@pytest.mark.parametrize(
    "page_size, group, lengths, t, window, block_tokens, before_chunk", _key_max_cases()
)
def test_key_max_is_the_largest_probability_a_kv_heads_live_queries_pay(
    page_size, group, lengths, t, window, block_tokens, before_chunk
):
  """Exactly the max, over each kv head's query heads and its live queries, of the
  reference's per-head probabilities (with `before_chunk`, on the slots cached before the
  queries' chunk, 0 on the chunk's own); NaN in every page a sequence does not own never
  reaches it; padding queries (a row with fewer) pay nothing."""
  from pallas_kernels.paged_attention import (
      paged_attention_key_max,
      paged_attention_live_blocks,
  )

  rng = np.random.default_rng(page_size * 1000 + group * 100 + sum(lengths) + t + window)
  hkv = 2
  q, k_pages, v_pages, table, lens, _, _ = _paged_problem(rng, page_size, hkv, group, lengths, t)
  num_queries = np.minimum(np.full(len(lengths), t), np.asarray(lengths)).astype(np.int32)
  num_queries[-1] = 1  # a row with padding queries when t > 1
  args = tuple(map(jnp.asarray, (q, k_pages, v_pages, table, lens, num_queries)))
  _, lse = paged_attention_live_blocks(*args, window=window)
  key_max = jax.jit(paged_attention_key_max, static_argnames=("block_tokens", "before_chunk"))(
      args[0], args[1], args[3], args[4], args[5], lse, block_tokens=block_tokens,
      window=window, before_chunk=before_chunk,
  )  # fmt: skip
  _, probs = paged_attention_reference(*args, per_query_head=True, window=window)
  b, hq, tt, n = probs.shape
  live = (np.arange(tt)[None, :] < num_queries[:, None])[:, None, :, None]
  expected = np.where(live, np.asarray(probs), 0.0).reshape(b, hkv, group * tt, n).max(axis=2)
  if before_chunk:  # [B, Hkv, N]: the slots cached before each row's chunk
    before = np.arange(n) < (np.asarray(lens) - num_queries[:, None])[..., None]
    assert (expected[~before] > 0).any()  # the chunk's own slots are paid: zeroing matters
    expected = np.where(before, expected, 0.0)
  assert key_max.shape == (b, hkv, n) and not np.isnan(np.asarray(key_max)).any()
  np.testing.assert_allclose(key_max, expected, rtol=1e-5, atol=1e-6)


def test_key_max_checks_the_lse_shape():
  from pallas_kernels.paged_attention import paged_attention_key_max

  q, k_pages = np.zeros((1, 2, 4, 8), np.float32), np.zeros((3, 4, 8), np.float32)
  table, lengths = np.ones((1, 2, 2), np.int32), np.full((1, 2), 4, np.int32)
  with pytest.raises(ValueError, match=r"lse must be \[B, T, Hq\] = \(1, 2, 4\), got \(1, 4\)"):
    paged_attention_key_max(q, k_pages, table, lengths, None, np.zeros((1, 4), np.float32))


@pytest.mark.parametrize(
    "option, error, match",
    [
        ({"block_tokens": 0}, ValueError, "block_tokens must be an int >= 1, got 0"),
        ({"block_tokens": 2.5}, ValueError, "block_tokens must be an int >= 1, got 2.5"),
        ({"before_chunk": "yes"}, TypeError, "before_chunk must be a bool, got 'yes'"),
    ],
)
def test_key_max_rejects_bad_options(option, error, match):
  from pallas_kernels.paged_attention import paged_attention_key_max

  q, k_pages = np.zeros((1, 2, 4, 8), np.float32), np.zeros((3, 4, 8), np.float32)
  table, lengths = np.ones((1, 2, 2), np.int32), np.full((1, 2), 4, np.int32)
  lse = np.zeros((1, 2, 4), np.float32)
  with pytest.raises(error, match=match):
    paged_attention_key_max(q, k_pages, table, lengths, None, lse, **option)


def test_live_blocks_read_only_live_blocks():
  """The loop's trip count is the live blocks: NaN in every block past the longest
  sequence (even in pages the table points at) never reaches the output."""
  from pallas_kernels.paged_attention import paged_attention_live_blocks

  rng = np.random.default_rng(0)
  d, ps = 8, 4
  k_pages = rng.normal(size=(9, ps, d)).astype(np.float32)
  v_pages = rng.normal(size=(9, ps, d)).astype(np.float32)
  k_pages[5:], v_pages[5:] = np.nan, np.nan
  table = np.array([[[1, 2, 5, 6, 7, 8]]], np.int32)  # pages 5.. lie past the length
  q = rng.normal(size=(1, 1, 1, d)).astype(np.float32)
  lengths = np.array([[8]], np.int32)
  out, _ = paged_attention_live_blocks(q, k_pages, v_pages, table, lengths, block_tokens=8)
  k = k_pages[[1, 2]].reshape(8, d)
  p = np.exp(k @ q[0, 0, 0] / np.sqrt(d))
  np.testing.assert_allclose(out[0, 0, 0], (p / p.sum()) @ v_pages[[1, 2]].reshape(8, d), rtol=1e-5)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"q": np.zeros((1, 1, 3, 8), np.float32)}, "divisible|multiple|Hq"),
        ({"block_tokens": 0}, "block_tokens must be an int >= 1, got 0"),
    ],
)
def test_live_blocks_reject_bad_arguments(change, match):
  from pallas_kernels.paged_attention import paged_attention_live_blocks

  args = {
      "q": np.zeros((1, 1, 4, 8), np.float32),
      "k_pages": np.zeros((3, 4, 8), np.float32),
      "v_pages": np.zeros((3, 4, 8), np.float32),
      "page_table": np.ones((1, 2, 2), np.int32),
      "lengths": np.full((1, 2), 4, np.int32),
  }
  block_tokens = change.pop("block_tokens", 8)
  with pytest.raises(ValueError, match=match):
    paged_attention_live_blocks(**{**args, **change}, block_tokens=block_tokens)


# One page layout in the default suite (the kernel tests cover page sizes over parameter
# products in interpret mode); one page a token and 16-token pages under -m slow.
@pytest.mark.parametrize(
    "page_size, group",
    [
        pytest.param(1, 1, marks=pytest.mark.slow),
        (4, 3),
        pytest.param(16, 3, marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize(
    "lengths",  # under the narrowest prefix .. the whole table (-m slow; ~18 s each)
    [
        *(pytest.param(x, marks=pytest.mark.slow) for x in ([1], [3, 9])),
        pytest.param([17, 0, 33], marks=pytest.mark.slow),
        pytest.param([64, 5], marks=pytest.mark.slow),
    ],
)
def test_decode_reads_a_live_prefix_and_matches_the_reference(
    monkeypatch, page_size, group, lengths
):
  """One query per row reads, per kv head, the narrowest power-of-two prefix of the table
  holding the head's live pages: outputs, probabilities (zero past the prefix) and lse
  equal the reference's over the whole (NaN-poisoned) table, for every prefix width, kv
  heads of different lengths and an empty sequence."""
  from pallas_kernels.paged_attention import dispatch as attention

  monkeypatch.setattr(attention, "PREFIX_MIN_TOKENS", 4)  # several widths in a small table
  rng = np.random.default_rng(page_size * 10 + group + len(lengths))
  m = -(-64 // page_size)  # 64 tokens of table: widths of 4, 8, .., 64 tokens
  b = len(lengths)
  q, kp, vp, table, lens, _, _ = paged_pool(
      rng, page_size, 2, group, [max(x, 1) for x in lengths], m, 16, b * 2 * m + 3
  )
  lens[np.asarray(lengths) == 0] = 0
  # Kv head 1 holds a third of head 0's tokens (a budget per head): its own, narrower
  # prefix; the slots it no longer holds are NaN.
  for row in range(b):
    short = lens[row, 1] // 3
    for slot in range(short, lens[row, 1]):
      page = table[row, 1, slot // page_size]
      kp[page, slot % page_size] = vp[page, slot % page_size] = np.nan
    lens[row, 1] = short
  num_queries = (np.asarray(lengths) > 0).astype(np.int32)
  args = tuple(map(jnp.asarray, (q, kp, vp, table, lens, num_queries)))
  widths = attention.prefix_widths(m, page_size)
  assert widths[-1] == m and len(widths) > 1
  for per_query_head, heads_per_step in [(False, 1), (True, 1), (False, 2), (True, 2)]:
    # One kv head per step (CPU), or both (accelerators: one prefix for the group).
    run = jax.jit(
        functools.partial(
            attention.paged_attention_live_prefix,
            per_query_head=per_query_head,
            return_lse=True,
            heads_per_step=heads_per_step,
        )
    )
    out, probs, lse = run(*args)
    ref_out, ref_probs = paged_attention_reference(*args, per_query_head=per_query_head)
    ref_lse = attention.paged_attention_lse_reference(args[0], args[1], args[3], args[4], args[5])
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(probs, ref_probs, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
  out, probs = attention.paged_attention(*args, return_probs=False, impl="ref")
  assert probs is None
  np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
  # Eagerly, from NumPy arrays (as `kvjax doctor` calls it): nothing indexes them with a
  # traced loop index.
  host = (q, kp, vp, table, lens, num_queries)
  out, _ = attention.paged_attention(*host, per_query_head=True, impl="ref")
  np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)


def test_the_live_prefix_reads_one_query_per_row_only():
  from pallas_kernels.paged_attention import paged_attention_live_prefix

  rng = np.random.default_rng(0)
  q, kp, vp, table, lens, _, _ = paged_pool(rng, 4, 2, 1, [5, 9], 4, 16, 20, t=2)
  with pytest.raises(ValueError, match=r"one query per row: q must be \[B, 1, Hq, D\], got \(2, 2"):
    paged_attention_live_prefix(*map(jnp.asarray, (q, kp, vp, table, lens)))
  with pytest.raises(ValueError, match="lengths"):
    paged_attention_live_prefix(*map(jnp.asarray, (q[:, :1], kp, vp, table, lens[:1])))
  with pytest.raises(ValueError, match="heads_per_step must be an int >= 1 dividing Hkv=2"):
    paged_attention_live_prefix(
        *map(jnp.asarray, (q[:, :1], kp, vp, table, lens)), heads_per_step=3
    )


def test_a_windowed_decode_on_the_kernel_path_takes_the_reference_only_where_windowed():
  """impl='pallas' with a traced window: a sliding layer (window > 0) is answered by the
  reference, a full layer (window 0) by the kernel (TPU interpreter), each exactly."""
  import kernel_helpers as kh
  from pallas_kernels.paged_attention import paged_attention

  rng = np.random.default_rng(3)
  lengths, hkv = [13, 6, 20], 2
  q, kp, vp, table, lens, dk, dv = _paged_problem(rng, 4, hkv, 3, lengths, 1)
  num = np.ones((3,), np.int32)
  run = jax.jit(
      lambda w: paged_attention(
          q, kp, vp, table, lens, num, impl="pallas", interpret=kh.kernel_interpret(), window=w
      )
  )
  for window in (5, 0):
    out, probs = run(jnp.int32(window))
    want_out, want_probs = _dense_attention(q, dk, dv, lengths, num, hkv, window)
    np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=0)
    np.testing.assert_allclose(probs[..., : max(lengths)], want_probs, atol=1e-5, rtol=0)
