"""The cache and the model sharded over a device mesh (kvjax.sharding).

Meshes of several devices run in a subprocess with forced CPU devices
(tests/sharding_check.py), so this process keeps its one device; a (1, 1) mesh runs the
sharded code path here."""

import json
import pathlib
import socket
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

import kvjax
from kvjax import sharding
from kvjax.sharding import layout_key as sharding_key
from kvjax.testing import ByteTokenizer, tiny_llama

ROOT = pathlib.Path(__file__).resolve().parent.parent
POLICIES = ("full", "h2o", "kvzip")  # kvzip: the best query-agnostic policy
MESHES = ("data=4,model=1", "data=1,model=2", "data=2,model=2")
# By default a compress-once policy on the mesh that
# splits both axes (test_two_processes_agree_with_one runs h2o on float pages); every
# policy x mesh with -m slow. A budget shared across kv heads (AdaKV) ranks every head of a
# row: gathered over `model`. The learned scorer predicts every kv head's score: each shard
# keeps its own heads'.
DEFAULT_CASES = ["kvzip@data=2,model=2"]
SLOW_CASES = [f"{p}@{m}" for p in POLICIES for m in MESHES if f"{p}@{m}" not in DEFAULT_CASES]
SLOW_CASES += ["snapkv+layer@data=1,model=2", "learned@data=1,model=2"]
SLOW_CASES += ["kvzip:int4@data=2,model=2", "full:int8@data=1,model=2"]
# Quantized pages: codes and scales sharded with their tokens.
SLOW_CASES += ["h2o:int8@data=2,model=2"]
# A hybrid cache (sliding-window layers beside full ones) on the mesh that splits both axes.
SLOW_CASES += ["gemma3/kvzip@data=2,model=2", "gemma3/h2o:int8@data=2,model=2"]
CASES = [*DEFAULT_CASES, *(pytest.param(case, marks=pytest.mark.slow) for case in SLOW_CASES)]


@pytest.fixture(scope="module")
def sharded_runs():
  """One subprocess with 4 CPU devices per group of cases (the default ones, the slow ones)
  runs each case and its one-device reference; cases are run when first asked for."""
  runs = {}

  def run(case):
    if case not in runs:
      group = DEFAULT_CASES if case in DEFAULT_CASES else SLOW_CASES
      out = subprocess.run(
          [sys.executable, str(ROOT / "tests" / "sharding_check.py"), "4", *group],
          capture_output=True,
          text=True,
          timeout=900,
          cwd=ROOT,
      )
      assert out.returncode == 0, out.stderr[-3000:]
      for line in out.stdout.splitlines():
        if line.startswith("{"):
          row = json.loads(line)
          runs[row["case"]] = row
    return runs[case]

  return run


@pytest.mark.parametrize("case", CASES)
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_sharded_generation_matches_one_device(sharded_runs, case):
  run = sharded_runs(case)
  assert run["same_tokens"], run
  # Quantized pages: a key that differs by an ulp (GSPMD sums in another order) can round to
  # the next code, a step of its group's range, so the logits agree less closely.
  assert run["max_logit_diff"] <= (1e-4 if ":int" in case else 1e-5), run
  assert run["kv_bytes"][0] == run["kv_bytes"][1]  # the same tokens kept, in total


@pytest.mark.parametrize("case", CASES)
def test_cache_bytes_per_device(sharded_runs, case):
  """Measured from the arrays' shards: each device holds 1/N of the cache, plus its own
  null page (for a context compressed once, the room the fullest shard needs; with a budget
  shared across heads, its rows' whole pool)."""
  run = sharded_runs(case)
  n = int(np.prod([int(part.split("=")[1]) for part in case.split("@")[1].split(",")]))
  per_device, whole = run["bytes_per_device"], run["unsharded_bytes"]
  assert run["devices"] == n and len(set(per_device)) == 1
  if case.split("/")[-1].startswith(("kvzip", "learned")):
    # Shards share one pool size: the largest need after the global ranking.
    assert whole / n <= per_device[0] <= 1.05 * whole / n + run["one_page_bytes"]
  elif "+layer" in case:
    rows = int(case.split("data=")[1].split(",")[0])
    assert whole / n <= per_device[0] <= whole / rows + run["one_page_bytes"]
  else:
    assert whole / n <= per_device[0] <= whole / n + run["one_page_bytes"]


@pytest.mark.parametrize("case", CASES)
def test_no_recompilation_per_step(sharded_runs, case):
  """A mesh compiles what one device compiles: one prefill step for all its chunks, one
  decode loop for all its steps, nothing for a second decode of the same length."""
  counts, one_device = sharded_runs(case)["compiles"], sharded_runs(case)["one_device_compiles"]
  assert counts == one_device
  assert counts["first_decode"] == 1 and counts["second_decode"] == 0


@pytest.mark.slow  # ~20 s: -m slow; the 2x2 mesh and two processes run by default
def test_one_device_mesh_runs_the_sharded_path():
  """A (1, 1) mesh: the shard_map path on one device gives the unsharded tokens and logits,
  and the state keeps its mesh through decode and extend."""
  tokenizer = ByteTokenizer()
  prompts = ["the quick brown fox jumps over the lazy dog", "hello sharded world"]
  spec = kvjax.CompressionSpec(policy="h2o", budget=16, page_size=8)
  results = []
  for mesh in (None, "data=1,model=1"):
    model = tiny_llama(qk_scale=20)
    state = kvjax.prefill(model, prompts, spec, tokenizer=tokenizer, mesh=mesh)
    state, first = kvjax.decode(model, state, 6, return_logits=True)
    state = kvjax.extend(model, state, ["and more", "!"], tokenizer=tokenizer)
    state, second = kvjax.decode(model, state, 4)
    results.append((first.tokens + second.tokens, np.asarray(first.logits), state))
  (tokens, logits, plain), (tokens_m, logits_m, sharded) = results
  assert tokens_m == tokens
  np.testing.assert_allclose(logits_m, logits, atol=1e-5)
  assert plain.cache.mesh is None and sharded.cache.mesh is not None
  assert sharded.cache.k_pages.ndim == 4  # [G, P, S, D]: one pool per shard
  assert sharded.kv_bytes() == plain.kv_bytes()


def test_generate_reports_the_mesh():
  result = kvjax.generate(
      tiny_llama(), ByteTokenizer(), ["abc"], max_new_tokens=2, mesh="data=1,model=1"
  )
  assert result.stats["mesh"] == {"data": 1, "model": 1}


@pytest.mark.parametrize(
    "mesh, match",
    [
        ("data=2", "needs 2 devices; 1 cpu device"),
        ("data=0", "ints >= 1"),
        ("rows=2", r"mesh axes must be \('data', 'model'\)"),
        ("data:2", "must look like 'data=2,model=2'"),
        ((1, 1, 1), "jax Mesh, 'data=D,model=M'"),
    ],
)
def test_bad_meshes(mesh, match):
  with pytest.raises(ValueError, match=match):
    kvjax.make_mesh(mesh)


def test_shard_model_needs_a_mesh():
  with pytest.raises(ValueError, match="shard_model needs a mesh, got None"):
    kvjax.shard_model(tiny_llama(), None)
  with pytest.raises(ValueError, match="mesh must look like 'data=2,model=2'"):
    kvjax.shard_model(tiny_llama(), "data:2")


def test_layout_keys_ignore_axes_of_size_one():
  mesh = kvjax.make_mesh("data=1,model=1")
  sharding = lambda *spec: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))  # noqa: E731
  x = jax.device_put(np.zeros((2, 2, 2)), sharding(None, "data", "model"))
  y = jax.device_put(np.zeros((2, 2, 2)), sharding())
  assert sharding_key(x) == sharding_key(y) == (mesh, ())
  assert sharding_key(np.zeros(2)) is None


def test_uneven_splits_are_refused():
  mesh = types.SimpleNamespace(shape={"data": 2, "model": 4})
  with pytest.raises(ValueError, match="batch of 3 rows does not split over mesh axis data=2"):
    sharding.check_mesh(mesh, batch=3, kv_heads=4)
  with pytest.raises(ValueError, match="2 kv heads do not split over mesh axis model=4"):
    sharding.check_mesh(mesh, batch=2, kv_heads=2)


def test_unsupported_combinations_are_refused(tmp_path):
  model, tokenizer = tiny_llama(), ByteTokenizer()
  with pytest.raises(ValueError, match="expected_attention.*without a mesh"):
    kvjax.prefill(
        model,
        ["abc"],
        kvjax.CompressionSpec(policy="expected_attention", budget=16, page_size=8),
        tokenizer=tokenizer,
        mesh="data=1,model=1",
    )
  state = kvjax.prefill(model, ["abc"], tokenizer=tokenizer, mesh="data=1,model=1")
  with pytest.raises(ValueError, match="sharded over a mesh"):
    kvjax.save_state(tmp_path / "s", state, model)
  # A sharded state with weights elsewhere is refused, not run across devices.
  with pytest.raises(ValueError, match="weights are on one device and the state's cache on"):
    kvjax.decode(tiny_llama(), state, 2)
  # Weights placed on a one-device mesh still serve a one-device cache.
  kvjax.prefill(model, ["abc"], tokenizer=tokenizer)


def test_blocks_round_trip():
  """Host views per shard: shard g = (i, j) holds row block i and head block j."""
  cache = types.SimpleNamespace(mesh=types.SimpleNamespace(shape={"data": 2, "model": 3}))
  x = np.arange(4 * 6 * 9 * 2).reshape(4, 6, 9, 2)  # [L, B, H, M]
  y = sharding.blocks(cache, x)
  assert y.shape == (6, 4, 3, 3, 2)
  np.testing.assert_array_equal(y[1 * 3 + 2], x[:, 3:6, 6:9])
  np.testing.assert_array_equal(sharding.unblocks(cache, y), x)


def test_llama_partition_rules():
  model = tiny_llama()
  assert model.partition(("layers", "0", "wq"), (32, 32)) == jax.sharding.PartitionSpec(
      None, "model"
  )
  assert model.partition(("layers", "0", "wo"), (32, 32)) == jax.sharding.PartitionSpec(
      "model", None
  )
  assert model.partition(("layers", "0", "attn_norm"), (32,)) is None
  assert model.partition(("embed",), (259, 32)) is None


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_two_processes_agree_with_one():
  """jax.distributed on localhost: 2 processes x 2 CPU devices run one generation sharded
  over a (2, 2) mesh; every process gets the tokens one device makes. In the default suite
  (tiny model, ~15 s): the multi-process path once broke unseen behind a slow mark."""
  out = subprocess.run(
      [
          sys.executable,
          str(ROOT / "examples" / "multihost.py"),
          "--local-processes",
          "2",
          "--port",
          str(_free_port()),
          "--mesh",
          "data=2,model=2",
          "--check",
      ],
      capture_output=True,
      text=True,
      timeout=300,
      cwd=ROOT,
  )
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
  agreed = [line for line in out.stdout.splitlines() if "agrees with one device" in line]
  assert len(agreed) == 2, out.stdout
