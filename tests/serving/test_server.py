"""`kvjax serve` as a user runs it: the real process on 127.0.0.1 (a free port), the default
model, talked to with the official `openai` client and `httpx`. Every loop is bounded."""

import json
import signal

import httpx
import openai
import pytest

from kvjax.testing import idle_metrics, start_server

MODEL = "smollm2-135m-instruct"
KEYS = ("sk-alice-0123456789", "sk-bob-9876543210")


def _start(tmp_path, *flags):
  keys = tmp_path / "keys.txt"
  keys.write_text("# two tenants\n" + "\n".join(KEYS) + "\n")
  flags = ["--api-keys", str(keys), *flags]
  return start_server(flags, tmp_path / "server.log", timeout=240)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  root = tmp_path_factory.mktemp("serve")
  proc, url = _start(
      root,
      "--rows",
      "2",
      "--queue",
      "2",
      "--kv-memory",
      "24MiB",
      "--contexts",
      str(root / "contexts"),
      "--context-quota",
      "8MiB",
  )
  yield url, proc
  if proc.poll() is None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


def _client(url, key=KEYS[0]):
  return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def _chat(content, **extra):
  return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def test_chat_streaming_completions_and_models_with_the_openai_client(server):
  url, _ = server
  client = _client(url)
  assert [m.id for m in client.models.list()] == [MODEL]
  reply = client.chat.completions.create(
      model=MODEL,
      messages=[{"role": "user", "content": "What is the capital of France?"}],
      max_tokens=12,
      temperature=0,
  )
  assert "Paris" in reply.choices[0].message.content
  assert reply.choices[0].finish_reason == "stop" and reply.usage.prompt_tokens > 0
  streamed = client.chat.completions.create(
      model=MODEL,
      messages=[{"role": "user", "content": "What is the capital of France?"}],
      max_tokens=12,
      temperature=0,
      stream=True,
      stream_options={"include_usage": True},
  )
  chunks = list(streamed)
  text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
  assert text == reply.choices[0].message.content  # greedy: the same answer
  assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
  done = client.completions.create(
      model=MODEL, prompt="One, two, three,", max_tokens=5, temperature=0
  )
  assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 5


@pytest.mark.slow  # compiles kvzip's passes for its prompt: ~10 s
def test_a_request_chooses_its_own_compression(server):
  url, _ = server
  client = _client(url)
  # kvzip keeping half of the prompt, in kvjax's extension field.
  zipped = client.chat.completions.create(
      model=MODEL,
      messages=[{"role": "user", "content": "What is the capital of France?"}],
      max_tokens=12,
      temperature=0,
      extra_body={"compression": {"policy": "kvzip", "budget": 0.5}},
  )
  assert zipped.choices[0].message.content


@pytest.mark.slow  # a server of its own: about a minute
def test_a_chats_question_is_never_evicted_under_a_running_budget_of_16(tmp_path):
  proc, url = _start(tmp_path, "--policy", "h2o", "--budget", "16", "--rows", "1")
  try:
    reply = _client(url).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
        extra_body={"compression": {"policy": "h2o", "budget": 16}},
    )
    assert "Paris" in reply.choices[0].message.content
  finally:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
  # The system prompt was compressed: the request kept less than all it read.
  log = (tmp_path / "server.log").read_text()
  (line,) = [x for x in log.splitlines() if "POST /v1/chat/completions" in x]
  assert "status=200" in line and float(line.split("kept_share=")[1].split()[0]) < 1, line


BAD = [
    (b"{not json", None),
    (_chat("hi", max_tokens=0), "max_tokens"),
    (_chat("hi", max_tokens=-5), "max_tokens"),
    (_chat("hi", max_tokens=10**9), "max_tokens"),
    (_chat("hi", max_tokens="ten"), "max_tokens"),
    (_chat("hi", temperature=-1), "temperature"),
    (_chat("hi", compression={"policy": "nope"}), "compression.policy"),
    (_chat("hi", compression={"policy": "h2o", "budget": 10**9}), "compression.budget"),
    (_chat("hi", compression={"budget": -3, "policy": "snapkv"}), "compression.budget"),
    (_chat("x " * 5000, max_tokens=8), "prompt"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
]


@pytest.mark.parametrize("body, param", BAD)
def test_bad_requests_get_a_400_naming_the_field_and_the_server_goes_on(server, body, param):
  url, _ = server
  headers = {"Authorization": f"Bearer {KEYS[0]}"}
  if isinstance(body, bytes):
    r = httpx.post(f"{url}/v1/chat/completions", content=body, headers=headers, timeout=60)
  else:
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
  assert r.status_code == 400, r.text
  error = r.json()["error"]
  assert error["param"] == param and error["type"] == "invalid_request_error", error
  assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_keys_unknown_models_and_a_full_queue(server):
  url, _ = server
  for headers in ({}, {"Authorization": "Bearer sk-wrong-000000000"}, {"Authorization": KEYS[0]}):
    r = httpx.get(f"{url}/v1/models", headers=headers, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
  with pytest.raises(openai.NotFoundError):
    _client(url).chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
  # Two rows and a queue of two: a burst past four is answered 429 with Retry-After.
  headers = {"Authorization": f"Bearer {KEYS[1]}"}
  with httpx.Client(timeout=120) as http:
    streams = [
        http.stream(
            "POST",
            f"{url}/v1/completions",
            headers=headers,
            json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "stream": True},
        )
        for _ in range(6)
    ]
    responses = [s.__enter__() for s in streams]
    codes = [r.status_code for r in responses]
    for s in streams:
      s.__exit__(None, None, None)  # leave: each accepted stream is cancelled
  assert codes.count(429) >= 1 and codes.count(200) >= 2, codes
  limited = next(r for r in responses if r.status_code == 429)
  assert limited.headers["retry-after"] == "1"


@pytest.mark.slow
def test_disconnects_free_their_rows(server):
  url, _ = server
  headers = {"Authorization": f"Bearer {KEYS[0]}"}
  idle_metrics(url, key=KEYS[0])  # what earlier tests left behind
  for _ in range(3):
    with httpx.stream(
        "POST",
        f"{url}/v1/completions",
        headers=headers,
        timeout=120,
        json={"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 400, "stream": True},
    ) as r:
      lines = r.iter_lines()
      assert next(lines).startswith("data: ")
  metrics = idle_metrics(url, 30, key=KEYS[0])
  assert "kvjax_rows_in_use 0" in metrics and "kvjax_kv_bytes_reserved 0" in metrics


@pytest.mark.slow
def test_sigterm_drains_the_request_in_flight(tmp_path):
  proc, url = _start(tmp_path, "--rows", "1")
  headers = {"Authorization": f"Bearer {KEYS[0]}"}
  with httpx.stream(
      "POST",
      f"{url}/v1/completions",
      headers=headers,
      timeout=120,
      json={"model": MODEL, "prompt": "One, two,", "max_tokens": 24, "stream": True},
  ) as r:
    lines = r.iter_lines()
    next(lines)
    proc.send_signal(signal.SIGTERM)
    rest = [line for line in lines if line]
  assert rest[-1] == "data: [DONE]"
  assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
  assert proc.wait(60) == 0


DOCUMENT = (
    "Notes from the harbour office. The ferry to the island leaves at seven. The code of the "
    "blue locker is 4812. Fishing boats return before noon, and the market opens at ten. "
) * 6


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_a_context_compressed_once_answers_its_tenant_only(server):
  url, _ = server
  alice, bob = ({"Authorization": f"Bearer {key}"} for key in KEYS)
  made = httpx.post(
      f"{url}/v1/contexts",
      headers=alice,
      timeout=300,  # kvzip reads the document in two passes: slow on busy CPUs
      json={"text": DOCUMENT, "policy": "kvzip", "budget": 0.5},
  )
  assert made.status_code == 200, made.text
  context = made.json()
  assert context["id"].startswith("ctx-") and "kept_tokens" not in context
  # Half of the document kept (its protected opening beside), in its share and its bytes.
  assert context["document_tokens"] > 200 and 0.45 < context["kept_share"] < 0.6, context
  assert 0.45 < context["kv_bytes"] / context["full_kv_bytes"] < 0.65, context
  question = "What is the code of the blue locker? Answer with the number only."
  reply = _client(url).chat.completions.create(
      model=MODEL,
      messages=[{"role": "user", "content": question}],
      max_tokens=16,
      temperature=0,
      extra_body={"context_id": context["id"]},
  )
  assert "4812" in reply.choices[0].message.content
  # Another tenant's id is answered exactly as an unknown one.
  for headers, cid in ((bob, context["id"]), (alice, "ctx-" + "0" * 32), (alice, "ctx-not-hex")):
    body = _chat(question, max_tokens=4, context_id=cid)
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "context_not_found", r.text
    gone = httpx.delete(f"{url}/v1/contexts/{cid}", headers=headers, timeout=60)
    assert gone.status_code == 404 and gone.json() == r.json()
  assert httpx.delete(f"{url}/v1/contexts/{context['id']}", headers=alice).status_code == 200
  r = httpx.post(
      f"{url}/v1/chat/completions",
      headers=alice,
      timeout=60,
      json=_chat(question, max_tokens=4, context_id=context["id"]),
  )
  assert r.status_code == 404


@pytest.mark.slow
def test_a_tenants_context_quota_holds(server):
  url, _ = server
  bob = {"Authorization": f"Bearer {KEYS[1]}"}
  made, codes = [], []
  for _ in range(4):  # bounded: 8 MiB holds one of these (6 MiB on disk)
    r = httpx.post(
        f"{url}/v1/contexts",
        headers=bob,
        timeout=120,
        json={"text": DOCUMENT, "policy": "kvzip", "budget": 0.5},
    )
    codes.append(r.status_code)
    if r.status_code != 200:
      break
    made.append(r.json()["id"])
  assert codes[-1] == 429 and r.json()["error"]["code"] == "insufficient_quota", codes
  assert made
  for cid in made:
    assert httpx.delete(f"{url}/v1/contexts/{cid}", headers=bob).status_code == 200
  r = httpx.post(
      f"{url}/v1/contexts",
      headers=bob,
      timeout=120,
      json={"text": DOCUMENT, "policy": "h2o", "budget": 64},
  )
  assert r.status_code == 400 and r.json()["error"]["param"] == "policy"
  r = httpx.get(f"{url}/v1/no-such-endpoint", headers=bob)
  assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kv-memory", "12XB"], "--kv-memory must be bytes with a unit"),
        (["--port", "70000"], "--port must be in [0, 65535]"),
        (["--policy", "nope"], "unknown policy 'nope'"),
        (["--rows", "0"], "rows must be an int >= 1"),
        (["--context-ttl", "0"], "--context-ttl must be a finite number of seconds > 0"),
        (["--context-ttl", "inf"], "--context-ttl must be a finite number of seconds > 0"),
        (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
        (["--api-keys", "KEYFILE"], "an API key is one word of at least 8 characters"),
    ],
)
def test_bad_command_lines_exit_2_in_one_line_before_any_work(argv, message, tmp_path, capsys):
  from kvjax import cli

  keys = tmp_path / "keys.txt"
  keys.write_text("short\n")
  argv = [str(keys) if a == "KEYFILE" else a for a in argv]
  assert cli.main(["serve", *argv]) == 2
  err = capsys.readouterr().err.strip()
  assert message in err and len(err.splitlines()) == 1 and "loading" not in err
