"""The OpenAI wire format kvjax serves: request bodies (validated; every error names its
field), the engine prompt each becomes, and the response and stream chunk bodies.

kvjax's extension: a top-level "compression" object, {"policy": NAME, "budget": N}, chooses
the request's policy and budget (validated as `kvjax.CompressionSpec` validates them); the
server's own spec applies to what it leaves out.

What compression may drop: a chat's system prompt and earlier turns (the context); never
its last user message with the template's tokens around it and the generation prompt (the
question, a protected `Segment`), nor a question asked of a stored context.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

from kvjax.runtime.prompts import Segment, chat_request, context_prompt, encode_question
from kvjax.runtime.sampling import TEMPERATURE_MAX, TOP_K_MAX, Sampling
from kvjax.serving._contexts import NAME_MAX
from kvjax.spec import CompressionSpec

MAX_TOKENS_LIMIT = 1 << 20  # past any model context: the engine names the real limit
# A stop string's characters at most: the streamed text holds back what may begin one, and
# looks for it at every token.
STOP_CHARS = 1000


class BadRequest(ValueError):
  """A request the server refuses (HTTP `status`), naming the field (`param`)."""

  def __init__(self, message: str, param: str | None, status: int = 400, code: str | None = None):
    super().__init__(message)
    self.param, self.status, self.code = param, status, code


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None):
  return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _supported_only(*accepted):
  """A field of OpenAI's API that kvjax does not implement: accepted where it asks for
  nothing (one of `accepted`, or left out), else a 400 naming it (never ignored silently)."""

  def check(value):
    # By type too: `0 == False`, yet `"logprobs": 0` asks for something `false` does not.
    if not any(type(value) is type(a) and value == a for a in accepted):
      raise PydanticCustomError("unsupported", "not supported by kvjax serve")
    return value

  return Annotated[Any, AfterValidator(check)]


# Strict: `"max_tokens": true` or `"stream": "yes"` is a 400 naming the field, not 1 or True
# (an int is a float where OpenAI's API takes a number).
STRICT = ConfigDict(extra="forbid", strict=True)


class Compression(BaseModel):
  model_config = STRICT
  policy: str | None = None
  budget: int | float | Literal["auto"] | None = None


class StreamOptions(BaseModel):
  model_config = ConfigDict(strict=True)
  include_usage: bool = False


class _Common(BaseModel):
  # Fields it does not know are ignored (`user`, `metadata`, a client's extensions); those of
  # OpenAI's API that would change the answer kvjax gives are refused below.
  model_config = ConfigDict(extra="ignore", strict=True)
  model: str
  max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
  max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
  # None: the server's default (`kvjax serve --temperature`, else OpenAI's 1.0).
  temperature: float | None = Field(default=None, ge=0, le=TEMPERATURE_MAX)
  top_p: float = Field(default=1.0, gt=0, le=1)
  top_k: int = Field(default=0, ge=0, le=TOP_K_MAX)
  seed: int | None = Field(default=None, ge=0, le=2**32 - 1)
  n: _supported_only(1) = 1
  stop: str | list[str] | None = None
  stream: bool = False
  stream_options: StreamOptions | None = None
  compression: Compression | None = None
  context_id: str | None = None
  ignore_eos: bool = False  # vLLM's extension: run to max_tokens (load tests)
  # OpenAI's, unsupported: a 400 unless left out or at the value that asks for nothing.
  logprobs: _supported_only(None, False) = None
  top_logprobs: _supported_only(None, 0) = None
  tools: _supported_only(None, []) = None
  tool_choice: _supported_only(None, "none") = None
  functions: _supported_only(None, []) = None
  function_call: _supported_only(None, "none") = None
  response_format: _supported_only(None, {"type": "text"}) = None
  logit_bias: _supported_only(None, {}) = None
  presence_penalty: _supported_only(None, 0, 0.0) = None
  frequency_penalty: _supported_only(None, 0, 0.0) = None
  best_of: _supported_only(None, 1) = None
  echo: _supported_only(None, False) = None
  suffix: _supported_only(None, "") = None

  def limit(self, default: int) -> int:
    return self.max_completion_tokens or self.max_tokens or default

  def stops(self) -> list[str]:
    stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
    if len(stops) > 4 or any(not 0 < len(s) <= STOP_CHARS for s in stops):
      raise BadRequest(
          f"stop takes up to 4 non-empty strings of at most {STOP_CHARS} characters", "stop"
      )
    return stops

  def sampling(self, default_temperature: float = 1.0) -> Sampling:
    """The request's sampling values; `default_temperature` where it gives none."""
    temperature = default_temperature if self.temperature is None else self.temperature
    return Sampling(temperature=temperature, top_k=self.top_k, top_p=self.top_p)


class Message(BaseModel):
  model_config = ConfigDict(strict=True)
  role: Literal["system", "user", "assistant"]
  content: str


class ChatRequest(_Common):
  messages: list[Message] = Field(min_length=1)


class CompletionRequest(_Common):
  prompt: str | list[int] = Field(min_length=1)
  max_tokens: int | None = Field(default=16, ge=1, le=MAX_TOKENS_LIMIT)


TTL_MAX = 30 * 24 * 3600.0  # seconds a context may be kept, at most (30 days)


class ContextRequest(BaseModel):
  model_config = STRICT
  text: str = Field(min_length=1)
  policy: str = "kvzip"
  budget: int | float = 0.25
  name: str | None = Field(default=None, max_length=NAME_MAX)
  ttl_seconds: int | float | None = Field(default=None, gt=0, le=TTL_MAX)  # None: the server's


class ContextUpdate(BaseModel):
  """PATCH /v1/contexts/{id}: a new lifetime (from now) and/or display name."""

  model_config = STRICT
  ttl_seconds: int | float | None = Field(default=None, gt=0, le=TTL_MAX)
  name: str | None = Field(default=None, max_length=NAME_MAX)


def param_at(error: dict) -> str | None:
  """The field a validation error (pydantic's) names: its location's field names and list
  indices, up to the first that is neither (a union's member: "budget.int" is "budget"), or
  the unknown field an object forbids."""
  loc = tuple(error["loc"])
  loc = loc[1:] if loc[:1] == ("body",) else loc
  if error["type"] == "extra_forbidden":
    return ".".join(map(str, loc))
  models = (
      ChatRequest,
      CompletionRequest,
      ContextRequest,
      ContextUpdate,
      Message,
      Compression,
      StreamOptions,
  )
  fields = {name for model in models for name in model.model_fields}
  names = []
  for part in loc:
    if not (isinstance(part, int) or part in fields):
      break
    names.append(str(part))
  return ".".join(names) or None


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


def usage(prompt: int, completion: int, context=None) -> dict:
  """OpenAI's usage object. With a stored `context` (its record, `_contexts.Context`), its
  document counts in the prompt and as cached tokens, as a provider's prompt cache does."""
  if context is None:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
  cached = context.document_tokens
  return {
      "prompt_tokens": cached + prompt,
      "completion_tokens": completion,
      "total_tokens": cached + prompt + completion,
      "prompt_tokens_details": {"cached_tokens": cached},
  }


def served_from(context) -> dict:
  """kvjax's extension of a response from a stored context: unlike a provider's prompt
  cache, it is lossy, so the client is told how it was compressed and what it kept."""
  return {
      "context_id": context.id,
      "compression": {"policy": context.policy, "kept_share": context.kept_share},
  }


def chat_response(rid, model, text, finish, prompt, completion, context=None) -> dict:
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
      "usage": usage(prompt, completion, context),
      **({} if context is None else {"kvjax": served_from(context)}),
  }


def completion_response(rid, model, text, finish, prompt, completion, context=None) -> dict:
  return {
      "id": rid,
      "object": "text_completion",
      "created": int(time.time()),
      "model": model,
      "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
      "usage": usage(prompt, completion, context),
      **({} if context is None else {"kvjax": served_from(context)}),
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


# ---- the engine's prompt of a request -------------------------------------------------


def chat_prompt(tokenizer, messages) -> list[Segment]:
  """The engine's prompt of a chat (`messages`: dicts of role and content): the system
  prompt and earlier turns (the context, which the request's policy may compress), then the
  last user message with the template's tokens around it and the generation prompt (the
  question: protected, so no policy evicts it for the rest of the request). A chat that
  does not end with a user message has no question: all of it is context."""
  if getattr(tokenizer, "chat_template", None) is None:
    raise BadRequest(
        "this model has no chat template (a base model): use /v1/completions", "messages"
    )
  try:
    context, question = chat_request(tokenizer, messages)
  except ValueError as err:  # a message that is not UTF-8 text, a template that hides it
    raise BadRequest(str(err).splitlines()[0], "messages") from None
  prompt = [Segment(context)] if context else []
  if question:
    prompt.append(Segment(question, protected=True))
  if not prompt:
    raise BadRequest("the prompt is empty", "messages")
  return prompt


def text_prompt(tokenizer, prompt: str | list[int], vocab_size: int) -> list[int]:
  """The ids of a text completion's prompt: text encoded (after the tokenizer's `<bos>`
  where it starts sequences with one), or token ids as they are."""
  if isinstance(prompt, str):
    ids = tokenizer.encode(prompt)
    bos = getattr(tokenizer, "bos_id", None)
    if getattr(tokenizer, "add_bos", False) and ids[:1] != [bos]:
      ids = [bos, *ids]
  else:
    if any(not 0 <= t < vocab_size for t in prompt):
      raise BadRequest(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    ids = list(prompt)
  if not ids:
    raise BadRequest("the prompt is empty", "prompt")
  return ids


def document_prompt(tokenizer, text: str) -> list[Segment]:
  """The prompt a stored context is read as (`kvjax.runtime.prompts.context_prompt`): the
  chat template's opening of a user message (protected) where the model has a template,
  then the document, which a question closes later (`question_prompt`)."""
  try:
    return context_prompt(tokenizer, text, chat=True)
  except ValueError as err:
    raise BadRequest(str(err).splitlines()[0], "text") from None


def question_prompt(tokenizer, body: ChatRequest | CompletionRequest, chat: bool):
  """What follows a stored context: a chat's one user message, closing the user turn the
  context opened (`encode_question`; protected), or a completion's prompt as it is."""
  if chat:
    messages = body.messages
    if len(messages) != 1 or messages[0].role != "user":
      raise BadRequest("a chat over a context takes one user message", "messages")
    try:
      ids = encode_question(tokenizer, messages[0].content, chat=True)
    except ValueError as err:  # empty, or not UTF-8 text
      raise BadRequest(str(err).splitlines()[0], "messages") from None
    return [Segment(ids, protected=True)]
  ids = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
  if not ids:
    raise BadRequest("the question is empty", "prompt")
  return ids
