"""What a caller hands the engine and what it raises: `Request` (a prompt, its spec, its
limit and sampling values, the callback its events go to), `EngineConfig` (the served
batch's shape), `QueueFull` and `EngineStopped`."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable

from kvjax.runtime.sampling import Sampling
from kvjax.serving._admission import Planned
from kvjax.spec import CompressionSpec


class QueueFull(RuntimeError):
  """The waiting queue is full: try again later (HTTP 429)."""


class EngineStopped(RuntimeError):
  """The engine takes no request: it was stopped, or its thread ended on an error (HTTP
  503)."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """The served batch's shape, fixed when the engine starts.

  rows: requests decoded at once (the batch's rows).
  kv_memory: bytes of K/V for the page pool all rows share.
  max_tokens: tokens a row holds at most (a request's prompt and new tokens as kept); by
    default the model context.
  steps: decode steps between two scheduling rounds (admissions, releases, cancels); one
    while a streaming request decodes (its tokens go out after every step).
  queue: requests waiting for memory at most; past it `submit` raises `QueueFull`.
  compile_ahead: compile the decode round of every width when the engine starts (in the
    background), not when a load first needs it (a server: yes; a short-lived test: no).
  """

  rows: int = 8
  kv_memory: int = 64 * 2**20
  max_tokens: int | None = None
  steps: int = 4
  queue: int = 64
  compile_ahead: bool = True

  def __post_init__(self):
    for name in ("rows", "kv_memory", "steps", "queue"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"EngineConfig.{name} must be an int >= 1, got {value!r}")
    if not isinstance(self.compile_ahead, bool):
      raise TypeError(f"EngineConfig.compile_ahead must be a bool, got {self.compile_ahead!r}")


@dataclasses.dataclass
class Request:
  """One request: `prompt` (token ids, or `Segment`s, as `kvjax.prefill` takes one row),
  compressed by `spec`, generating up to `max_tokens` tokens with `sampling`. `emit(event)`
  receives ("tokens", [ids]) as they come, then one ("done", finish_reason) or
  ("error", message). `finish_reason`: "stop" (a stop token) or "length"."""

  prompt: object
  spec: CompressionSpec
  max_tokens: int
  emit: Callable[[tuple], None]
  sampling: Sampling = dataclasses.field(default_factory=Sampling)
  # Its sampling key's seed (and its prompt's, for a policy that draws): the same seed and
  # request give the same tokens whatever else the batch decodes. None: a fresh one.
  seed: int | None = None
  # A compressed context (a one-row `State`, e.g. the state `ContextStore.load` returns) the prompt
  # continues: the prompt is appended to it (`kvjax.extend`), with its own compression.
  context: object = None
  # False: the request runs to `max_tokens` whatever it generates (benchmarks).
  stops: bool = True
  # True: its tokens are handed over after every decode step, not every round (a stream).
  stream: bool = False
  id: int = dataclasses.field(default_factory=itertools.count().__next__)
  # Set by the engine.
  prompt_tokens: int = 0
  protected_tokens: int = 0  # of the prompt: never evicted
  planned: Planned | None = None  # by `check`
  reserved: int = 0  # pages reserved for it now
  depth: int = 0  # the most pages one of its sequences holds at its peak
  arrived: float = dataclasses.field(default_factory=time.perf_counter)
  # Once its prompt is read: the K/V entries kept as a share of the tokens read (mean over
  # layers and kv heads), and the bytes they take.
  kept_share: float | None = None
  kv_bytes: int | None = None


def one_line(err: BaseException) -> str:
  """An error as a request's error event, a client and the log say it: its type and first
  line, never a traceback."""
  return f"{type(err).__name__}: {err}".splitlines()[0]
