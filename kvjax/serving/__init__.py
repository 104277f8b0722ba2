"""Serving: requests join and leave one running batch over one page pool (continuous
batching), so the pages compression frees become admitted requests.

    _batch   the served batch: rows as slots, insert / release / a compiled decode of every
             active row with its own remaining tokens, budget and sampling values
    _request  what a caller hands the engine (`Request`, `EngineConfig`) and what it raises
    _admission  a request planned once: its prompt encoded, its own plan, its row's budget
             and the pages its row holds at its peak; what the engine cannot serve, refused
    _engine  `Engine`: admission by those pages, a bounded queue, cancels, a streaming
             request's tokens after every step; one thread owns every device call and
             survives any request's failure; no HTTP
    _contexts  per-tenant compressed contexts kept per model (records, TTL, quota, a lock
             replicas share)
    _context_routes  the contexts API over HTTP (create, list, get, update, delete)
    _guards  what refuses a request before its route (keys, Host, body size, idle clients)
    _protocol  the OpenAI wire format and the engine prompt of a request (a chat's question
             protected)
    _telemetry  the operator's log (logger "kvjax.serve") and /metrics
    http     the FastAPI face
"""

from kvjax.serving._engine import (
    Engine,
    EngineConfig,
    EngineStopped,
    QueueFull,
    Request,
    RequestTooLarge,
    Unservable,
)

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineStopped",
    "QueueFull",
    "Request",
    "RequestTooLarge",
    "Unservable",
]
