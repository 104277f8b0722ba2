"""Paged KV cache: page data, a page-table struct with the allocator that runs inside `jit`,
and per-slot arrays that the cache and the policies declare.

  k_pages, v_pages  [P, S, D]     physical pool; page 0 is the reserved null page. Float, or
                                  `QuantizedPages` (int8/int4 codes [P, S, W] with per-token
                                  group scales [P, S, G], `pallas_kernels.page_format`): every
                                  operation maps over the pool's arrays, so scales move with
                                  their tokens; `read_pages` is the one way to read values
  slots             {name: [P, S]} per-slot arrays declared by `Slot`s: the cache's own
                                  (position, protected, segment) and the policy's (e.g. score)
  pages             PageTable     page table [L, B, H, M], lengths [L, B, H], free stack, status
  extra             {name: array} a policy's state that is not per token (e.g. running
                                  statistics of the queries, `Policy.init_extra`); eviction
                                  leaves it alone

Sequences own exactly their first ceil(length / S) page-table entries. The null page
keeps every gather in range: unused entries point at it and are masked by `length`.
Eviction moves and clears every declared slot array together with K/V, so a policy with
its own per-token state declares a `Slot` and touches nothing here.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from kvjax._checks import check_int
from kvjax.cache.config import CacheConfig
from kvjax.cache.pages import PageTable, pages_for, token_slots
from pallas_kernels import page_format
from pallas_kernels.page_format import Pool


@dataclasses.dataclass(frozen=True)
class Slot:
  """A per-slot array `[P, S]` kept beside K/V: its name, dtype and value in an empty slot.

  New tokens start at `empty` unless `append` writes them (position, protected, segment);
  freed and vacated slots are reset to `empty`."""

  name: str
  dtype: str
  empty: float | int | bool

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name.isidentifier():
      raise ValueError(f"Slot name must be an identifier, got {self.name!r}")
    try:
      np.dtype(self.dtype)
    except TypeError:
      raise ValueError(f"Slot {self.name!r}: unknown dtype {self.dtype!r}") from None

  def init(self, num_pages: int, page_size: int) -> Array:
    return jnp.full((num_pages, page_size), self.empty, jnp.dtype(self.dtype))


# The cache's own per-slot arrays; policies declare more (`Policy.slots`).
POSITION = Slot("position", "int32", -1)  # original token position
PROTECTED = Slot("protected", "bool", False)  # caller-marked: never evicted
SEGMENT = Slot("segment", "int32", 0)  # caller-marked segment id (0 = none), for fair eviction
CACHE_SLOTS = (POSITION, PROTECTED, SEGMENT)


class Status(enum.IntFlag):
  """Flags set inside jit; `check_status` turns them into host errors."""

  OK = 0
  OUT_OF_PAGES = 1  # the pool had no free page for an append; that append was dropped
  OVER_CAPACITY = 2  # an append would pass max_tokens; that append was dropped
  OVER_BUDGET = 4  # protected tokens alone exceed the budget; the cache kept them
  OVER_CHUNK = 8  # with OUT_OF_PAGES: the failed append was longer than the pool's `chunk`
  NONFINITE_LOGITS = 16  # the model gave NaN/Inf logits for a row; decoding stopped there
  NONFINITE_SCORES = 32  # a policy scored tokens NaN/±inf; NaN and -inf were evicted first


# Bits that are reported (a warning) while the work goes on; every other bit stops it.
WARNINGS = Status.OVER_BUDGET | Status.NONFINITE_SCORES


class CacheError(RuntimeError):
  """A cache operation inside jit failed; raised on the host by `check_status`."""


class NumericsError(RuntimeError):
  """The model gave non-finite logits (NaN or Inf: a broken checkpoint, an overflow in a
  low-precision dtype): a token drawn from them would be a silent wrong answer. Raised on
  the host after the compiled step, naming the step and the rows."""


@struct.dataclass
class PagedKVCache:
  """A paged KV cache (a pytree): the K and V page pools, the per-slot arrays policies keep
  (`slots`), the page table and free stack (`pages`), and its static `CacheConfig`. Made by
  `init_cache`; written by `append`/`append_layer`; read through `logical_view`,
  `valid_mask` and `read_sequence`."""

  k_pages: Pool  # [P, S, D] float, or QuantizedPages
  v_pages: Pool
  slots: dict[str, Array]  # name -> [P, S], one entry per `slot_specs`
  pages: PageTable
  config: CacheConfig = struct.field(pytree_node=False)
  slot_specs: tuple[Slot, ...] = struct.field(pytree_node=False, default=CACHE_SLOTS)
  # Tokens per append that the pool was sized for (`init_cache(chunk=)`).
  chunk: int = struct.field(pytree_node=False, default=1)
  # A policy's state that is not per token (`Policy.init_extra`): any arrays, e.g. [L, B, ...].
  extra: dict[str, Array] = struct.field(default_factory=dict)
  # The device mesh the cache is sharded over (`kvjax.sharding`): then the pool arrays have
  # a leading shard axis ([G, P, S, D], free stack [G, P], counters [G]) and page ids are
  # local to a shard. None: one device, the layout above.
  mesh: object = struct.field(pytree_node=False, default=None)

  # Read-only shortcuts into the page table; updates go through `pages.replace`.
  @property
  def page_table(self) -> Int[Array, "L B H M"]:
    return self.pages.table

  @property
  def length(self) -> Int[Array, "L B H"]:
    return self.pages.length

  @property
  def status(self) -> Int[Array, ""]:
    """The `Status` bits raised so far (on any shard of a sharded cache)."""
    status = self.pages.status
    if status.ndim:  # one per shard: OR them, bit by bit (a max reduces over devices)
      bit = jnp.arange(len(Status), dtype=jnp.int32)
      raised = ((status[:, None] >> bit) & 1).max(axis=0)
      return (raised << bit).sum().astype(jnp.int32)
    return status

  def raise_status(self, raised: Bool[Array, ""], bit: Status) -> "PagedKVCache":
    """The cache with `bit` set in its status where `raised` (traced) holds."""
    status = self.pages.status | jnp.where(raised, jnp.int32(bit), jnp.int32(0))
    return self.replace(pages=self.pages.replace(status=status))

  def freed(self, pages: PageTable, ids: Int[Array, " X"]) -> "PagedKVCache":
    """The cache with page table `pages`, whose operation freed the pages `ids` (out of range
    where nothing was freed, as `PageTable.free` gives them): freed pages carry no per-slot
    state into their next owner."""
    return self.replace(
        pages=pages,
        slots={
            spec.name: self.slots[spec.name].at[ids].set(spec.empty, mode="drop")
            for spec in self.slot_specs
        },
    )

  def slot(self, name: str) -> Array:
    """The per-slot array `name` ([P, S]); KeyError naming the declared slots."""
    if name not in self.slots:
      raise KeyError(
          f"the cache has no slot {name!r}; declared: {', '.join(self.slots)} (a policy "
          "declares its per-token state in `Policy.slots`)"
      )
    return self.slots[name]

  def with_slots(self, **arrays: Array) -> "PagedKVCache":
    for name in arrays:
      self.slot(name)
    return self.replace(slots={**self.slots, **arrays})

  def with_extra(self, **arrays: Array) -> "PagedKVCache":
    """The cache with some of its declared `extra` arrays replaced; KeyError naming them."""
    for name in arrays:
      if name not in self.extra:
        raise KeyError(
            f"the cache has no extra state {name!r}; declared: {', '.join(self.extra) or 'none'}"
            " (a policy declares it in `Policy.init_extra`)"
        )
    return self.replace(extra={**self.extra, **arrays})

  @property
  def num_layers(self) -> int:
    return self.page_table.shape[0]

  @property
  def batch_size(self) -> int:
    return self.page_table.shape[1]

  @property
  def num_kv_heads(self) -> int:
    return self.page_table.shape[2]

  @property
  def head_dim(self) -> int:
    return self.k_pages.shape[-1]

  @property
  def num_pages(self) -> int:
    """Pages in the pool (of one shard, when sharded)."""
    return self.k_pages.shape[-3]

  def pages_in_use(self) -> Int[Array, "L B H"]:
    return self.pages.held(self.config.page_size)

  @property
  def kv_dtype(self) -> str:
    """How K/V are stored: a float dtype's name, or int8/int4."""
    return page_format.kv_dtype_of(self.k_pages)

  @property
  def page_bytes(self) -> int:
    """Bytes of K and V in one page, scales included."""
    return 2 * self.config.page_size * page_format.token_bytes(self.head_dim, self.kv_dtype)

  @property
  def token_bytes(self) -> int:
    """Bytes of K and V one token takes across all layers and kv heads (one row)."""
    return self.num_layers * self.num_kv_heads * self.page_bytes // self.config.page_size

  def kv_bytes(self) -> int:
    """Host-side: bytes of K and V held by live pages (what a right-sized pool must hold).
    Inside jit, track `pages_in_use().sum()` instead (int32 bytes would overflow)."""
    length = to_host(self.length).astype(np.int64)  # host math: nothing to compile
    return int(pages_for(length, self.config.page_size).sum()) * self.page_bytes


def to_host(x) -> np.ndarray:
  """A host copy of a (possibly sharded, possibly multi-process) array: every process gets
  the whole value (`jax.device_get` refuses an array with shards on other processes)."""
  if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def one_device(cache: PagedKVCache, what: str) -> None:
  """ValueError when `cache` is sharded over a mesh: `what` reads one pool's page ids. A
  sharded cache goes through the session API, or per shard (`kvjax.sharding.on_shards`,
  inside which each shard's cache is a one-device cache)."""
  if cache.mesh is not None:
    raise ValueError(
        f"{what} takes a cache on one device (or one shard's, inside "
        "kvjax.sharding.on_shards); this cache is sharded over a mesh"
    )


def init_cache(
    config: CacheConfig,
    num_layers: int,
    batch_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    chunk: int = 1,
    slots: tuple[Slot, ...] = (),
    extra: dict[str, Array] | None = None,
    shared_pool: bool = False,
) -> PagedKVCache:
  """An empty cache whose pool fits every sequence appending `chunk` tokens at a time.

  `slots` declares per-slot arrays beyond the cache's own (`CACHE_SLOTS`), e.g. a policy's
  score history; `extra` holds a policy's initial state that is not per token
  (`Policy.init_extra`). `shared_pool`: the rows take turns in the pool (a served batch,
  `kvjax.serving`, admits a request only when its pages are free), so the pool need not
  hold every sequence's budget at once."""
  if not isinstance(config, CacheConfig):
    raise TypeError(f"config must be a CacheConfig, got {type(config).__name__}")
  for name, value in [
      ("num_layers", num_layers),
      ("batch_size", batch_size),
      ("num_kv_heads", num_kv_heads),
      ("head_dim", head_dim),
      ("chunk", chunk),
  ]:
    check_int(name, value)
  slot_specs = _merge_slots(CACHE_SLOTS, tuple(slots))
  extra = {} if extra is None else extra
  if not isinstance(extra, dict) or not all(isinstance(name, str) for name in extra):
    raise TypeError(f"extra must be a dict of named arrays, got {type(extra).__name__}")
  if config.windows and len(config.windows) != num_layers:
    raise ValueError(
        f"config.windows gives {len(config.windows)} layers' windows; the cache has "
        f"num_layers={num_layers}"
    )
  num_sequences = num_layers * batch_size * num_kv_heads
  num_pages = config.pool_pages(num_sequences, chunk)
  if config.evicts and not shared_pool:
    # What every sequence must be able to hold: a full layer's budget; a sliding layer,
    # which is never evicted, its window (a plan sizes the window's peak by the request,
    # which may be shorter than the window: `CompressionSpec.plan`).
    per_layer = num_sequences // num_layers
    needed = (
        sum(
            per_layer
            * pages_for(min(w, config.max_tokens) if w else config.budget, config.page_size)
            for w in (config.windows or (0,) * num_layers)
        )
        + 1
    )
    if num_pages < needed:
      raise ValueError(
          f"num_pages={num_pages} cannot hold budget={config.budget} tokens for each of "
          f"{num_sequences} sequences (num_layers={num_layers} x batch_size={batch_size} x "
          f"num_kv_heads={num_kv_heads}) at page_size={config.page_size}: need >= {needed}"
      )
  table_shape = (num_layers, batch_size, num_kv_heads, config.max_pages)
  k, v, slots, pages = _empty_arrays(
      num_pages, config.page_size, head_dim, config.dtype, slot_specs, table_shape
  )
  return PagedKVCache(
      k_pages=k,
      v_pages=v,
      slots=slots,
      pages=pages,
      config=config,
      slot_specs=slot_specs,
      chunk=int(chunk),
      extra={name: jnp.asarray(x) for name, x in extra.items()},
  )


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def _empty_arrays(num_pages, page_size, head_dim, dtype, slot_specs, table_shape):
  """Every array of an empty cache, made by one compiled program (a first call compiles
  once, not once per array)."""
  pool = page_format.empty_pool(num_pages, page_size, head_dim, dtype)
  pages = PageTable.empty(table_shape, num_pages)
  slots = {spec.name: spec.init(num_pages, page_size) for spec in slot_specs}
  return pool, pool, slots, pages


def _merge_slots(*groups: tuple[Slot, ...]) -> tuple[Slot, ...]:
  """Slots in declaration order, each name once; one name declared two ways is an error."""
  merged: dict[str, Slot] = {}
  for spec in (s for group in groups for s in group):
    if not isinstance(spec, Slot):
      raise TypeError(f"slots must be kvjax.cache.paged_cache.Slot, got {type(spec).__name__}")
    if merged.setdefault(spec.name, spec) != spec:
      raise ValueError(f"slot {spec.name!r} declared twice: {merged[spec.name]} and {spec}")
  return tuple(merged.values())


def append_layer(
    cache: PagedKVCache,
    layer: int | Int[Array, ""],
    k: Float[Array, "B T H D"],
    v: Float[Array, "B T H D"],
    positions: Int[Array, "B T"],
    num_new: Int[Array, " B"] | None = None,
    protected: Bool[Array, "B T"] | None = None,
    segment: Int[Array, "B T"] | None = None,
) -> PagedKVCache:
  """Appends the first `num_new[b]` of T tokens of row b to every kv head of one layer.

  `protected` marks tokens no eviction may remove; `segment` tags tokens with a segment id
  (> 0) so that fair eviction can take the same fraction from each segment.

  Pages are allocated from the shared pool inside jit. If the pool is exhausted or a
  sequence would pass `max_tokens`, nothing is written for this layer and the cache's
  status records why (see `check_status`).
  """
  one_device(cache, "append_layer")
  k, v, positions, num_new, protected, segment = _validate_append(
      cache, k, v, positions, num_new, protected, segment, layer_axis=False
  )
  b, t = positions.shape
  num_new = jnp.full((b,), t, jnp.int32) if num_new is None else num_new.astype(jnp.int32)
  marks = {
      POSITION.name: positions,
      PROTECTED.name: jnp.zeros((b, t), bool) if protected is None else protected,
      SEGMENT.name: jnp.zeros((b, t), jnp.int32) if segment is None else segment,
  }
  ps = cache.config.page_size
  length = cache.length[layer]  # [B, H]
  new_length = length + num_new[:, None]
  pages, fits = cache.pages.allocate(layer, new_length, ps, cache.config.max_tokens)
  page, offset = token_slots(pages.table[layer], length, num_new * fits, t, ps, cache.num_pages)
  per_token = lambda x: jnp.broadcast_to(x[..., None], page.shape)  # noqa: E731
  status = cache.status | jnp.where(
      fits,
      0,
      jnp.where(
          new_length.max() > cache.config.max_tokens,
          Status.OVER_CAPACITY,
          Status.OUT_OF_PAGES
          | (Status.OVER_CHUNK if t > cache.chunk and cache.config.num_pages is None else 0),
      ),
  )
  # New tokens carry the caller's marks; every other declared slot starts empty.
  slots = {
      spec.name: cache.slots[spec.name]
      .at[page, offset]
      .set(per_token(marks[spec.name]) if spec.name in marks else spec.empty, mode="drop")
      for spec in cache.slot_specs
  }
  return cache.replace(
      k_pages=page_format.write(cache.k_pages, (page, offset), k),
      v_pages=page_format.write(cache.v_pages, (page, offset), v),
      slots=slots,
      pages=pages.replace(status=status.astype(jnp.int32)),
  )


def append(
    cache: PagedKVCache,
    k: Float[Array, "L B T H D"],
    v: Float[Array, "L B T H D"],
    positions: Int[Array, "B T"],
    num_new: Int[Array, " B"] | None = None,
    protected: Bool[Array, "B T"] | None = None,
    segment: Int[Array, "B T"] | None = None,
) -> PagedKVCache:
  """Appends a chunk of T tokens (T = 1 for decode) to every layer, row and kv head.
  NumPy arrays are accepted wherever arrays are."""
  k, v, positions, num_new, protected, segment = _validate_append(
      cache, k, v, positions, num_new, protected, segment, layer_axis=True
  )

  def body(layer, c):
    return append_layer(c, layer, k[layer], v[layer], positions, num_new, protected, segment)

  return jax.lax.fori_loop(0, cache.num_layers, body, cache)


def _as_array(x):
  return None if x is None else jnp.asarray(x)


def _validate_append(cache, k, v, positions, num_new, protected, segment, *, layer_axis):
  """Checks shapes and dtypes; returns the arguments as JAX arrays."""
  if not isinstance(cache, PagedKVCache):
    raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
  k, v, positions, num_new, protected, segment = map(
      _as_array, (k, v, positions, num_new, protected, segment)
  )
  lead = (cache.num_layers,) if layer_axis else ()
  if getattr(positions, "ndim", None) != 2:
    raise ValueError(f"positions must be [B, T], got shape {getattr(positions, 'shape', None)}")
  b, t = positions.shape
  expected = (*lead, cache.batch_size, t, cache.num_kv_heads, cache.head_dim)
  names = "[L, B, T, H, D]" if layer_axis else "[B, T, H, D]"
  for name, x in (("k", k), ("v", v)):
    if getattr(x, "shape", None) != expected:
      raise ValueError(f"{name} must be {names} = {expected}, got {getattr(x, 'shape', None)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must be floating point, got {x.dtype}")
  if b != cache.batch_size:
    raise ValueError(f"positions batch {b} != cache batch_size {cache.batch_size}")
  if t > cache.config.max_tokens:
    raise ValueError(f"chunk of T={t} tokens exceeds max_tokens={cache.config.max_tokens}")
  if not jnp.issubdtype(positions.dtype, jnp.integer):
    raise TypeError(f"positions must be integer, got {positions.dtype}")
  if num_new is not None and (
      num_new.shape != (b,) or not jnp.issubdtype(num_new.dtype, jnp.integer)
  ):
    raise ValueError(f"num_new must be [B] = ({b},) integers, got {num_new.shape} {num_new.dtype}")
  if protected is not None and (protected.shape != (b, t) or protected.dtype != bool):
    raise ValueError(
        f"protected must be bool [B, T] = ({b}, {t}), got {protected.shape} {protected.dtype}"
    )
  if segment is not None and (
      segment.shape != (b, t) or not jnp.issubdtype(segment.dtype, jnp.integer)
  ):
    raise ValueError(
        f"segment must be integer [B, T] = ({b}, {t}), got {segment.shape} {segment.dtype}"
    )
  return k, v, positions, num_new, protected, segment


def logical_view(cache: PagedKVCache, x: Array, layer=None) -> Array:
  """Gathers a per-slot array ([P, S, ...]) into logical order: [(L,) B, H, M * S, ...].
  A K/V pool reads as its float values (dequantized when quantized)."""
  one_device(cache, "logical_view")
  table = cache.page_table if layer is None else cache.page_table[layer]
  if isinstance(x, page_format.QuantizedPages):
    gathered = page_format.read(x, table)  # [..., M, S, D] float32
  else:
    gathered = x[table]  # [..., M, S, ...]
  lead = table.shape
  return gathered.reshape(*lead[:-1], lead[-1] * x.shape[1], *x.shape[2:])


def read_pages(pool: Pool) -> Float[Array, "P S D"]:
  """The K or V values of a whole pool as float32 (dequantized when quantized): what a
  policy scoring every slot reads, e.g. key norms."""
  return page_format.decode(pool)


def valid_mask(cache: PagedKVCache, layer=None) -> Bool[Array, "..."]:
  """True for live logical slots: [(L,) B, H, M * S]."""
  length = cache.length if layer is None else cache.length[layer]
  return jnp.arange(cache.config.max_tokens) < length[..., None]


def read_sequence(cache: PagedKVCache, layer: int, row: int, head: int):
  """Host-side: the live (k [n, D], v [n, D], positions [n]) of one sequence, in order."""
  one_device(cache, "read_sequence")
  check_status(cache)
  for name, value, size in (
      ("layer", layer, cache.num_layers),
      ("row", row, cache.batch_size),
      ("head", head, cache.num_kv_heads),
  ):
    if not 0 <= value < size:
      raise ValueError(f"{name}={value} out of range [0, {size})")
  n = int(cache.length[layer, row, head])
  table = cache.page_table[layer, row, head]
  take = lambda x: np.asarray(x.reshape(-1, *x.shape[2:])[:n])  # noqa: E731
  k, v = (page_format.read(pool, table) for pool in (cache.k_pages, cache.v_pages))
  return take(k), take(v), take(cache.slot("position")[table])


def check_status(cache: PagedKVCache) -> None:
  """Raises `CacheError` (`NumericsError`) for failures recorded inside jit; warns when over
  budget or when a policy's scores were not finite. The session API checks non-finite
  logits itself first, to name the step and rows."""
  status = Status(int(cache.status))
  if status & Status.NONFINITE_LOGITS:
    raise NumericsError("the model gave non-finite logits (NaN or Inf)")
  if status & Status.OUT_OF_PAGES and status & Status.OVER_CHUNK:
    raise CacheError(
        f"out of pages: the pool of {cache.num_pages} pages was sized for appends of "
        f"chunk={cache.chunk} tokens per sequence, and an append was longer; pass "
        "init_cache(chunk=) the largest number of tokens you append at once"
    )
  if status & Status.OUT_OF_PAGES:
    raise CacheError(
        f"out of pages: the pool of {cache.num_pages} pages (page_size="
        f"{cache.config.page_size}) could not hold an append; raise CacheConfig.num_pages, "
        "lower the budget, or use a smaller batch"
    )
  if status & Status.OVER_CAPACITY:
    raise CacheError(
        f"a sequence would pass max_tokens={cache.config.max_tokens}; raise "
        "CacheConfig.max_tokens or set a budget so that eviction keeps sequences short"
    )
  if status & Status.OVER_BUDGET:
    warnings.warn(
        f"protected tokens (a question, marked segments) with the sink and recent window "
        f"exceed budget={cache.config.budget} on some sequences: they were kept, so the cache "
        "holds more than its budget",
        stacklevel=2,
    )
  if status & Status.NONFINITE_SCORES:
    warnings.warn(
        "the policy scored some tokens NaN or infinite; NaN and -inf ones were evicted "
        "first, +inf ones last (a broken scorer or an overflow: check the policy)",
        stacklevel=2,
    )
