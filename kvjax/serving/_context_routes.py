"""The contexts API over HTTP (`ContextStore` behind it, the engine's thread compressing):

    POST   /v1/contexts        read and compress a document once: its record
    GET    /v1/contexts        the tenant's live contexts, oldest first (?after=ID&limit=N)
    GET    /v1/contexts/{id}   one record
    PATCH  /v1/contexts/{id}   a new lifetime (`ttl_seconds` from now) and/or `name`
    DELETE /v1/contexts/{id}   removed

A record says what the context keeps as a reader can check it: its document's tokens, the
share of their K/V kept, its bytes against the full cache's, the policy, the model, when it
was made and when it expires. Creating one waits in the engine's queue as a completion does
(429 past it), and the tenant's quota is checked before the document is read, on the pages
its plan holds, and again when it is saved. Another tenant's id is answered as an unknown
one (404).
"""

from __future__ import annotations

import asyncio
import dataclasses

from fastapi import FastAPI, Request

from kvjax.runtime.session import prefill
from kvjax.serving import _protocol as wire
from kvjax.serving._contexts import QuotaExceeded
from kvjax.serving._engine import (
    Engine,
    EngineStopped,
    QueueFull,
    RequestTooLarge,
    Unservable,
)
from kvjax.serving._engine import Request as EngineRequest
from kvjax.serving._guards import error_response, one_line

ENDPOINT = "/v1/contexts"  # every route's label in /metrics and the log
LIST_MAX = 100  # records a page of the list holds at most


def context_not_found():
  # One answer for an unknown id and another tenant's: nothing tells them apart.
  return error_response(
      404, "no such context", "invalid_request_error", "context_id", "context_not_found"
  )


def _record(context) -> dict:
  return {"object": "context", **dataclasses.asdict(context)}


def add_routes(app: FastAPI, service) -> None:
  """The contexts routes on `app`, answered through `service` (`http._Service`: its
  engine, its `contexts` store or None, `finish` and `refused`)."""

  def kept(request: Request):
    """None while the server keeps contexts; else the 404 that says it keeps none."""
    if service.contexts is not None:
      return None
    service.finish(request.scope, ENDPOINT, 404)
    return error_response(404, "this server keeps no contexts", "invalid_request_error")

  def answered(request: Request, found, status=200):
    service.finish(request.scope, ENDPOINT, status if found is not None else 404)
    return context_not_found() if found is None else found

  @app.post(ENDPOINT)
  async def create_context(body: wire.ContextRequest, request: Request):
    if (refused := kept(request)) is not None:
      return refused
    return await service.answer(request, _create(service, request, body))

  @app.get(ENDPOINT)
  async def list_contexts(request: Request, after: str | None = None, limit: str = "20"):
    if (refused := kept(request)) is not None:
      return refused
    if not limit.isdigit() or not 1 <= int(limit) <= LIST_MAX:
      err = wire.BadRequest(f"limit must be an integer in [1, {LIST_MAX}], got {limit!r}", "limit")
      return service.refused(request, ENDPOINT, err)
    records, more = await asyncio.to_thread(
        service.contexts.list, request.state.tenant, after=after, limit=int(limit)
    )
    service.finish(request.scope, ENDPOINT, 200)
    return {
        "object": "list",
        "data": [_record(c) for c in records],
        "first_id": records[0].id if records else None,
        "last_id": records[-1].id if records else None,
        "has_more": more,
    }

  @app.get(ENDPOINT + "/{cid}")
  async def get_context(cid: str, request: Request):
    if (refused := kept(request)) is not None:
      return refused
    found = await asyncio.to_thread(service.contexts.get, request.state.tenant, cid)
    return answered(request, None if found is None else _record(found))

  @app.patch(ENDPOINT + "/{cid}")
  async def update_context(cid: str, body: wire.ContextUpdate, request: Request):
    if (refused := kept(request)) is not None:
      return refused
    changes = {}
    if body.ttl_seconds is not None:
      changes["ttl"] = float(body.ttl_seconds)
    if "name" in body.model_fields_set:
      changes["name"] = body.name
    if not changes:
      err = wire.BadRequest("give ttl_seconds or name (or both)", "ttl_seconds")
      return service.refused(request, ENDPOINT, err)
    found = await asyncio.to_thread(service.contexts.update, request.state.tenant, cid, **changes)
    return answered(request, None if found is None else _record(found))

  @app.delete(ENDPOINT + "/{cid}")
  async def delete_context(cid: str, request: Request):
    if (refused := kept(request)) is not None:
      return refused
    deleted = await asyncio.to_thread(service.contexts.delete, request.state.tenant, cid)
    return answered(request, {"id": cid, "object": "context", "deleted": True} if deleted else None)


async def _create(service, request: Request, body: wire.ContextRequest):
  engine, tenant = service.engine, request.state.tenant
  try:
    spec = wire.request_spec(engine.spec, wire.Compression(policy=body.policy, budget=body.budget))
    if not spec.once:
      raise wire.BadRequest(
          f"policy {spec.policy.name!r} does not compress a context once (kvzip, "
          "expected_attention, learned do)",
          "policy",
      )
    # In a thread, as a completion's prompt: the document is tokenized.
    job = await asyncio.to_thread(_planned_document, engine, body.text, spec)
    # The quota before the work: what the document's plan holds at most.
    await asyncio.to_thread(
        service.contexts.check_quota, tenant, job.planned.pages * engine.page_bytes
    )
  except RequestTooLarge as err:
    err.field = "text"
    return service.refused(request, ENDPOINT, err)
  except Unservable as err:  # here, top-level fields
    return service.refused(request, ENDPOINT, wire.BadRequest(str(err), err.field))
  except wire.BadRequest as err:
    if err.param and err.param.startswith("compression."):  # here, top-level fields
      err.param = err.param.removeprefix("compression.")
    return service.refused(request, ENDPOINT, err)
  except QuotaExceeded as err:
    return _over_quota(service, request, err)
  except (ValueError, TypeError) as err:
    return service.refused(request, ENDPOINT, wire.BadRequest(str(err).splitlines()[0], "text"))

  def compress_and_store():  # the document as `check` encoded it
    state = prefill(engine.model, job.planned.encoded, spec, tokenizer=engine.tokenizer, reserve=0)
    return service.contexts.save(
        tenant,
        state,
        job.prompt_tokens,
        name=body.name,
        policy=f"{spec.policy.name}, budget {spec.budget}",
        ttl=None if body.ttl_seconds is None else float(body.ttl_seconds),
    )

  try:  # in the requests' queue: QueueFull (429) past it
    made = await asyncio.wrap_future(engine.call(compress_and_store, queued=True))
  except QuotaExceeded as err:
    return _over_quota(service, request, err)
  except (QueueFull, EngineStopped) as err:  # 429, 503
    return service.refused(request, ENDPOINT, err)
  except Exception as err:  # noqa: BLE001 - the read failed (a full disk, say): one line
    service.finish(request.scope, ENDPOINT, 500)
    message = f"the context could not be stored: {one_line(err)}"
    return error_response(500, message, "server_error")
  job.kept_share, job.kv_bytes = made.kept_share, made.kv_bytes
  service.finish(request.scope, ENDPOINT, 200, job, 0)
  return _record(made)


def _over_quota(service, request: Request, err: QuotaExceeded):
  service.finish(request.scope, ENDPOINT, 429)
  return error_response(429, str(err), "insufficient_quota", code="insufficient_quota")


def _planned_document(engine: Engine, text: str, spec) -> EngineRequest:
  """A context's document as an engine request, checked (`Engine.check`: sets its
  `prompt_tokens`, the document's and the opening's)."""
  prompt = wire.document_prompt(engine.tokenizer, text)
  job = EngineRequest(prompt=prompt, spec=spec, max_tokens=1, emit=lambda event: None)
  engine.check(job)
  return job
