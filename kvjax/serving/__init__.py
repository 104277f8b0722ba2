"""Serving: requests join and leave one running batch over one page pool (continuous
batching), so the pages compression frees become admitted requests.

    _batch   the served batch: rows as slots, insert / release / a compiled decode of every
             active row with its own remaining tokens, budget and sampling values
    _engine  `Engine`: admission by the pages a request's plan needs, a bounded queue,
             cancels, a streaming request's tokens after every step; one thread owns every
             device call; no HTTP
    _contexts  per-tenant compressed contexts (TTL, quota, what each keeps)
    _protocol  the OpenAI wire format and the engine prompt of a request (a chat's question
             protected)
    http     the FastAPI face, and the operator's log (logger "kvjax.serve")
"""

from kvjax.serving._engine import (
    Engine,
    EngineConfig,
    QueueFull,
    Request,
    RequestTooLarge,
)

__all__ = ["Engine", "EngineConfig", "QueueFull", "Request", "RequestTooLarge"]
