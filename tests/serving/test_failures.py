"""A request cannot break `kvjax serve` (issue 60): each server here is a real process on
127.0.0.1 over a tiny random checkpoint (one layer, two kv heads, 16-token pages of 256
bytes). A request that asks for more than its reservation held, a request whose decode
round raises, a spec the engine cannot serve: each fails alone, or at start, and every
later request is answered. Every loop is bounded."""

import asyncio
import signal
import subprocess
import sys
import time

import httpx
import pytest

import kvjax
from kvjax.testing import ByteTokenizer, idle_metrics, start_server, tiny_hf_checkpoint, tiny_llama

MODEL = "ckpt"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  return tiny_hf_checkpoint(tmp_path_factory.mktemp("failures") / MODEL)


def _stop(proc):
  if proc.poll() is None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


def _complete(url, prompt, max_tokens=4, timeout=120, **extra):
  body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
  return httpx.post(f"{url}/v1/completions", json={**body, **extra}, timeout=timeout)


@pytest.mark.slow  # a server of its own: about 30 s on 2 busy cores
def test_a_request_over_the_servers_budget_in_a_full_pool_breaks_no_later_request(
    checkpoint, tmp_path
):
  # The review's server: h2o at 32 tokens, a pool of 78 pages. A request at budget 600
  # reads its 624-token prompt with its own margin (32 tokens: nothing evicted), and its
  # first decode step needs a 40th page per sequence: 80 pages at its peak, not 78.
  flags = ["--model", str(checkpoint), "--policy", "h2o", "--budget", "32"]
  flags += ["--kv-memory", "19968B", "--rows", "2", "--temperature", "0"]
  proc, url = start_server(flags, tmp_path / "server.log", timeout=240)
  try:
    prompt = [2 + i % 6 for i in range(624)]
    big = _complete(url, prompt, compression={"policy": "h2o", "budget": 600})
    # Refused (its peak passes the pool), or served: never a 5xx.
    assert big.status_code in (200, 400), big.text
    if big.status_code == 400:
      error = big.json()["error"]
      assert error["param"] == "max_tokens" and "80 pages" in error["message"], error
    for _ in range(3):  # every later request is answered
      r = _complete(url, [2, 3, 4])
      assert r.status_code == 200, r.text
      assert r.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    metrics = idle_metrics(url)
    assert "kvjax_kv_bytes_reserved 0" in metrics, metrics
  finally:
    _stop(proc)


POLICY_MODULE = '''
"""A running policy that scores a request's own prefill (one row) and a served batch's
rounds over tables of up to 1,024 tokens, and fails in a deeper round: a request whose
decode round raises in the engine."""

import dataclasses
from typing import ClassVar

from kvjax.policies import register
from kvjax.policies.simple import Streaming


@register
@dataclasses.dataclass(frozen=True)
class FailsInDeepRounds(Streaming):
  name: ClassVar[str] = "fails_in_deep_rounds"

  def scores(self, cache, key):
    if cache.length.shape[1] > 1 and cache.config.max_tokens > 1024:
      raise RuntimeError("this policy cannot score a table past 1024 tokens")
    return super().scores(cache, key)
'''


@pytest.mark.slow  # a server of its own: about 40 s on 2 busy cores
def test_a_request_whose_round_raises_fails_alone_and_the_server_goes_on(checkpoint, tmp_path):
  module = tmp_path / "fails_in_deep_rounds.py"
  module.write_text(POLICY_MODULE)
  flags = ["--model", str(checkpoint), "--policy-module", str(module), "--rows", "2"]
  flags += ["--policy", "fails_in_deep_rounds", "--budget", "32", "--kv-memory", "64KiB"]
  proc, url = start_server(flags, tmp_path / "server.log", timeout=240)
  # 1,100 tokens kept whole: its row's round reads 2,048-token tables, where the policy
  # fails; a short request's round reads 1,024.
  deep = {"prompt": [2 + i % 6 for i in range(1100)], "compression": {"policy": "full"}}
  try:
    for _ in range(2):  # the engine goes on after each
      r = _complete(url, timeout=60, **deep)
      assert r.status_code == 500, r.text
      error = r.json()["error"]
      assert error["type"] == "server_error" and "past 1024 tokens" in error["message"], error
      r = _complete(url, [2, 3, 4], timeout=60)
      assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    body = {"model": MODEL, "max_tokens": 4, "stream": True, **deep}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
      events = [line for line in stream.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and "past 1024 tokens" in events[-2], events
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    metrics = idle_metrics(url)
    assert 'kvjax_requests_total{endpoint="/v1/completions",status="500"} 3' in metrics
    assert "kvjax_kv_bytes_reserved 0" in metrics and "kvjax_engine_up 1" in metrics, metrics
  finally:
    _stop(proc)
  log = (tmp_path / "server.log").read_text()
  assert "Traceback" not in log, log[-3000:]
  assert "a decode round failed, ending request(s)" in log


@pytest.mark.parametrize(
    "flags, flag",
    [
        (["--policy", "h2o", "--budget", "32", "--head-budget", "layer"], "--head-budget layer"),
        (
            ["--policy", "h2o", "--budget", "32", "--budget-schedule", "pyramid"],
            "--budget-schedule",
        ),
    ],
)
def test_a_spec_the_engine_cannot_serve_exits_2_in_one_line_before_loading(checkpoint, flags, flag):
  done = subprocess.run(
      [sys.executable, "-m", "kvjax.cli", "serve", "--model", str(checkpoint), "--port", "0"]
      + flags,
      capture_output=True,
      text=True,
      check=False,
      timeout=120,  # a server that starts is a failure: bounded
  )
  err = done.stderr.strip()
  assert done.returncode == 2, err
  assert len(err.splitlines()) == 1 and flag in err and "loading" not in err, err


def test_once_the_engine_thread_stops_health_and_requests_answer_503():
  from kvjax.serving import Engine, EngineConfig
  from kvjax.serving.http import make_app

  config = EngineConfig(rows=2, kv_memory=2**20, max_tokens=128, compile_ahead=False)
  engine = Engine(tiny_llama(), ByteTokenizer(), kvjax.CompressionSpec(), config).start()
  app = make_app(engine, model_name="tiny")
  body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4}

  def broken():  # an error in the engine's own code, outside any request's handling
    raise RuntimeError("a bug in the engine")

  async def scenario(client):
    assert (await client.get("/health")).status_code == 200
    engine._admit = broken
    # Bounded: a request the engine never answers would wait here forever.
    failed = await asyncio.wait_for(client.post("/v1/completions", json=body), 60)
    health = await client.get("/health")
    refused = await asyncio.wait_for(client.post("/v1/completions", json=body), 10)
    metrics = (await client.get("/metrics")).text
    return failed, health, refused, metrics

  async def run():
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
      return await scenario(client)

  try:
    failed, health, refused, metrics = asyncio.run(run())
  finally:
    engine.stop(drain=False, timeout=10)
  why = "the engine stopped: RuntimeError: a bug in the engine"
  assert failed.status_code == 500 and failed.json()["error"]["message"] == why
  assert health.status_code == 503 and health.json() == {"status": "unavailable", "reason": why}
  assert refused.status_code == 503, refused.text
  assert refused.json()["error"]["message"] == why and refused.headers["retry-after"] == "1"
  assert "kvjax_engine_up 0" in metrics


def test_a_policy_whose_rows_cannot_decode_is_refused_once_the_model_loads(checkpoint, tmp_path):
  module = tmp_path / "fails_in_rows.py"
  module.write_text(POLICY_MODULE.replace("cache.config.max_tokens > 1024", "True"))
  done = subprocess.run(
      [sys.executable, "-m", "kvjax.cli", "serve", "--model", str(checkpoint), "--port", "0"]
      + ["--policy-module", str(module), "--policy", "fails_in_deep_rounds", "--budget", "32"],
      capture_output=True,
      text=True,
      check=False,
      timeout=120,  # a server that starts is a failure: bounded
  )
  err = done.stderr.strip().splitlines()
  assert done.returncode == 2, err
  assert err[-1] == (
      "kvjax serve: error: this spec's rows cannot decode: RuntimeError: this policy cannot "
      "score a table past 1024 tokens"
  ), err
  assert not any("on http://" in line for line in err)


@pytest.mark.slow  # a server of its own
def test_sigterm_cancels_what_the_drain_timeout_cannot_finish(checkpoint, tmp_path):
  import threading

  flags = ["--model", str(checkpoint), "--rows", "2", "--drain-timeout", "2"]
  proc, url = start_server(flags, tmp_path / "server.log", timeout=240)
  answers = []
  # Far more tokens than the drain lets it decode (a non-streaming request, held open).
  long = threading.Thread(
      target=lambda: answers.append(_complete(url, [2, 3, 4], max_tokens=2000, timeout=120))
  )
  try:
    long.start()
    deadline = time.monotonic() + 60
    while "kvjax_rows_in_use 1" not in httpx.get(f"{url}/metrics", timeout=10).text:
      assert time.monotonic() < deadline, "the request never started"
      time.sleep(0.1)
    stopping = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    assert time.monotonic() - stopping < 20, "the drain outlived its timeout"
  finally:
    _stop(proc)
    long.join(60)
  log = (tmp_path / "server.log").read_text()
  assert "Traceback" not in log, log[-3000:]
