"""`kvjax doctor`: what this machine offers kvjax, which implementation `impl="auto"` runs
and why, and a self-check on a tiny random model (about 3 minutes on 2 CPU cores with a new
cache directory: it compiles every step it runs).

    kvjax doctor              # the report, then the self-check; exit 1 if a check fails
    kvjax doctor --json       # one JSON object
    kvjax.cli.doctor.report(), kvjax.cli.doctor.self_check()   # the same from Python
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cli import common

# The ops with a Pallas kernel, and whether each has a GPU variant (see pallas_kernels).
KERNELS = {"paged attention": True, "output impact": False, "group importance": False}


@dataclasses.dataclass(frozen=True)
class Check:
  name: str
  ok: bool
  detail: str
  seconds: float


def _version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"


def _memory(device) -> str:
  try:
    stats = device.memory_stats() or {}
  except Exception:  # backends without memory stats (CPU) raise or return None
    stats = {}
  if "bytes_limit" in stats:
    return f"{stats['bytes_limit'] / 2**30:.1f} GiB"
  try:
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return "unknown"
  return f"{host / 2**30:.1f} GiB (host memory)"


def implementation(op: str) -> tuple[str, str]:
  """(what `impl="auto"` runs for the kernel op `op` on this backend, why)."""
  from pallas_kernels._common import resolve_impl

  backend = jax.default_backend()
  if resolve_impl("auto", gpu_kernel=KERNELS[op])[0]:
    return "Pallas kernel (compiled)", "the TPU-style kernels compile on TPU and were tested there"
  if backend == "gpu":
    why = (
        "its GPU variant compiles (impl='pallas') but has not been verified on a GPU yet "
        "(python -m pallas_kernels.gpu_check)"
        if KERNELS[op]
        else "the kernel is TPU-style (scalar-prefetched page tables), which GPUs cannot compile"
    )
    return "jnp reference", why
  return "jnp reference", (
      f"Pallas kernels compile on TPU (and GPU); on {backend} they run only in interpret "
      "mode, which the self-check uses to verify them against the reference"
  )


def report() -> dict:
  """The machine as kvjax sees it: backend, devices, memory, versions, the default model,
  the implementation of each kernel op, the compilation cache."""
  from kvjax_store.cache_dir import describe as describe_cache
  from models.registry import DEFAULT_MODEL, known_models, model_availability, resolve_model

  backend = jax.default_backend()
  devices = jax.devices()
  try:
    model = f"{DEFAULT_MODEL}: {resolve_model(DEFAULT_MODEL).path}"
  except (FileNotFoundError, ValueError) as e:
    model = f"{DEFAULT_MODEL}: {e}"
  # Whether each registry model can load, without assembling or reading its weights.
  registry = {name: model_availability(name) for name in known_models()}
  return {
      "backend": backend,
      "devices": f"{len(devices)} x {devices[0].device_kind}",
      "memory per device": _memory(devices[0]),
      "processes": jax.process_count(),
      "versions": {
          "python": platform.python_version(),
          **{
              p: _version(p)
              for p in ("kvjax", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint")
          },
      },
      "default model": model,
      "registry models": registry,
      "impl='auto'": {op: dict(zip(("runs", "why"), implementation(op))) for op in KERNELS},
      "cache directory": describe_cache(),
  }


# ---- the self-check ------------------------------------------------------------------------


def _timed(name, fn) -> Check:
  start = time.perf_counter()
  try:
    ok, detail = fn()
  except Exception as e:  # a check that raises has failed: say why, in one line
    ok, detail = False, f"{type(e).__name__}: {e}".splitlines()[0]
  return Check(name, bool(ok), detail, time.perf_counter() - start)


def _dense_logits(model, ids):
  """The model's logits with plain causal attention over its own K/V (no kvjax cache); a
  sliding layer's query sees its window's latest keys (`config.layer_windows`, 0: all)."""
  windows = jnp.asarray(getattr(model.config, "layer_windows", None) or [0] * model.config.n_layers)

  def attend(q, k, v, state, layer):
    b, t, hq, d = q.shape
    k = jnp.repeat(k, hq // k.shape[2], axis=2)
    v = jnp.repeat(v, hq // v.shape[2], axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    back = jnp.arange(t)[:, None] - jnp.arange(t)[None, :]  # [T, T] query minus key position
    window = windows[layer]  # layer may be traced (the model's layer loop)
    visible = (back >= 0) & ((window == 0) | (back < window))
    s = jnp.where(visible, s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v), state

  tokens = jnp.asarray([ids], jnp.int32)
  positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
  return model.run(tokens, positions, None, attend)[0][0]


def _check_full_cache(model, ids):
  """Prefill and greedy decode through the paged cache against plain dense attention."""
  import kvjax

  state = kvjax.prefill(model, [ids], kvjax.CompressionSpec(page_size=8, prefill_chunk=16))
  state, result = kvjax.decode(model, state, 4, return_logits=True)
  dense = _dense_logits(model, list(ids) + result.tokens[0])  # [T + 4, V]
  paged = np.asarray(result.logits[0])  # the logits each decoded token was chosen from
  want = np.asarray(dense[len(ids) - 1 : len(ids) - 1 + len(paged)])
  diff = float(np.abs(paged - want).max())
  return diff <= 1e-4, (
      f"prefill of {len(ids)} tokens + {len(paged)} decode steps vs dense attention: "
      f"max |logit diff| {diff:.1e}"
  )


def _check_quantized(model, ids):
  """int8 and int4 pages against float32 pages: the same prefill and extend, logits within
  the codec's error (int8 closer than int4), K/V bytes in proportion to the dtype's."""
  import kvjax
  from pallas_kernels.page_format import token_bytes

  logits, held = {}, {}
  for kv_dtype in ("float32", "int8", "int4"):
    spec = kvjax.CompressionSpec(page_size=8, prefill_chunk=16, kv_dtype=kv_dtype)
    state = kvjax.prefill(model, [ids[:-4]], spec)
    first = np.asarray(state.logits)
    state = kvjax.extend(model, state, [ids[-4:]])
    logits[kv_dtype] = np.concatenate([first, np.asarray(state.logits)])
    held[kv_dtype] = state.kv_bytes()
  scale = float(np.abs(logits["float32"]).max())
  diff = {kv: float(np.abs(logits[kv] - logits["float32"]).max()) / scale for kv in held}
  d = model.config.head_dim
  ratios = {kv: held["float32"] / held[kv] for kv in ("int8", "int4")}
  in_proportion = all(
      abs(r - token_bytes(d, "float32") / token_bytes(d, kv)) < 1e-6 for kv, r in ratios.items()
  )
  ok = diff["int8"] <= 0.02 and diff["int8"] <= diff["int4"] <= 0.3 and in_proportion
  return ok, (
      f"max |logit diff| / max |logit| vs float32 pages: int8 {diff['int8']:.1e}, int4 "
      f"{diff['int4']:.1e}; K/V bytes 1/{ratios['int8']:.1f} and 1/{ratios['int4']:.1f}"
  )


def _check_kernel():
  """The paged-attention kernel (interpret mode off TPU/GPU) against the reference, with
  NaN in the pages no sequence owns, on float32, int8 and int4 pages."""
  from kvjax.cache.pages import pages_for
  from pallas_kernels import page_format
  from pallas_kernels.paged_attention import paged_attention

  rng = np.random.default_rng(0)
  b, hkv, group, d, ps, m = 2, 2, 2, 64, 8, 4
  pool = 1 + b * hkv * m
  k = rng.normal(size=(pool, ps, d)).astype(np.float32)
  v = rng.normal(size=(pool, ps, d)).astype(np.float32)
  lengths = np.array([[13, 32], [1, 20]], np.int32)
  table = np.zeros((b, hkv, m), np.int32)
  owned = np.zeros(pool, bool)
  ids = iter(range(1, pool))
  for i in range(b):
    for h in range(hkv):
      for j in range(pages_for(lengths[i, h], ps)):
        table[i, h, j] = next(ids)
        owned[table[i, h, j]] = True
  k[~owned], v[~owned] = np.nan, np.nan  # an unused page that leaks shows up as NaN
  q = rng.normal(size=(b, 1, hkv * group, d)).astype(np.float32)
  interpret = jax.default_backend() not in ("tpu", "gpu")
  diffs = []
  for kv_dtype in ("float32", "int8", "int4"):
    pools = [page_format.encode(jnp.asarray(x), kv_dtype) for x in (k, v)]
    args = (q, *pools, table, lengths)
    want = paged_attention(*args, impl="ref")
    got = paged_attention(*args, impl="pallas", interpret=interpret or None)
    diffs.append(max(float(np.abs(np.asarray(a) - np.asarray(w)).max()) for a, w in zip(got, want)))
  diff = max(diffs)
  mode = "interpret mode" if interpret else "compiled"
  return (
      diff <= 1e-5 and np.isfinite(diff),
      f"Pallas kernel ({mode}) vs reference on float32, int8 and int4 pages: max |diff| "
      f"{diff:.1e}",
  )


def _check_policy(model, policy, prompts, tokenizer, auto_is_reference):
  """A prefill in 16-token chunks (evicting between them, or compressing the context once
  at the end) at budget 24: the allocator's invariants, the budget, finite logits; where
  impl='auto' is not the reference, the same against the reference."""
  import kvjax
  from kvjax.testing import assert_cache_invariants

  def run(impl):
    spec = kvjax.CompressionSpec(
        policy=policy, budget=24, page_size=8, prefill_chunk=16, attention_impl=impl
    )
    return kvjax.prefill(model, prompts, spec, tokenizer=tokenizer)

  state = run("auto")
  assert_cache_invariants(state.cache)
  if not np.isfinite(np.asarray(state.logits)).all():
    return False, "non-finite logits"
  length = np.asarray(state.cache.length)  # [L, B, H]
  # A row keeps its budget per sequence, plus at most its margin (a page at this budget) and
  # a prefill chunk (a global ranking moves tokens between sequences, not above this).
  bound = length.shape[0] * length.shape[2] * (24 + 8 + 16)
  held = int(length.sum(axis=(0, 2)).max())
  entries = max(map(len, prompts)) * length.shape[0] * length.shape[2]
  detail = f"a row holds {held} of {entries} K/V entries (at most {bound} at budget 24)"
  if auto_is_reference:
    return held <= bound, detail
  diff = float(np.abs(np.asarray(state.logits) - np.asarray(run("ref").logits)).max())
  return held <= bound and diff <= 1e-3, detail + f"; vs the reference: max |logit diff| {diff:.1e}"


def _tiny_learned(model):
  """The learned policy with a random scorer made for `model` (the shipped scorer is the
  default model's)."""
  from kvjax.policies import Learned
  from kvjax.policies.learned import Scorer
  from kvjax.fingerprint import model_fingerprint
  from kvjax.seam import ModelShape

  shape, rng = ModelShape.of(model), np.random.default_rng(0)
  d = model.config.d_model
  weight = rng.normal(size=(shape.n_layers, d, shape.n_kv_heads))
  bias = rng.normal(size=(shape.n_layers, shape.n_kv_heads))
  return Learned(scorer=Scorer(weight, bias, "tiny", model_fingerprint(model)))


def self_check(progress=None) -> list[Check]:
  """Runs the checks on a tiny random model (nothing downloaded): the paged cache against
  dense attention, the Pallas kernel against its reference, and every policy (prefill in
  chunks, decode, the allocator's invariants, finite logits; off CPU, impl='auto' against
  the reference). `progress(check)` is called after each."""
  from kvjax.policies import POLICIES
  from kvjax.testing import ByteTokenizer, tiny_gemma3, tiny_llama

  model, tokenizer = tiny_llama(max_context=256, qk_scale=20), ByteTokenizer()
  prompts = ["the quick brown fox jumps over the lazy dog " * 2, "kvjax doctor " * 8]
  auto_is_reference = all(implementation(op)[0] == "jnp reference" for op in KERNELS)
  steps = [
      (
          "full cache = dense attention",
          lambda: _check_full_cache(model, tokenizer.encode(prompts[0])),
      ),
      ("Pallas paged attention = reference", _check_kernel),
      (
          "int8 / int4 pages ~ float32 pages",
          lambda: _check_quantized(model, tokenizer.encode(prompts[0])),
      ),
  ]
  hybrid, hybrid_ids = tiny_gemma3(window=8, max_context=256, qk_scale=3.0), prompts[0]
  steps.append(
      (
          "sliding-window layers (tiny Gemma 3) = dense windowed attention",
          lambda: _check_full_cache(hybrid, tokenizer.encode(hybrid_ids)),
      )
  )
  for name in sorted(POLICIES):
    if name == "full":  # checked above
      continue
    policy = _tiny_learned(model) if name == "learned" else name
    steps.append(
        (
            f"policy {name}",
            lambda p=policy: _check_policy(model, p, prompts, tokenizer, auto_is_reference),
        )
    )
  checks = []
  for name, fn in steps:
    checks.append(_timed(name, fn))
    if progress is not None:
      progress(checks[-1])
  return checks


# ---- the command ---------------------------------------------------------------------------


def add_parsers(subparsers) -> None:
  doctor = subparsers.add_parser(
      "doctor", help="backend, devices, versions, the implementation impl='auto' runs; a self-check"
  )
  doctor.add_argument("--json", action="store_true", help="print one JSON object")
  doctor.add_argument(
      "--no-self-check",
      action="store_true",
      help="the report only (no self-check: ~3 min on 2 CPU cores with a new cache directory)",
  )
  doctor.set_defaults(func=_doctor)


def _print_report(found: dict) -> None:
  for key, value in found.items():
    if isinstance(value, dict):
      print(f"{key}:")
      for name, item in value.items():
        text = f"{item['runs']} ({item['why']})" if isinstance(item, dict) else item
        print(f"  {name}: {text}")
    else:
      print(f"{key}: {value}")


def _doctor(args) -> int:
  """Prints what this machine offers kvjax and runs the self-check; 1 if a check fails."""
  common.begin_work(args)  # no input to check: everything is the run
  found = report()
  if not args.json:
    _print_report(found)
  checks = []
  if not args.no_self_check:
    if not args.json:
      print(
          "self-check (a tiny random model; where impl='auto' runs the reference, that is what "
          "it checks):"
      )

    def show(check):
      if not args.json:
        mark = "ok  " if check.ok else "FAIL"
        print(f"  {mark} {check.name} ({check.seconds:.1f} s): {check.detail}", flush=True)

    checks = self_check(progress=show)
  failed = [c.name for c in checks if not c.ok]
  if args.json:
    found["self_check"] = [dataclasses.asdict(c) for c in checks]
    print(json.dumps(found))
  elif checks:
    seconds = sum(c.seconds for c in checks)
    print(
        f"self-check: {len(checks) - len(failed)} of {len(checks)} passed in {seconds:.0f} s"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
  return common.EXIT_FAILED if failed else 0
