"""What `kvjax serve` refuses and how (kvjax.serving._guards, _protocol, http): keys compared as
bytes, /metrics behind them, a Host allowlist, a body limit, strict types, unsupported fields
named, an error object on every path, tokenizing off the event loop, stop strings held back
across rounds, connections that stall closed. Most run in-process over an engine without a
model (`FakeEngine`); uvicorn runs in a thread where the finding is its protocol's, and one
slow test runs the real process. Every loop and wait is bounded."""

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import random
import re
import signal
import socket
import threading
import time
import types

import httpx
import pytest

import kvjax
from kvjax.serving.http import _Text, make_app, server_config
from kvjax.testing import ByteTokenizer, start_server, tiny_hf_checkpoint

KEY = "sk-guards-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"
LOOPBACK = {"localhost", "127.0.0.1", "::1"}


def _ids(text: str) -> list[int]:
  return ByteTokenizer().encode(text)


@dataclasses.dataclass
class _Stored:  # what a stored context's POST answers with
  id: str = "ctx-" + "0" * 32
  kept_share: float = 0.5
  kv_bytes: int = 1
  expires: float = float("inf")  # no JSON number: its response cannot be rendered


class FakeEngine:
  """What the routes read of an engine, without a model: each request is answered with the
  tokens of `reply`, one event a token, then "length"."""

  def __init__(self, tokenizer=None, reply="ok"):
    self.tokenizer = tokenizer or ByteTokenizer()
    self.spec = kvjax.CompressionSpec()
    self.shape = types.SimpleNamespace(vocab_size=259)
    self.reply, self.broken = reply, False

  def check(self, job):
    job.prompt_tokens = 1

  def submit(self, job):
    self.check(job)
    for token in _ids(self.reply):
      job.emit(("tokens", [token]))
    job.emit(("done", "length"))
    return job

  def call(self, fn, queued=False):  # a context "compressed and stored"
    future = concurrent.futures.Future()
    future.set_result(_Stored())
    return future

  def cancel(self, request_id):
    pass

  def unavailable(self):
    if self.broken:
      raise RuntimeError("a bug in the engine\nits second line")

  def stats(self):
    keys = ("page_bytes", "queue", "rows_in_use", "rows", "pages_reserved", "pages")
    return {**dict.fromkeys(keys, 0), "tokens_per_s": 0.0, "generated_tokens": 0}

  def stop(self, drain=True, timeout=None):
    pass


def _app(engine=None, **kwargs):
  kwargs = {"api_keys": {KEY}, "allowed_hosts": LOOPBACK, "max_body": 4096, **kwargs}
  return make_app(
      engine or FakeEngine(), model_name=MODEL, contexts=types.SimpleNamespace(), **kwargs
  )


async def _client_run(app, scenario):
  transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
  async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
    return await asyncio.wait_for(scenario(client), 60)


def _request(app, method, path, **kwargs):
  return asyncio.run(_client_run(app, lambda client: client.request(method, path, **kwargs)))


def _completion(**fields):
  return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **fields}


async def _chunks(n):  # a body without a Content-Length (chunked)
  for _ in range(n):
    yield b"x" * 400


def _keyed(key: bytes):
  return {"headers": {"Authorization": b"Bearer " + key}}


def _post(path="/v1/completions", **fields):
  body = {"text": "doc", **fields} if path == "/v1/contexts" else _completion(**fields)
  return "POST", path, {"headers": AUTH, "json": body}


CHUNKED = {"headers": AUTH, "content": _chunks(12)}  # 4,800 bytes, no Content-Length
# (why, method, path, request kwargs, status, param, code): what the guards refuse...
REFUSED = [
    ("a key not ASCII", "GET", "/v1/models", _keyed("ключ-0123456789".encode()), 401),
    ("a key after a BOM", "GET", "/v1/models", _keyed(b"\xef\xbb\xbf" + KEY.encode()), 401),
    ("/metrics without a key", "GET", "/metrics", {}, 401),
    ("/metrics with another key", "GET", "/metrics", _keyed(b"sk-other-000000000"), 401),
    ("another Host", "GET", "/health", {"headers": {"Host": "evil.example:8000"}}, 400),
    ("a body past --max-body", *_post(prompt="x" * 5000), 413),
    ("a chunked body past it", "POST", "/v1/completions", CHUNKED, 413),
    ("an unknown route", "GET", "/v1/nowhere", {"headers": AUTH}, 404),
    ("an unknown route outside /v1", "GET", "/nowhere", {}, 404),
    ("a method the route does not take", "GET", "/v1/completions", {"headers": AUTH}, 405),
    ("a context whose answer cannot render", *_post("/v1/contexts"), 500),
]
CODES = {401: "invalid_api_key", 400: "invalid_host", 413: "request_too_large"}
REFUSED = [(*row, None, CODES.get(row[-1])) for row in REFUSED]
# ...a value of the wrong type (strict: never coerced)...
REFUSED += [
    (f"{field}: {value!r}"[:40], *_post(**{field: value}), 400, param or field, None)
    for field, value, param in [
        ("max_tokens", True, None),
        ("max_completion_tokens", 2.0, None),
        ("temperature", True, None),
        ("top_p", "1", None),
        ("seed", 1.5, None),
        ("stream", "yes", None),
        ("stream", 1, None),
        ("ignore_eos", 1, None),
        ("stream_options", {"include_usage": 1}, "stream_options.include_usage"),
        ("compression", {"budget": True}, "compression.budget"),
        ("prompt", [True], None),
        ("stop", ["s" * 1001], None),  # past a stop string's length
    ]
]
REFUSED.append(
    ("a context's budget: True", *_post("/v1/contexts", budget=True), 400, "budget", None)
)
# ...and a field of OpenAI's API that kvjax does not implement, asking for something.
REFUSED += [
    (f"{field}: {value!r}", *_post(**{field: value}), 400, field, "unsupported_parameter")
    for field, value in [
        ("n", 2),
        ("logprobs", True),
        ("logprobs", 2),
        ("top_logprobs", 3),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "auto"),
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("response_format", {"type": "json_object"}),
        ("logit_bias", {"5": 10}),
        ("best_of", 2),
        ("echo", True),
        ("suffix", "end"),
        ("presence_penalty", 0.5),
        ("frequency_penalty", -1),
    ]
]


@pytest.mark.parametrize(
    "why, method, path, kwargs, status, param, code", REFUSED, ids=[r[0] for r in REFUSED]
)
def test_each_refusal_is_an_error_object_naming_its_field(
    why, method, path, kwargs, status, param, code
):
  r = _request(_app(), method, path, **kwargs)
  assert r.status_code == status, r.text
  assert r.headers["content-type"] == "application/json", r.headers
  error = r.json()["error"]
  assert error["param"] == param and error["code"] == code, error
  assert error["type"] == ("server_error" if status == 500 else "invalid_request_error"), error
  assert "Traceback" not in error["message"] and "\n" not in error["message"], error
  if code == "unsupported_parameter":
    assert error["message"] == f"{param}: not supported by kvjax serve", error


# What clients send by default (the openai client only what its caller sets; others send the
# OpenAI defaults): each accepted.
ACCEPTED = [
    {"n": 1, "logprobs": None, "top_logprobs": None, "echo": False, "best_of": 1},
    {"logprobs": False, "top_logprobs": 0, "suffix": None, "logit_bias": {}},
    {"tools": [], "tool_choice": "none", "functions": None, "function_call": None},
    {"response_format": {"type": "text"}, "presence_penalty": 0, "frequency_penalty": 0.0},
    {"temperature": 1, "top_p": 1, "seed": 7, "stream": False, "user": "someone"},
]


@pytest.mark.parametrize("fields", ACCEPTED)
def test_the_defaults_of_unsupported_fields_are_accepted(fields):
  r = _request(_app(), "POST", "/v1/completions", headers=AUTH, json=_completion(**fields))
  assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok", r.text


def test_metrics_take_a_key_and_health_none():
  app = _app()
  assert _request(app, "GET", "/metrics", headers=AUTH).status_code == 200
  assert _request(app, "GET", "/health").json() == {"status": "ok"}
  keyless = _app(api_keys=None)
  assert _request(keyless, "GET", "/metrics").status_code == 200
  # The loopback names, with or without a port, are answered.
  for host in ("127.0.0.1:8000", "[::1]:8000", "LOCALHOST"):
    assert _request(app, "GET", "/health", headers={"Host": host}).status_code == 200, host


def test_an_error_no_route_answered_is_a_500_object_in_one_line(caplog):
  engine = FakeEngine()
  engine.broken = True
  with caplog.at_level(logging.INFO, logger="kvjax.serve"):
    r = _request(_app(engine), "GET", "/health")
  assert r.status_code == 500 and r.json()["error"] == {
      "message": "RuntimeError: a bug in the engine",
      "type": "server_error",
      "param": None,
      "code": None,
  }
  assert "Traceback" not in caplog.text, caplog.text
  assert "GET /health failed: RuntimeError: a bug in the engine" in caplog.text


def test_300_random_paths_make_no_new_series_and_no_path_injects_a_line(caplog):
  def series(metrics):
    return {
        line.rsplit(" ", 1)[0] for line in metrics.splitlines() if line.startswith("kvjax_requests")
    }

  rng = random.Random(0)
  # Percent-encoded as a client sends them; the server's path has the quote and newline.
  odd = ["/v1/%22%7D%201%0Akvjax_fake%201", "/v1/contexts/x%0Ay", "/a%22b%0Ac", "/v1/m%0D%0AX: 1"]

  async def scenario(client):
    for path in odd:  # each kind of answer once: 401, 404, the context route
      for headers in ({}, AUTH):
        await client.get(path, headers=headers)
        await client.delete(path, headers=headers)
    before = (await client.get("/metrics", headers=AUTH)).text
    for _ in range(300):
      path = "/" + "/".join(f"{rng.getrandbits(64):x}" for _ in range(rng.randint(1, 3)))
      prefix = rng.choice(["", "/v1", "/v1/contexts"])
      for headers in ({}, AUTH):
        await client.get(prefix + path, headers=headers)
        await client.delete(prefix + path, headers=headers)
    return before, (await client.get("/metrics", headers=AUTH)).text

  with caplog.at_level(logging.INFO, logger="kvjax.serve"):
    before, after = asyncio.run(_client_run(_app(), scenario))
  assert series(after) == series(before), sorted(series(after) - series(before))
  endpoints = {"/v1/chat/completions", "/v1/completions", "/v1/contexts", "/v1/models", "other"}
  pattern = re.compile(r'kvjax_requests_total\{endpoint="([^"]*)",status="(\d{3})"\} \d+')
  for line in after.splitlines():
    assert not line or line.startswith(("# ", "kvjax_")), line
    if line.startswith("kvjax_requests_total"):
      match = pattern.fullmatch(line)
      assert match and match.group(1) in endpoints, line
  assert "kvjax_fake" not in after
  for record in caplog.records:
    assert "\n" not in record.getMessage() and "\r" not in record.getMessage(), record


class SlowTokenizer(ByteTokenizer):
  """Tokenizes as a 10 MB prompt does: seconds of CPU (here, sleep) per text."""

  def __init__(self, seconds):
    self.seconds, self.started = seconds, None

  def encode(self, text):
    self.started = time.monotonic()
    time.sleep(self.seconds)
    return super().encode(text)


@pytest.mark.parametrize(
    "path, body",
    [("/v1/completions", _completion(prompt="long")), ("/v1/contexts", {"text": "long"})],
)
def test_health_answers_while_a_prompt_is_tokenized(path, body):
  tokenizer = SlowTokenizer(seconds=3.0)
  app = _app(FakeEngine(tokenizer), api_keys=None)

  async def scenario(client):
    work = asyncio.create_task(client.post(path, json=body))
    deadline = time.monotonic() + 30
    while tokenizer.started is None and time.monotonic() < deadline:
      await asyncio.sleep(0.01)
    health = await client.get("/health")
    answered = time.monotonic()
    return health, answered - tokenizer.started, await work

  health, after, done = asyncio.run(_client_run(app, scenario))
  assert health.status_code == 200
  # Tokenizing on the event loop, /health waited for it: 3 s.
  assert after < 1.5, f"/health answered {after:.2f} s after tokenizing began"
  assert done.status_code in (200, 500), done.text  # 500: the fake context's answer


class SplitTokenizer:
  """One token a piece of text (ids index `pieces`): "STOP" may arrive as "ST" then "OP"."""

  def __init__(self, pieces):
    self.pieces = pieces

  def decode(self, ids, skip_special_tokens=False):
    return "".join(self.pieces[i] for i in ids)


STOPS = [
    # (pieces, stops, the text a client sees)
    (["Hello ", "ST", "OP", " more"], ["STOP"], "Hello "),
    (["Hello ", "S", "T", "OP"], ["STOP"], "Hello "),
    (["Hello ", "ST", "AY", " STO"], ["STOP"], "Hello STAY STO"),  # held, flushed at the end
    (["zza", "bc", "xc", "ab"], ["cab", "bcx"], "zza"),  # the earliest of two
    (["x", "aa", "ab"], ["aab"], "xa"),
    (["no stop here"], ["STOP"], "no stop here"),
]


@pytest.mark.parametrize("pieces, stops, expected", STOPS)
def test_a_stop_string_split_across_rounds_never_leaks_its_first_part(pieces, stops, expected):
  tokenizer = SplitTokenizer(pieces)
  ids = list(range(len(pieces)))
  streamed, parts = _Text(tokenizer, stops), []
  for i in ids:  # a stream: a token at a time
    parts.append(streamed.add([i]))
    if streamed.stopped:
      break
    # What a client has seen never ends in a proper beginning of a stop string.
    seen = "".join(parts)
    assert not any(seen.endswith(s[:n]) for s in stops for n in range(1, len(s))), parts
  parts.append(streamed.flush())
  whole = _Text(tokenizer, stops)  # not streamed: the round's tokens at once
  text = whole.add(ids) + whole.flush()
  assert "".join(parts) == text == expected, (parts, text)


def test_a_stream_cut_by_a_stop_string_sends_none_of_it():
  engine = FakeEngine(reply="abcSTOPdef")
  app = _app(engine, api_keys=None)

  async def scenario(client):
    body = _completion(prompt="x", max_tokens=16, stop="STOP", stream=True)
    async with client.stream("POST", "/v1/completions", json=body) as r:
      lines = [line async for line in r.aiter_lines() if line.startswith("data: {")]
    plain = await client.post("/v1/completions", json=_completion(prompt="x", stop="STOPX"))
    return [json.loads(line[6:])["choices"][0] for line in lines], plain.json()["choices"][0]

  chunks, plain = asyncio.run(_client_run(app, scenario))
  assert "".join(c["text"] for c in chunks) == "abc" and chunks[-1]["finish_reason"] == "stop"
  assert plain["text"] == "abcSTOPdef" and plain["finish_reason"] == "length", plain


def test_keys_files_are_read_as_utf8_sig_and_a_key_not_printable_ascii_exits_2(tmp_path, capsys):
  from kvjax import cli
  from kvjax.cli.serve import read_api_keys

  keys = tmp_path / "keys.txt"
  keys.write_bytes(b"\xef\xbb\xbf" + KEY.encode() + b"\r\n\n# a comment\n")
  assert read_api_keys(str(keys)) == {KEY}
  for line in ("sk-\u200bhidden-0123456789", "sk-caf\u00e9-0123456789", "sk-tab\tkey-0123"):
    keys.write_text(f"# tenants\n{KEY}\n{line}\n", encoding="utf-8")
    # --rows 0: refused after the keys are read, before any work (bounded, if they pass).
    assert cli.main(["serve", "--api-keys", str(keys), "--rows", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{keys}:3: an API key is one word" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--host", "0.0.0.0"], "--host 0.0.0.0 is reached from other machines"),
        (["--host", "10.1.2.3"], "give --api-keys FILE, or --allow-no-keys"),
        (["--max-body", "4XB"], "--max-body must be bytes with a unit"),
        (["--timeout-idle", "0"], "--timeout-idle must be a finite number of seconds > 0"),
        (["--timeout-idle", "nan"], "--timeout-idle must be a finite number of seconds > 0"),
        (["--allowed-hosts", "a.example,,b"], "--allowed-hosts takes host names"),
    ],
)
def test_a_keyless_server_other_machines_reach_exits_2_before_any_work(argv, message, capsys):
  from kvjax import cli

  # --rows 0: refused after these are checked, before any work (bounded, if they pass).
  assert cli.main(["serve", *argv, "--rows", "0"]) == 2
  err = capsys.readouterr().err.strip()
  assert message in err and len(err.splitlines()) == 1 and "loading" not in err, err


def test_allowed_hosts_default_to_the_loopback_names_and_the_bound_host():
  from kvjax.cli.serve import allowed_hosts

  assert allowed_hosts(None, "127.0.0.1") == LOOPBACK
  assert allowed_hosts(None, "10.1.2.3") == {*LOOPBACK, "10.1.2.3"}
  assert allowed_hosts("API.example.com:8000, b.example", "127.0.0.1") == {
      *LOOPBACK,
      "api.example.com",
      "b.example",
  }
  assert allowed_hosts(None, "0.0.0.0") is None and allowed_hosts("*", "127.0.0.1") is None


class _Uvicorn:
  """`make_app` over a `FakeEngine` on uvicorn as `serve` configures it (`server_config`), in
  a thread, on 127.0.0.1."""

  def __init__(self, timeout_idle):
    import uvicorn

    config = server_config(_app(api_keys=None), "127.0.0.1", 0, timeout_idle=timeout_idle)
    self.server = uvicorn.Server(config)
    self.thread = threading.Thread(target=asyncio.run, args=(self.server.serve(),), daemon=True)

  def __enter__(self):
    self.thread.start()
    deadline = time.monotonic() + 30
    while not self.server.started and time.monotonic() < deadline:
      time.sleep(0.02)
    assert self.server.started
    return self.server.servers[0].sockets[0].getsockname()[1]

  def __exit__(self, *_):
    self.server.should_exit = True
    self.thread.join(30)


def _closed_after(port, data: bytes, seconds: float = 10.0):
  """(seconds until the server closed the connection or `seconds`, what it sent) after
  sending `data`."""
  with socket.create_connection(("127.0.0.1", port), timeout=seconds) as sock:
    sent = time.monotonic()
    if data:
      sock.sendall(data)
    received = b""
    try:
      while chunk := sock.recv(65536):
        received += chunk
    except (TimeoutError, ConnectionResetError):
      pass
    return time.monotonic() - sent, received


def test_half_sent_requests_are_closed_after_the_idle_timeout():
  with _Uvicorn(timeout_idle=1.0) as port:
    for data in (
        b"",  # connected, nothing sent
        b"GET /hea",  # half a request line
        b"GET /health HTTP/1.1\r\nHost: localhost\r\n",  # headers never ended
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\n{",
    ):
      waited, received = _closed_after(port, data)
      assert 0.5 < waited < 5, (data, waited)
    # A complete request is answered, then the idle connection closed as well.
    waited, received = _closed_after(port, b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert received.startswith(b"HTTP/1.1 200") and waited < 8, (waited, received)
    # Headers past their limit, not ended yet: a 400 error object, not text.
    big = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 17000
    waited, received = _closed_after(port, big)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, received[:300]
    assert json.loads(body)["error"]["type"] == "invalid_request_error", body


@pytest.mark.slow  # a server of its own: about 30 s on 2 busy cores
def test_a_keyless_server_warns_checks_hosts_and_bounds_bodies_and_idle_clients(tmp_path):
  checkpoint = tiny_hf_checkpoint(tmp_path / "ckpt")
  flags = ["--model", str(checkpoint), "--max-body", "1KiB", "--timeout-idle", "2"]
  log = tmp_path / "server.log"
  proc, url = start_server(flags, log, timeout=240)
  port = int(url.rsplit(":", 1)[1])
  try:
    body = {"model": "ckpt", "prompt": "ab" * 600, "max_tokens": 1}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    r = httpx.get(f"{url}/health", headers={"Host": f"rebound.example:{port}"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", r.text
    assert httpx.get(f"http://localhost:{port}/health", timeout=10).status_code == 200
    waited, _ = _closed_after(port, b"GET /hea")
    assert 1 < waited < 8, waited
  finally:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
  warnings = [line for line in log.read_text().splitlines() if " WARNING kvjax.serve" in line]
  assert len(warnings) == 1 and "any process on this machine can use" in warnings[0], warnings


class HeldEngine(FakeEngine):
  """Answers nothing until `release`: its requests stay in flight."""

  def __init__(self):
    super().__init__()
    self.held = []

  def submit(self, job):
    self.check(job)
    self.held.append(job)
    return job

  def release(self):
    for job in self.held:
      job.emit(("done", "length"))
    self.held.clear()


def test_a_tenant_past_its_requests_in_flight_gets_429_and_others_go_on():
  engine, other = HeldEngine(), "sk-guards-other-987654"
  app = _app(engine, api_keys={KEY, other}, tenant_requests=1)
  bob = {"Authorization": f"Bearer {other}"}

  async def held(client, headers):
    """A request taken and held in flight (bounded wait)."""
    before = len(engine.held)
    work = asyncio.create_task(client.post("/v1/completions", json=_completion(), headers=headers))
    for _ in range(500):
      if len(engine.held) > before:
        return work
      await asyncio.sleep(0.01)
    raise AssertionError("the request never reached the engine")

  async def scenario(client):
    first = await held(client, AUTH)
    refused = await client.post("/v1/completions", json=_completion(), headers=AUTH)
    second = await held(client, bob)  # another tenant is not limited by alice's
    engine.release()
    answered = [await first, await second]
    again = await held(client, AUTH)  # alice's first is answered: she may send another
    engine.release()
    return refused, answered, await again

  refused, answered, again = asyncio.run(_client_run(app, scenario))
  assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
  assert refused.json()["error"]["code"] == "rate_limit_exceeded", refused.text
  assert [r.status_code for r in answered] == [200, 200] and again.status_code == 200
