"""What stands between a connection and the routes of `kvjax serve`: pure ASGI middlewares (a
`BaseHTTPMiddleware` would hide client disconnects) and the HTTP protocol uvicorn runs. Each
refusal is an OpenAI error object, counted in /metrics.

    Catch      an error no route answered: a 500 error object (its type and first line),
               logged in one line, never a traceback
    Auth       /v1 and /metrics take `Authorization: Bearer KEY` with a known key (when keys
               are given): else 401 `invalid_api_key`
    HostCheck  a Host header the server does not answer to: 400 (a web page whose DNS name
               rebinds to 127.0.0.1 cannot reach a local server)
    BodyLimit  a body past `--max-body` bytes: 413, before any of it is parsed
    protocol   uvicorn's h11 with a deadline on a request's headers and on a pause in its body
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import time

from starlette.responses import JSONResponse

from kvjax.serving import _protocol as wire
from kvjax.serving._request import one_line  # noqa: F401 - an error as a client sees it
from kvjax.serving._telemetry import endpoint_label, printable

log = logging.getLogger("kvjax.serve")

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
# h11's own default, stated so that the bound on a request's headers does not move with it.
HEADER_BYTES = 16 * 1024


class ErrorResponse(JSONResponse):
  """An OpenAI error object. ASCII JSON: a message that quotes what a client sent (a lone
  surrogate included) always renders."""

  def render(self, content) -> bytes:
    return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(status, message, kind, param=None, code=None, headers=None) -> ErrorResponse:
  return ErrorResponse(wire.error_body(message, kind, param, code), status, headers=headers)


def tenant_of(key: str) -> str:
  """A tenant's name from its API key: a digest, so no key is kept or logged in the clear."""
  return hashlib.sha256(key.encode()).hexdigest()[:16]


def is_loopback(host: str) -> bool:
  """Whether `host` (a name or an address, as --host takes it) is this machine's only."""
  if host.lower() == "localhost":
    return True
  try:
    return ipaddress.ip_address(host.strip("[]")).is_loopback
  except ValueError:
    return False


def host_name(value: str) -> str:
  """A Host header's (or an --allowed-hosts entry's) name: lower case, without its port or
  an IPv6 address's brackets."""
  value = value.strip().lower()
  if value.startswith("["):  # [::1]:8000
    return value[1:].partition("]")[0]
  if value.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
    value = value.partition(":")[0]
  return value


class Catch:
  """Answers an error that no route answered (a response that cannot be rendered, a bug) with
  a 500 `server_error` object, counted (`finish`) and logged in one line; once a response
  has begun, the connection is closed instead."""

  def __init__(self, app, finish):
    self.app, self.finish = app, finish

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    started = False

    async def watched(message):
      nonlocal started
      started = started or message["type"] == "http.response.start"
      await send(message)

    try:
      await self.app(scope, receive, watched)
    except Exception as err:  # noqa: BLE001 - answered and logged, never re-raised
      log.error("%s %s failed: %s", scope["method"], printable(scope["path"]), one_line(err))
      if started:  # uvicorn closes a connection whose response did not end
        return
      self.finish(scope, endpoint_label(scope["path"]), 500)
      await error_response(500, one_line(err), "server_error")(scope, receive, send)


class Auth:
  """/v1 and /metrics ask for `Authorization: Bearer KEY` with one of `keys` (None: no key
  asked, one local tenant); a request's tenant and its arrival go in its scope's state
  (`Telemetry.finish` logs them)."""

  def __init__(self, app, keys: set[str] | None, finish):
    self.app, self.finish = app, finish
    # Compared as bytes: `hmac.compare_digest` raises on a str that is not ASCII.
    self.keys = None if keys is None else {k.encode(): tenant_of(k) for k in keys}

  async def __call__(self, scope, receive, send):
    path = scope.get("path", "")
    if scope["type"] == "http" and (path.startswith("/v1") or path == "/metrics"):
      state = scope.setdefault("state", {})
      state.update(tenant="local" if self.keys is None else "-", started=time.perf_counter())
      if self.keys is not None:
        scheme, _, key = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        # Every key compared, the match or not: no early exit that times could tell.
        tenants = [t for k, t in self.keys.items() if hmac.compare_digest(key, k)]
        if scheme.lower() != b"bearer" or not tenants:
          self.finish(scope, endpoint_label(path), 401)
          response = error_response(
              401, "missing or unknown API key", "invalid_request_error", code="invalid_api_key"
          )
          return await response(scope, receive, send)
        state["tenant"] = tenants[0]
    await self.app(scope, receive, send)


class HostCheck:
  """Answers 400 to a request whose Host header names none of `hosts` (None: any). A browser
  always sends the name it resolved, so a page that rebinds its own name to 127.0.0.1 is
  refused; a client without a Host header is no browser, and is let through."""

  def __init__(self, app, hosts: set[str] | None, finish):
    self.app, self.finish = app, finish
    self.hosts = None if hosts is None else {host_name(h) for h in hosts}

  async def __call__(self, scope, receive, send):
    if scope["type"] == "http" and self.hosts is not None:
      given = dict(scope["headers"]).get(b"host")
      host = None if given is None else host_name(given.decode("latin-1"))
      if host is not None and host not in self.hosts:
        self.finish(scope, endpoint_label(scope["path"]), 400)
        response = error_response(
            400,
            f"this server does not answer to the host {host!r} (kvjax serve --allowed-hosts)",
            "invalid_request_error",
            code="invalid_host",
        )
        return await response(scope, receive, send)
    await self.app(scope, receive, send)


class BodyLimit:
  """Answers 413 to a request whose body passes `limit` bytes (None: no limit): by its
  Content-Length before a byte of it is read, else (a chunked body) once the bytes received
  pass it. The body is read whole before the route sees it, so nothing parses a part."""

  def __init__(self, app, limit: int | None, finish):
    self.app, self.limit, self.finish = app, limit, finish

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http" or self.limit is None:
      return await self.app(scope, receive, send)
    length = dict(scope["headers"]).get(b"content-length", b"")
    if length.isdigit() and int(length) > self.limit:
      return await self.refuse(scope, receive, send)
    messages, total = [], 0
    while True:
      message = await receive()
      messages.append(message)
      if message["type"] != "http.request":  # the client left
        break
      total += len(message.get("body", b""))
      if total > self.limit:
        return await self.refuse(scope, receive, send)
      if not message.get("more_body", False):
        break

    async def replay():  # then a disconnect, as the client sends it
      return messages.pop(0) if messages else await receive()

    await self.app(scope, replay, send)

  async def refuse(self, scope, receive, send):
    self.finish(scope, endpoint_label(scope["path"]), 413)
    response = error_response(
        413,
        f"the request body is larger than {self.limit} bytes (kvjax serve --max-body)",
        "invalid_request_error",
        code="request_too_large",
        headers={"Connection": "close"},  # the rest of the body is not read
    )
    await response(scope, receive, send)


def protocol(idle: float):
  """uvicorn's h11 protocol where a client has `idle` seconds to send a request's headers
  (from connecting, or from its first byte after a response) and pauses at most `idle`
  seconds while it sends a body; past either its connection is closed (uvicorn's own would
  wait forever). A request it cannot parse (headers past `HEADER_BYTES`, say) gets a 400
  error object."""
  import h11
  from uvicorn.protocols.http.h11_impl import H11Protocol

  class Guarded(H11Protocol):
    deadline = None

    def connection_made(self, transport):
      super().connection_made(transport)
      self.arm()

    def connection_lost(self, exc):
      self.disarm()
      super().connection_lost(exc)

    def data_received(self, data):
      super().data_received(data)
      state = self.conn.their_state
      if state is h11.SEND_BODY:  # a pause counts from the body's last byte
        self.arm()
      elif state is h11.IDLE:  # headers: one deadline, however slowly they come
        if self.deadline is None:
          self.arm()
      else:
        self.disarm()

    def arm(self):
      self.disarm()
      self.deadline = self.loop.call_later(idle, self.expire)

    def disarm(self):
      if self.deadline is not None:
        self.deadline.cancel()
        self.deadline = None

    def expire(self):
      self.deadline = None
      state = self.conn.their_state
      if state is h11.SEND_BODY and self.flow.read_paused:  # the server's wait, not theirs
        self.arm()
      elif state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
      body = json.dumps(wire.error_body(msg, "invalid_request_error")).encode()
      headers = [
          (b"content-type", b"application/json"),
          (b"content-length", str(len(body)).encode()),
          (b"connection", b"close"),
      ]
      for event in (h11.Response(status_code=400, headers=headers), h11.Data(data=body)):
        self.transport.write(self.conn.send(event))
      self.transport.write(self.conn.send(h11.EndOfMessage()))
      self.transport.close()

  return Guarded
