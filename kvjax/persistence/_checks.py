"""What a saved state must be before it is trusted: its metadata in range and consistent with
the model (or, without one, with the model it records), the arrays it declares exactly those
that metadata implies (names, shapes, dtypes: compared before any array is restored), and the
restored values a cache the allocator could have made (the page table a save writes, lengths,
positions, status).

The digest (`_format.digest`) tells an accident (a truncated file, a flipped bit) from the
state that was saved. It is a plain SHA-256, which anyone can recompute after an edit: these
checks are what keep an edited or hostile state from loading. Every field is in range, every
array has the size its metadata implies, and what a load allocates is what the metadata
describes, bounded by the model: a pool of at most every sequence's page table full, page
tables of at most the tokens the model's context and the recorded budgets need."""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import numpy as np

from kvjax.cache import pages
from kvjax.cache.config import CacheConfig
from kvjax.cache.paged_cache import CACHE_SLOTS, WARNINGS, Slot
from kvjax.persistence._format import StateFileError, short
from kvjax.policies import POLICIES, get_policy
from kvjax.spec import ATTENTION_IMPLS
from pallas_kernels import page_format

# Dtypes a per-slot array may have (what `Slot`s declare: numbers and flags, never objects).
SLOT_DTYPES = ("bool", "int8", "int16", "int32", "uint8", "uint16", "uint32") + (
    "float16",
    "bfloat16",
    "float32",
)
MAX_BATCH = 2**20
# Query heads per kv head that a policy's state beside the cache (`cache.extra`) may assume
# where the model is not at hand (`state_info`); `load_state` asks the model for the exact count.
MAX_QUERY_GROUP = 128
_MODEL_DIMS = ("n_layers", "n_kv_heads", "head_dim", "vocab_size", "max_context")


@dataclasses.dataclass(frozen=True)
class Layout:
  """A state's metadata, checked: the model dims it is for and the sizes it implies."""

  version: pathlib.Path
  layers: int
  kv_heads: int
  head_dim: int
  vocab: int
  max_context: int
  batch: int
  position: tuple[int, ...]  # tokens each row has read (the metadata's copy)
  config: CacheConfig
  num_pages: int  # the pool a load allocates, null page included
  live: int  # the pages saved (1..live in the packed page table)
  slots: tuple[Slot, ...]
  extra: tuple[str, ...]
  kv_dtype: str
  key_shape: tuple[int, ...]

  def arrays(self, extra: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, dtype)} of every array the state holds (`_format.live_arrays`), with
    `extra` the shapes of the policy's state beside the cache."""
    ps = self.config.page_size
    l, b, h = self.layers, self.batch, self.kv_heads
    pool = jax.eval_shape(
        lambda: page_format.empty_pool(self.live, ps, self.head_dim, self.kv_dtype)
    )
    want = {}
    for name in ("k_pages", "v_pages"):
      for part, x in page_format.parts(pool).items():
        want[name if part == "values" else f"{name}.{part}"] = (x.shape, np.dtype(x.dtype).name)
    want.update(
        {
            "table": ((l, b, h, self.config.max_pages), "int32"),
            "length": ((l, b, h), "int32"),
            "status": ((), "int32"),
            "logits": ((b, self.vocab), "float32"),
            "position": ((b,), "int32"),
            "done": ((b,), "bool"),
            "key": (self.key_shape, "uint32"),
            "peak_pages": ((), "int32"),
        }
    )
    want.update({f"slot.{s.name}": ((self.live, ps), np.dtype(s.dtype).name) for s in self.slots})
    want.update({f"extra.{name}": extra[name] for name in self.extra})
    return want


def recorded_shape(meta: dict, version: pathlib.Path) -> dict:
  """The model dims a state records (for `state_info`, which has no model), checked."""
  record = meta.get("model")
  if not isinstance(record, dict):
    raise StateFileError(f"{version}: its metadata records no model ({_show(record)})")
  dims = {k: _int(version, f"model.{k}", record.get(k), 1) for k in _MODEL_DIMS}
  return {**dims, "dtype": record.get("dtype")}


def layout(meta: dict, version: pathlib.Path, shape: dict) -> Layout:
  """The checked layout of a state's metadata for a model of `shape` (`ModelShape` fields);
  StateFileError naming the first field out of range or inconsistent."""
  l, h = shape["n_layers"], shape["n_kv_heads"]
  batch = _int(version, "batch_size", meta.get("batch_size"), 1, MAX_BATCH)
  position = _positions(meta, version, batch, shape)
  plan, cache = _dict(meta, "plan", version), _dict(meta, "cache", version)
  try:
    config = CacheConfig(**_dict(plan, "config", version, "plan.config"))
  except (TypeError, ValueError) as err:
    raise StateFileError(f"{version}: plan.config is not a cache layout ({short(err)})") from None
  spec = _dict(meta, "spec", version)
  model_dtype = shape.get("dtype") or config.dtype
  if config.dtype != (spec.get("kv_dtype") or model_dtype) or config.page_size != spec.get(
      "page_size"
  ):
    raise StateFileError(
        f"{version}: plan.config (page_size {config.page_size}, dtype {config.dtype}) disagrees "
        f"with its spec (page_size {_show(spec.get('page_size'))}, kv_dtype "
        f"{_show(spec.get('kv_dtype'))}) and model ({model_dtype})"
    )
  chunk_cap = max(config.max_tokens, 1 << (shape["max_context"] - 1).bit_length())
  chunk = _int(version, "plan.chunk", plan.get("chunk"), 1, chunk_cap)
  _int(version, "cache.chunk", cache.get("chunk"), 1, chunk_cap)
  top = _eviction(plan.get("eviction"), version, config, l)
  # The longest page table a plan makes or grows to: the model context, a sequence's peak
  # under its budget (x heads sharing a layer's), a chunk and a reconstruction pass's room.
  room = _policy_room(spec.get("policy"), version)
  cap = pages.whole_pages(2 * shape["max_context"] + h * top + chunk + room, config.page_size)
  if config.max_tokens > cap:
    raise StateFileError(
        f"{version}: plan.config.max_tokens={config.max_tokens} is more than this model "
        f"(context {shape['max_context']}) and the state's budgets need ({cap} at most)"
    )
  sequences = l * batch * h
  live = _int(version, "cache.live_pages", cache.get("live_pages"), 0, sequences * config.max_pages)
  # Every sequence's table full, plus a partly filled page per head sharing a layer's budget.
  most = sequences * (config.max_pages + 1) + 1
  num_pages = _int(version, "cache.num_pages", cache.get("num_pages"), max(2, live + 1), most)
  if config.num_pages not in (None, num_pages):
    raise StateFileError(
        f"{version}: plan.config.num_pages={config.num_pages} disagrees with cache.num_pages="
        f"{num_pages}"
    )
  kv_dtype = cache.get("kv_dtype")
  if kv_dtype != config.dtype:
    raise StateFileError(
        f"{version}: cache.kv_dtype {_show(kv_dtype)} disagrees with its config ({config.dtype})"
    )
  try:
    key_shape = jax.eval_shape(
        lambda: jax.random.key_data(jax.random.key(0, impl=meta.get("key_impl")))
    ).shape
  except (TypeError, ValueError, KeyError) as err:
    impl = _show(meta.get("key_impl"))
    raise StateFileError(f"{version}: key_impl {impl}: {short(err)}") from None
  return Layout(
      version=version,
      layers=l,
      kv_heads=h,
      head_dim=shape["head_dim"],
      vocab=shape["vocab_size"],
      max_context=shape["max_context"],
      batch=batch,
      position=position,
      config=config,
      num_pages=num_pages,
      live=live,
      slots=_slots(cache.get("slots"), version),
      extra=_extra_names(cache.get("extra"), version),
      kv_dtype=kv_dtype,
      key_shape=tuple(key_shape),
  )


def bounded_extra(layout: Layout, declared: dict) -> dict:
  """Shapes the policy's state beside the cache may have without the model at hand: float32
  [L, B, ...] of at most `MAX_QUERY_GROUP` query heads per kv head (`load_state` checks the
  exact shapes the policy makes)."""
  most = layout.layers * layout.batch * MAX_QUERY_GROUP * layout.kv_heads * layout.head_dim**2
  out = {}
  for name in layout.extra:
    shape, dtype = declared.get(f"extra.{name}", ((), "float32"))
    if len(shape) < 2 or shape[:2] != (layout.layers, layout.batch) or np.prod(shape) > most:
      raise StateFileError(
          f"{layout.version}: array 'extra.{name}' is {dtype} {shape}, not [layers "
          f"{layout.layers}, rows {layout.batch}, ...] of at most {most} values"
      )
    out[name] = (shape, "float32")
  return out


def check_values(layout: Layout, arrays: dict[str, np.ndarray]) -> None:
  """StateFileError unless the restored arrays are a cache the allocator could have made:
  `kvjax.testing.assert_cache_invariants` (each sequence owns exactly its first pages, no
  page twice, the rest free) in the form a save writes (the live pages 1..n in table
  order), lengths within the capacity and the tokens each row read, positions as recorded,
  each live token's original position before its row's, no error bit in its status, finite
  logits."""
  version, cfg = layout.version, layout.config
  length, table = arrays["length"], arrays["table"]
  row_position = np.asarray(layout.position, np.int64)
  if not (arrays["position"] == row_position).all():
    raise StateFileError(f"{version}: array 'position' disagrees with its metadata's positions")
  if (length < 0).any() or (length > cfg.max_tokens).any():
    raise StateFileError(f"{version}: array 'length' is outside [0, {cfg.max_tokens}] tokens")
  if (length > row_position[None, :, None]).any():
    raise StateFileError(
        f"{version}: array 'length' holds a sequence longer than the tokens its row has read"
    )
  owned = np.arange(cfg.max_pages) < pages.pages_for(length, cfg.page_size)[..., None]
  if int(owned.sum()) != layout.live:
    raise StateFileError(
        f"{version}: its lengths need {int(owned.sum())} pages; cache.live_pages is {layout.live}"
    )
  if not np.array_equal(table, pages.packed_table(owned)):
    raise StateFileError(
        f"{version}: array 'table' is not the page table of its lengths (each sequence its "
        "own pages, in order, the rest null)"
    )
  status = int(arrays["status"])
  if status < 0 or status & ~int(WARNINGS):  # a failed step's bits: no step returned it
    raise StateFileError(
        f"{version}: array 'status' holds bits {status} (a saved state holds at most the "
        f"warnings {int(WARNINGS)})"
    )
  if int(arrays["peak_pages"]) < 0:
    raise StateFileError(f"{version}: array 'peak_pages' is negative")
  if not np.isfinite(arrays["logits"]).all():
    raise StateFileError(f"{version}: array 'logits' holds NaN or Inf")
  # Each saved page's sequence, in the order the save wrote them (the table's).
  page_of = lambda x: np.broadcast_to(x, owned.shape)[owned]  # noqa: E731
  filled = np.clip(
      page_of(length[..., None]) - page_of(np.arange(cfg.max_pages)) * cfg.page_size,
      0,
      cfg.page_size,
  )
  in_use = np.arange(cfg.page_size) < filled[:, None]  # [live, S]
  limit = row_position[page_of(np.arange(layout.batch)[None, :, None, None])][:, None]
  original = arrays["slot.position"]
  if ((original < 0) | (original >= limit))[in_use].any():
    raise StateFileError(
        f"{version}: array 'slot.position' places a token outside [0, its row's position)"
    )


# ---- fields --------------------------------------------------------------------------------


def _positions(meta: dict, version: pathlib.Path, batch: int, shape: dict) -> tuple[int, ...]:
  position = meta.get("position")
  if not isinstance(position, list) or len(position) != batch:
    raise StateFileError(
        f"{version}: position must be a list of batch_size={batch} ints, got {_show(position)}"
    )
  out = tuple(
      _int(version, f"position[{i}]", p, 0, shape["max_context"]) for i, p in enumerate(position)
  )
  tokens = meta.get("tokens")
  if tokens is not None:
    vocab = shape["vocab_size"]
    rows = tokens if isinstance(tokens, list) else None
    if rows is None or [len(r) if isinstance(r, list) else -1 for r in rows] != list(out):
      raise StateFileError(
          f"{version}: tokens must list each row's ids, as many as its position "
          f"{_show(list(out))}"
      )
    for row in tokens:
      if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in row):
        raise StateFileError(f"{version}: tokens holds an id outside [0, {vocab})")
  return out


def _eviction(eviction, version: pathlib.Path, config: CacheConfig, layers: int) -> int:
  """Checks plan.eviction; returns the most tokens a sequence holds before it evicts."""
  top = config.threshold or 0
  if eviction is None:
    return top
  if not isinstance(eviction, dict) or not config.evicts:
    raise StateFileError(
        f"{version}: plan.eviction {_show(eviction)} needs a dict and a config with a budget"
    )
  budget = eviction.get("layer_budget")
  if not isinstance(budget, list) or len(budget) != layers:
    raise StateFileError(
        f"{version}: plan.eviction.layer_budget must list {layers} budgets, got {_show(budget)}"
    )
  for i, b in enumerate(budget):
    _int(version, f"plan.eviction.layer_budget[{i}]", b, 1, config.max_tokens)
  for name in ("per_head", "fair", "evict"):
    if not isinstance(eviction.get(name), bool):
      raise StateFileError(f"{version}: plan.eviction.{name} must be a bool")
  if eviction.get("impl") not in ATTENTION_IMPLS:
    raise StateFileError(f"{version}: plan.eviction.impl must be one of {ATTENTION_IMPLS}")
  return max(top, max(budget) + config.margin)


def _policy_room(spelling, version: pathlib.Path) -> int:
  """Tokens a compress-once policy's reconstruction pass adds after the context (its
  `chunk` and a prompt: `CompressionSpec.plan`); 0 for a policy without one."""
  if not isinstance(spelling, str):
    raise StateFileError(f"{version}: spec.policy must be a policy's name, got {_show(spelling)}")
  cls = POLICIES.get(spelling.partition(":")[0])
  if cls is None:
    raise StateFileError(f"{version}: spec.policy {_show(spelling)} is not a policy of this kvjax")
  if "chunk" not in {f.name for f in dataclasses.fields(cls)}:
    return 0
  try:
    chunk = get_policy(spelling).chunk
  except (TypeError, ValueError) as err:
    raise StateFileError(f"{version}: spec.policy {_show(spelling)}: {short(err)}") from None
  return int(chunk) + 64


def _slots(saved, version: pathlib.Path) -> tuple[Slot, ...]:
  if not isinstance(saved, list) or not all(isinstance(s, list) and len(s) == 3 for s in saved):
    raise StateFileError(f"{version}: cache.slots must list [name, dtype, empty] triples")
  slots = []
  for name, dtype, empty in saved:
    if (
        not isinstance(name, str)
        or not name.isidentifier()
        or dtype not in SLOT_DTYPES
        or not isinstance(empty, (bool, int, float))
    ):
      raise StateFileError(
          f"{version}: cache.slots holds {_show([name, dtype, empty])}: a slot is an "
          f"identifier, a dtype of {SLOT_DTYPES} and an empty value"
      )
    slots.append(Slot(name, dtype, empty))
  names = [s.name for s in slots]
  if tuple(slots[: len(CACHE_SLOTS)]) != CACHE_SLOTS or len(set(names)) != len(names):
    raise StateFileError(
        f"{version}: cache.slots {names} must start with the cache's own "
        f"{[s.name for s in CACHE_SLOTS]} and name each slot once"
    )
  return tuple(slots)


def _extra_names(saved, version: pathlib.Path) -> tuple[str, ...]:
  if (
      not isinstance(saved, list)
      or not all(isinstance(n, str) and n.isidentifier() for n in saved)
      or saved != sorted(set(saved))
  ):
    raise StateFileError(f"{version}: cache.extra must list distinct names, got {_show(saved)}")
  return tuple(saved)


def _dict(meta: dict, key: str, version: pathlib.Path, field: str | None = None) -> dict:
  value = meta.get(key)
  if not isinstance(value, dict):
    raise StateFileError(f"{version}: {field or key} must be a mapping, got {_show(value)}")
  return value


def _int(version: pathlib.Path, field: str, value, low: int, high: int | None = None) -> int:
  """`value` when it is an int in [low, high]; else StateFileError naming `field`."""
  if (
      not isinstance(value, int)
      or isinstance(value, bool)
      or value < low
      or (high is not None and value > high)
  ):
    bound = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise StateFileError(f"{version}: {field} must be an int {bound}, got {_show(value)}")
  return value


def _show(value) -> str:
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + "..."
