"""The HTTP face of the engine: an OpenAI-compatible server (FastAPI on uvicorn). A thin
layer: it validates and tokenizes a request, hands it to the `Engine`, and turns the
engine's events into a response or an SSE stream (an event per token); the engine knows
nothing of HTTP.

    app = make_app(engine, model_name="smollm2-135m-instruct", api_keys={"sk-...": "alice"})
    serve(app, host="127.0.0.1", port=8000)        # what `kvjax serve` runs

Endpoints: POST /v1/chat/completions, POST /v1/completions (both with "stream"), the
contexts API (`_context_routes`: POST and GET /v1/contexts, GET, PATCH and DELETE
/v1/contexts/{id}), GET /v1/models, GET /health, GET /metrics (Prometheus text).
Errors are OpenAI error objects naming the field, on every path; 401 for a missing or wrong
key (when keys are given; /metrics too), 400 for a Host header the server does not answer to,
404 for an unknown model or route, 413 for a body past its limit, 429 with Retry-After when
the queue is full, 500 for a request that failed (an error event in a stream), 503 once the
engine takes no request (/health too, saying why); `_guards` holds what refuses a request
before its route. A prompt is tokenized off the event loop. A client that goes away
mid-request has its request cancelled: its row is freed in the engine's next round. Every /v1 request ends with one line in the
operator's log, and /metrics counts it (`_telemetry`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvjax.serving import _context_routes as context_routes
from kvjax.serving import _guards as guards
from kvjax.serving import _protocol as wire
from kvjax.serving._context_routes import context_not_found
from kvjax.serving._contexts import ContextStore
from kvjax.serving._engine import (
    Engine,
    EngineStopped,
    QueueFull,
    RequestTooLarge,
    Unservable,
)
from kvjax.serving._engine import Request as EngineRequest
from kvjax.serving._guards import one_line as _one_line
from kvjax.serving._guards import tenant_of  # noqa: F401 - the server's API
from kvjax.serving._telemetry import Telemetry, endpoint_label

log = logging.getLogger("kvjax.serve")

DEFAULT_MAX_TOKENS = 256  # a chat completion's limit when the request gives none


def _error(status: int, message: str, kind: str, param=None, code=None, headers=None):
  return guards.error_response(status, message, kind, param, code, headers)


class _Text:
  """A request's generated text, decoded as its tokens arrive: what is new since the last
  call, cut at the first stop string. Held back while it ends in a partial character or in
  what may begin a stop string (sent once it cannot, or by `flush` at the end): no client
  sees a stop string's first part."""

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
      text = text[: len(text) - self._stop_begins(text)]
    return self._send(text)

  def flush(self) -> str:
    """What is held back, once the request ended without a stop string."""
    if self.stopped:
      return ""
    return self._send(self.tokenizer.decode(self.ids, skip_special_tokens=True).rstrip("\ufffd"))

  def _send(self, text: str) -> str:
    new, self.sent = text[self.sent :], max(self.sent, len(text))
    return new

  def _stop_begins(self, text: str) -> int:
    """The length of the longest end of the unsent text that begins a stop string."""
    unsent = len(text) - self.sent
    longest = 0
    for stop in self.stops:
      for n in range(min(unsent, len(stop) - 1), longest, -1):
        if text.endswith(stop[:n]):
          longest = n
          break
    return longest


class _Service:
  """What the routes share: the engine, the model's name, the contexts, the default
  temperature, the request counts (`telemetry`)."""

  def __init__(
      self,
      engine: Engine,
      model_name: str,
      contexts: ContextStore | None,
      default_temperature: float,
      tenant_requests: int | None = None,
  ):
    self.engine, self.model_name, self.contexts = engine, model_name, contexts
    self.default_temperature = default_temperature
    self.telemetry = Telemetry()
    self.tenant_requests = tenant_requests  # a tenant's requests in flight at most
    self.in_flight: dict[str, int] = {}  # tenant -> requests taken, not yet answered

  def finish(self, scope: dict, endpoint: str, status: int, job=None, generated=None):
    """Counts an answered request and logs it (`Telemetry.finish`); a request `take` let
    in no longer counts against its tenant."""
    state = scope.get("state", {})
    if state.pop("in_flight", False):
      self.in_flight[state["tenant"]] -= 1
    self.telemetry.finish(scope, endpoint, status, job, generated)

  def take(self, request: Request):
    """None when the request's tenant may have one more request in flight (counted until
    its `finish`); else the 429 that says it may not."""
    tenant = request.state.tenant
    held = self.in_flight.get(tenant, 0)
    if self.tenant_requests is not None and held >= self.tenant_requests:
      self.finish(request.scope, endpoint_label(request.url.path), 429)
      message = f"this tenant has {held} requests in flight, the most it may have"
      return _error(
          429, message, "rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"}
      )
    self.in_flight[tenant] = held + 1
    request.scope["state"]["in_flight"] = True
    return None

  def submit(self, body: wire._Common, chat: bool, context, emit):
    """(the engine request, the text decoder) for `body`, submitted (after `context`, a
    loaded compressed context, when given; its events to `emit`); raises what `complete`
    turns into an error response. Tokenizes: off the event loop."""
    engine, tokenizer = self.engine, self.engine.tokenizer
    if context is not None:
      if body.compression is not None:
        raise wire.BadRequest("a context keeps the compression it was made with", "compression")
      prompt = wire.question_prompt(tokenizer, body, chat)
      spec = context.plan.spec
    else:
      if chat:
        prompt = wire.chat_prompt(tokenizer, [m.model_dump() for m in body.messages])
      else:
        prompt = wire.text_prompt(tokenizer, body.prompt, engine.shape.vocab_size)
      spec = wire.request_spec(engine.spec, body.compression)
    text = _Text(tokenizer, body.stops())
    job = EngineRequest(
        prompt=prompt,
        spec=spec,
        max_tokens=body.limit(DEFAULT_MAX_TOKENS),
        emit=emit,
        sampling=body.sampling(self.default_temperature),
        seed=body.seed,
        context=context,
        stops=not body.ignore_eos,
        stream=body.stream,
    )
    try:
      engine.submit(job)  # sets job.prompt_tokens
    except Unservable as err:
      if context is None:
        raise
      raise wire.BadRequest(f"the context was stored with {err}", "context_id") from None
    return job, text

  async def complete(self, request: Request, body: wire._Common, chat: bool):
    endpoint = request.url.path
    if body.model != self.model_name:
      self.finish(request.scope, endpoint, 404)
      return _error(
          404,
          f"the model {body.model!r} does not exist here; this server has {self.model_name!r}",
          "invalid_request_error",
          "model",
          "model_not_found",
      )
    context = record = None
    if body.context_id is not None:
      loaded = await self.load_context(request, body.context_id)
      if loaded is None:
        self.finish(request.scope, endpoint, 404)
        return context_not_found()
      context, record = loaded
    events: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    emit = lambda event: loop.call_soon_threadsafe(events.put_nowait, event)
    try:  # in a thread: a long prompt's tokenizing stalls no other client (/health either)
      job, text = await asyncio.to_thread(self.submit, body, chat, context, emit)
    except Exception as err:  # noqa: BLE001 - each answered by its status (`refused`)
      return self.refused(request, endpoint, err)
    rid = wire.new_id("chatcmpl" if chat else "cmpl")
    flow = _events(events, text, self.engine, job, per_token=body.stream)
    if body.stream:
      return StreamingResponse(
          _stream(flow, self, request, job, rid, chat, body, record),
          media_type="text/event-stream",
          headers={"Cache-Control": "no-cache"},
      )
    parts, ended = [], {"finish": None, "generated": 0}

    async def collect():
      async for new, finish, generated in flow:
        parts.append(new)
        ended.update(finish=finish, generated=generated)

    work = asyncio.create_task(collect())
    watcher = asyncio.create_task(_gone(request))
    try:
      done, pending = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server stops: its drain's time ran out
      work.cancel(), watcher.cancel()
      self.engine.cancel(job.id)
      self.finish(request.scope, endpoint, 503, job, ended["generated"])
      return _error(503, "the server stopped before the request finished", "server_error")
    for task in pending:
      task.cancel()
    if work not in done:  # the client left: free its row
      self.engine.cancel(job.id)
      self.finish(request.scope, endpoint, 499, job, ended["generated"])
      return PlainTextResponse("", 499)
    try:
      work.result()
    except Exception as err:  # noqa: BLE001 - the request failed (its error event), alone
      self.engine.cancel(job.id)  # where it failed here, not in the engine
      self.finish(request.scope, endpoint, 500, job, ended["generated"])
      message = str(err) if isinstance(err, _RequestFailed) else _one_line(err)
      return _error(500, message, "server_error")
    self.finish(request.scope, endpoint, 200, job, ended["generated"])
    make = wire.chat_response if chat else wire.completion_response
    out, finish, generated = "".join(parts), ended["finish"], ended["generated"]
    return make(rid, self.model_name, out, finish, job.prompt_tokens, generated, record)

  async def answer(self, request: Request, work):
    """The response `work` (a route's coroutine, run once its tenant may have one more
    request in flight: `take`) gives; an error it did not answer is a 500 error object,
    counted and logged in one line (never a traceback)."""
    refused = self.take(request)
    if refused is not None:
      work.close()
      return refused
    try:
      return await work
    except Exception as err:  # noqa: BLE001 - answered, never re-raised
      self.finish(request.scope, endpoint_label(request.url.path), 500)
      return _error(500, _one_line(err), "server_error")

  def refused(self, request: Request, endpoint: str, err: Exception):
    """The error response to a request the engine did not take (`err`), counted."""
    if isinstance(err, QueueFull):
      status, response = 429, _error(
          429,
          str(err),
          "rate_limit_error",
          code="rate_limit_exceeded",
          headers={"Retry-After": "1"},
      )
    elif isinstance(err, RequestTooLarge):
      status, response = 400, _error(400, str(err), "invalid_request_error", err.field)
    elif isinstance(err, Unservable):
      param = f"compression.{err.field}"
      status, response = 400, _error(400, str(err), "invalid_request_error", param)
    elif isinstance(err, wire.BadRequest):
      status = err.status
      response = _error(status, str(err), "invalid_request_error", err.param, err.code)
    elif isinstance(err, (ValueError, TypeError)):
      message = str(err).splitlines()[0]
      status, response = 400, _error(400, message, "invalid_request_error", _param_of(err))
    elif isinstance(err, EngineStopped):  # stopping, or its thread stopped on an error
      status = 503
      response = _error(503, str(err), "server_error", headers={"Retry-After": "1"})
    else:  # not the request's fault: a failure, answered and logged in one line
      status, response = 500, _error(500, _one_line(err), "server_error")
    self.finish(request.scope, endpoint, status)
    return response

  async def load_context(self, request: Request, cid: str):
    """(state, record) of the tenant's context `cid`; None where it has no such live one
    (unknown, another tenant's, expired)."""
    if self.contexts is None:
      return None
    return await asyncio.to_thread(self.contexts.load, request.state.tenant, cid)


class _RequestFailed(RuntimeError):
  """The engine ended a request with an error event (its message, one line)."""


async def _events(events: asyncio.Queue, text: _Text, engine: Engine, job, per_token: bool):
  """(new text, finish, tokens so far) as the engine's events come: one per token where
  `per_token` (a stream; its text may be empty while a character's bytes are incomplete),
  else one per engine event; finish None until the end; a stop string ends the request
  (cancelled in the engine); an error raises."""
  generated = 0
  while True:
    kind, value = await events.get()
    if kind == "tokens":
      for ids in [[token] for token in value] if per_token else [value]:
        generated += len(ids)
        new = text.add(ids)
        if text.stopped:
          engine.cancel(job.id)
          yield new, "stop", generated
          return
        yield new, None, generated
    elif kind == "done":
      yield text.flush(), value, generated
      return
    else:
      raise _RequestFailed(value)


def make_app(
    engine: Engine,
    *,
    model_name: str,
    api_keys: set[str] | None = None,
    contexts: ContextStore | None = None,
    default_temperature: float = 1.0,
    allowed_hosts: set[str] | None = None,
    max_body: int | None = 4 * 2**20,
    tenant_requests: int | None = 16,
) -> FastAPI:
  """The FastAPI app serving `engine` as `model_name`; `api_keys` None: no key asked (a local
  server), else each key is its own tenant (/metrics takes any of them); `contexts`: where
  compressed contexts are kept (None: no /v1/contexts); `default_temperature`: a request's
  that gives none; `allowed_hosts`: the Host header's names it answers (None: any);
  `max_body`: a request body's bytes at most (None: no limit); `tenant_requests`: the
  completions and context creations one tenant may have in flight (None: no limit; past
  it, 429)."""
  service = _Service(engine, model_name, contexts, default_temperature, tenant_requests)

  async def lifespan(app):
    yield
    # uvicorn runs this once the requests in flight finished, or the drain's time ran out
    # and it cancelled them: what the engine still holds has no client left to answer.
    await asyncio.to_thread(engine.stop, False, 30.0)
    stats = engine.stats()
    log.info(
        "stopped after %d requests answered, %d tokens generated",
        sum(service.telemetry.requests.values()),
        stats.get("generated_tokens", 0),
    )

  app = FastAPI(lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
  # The last added is the outermost: Catch, Auth, HostCheck, BodyLimit, then the routes.
  app.add_middleware(guards.BodyLimit, limit=max_body, finish=service.finish)
  app.add_middleware(guards.HostCheck, hosts=allowed_hosts, finish=service.finish)
  app.add_middleware(guards.Auth, keys=api_keys, finish=service.finish)
  app.add_middleware(guards.Catch, finish=service.finish)

  @app.exception_handler(RequestValidationError)
  async def invalid(request: Request, exc: RequestValidationError):
    first = exc.errors()[0]
    param = None if first["type"] == "json_invalid" else wire.param_at(first)
    service.finish(request.scope, endpoint_label(request.url.path), 400)
    message = first["msg"] if param is None else f"{param}: {first['msg']}"
    code = "unsupported_parameter" if first["type"] == "unsupported" else None
    return _error(400, message, "invalid_request_error", param, code)

  @app.exception_handler(StarletteHTTPException)
  async def http_error(request: Request, exc: StarletteHTTPException):
    endpoint = "other" if exc.status_code == 404 else endpoint_label(request.url.path)
    service.finish(request.scope, endpoint, exc.status_code)
    return _error(exc.status_code, str(exc.detail), "invalid_request_error")

  @app.get("/health")
  async def health():
    # 503 once the engine takes no request (stopping, or its thread stopped on an error):
    # a load balancer stops sending requests that could only fail.
    why = engine.unavailable()
    if why is not None:
      return JSONResponse({"status": "unavailable", "reason": why}, 503)
    return {"status": "ok"}

  @app.get("/v1/models")
  async def list_models(request: Request):
    service.finish(request.scope, "/v1/models", 200)
    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "kvjax"}
    return {"object": "list", "data": [card]}

  @app.get("/metrics")
  async def prometheus():
    return PlainTextResponse(
        service.telemetry.metrics(engine), media_type="text/plain; version=0.0.4"
    )

  @app.post("/v1/chat/completions")
  async def chat_completions(body: wire.ChatRequest, request: Request):
    return await service.answer(request, service.complete(request, body, chat=True))

  @app.post("/v1/completions")
  async def completions(body: wire.CompletionRequest, request: Request):
    return await service.answer(request, service.complete(request, body, chat=False))

  context_routes.add_routes(app, service)

  return app


def _param_of(err: Exception) -> str | None:
  """The request field an engine error is about, where its message names one."""
  message = str(err)
  for field in ("max_tokens", "budget", "policy", "page_size", "prompt", "messages"):
    if field in message:
      return f"compression.{field}" if field in ("budget", "policy", "page_size") else field
  return None


async def _gone(request: Request) -> None:
  """Returns once the client has disconnected (a non-streaming request gets no notice)."""
  while not await request.is_disconnected():
    await asyncio.sleep(0.1)


async def _stream(flow, service: _Service, request: Request, job, rid, chat, body, record=None):
  """The SSE body: a chunk per token as it is decoded (the first with the role), the
  finish, usage if asked, [DONE]. Left early (the client went away), the request is
  cancelled."""
  model, endpoint, finished = service.model_name, request.url.path, False
  first, generated, sent = True, 0, 0
  try:
    async for new, finish, generated in flow:
      if generated > sent or new or first:  # a token, or the role before an empty answer
        yield _sse(wire.chunk(rid, model, chat, new, None, first=first))
        first, sent = False, generated
      if finish is not None:
        yield _sse(wire.chunk(rid, model, chat, None, finish))
        break
    finished = True
    if body.stream_options is not None and body.stream_options.include_usage:
      end = wire.chunk(rid, model, chat, None, None)
      end["choices"], end["usage"] = [], wire.usage(job.prompt_tokens, generated, record)
      yield _sse(end)
    service.finish(request.scope, endpoint, 200, job, generated)
    yield "data: [DONE]\n\n"
  except Exception as err:  # noqa: BLE001 - the request failed alone (e.g. non-finite logits)
    finished = True
    service.engine.cancel(job.id)  # where it failed here, not in the engine
    service.finish(request.scope, endpoint, 500, job, generated)
    message = str(err) if isinstance(err, _RequestFailed) else _one_line(err)
    yield _sse(wire.error_body(message, "server_error"))
    yield "data: [DONE]\n\n"
  finally:
    if not finished:
      service.engine.cancel(job.id)
      service.finish(request.scope, endpoint, 499, job, generated)


def _sse(body: dict) -> str:
  return f"data: {json.dumps(body)}\n\n"


def server_config(app, host, port, drain_seconds=30.0, log_level="info", timeout_idle=30.0):
  """uvicorn's `Config` of `serve`: its own log from warnings up (kvjax logs every request
  itself: no access log), the guarded protocol (`_guards.protocol`), a request's headers
  bounded at `HEADER_BYTES`, a connection idle between requests closed after 5 s at most."""
  import uvicorn

  return uvicorn.Config(
      app,
      host=host,
      port=port,
      log_level=max(logging.WARNING, logging.getLevelName(log_level.upper())),
      access_log=False,
      lifespan="on",
      timeout_graceful_shutdown=drain_seconds,
      http=guards.protocol(timeout_idle),
      timeout_keep_alive=min(5.0, timeout_idle),
      h11_max_incomplete_event_size=guards.HEADER_BYTES,
  )


def serve(
    app: FastAPI,
    host: str,
    port: int,
    *,
    ready=None,
    drain_seconds: float = 30.0,
    log_level: str = "info",
    timeout_idle: float = 30.0,
) -> None:
  """Runs `app` on uvicorn until SIGTERM or SIGINT; in-flight requests then finish (up to
  `drain_seconds`) before the engine stops. `ready(port)` is called once it listens.
  `log_level`: the operator's; uvicorn's own messages show from warnings up (kvjax logs
  every request itself: no access log). `timeout_idle`: the seconds a client has to send a
  request's headers, and may pause while it sends a body (`_guards.protocol`)."""
  import uvicorn

  server = uvicorn.Server(server_config(app, host, port, drain_seconds, log_level, timeout_idle))
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
