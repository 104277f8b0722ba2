"""Progress as a context is read and scored: `progress(done, total)` covers the whole work
(the read, and a compress-once policy's scoring), reaches its end only when the last part
does, and never goes back; the CLI's bar says what it covers; `kvjax tune`'s estimate of
the time left."""

import types

import numpy as np
import pytest

import kvjax
from kvjax.cli import common
from kvjax.policies import KVzip
from kvjax.policies.kvzip import RECONSTRUCTION_PROMPT
from kvjax.runtime.steps import WorkProgress
from kvjax.testing import ByteTokenizer, tiny_llama
from kvjax.tuning import _eta

CONTEXT = "The vault code is 4812. Remember it while the filler goes on and on. " * 4


@pytest.fixture(scope="module")
def tiny():
  return tiny_llama(max_context=1024, n_layers=2), ByteTokenizer()


class Calls(list):
  """A progress callback that records its calls."""

  def __call__(self, done, total):
    self.append((done, total))


def _assert_covers(calls, total):
  """Calls in order, all against `total`, never going back, the last at the end."""
  assert calls, "progress was never called"
  assert {t for _, t in calls} == {total}
  done = [d for d, _ in calls]
  assert done == sorted(done) and 0 < done[0] and done[-1] == total


def test_a_plain_read_counts_its_tokens_chunk_by_chunk(tiny):
  model, tokenizer = tiny
  n = len(tokenizer.encode(CONTEXT))
  calls = Calls()
  kvjax.prefill(
      model, [CONTEXT], kvjax.CompressionSpec(prefill_chunk=64), tokenizer=tokenizer, progress=calls
  )
  assert calls == [(min(end, n), n) for end in range(64, n + 64, 64)]


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_kvzip_counts_the_read_then_every_reconstruction_pass(tiny):
  """Two rows: the longest is read, then repeated in passes of 64 tokens after the
  reconstruction prompt; the total counts all of it, up front."""
  model, tokenizer = tiny
  rows = [CONTEXT, CONTEXT[:100]]
  n = len(tokenizer.encode(CONTEXT))
  prompt = len(tokenizer.encode(RECONSTRUCTION_PROMPT))
  spec = kvjax.CompressionSpec(policy=KVzip(chunk=64), budget=0.5, prefill_chunk=64)
  calls = Calls()
  kvjax.prefill(model, rows, spec, tokenizer=tokenizer, progress=calls)
  passes = [prompt + min(64, n - start) for start in range(0, n, 64)]
  total = n + sum(passes)
  _assert_covers(calls, total)
  assert total > n
  # The read ends at n; each pass then reports its end, in one step per pass.
  done = [d for d, _ in calls]
  assert n in done and done[-len(passes) :] == list(n + np.cumsum(passes))


def test_expected_attention_counts_the_read_then_the_keys_scored(tiny):
  """The queries' statistics are gathered as the context is read; the keys are scored
  after it, layer by layer, and counted as the context's tokens again."""
  model, tokenizer = tiny
  n = len(tokenizer.encode(CONTEXT))
  spec = kvjax.CompressionSpec(policy="expected_attention", budget=0.5, prefill_chunk=64)
  calls = Calls()
  kvjax.prefill(model, [CONTEXT], spec, tokenizer=tokenizer, progress=calls)
  _assert_covers(calls, 2 * n)
  layers = model.config.n_layers
  assert [d for d, _ in calls][-layers:] == [n + n * (i + 1) // layers for i in range(layers)]


@pytest.mark.slow  # ~40 s beside other work: generate's own steps; the counting is kvzip's above
def test_generate_reports_the_same_progress(tiny):
  model, tokenizer = tiny
  n = len(tokenizer.encode(CONTEXT))
  spec = kvjax.CompressionSpec(policy=KVzip(chunk=64), budget=0.5, prefill_chunk=64)
  calls = Calls()
  kvjax.generate(model, tokenizer, [CONTEXT], spec, max_new_tokens=2, progress=calls)
  _assert_covers(calls, calls[-1][1])
  assert calls[-1][1] > n


def test_work_progress_counts_each_part_after_the_ones_before():
  calls = Calls()
  work = WorkProgress(calls, 100)
  read, scoring = work.part(60), work.part(40)
  read(30, 60)
  read(60, 60)
  scoring(1, 4)  # a part may count in its own unit: a quarter of its 40
  scoring(4, 4)
  assert calls == [(30, 100), (60, 100), (70, 100), (100, 100)]
  assert WorkProgress(None, 100).part(60) is None  # nobody listens: nothing to call


# ---- the CLI's bar ------------------------------------------------------------------------


class _Bar:
  """What `prefill_bar` draws, recorded instead of drawn."""

  made = []

  def __init__(self, total, desc, **kwargs):
    self.total, self.desc, self.n, self.closed = total, desc, 0, False
    _Bar.made.append(self)

  def update(self, k):
    self.n += k

  def close(self):
    self.closed = True


@pytest.fixture
def bars(monkeypatch):
  import tqdm.auto

  _Bar.made = []
  monkeypatch.setattr(tqdm.auto, "tqdm", _Bar)
  monkeypatch.setattr(common.sys.stderr, "isatty", lambda: True, raising=False)
  return _Bar.made


@pytest.mark.parametrize(
    "spec, label",
    [
        (None, "reading"),
        (kvjax.CompressionSpec(), "reading"),
        (kvjax.CompressionSpec(policy="snapkv", budget=64), "reading"),
        (kvjax.CompressionSpec(policy="kvzip", budget=0.5), "reading + scoring"),
    ],
)
def test_the_bar_says_what_it_covers_and_ends_with_the_work(bars, spec, label):
  progress = common.prefill_bar(types.SimpleNamespace(quiet=False), spec)
  progress(1000, 3000)
  progress(3000, 3000)
  (bar,) = bars
  assert (bar.desc, bar.total, bar.n, bar.closed) == (label, 3000, 3000, True)


def test_no_bar_for_short_work_or_when_quiet(bars):
  common.prefill_bar(types.SimpleNamespace(quiet=False))(512, 1000)
  assert bars == []
  assert common.prefill_bar(types.SimpleNamespace(quiet=True)) is None


# ---- kvjax tune's estimate of the time left ----------------------------------------------


class _Time:

  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def test_the_tune_estimate_scales_the_time_so_far_by_the_work_left():
  """Two steps of equal recorded time: half the first done after 10 s is a quarter of the
  work, so 30 s are left; the second step starting after 25 s leaves 25 s."""
  said, clock_time = [], _Time()
  shares = {"calibrate": 1.0, "fixed": 1.0}
  clock = _eta.Clock(
      said.append, ["calibrate", "fixed"], now=clock_time, every_s=60, seconds=shares
  )
  clock.step("calibrate")
  assert said == []  # nothing measured yet
  clock_time.now = 1.0
  clock.advance(1, 100)  # too little done to extrapolate from (compilation)
  assert said == []
  clock_time.now = 10.0
  clock.advance(50, 100)
  assert said == ["under a minute left (estimated from the time so far)"]
  assert clock.left_s(0.25) == pytest.approx(30.0)
  clock_time.now = 20.0
  clock.advance(80, 100)  # within `every_s` of the last estimate: not said again
  assert len(said) == 1
  clock_time.now = 25.0 * 60
  clock.step("fixed")  # each step's start says it
  assert said[-1] == "about 25 min left (estimated from the time so far)"


def test_a_skipped_step_counts_as_done():
  said, clock_time = [], _Time()
  clock = _eta.Clock(said.append, now=clock_time)
  clock_time.now = 600.0
  clock.step("held_out")  # an unreachable target tries no quantized pages
  done = 1 - _eta.STEP_SECONDS["held_out"] / sum(_eta.STEP_SECONDS.values())
  assert said == [f"{_eta.about(600 * (1 - done) / done)} left (estimated from the time so far)"]


def test_the_estimate_refuses_unknown_steps():
  with pytest.raises(ValueError, match="steps must be some of"):
    _eta.Clock(print, ["calibrate", "coffee"])
  with pytest.raises(ValueError, match="step must be one of"):
    _eta.Clock(print, ["calibrate"]).step("fixed")
