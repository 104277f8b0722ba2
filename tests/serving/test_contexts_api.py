"""The contexts API as a client drives it with the official `openai` client (its generic
`post`/`get`/`patch`/`delete` and `extra_body`): create, list by pages, get, a new lifetime
and name, expiry, delete; completions from a context report its document as cached tokens
and how it was compressed. And two live replicas of one model over one contexts directory:
a context made on one is answered, listed and deleted on the other, and their quota is one."""

import asyncio
import os
import signal

import httpx
import openai
import pytest

import kvjax
from kvjax.serving import Engine, EngineConfig
from kvjax.serving._contexts import ContextStore
from kvjax.serving.http import make_app
from kvjax.testing import ByteTokenizer, start_server, tiny_hf_checkpoint, tiny_llama

DOCUMENT = "The blue locker's code is 4812. " * 6
KEYS = ("sk-alice-0001", "sk-bob-00000002")


def _app(tmp_path):
  model, tok = tiny_llama(max_context=512), ByteTokenizer()
  spec = kvjax.CompressionSpec(page_size=8)
  config = EngineConfig(rows=2, kv_memory=2**20, max_tokens=512, compile_ahead=False)
  engine = Engine(model, tok, spec, config).start()
  store = ContextStore(tmp_path / "contexts", model, tok, ttl=60.0, quota=10**8, model_name="tiny")
  return engine, make_app(engine, model_name="tiny", api_keys=set(KEYS), contexts=store)


def test_a_contexts_lifecycle_through_the_openai_client(tmp_path):
  engine, app = _app(tmp_path)
  http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")
  alice = openai.AsyncOpenAI(api_key=KEYS[0], base_url="http://127.0.0.1/v1", http_client=http)
  bob = openai.AsyncOpenAI(api_key=KEYS[1], base_url="http://127.0.0.1/v1", http_client=http)
  made_body = {"text": DOCUMENT, "policy": "kvzip", "budget": 0.5}

  async def scenario():
    made = [
        await alice.post("/contexts", body={**made_body, "name": f"doc {i}"}, cast_to=object)
        for i in range(3)
    ]
    first = made[0]
    assert first["object"] == "context" and first["name"] == "doc 0" and first["model"] == "tiny"
    assert first["policy"] == "kvzip, budget 0.5" and 0.4 < first["kept_share"] < 0.7
    assert first["kv_bytes"] < first["full_kv_bytes"] and first["expires"] > first["created"]
    page = await alice.get("/contexts", cast_to=object, options={"params": {"limit": 2}})
    assert [c["id"] for c in page["data"]] == [made[0]["id"], made[1]["id"]] and page["has_more"]
    rest = await alice.get(
        "/contexts", cast_to=object, options={"params": {"limit": 2, "after": page["last_id"]}}
    )
    assert [c["id"] for c in rest["data"]] == [made[2]["id"]] and not rest["has_more"]
    assert await alice.get(f"/contexts/{first['id']}", cast_to=object) == first
    longer = await alice.patch(
        f"/contexts/{first['id']}", body={"ttl_seconds": 3600, "name": "kept"}, cast_to=object
    )
    assert longer["name"] == "kept" and longer["expires"] > first["expires"] + 3000
    # Completions from it: its document counted as cached tokens, its compression said.
    reply = await alice.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "The code?"}],
        max_tokens=4,
        temperature=0,
        extra_body={"context_id": first["id"]},
    )
    details = reply.usage.prompt_tokens_details
    assert details.cached_tokens == first["document_tokens"] < reply.usage.prompt_tokens
    extension = reply.model_extra["kvjax"]
    assert extension["context_id"] == first["id"]
    assert extension["compression"] == {
        "policy": "kvzip, budget 0.5",
        "kept_share": first["kept_share"],
    }
    # Another tenant: nothing of alice's is seen or changed.
    assert (await bob.get("/contexts", cast_to=object))["data"] == []
    for call in (
        bob.get(f"/contexts/{first['id']}", cast_to=object),
        bob.patch(f"/contexts/{first['id']}", body={"ttl_seconds": 1}, cast_to=object),
        bob.delete(f"/contexts/{first['id']}", cast_to=object),
    ):
      with pytest.raises(openai.NotFoundError):
        await call
    # A short lifetime: expired, it is neither listed nor answered.
    short = await alice.patch(
        f"/contexts/{made[1]['id']}", body={"ttl_seconds": 0.2}, cast_to=object
    )
    assert short["expires"] < first["expires"]
    await asyncio.sleep(0.3)
    with pytest.raises(openai.NotFoundError):
      await alice.get(f"/contexts/{made[1]['id']}", cast_to=object)
    listed = await alice.get("/contexts", cast_to=object)
    assert [c["id"] for c in listed["data"]] == [made[0]["id"], made[2]["id"]]
    deleted = await alice.delete(f"/contexts/{made[2]['id']}", cast_to=object)
    assert deleted == {"id": made[2]["id"], "object": "context", "deleted": True}
    # Bad input names its field.
    for path, body, param in (
        ("/contexts", {**made_body, "ttl_seconds": 0}, "ttl_seconds"),
        ("/contexts", {**made_body, "name": 7}, "name"),
        (f"/contexts/{first['id']}", {}, "ttl_seconds"),
        (f"/contexts/{first['id']}", {"ttl_seconds": True}, "ttl_seconds"),
    ):
      send = alice.post if path == "/contexts" else alice.patch
      with pytest.raises(openai.BadRequestError) as refused:
        await send(path, body=body, cast_to=object)
      assert refused.value.body["param"] == param, refused.value.body
    with pytest.raises(openai.BadRequestError) as refused:
      await alice.get("/contexts", cast_to=object, options={"params": {"limit": 0}})
    assert refused.value.body["param"] == "limit"

  try:
    asyncio.run(asyncio.wait_for(scenario(), 300))  # bounded
  finally:
    engine.stop(drain=False, timeout=10)


def _stop(proc):
  if proc.poll() is None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


@pytest.mark.slow  # two live servers: about a minute on 2 busy cores
def test_two_replicas_over_one_directory_share_their_contexts_and_quota(tmp_path):
  checkpoint = tiny_hf_checkpoint(tmp_path / "ckpt")
  keys = tmp_path / "keys"
  keys.write_text("\n".join(KEYS) + "\n")
  os.chmod(keys, 0o600)
  flags = ["--model", str(checkpoint), "--api-keys", str(keys), "--rows", "2"]
  flags += ["--contexts", str(tmp_path / "shared"), "--context-quota", "30KiB"]
  servers = [start_server(flags, tmp_path / f"server{i}.log", timeout=240) for i in range(2)]
  (one, first_url), (two, second_url) = servers
  alice = {"Authorization": f"Bearer {KEYS[0]}"}
  body = {"text": "a document kept on one replica " * 4, "policy": "kvzip", "budget": 0.5}
  try:
    made = httpx.post(f"{first_url}/v1/contexts", json=body, headers=alice, timeout=120)
    assert made.status_code == 200, made.text
    cid = made.json()["id"]
    got = httpx.get(f"{second_url}/v1/contexts/{cid}", headers=alice, timeout=30)
    assert got.status_code == 200 and got.json() == made.json()
    reply = httpx.post(
        f"{second_url}/v1/completions",
        headers=alice,
        timeout=120,
        json={"model": "ckpt", "prompt": "and then", "max_tokens": 3, "context_id": cid},
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # One quota over both: each replica refuses once the tenant's contexts fill it.
    codes = []
    for i in range(6):  # bounded
      url = (first_url, second_url)[i % 2]
      codes.append(
          httpx.post(f"{url}/v1/contexts", json=body, headers=alice, timeout=120).status_code
      )
      if codes[-1] != 200:
        break
    assert codes[-1] == 429, codes
    listed = httpx.get(f"{first_url}/v1/contexts", headers=alice, timeout=30).json()
    again = httpx.get(f"{second_url}/v1/contexts", headers=alice, timeout=30).json()
    assert listed == again and len(listed["data"]) == codes.count(200) + 1
    assert httpx.delete(f"{second_url}/v1/contexts/{cid}", headers=alice).status_code == 200
    assert httpx.get(f"{first_url}/v1/contexts/{cid}", headers=alice).status_code == 404
  finally:
    for proc, _ in servers:
      _stop(proc)
  for i in range(2):
    assert "Traceback" not in (tmp_path / f"server{i}.log").read_text()
