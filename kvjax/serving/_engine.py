"""The engine: requests in, tokens out, over one served batch (`_batch`). It knows nothing of
HTTP: a request is token ids (or `Segment`s) with a `CompressionSpec`, a token limit and
sampling values; what it produces goes to the request's callback.

Admission is by memory. Each request reserves the pages its plan needs at its peak (its
prompt as its policy keeps it, plus its new tokens under its running budget, or its window
on a sliding layer); it is admitted when a row is free and the pool has that many pages not
reserved, so a running request never runs out of pages. What cannot be admitted yet waits
in a bounded queue (`QueueFull` past it); a request whose plan could never fit the pool is
refused (`RequestTooLarge`, naming the limit). Reservations are made on the prompt before it
is read, then brought down to what the compressed context actually holds.

One thread owns every device call: it reads (prefills) admitted requests, inserts them into
free rows, runs a round of `steps` decode steps of every active row (one step while a
streaming request decodes, so its tokens go out as they are decoded), hands each request
its tokens and releases finished or cancelled rows. Callbacks run on that thread: keep them
short (the HTTP layer hands them over to its event loop).

Protected tokens (a chat's question, `Segment(protected=True)`) are never evicted: a running
policy's row keeps them beside its budget (`row_budget`), and admission counts them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from kvjax.cache.paged_cache import check_status, to_host
from kvjax.cache.pages import pages_for
from kvjax.cache.sizing import min_budget, window_peak
from kvjax.eviction.budgets import NEVER
from kvjax.runtime.compilation import compile_ahead, compiled
from kvjax.runtime.generation import held_stats
from kvjax.runtime.sampling import Sampling
from kvjax.runtime.session import extend, prefill
from kvjax.runtime.tokenizer import as_tokenizer
from kvjax.seam import ModelShape
from kvjax.serving import _batch
from kvjax.spec import CompressionSpec
from pallas_kernels import page_format

log = logging.getLogger("kvjax.serve.engine")


class QueueFull(RuntimeError):
  """The waiting queue is full: try again later (HTTP 429)."""


class RequestTooLarge(ValueError):
  """The request's plan could never fit the pool, or passes the rows' length (HTTP 400)."""

  def __init__(self, message: str, field: str):
    super().__init__(message)
    self.field = field


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
  seed: int = 0
  # A compressed context (a one-row `State`, e.g. from `ContextStore.load`) the prompt
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
  reserved: int = 0
  depth: int = 0  # the most pages one of its sequences holds at its peak
  arrived: float = dataclasses.field(default_factory=time.perf_counter)
  # Once its prompt is read: the K/V entries kept as a share of the tokens read (mean over
  # layers and kv heads), and the bytes they take.
  kept_share: float | None = None
  kv_bytes: int | None = None


class Engine:
  """Continuous batching over one page pool (see the module docstring).

  engine = Engine(model, tokenizer, CompressionSpec(policy="h2o", budget=256), config)
  engine.start()
  engine.submit(Request(ids, spec, max_tokens=64, emit=print))
  ...
  engine.stop()            # finishes what runs (drain), then stops the thread
  """

  def __init__(self, model, tokenizer, spec: CompressionSpec, config: EngineConfig):
    # Text in, text out, stop at EOS: kvjax's tokenizer contract (a tokenizers.Tokenizer or
    # a transformers tokenizer is adapted), checked before the engine starts.
    tokenizer = as_tokenizer(tokenizer, needs=("text", "decode", "stop"))
    self.model, self.tokenizer, self.spec, self.config = model, tokenizer, spec, config
    self.shape = ModelShape.of(model)
    max_tokens = config.max_tokens or self.shape.max_context
    plan = spec.plan(self.shape, batch=1, longest=1, reserve=0)
    page_size = plan.config.page_size
    self.max_tokens = pages_for(min(max_tokens, self.shape.max_context), page_size) * page_size
    dtype = spec.kv_dtype or self.shape.dtype
    self.page_bytes = 2 * page_size * page_format.token_bytes(self.shape.head_dim, dtype)
    num_pages = config.kv_memory // self.page_bytes  # usable pages (the null page is extra)
    if num_pages < 1:
      raise ValueError(
          f"kv_memory={config.kv_memory} bytes holds no page of {self.page_bytes} bytes"
      )
    # Rows evict with the server's running policy (each with its own budget); a server whose
    # policy compresses once, or keeps all, decodes without eviction.
    self.running = spec.evicts and not spec.once
    if not self.running:
      plan = dataclasses.replace(
          plan, eviction=None, config=dataclasses.replace(plan.config, budget=None)
      )
    self.batch = _batch.empty_batch(model, plan, config.rows, num_pages + 1, self.max_tokens)
    cfg = self.batch.state.cache.config
    self.page_size, self.max_pages = cfg.page_size, self.batch.state.cache.pages.table.shape[-1]
    self.windows = np.asarray(cfg.windows or (0,) * self.shape.n_layers)
    self.margin = cfg.margin if cfg.evicts else 0
    self.capacity = num_pages
    stop = np.asarray(list(tokenizer.eos_ids or ()) or [-1], np.int32)
    # Split once: a decode round hands the compiled step the same arrays every time.
    self._graphdef, self._params = nnx.split(model)
    self._stop = jax.device_put(stop)
    self._lock = threading.Condition()
    self._queue: collections.deque[Request] = collections.deque()
    self._cancelled: set[int] = set()
    self._rows: dict[int, Request] = {}  # row -> request
    self._reserved = 0
    self._calls: collections.deque = collections.deque()  # (fn, Future) for the thread
    self._running = False
    self._thread: threading.Thread | None = None
    self.counters = collections.Counter()
    self._rate = 0.0  # tokens per second over the last decode round
    # A round's step count is an argument of its one compiled program: a round of one step
    # (a streaming request decodes) costs no compile of its own.
    self._round_steps = {
        False: jax.device_put(np.int32(config.steps)),
        True: jax.device_put(np.int32(1)),
    }

  # ---- sizes ---------------------------------------------------------------------------

  def row_budget(self, spec: CompressionSpec, prompt_tokens: int, protected: int = 0) -> int:
    """The running budget a request's row keeps on the full layers (`NEVER`: all): its
    spec's, or what eviction can always reach beside `protected` tokens where that is more
    (eviction keeps them, the sink and the recent window whatever the budget)."""
    if spec.once or not spec.evicts:
      return NEVER
    # Rows evict with the batch's sink, recent window and groups (the server's spec's).
    cfg = self.batch.state.cache.config
    floor = self._floor(protected, cfg.sink, cfg.recent, cfg.group_size)
    return max(spec.budget_tokens(prompt_tokens), floor)

  def _floor(self, protected: int, sink: int, recent: int, group: int) -> int:
    """Tokens a sequence holds however it evicts: its sink, its recent window and its
    `protected` tokens, in whole groups (one more for a span that starts mid-group)."""
    floor = min_budget(self.page_size, sink, recent, group)
    if protected and group > 1:
      return floor + (pages_for(protected, group) + 1) * group
    return floor + protected

  def layer_pages(self, kept, max_tokens: int, budget: int) -> np.ndarray:
    """Pages a row needs at its peak, per layer [L]: sequences holding `kept` tokens ([L, H], or one count
    for all) that grow by up to `max_tokens`, a full layer's evicted back once it passes
    `budget` and the margin (a sliding layer's, once past its window)."""
    return self._peak_pages(kept, max_tokens, budget).sum(-1)  # [L]

  def _peak_pages(self, kept, max_tokens: int, budget: int) -> np.ndarray:
    """Pages each sequence [L, H] holds at its peak (`layer_pages`)."""
    kept = np.broadcast_to(np.asarray(kept, np.int64), (self.shape.n_layers, self.shape.n_kv_heads))
    ps = self.page_size
    grown = kept + max_tokens
    cap = np.where(
        self.windows > 0,
        window_peak(self.windows, ps, 1),
        np.int64(NEVER) if budget >= NEVER else budget + self.margin + 1,
    )[:, None]
    return pages_for(np.minimum(grown, np.maximum(kept, cap)), ps)

  def pages_needed(self, kept, max_tokens: int, budget: int) -> int:
    """`layer_pages` over all layers."""
    return int(self.layer_pages(kept, max_tokens, budget).sum())

  def _bound(self, request: Request) -> int:
    """Pages a request needs at most, before its prompt is read: its prompt kept whole, or
    its budget where it compresses the context once (each sequence at most a page over)."""
    spec, n, new = request.spec, request.prompt_tokens, request.max_tokens
    if request.context is not None:  # the context as kept, and the prompt after it
      kept = to_host(request.context.cache.length)[:, 0]
      return self.pages_needed(kept + n, new, NEVER)
    whole = self.pages_needed(n, new, self.row_budget(spec, n, request.protected_tokens))
    if not spec.once or spec.auto:
      return whole
    # Compressed once: the full layers keep `budget` tokens per sequence on average (one
    # ranking may give a sequence more and another less: counted over them all, plus a
    # partly filled page each), or what they protect where that is more; the sliding ones
    # their window.
    budget = spec.budget_tokens(n)
    protected = self._floor(
        request.protected_tokens, spec.sink, spec.recent_tokens(budget), spec.group
    )
    ps = self.batch.state.cache.config.page_size
    full = int((self.windows == 0).sum()) * self.shape.n_kv_heads
    sliding = int(self.layer_pages(n, new, NEVER)[self.windows > 0].sum())
    kept = pages_for(full * (max(budget, protected) + new), ps) + full
    return min(whole, sliding + kept)

  # ---- requests ------------------------------------------------------------------------

  def check(self, request: Request) -> None:
    """Raises `RequestTooLarge` (naming the field and the limit) or ValueError unless the
    request can ever run here; sets its `prompt_tokens`."""
    from kvjax.runtime.prompts import encode_prompts

    spec = request.spec
    if spec.once or not spec.evicts:
      pass
    elif not self.running or spec.policy != self.spec.policy:
      raise ValueError(
          f"policy {spec.policy.name!r} evicts while decoding; this server's rows decode with "
          f"{self.spec.policy.name if self.running else 'no running policy'}: ask for "
          "that one (any budget), the full cache, or a policy that compresses the context once"
      )
    if (spec.kv_dtype or self.shape.dtype) != (self.spec.kv_dtype or self.shape.dtype):
      raise RequestTooLarge(
          f"kv_dtype {spec.kv_dtype!r} differs from this server's pages "
          f"({self.spec.kv_dtype or self.shape.dtype})",
          "kv_dtype",
      )
    if spec.page_size != self.spec.page_size:
      raise RequestTooLarge(
          f"page_size {spec.page_size} differs from this server's {self.spec.page_size}",
          "page_size",
      )
    encoded = encode_prompts(
        self.tokenizer,
        [request.prompt],
        chat=False,
        vocab_size=self.shape.vocab_size,
        start=request.context is None,
    )
    request.prompt_tokens = n = int(encoded.lengths[0])
    request.protected_tokens = int(sum(encoded.protected[0]))
    if request.context is not None:
      n += int(to_host(request.context.position)[0])  # the row holds the context too
    if n + request.max_tokens > self.max_tokens:
      raise RequestTooLarge(
          f"a prompt of {n} tokens and max_tokens={request.max_tokens} pass the "
          f"{self.max_tokens} tokens a row holds",
          "max_tokens" if n < self.max_tokens else "prompt",
      )
    if request.context is None:
      spec.plan(self.shape, batch=1, longest=n, reserve=0)  # the spec's own checks
    need = self._bound(request)
    if need > self.capacity:
      # The prompt alone, or only with its new tokens, passes the pool.
      alone = self._bound(dataclasses.replace(request, max_tokens=0))
      raise RequestTooLarge(
          f"the request needs {need} pages of {self.page_bytes} bytes at its peak; the pool "
          f"holds {self.capacity} (kv_memory {self.capacity * self.page_bytes} bytes)",
          "prompt" if alone > self.capacity else "max_tokens",
      )

  def submit(self, request: Request) -> Request:
    """Queues `request` (checked first: `check`); `QueueFull` when the queue is full."""
    self.check(request)
    with self._lock:
      if not self._running:
        raise RuntimeError("the engine is not running")
      if len(self._queue) >= self.config.queue:
        self.counters["rejected"] += 1
        raise QueueFull(f"{len(self._queue)} requests are waiting (the queue's limit)")
      self._queue.append(request)
      self.counters["submitted"] += 1
      self._lock.notify()
    return request

  def call(self, fn) -> concurrent.futures.Future:
    """Runs `fn()` on the engine's thread between two rounds (device work that is not a
    request, e.g. compressing a context to store); its result or error in the future."""
    future = concurrent.futures.Future()
    with self._lock:
      if not self._running:
        raise RuntimeError("the engine is not running")
      self._calls.append((fn, future))
      self._lock.notify()
    return future

  def cancel(self, request_id: int) -> None:
    """Stops a request wherever it is (queued or decoding); its row is freed in the next
    scheduling round. It gets no further event."""
    with self._lock:
      self._cancelled.add(request_id)
      self._lock.notify()

  def stats(self) -> dict:
    with self._lock:
      return {
          "rows": self.config.rows,
          "rows_in_use": len(self._rows),
          "queue": len(self._queue),
          "pages": self.capacity,
          "pages_reserved": self._reserved,
          "page_bytes": self.page_bytes,
          "tokens_per_s": self._rate,
          **self.counters,
      }

  # ---- the thread ----------------------------------------------------------------------

  def _statics(self, width: int, depth: int) -> dict:
    return {"graphdef": self._graphdef, "steps": self.config.steps, "width": width, "depth": depth}

  def start(self) -> Engine:
    # The decode rounds of every width compile (or load from kvjax's executable store) in
    # the background from now: the first requests find them ready, or wait for them only.
    args = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=x.sharding, weak_type=getattr(x, "weak_type", False)
        ),
        (self._params, self.batch, self._stop, self._round_steps[False]),
    )
    shallow = _batch.depth_for(0, self.page_size, self.max_pages)  # deeper ones when asked
    for width in _batch.widths(self.config.rows) if self.config.compile_ahead else ():
      compile_ahead(_batch.run, self._statics(width, shallow), *args, returns=_batch.run_returns)
    with self._lock:
      self._running = True
    self._thread = threading.Thread(target=self._loop, name="kvjax-engine", daemon=True)
    self._thread.start()
    return self

  def stop(self, drain: bool = True, timeout: float | None = None) -> None:
    """Stops the thread: with `drain`, after every queued and running request finished;
    without, every one of them ends now with an error event."""
    with self._lock:
      self._running = False
      if not drain:
        for request in [*self._queue, *self._rows.values()]:
          self._cancelled.add(request.id)
          _emit(request, ("error", "the server is stopping"))
      self._lock.notify()
    if self._thread is not None:
      self._thread.join(timeout)

  def _loop(self) -> None:
    while True:
      with self._lock:
        while (
            self._running
            and not self._queue
            and not self._rows
            and not self._cancelled
            and not self._calls
        ):
          self._lock.wait()
        if not self._running and not self._queue and not self._rows and not self._calls:
          return
        cancelled, self._cancelled = self._cancelled, set()
        self._queue = collections.deque(r for r in self._queue if r.id not in cancelled)
        calls, self._calls = self._calls, collections.deque()
      for fn, future in calls:
        if future.set_running_or_notify_cancel():
          try:
            future.set_result(fn())
          except Exception as err:  # noqa: BLE001 - the caller's error, in its future
            future.set_exception(err)
      self._release([row for row, r in self._rows.items() if r.id in cancelled], "cancelled")
      self._admit()
      if self._rows:
        self._step()

  def _admit(self) -> None:
    """Reads and inserts queued requests, in order, while a row and their pages are free."""
    while True:
      with self._lock:
        free = [row for row in range(self.config.rows) if row not in self._rows]
        if not self._queue or not free:
          return
        request = self._queue[0]
        need = self._bound(request)
        if self._reserved + need > self.capacity:
          return  # the head of the queue waits for pages (no overtaking: no starvation)
        self._queue.popleft()
        self._reserved += need
        request.reserved = need
      self._start(request, free[0])

  def _start(self, request: Request, row: int) -> None:
    try:
      if request.context is not None:
        state = extend(self.model, request.context, [request.prompt], tokenizer=self.tokenizer)
      else:
        state = prefill(
            self.model,
            [request.prompt],
            request.spec,
            tokenizer=self.tokenizer,
            reserve=0,
            seed=request.seed,
        )
      budget = (
          NEVER
          if request.context is not None
          else self.row_budget(request.spec, request.prompt_tokens, request.protected_tokens)
      )
      held = held_stats(state, self.shape)
      request.kept_share, request.kv_bytes = held["kept_fraction"][0], held["kv_bytes_held"]
      kept = to_host(state.cache.length)[:, 0]  # [L, H]
      peak = self._peak_pages(kept, request.max_tokens, budget)
      need = int(peak.sum())
      self.batch = _batch.insert(
          self.batch,
          state,
          row,
          max_tokens=request.max_tokens,
          budget=budget,
          sampling=request.sampling,
          stops=request.stops,
      )
      check_status(self.batch.state.cache)
    except Exception as err:  # noqa: BLE001 - one request fails alone
      with self._lock:
        self._reserved -= request.reserved
      self.counters["failed"] += 1
      log.debug("request %d failed on admission: %s", request.id, err)
      _emit(request, ("error", f"{type(err).__name__}: {err}".splitlines()[0]))
      return
    with self._lock:
      self._reserved += need - request.reserved  # what the compressed context holds
      request.reserved = need
      request.depth = int(peak.max())
      self._rows[row] = request
    log.debug(
        "request %d in row %d: %d prompt tokens (%d protected), %.3f kept, %d pages reserved",
        request.id,
        row,
        request.prompt_tokens,
        request.protected_tokens,
        request.kept_share,
        need,
    )

  def _step(self) -> None:
    start = time.perf_counter()
    width = _batch.width_for(self._rows, self.config.rows)
    deepest = max(request.depth for request in self._rows.values())
    depth = _batch.depth_for(deepest, self.page_size, self.max_pages)
    streaming = any(request.stream for request in self._rows.values())
    args = (self._params, self.batch, self._stop, self._round_steps[streaming])
    step = compiled(_batch.run, self._statics(width, depth), *args, returns=_batch.run_returns)
    self.batch, out = step(*args)
    # One transfer of what the host needs from the round.
    count, tokens, stopped, failed, remaining = jax.device_get(
        (out.count, out.tokens, out.stopped, out.failed, self.batch.remaining)
    )
    self._rate = round(float(count.sum()) / max(time.perf_counter() - start, 1e-9), 2)
    done = []
    for row, request in list(self._rows.items()):
      if request.id in self._cancelled:
        continue  # released next round, silently
      if count[row]:
        _emit(request, ("tokens", tokens[row, : count[row]].tolist()))
        self.counters["generated_tokens"] += int(count[row])
      if failed[row]:
        _emit(request, ("error", "NumericsError: the model gave non-finite logits"))
        done.append((row, "failed"))
      elif stopped[row] or remaining[row] == 0:
        _emit(request, ("done", "stop" if stopped[row] else "length"))
        done.append((row, "finished"))
    for row, why in done:
      self._release([row], why)

  def _release(self, rows: list[int], why: str) -> None:
    if not rows:
      return
    for row in rows:
      self.batch = _batch.release(self.batch, row)
    with self._lock:
      for row in rows:
        request = self._rows.pop(row)
        self._reserved -= request.reserved
        self.counters[why] += 1


def _emit(request: Request, event: tuple) -> None:
  """Hands `event` to the request's callback; a callback that fails (its client's event
  loop closed, say) loses its own events, never the engine's thread."""
  try:
    request.emit(event)
  except Exception:  # noqa: BLE001 - the caller's callback, not the engine's error
    pass
