"""The OpenAI wire format kvjax serves: request bodies (validated; every error names its
field), the engine request each becomes, and the response and stream chunk bodies.

kvjax's extension: a top-level "compression" object, {"policy": NAME, "budget": N}, chooses
the request's policy and budget (validated as `kvjax.CompressionSpec` validates them); the
server's own spec applies to what it leaves out.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvjax.runtime.sampling import TEMPERATURE_MAX, TOP_K_MAX, Sampling
from kvjax.spec import CompressionSpec

MAX_TOKENS_LIMIT = 1 << 20  # past any model context: the engine names the real limit


class BadRequest(ValueError):
  """A request the server refuses (HTTP `status`), naming the field (`param`)."""

  def __init__(self, message: str, param: str | None, status: int = 400, code: str | None = None):
    super().__init__(message)
    self.param, self.status, self.code = param, status, code


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None):
  return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Compression(BaseModel):
  model_config = ConfigDict(extra="forbid")
  policy: str | None = None
  budget: int | float | Literal["auto"] | None = None


class StreamOptions(BaseModel):
  include_usage: bool = False


class _Common(BaseModel):
  model_config = ConfigDict(extra="ignore")  # fields of OpenAI's API kvjax does not use
  model: str
  max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
  max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
  temperature: float = Field(default=1.0, ge=0, le=TEMPERATURE_MAX)
  top_p: float = Field(default=1.0, gt=0, le=1)
  top_k: int = Field(default=0, ge=0, le=TOP_K_MAX)
  seed: int | None = Field(default=None, ge=0, le=2**32 - 1)
  n: int = Field(default=1, ge=1, le=1)
  stop: str | list[str] | None = None
  stream: bool = False
  stream_options: StreamOptions | None = None
  compression: Compression | None = None
  context_id: str | None = None
  ignore_eos: bool = False  # vLLM's extension: run to max_tokens (load tests)

  def limit(self, default: int) -> int:
    return self.max_completion_tokens or self.max_tokens or default

  def stops(self) -> list[str]:
    stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
    if len(stops) > 4 or any(not s for s in stops):
      raise BadRequest("stop takes up to 4 non-empty strings", "stop")
    return stops

  def sampling(self) -> Sampling:
    return Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


class Message(BaseModel):
  role: Literal["system", "user", "assistant"]
  content: str


class ChatRequest(_Common):
  messages: list[Message] = Field(min_length=1)


class CompletionRequest(_Common):
  prompt: str | list[int] = Field(min_length=1)
  max_tokens: int | None = Field(default=16, ge=1, le=MAX_TOKENS_LIMIT)


class ContextRequest(BaseModel):
  model_config = ConfigDict(extra="forbid")
  text: str = Field(min_length=1)
  policy: str = "kvzip"
  budget: int | float = 0.25


def request_spec(base: CompressionSpec, compression: Compression | None) -> CompressionSpec:
  """The server's spec with the request's policy and budget; BadRequest naming the one
  that is wrong."""
  if compression is None:
    return base
  given = {k: v for k, v in compression.model_dump().items() if v is not None}
  if "policy" in given and given["policy"] != base.policy.name and "budget" not in given:
    given["budget"] = None  # the server's budget was for its own policy
  try:
    return base.replace(**given)
  except (ValueError, TypeError) as err:
    message = str(err).splitlines()[0]
    field = "budget" if "budget" in message and "budget" in given else "policy"
    raise BadRequest(message, f"compression.{field}") from None


def new_id(prefix: str) -> str:
  return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt: int, completion: int) -> dict:
  return {
      "prompt_tokens": prompt,
      "completion_tokens": completion,
      "total_tokens": prompt + completion,
  }


def chat_response(rid, model, text, finish, prompt, completion) -> dict:
  return {
      "id": rid,
      "object": "chat.completion",
      "created": int(time.time()),
      "model": model,
      "choices": [
          {
              "index": 0,
              "message": {"role": "assistant", "content": text},
              "finish_reason": finish,
              "logprobs": None,
          }
      ],
      "usage": usage(prompt, completion),
  }


def completion_response(rid, model, text, finish, prompt, completion) -> dict:
  return {
      "id": rid,
      "object": "text_completion",
      "created": int(time.time()),
      "model": model,
      "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
      "usage": usage(prompt, completion),
  }


def chunk(rid, model, chat: bool, text: str | None, finish: str | None, first: bool = False):
  """One streamed chunk: a text delta, or the end (`finish`)."""
  if chat:
    delta = {} if text is None else {"content": text}
    if first:
      delta["role"] = "assistant"
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    kind = "chat.completion.chunk"
  else:
    choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    kind = "text_completion"
  return {
      "id": rid,
      "object": kind,
      "created": int(time.time()),
      "model": model,
      "choices": [choice],
  }
