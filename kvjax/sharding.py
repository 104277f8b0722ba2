"""Scale-out on JAX's own runtime: the paged cache and the model sharded over a device mesh.

A mesh has two axes, `data` and `model` (either may have size 1):

    batch rows         over `data`
    kv heads           over `model`, with their query heads and the weights that make them
    the cache          G = data x model shards; shard g = (i, j) owns the sequences (layer, row,
                       kv head) of row block i and head block j, and a page pool of its own:

      k_pages, v_pages  [G, P, S, D]    sharded over (data, model) on the first axis
      slots             {name: [G, P, S]}
      pages.table       [L, B, H, M]    sharded over rows and heads; page ids are local to the
                                        shard that holds the entry: no page is referenced across
                                        devices
      pages.length      [L, B, H]       sharded over rows and heads
      pages.free_pages  [G, P]          each shard's free stack
      pages.num_free, pages.status  [G]

Every operation that reads or writes the cache (append, attention, the policy's observation,
eviction) runs per shard in `shard_map` on that shard's own cache (`on_shards`): the same code
as on one device, on [P, S, D] pools and [L, B/data, H/model, M] tables. Rankings that span
kv heads (a budget shared across heads, `head_budgets`) gather the scores over `model` once
per eviction, so every shard decides exactly what one device would. The rest of the model
runs under GSPMD with its weights placed by the model's own rules (`model.partition`, see
`shard_model`); XLA inserts the collectives (one all-reduce after attention's output
projection and one after the MLP per layer, with the Llama rules).
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.cache.paged_cache import PagedKVCache, init_cache

__all__ = [
    "SHARDS",
    "all_heads",
    "any_shard",
    "inside",
    "make_mesh",
    "model_mesh",
    "my_heads",
    "num_shards",
    "on_shards",
    "shard_bytes",
    "shard_config",
    "shard_key",
    "shard_model",
]

DATA, MODEL = "data", "model"
SHARDS = (DATA, MODEL)  # the pool's first axis: one block per device, data-major

# Set while a function traces inside `on_shards`: collectives over the mesh axes are legal.
_INSIDE = contextvars.ContextVar("kvjax_inside_shards", default=False)


def make_mesh(mesh) -> Mesh | None:
  """A `Mesh` with axes ('data', 'model') from a Mesh, "data=2,model=2", {"data": 2,
  "model": 2} or (data, model); None stays None (one device). ValueError naming the
  devices there are when the mesh asks for more."""
  if mesh is None or isinstance(mesh, Mesh):
    if isinstance(mesh, Mesh) and set(mesh.axis_names) != set(SHARDS):
      raise ValueError(
          f"mesh must have the axes {SHARDS} (size 1 for an unused one), got {mesh.axis_names}"
      )
    return mesh
  if isinstance(mesh, str):
    sizes = {}
    for part in filter(None, (p.strip() for p in mesh.split(","))):
      match = re.fullmatch(r"(\w+)\s*=\s*(\d+)", part)
      if match is None:
        raise ValueError(f"mesh must look like 'data=2,model=2', got {mesh!r}")
      sizes[match.group(1)] = int(match.group(2))
    mesh = sizes
  if isinstance(mesh, dict):
    unknown = set(mesh) - set(SHARDS)
    if unknown:
      raise ValueError(f"mesh axes must be {SHARDS}, got {sorted(mesh)}")
    mesh = (mesh.get(DATA, 1), mesh.get(MODEL, 1))
  if (
      not isinstance(mesh, (tuple, list))
      or len(mesh) != 2
      or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in mesh)
  ):
    raise ValueError(
        f"mesh must be a jax Mesh, 'data=D,model=M', a dict or (D, M) of ints >= 1, got {mesh!r}"
    )
  data, model = mesh
  devices = jax.devices()
  if data * model > len(devices):
    raise ValueError(
        f"mesh data={data} x model={model} needs {data * model} devices; "
        f"{len(devices)} {devices[0].platform} device(s) are visible (on a CPU, "
        "XLA_FLAGS=--xla_force_host_platform_device_count=N makes N)"
    )
  # jax.make_mesh lays `model` (the chattier axis) on neighbouring devices.
  return jax.make_mesh(
      (data, model),
      SHARDS,
      axis_types=(jax.sharding.AxisType.Auto,) * 2,
      devices=devices[: data * model],
  )


def num_shards(mesh: Mesh | None) -> int:
  """Devices of the mesh (data x model); 1 for None (one device)."""
  return 1 if mesh is None else mesh.shape[DATA] * mesh.shape[MODEL]


def check_mesh(mesh: Mesh, *, batch: int, kv_heads: int):
  """ValueError when the batch or the heads do not split evenly over the mesh."""
  data, model = mesh.shape[DATA], mesh.shape[MODEL]
  if batch % data:
    raise ValueError(
        f"batch of {batch} rows does not split over mesh axis data={data}: give a multiple "
        f"of {data} prompts"
    )
  if kv_heads % model:
    raise ValueError(
        f"the model's {kv_heads} kv heads do not split over mesh axis model={model}: use a "
        f"model axis that divides {kv_heads}"
    )


# ---- the cache's layout ------------------------------------------------------------------


def cache_specs(cache: PagedKVCache) -> PagedKVCache:
  """The cache's pytree with a `PartitionSpec` per array (see the module docstring)."""
  if cache.extra:
    raise ValueError("a sharded cache holds no policy `extra` state (see check_policy)")
  per_sequence = P(None, DATA, MODEL)
  return cache.replace(
      k_pages=jax.tree.map(lambda _: P(SHARDS), cache.k_pages),
      v_pages=jax.tree.map(lambda _: P(SHARDS), cache.v_pages),
      slots={name: P(SHARDS) for name in cache.slots},
      pages=cache.pages.replace(
          table=per_sequence,
          length=per_sequence,
          free_pages=P(SHARDS),
          num_free=P(SHARDS),
          status=P(SHARDS),
      ),
  )


def check_policy(policy) -> None:
  """Policies whose state is not per token are not sharded yet: a clear error."""
  if policy is not None and policy.keeps_extra:
    raise ValueError(
        f"policy {policy.name!r} keeps state that is not per token (`Policy.init_extra`), "
        "which kvjax does not shard yet: run it without a mesh"
    )


def shard_config(config, mesh: Mesh, *, shares_heads: bool = False):
  """A plan's `CacheConfig` for one shard: a pool sized for the whole batch (`num_pages`)
  becomes each shard's share of the sequences plus its own null page. A budget shared
  across kv heads (`shares_heads`) may give one shard's heads most of a row's tokens, so
  each shard then holds its rows' whole pool (split over `data` only)."""
  if config.num_pages is None:  # sized by `init_cache` from the shard's own sequences
    return config
  split = mesh.shape[DATA] if shares_heads else num_shards(mesh)
  share = math.ceil((config.num_pages - 1) / split) + 1  # + its own null page
  return dataclasses.replace(config, num_pages=share)


def sharded_cache(config, mesh: Mesh, num_layers, batch, kv_heads, head_dim, **kwargs):
  """An empty cache laid out over `mesh`: every shard's pool and page-table block made on
  its own device (`config.num_pages`, when set, is the pool of one shard)."""
  data, model = mesh.shape[DATA], mesh.shape[MODEL]
  check_mesh(mesh, batch=batch, kv_heads=kv_heads)
  g = data * model
  local = jax.eval_shape(
      lambda: init_cache(config, num_layers, batch // data, kv_heads // model, head_dim, **kwargs)
  )

  def make():
    one = init_cache(config, num_layers, batch // data, kv_heads // model, head_dim, **kwargs)
    stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (g, *x.shape)), _pool_part(one))
    tile = lambda x: jnp.tile(x, (1, data, model, *([1] * (x.ndim - 3))))  # noqa: E731
    return one.replace(
        k_pages=stacked.k_pages,
        v_pages=stacked.v_pages,
        slots=stacked.slots,
        pages=one.pages.replace(
            table=tile(one.pages.table),
            length=tile(one.pages.length),
            free_pages=stacked.pages.free_pages,
            num_free=stacked.pages.num_free,
            status=stacked.pages.status,
        ),
    )

  shardings = _named(mesh, cache_specs(local))
  return jax.jit(make, out_shardings=shardings)().replace(mesh=mesh)


def _pool_part(cache: PagedKVCache) -> PagedKVCache:
  """The per-shard part of a cache: the arrays with one block per shard (pool, slots, free
  stack, counters); the table and lengths are left out (None)."""
  return cache.replace(pages=cache.pages.replace(table=None, length=None))


def _named(mesh: Mesh, specs):
  return jax.tree.map(
      lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P)
  )


def _local(cache: PagedKVCache) -> PagedKVCache:
  """Inside `on_shards`: this shard's [1, ...] blocks as the cache one device would hold."""
  pages = cache.pages
  return cache.replace(
      k_pages=jax.tree.map(lambda x: x[0], cache.k_pages),
      v_pages=jax.tree.map(lambda x: x[0], cache.v_pages),
      slots={name: x[0] for name, x in cache.slots.items()},
      pages=pages.replace(
          free_pages=pages.free_pages[0], num_free=pages.num_free[0], status=pages.status[0]
      ),
      mesh=None,
  )


def _stacked(cache: PagedKVCache, mesh: Mesh) -> PagedKVCache:
  pages = cache.pages
  return cache.replace(
      k_pages=jax.tree.map(lambda x: x[None], cache.k_pages),
      v_pages=jax.tree.map(lambda x: x[None], cache.v_pages),
      slots={name: x[None] for name, x in cache.slots.items()},
      pages=pages.replace(
          free_pages=pages.free_pages[None],
          num_free=pages.num_free[None],
          status=pages.status[None],
      ),
      mesh=mesh,
  )


def on_shards(fn, cache: PagedKVCache, *args, specs=(), out_specs=None):
  """Runs `fn(cache, *args)` on every shard of `cache`'s mesh, on that shard's own cache.

  `specs` are the `PartitionSpec`s of `args` (e.g. `P(DATA)` for per-row arrays, `P()` for
  replicated ones); `fn` returns the cache, or `(cache, outputs)` with `out_specs` for the
  outputs. Inside, `all_heads`/`any_shard` may be used (collectives over the mesh)."""
  mesh = cache.mesh
  if mesh is None:
    return fn(cache, *args)
  cspecs = cache_specs(cache)

  def local(cache, *args):
    token = _INSIDE.set(True)
    try:
      result = fn(_local(cache), *args)
    finally:
      _INSIDE.reset(token)
    if out_specs is None:
      return _stacked(result, mesh)
    cache, outputs = result
    return _stacked(cache, mesh), outputs

  return jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(cspecs, *specs),
      out_specs=cspecs if out_specs is None else (cspecs, out_specs),
      check_vma=False,
  )(cache, *args)


def inside() -> bool:
  """True while tracing a function for `on_shards` (collectives over the mesh are legal)."""
  return _INSIDE.get()


def all_heads(x: jax.Array, axis: int) -> jax.Array:
  """Inside `on_shards`: x with the kv heads of every model shard along `axis` (in head
  order); elsewhere x itself."""
  return jax.lax.all_gather(x, MODEL, axis=axis, tiled=True) if inside() else x


def my_heads(x: jax.Array, axis: int, local: int) -> jax.Array:
  """Inside `on_shards`: this shard's `local` heads of x along `axis` (undoes `all_heads`)."""
  if not inside():
    return x
  start = jax.lax.axis_index(MODEL) * local
  return jax.lax.dynamic_slice_in_dim(x, start, local, axis)


def shard_key(key: jax.Array) -> jax.Array:
  """Inside `on_shards`: a random key of this shard's own (folded with its index)."""
  if not inside():
    return key
  index = jax.lax.axis_index(DATA) * jax.lax.axis_size(MODEL) + jax.lax.axis_index(MODEL)
  return jax.random.fold_in(key, index)


def any_shard(x: jax.Array) -> jax.Array:
  """Inside `on_shards`: whether x holds on any shard of the mesh (the same answer on all)."""
  if not inside():
    return x
  return jax.lax.pmax(x.astype(jnp.int32), SHARDS) > 0


def constrain(cache: PagedKVCache) -> PagedKVCache:
  """Inside jit: the cache pinned to its layout, so compiled steps hand each other caches
  of one sharding (an executable refuses arguments of another)."""
  if cache.mesh is None:
    return cache
  return jax.lax.with_sharding_constraint(cache, _named(cache.mesh, cache_specs(cache)))


def rows(x, mesh: Mesh | None, spec=P(DATA)):
  """Per-row arrays ([B, ...]) pinned over `data` (inside jit, or placed from the host)."""
  if mesh is None:
    return x
  sharding = NamedSharding(mesh, spec)
  if isinstance(x, jax.core.Tracer):
    return jax.lax.with_sharding_constraint(x, sharding)
  if isinstance(x, jax.Array) and getattr(x.sharding, "mesh", None) != mesh:
    # An array of one device (e.g. a key made on the host) goes through the host: with
    # several processes, no process may put another's array on the mesh.
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      data = jax.device_put(np.asarray(jax.random.key_data(x)), sharding)
      return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    x = np.asarray(x)
  return jax.device_put(x, sharding)


def replicated(x, mesh: Mesh | None):
  return rows(x, mesh, P())


def layout_key(x):
  """How an array is laid out over a mesh, as a hashable key with axes of size 1 left out
  (P(None, 'data', 'model') on a mesh with model=1 is the same layout as P(None, 'data'));
  None for an array not on a mesh."""
  sharding = getattr(x, "sharding", None)
  if not isinstance(sharding, NamedSharding):
    return None
  mesh = sharding.mesh

  def used(entry):
    names = entry if isinstance(entry, tuple) else (entry,)
    kept = tuple(n for n in names if n is not None and mesh.shape[n] > 1)
    return kept or None

  spec = [used(entry) for entry in sharding.spec]
  while spec and spec[-1] is None:
    spec.pop()
  return mesh, tuple(spec)


def shard_bytes(cache: PagedKVCache) -> dict:
  """Bytes of the cache's arrays on each device, measured from the arrays' shards:
  {device id: bytes}."""
  per_device: dict[int, int] = {}
  for leaf in jax.tree.leaves(cache):
    for shard in leaf.addressable_shards:
      per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
  return per_device


# ---- the model's weights -----------------------------------------------------------------


def shard_model(model, mesh: Mesh) -> None:
  """Places the model's parameters on `mesh` in place, by the model's own rules:
  `model.partition(path, shape) -> PartitionSpec or None` (None: replicated) names the
  axis split over `model` (e.g. a projection's head axis); a model without `partition`
  gets every weight replicated (correct, not lean). Parameters already placed stay.
  `mesh`: anything `make_mesh` takes (not None)."""
  mesh = make_mesh(mesh)
  if mesh is None:
    raise ValueError("shard_model needs a mesh, got None (the model stays where it is)")
  rule = getattr(model, "partition", None)
  state = nnx.state(model, nnx.Param)

  def place(path, x):
    spec = rule(tuple(str(getattr(k, "key", k)) for k in path), x.shape) if rule else None
    if spec is not None and any(size % _axis_size(mesh, axis) for axis, size in zip(spec, x.shape)):
      spec = None  # an axis that does not split evenly: replicated
    sharding = NamedSharding(mesh, P() if spec is None else spec)
    if isinstance(x, jax.Array) and x.sharding == sharding:
      return x
    return jax.device_put(x, sharding)

  nnx.update(model, jax.tree_util.tree_map_with_path(place, state))


def _axis_size(mesh: Mesh, axis) -> int:
  names = () if axis is None else axis if isinstance(axis, tuple) else (axis,)
  return int(np.prod([mesh.shape[name] for name in names]))


def model_mesh(model) -> Mesh | None:
  """The mesh a model's weights are placed on (None when on one device)."""
  for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
    sharding = getattr(leaf, "sharding", None)
    return sharding.mesh if isinstance(sharding, NamedSharding) else None
  return None


# ---- host-side views per shard (growing and compacting a pool) ---------------------------


def mesh_shape(cache: PagedKVCache) -> tuple[int, int]:
  """(data, model) of the cache's mesh; (1, 1) on one device."""
  mesh = cache.mesh
  return (1, 1) if mesh is None else (mesh.shape[DATA], mesh.shape[MODEL])


def blocks(cache: PagedKVCache, x: np.ndarray) -> np.ndarray:
  """A host per-sequence array [L, B, H, ...] as one block per shard [G, L, B/data,
  H/model, ...], in the pool's shard order (G = 1 on one device)."""
  d, m = mesh_shape(cache)
  l, b, h, *rest = x.shape
  y = np.moveaxis(x.reshape(l, d, b // d, m, h // m, *rest), (1, 3), (0, 1))
  return y.reshape(d * m, l, b // d, h // m, *rest)


def unblocks(cache: PagedKVCache, y: np.ndarray) -> np.ndarray:
  """The inverse of `blocks`: [G, L, b, h, ...] -> [L, B, H, ...]."""
  d, m = mesh_shape(cache)
  _, l, b, h, *rest = y.shape
  x = np.moveaxis(y.reshape(d, m, l, b, h, *rest), (0, 1), (1, 3))
  return x.reshape(l, d * b, m * h, *rest)


def per_shard(cache: PagedKVCache, x):
  """A pool array or counter with its shard axis ([G, ...]; a new axis of 1 on one device)."""
  return x if cache.mesh is not None else x[None]


def from_per_shard(cache: PagedKVCache, x):
  return x if cache.mesh is not None else x[0]


def place(cache: PagedKVCache) -> PagedKVCache:
  """Host-side: a (re-laid-out) sharded cache's arrays put back on their devices."""
  if cache.mesh is None:
    return cache
  return jax.device_put(cache, _named(cache.mesh, cache_specs(cache)))
