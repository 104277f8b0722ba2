"""The served batch (kvjax.serving._batch): requests prefilled alone, inserted into free rows
of one pool, decoded together, released; a row's tokens and logits do not depend on its
neighbours, and a released row leaves nothing behind."""

import numpy as np
import pytest

import kvjax
from kvjax.eviction.budgets import NEVER
from kvjax.seam import ModelShape
from kvjax.serving import _batch
from kvjax.testing import ByteTokenizer, assert_cache_invariants, tiny_llama

TOK = ByteTokenizer()
STOP = np.asarray([-1], np.int32)


@pytest.fixture(scope="module")
def model():
  return tiny_llama(max_context=256, qk_scale=20)


def _plan(model, spec):
  return spec.plan(ModelShape.of(model), batch=1, longest=64, reserve=64)


def _prefill(model, prompt, spec):
  return kvjax.prefill(model, [prompt], spec, tokenizer=TOK)


def _serve(model, spec, schedule, rows=3, steps=4, num_pages=200, narrow=False):
  """Runs `schedule`: (row, prompt, max_tokens) in order of arrival, each inserted as soon as
  its row is free. Returns {index: (tokens, final logits)} and the batch at the end.
  `narrow`: each round computes only the rows up to the last active one and reads the
  first 8 entries of their tables (64 tokens: every page they hold), as the engine does."""
  batch = _batch.empty_batch(model, _plan(model, spec), rows, num_pages, max_tokens=256)
  budget = NEVER if not spec.evicts else spec.budget
  pending = list(enumerate(schedule))
  holder, out, logits, longest = {}, {}, {}, 0
  while pending or holder:
    for i, (row, prompt, max_tokens) in list(pending):
      if row not in holder:
        request = _prefill(model, prompt, spec)
        batch = _batch.insert(
            batch, request, row, max_tokens=max_tokens, budget=budget, sampling=kvjax.Sampling()
        )
        holder[row], out[i] = i, []
        pending.remove((i, (row, prompt, max_tokens)))
    width, depth = (_batch.width_for(holder, rows), 8) if narrow else (None, None)
    batch, stepped = _batch.run_steps(model, batch, STOP, steps, width=width, depth=depth)
    longest = max(longest, int(np.asarray(batch.state.cache.length).max()))
    count, tokens = np.asarray(stepped.count), np.asarray(stepped.tokens)
    remaining = np.asarray(batch.remaining)
    for row, i in list(holder.items()):
      out[i] += tokens[row, : count[row]].tolist()
      if remaining[row] == 0:
        logits[i] = np.asarray(batch.state.logits[row])
        del holder[row]
        batch = _batch.release(batch, row)
  return {i: (out[i], logits[i]) for i in out}, batch, longest


def test_a_rows_tokens_and_logits_do_not_depend_on_its_neighbours(model):
  spec = kvjax.CompressionSpec(page_size=8)
  target = "the quick brown fox jumps over the lazy dog"
  first, _, _ = _serve(model, spec, [(1, target, 10), (0, "hello there", 3), (0, "abc " * 9, 9)])
  second, _, _ = _serve(model, spec, [(1, target, 10), (0, "zz top " * 7, 6), (0, "x", 9)])
  assert len(first[0][0]) == 10 and first[0][0] == second[0][0]
  np.testing.assert_array_equal(first[0][1], second[0][1])
  # The request alone (kvjax.decode, its own cache) generates the same tokens.
  state, result = kvjax.decode(model, _prefill(model, target, spec), 10)
  assert result.tokens[0] == first[0][0]
  np.testing.assert_allclose(np.asarray(state.logits[0]), first[0][1], atol=1e-5)
  # A row reused after a release reads nothing of the request before it.
  alone, _, _ = _serve(model, spec, [(0, "abc " * 9, 9)])
  assert alone[0][0] == first[2][0]
  np.testing.assert_array_equal(alone[0][1], first[2][1])
  # Rounds that compute only the first 4 of 6 rows (`MIN_WIDTH`) and read the first 8 of
  # 32 table entries: the same tokens (the matmuls' width may change the last bits of the
  # logits).
  narrow, batch, _ = _serve(
      model, spec, [(1, target, 10), (0, "hello there", 3), (0, "abc " * 9, 9)], rows=6, narrow=True
  )
  assert [narrow[i][0] for i in range(3)] == [first[i][0] for i in range(3)]
  np.testing.assert_allclose(narrow[0][1], first[0][1], atol=1e-5)
  assert int(batch.state.cache.pages.num_free) == batch.state.cache.num_pages - 1


@pytest.mark.slow
def test_a_running_budget_per_row_bounds_that_row_only(model):
  spec = kvjax.CompressionSpec(policy="h2o", budget=16, page_size=8)
  long = "the quick brown fox jumps over the lazy dog " * 2
  results, batch, longest = _serve(model, spec, [(0, long, 40), (1, long, 40)], steps=8)
  assert len(results[0][0]) == 40 and results[0][0] == results[1][0]  # one request, two rows
  assert longest <= 16 + batch.state.cache.config.margin  # evicted as it went
  _, alone = kvjax.decode(model, _prefill(model, long, spec), 40)
  assert alone.tokens[0] == results[0][0]


@pytest.mark.slow
def test_many_requests_leave_no_row_or_page_held(model):
  spec = kvjax.CompressionSpec(page_size=8)
  schedule = [(i % 3, f"request {i} " * (1 + i % 4), 1 + i % 5) for i in range(24)]
  results, batch, _ = _serve(model, spec, schedule)
  assert len(results) == 24 and all(len(tokens) >= 1 for tokens, _ in results.values())
  assert not np.asarray(batch.active).any()
  assert int(np.asarray(batch.state.cache.length).sum()) == 0
  assert int(batch.state.cache.pages.num_free) == batch.state.cache.num_pages - 1
  assert_cache_invariants(batch.state.cache)


def _two_rows(model, spec, num_pages, pages=(None, None)):
  """A batch of two rows over `num_pages` pages, each holding an 8-token prompt (one page a
  sequence) with 6 tokens to generate, at most `pages` pages each (None: the pool's)."""
  batch = _batch.empty_batch(model, _plan(model, spec), 2, num_pages, max_tokens=256)
  for row, prompt in enumerate(("abcdefgh", "zyxwvuts")):
    request = _prefill(model, prompt, spec)
    batch = _batch.insert(
        batch,
        request,
        row,
        max_tokens=6,
        budget=NEVER,
        sampling=kvjax.Sampling(),
        stops=False,
        pages=pages[row],
    )
  return batch


def test_a_row_that_would_pass_its_pages_stops_before_its_append_alone(model):
  spec = kvjax.CompressionSpec(page_size=8)
  # Row 0 may hold the 4 pages it holds (a reservation short of its next token's page).
  batch = _two_rows(model, spec, num_pages=200, pages=(4, None))
  free = int(batch.state.cache.pages.num_free)
  batch, stepped = _batch.run_steps(model, batch, STOP, 4)
  assert np.asarray(stepped.short).tolist() == [True, False]
  assert np.asarray(stepped.count).tolist() == [0, 4]  # nothing of row 0 appended
  assert int(batch.state.cache.status) == 0
  assert np.asarray(batch.state.cache.length)[:, 0].tolist() == [[8, 8], [8, 8]]
  assert int(batch.state.cache.pages.num_free) == free - 4  # row 1's four new pages only
  batch, stepped = _batch.run_steps(model, batch, STOP, 4)  # row 0 stays stopped
  assert np.asarray(stepped.count).tolist() == [0, 2]
  alone = kvjax.decode(model, _prefill(model, "zyxwvuts", spec), 6)[1].tokens[0]
  assert alone[4:] == np.asarray(stepped.tokens)[1, :2].tolist()


def test_an_append_the_pool_drops_fails_the_rows_that_appended_and_clears_the_status(model):
  spec = kvjax.CompressionSpec(page_size=8)
  # 8 usable pages: both rows hold them all, and their first append needs 8 more.
  batch = _two_rows(model, spec, num_pages=9)
  batch, stepped = _batch.run_steps(model, batch, STOP, 4)
  assert np.asarray(stepped.short).tolist() == [True, True]
  assert np.asarray(stepped.count).tolist() == [1, 1]  # the token whose append was dropped
  assert int(batch.state.cache.status) == 0  # acted on: nothing left for the next program
  assert np.asarray(batch.failed).tolist() == [True, True]
  batch, stepped = _batch.run_steps(model, batch, STOP, 4)
  assert np.asarray(stepped.count).tolist() == [0, 0]


def test_an_insert_the_pool_cannot_hold_leaves_the_row_free(model):
  spec = kvjax.CompressionSpec(page_size=8)
  batch = _batch.empty_batch(model, _plan(model, spec), 2, 4, max_tokens=256)  # 3 pages
  request = _prefill(model, "abcdefgh", spec)  # 4 sequences of a page each
  batch = _batch.insert(batch, request, 0, max_tokens=6, budget=NEVER, sampling=kvjax.Sampling())
  assert int(batch.state.cache.status) & 1  # OUT_OF_PAGES: `check_status` raises
  assert not np.asarray(batch.active).any()
  batch, stepped = _batch.run_steps(model, batch, STOP, 4)
  assert np.asarray(stepped.count).tolist() == [0, 0]
