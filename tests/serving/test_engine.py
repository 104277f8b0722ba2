"""The engine (kvjax.serving._engine): admission by the pages a request's plan needs, a bounded
queue, cancels, and every request's tokens as if it ran alone."""

import threading

import numpy as np
import pytest

import kvjax
from kvjax.serving._engine import (
    Engine,
    EngineConfig,
    QueueFull,
    Request,
    RequestTooLarge,
)
from kvjax.testing import ByteTokenizer, tiny_llama

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def model():
  return tiny_llama(max_context=256, qk_scale=20)


class Collector:
  """A request's events, and an Event set when it ends."""

  def __init__(self):
    self.tokens, self.end, self.finished = [], None, threading.Event()

  def __call__(self, event):
    kind, value = event
    if kind == "tokens":
      self.tokens += value
    else:
      self.end = event
      self.finished.set()


def _request(prompt, spec, max_tokens):
  c = Collector()
  return Request(TOK.encode(prompt), spec, max_tokens, c), c


def _engine(model, spec, pages, rows=4, queue=64):
  """An engine whose pool holds `pages` pages of `spec`'s page size (float32 K/V)."""
  c = model.config
  kv_memory = pages * 2 * spec.page_size * c.head_dim * 4
  config = EngineConfig(
      rows=rows, kv_memory=kv_memory, max_tokens=256, steps=4, queue=queue, compile_ahead=False
  )
  return Engine(model, TOK, spec, config).start()


def _alone(model, prompt, spec, max_tokens):
  state = kvjax.prefill(model, [TOK.encode(prompt)], spec)
  return kvjax.decode(model, state, max_tokens)[1].tokens[0]


@pytest.mark.slow
def test_requests_beyond_the_rows_and_the_pool_wait_and_each_runs_as_alone(model):
  spec = kvjax.CompressionSpec(page_size=8)
  engine = _engine(model, spec, pages=60)
  prompts = [f"request number {i} " * (1 + i % 3) for i in range(12)]
  submitted = [_request(p, spec, 6 + i % 4) for i, p in enumerate(prompts)]
  most = 0
  for request, _ in submitted:
    engine.submit(request)
  for request, c in submitted:
    while not c.finished.wait(0.05):
      stats = engine.stats()
      most = max(most, stats["rows_in_use"])
      assert stats["pages_reserved"] <= stats["pages"]
    assert c.end == ("done", "length")
  for (request, c), prompt in zip(submitted, prompts):
    assert c.tokens == _alone(model, prompt, spec, request.max_tokens)
  engine.stop()
  stats = engine.stats()
  assert stats["rows_in_use"] == 0 and stats["pages_reserved"] == 0 and stats["finished"] == 12
  assert int(np.asarray(engine.batch.state.cache.length).sum()) == 0
  assert 1 <= most <= 4


def test_a_request_that_could_never_fit_is_refused_naming_the_limit(model):
  spec = kvjax.CompressionSpec(page_size=8)
  engine = _engine(model, spec, pages=4)
  request, _ = _request("a long prompt " * 10, spec, 8)
  with pytest.raises(RequestTooLarge, match="the pool holds 4") as err:
    engine.submit(request)
  assert err.value.field == "prompt"  # the prompt alone passes the pool
  request, _ = _request("hi", spec, 100)
  with pytest.raises(RequestTooLarge, match="the pool holds 4") as err:
    engine.submit(request)
  assert err.value.field == "max_tokens"
  request, _ = _request("hi", spec, 300)
  with pytest.raises(RequestTooLarge, match="256 tokens a row holds"):
    engine.submit(request)
  engine.stop()


@pytest.mark.slow
def test_a_full_queue_refuses_and_a_cancel_frees_the_row(model):
  spec = kvjax.CompressionSpec(page_size=8)
  engine = _engine(model, spec, pages=400, rows=1, queue=1)
  # The first request's callback holds the engine's thread after its first tokens until the
  # cancel is in, so it cannot finish its 200 tokens first (a race on a fast machine).
  gate = threading.Event()
  c1 = Collector()
  first = Request(TOK.encode("the first one"), spec, 200, lambda e: (c1(e), gate.wait(60)))
  engine.submit(first)
  while not c1.tokens:
    c1.finished.wait(0.05)
  second, c2 = _request("the second", spec, 4)
  engine.submit(second)  # waits for the row
  third, _ = _request("the third", spec, 4)
  with pytest.raises(QueueFull):
    engine.submit(third)
  engine.cancel(first.id)
  gate.set()
  assert c2.finished.wait(60) and c2.end == ("done", "length")
  assert not c1.finished.is_set()  # a cancelled request hears nothing more
  engine.stop()
  assert engine.stats()["cancelled"] == 1 and engine.stats()["pages_reserved"] == 0


def test_a_running_budget_admits_more_requests_into_the_same_memory(model):
  pages = 160  # full cache: 76 pages a request; h2o at 16 tokens: 16
  prompt = "the quick brown fox jumps over the lazy dog " * 2
  most = {}
  for name, spec in [
      ("full", kvjax.CompressionSpec(page_size=8)),
      ("h2o", kvjax.CompressionSpec(policy="h2o", budget=16, page_size=8)),
  ]:
    engine = _engine(model, spec, pages, rows=8)
    requests = [_request(prompt, spec, 60) for _ in range(8)]
    for request, _ in requests:
      engine.submit(request)
    most[name] = 0
    for _, c in requests:
      while not c.finished.wait(0.02):
        most[name] = max(most[name], engine.stats()["rows_in_use"])
      assert c.end == ("done", "length") and len(c.tokens) == 60
    engine.stop()
  assert most["h2o"] >= 3 * most["full"], most


@pytest.mark.slow
def test_two_hundred_requests_leave_no_row_or_page_held(model):
  spec = kvjax.CompressionSpec(page_size=8)
  engine = _engine(model, spec, pages=80, rows=4, queue=256)
  requests = [_request(f"short request {i % 7}", spec, 1 + i % 3) for i in range(200)]
  for request, _ in requests:
    engine.submit(request)
  for _, c in requests:  # bounded: each waits at most a minute
    assert c.finished.wait(60) and c.end == ("done", "length")
  engine.stop()
  stats = engine.stats()
  assert stats["finished"] == 200 and stats["rows_in_use"] == 0 and stats["pages_reserved"] == 0
  cache = engine.batch.state.cache
  assert int(np.asarray(cache.length).sum()) == 0
  assert int(cache.pages.num_free) == cache.num_pages - 1


@pytest.mark.slow
def test_a_request_whose_logits_are_not_finite_fails_alone():
  model = tiny_llama(max_context=256, qk_scale=20)
  poisoned = TOK.encode("~")[0]
  model.embed[...] = model.embed[...].at[poisoned].set(float("nan"))
  spec = kvjax.CompressionSpec(page_size=8)
  engine = _engine(model, spec, pages=80, rows=2)
  bad, c_bad = _request("a prompt with a ~ in it", spec, 4)
  good, c_good = _request("a clean prompt", spec, 4)
  engine.submit(bad)
  engine.submit(good)
  assert c_bad.finished.wait(60) and c_bad.end[0] == "error" and "non-finite" in c_bad.end[1]
  assert c_good.finished.wait(60) and c_good.end == ("done", "length")
  assert c_good.tokens == _alone(model, "a clean prompt", spec, 4)
  engine.stop()
  assert engine.stats()["rows_in_use"] == 0 and engine.stats()["pages_reserved"] == 0


def test_a_row_whose_logits_turn_non_finite_while_decoding_fails_alone():
  model = tiny_llama(max_context=256, qk_scale=20)
  spec = kvjax.CompressionSpec(page_size=8)
  first = _alone(model, "the first prompt", spec, 1)[0]  # fed back at A's second step
  model.embed[...] = model.embed[...].at[first].set(float("nan"))
  other = "zz top zz top"
  expected = _alone(model, other, spec, 6)
  assert first not in TOK.encode(other) + expected
  engine = _engine(model, spec, pages=80, rows=2)
  bad, c_bad = _request("the first prompt", spec, 6)
  good, c_good = _request(other, spec, 6)
  engine.submit(bad)
  engine.submit(good)
  assert c_bad.finished.wait(60) and c_bad.end == (
      "error",
      "NumericsError: the model gave non-finite logits",
  )
  assert c_bad.tokens == [first]  # the token stands; nothing was drawn from the NaN logits
  assert c_good.finished.wait(60) and c_good.tokens == expected
  engine.stop()
  assert engine.stats()["failed"] == 1 and engine.stats()["pages_reserved"] == 0


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"rows": 0}, ValueError, "EngineConfig.rows must be an int >= 1, got 0"),
        ({"queue": 2.5}, ValueError, "EngineConfig.queue must be an int >= 1, got 2.5"),
        ({"compile_ahead": "yes"}, TypeError, "EngineConfig.compile_ahead must be a bool"),
    ],
)
def test_an_engine_config_out_of_range_names_the_field(kwargs, error, message):
  with pytest.raises(error, match=message):
    EngineConfig(**kwargs)


def test_a_chats_question_stays_in_every_layer_while_a_running_policy_evicts(model):
  from kvjax.cache.paged_cache import logical_view, valid_mask
  from kvjax.serving._protocol import chat_prompt
  from test_protocol import ChatTokenizer

  spec = kvjax.CompressionSpec(policy="h2o", budget=16, page_size=8)
  engine = _engine(model, spec, pages=120, rows=2)
  messages = [
      {"role": "system", "content": "Answer in one word. " * 3},
      {"role": "user", "content": "Hello"},
      {"role": "assistant", "content": "Hi, what do you want to know?"},
      {"role": "user", "content": "What is the capital of France?"},
  ]
  prompt = chat_prompt(ChatTokenizer(), messages)
  context, question = (len(segment.text) for segment in prompt)
  assert [s.protected for s in prompt] == [False, True] and question > 16
  held, events = [], []

  def inspect(event):  # on the engine's thread, between two rounds: the batch is still
    if event[0] == "tokens":
      events.append(len(event[1]))
      cache = engine.batch.state.cache
      valid = np.asarray(valid_mask(cache))[:, 0]  # row 0: [L, H, N]
      positions = np.asarray(logical_view(cache, cache.slot("position")))[:, 0]
      n = positions.shape[-1]
      pairs = zip(positions.reshape(-1, n), valid.reshape(-1, n))  # every layer and kv head
      held.append([set(p[v].tolist()) for p, v in pairs])
    collector(event)

  collector = Collector()
  request = Request(prompt, spec, 24, inspect, stream=True)
  engine.submit(request)
  assert collector.finished.wait(120) and collector.end == ("done", "length")
  engine.stop()
  asked = set(range(context, context + question))
  assert events == [1] * 24  # a streaming request: its token after every step
  for step, sequences in enumerate(held):
    for kept in sequences:
      assert asked <= kept, f"step {step}: the question lost {sorted(asked - kept)}"
      assert len(kept) < context  # the context was compressed
  assert request.protected_tokens == question
  assert 0 < request.kept_share < 1 and request.kv_bytes > 0


def test_a_streaming_request_gets_each_token_after_its_step_others_after_a_round(model):
  spec = kvjax.CompressionSpec(page_size=8)
  engine = _engine(model, spec, pages=80, rows=2)
  sizes = {}
  for stream in (False, True):
    collector, sizes[stream] = Collector(), []

    def emit(event, collector=collector, sizes=sizes[stream]):
      if event[0] == "tokens":
        sizes.append(len(event[1]))
      collector(event)

    engine.submit(Request(TOK.encode("a short prompt"), spec, 10, emit, stream=stream))
    assert collector.finished.wait(120) and collector.end == ("done", "length")
  engine.stop()
  assert sizes == {False: [4, 4, 2], True: [1] * 10}
