"""The served batch: S rows over one page pool, each row a slot a request holds while it
decodes. Requests are prefilled (and their contexts compressed) in states of their own, then
inserted into a free row; one compiled program decodes every active row a few steps at a
time, each with its own remaining tokens, running budget and sampling values; a finished row
is released and its pages go back to the pool. Nothing here recompiles as requests come and
go: the rows, the pool and the step count are fixed when the batch is made.

    state        `State` of S rows: the cache (table [L, S, H, M] over P pages), next-token
                 logits [S, V], positions [S], done [S] (stopped at a stop token), the key
    active       [S] a request holds the row
    remaining    [S] tokens the row may still generate
    budget       [S] the row's budget on every full layer for the running policy, or
                 `NEVER` (the row keeps what it holds: the full cache, or a context its own
                 policy compressed once)
    temperature, top_k, top_p   [S] each row's sampling values (`sample_rows`)
    keys         [S, ...] each row's sampling key (its raw key data): from its request's
                 seed, so a row draws the same tokens whatever its neighbours
    pages        [S] the most pages the row may hold (its request's reservation): a step
                 that would take it past them stops it instead (`Stepped.short`)
    failed       [S] the row failed (non-finite logits, or short of pages): it stops, the
                 others go on

A decode step never drops an append silently: the pool's out-of-pages status is checked
after every step, and the rows whose append it dropped fail (`Stepped.short`); the status is
cleared for the others. Each program that writes the pool (an insert, a round) starts with
that status clear, so what the engine reads after it is that program's own.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jaxtyping import Array, Bool, Float, Int

from kvjax.cache.config import CacheConfig
from kvjax.cache.paged_cache import PagedKVCache, Status, init_cache
from kvjax.cache.pages import pages_for
from kvjax.cache.rows import check_insertable, insert_row, release_row
from kvjax.eviction.budgets import NEVER
from kvjax.runtime.sampling import sample_rows
from kvjax.runtime.state import State
from kvjax.runtime.steps import feed
from kvjax.seam import ModelShape
from kvjax.spec import CachePlan


@struct.dataclass
class Batch:
  state: State
  active: Bool[Array, " S"]
  remaining: Int[Array, " S"]
  budget: Int[Array, " S"]
  temperature: Float[Array, " S"]
  top_k: Int[Array, " S"]
  top_p: Float[Array, " S"]
  keys: Array  # [S, *key_shape] uint32: each row's sampling key data
  pages: Int[Array, " S"]
  failed: Bool[Array, " S"]
  stops: Bool[Array, " S"]  # the row ends at a stop token (off: it runs to its limit)

  @property
  def rows(self) -> int:
    return self.active.shape[0]


def empty_batch(model, plan: CachePlan, rows: int, num_pages: int, max_tokens: int) -> Batch:
  """A batch of `rows` free rows over a pool of `num_pages` pages (the null page included),
  each sequence up to `max_tokens` tokens, laid out as `plan` lays out a request's cache
  (page size, K/V storage, the running policy's slots and budget, sliding windows)."""
  shape = ModelShape.of(model)
  config = dataclasses.replace(plan.config, max_tokens=max_tokens, num_pages=num_pages)
  policy = None if plan.eviction is None else plan.eviction.policy
  slots = () if policy is None else policy.slots
  extra = {}
  if policy is not None and policy.keeps_extra:
    from kvjax.seam import query_heads

    extra = policy.init_extra(
        shape.n_layers, rows, shape.n_kv_heads, query_heads(model), shape.head_dim
    )
  cache = init_cache(
      config,
      shape.n_layers,
      rows,
      shape.n_kv_heads,
      shape.head_dim,
      slots=slots,
      extra=extra,
      shared_pool=True,
  )
  put = jax.device_put
  state = State(
      cache=cache,
      logits=put(np.zeros((rows, shape.vocab_size), np.float32)),
      position=put(np.zeros((rows,), np.int32)),
      done=put(np.ones((rows,), bool)),
      key=jax.random.key(0),
      peak_pages=put(np.int32(0)),
      plan=dataclasses.replace(plan, config=None, chunk=1),
  )
  return Batch(
      state=state,
      active=put(np.zeros((rows,), bool)),
      remaining=put(np.zeros((rows,), np.int32)),
      budget=put(np.full((rows,), NEVER, np.int32)),
      temperature=put(np.zeros((rows,), np.float32)),
      top_k=put(np.zeros((rows,), np.int32)),
      top_p=put(np.ones((rows,), np.float32)),
      keys=put(np.zeros((rows, *_key_data(0).shape), np.uint32)),
      pages=put(np.zeros((rows,), np.int32)),
      failed=put(np.zeros((rows,), bool)),
      stops=put(np.ones((rows,), bool)),
  )


def insert(
    batch: Batch,
    request: State,
    row: int,
    *,
    max_tokens: int,
    budget: int,
    sampling,
    stops=True,
    pages: int | None = None,
    seed: int = 0,
):
  """`batch` with `request` (a prefilled state of one row) in free row `row`, to generate up
  to `max_tokens` tokens with its running `budget` (`NEVER`: keep all) and `sampling` (a
  `kvjax.Sampling`), ending at a stop token unless not `stops`, holding at most `pages`
  pages (None: no limit but the pool's), sampling from its own key made from `seed`.
  Host-side checks, then one compiled program per
  request cache shape. When the pool cannot hold the request's pages, nothing is inserted
  and the cache's status says so (`check_status`): the row stays free."""
  check_insertable(batch.state.cache, request.cache)
  if request.batch_size != 1:
    raise ValueError(f"a request state has one row; this one has {request.batch_size}")
  values = (
      np.int32(row),
      np.int32(max_tokens),
      np.int32(budget),
      np.float32(sampling.temperature),
      np.int32(sampling.top_k),
      np.float32(sampling.top_p),
      np.bool_(stops),
      np.int32(NEVER if pages is None else pages),
      _key_data(seed),
  )
  source = _as_source(request.cache, batch.state.cache)
  return _insert(batch, source, request.logits, request.position, *map(jax.device_put, values))


def _as_source(cache: PagedKVCache, batch: PagedKVCache) -> PagedKVCache:
  """A request's cache with only what an insert reads, its static parts made canonical, so
  requests of other policies and budgets but the same array shapes share one compiled
  insert: the batch's slots (the others are not copied), sizes, no budget."""
  c = cache.config
  config = CacheConfig(
      page_size=c.page_size, max_tokens=c.max_tokens, dtype=c.dtype, windows=c.windows
  )
  specs = tuple(spec for spec in batch.slot_specs if spec.name in cache.slots)
  return cache.replace(
      config=config,
      slot_specs=specs,
      slots={spec.name: cache.slots[spec.name] for spec in specs},
      extra={name: x for name, x in cache.extra.items() if name in batch.extra},
      chunk=1,
  )


@functools.partial(jax.jit, donate_argnames="batch")
def _insert(
    batch: Batch,
    source,
    logits,
    position,
    row,
    max_tokens,
    budget,
    temperature,
    top_k,
    top_p,
    stops,
    pages,
    key,
):
  s = batch.state
  cache = insert_row(_clear_append_status(s.cache), row, source)
  fits = (cache.status & _APPEND_FAILED) == 0
  state = s.replace(
      cache=cache,
      logits=s.logits.at[row].set(logits[0]),
      position=s.position.at[row].set(position[0]),
      done=s.done.at[row].set(~fits),
      peak_pages=jnp.maximum(s.peak_pages, cache.pages_in_use().sum()),
  )
  return batch.replace(
      state=state,
      active=batch.active.at[row].set(fits),
      remaining=batch.remaining.at[row].set(max_tokens),
      budget=batch.budget.at[row].set(budget),
      temperature=batch.temperature.at[row].set(temperature),
      top_k=batch.top_k.at[row].set(top_k),
      top_p=batch.top_p.at[row].set(top_p),
      pages=batch.pages.at[row].set(pages),
      keys=batch.keys.at[row].set(key),
      failed=batch.failed.at[row].set(False),
      stops=batch.stops.at[row].set(stops),
  )


def _key_data(seed: int) -> np.ndarray:
  """The raw data of the key `seed` makes (a row's sampling key travels as it)."""
  return np.asarray(jax.random.key_data(jax.random.key(seed)), np.uint32)


# An append the pool could not take (no free page, or past a sequence's table): dropped.
_APPEND_FAILED = int(Status.OUT_OF_PAGES | Status.OVER_CAPACITY | Status.OVER_CHUNK)


def _clear_append_status(cache: PagedKVCache) -> PagedKVCache:
  """The cache with its append-failure bits cleared (they are read, and acted on, after every
  program that writes the pool; the warnings stay)."""
  return cache.replace(pages=cache.pages.replace(status=cache.pages.status & ~_APPEND_FAILED))


def release(batch: Batch, row: int) -> Batch:
  """`batch` with row `row` free: its pages back in the pool, nothing of it readable (one
  compiled program for every row)."""
  return _release(batch, jax.device_put(np.int32(row)))


@functools.partial(jax.jit, donate_argnames="batch")
def _release(batch: Batch, row) -> Batch:
  s = batch.state
  state = s.replace(cache=release_row(s.cache, row), done=s.done.at[row].set(True))
  return batch.replace(
      state=state,
      active=batch.active.at[row].set(False),
      remaining=batch.remaining.at[row].set(0),
      budget=batch.budget.at[row].set(NEVER),
      pages=batch.pages.at[row].set(0),
      failed=batch.failed.at[row].set(False),
  )


@struct.dataclass
class Stepped:
  """What `run` hands back beside the batch: per row the tokens it generated in this call
  (the first `count` of `tokens`), whether it stopped at a stop token, whether it failed:
  its logits were not finite (`failed`), or it ran short of pages (`short`: its next append
  would have passed its pages, and it stopped before it; or the pool dropped its last
  token's append, and it stopped after it)."""

  tokens: Int[Array, "S K"]
  count: Int[Array, " S"]
  stopped: Bool[Array, " S"]
  failed: Bool[Array, " S"]
  short: Bool[Array, " S"]


MIN_WIDTH = 4  # the fewest rows a round computes (narrower ones save little, cost programs)


def width_for(active_rows, rows: int) -> int:
  """The rows a decode round computes: the narrowest power of two (at least `MIN_WIDTH`, at
  most `rows`) that holds every active row, so a few programs serve every load and idle
  rows cost little (a row's matmuls cost the same whether it is active or not)."""
  last = max(MIN_WIDTH, max(active_rows, default=0) + 1)
  return min(1 << (last - 1).bit_length(), rows)


MIN_DEPTH_TOKENS = 1024  # the shallowest table a round reads (fewer programs below it)


def depth_for(pages: int, page_size: int, max_pages: int) -> int:
  """The table entries a decode round reads per sequence: the narrowest power of two (at
  least `MIN_DEPTH_TOKENS`, at most the table) that holds `pages`, the most any active
  sequence holds at its peak. Eviction ranks, and attention reads, that many entries, not
  the model context's: at budget 192 on 8 rows a round over 1024 tokens costs 0.4x one over
  8192."""
  least = -(-MIN_DEPTH_TOKENS // page_size)
  return min(1 << (max(pages, least) - 1).bit_length(), max_pages)


def widths(rows: int) -> list[int]:
  """Every width `width_for` gives over `rows` rows."""
  return sorted({width_for([row], rows) for row in range(rows)})


def run_returns(params, batch, stop_tokens, step_limit):
  """`run`'s output structure (for `kvjax.runtime.compilation.compiled`)."""
  return batch, Stepped(tokens=0, count=0, stopped=0, failed=0, short=0)


_ROW_FIELDS = (
    "active",
    "remaining",
    "budget",
    "temperature",
    "top_k",
    "top_p",
    "keys",
    "pages",
    "failed",
    "stops",
)


def _first_rows(batch: Batch, width: int, depth: int) -> Batch:
  """The first `width` rows of `batch`, the first `depth` entries of their tables (every
  page they hold: a sequence holds a prefix of its table), over the whole pool."""
  s = batch.state
  c = s.cache
  pages = c.pages.replace(
      table=c.pages.table[:, :width, :, :depth], length=c.pages.length[:, :width]
  )
  config = dataclasses.replace(c.config, max_tokens=depth * c.config.page_size)
  cache = c.replace(
      config=config, pages=pages, extra={name: x[:, :width] for name, x in c.extra.items()}
  )
  state = s.replace(
      cache=cache, logits=s.logits[:width], position=s.position[:width], done=s.done[:width]
  )
  return batch.replace(state=state, **{f: getattr(batch, f)[:width] for f in _ROW_FIELDS})


def _put_first_rows(batch: Batch, part: Batch) -> Batch:
  """`batch` with its first rows (and the pool, key and peak) from `part` (`_first_rows`)."""
  s, p = batch.state, part.state
  width, depth = part.rows, p.cache.pages.table.shape[-1]
  pages = p.cache.pages.replace(
      table=s.cache.pages.table.at[:, :width, :, :depth].set(p.cache.pages.table),
      length=s.cache.pages.length.at[:, :width].set(p.cache.pages.length),
  )
  extra = {name: x.at[:, :width].set(p.cache.extra[name]) for name, x in s.cache.extra.items()}
  state = p.replace(
      cache=p.cache.replace(config=s.cache.config, pages=pages, extra=extra),
      logits=s.logits.at[:width].set(p.logits),
      position=s.position.at[:width].set(p.position),
      done=s.done.at[:width].set(p.done),
  )
  rows = {f: getattr(batch, f).at[:width].set(getattr(part, f)) for f in _ROW_FIELDS}
  return batch.replace(state=state, **rows)


@functools.partial(
    jax.jit, static_argnames=("graphdef", "steps", "width", "depth"), donate_argnames="batch"
)
def run(
    params,
    batch: Batch,
    stop_tokens,
    step_limit,
    *,
    graphdef,
    steps: int,
    width: int | None = None,
    depth: int | None = None,
) -> tuple[Batch, Stepped]:
  """Up to `step_limit` (an int32 scalar, at most `steps`) decode steps of every active row
  (fewer when no row is left to go on): the limit is an argument, so a round of one step
  (a streaming request's tokens out after each) runs the program of a round of `steps`.
  A row goes on while it is active, has tokens left, has not stopped and has not failed.
  `width`: compute only the first `width` rows (every active row among them: `width_for`);
  the tokens and counts cover those rows. `depth`: read only the first `depth` entries of
  each table (at least the pages any of those rows holds at its peak: `depth_for`)."""
  width = batch.rows if width is None else width
  depth = batch.state.cache.pages.table.shape[-1] if depth is None else depth
  limit = jnp.minimum(step_limit, steps)
  if (width, depth) == (batch.rows, batch.state.cache.pages.table.shape[-1]):
    return _run(params, batch, stop_tokens, limit, graphdef, steps)
  part, out = _run(params, _first_rows(batch, width, depth), stop_tokens, limit, graphdef, steps)
  return _put_first_rows(batch, part), out


def _run(params, batch: Batch, stop_tokens, limit, graphdef, steps: int) -> tuple[Batch, Stepped]:
  model = nnx.merge(graphdef, params)
  eviction = batch.state.plan.eviction
  rows = jnp.arange(batch.rows)
  page_size = batch.state.cache.config.page_size
  batch = batch.replace(state=batch.state.replace(cache=_clear_append_status(batch.state.cache)))

  def live(b: Batch):
    return b.active & ~b.state.done & (b.remaining > 0) & ~b.failed

  def cond(carry):
    b, _, step = carry
    return (step < limit) & live(b).any()

  def body(carry):
    b, out, step = carry
    s = b.state
    key, evict_key = jax.random.split(s.key)
    # Each row draws from its own key: its tokens depend on its seed, not its neighbours.
    keys = jax.vmap(jax.random.split)(jax.random.wrap_key_data(b.keys))  # [S, 2]
    token = sample_rows(s.logits, keys[:, 1], b.temperature, b.top_k, b.top_p)
    going = live(b)
    stop = going & b.stops & jnp.isin(token, stop_tokens)
    # A row whose append would take it past its pages stops before it (its reservation was
    # short): the pool then always holds the other rows' appends, each within its own.
    length = s.cache.length  # [L, S, H]
    taking = (pages_for(length, page_size) + (length % page_size == 0)).sum((0, 2))
    short = going & ~stop & (taking > b.pages)
    emit = going & ~stop & ~short
    tokens = out.tokens.at[rows, out.count].set(jnp.where(emit, token, 0), mode="drop")
    logits, cache, held = feed(model, s, token, emit, eviction, evict_key, b.budget)
    # An append the pool did not take was dropped for every row of a layer: the rows that
    # appended fail (their tokens so far stand); the status is cleared for the others.
    dropped = emit & ((cache.status & _APPEND_FAILED) != 0)
    short = short | dropped
    cache = _clear_append_status(cache)
    # A row whose logits are not finite fails alone: its token stands, nothing is drawn
    # from them, and the other rows go on.
    bad = emit & ~dropped & ~jnp.isfinite(logits).all(-1)
    state = s.replace(
        cache=cache,
        logits=jnp.where((emit & ~bad)[:, None], logits, s.logits),
        position=s.position + emit,
        done=s.done | stop,
        key=key,
        peak_pages=jnp.maximum(s.peak_pages, held),
    )
    b = b.replace(
        state=state,
        remaining=b.remaining - emit,
        failed=b.failed | bad | short,
        keys=jax.random.key_data(keys[:, 0]),
    )
    out = out.replace(
        tokens=tokens,
        count=out.count + emit,
        stopped=out.stopped | stop,
        failed=out.failed | bad,
        short=out.short | short,
    )
    return b, out, step + 1

  out = Stepped(
      tokens=jnp.zeros((batch.rows, steps), jnp.int32),
      count=jnp.zeros((batch.rows,), jnp.int32),
      stopped=jnp.zeros((batch.rows,), bool),
      failed=jnp.zeros((batch.rows,), bool),
      short=jnp.zeros((batch.rows,), bool),
  )
  batch, out, _ = jax.lax.while_loop(cond, body, (batch, out, jnp.int32(0)))
  return batch, out


def run_steps(
    model, batch: Batch, stop_tokens: np.ndarray, steps: int, width=None, depth=None, limit=None
):
  """`run` from the host: (batch, Stepped) with the model split into its static graph
  (tests; the engine splits the model and puts the stop ids on the device once); `limit`:
  the round's steps (default `steps`)."""
  graphdef, params = nnx.split(model)
  stop = jax.device_put(stop_tokens)
  limit = jax.device_put(np.int32(steps if limit is None else limit))
  return run(params, batch, stop, limit, graphdef=graphdef, steps=steps, width=width, depth=depth)
