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


def _alone(model, prompt, spec, max_tokens, tokenizer=None):
  state = kvjax.prefill(model, [TOK.encode(prompt)], spec, tokenizer=tokenizer)
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


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
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


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
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


# ---- a request cannot break the engine (issue 60) ---------------------------------------


def _idle_and_whole(engine):
  """Every row free, nothing reserved, every page of the pool free again."""
  stats = engine.stats()
  assert stats["rows_in_use"] == 0 and stats["pages_reserved"] == 0, stats
  cache = engine.batch.state.cache
  assert not np.asarray(engine.batch.active).any()
  assert int(cache.pages.num_free) == cache.num_pages - 1
  assert int(cache.status) == 0


BIG_PROMPT = [3 + i % 250 for i in range(136)]


def _ids_request(ids, spec, max_tokens):
  """A request of token ids that runs to `max_tokens` (no stop token ends it early)."""
  return Request(list(ids), spec, max_tokens, Collector(), stops=False)


def _spec(**fields):
  return kvjax.CompressionSpec(page_size=4, **fields)


@pytest.mark.slow  # ~30 s each: the steps of two specs to compile
@pytest.mark.parametrize(
    "server, large",
    [
        # The server evicts at 32 tokens past a 4-token margin; the request reads its prompt
        # at 128 with its own margin (8 tokens): its 136 tokens stay, past its row's 132.
        ({"policy": "h2o", "budget": 32}, {"policy": "h2o", "budget": 128}),
        # A fractional server budget: the batch's margin is sized on a 1-token prompt (4),
        # the request's budget (129 tokens) and margin (8) on its own prompt.
        ({"policy": "h2o", "budget": 0.95}, {"policy": "h2o", "budget": 0.95}),
    ],
)
def test_a_request_read_with_a_larger_margin_reserves_its_first_step(model, server, large):
  spec, full = _spec(**server), _spec()
  # Its 4 sequences of 136 tokens (34 pages) take a 35th page each at their first step: 140
  # pages. A full-cache request beside holds all its 20 pages (5 a sequence) from the start.
  engine = _engine(model, spec, pages=136 + 20, rows=2)
  small = _ids_request(range(3, 20), full, 3)
  big = _ids_request(BIG_PROMPT, _spec(**large), 4)
  engine.submit(small)
  engine.submit(big)
  for request in (small, big):
    c = request.emit
    assert c.finished.wait(120) and c.end == ("done", "length"), c.end
  assert len(big.emit.tokens) == 4
  # Nothing of the others stays behind (no status, no page), and nothing was dropped: the
  # same request again, alone in the batch, generates the same tokens.
  after = _ids_request(range(3, 20), full, 3)
  engine.submit(after)
  assert after.emit.finished.wait(120) and after.emit.end == ("done", "length"), after.emit.end
  assert small.emit.tokens == after.emit.tokens
  engine.stop()
  _idle_and_whole(engine)
  assert big.planned.pages == 140  # admission counted its first step's pages


def test_a_request_whose_first_step_passes_the_pool_is_refused_naming_max_tokens(model):
  engine = _engine(model, _spec(policy="h2o", budget=32), pages=136, rows=2)
  big = _ids_request(BIG_PROMPT, _spec(policy="h2o", budget=128), 4)
  with pytest.raises(RequestTooLarge, match="needs 140 pages") as err:
    engine.submit(big)
  assert err.value.field == "max_tokens"  # its prompt alone fits (136 pages)
  engine.stop()


def test_a_failure_after_insertion_frees_the_row_and_its_pages(model, monkeypatch):
  from kvjax.cache.paged_cache import CacheError
  from kvjax.serving import _engine as engine_module

  spec = kvjax.CompressionSpec(page_size=8)
  engine = _engine(model, spec, pages=80, rows=2)
  fail_once = [True]
  check = engine_module.check_status

  def failing_check(cache):  # the insert's status, read after the row took its pages
    if fail_once.pop() if fail_once else False:
      raise CacheError("out of pages: injected")
    check(cache)

  monkeypatch.setattr(engine_module, "check_status", failing_check)
  bad, c_bad = _request("the first prompt", spec, 6)
  engine.submit(bad)
  assert c_bad.finished.wait(60) and c_bad.end == ("error", "CacheError: out of pages: injected")
  good, c_good = _request("the second prompt", spec, 6)
  engine.submit(good)
  assert c_good.finished.wait(60) and c_good.end == ("done", "length")
  assert c_good.tokens == _alone(model, "the second prompt", spec, 6)
  engine.stop()
  _idle_and_whole(engine)
  assert engine.stats()["failed"] == 1


def test_a_row_past_its_reservation_fails_alone_and_the_others_go_on(model, monkeypatch):
  spec = kvjax.CompressionSpec(page_size=8)
  engine = _engine(model, spec, pages=80, rows=2)
  prompt = "a prompt of thirty bytes, or so"
  short = _ids_request(TOK.encode(prompt), spec, 40)
  c_short = short.emit
  settle = engine._settle

  def short_reservation(request, need):  # an engine bug: two pages short of its peak
    settle(request, need - 2 if request is short else need)

  monkeypatch.setattr(engine, "_settle", short_reservation)
  other = "zz top zz top"
  good = _ids_request(TOK.encode(other), spec, 40)
  c_good = good.emit
  engine.submit(short)
  engine.submit(good)
  assert c_short.finished.wait(120) and c_short.end[0] == "error", c_short.end
  assert "out of pages" in c_short.end[1] and 0 < len(c_short.tokens) < 40
  # Its tokens up to its last full page are its own: the ones it would generate alone.
  assert c_short.tokens == _alone(model, prompt, spec, 40)[: len(c_short.tokens)]
  assert c_good.finished.wait(120) and c_good.tokens == _alone(model, other, spec, 40)
  engine.stop()
  _idle_and_whole(engine)


def test_a_round_that_raises_fails_its_requests_and_the_engine_goes_on(model, monkeypatch):
  from kvjax.serving import _engine as engine_module

  spec = kvjax.CompressionSpec(page_size=8)
  engine = _engine(model, spec, pages=80, rows=2)
  compiled = engine_module.compiled
  fail_once = [True]

  def failing_compiled(*args, **kwargs):
    if fail_once.pop() if fail_once else False:
      raise RuntimeError("a round that cannot compile")
    return compiled(*args, **kwargs)

  monkeypatch.setattr(engine_module, "compiled", failing_compiled)
  bad, c_bad = _request("the first prompt", spec, 6)
  engine.submit(bad)
  assert c_bad.finished.wait(60) and c_bad.end == (
      "error",
      "RuntimeError: a round that cannot compile",
  )
  good, c_good = _request("the second prompt", spec, 6)
  engine.submit(good)
  assert c_good.finished.wait(60) and c_good.tokens == _alone(model, "the second prompt", spec, 6)
  assert engine.unavailable() is None
  engine.stop()
  _idle_and_whole(engine)


def test_an_engine_whose_thread_stops_fails_what_it_holds_and_refuses_the_rest(model, monkeypatch):
  from kvjax.serving._engine import EngineStopped

  spec = kvjax.CompressionSpec(page_size=8)
  engine = _engine(model, spec, pages=80, rows=2)

  def broken():  # an error in the engine's own code, outside any request's handling
    raise RuntimeError("a bug in the engine")

  monkeypatch.setattr(engine, "_admit", broken)
  waiting, c_waiting = _request("a prompt", spec, 6)
  engine.submit(waiting)
  assert c_waiting.finished.wait(60)
  assert c_waiting.end == ("error", "the engine stopped: RuntimeError: a bug in the engine")
  engine._thread.join(10)
  assert engine.unavailable() == "the engine stopped: RuntimeError: a bug in the engine"
  later, _ = _request("a later prompt", spec, 6)
  with pytest.raises(EngineStopped, match="a bug in the engine"):
    engine.submit(later)
  with pytest.raises(EngineStopped):
    engine.call(lambda: None)
  engine.stop()  # returns: the thread has ended


@pytest.mark.parametrize(
    "server, field",
    [
        ({"policy": "h2o", "budget": 32, "head_budget": "layer"}, "head_budget"),
        ({"policy": "h2o", "budget": 32, "budget_schedule": "pyramid"}, "budget_schedule"),
    ],
)
def test_a_spec_the_rows_cannot_decode_is_refused_naming_its_field(model, server, field):
  from kvjax.serving._engine import Unservable

  with pytest.raises(Unservable) as err:
    _engine(model, kvjax.CompressionSpec(**server), pages=80)
  assert err.value.field == field and str(err.value).startswith(f"{field}=")


def test_a_request_for_a_spec_the_rows_cannot_decode_is_refused_naming_its_field(model):
  from kvjax.serving._engine import Unservable

  engine = _engine(model, kvjax.CompressionSpec(policy="h2o", budget=32), pages=80)
  for spec, field in [
      (kvjax.CompressionSpec(policy="snapkv", budget=32), "policy"),  # another running one
      (kvjax.CompressionSpec(policy="h2o", budget=32, kv_dtype="int8"), "kv_dtype"),
      (kvjax.CompressionSpec(policy="h2o", budget=32, head_budget="layer"), "head_budget"),
  ]:
    with pytest.raises(Unservable) as err:
      engine.submit(Request(TOK.encode("hi"), spec, 4, Collector()))
    assert err.value.field == field
  engine.stop()


@pytest.mark.parametrize(
    "server",
    [
        pytest.param({"policy": "kvzip", "budget": 0.5}, marks=pytest.mark.slow),  # ~30 s
        {"policy": "h2o", "budget": 32, "compress": "once"},
    ],
)
def test_a_server_whose_policy_compresses_once_serves_its_requests(model, server):
  spec = kvjax.CompressionSpec(**server)  # every request compressed once, rows keep it all
  engine = _engine(model, spec, pages=200)
  prompt = "the quick brown fox jumps over the lazy dog " * 2
  request, c = _request(prompt, spec, 6)
  engine.submit(request)
  assert c.finished.wait(120) and c.end == ("done", "length"), c.end
  # kvzip's reconstruction pass reads an instruction the tokenizer encodes, as the engine's.
  assert c.tokens == _alone(model, prompt, spec, 6, tokenizer=TOK) and request.kept_share < 1
  engine.stop()
  _idle_and_whole(engine)


def test_a_seed_gives_a_row_the_same_tokens_whatever_its_neighbours(model):
  spec = kvjax.CompressionSpec(page_size=8)
  engine = _engine(model, spec, pages=60)
  hot = kvjax.Sampling(temperature=1.0)

  def run(seeds):
    """The tokens of one request per seed (None: the engine draws one), decoded together."""
    jobs = []
    for seed in seeds:
      job = Request(TOK.encode("sample me "), spec, 12, Collector(), sampling=hot, seed=seed)
      job.stops = False
      jobs.append(job)
      engine.submit(job)
    for job in jobs:
      assert job.emit.finished.wait(120), "bounded: the engine answers"
    return [tuple(job.emit.tokens) for job in jobs]

  try:
    alone = run([7])[0]
    together = run([3, 7, None, 7])
    assert together[1] == together[3] == alone  # seed 7, beside other rows or alone
    assert together[0] != alone  # another seed draws other tokens
    unseeded = run([None, None])
    assert unseeded[0] != unseeded[1]  # no seed: a fresh one each, as OpenAI's API
  finally:
    engine.stop()
  _idle_and_whole(engine)
