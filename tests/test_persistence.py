"""Saved states (`kvjax.save_state` / `load_state`): round trips in another process, only
live pages on disk, refusal of anything that is not exactly what was saved, and crashes
while saving that leave the old state or the new one."""

import dataclasses
import json
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import kvjax
from kvjax import persistence
from kvjax.persistence import _directory, _format, _load, _save
from kvjax.eviction.allocation import HeadAllocation
from kvjax.fingerprint import model_fingerprint
from kvjax.testing import ByteTokenizer, assert_cache_invariants, tiny_llama
from kvjax_store.files import arrays_digest

# orbax leaves an asyncio callback behind when a restore of damaged files fails.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

SPECS = {
    "full": kvjax.CompressionSpec(),
    # A policy with an option: saved spelled out, loaded as the same policy.
    "h2o": kvjax.CompressionSpec(policy="h2o:decay=0.9", budget=48, sink=2),
    "kvzip": kvjax.CompressionSpec(policy="kvzip", budget=0.25, sink=2),
    # Quantized pages: codes and scales are saved as they are, and load as they were (int4
    # pages are the same arrays with another kv_dtype; kept out to bound the suite's time).
    "h2o-int8": kvjax.CompressionSpec(policy="h2o", budget=48, sink=2, kv_dtype="int8"),
}
# The model both processes build: same seed, same weights.
MODEL = dict(max_context=512, qk_scale=20.0)
CONTEXT = np.random.default_rng(0).integers(3, 250, 300).tolist()


@pytest.fixture(scope="module")
def model():
  return tiny_llama(**MODEL)


@pytest.fixture(scope="module")
def states(model):
  return {name: kvjax.prefill(model, [CONTEXT], spec) for name, spec in SPECS.items()}


def info_dtype(state):
  """The K/V dtype a state's spec asked for (the model's float32 by default)."""
  return state.plan.spec.kv_dtype or "float32"


def _saved_arrays(path) -> dict:
  """The arrays of the state saved at `path`, as orbax holds them (no checks)."""
  import orbax.checkpoint as ocp

  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    restored = checkpointer.restore(
        persistence.current_version(path), ocp.args.Composite(arrays=ocp.args.StandardRestore())
    )
  return {name: np.asarray(x) for name, x in restored["arrays"].items()}


def _one_line_error(err: pytest.ExceptionInfo, *words: str):
  message = str(err.value)
  assert "\n" not in message, message
  for word in words:
    assert word in message, message


def test_a_loaded_state_equals_the_saved_one_and_holds_only_its_live_pages(model, states, tmp_path):
  for name, state in states.items():
    path = kvjax.save_state(tmp_path / name, state, model, tokens=[CONTEXT], info={"n": 1})
    loaded = kvjax.load_state(path, model)
    assert_cache_invariants(loaded.cache)
    assert loaded.plan == state.plan and loaded.cache.num_pages == state.cache.num_pages
    assert loaded.kv_bytes() == state.kv_bytes()
    assert loaded.cache.kv_dtype == state.cache.kv_dtype == info_dtype(state)
    for a, b in zip(jax.tree.leaves(loaded.cache.k_pages), jax.tree.leaves(state.cache.k_pages)):
      assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(loaded.logits, state.logits)
    np.testing.assert_array_equal(loaded.cache.length, state.cache.length)
    info = kvjax.state_info(path)
    assert info["tokens"] == [CONTEXT] and info["info"] == {"n": 1}
    live = int(np.asarray(state.cache.pages_in_use()).sum())
    assert info["cache"]["live_pages"] == live < state.cache.num_pages - 1
    # Only the live pages are written: the K/V arrays on disk hold `live` pages.
    arrays = _saved_arrays(path)
    saved_k = [x for key, x in arrays.items() if key.split(".")[0] == "k_pages"]
    assert [x.shape for x in saved_k] == [
        (live, *x.shape[1:]) for x in jax.tree.leaves(state.cache.k_pages)
    ]
    # Each sequence's live tokens, in order, are the saved state's.
    for layer, row, head in [(0, 0, 0), (1, 0, 1)]:
      for a, b in zip(
          kvjax.read_sequence(loaded.cache, layer, row, head),
          kvjax.read_sequence(state.cache, layer, row, head),
      ):
        np.testing.assert_array_equal(a, b)


def test_a_state_loads_with_its_own_kv_dtype_and_refuses_another(model, states, tmp_path):
  path = kvjax.save_state(tmp_path / "int8", states["h2o-int8"], model)
  assert kvjax.load_state(path, model, kv_dtype="int8").cache.kv_dtype == "int8"
  with pytest.raises(kvjax.StateFileError) as err:
    kvjax.load_state(path, model, kv_dtype="float32")
  _one_line_error(err, "int8", "kv_dtype='float32'", "saved with")
  with pytest.raises(ValueError, match="kv_dtype must be one of"):
    kvjax.load_state(path, model, kv_dtype="int3")
  # On disk: the codes and float16 scales, about a third of float32's bytes at head_dim 8.
  assert kvjax.state_info(path)["cache"]["kv_dtype"] == "int8"


def test_a_compressed_state_takes_its_share_of_the_full_cache_on_disk(model, states, tmp_path):
  def kv_on_disk(name):
    path = kvjax.save_state(tmp_path / name, states[name], model)
    files = (persistence.current_version(path) / "arrays").rglob("*")
    return sum(f.stat().st_size for f in files if f.is_file())

  # kvzip keeps 25% of the tokens: its state is well under half the full cache's on disk
  # (what remains above 25% is partly filled pages and orbax's per-array metadata).
  assert kv_on_disk("kvzip") < 0.5 * kv_on_disk("full")


_CONTINUE = """
import json, sys
import kvjax
from kvjax.testing import tiny_llama
model = tiny_llama(**json.loads(sys.argv[1]))
out = {}
for name in sys.argv[3:]:
  state = kvjax.load_state(f"{sys.argv[2]}/{name}", model)
  state = kvjax.extend(model, state, [[5, 6, 7, 8]])
  out[name] = kvjax.decode(model, state, 12)[1].tokens
print(json.dumps(out))
"""


@pytest.mark.slow  # a second process; a state loaded in this one equals the saved one (above)
def test_a_state_saved_here_continues_identically_in_another_process(model, states, tmp_path):
  expected = {}
  for name, state in states.items():
    kvjax.save_state(tmp_path / name, state, model)
    state = kvjax.extend(model, state, [[5, 6, 7, 8]])
    expected[name] = kvjax.decode(model, state, 12)[1].tokens
  out = subprocess.run(
      [sys.executable, "-c", _CONTINUE, json.dumps(MODEL), str(tmp_path), *states],
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert json.loads(out.stdout.splitlines()[-1]) == expected


def test_a_state_is_refused_by_another_model_dtype_tokenizer_or_format(
    model, states, tmp_path, monkeypatch
):
  state = states["h2o"]
  path = kvjax.save_state(tmp_path / "s", state, model, tokenizer=ByteTokenizer())
  with pytest.raises(kvjax.StateFileError) as err:
    kvjax.load_state(path, tiny_llama(**MODEL, seed=1))
  _one_line_error(err, "other weights")
  with pytest.raises(kvjax.StateFileError) as err:
    kvjax.load_state(path, tiny_llama(**MODEL, n_layers=3))
  _one_line_error(err, "3 n_layers")
  with pytest.raises(kvjax.StateFileError) as err:
    kvjax.load_state(path, tiny_llama(**MODEL, dtype="bfloat16"))
  _one_line_error(err, "float32 model", "bfloat16")

  class OtherTokenizer(ByteTokenizer):
    eos_ids = (1,)

  with pytest.raises(kvjax.StateFileError) as err:
    kvjax.load_state(path, model, tokenizer=OtherTokenizer())
  _one_line_error(err, "another tokenizer")
  kvjax.load_state(path, model, tokenizer=ByteTokenizer())  # the right one loads
  monkeypatch.setattr(_format, "FORMAT", "kvjax-state/0")
  old = kvjax.save_state(tmp_path / "old", state, model)
  monkeypatch.undo()
  with pytest.raises(kvjax.StateFileError) as err:
    kvjax.load_state(old, model)
  _one_line_error(err, "kvjax-state/0", persistence.FORMAT)


def test_damaged_checkpoints_are_refused_never_loaded(model, states, tmp_path):
  state = states["kvzip"]
  rng = random.Random(0)
  damages = []
  for trial in range(6):  # bytes flipped at random places of the metadata
    path = kvjax.save_state(tmp_path / f"flip{trial}", state, model)
    meta = next(f for f in (persistence.current_version(path) / "meta").rglob("*") if f.is_file())
    data = bytearray(meta.read_bytes())
    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    meta.write_bytes(bytes(data))
    damages.append(path)
  path = kvjax.save_state(tmp_path / "truncated", state, model)
  files = [f for f in (persistence.current_version(path) / "arrays").rglob("*") if f.is_file()]
  largest = max(files, key=lambda f: f.stat().st_size)
  largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
  damages.append(path)
  path = kvjax.save_state(tmp_path / "pointer", state, model)
  (path / _directory.CURRENT).write_text("../elsewhere")
  damages.append(path)
  (tmp_path / "empty").mkdir()
  damages.append(tmp_path / "empty")
  for path in damages:
    with pytest.raises(kvjax.StateFileError) as err:
      kvjax.load_state(path, model)
    _one_line_error(err, str(path.name))


def test_saving_refuses_to_overwrite_or_write_into_other_files(model, states, tmp_path):
  path = kvjax.save_state(tmp_path / "s", states["full"], model)
  with pytest.raises(FileExistsError, match="overwrite=True"):
    kvjax.save_state(path, states["h2o"], model)
  kvjax.save_state(path, states["h2o"], model, overwrite=True)
  assert kvjax.state_info(path)["spec"]["policy"] == "h2o:decay=0.9"
  # The version replaced stays until the next save (a reader may have just read its name).
  assert sorted(p.name for p in path.iterdir()) == [".lock", "CURRENT", "v1", "v2"]
  kvjax.save_state(path, states["kvzip"], model, overwrite=True)
  assert sorted(p.name for p in path.iterdir()) == [".lock", "CURRENT", "v2", "v3"]  # v1 gone
  (tmp_path / "mine").mkdir()
  (tmp_path / "mine" / "notes.txt").write_text("keep me")
  with pytest.raises(FileExistsError, match="other files"):
    kvjax.save_state(tmp_path / "mine", states["full"], model)
  with pytest.raises(ValueError, match="tokens must be the ids"):
    kvjax.save_state(tmp_path / "t", states["full"], model, tokens=[CONTEXT[:-1]])
  with pytest.raises(TypeError, match="JSON"):
    kvjax.save_state(tmp_path / "t", states["full"], model, info={"x": object()})


@pytest.mark.parametrize("crash_at", ["orbax", "pointer", "cleanup"])
def test_a_save_that_fails_part_way_leaves_the_old_state_or_the_new(
    model, states, tmp_path, monkeypatch, crash_at
):
  path = kvjax.save_state(tmp_path / "s", states["full"], model)
  crashed = []

  def crash(*args, **kwargs):
    crashed.append(sorted(p.name for p in path.iterdir()))
    raise KeyboardInterrupt  # as a kill would stop it, between two steps

  async def crash_in_orbax(*args, **kwargs):
    crash()

  from orbax.checkpoint._src.path import async_path

  target = {
      # orbax's last step, renaming its complete temporary directory: inside orbax's save
      "orbax": (async_path, "rename", crash_in_orbax),
      "pointer": (_save.files, "write_text", crash),  # complete, CURRENT not switched
      "cleanup": (_save, "remove_stale", crash),  # switched, the old version still there
  }[crash_at]
  monkeypatch.setattr(*target)
  with pytest.raises(KeyboardInterrupt):
    kvjax.save_state(path, states["h2o"], model, overwrite=True)
  monkeypatch.undo()
  # The crash came where it is named: orbax's temporary directory written, or v2 complete.
  leftover = {"orbax": "v2.orbax-checkpoint-tmp", "pointer": "v2", "cleanup": "v2"}[crash_at]
  assert crashed == [[".lock", "CURRENT", "v1", leftover]]
  expected = "h2o" if crash_at == "cleanup" else "full"
  loaded = kvjax.load_state(path, model)
  assert loaded.spec.policy.name == expected
  kvjax.save_state(path, states["kvzip"], model, overwrite=True)  # and saving goes on
  assert kvjax.load_state(path, model).spec.policy.name == "kvzip"
  # What the crash left is gone; the version CURRENT named before the last save stays.
  previous = "v2" if crash_at == "cleanup" else "v1"
  assert sorted(p.name for p in path.iterdir()) == [".lock", "CURRENT", previous, "v3"]


_SAVE_FOREVER = """
import json, sys
import kvjax
from kvjax.testing import tiny_llama
model = tiny_llama(**json.loads(sys.argv[1]))
ids = json.loads(sys.argv[3])
states = [kvjax.prefill(model, [ids[:n]], kvjax.CompressionSpec()) for n in (200, 300)]
kvjax.save_state(sys.argv[2], states[0], model, overwrite=True)
print("ready", flush=True)
i = 1
while True:
  kvjax.save_state(sys.argv[2], states[i % 2], model, overwrite=True)
  i += 1
"""


def _kill_while_saving(tmp_path, model, trials: int):
  references = {
      n: kvjax.prefill(model, [CONTEXT[:n]], kvjax.CompressionSpec()).logits for n in (200, 300)
  }
  rng = random.Random(1)
  seen = set()
  for trial in range(trials):
    path = tmp_path / f"trial{trial}"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SAVE_FOREVER, json.dumps(MODEL), str(path), json.dumps(CONTEXT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
      assert proc.stdout.readline().strip() == "ready"
      time.sleep(rng.uniform(0.0, 1.5))
    finally:
      os.kill(proc.pid, signal.SIGKILL)
      proc.wait()
    loaded = kvjax.load_state(path, model)  # the old state or the new one, never neither
    n = int(loaded.position[0])
    np.testing.assert_array_equal(loaded.logits, references[n])
    seen.add(n)
  return seen


def test_killing_a_process_while_it_saves_leaves_a_state_that_loads(model, tmp_path):
  _kill_while_saving(tmp_path, model, trials=3)


@pytest.mark.slow
def test_twenty_kills_while_saving_each_leave_the_old_or_the_new_state(model, tmp_path):
  assert _kill_while_saving(tmp_path, model, trials=20) == {200, 300}


@pytest.mark.slow  # heavy: run with -m slow
def test_cli_prefill_saves_a_state_that_ask_answers_from(tmp_path):
  """The real model, end to end: a context saved once, two questions answered from the
  saved state in another process (identical answers before and after saving are checked
  by the tiny-model round trip above and by `benchmarks.persistence`)."""
  context = tmp_path / "context.txt"
  context.write_text("My name is Ada and my cat is called Pixel. " * 4)
  save = tmp_path / "state"
  run = lambda *argv: subprocess.run(  # noqa: E731
      [sys.executable, "-m", "kvjax.cli", *argv], capture_output=True, text=True, timeout=600
  )
  out = run("prefill", "--context", str(context), "--save", str(save), "--json")
  assert out.returncode == 0, out.stderr
  stats = json.loads(out.stdout)["stats"]
  assert stats["context_tokens"] > 40 and stats["disk_bytes"] > 0
  questions = tmp_path / "q.jsonl"
  questions.write_text(
      "\n".join(json.dumps({"question": q}) for q in ["What is my cat called?", "Who am I?"])
  )
  out = run("ask", str(save), "--jsonl", str(questions), "--json", "--max-new-tokens", "12")
  assert out.returncode == 0, out.stderr
  answers = [json.loads(line) for line in out.stdout.splitlines()]
  assert [a["question"] for a in answers] == ["What is my cat called?", "Who am I?"]
  assert "Pixel" in answers[0]["answer"]
  assert all(a["load_seconds"] > 0 and a["answer_seconds"] > 0 for a in answers)
  assert "loaded the state of" in out.stderr
  out = run("prefill", "--context", str(context), "--save", str(save))
  assert out.returncode == 2 and "--overwrite" in out.stderr


@pytest.mark.slow  # two model loads in subprocesses
def test_weights_are_converted_once_and_read_back_from_the_cache(tmp_path, monkeypatch):
  """The default model: the first load stores its converted weights, a later load reads
  them (same parameters, same tokenizer); a damaged entry is converted again."""
  import jax

  from models import registry, weight_cache
  from kvjax_store.cache_dir import private_dir
  from models.llama import load_llama

  monkeypatch.setenv("KVJAX_CACHE_DIR", str(tmp_path))
  calls = []
  convert = registry._convert
  monkeypatch.setattr(registry, "_convert", lambda src: calls.append(src) or convert(src))
  first, tok_first = load_llama()
  second, tok_second = load_llama()
  assert len(calls) == 1  # converted once
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
    np.testing.assert_array_equal(a, b)
  text = "Hello wörld, 日本語 🙂 <|im_end|>"
  assert tok_first.encode(text) == tok_second.encode(text)
  assert tok_first.chat_template == tok_second.chat_template
  assert tok_first.eos_ids == tok_second.eos_ids
  # Where `load_model` keeps them: the private `weights` directory of the cache.
  entry = weight_cache.entry_dir(private_dir("weights"), registry.resolve_model())
  files = [f for f in (entry / "params").rglob("*") if f.is_file()]
  largest = max(files, key=lambda f: f.stat().st_size)
  largest.write_bytes(largest.read_bytes()[:100])
  with pytest.warns(UserWarning, match="damaged weight cache"):
    third, _ = load_llama()
  assert len(calls) == 2
  np.testing.assert_array_equal(third.embed[...], first.embed[...])


def test_the_persistence_api_rejects_what_is_not_a_state_or_a_model(model, states, tmp_path):
  with pytest.raises(TypeError, match="state must be a kvjax.State"):
    kvjax.save_state(tmp_path / "s", {"cache": None}, model)
  with pytest.raises(TypeError, match="is not a kvjax model"):
    kvjax.save_state(tmp_path / "s", states["full"], object())
  path = kvjax.save_state(tmp_path / "s", states["full"], model)
  with pytest.raises(TypeError, match="is not a kvjax model"):
    kvjax.load_state(path, object())
  with pytest.raises(TypeError, match="info must be a dict"):
    kvjax.save_state(tmp_path / "t", states["full"], model, info=["x"])


# ---- a state directory under concurrent use ------------------------------------------------


def _listing(path) -> list[str]:
  return sorted(p.name for p in pathlib.Path(path).iterdir())


def _whole(state) -> str:
  """A digest of everything a state holds (its live pages in table order and its small
  arrays): equal for a state and the same state saved and loaded."""
  return arrays_digest(_format.live_arrays(state))


def test_a_state_keeps_its_head_allocation_made_in_memory_or_saved_and_removed(
    model, states, tmp_path
):
  """The allocation is stored by value: one made in memory (no directory) and one whose
  directory was removed after the save both load with the state."""
  offsets = np.random.default_rng(3).normal(0, 1.5, (2, 2)).astype(np.float32)
  allocation = HeadAllocation(
      offsets=offsets,
      policy="kvzip",
      log_scores=True,
      scale=2.0,
      model="tiny",
      fingerprint=model_fingerprint(model),
  )
  base = states["kvzip"]
  for name, alloc in [("memory", allocation), ("saved", allocation.save(tmp_path / "alloc"))]:
    # The kvzip state with the allocation in its spec (what it kept does not matter here:
    # the spec is what must survive).
    spec = base.spec.replace(allocation=alloc)
    state = dataclasses.replace(base, plan=dataclasses.replace(base.plan, spec=spec))
    path = kvjax.save_state(tmp_path / name, state, model)
    if name == "saved":
      shutil.rmtree(tmp_path / "alloc")
    loaded = kvjax.load_state(path, model)
    assert loaded.spec.allocation == allocation and loaded.plan == state.plan
    np.testing.assert_array_equal(loaded.spec.allocation.offsets, offsets)
    assert loaded.spec.allocation.path == alloc.path
    assert _whole(loaded) == _whole(state)


def test_a_reader_whose_version_two_saves_removed_follows_current(
    model, states, tmp_path, monkeypatch
):
  """A slow reader: saves complete between its reading the metadata and the arrays. One
  save keeps the version it reads (it returns that state); two remove it (it reads the
  newest instead); saves during every attempt make it give up, saying so, after a few."""
  path = kvjax.save_state(tmp_path / "s", states["full"], model)
  read_arrays, saves, attempts = _load.read_arrays, [], []

  def slow_read(version, *args):
    attempts.append(version.name)
    for name in saves.pop(0) if saves else ():
      kvjax.save_state(path, states[name], model, overwrite=True)
    return read_arrays(version, *args)

  monkeypatch.setattr(_load, "read_arrays", slow_read)
  saves[:] = [["h2o"]]
  loaded = kvjax.load_state(path, model)  # v1, kept by the save of v2
  assert attempts == ["v1"] and _whole(loaded) == _whole(states["full"])
  saves[:] = [["full", "kvzip"]]  # v3 and v4 remove v2 while it is read
  loaded = kvjax.load_state(path, model)
  assert attempts[1:] == ["v2", "v4"] and _whole(loaded) == _whole(states["kvzip"])
  saves[:] = [["h2o", "full"]] * _directory.READ_ATTEMPTS
  with pytest.raises(kvjax.StateFileError) as err:
    kvjax.load_state(path, model)
  _one_line_error(err, f"saved again {_directory.READ_ATTEMPTS} times")
  assert _whole(kvjax.load_state(path, model)) == _whole(states["full"])


_FIRST_SAVE_KILLED = """
import json, os, sys, time
import kvjax
from kvjax.testing import tiny_llama
model = tiny_llama(**json.loads(sys.argv[1]))
target, point = sys.argv[2], sys.argv[3]
state = kvjax.load_state(sys.stdin.readline().strip(), model)  # sent once we have imported

def stop():
  print(json.dumps(sorted(os.listdir(target))), flush=True)  # the parent kills us here
  time.sleep(600)

if point == "orbax writing":  # the metadata item, while the arrays are being written
  import orbax.checkpoint as ocp
  async def async_save(*args, **kwargs):
    stop()
  ocp.JsonCheckpointHandler.async_save = async_save
elif point == "orbax renaming":  # its temporary directory complete
  from orbax.checkpoint._src.path import async_path
  async def rename(*args, **kwargs):
    stop()
  async_path.rename = rename
elif point == "CURRENT renaming":  # v1 complete, CURRENT's temporary written
  replace = os.replace
  def hooked(src, dst, *args, **kwargs):
    if os.path.basename(dst) == "CURRENT":
      stop()
    return replace(src, dst, *args, **kwargs)
  os.replace = hooked
kvjax.save_state(target, state, model)
print("saved", flush=True)
"""


def test_a_first_save_killed_anywhere_leaves_a_directory_the_next_save_uses(
    model, states, tmp_path
):
  """SIGKILL at three points of a first save (each in its own process, all at once); then a
  save into each directory succeeds, loads, and has cleared what the killed one left."""
  leftovers = {
      "orbax writing": r"v1\.orbax-checkpoint-tmp.*",
      "orbax renaming": r"v1\.orbax-checkpoint-tmp.*",
      "CURRENT renaming": r"\.CURRENT\..+",
  }
  procs, logs = {}, [(tmp_path / f"err{i}").open("w") for i in range(len(leftovers))]
  try:
    for i, point in enumerate(leftovers):
      procs[point] = subprocess.Popen(
          [
              sys.executable,
              "-c",
              _FIRST_SAVE_KILLED,
              json.dumps(MODEL),
              str(tmp_path / f"killed{i}"),
              point,
          ],
          stdin=subprocess.PIPE,
          stdout=subprocess.PIPE,
          stderr=logs[i],
          text=True,
      )
    source = kvjax.save_state(tmp_path / "source", states["h2o"], model)  # while they import
    for proc in procs.values():
      proc.stdin.write(f"{source}\n")
      proc.stdin.close()
    at_kill = {}
    for i, (point, proc) in enumerate(procs.items()):
      line = proc.stdout.readline()
      assert line.startswith("["), (point, line, (tmp_path / f"err{i}").read_text()[-3000:])
      os.kill(proc.pid, signal.SIGKILL)
      at_kill[point] = json.loads(line)
  finally:
    for proc in procs.values():
      proc.kill()
      proc.wait()
    for log in logs:
      log.close()
  for i, (point, pattern) in enumerate(leftovers.items()):
    target = tmp_path / f"killed{i}"
    # Killed where named: a temporary of orbax's or of CURRENT's is there, CURRENT is not.
    assert any(re.fullmatch(pattern, name) for name in _listing(target)), (point, at_kill)
    assert "CURRENT" not in _listing(target)
    with pytest.raises(kvjax.StateFileError, match="interrupted first save"):
      kvjax.load_state(target, model)
    kvjax.save_state(target, states["kvzip"], model)
    assert _whole(kvjax.load_state(target, model)) == _whole(states["kvzip"])
    assert _listing(target) == [".lock", "CURRENT", (target / "CURRENT").read_text().strip()]


_CONCURRENT = """
import collections, json, sys, time
import kvjax
from kvjax.persistence import _format, _load
from kvjax.testing import tiny_llama
from kvjax_store.files import arrays_digest
model = tiny_llama(**json.loads(sys.argv[1]))
role, target, seconds = sys.argv[2], sys.argv[3], float(sys.argv[4])
given = json.loads(sys.stdin.readline())  # sent once this process has imported all
if role == "reader":
  expected = given  # digest of each saved state -> its name
  read_meta, attempts = _load.read_meta, [0]
  def counting(version):
    attempts[0] += 1
    return read_meta(version)
  _load.read_meta = counting
else:
  states = [kvjax.load_state(source, model) for source in given]
done, errors, seen = 0, [], collections.Counter()
print("ready", flush=True)
sys.stdin.readline()
end = time.monotonic() + seconds
while time.monotonic() < end:
  try:
    if role == "reader":
      state = kvjax.load_state(target, model)
      digest = arrays_digest(_format.live_arrays(state))
      if digest not in expected:
        raise AssertionError("a state that no writer saved")
      seen[expected[digest]] += 1
    else:
      kvjax.save_state(target, states[done % 2], model, overwrite=True, info={"by": role})
    done += 1
  except Exception as err:
    errors.append(f"{type(err).__name__}: {err}"[:400])
out = {"done": done, "errors": errors, "seen": seen}
if role == "reader":
  out["attempts"] = attempts[0]
print(json.dumps(out), flush=True)
"""


def _two_writers_and_a_reader(model, states, tmp_path, seconds: float) -> dict:
  """Two processes save into one directory (each alternating two states of its own: this
  one and a child) while a third loads it, for `seconds`; each counts what it did and every
  error."""
  import jax

  target, roles = tmp_path / "shared", ("writer", "reader")
  procs, logs = {}, {role: (tmp_path / f"{role}.err").open("w") for role in roles}
  results = {}
  try:
    for role in roles:  # they import while this process prepares the states
      procs[role] = subprocess.Popen(
          [sys.executable, "-c", _CONCURRENT, json.dumps(MODEL), role, str(target), str(seconds)],
          stdin=subprocess.PIPE,
          stdout=subprocess.PIPE,
          stderr=logs[role],
          text=True,
      )
    # A fourth state: h2o's with another sampling key (another prefill would compile).
    other = dataclasses.replace(states["h2o"], key=jax.random.fold_in(states["h2o"].key, 1))
    sources = {}
    for name, state in [*states.items(), ("h2o, other key", other)]:
      sources[name] = kvjax.save_state(tmp_path / "sources" / name, state, model)
    expected = {_whole(kvjax.load_state(p, model)): name for name, p in sources.items()}
    assert len(expected) == len(states) + 1
    kvjax.save_state(target, states["full"], model)
    given = {"writer": [str(sources["kvzip"]), str(sources["h2o, other key"])], "reader": expected}
    for role, proc in procs.items():
      proc.stdin.write(json.dumps(given[role]) + "\n")
      proc.stdin.flush()
    for role, proc in procs.items():
      line = proc.stdout.readline()
      assert line.strip() == "ready", (role, (tmp_path / f"{role}.err").read_text()[-3000:])
    for proc in procs.values():  # all start together
      proc.stdin.write("go\n")
      proc.stdin.close()
    # The other writer is this process (one child less to start).
    mine, done, errors = [states["full"], states["h2o"]], 0, []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
      try:
        kvjax.save_state(target, mine[done % 2], model, overwrite=True)
        done += 1
      except Exception as err:  # noqa: BLE001 - every failure counts
        errors.append(f"{type(err).__name__}: {err}"[:400])
    results["writer (this process)"] = {"done": done, "errors": errors}
    for role, proc in procs.items():
      out = proc.stdout.read()  # each stops `seconds` after "go"
      assert proc.wait(timeout=60) == 0, (role, (tmp_path / f"{role}.err").read_text()[-3000:])
      results[role] = json.loads(out.splitlines()[-1])
  finally:
    for proc in procs.values():
      proc.kill()
      proc.wait()
    for log in logs.values():
      log.close()
  print(f"\n{seconds:.0f} s, two writers and a reader:", json.dumps(results))
  for role, result in results.items():
    assert result["errors"] == [], (role, result["errors"][:5])
    assert result["done"] > 0, (role, result)
  # Every read was a whole state that a writer saved (a digest of all its arrays); the
  # directory loads afterwards and holds CURRENT, the lock and two versions at most.
  assert sum(results["reader"]["seen"].values()) == results["reader"]["done"]
  assert _whole(kvjax.load_state(target, model)) in expected
  names = _listing(target)
  assert names[:2] == [".lock", "CURRENT"] and len(names) <= 4
  assert all(re.fullmatch(r"v\d+", name) for name in names[2:]), names
  return results


def test_two_writers_and_a_reader_share_a_state_directory(model, states, tmp_path):
  _two_writers_and_a_reader(model, states, tmp_path, seconds=2)


@pytest.mark.slow
def test_two_writers_and_a_reader_share_a_state_directory_for_thirty_seconds(
    model, states, tmp_path
):
  results = _two_writers_and_a_reader(model, states, tmp_path, seconds=30)
  assert len(results["reader"]["seen"]) == 4  # states of both writers were read
