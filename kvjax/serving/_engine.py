"""The engine: requests in, tokens out, over one served batch (`_batch`). It knows nothing of
HTTP: a request is token ids (or `Segment`s) with a `CompressionSpec`, a token limit and
sampling values; what it produces goes to the request's callback.

Admission is by memory. `check` plans a request once (`_admission`: its prompt encoded, its
plan, the pages its row holds at its peak; `RequestTooLarge` or `Unservable` where it could
never run here). It is admitted when a row is free and the pool has those pages unreserved;
once its prompt is read the reservation becomes what it kept. The batch holds every row to
its reservation, so a running request never runs out of pages (one that would: an engine
bug, fails alone). What cannot be admitted waits in a bounded queue (`QueueFull` past it).

One thread owns every device call: it reads (prefills) admitted requests, inserts them into
free rows, runs a round of `steps` decode steps of every active row (one step while a
streaming request decodes, so its tokens go out as they are decoded), hands each request
its tokens and releases finished or cancelled rows. Callbacks run on that thread: keep them
short (the HTTP layer hands them over to its event loop).

A request's failure is its own (an error while it is read or inserted frees its row and
pages; a round that raises ends the requests it decoded; a lost batch, every request in it)
and the thread goes on. Should the thread itself stop, every waiting request gets an error
event, later ones `EngineStopped`, and `unavailable()` says why.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import secrets
import threading
import time

import jax
import numpy as np
from flax import nnx

from kvjax.cache.paged_cache import CacheError, check_status, to_host
from kvjax.cache.pages import pages_for
from kvjax.cache.sizing import ServedRows
from kvjax.eviction.budgets import NEVER
from kvjax.runtime.compilation import compile_ahead, compiled
from kvjax.runtime.generation import held_stats
from kvjax.runtime.session import extend, prefill
from kvjax.runtime.tokenizer import as_tokenizer
from kvjax.seam import ModelShape
from kvjax.serving import _batch
from kvjax.serving._admission import (  # noqa: F401 - its errors re-exported from here
    Admission,
    Planned,
    RequestTooLarge,
    Unservable,
    check_servable,
)
from kvjax.serving._request import (  # noqa: F401 - re-exported from here
    EngineConfig,
    EngineStopped,
    QueueFull,
    Request,
    one_line,
)
from kvjax.spec import CompressionSpec
from pallas_kernels import page_format

log = logging.getLogger("kvjax.serve.engine")


class Engine:
  """Continuous batching over one page pool (see the module docstring).

  engine = Engine(model, tokenizer, CompressionSpec(policy="h2o", budget=256), config)
  engine.start()
  engine.submit(Request(ids, spec, max_tokens=64, emit=print))
  ...
  engine.stop()            # finishes what runs (drain), then stops the thread
  """

  def __init__(self, model, tokenizer, spec: CompressionSpec, config: EngineConfig):
    check_servable(spec)
    # Text in, text out, stop at EOS: kvjax's tokenizer contract (a tokenizers.Tokenizer or
    # a transformers tokenizer is adapted), checked before the engine starts.
    tokenizer = as_tokenizer(tokenizer, needs=("text", "decode", "stop"))
    self.model, self.tokenizer, self.spec, self.config = model, tokenizer, spec, config
    self.shape = ModelShape.of(model)
    # Rows evict with the server's running policy (each with its own budget); a server whose
    # policy compresses once, or keeps all, decodes without eviction: its rows are laid out
    # as the full cache (the spec's page size, K/V storage and kernels).
    self.running = spec.evicts and not spec.once
    plan = (spec if self.running else spec.full_cache()).plan(
        self.shape, batch=1, longest=1, reserve=0
    )
    page_size = plan.config.page_size
    max_tokens = min(config.max_tokens or self.shape.max_context, self.shape.max_context)
    self.max_tokens = pages_for(max_tokens, page_size) * page_size
    dtype = spec.kv_dtype or self.shape.dtype
    self.page_bytes = 2 * page_size * page_format.token_bytes(self.shape.head_dim, dtype)
    self.capacity = config.kv_memory // self.page_bytes  # usable pages (the null page is extra)
    if self.capacity < 1:
      raise ValueError(
          f"kv_memory={config.kv_memory} bytes holds no page of {self.page_bytes} bytes"
      )
    self._batch_plan = plan  # a new empty batch is made from it (`_lose_batch`)
    self.batch = self._empty_batch()
    cfg = self.batch.state.cache.config
    self.page_size, self.max_pages = cfg.page_size, self.batch.state.cache.pages.table.shape[-1]
    self.sizing = ServedRows(
        windows=tuple(cfg.windows or (0,) * self.shape.n_layers),
        kv_heads=self.shape.n_kv_heads,
        page_size=cfg.page_size,
        margin=cfg.margin if cfg.evicts else 0,
    )
    self.admission = Admission(
        model,
        self.shape,
        tokenizer,
        spec,
        running=self.running,
        sink=cfg.sink,
        recent=cfg.recent,
        group_size=cfg.group_size,
        page_size=cfg.page_size,
        sizing=self.sizing,
        max_tokens=self.max_tokens,
        capacity=self.capacity,
        page_bytes=self.page_bytes,
    )
    stop = np.asarray(list(tokenizer.eos_ids or ()) or [-1], np.int32)
    # Split once: a decode round hands the compiled step the same arrays every time.
    self._graphdef, self._params = nnx.split(model)
    self._stop = jax.device_put(stop)
    # A round's step count is an argument of its one compiled program: a round of one step
    # (a streaming request decodes) costs no compile of its own.
    self._round_steps = {
        False: jax.device_put(np.int32(config.steps)),
        True: jax.device_put(np.int32(1)),
    }
    self._check_round()
    self._lock = threading.Condition()
    self._queue: collections.deque[Request] = collections.deque()
    self._cancelled: set[int] = set()
    self._rows: dict[int, Request] = {}  # row -> request
    self._admitting: Request | None = None  # taken from the queue, not yet in a row
    self._reserved = 0
    self._calls: collections.deque = collections.deque()  # (fn, Future) for the thread
    self._running = False
    self._failure: str | None = None  # why the thread stopped, when an error stopped it
    self._thread: threading.Thread | None = None
    self.counters = collections.Counter()
    self._rate = 0.0  # tokens per second over the last decode round

  def _empty_batch(self) -> _batch.Batch:
    return _batch.empty_batch(
        self.model, self._batch_plan, self.config.rows, self.capacity + 1, self.max_tokens
    )

  def _check_round(self) -> None:
    """Traces a decode round (nothing is compiled), so that a spec whose rows cannot decode
    (a policy that cannot score a served batch, say) is refused here, not by every
    request's round; the compiled rounds reuse the trace."""
    statics = self._statics(_batch.width_for([0], self.config.rows), self._shallow)
    args = self._abstract_args()
    try:
      jax.eval_shape(lambda *a: _batch.run(*a, **statics), *args)
    except Exception as err:  # noqa: BLE001 - refused in one line, naming what failed
      raise ValueError(f"this spec's rows cannot decode: {one_line(err)}") from None

  @property
  def _shallow(self) -> int:
    """The table entries the shallowest round reads (deeper ones compile when asked)."""
    return _batch.depth_for(0, self.page_size, self.max_pages)

  def _abstract_args(self):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=x.sharding, weak_type=getattr(x, "weak_type", False)
        ),
        (self._params, self.batch, self._stop, self._round_steps[False]),
    )

  # ---- requests ------------------------------------------------------------------------

  def row_budget(self, spec: CompressionSpec, prompt_tokens: int, protected: int = 0) -> int:
    """The running budget a request's row keeps on the full layers (`NEVER`: all):
    `Admission.row_budget`."""
    return self.admission.row_budget(spec, prompt_tokens, protected)

  def check(self, request: Request) -> None:
    """Raises `Unservable` or `RequestTooLarge` (naming the field and the limit), or a
    ValueError, unless the request can ever run here; plans it (`request.planned`, its
    `prompt_tokens` and `protected_tokens`: `Admission.plan`)."""
    request.planned = self.admission.plan(request)

  def submit(self, request: Request) -> Request:
    """Queues `request` (checked first: `check`); `QueueFull` when the queue is full,
    `EngineStopped` when the engine takes no request."""
    self.check(request)
    with self._lock:
      if not self._running:
        raise EngineStopped(self._why_stopped())
      waiting = len(self._queue) + len(self._calls)
      if waiting >= self.config.queue:
        self.counters["rejected"] += 1
        raise QueueFull(f"{waiting} requests are waiting (the queue's limit)")
      self._queue.append(request)
      self.counters["submitted"] += 1
      self._lock.notify()
    return request

  def call(self, fn, *, queued: bool = False) -> concurrent.futures.Future:
    """Runs `fn()` on the engine's thread between two rounds (device work that is not a
    request); its result or error in the future. `queued`: it waits in the requests' queue
    (`QueueFull` past it, as a request), for work a client asks for (compressing a context
    to store)."""
    future = concurrent.futures.Future()
    with self._lock:
      if not self._running:
        raise EngineStopped(self._why_stopped())
      if queued and len(self._queue) + len(self._calls) >= self.config.queue:
        self.counters["rejected"] += 1
        raise QueueFull(f"{len(self._queue) + len(self._calls)} requests are waiting")
      self._calls.append((fn, future))
      self._lock.notify()
    return future

  def cancel(self, request_id: int) -> None:
    """Stops a request wherever it is (queued or decoding); its row is freed in the next
    scheduling round. It gets no further event."""
    with self._lock:
      self._cancelled.add(request_id)
      self._lock.notify()

  def unavailable(self) -> str | None:
    """None while the engine takes requests; else why not (not started, stopping, or its
    thread stopped by an error)."""
    with self._lock:
      if self._running and self._thread is not None and self._thread.is_alive():
        return None
      return self._why_stopped()

  def _why_stopped(self) -> str:
    if self._failure is not None:
      return f"the engine stopped: {self._failure}"
    return "the engine is not running"

  def stats(self) -> dict:
    with self._lock:
      return {
          "rows": self.config.rows,
          "rows_in_use": len(self._rows),
          "queue": len(self._queue) + len(self._calls),
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
    args = self._abstract_args()
    for width in _batch.widths(self.config.rows) if self.config.compile_ahead else ():
      compile_ahead(
          _batch.run, self._statics(width, self._shallow), *args, returns=_batch.run_returns
      )
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
    try:
      self._serve()
    except BaseException as err:  # noqa: BLE001 - the engine's own error: it serves no more
      self._stopped_by(err)

  def _serve(self) -> None:
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
      self._end([row for row, r in self._rows.items() if r.id in cancelled], "cancelled")
      self._admit()
      if self._rows:
        self._round()

  def _stopped_by(self, err: BaseException) -> None:
    """The thread ends on `err`: every request it holds or that waits gets an error event,
    every pending call the error, and the engine takes no more (`unavailable` says why)."""
    why = one_line(err)
    log.error("the engine stopped: %s", why)
    with self._lock:
      self._failure, self._running = why, False
      waiting = [*self._queue, *self._rows.values()]
      if self._admitting is not None:
        waiting.append(self._admitting)
      self._queue.clear()
      self._rows.clear()
      self._reserved = 0
      calls, self._calls = self._calls, collections.deque()
    for request in waiting:
      _emit(request, ("error", f"the engine stopped: {why}"))
    for _, future in calls:
      if future.set_running_or_notify_cancel():
        future.set_exception(EngineStopped(f"the engine stopped: {why}"))

  def _admit(self) -> None:
    """Reads and inserts queued requests, in order, while a row and their pages are free."""
    while True:
      with self._lock:
        free = [row for row in range(self.config.rows) if row not in self._rows]
        if not self._queue or not free:
          return
        request = self._queue[0]
        need = request.planned.pages
        if self._reserved + need > self.capacity:
          return  # the head of the queue waits for pages (no overtaking: no starvation)
        self._queue.popleft()
        self._reserved += need
        request.reserved = need
        self._admitting = request
      self._start(request, free[0])
      self._admitting = None

  def _read(self, request: Request):
    """The request's prompt read into a state of its own (prefilled, or appended to its
    context), as `check` encoded it."""
    encoded = request.planned.encoded
    if request.context is not None:
      return extend(self.model, request.context, encoded, tokenizer=self.tokenizer)
    return prefill(
        self.model,
        encoded,
        request.spec,
        tokenizer=self.tokenizer,
        reserve=0,
        seed=request.seed or 0,
    )

  def _start(self, request: Request, row: int) -> None:
    """Reads `request` and inserts it into free `row`; any failure ends it alone, its row
    and its pages free again."""
    planned = request.planned
    inserting = False
    try:
      state = self._read(request)
      held = held_stats(state, self.shape)
      request.kept_share, request.kv_bytes = held["kept_fraction"][0], held["kv_bytes_held"]
      kept = to_host(state.cache.length)[:, 0]  # [L, H]
      peak = self.sizing.peak_pages(kept, request.max_tokens, planned.row_budget)
      self._settle(request, int(peak.sum()))
      request.depth = int(peak.max())
      inserting = True
      self.batch = _batch.insert(
          self.batch,
          state,
          row,
          max_tokens=request.max_tokens,
          budget=NEVER if planned.row_budget is None else planned.row_budget,
          sampling=request.sampling,
          stops=request.stops,
          pages=request.reserved,
          seed=secrets.randbits(32) if request.seed is None else request.seed,
      )
      check_status(self.batch.state.cache)  # the insert's own (it starts with a clear one)
    except Exception as err:  # noqa: BLE001 - one request fails alone
      with self._lock:
        self._reserved -= request.reserved
        self.counters["failed"] += 1
      log.debug("request %d failed on admission: %s", request.id, err)
      _emit(request, ("error", one_line(err)))
      if inserting:
        self._free_rows([row])
      return
    with self._lock:
      self._rows[row] = request
    log.debug(
        "request %d in row %d: %d prompt tokens (%d protected), %.3f kept, %d pages reserved",
        request.id,
        row,
        request.prompt_tokens,
        request.protected_tokens,
        request.kept_share,
        request.reserved,
    )

  def _settle(self, request: Request, need: int) -> None:
    """The request's reservation made `need` pages, what its row needs at its peak now that
    its prompt is read: down from the bound admission reserved, or up where the pool has
    the pages unreserved; a `CacheError` otherwise (the bound was short: it fails alone
    rather than take another request's pages)."""
    with self._lock:
      more = need - request.reserved
      if more > 0 and self._reserved + more > self.capacity:
        raise CacheError(
            f"out of pages: the request needs {need} pages once read, more than the "
            f"{request.reserved} reserved for it, and the pool has "
            f"{self.capacity - self._reserved} unreserved"
        )
      self._reserved += more
      request.reserved = need

  def _round(self) -> None:
    """One decode round of every active row; a round that raises ends its requests."""
    start = time.perf_counter()
    rows = dict(self._rows)
    try:
      width = _batch.width_for(rows, self.config.rows)
      deepest = max(request.depth for request in rows.values())
      depth = _batch.depth_for(deepest, self.page_size, self.max_pages)
      streaming = any(request.stream for request in rows.values())
      args = (self._params, self.batch, self._stop, self._round_steps[streaming])
      step = compiled(_batch.run, self._statics(width, depth), *args, returns=_batch.run_returns)
      self.batch, out = step(*args)
      # One transfer of what the host needs from the round.
      count, tokens, stopped, failed, short, remaining = jax.device_get(
          (out.count, out.tokens, out.stopped, out.failed, out.short, self.batch.remaining)
      )
    except Exception as err:  # noqa: BLE001 - the round's requests fail, the engine goes on
      message = one_line(err)
      ids = ", ".join(str(request.id) for request in rows.values())
      log.error("a decode round failed, ending request(s) %s: %s", ids, message)
      self._end(list(rows), "failed", message)
      return
    self._rate = round(float(count.sum()) / max(time.perf_counter() - start, 1e-9), 2)
    ended = collections.defaultdict(list)  # (why, error message) -> rows
    for row, request in rows.items():
      if request.id in self._cancelled:
        continue  # released next round, silently
      if count[row]:
        _emit(request, ("tokens", tokens[row, : count[row]].tolist()))
        self.counters["generated_tokens"] += int(count[row])
      if short[row]:
        message = (
            f"CacheError: out of pages: the request's row needed more than the "
            f"{request.reserved} pages reserved for it"
        )
        log.error("request %d: %s", request.id, message)
        ended["failed", message].append(row)
      elif failed[row]:
        ended["failed", "NumericsError: the model gave non-finite logits"].append(row)
      elif stopped[row] or remaining[row] == 0:
        _emit(request, ("done", "stop" if stopped[row] else "length"))
        ended["finished", None].append(row)
    for (why, message), done in ended.items():
      self._end(done, why, message)

  def _end(self, rows: list[int], why: str, message: str | None = None) -> None:
    """Ends the requests of `rows` (`why`: finished, cancelled or failed; `message`: the
    error event they get, unless cancelled) and frees their rows and pages."""
    if not rows:
      return
    with self._lock:
      ended = [self._rows.pop(row) for row in rows]
      for request in ended:
        self._reserved -= request.reserved
      self.counters[why] += len(ended)
    if message is not None:
      for request in ended:
        if request.id not in self._cancelled:
          _emit(request, ("error", message))
    self._free_rows(rows)

  def _free_rows(self, rows: list[int]) -> None:
    """Releases `rows` of the batch (their pages back in the pool)."""
    try:
      for row in rows:
        self.batch = _batch.release(self.batch, row)
    except Exception as err:  # noqa: BLE001 - the batch is lost: `_lose_batch`
      self._lose_batch(err)

  def _lose_batch(self, err: Exception) -> None:
    """A device call on the batch failed after taking its buffers (donated): every request
    in it ends with an error, and a new empty batch takes its place."""
    message = f"the batch was lost: {one_line(err)}"
    log.error(message)
    with self._lock:
      lost, self._rows = list(self._rows.values()), {}
      self._reserved -= sum(request.reserved for request in lost)
      self.counters["failed"] += len(lost)
    for request in lost:
      _emit(request, ("error", message))
    self.batch = self._empty_batch()


def _emit(request: Request, event: tuple) -> None:
  """Hands `event` to the request's callback; a callback that fails (its client's event
  loop closed, say) loses its own events, never the engine's thread."""
  try:
    request.emit(event)
  except Exception:  # noqa: BLE001 - the caller's callback, not the engine's error
    pass
