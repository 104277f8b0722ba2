"""The HTTP face of the engine: an OpenAI-compatible server (FastAPI on uvicorn). A thin
layer: it validates and tokenizes a request, hands it to the `Engine`, and turns the
engine's events into a response or an SSE stream; the engine knows nothing of HTTP.

    app = make_app(engine, model_name="smollm2-135m-instruct", api_keys={"sk-...": "alice"})
    serve(app, host="127.0.0.1", port=8000)        # what `kvjax serve` runs

Endpoints: POST /v1/chat/completions, POST /v1/completions (both with "stream"),
GET /v1/models, GET /health, GET /metrics (Prometheus text). Errors are OpenAI error objects
naming the field; 401 for a missing or wrong key (when keys are given), 404 for an unknown
model, 429 with Retry-After when the queue is full. A client that goes away mid-request has
its request cancelled: its row is freed in the engine's next round.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import signal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvjax.runtime.prompts import Segment, chat_parts
from kvjax.runtime.session import prefill
from kvjax.serving import _protocol as wire
from kvjax.serving._contexts import ContextStore, QuotaExceeded
from kvjax.serving._engine import Engine, QueueFull, RequestTooLarge
from kvjax.serving._engine import Request as EngineRequest

DEFAULT_MAX_TOKENS = 256  # a chat completion's limit when the request gives none


def _error(status: int, message: str, kind: str, param=None, code=None, headers=None):
  return JSONResponse(wire.error_body(message, kind, param, code), status, headers=headers)


def tenant_of(key: str) -> str:
  """A tenant's name from its API key: a digest, so no key is kept or logged in the clear."""
  return hashlib.sha256(key.encode()).hexdigest()[:16]


class _Auth:
  """Pure ASGI middleware (a `BaseHTTPMiddleware` would hide client disconnects): every /v1
  request carries `Authorization: Bearer KEY` with a known key; its tenant goes in the
  request's scope."""

  def __init__(self, app, keys: set[str] | None):
    self.app, self.keys = app, keys

  async def __call__(self, scope, receive, send):
    if scope["type"] == "http" and scope["path"].startswith("/v1"):
      tenant = "local"
      if self.keys is not None:
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, key = header.partition(" ")
        known = any(hmac.compare_digest(key, k) for k in self.keys)
        if scheme.lower() != "bearer" or not key or not known:
          response = _error(
              401, "missing or unknown API key", "invalid_request_error", code="invalid_api_key"
          )
          return await response(scope, receive, send)
        tenant = tenant_of(key)
      scope.setdefault("state", {})["tenant"] = tenant
    await self.app(scope, receive, send)


class _Text:
  """A request's generated text, decoded as its tokens arrive: what is new since the last
  call (held back while it ends in a partial character), cut at the first stop string."""

  def __init__(self, tokenizer, stops: list[str]):
    self.tokenizer, self.stops = tokenizer, stops
    self.ids: list[int] = []
    self.sent = 0
    self.stopped = False

  def add(self, ids: list[int]) -> str:
    self.ids += ids
    text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
    for stop in self.stops:
      at = text.find(stop)
      if at >= 0:
        text, self.stopped = text[:at], True
    if not self.stopped:
      text = text.rstrip("\ufffd")  # a character whose bytes have not all come yet
    new, self.sent = text[self.sent :], max(self.sent, len(text))
    return new


class _Service:
  """What the routes share: the engine, the model's name, the contexts, the request counts."""

  def __init__(self, engine: Engine, model_name: str, contexts: ContextStore | None):
    self.engine, self.model_name, self.contexts = engine, model_name, contexts
    self.requests: dict[tuple[str, int], int] = {}

  def count(self, endpoint: str, status: int) -> None:
    self.requests[endpoint, status] = self.requests.get((endpoint, status), 0) + 1

  def metrics(self) -> str:
    """The Prometheus text exposition of the server's counters and the engine's gauges."""
    stats = self.engine.stats()
    lines = [
        "# HELP kvjax_requests_total HTTP requests answered, by endpoint and status.",
        "# TYPE kvjax_requests_total counter",
    ]
    for (endpoint, status), n in sorted(self.requests.items()):
      lines.append(f'kvjax_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
    page = stats["page_bytes"]
    gauges = {
        "kvjax_queue_depth": ("requests waiting for memory or a row", stats["queue"]),
        "kvjax_rows_in_use": ("rows (slots) decoding a request", stats["rows_in_use"]),
        "kvjax_rows": ("rows of the served batch", stats["rows"]),
        "kvjax_kv_bytes_reserved": (
            "K/V bytes the running requests' plans reserve",
            stats["pages_reserved"] * page,
        ),
        "kvjax_kv_bytes_pool": ("K/V bytes of the page pool", stats["pages"] * page),
        "kvjax_tokens_per_second": (
            "tokens generated per second, last round",
            stats["tokens_per_s"],
        ),
    }
    for name, (text, value) in gauges.items():
      lines += [f"# HELP {name} {text}.", f"# TYPE {name} gauge", f"{name} {value}"]
    lines += [
        "# HELP kvjax_generated_tokens_total tokens generated.",
        "# TYPE kvjax_generated_tokens_total counter",
        f"kvjax_generated_tokens_total {stats.get('generated_tokens', 0)}",
    ]
    return "\n".join(lines) + "\n"

  def submit(self, body: wire._Common, chat: bool, context=None):
    """(the engine request, its events queue, the text decoder, prompt tokens) for `body`,
    submitted (after `context`, a loaded compressed context, when given); raises what
    `complete` turns into an error response."""
    engine = self.engine
    if context is not None:
      if body.compression is not None:
        raise wire.BadRequest("a context keeps the compression it was made with", "compression")
      prompt, prompt_tokens = _question(engine, body, chat)
      spec = context.plan.spec
    else:
      prompt, prompt_tokens = _prompt(engine, body, chat)
      spec = wire.request_spec(engine.spec, body.compression)
    text = _Text(engine.tokenizer, body.stops())
    events: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    job = EngineRequest(
        prompt=prompt,
        spec=spec,
        max_tokens=body.limit(DEFAULT_MAX_TOKENS),
        emit=lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
        sampling=body.sampling(),
        seed=body.seed or 0,
        context=context,
        stops=not body.ignore_eos,
    )
    engine.submit(job)
    return job, events, text, prompt_tokens

  async def complete(self, request: Request, body: wire._Common, chat: bool):
    endpoint = request.url.path
    if body.model != self.model_name:
      self.count(endpoint, 404)
      return _error(
          404,
          f"the model {body.model!r} does not exist here; this server has {self.model_name!r}",
          "invalid_request_error",
          "model",
          "model_not_found",
      )
    context = None
    if body.context_id is not None:
      context = await self.load_context(request, body.context_id)
      if context is None:
        self.count(endpoint, 404)
        return _context_not_found()
    try:
      job, events, text, prompt_tokens = self.submit(body, chat, context)
    except QueueFull as err:
      self.count(endpoint, 429)
      return _error(
          429,
          str(err),
          "rate_limit_error",
          code="rate_limit_exceeded",
          headers={"Retry-After": "1"},
      )
    except RequestTooLarge as err:
      self.count(endpoint, 400)
      return _error(400, str(err), "invalid_request_error", err.field)
    except wire.BadRequest as err:
      self.count(endpoint, err.status)
      return _error(err.status, str(err), "invalid_request_error", err.param, err.code)
    except (ValueError, TypeError) as err:
      self.count(endpoint, 400)
      return _error(400, str(err).splitlines()[0], "invalid_request_error", _param_of(err))
    except RuntimeError as err:  # the engine stopped (the server is shutting down)
      self.count(endpoint, 503)
      return _error(503, str(err), "server_error", headers={"Retry-After": "1"})
    rid = wire.new_id("chatcmpl" if chat else "cmpl")
    flow = _events(events, text, self.engine, job)
    if body.stream:
      return StreamingResponse(
          _stream(flow, self, job, rid, chat, body, prompt_tokens, endpoint),
          media_type="text/event-stream",
          headers={"Cache-Control": "no-cache"},
      )

    async def collect():
      parts, finish, generated = [], None, 0
      async for new, finish, generated in flow:
        parts.append(new)
      return "".join(parts), finish, generated

    work = asyncio.create_task(collect())
    watcher = asyncio.create_task(_gone(request))
    done, pending = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
      task.cancel()
    if work not in done:  # the client left: free its row
      self.engine.cancel(job.id)
      self.count(endpoint, 499)
      return PlainTextResponse("", 499)
    try:
      out, finish, generated = work.result()
    except RuntimeError as err:
      self.count(endpoint, 500)
      return _error(500, str(err), "server_error")
    self.count(endpoint, 200)
    make = wire.chat_response if chat else wire.completion_response
    return make(rid, self.model_name, out, finish, prompt_tokens, generated)

  async def load_context(self, request: Request, cid: str):
    """The tenant's context `cid` (None: unknown, another tenant's, expired or invalid)."""
    if self.contexts is None:
      return None
    return await asyncio.to_thread(self.contexts.load, request.state.tenant, cid)

  async def create_context(self, request: Request, body: wire.ContextRequest):
    endpoint = "/v1/contexts"
    if self.contexts is None:
      self.count(endpoint, 404)
      return _error(404, "this server keeps no contexts", "invalid_request_error")
    try:
      spec = wire.request_spec(
          self.engine.spec, wire.Compression(policy=body.policy, budget=body.budget)
      )
      if not spec.once:
        raise wire.BadRequest(
            f"policy {spec.policy.name!r} does not compress a context once (kvzip, "
            "expected_attention, learned do)",
            "policy",
        )
      prompt, tokens = _document(self.engine, body.text)
      self.engine.check(
          EngineRequest(prompt=prompt, spec=spec, max_tokens=1, emit=lambda event: None)
      )
    except RequestTooLarge as err:
      self.count(endpoint, 400)
      return _error(400, str(err), "invalid_request_error", "text")
    except wire.BadRequest as err:
      self.count(endpoint, err.status)
      return _error(err.status, str(err), "invalid_request_error", err.param, err.code)
    except (ValueError, TypeError) as err:
      self.count(endpoint, 400)
      return _error(400, str(err).splitlines()[0], "invalid_request_error", "text")
    tenant, engine = request.state.tenant, self.engine

    def compress_and_store():
      state = prefill(engine.model, [prompt], spec, tokenizer=engine.tokenizer, reserve=0)
      return self.contexts.save(tenant, state, tokens)

    try:
      made = await asyncio.wrap_future(engine.call(compress_and_store))
    except QuotaExceeded as err:
      self.count(endpoint, 429)
      return _error(429, str(err), "insufficient_quota", code="insufficient_quota")
    self.count(endpoint, 200)
    return {"object": "context", **dataclasses.asdict(made)}

  async def delete_context(self, request: Request, cid: str):
    deleted = self.contexts is not None and await asyncio.to_thread(
        self.contexts.delete, request.state.tenant, cid
    )
    self.count("/v1/contexts", 200 if deleted else 404)
    if not deleted:
      return _context_not_found()
    return {"id": cid, "object": "context", "deleted": True}


def _context_not_found():
  # One answer for an unknown id and another tenant's: nothing tells them apart.
  return _error(404, "no such context", "invalid_request_error", "context_id", "context_not_found")


async def _events(events: asyncio.Queue, text: _Text, engine: Engine, job):
  """(new text, finish, tokens so far) as the engine's events come: finish None until the
  end; a stop string ends the request (cancelled in the engine); an error raises."""
  generated = 0
  while True:
    kind, value = await events.get()
    if kind == "tokens":
      generated += len(value)
      new = text.add(value)
      if text.stopped:
        engine.cancel(job.id)
        yield new, "stop", generated
        return
      yield new, None, generated
    elif kind == "done":
      yield "", value, generated
      return
    else:
      raise RuntimeError(value)


def make_app(
    engine: Engine,
    *,
    model_name: str,
    api_keys: set[str] | None = None,
    contexts: ContextStore | None = None,
) -> FastAPI:
  """The FastAPI app serving `engine` as `model_name`; `api_keys` None: no key asked (a local
  server), else each key is its own tenant; `contexts`: where compressed contexts are kept
  (None: no /v1/contexts)."""
  service = _Service(engine, model_name, contexts)

  async def lifespan(app):
    yield
    # uvicorn runs this after in-flight requests finished (SIGTERM drains them).
    await asyncio.to_thread(engine.stop, True)

  app = FastAPI(lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
  app.add_middleware(_Auth, keys=api_keys)

  @app.exception_handler(RequestValidationError)
  async def invalid(request: Request, exc: RequestValidationError):
    first = exc.errors()[0]
    loc = [str(x) for x in first["loc"] if x != "body"]
    param = None if first["type"] == "json_invalid" or not loc else ".".join(loc)
    service.count(request.url.path, 400)
    message = first["msg"] if param is None else f"{param}: {first['msg']}"
    return _error(400, message, "invalid_request_error", param)

  @app.exception_handler(StarletteHTTPException)
  async def http_error(request: Request, exc: StarletteHTTPException):
    service.count(request.url.path if exc.status_code != 404 else "other", exc.status_code)
    return _error(exc.status_code, str(exc.detail), "invalid_request_error")

  @app.get("/health")
  async def health():
    return {"status": "ok"}

  @app.get("/v1/models")
  async def list_models():
    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "kvjax"}
    return {"object": "list", "data": [card]}

  @app.get("/metrics")
  async def prometheus():
    return PlainTextResponse(service.metrics(), media_type="text/plain; version=0.0.4")

  @app.post("/v1/chat/completions")
  async def chat_completions(body: wire.ChatRequest, request: Request):
    return await service.complete(request, body, chat=True)

  @app.post("/v1/completions")
  async def completions(body: wire.CompletionRequest, request: Request):
    return await service.complete(request, body, chat=False)

  @app.post("/v1/contexts")
  async def create_context(body: wire.ContextRequest, request: Request):
    return await service.create_context(request, body)

  @app.delete("/v1/contexts/{cid}")
  async def delete_context(cid: str, request: Request):
    return await service.delete_context(request, cid)

  return app


def _param_of(err: Exception) -> str | None:
  """The request field an engine error is about, where its message names one."""
  message = str(err)
  for field in ("max_tokens", "budget", "policy", "page_size", "prompt", "messages"):
    if field in message:
      return f"compression.{field}" if field in ("budget", "policy", "page_size") else field
  return None


def _document(engine: Engine, text: str):
  """(the prompt a context is read as, its tokens): the chat template's opening of a user
  message (protected) where the model has one, else `<bos>` where it starts with one, then
  the document; a question closes the message later (`_question`)."""
  tokenizer = engine.tokenizer
  opening, _ = chat_parts(tokenizer, True)
  if not opening and getattr(tokenizer, "add_bos", False):
    opening = [tokenizer.bos_id]
  ids = tokenizer.encode(text)
  if not ids:
    raise wire.BadRequest("the text is empty", "text")
  return [Segment(opening, protected=True), Segment(ids)], len(opening) + len(ids)


def _question(engine: Engine, body, chat: bool):
  """(ids, count) of what follows a context: a chat's one user message, closing the user
  turn the context opened, or a completion's prompt as it is."""
  tokenizer = engine.tokenizer
  if chat:
    if len(body.messages) != 1 or body.messages[0].role != "user":
      raise wire.BadRequest("a chat over a context takes one user message", "messages")
    ids = tokenizer.encode("\n\n" + body.messages[0].content) + chat_parts(tokenizer, True)[1]
  elif isinstance(body.prompt, str):
    ids = tokenizer.encode(body.prompt)
  else:
    ids = list(body.prompt)
  if not ids:
    raise wire.BadRequest("the question is empty", "messages" if chat else "prompt")
  return ids, len(ids)


def _prompt(engine: Engine, body, chat: bool):
  """(the engine's prompt, its token count) of a chat or text completion request."""
  tokenizer = engine.tokenizer
  if chat:
    if getattr(tokenizer, "chat_template", None) is None:
      raise wire.BadRequest(
          "this model has no chat template (a base model): use /v1/completions", "messages"
      )
    messages = [m.model_dump() for m in body.messages]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = tokenizer.encode(text)
  elif isinstance(body.prompt, str):
    ids = tokenizer.encode(body.prompt)
    bos = getattr(tokenizer, "bos_id", None)
    if getattr(tokenizer, "add_bos", False) and ids[:1] != [bos]:
      ids = [bos, *ids]
  else:
    vocab = engine.shape.vocab_size
    if any(not 0 <= t < vocab for t in body.prompt):
      raise wire.BadRequest(f"prompt token ids must be in [0, {vocab})", "prompt")
    ids = list(body.prompt)
  if not ids:
    raise wire.BadRequest("the prompt is empty", "messages" if chat else "prompt")
  return ids, len(ids)


async def _gone(request: Request) -> None:
  """Returns once the client has disconnected (a non-streaming request gets no notice)."""
  while not await request.is_disconnected():
    await asyncio.sleep(0.1)


async def _stream(flow, service: _Service, job, rid, chat, body, prompt_tokens, endpoint):
  """The SSE body: chunks as the text comes, the finish, usage if asked, [DONE]. Left early
  (the client went away), the request is cancelled."""
  model, finished = service.model_name, False
  try:
    first, generated = True, 0
    async for new, finish, generated in flow:
      if new or first:
        yield _sse(wire.chunk(rid, model, chat, new, None, first=first))
        first = False
      if finish is not None:
        yield _sse(wire.chunk(rid, model, chat, None, finish))
        break
    finished = True
    if body.stream_options is not None and body.stream_options.include_usage:
      end = wire.chunk(rid, model, chat, None, None)
      end["choices"], end["usage"] = [], wire.usage(prompt_tokens, generated)
      yield _sse(end)
    service.count(endpoint, 200)
    yield "data: [DONE]\n\n"
  except RuntimeError as err:  # the request failed alone (e.g. non-finite logits)
    finished = True
    service.count(endpoint, 500)
    yield _sse(wire.error_body(str(err), "server_error"))
    yield "data: [DONE]\n\n"
  finally:
    if not finished:
      service.engine.cancel(job.id)
      service.count(endpoint, 499)


def _sse(body: dict) -> str:
  return f"data: {json.dumps(body)}\n\n"


def serve(app: FastAPI, host: str, port: int, *, ready=None, drain_seconds: float = 30.0) -> None:
  """Runs `app` on uvicorn until SIGTERM or SIGINT; in-flight requests then finish (up to
  `drain_seconds`) before the engine stops. `ready(port)` is called once it listens."""
  import uvicorn

  config = uvicorn.Config(
      app,
      host=host,
      port=port,
      log_level="warning",
      lifespan="on",
      timeout_graceful_shutdown=drain_seconds,
  )
  server = uvicorn.Server(config)
  # uvicorn re-raises the signal it caught once it has stopped; a no-op handler lets the
  # process exit 0 after a clean drain.
  signal.signal(signal.SIGTERM, lambda *_: None)

  async def main():
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
      await asyncio.sleep(0.05)
    if server.started and ready is not None:
      ready(server.servers[0].sockets[0].getsockname()[1])
    await task

  asyncio.run(main())
