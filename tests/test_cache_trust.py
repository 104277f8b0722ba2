"""kvjax's cache directory is trusted like code, so only this user's own, authenticated
entries are used (kvjax_store.cache_dir, kvjax.runtime.compilation, models.weight_cache)."""

import json
import os
import pathlib
import pickle
import stat
import subprocess
import sys
import warnings

import numpy as np
import pytest

import models
from kvjax.testing import tiny_hf_checkpoint
from kvjax_store import cache_dir as private_cache
from kvjax_store.cache_dir import private_dir
from models import weight_cache

ROOT = pathlib.Path(__file__).resolve().parents[1]


class _Plant:
  """A pickle that, when loaded, makes the directory `marker`: proof that code ran."""

  def __init__(self, marker):
    self.marker = str(marker)

  def __reduce__(self):
    return os.mkdir, (self.marker,)


@pytest.fixture
def private(tmp_path, monkeypatch):
  """An empty cache root and a key of this test's own; warnings said again."""
  monkeypatch.setenv("KVJAX_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setenv("KVJAX_CACHE_KEY_FILE", str(tmp_path / "config" / "cache.key"))
  monkeypatch.setattr(private_cache, "_WARNED", set())
  return tmp_path / "cache"


def _run(env) -> dict:
  out = subprocess.run(
      [sys.executable, str(ROOT / "tests" / "cache_trust_run.py"), env["CHECKPOINT"]],
      capture_output=True,
      text=True,
      timeout=600,
      env=env,
      cwd=ROOT,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert "Traceback" not in out.stderr, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def _plant_everywhere(root: pathlib.Path, marker: pathlib.Path) -> int:
  """Every file under `root` replaced by a pickle that runs code when loaded (the decode
  step's store entry as a well-formed header in front of it, with a made-up tag)."""
  payload = pickle.dumps(_Plant(marker))
  planted = 0
  for path in root.rglob("*"):
    if path.is_file():
      if path.name.startswith("_decode-"):
        header = {"format": "kvjax-executable-2", "size": len(payload), "tag": "0" * 64}
        path.write_bytes(json.dumps(header).encode() + b"\n" + payload)
      else:
        path.write_bytes(payload)
      planted += 1
  return planted


def _populated(tmp_path):
  """A cache populated by a fresh process: (root, marker, env, that process's report)."""
  root, marker = tmp_path / "cache", tmp_path / "code-ran"
  env = {
      **os.environ,
      "KVJAX_CACHE_DIR": str(root),
      "KVJAX_CACHE_KEY_FILE": str(tmp_path / "cache.key"),
      "CHECKPOINT": str(tiny_hf_checkpoint(tmp_path / "ckpt")),
  }
  first = _run(env)
  assert first["loaded"] == 0 and first["jax_cache_hits"] == 0 and not first["warnings"]
  assert list((root / "executables").glob("*.bin")) and list((root / "jax").iterdir())
  assert list((root / "weights").iterdir())
  return root, marker, env, first


def test_a_pickle_planted_in_every_cache_file_runs_nothing(tmp_path):
  """Fresh processes: a populated cache (executables, JAX's cache, converted weights) whose
  every file is replaced by a code-running pickle runs nothing and gives the same tokens and
  weights; the entries are rebuilt, authenticated, and loaded by the next process."""
  root, marker, env, first = _populated(tmp_path)

  assert _plant_everywhere(root, marker) > 10
  planted = _run(env)
  assert not marker.exists(), "a planted pickle ran"
  assert planted["tokens"] == first["tokens"] and planted["weights"] == first["weights"]
  assert planted["loaded"] == 0 and planted["jax_cache_hits"] == 0
  assert any("weight cache" in w for w in planted["warnings"])  # converted again, said so

  rebuilt = _run(env)
  assert rebuilt["loaded"] == 2 and rebuilt["jax_cache_hits"] >= 2
  assert rebuilt["tokens"] == first["tokens"]
  assert not rebuilt["warnings"]


@pytest.mark.slow  # ~12 s more: a third fresh process
def test_a_planted_cache_made_world_writable_is_not_used_at_all(tmp_path):
  """The root of a populated cache made world-writable, every file planted: not used at all
  (one warning naming it), nothing runs, nothing in it is touched."""
  root, marker, env, first = _populated(tmp_path)
  _plant_everywhere(root, marker)
  root.chmod(0o777)
  before = sorted((p, p.stat().st_mtime_ns) for p in root.rglob("*"))
  shared = _run(env)
  assert not marker.exists(), "a planted pickle ran"
  assert shared["tokens"] == first["tokens"] and shared["weights"] == first["weights"]
  assert shared["loaded"] == 0 and shared["jax_cache_hits"] == 0
  said = [w for w in shared["warnings"] if str(root) in w]
  assert len(said) == 1 and "writable by others" in said[0], shared["warnings"]
  assert sorted((p, p.stat().st_mtime_ns) for p in root.rglob("*")) == before  # untouched


def test_cache_directories_are_made_private(private):
  assert private_dir("executables") == private / "executables"
  for path in (private, private / "executables"):
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
  key = private_cache.key_file()
  assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_bytes()) == 32
  assert stat.S_IMODE(key.parent.stat().st_mode) == 0o700


@pytest.mark.parametrize(
    "where, mode, reason",
    [
        ("", 0o770, "writable by its group"),
        ("", 0o707, "writable by others"),
        ("executables", 0o777, "writable by others"),
    ],
)
def test_a_cache_directory_others_can_write_is_not_used(private, where, mode, reason):
  (private / "executables").mkdir(parents=True)
  (private / where).chmod(mode)
  with pytest.warns(
      UserWarning, match=f"not using the cache directory {private / where}.*{reason}"
  ):
    assert private_dir("executables") is None
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # said once per process
    assert private_dir("executables") is None
  assert (private_dir() is None) == (where == "")  # the root alone may still be fine


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory away needs root")
def test_a_cache_directory_of_another_user_is_not_used(private):
  private.mkdir(mode=0o700)
  os.chown(private, 4242, -1)
  with pytest.warns(UserWarning, match="belongs to another user"):
    assert private_dir() is None


def test_a_key_others_can_read_is_not_used(private):
  key = private_cache.key_file()
  key.parent.mkdir(mode=0o700)
  key.write_bytes(os.urandom(32))
  key.chmod(0o644)
  with pytest.warns(UserWarning, match="cache key .* cannot be used .*mode 644"):
    assert private_dir() is None
  assert "cannot be used" in private_cache.describe()


def test_the_cache_can_be_turned_off(monkeypatch):
  monkeypatch.setenv("KVJAX_CACHE_DIR", "off")
  assert private_dir() is None and private_cache.describe().startswith("off")


def test_converted_weights_are_keyed_on_the_source_content(private, tmp_path):
  """Same size and modification time, other bytes: converted again, never the old entry."""
  ckpt = tiny_hf_checkpoint(tmp_path / "ckpt")
  _, first, _ = models.load_model(ckpt)
  weights = private / "weights"
  assert len(list(weights.iterdir())) == 1
  tensors = ckpt / "model.safetensors"
  stat_before = tensors.stat()
  data = bytearray(tensors.read_bytes())
  data[-1] ^= 0x40  # a bit of the last weight
  tensors.write_bytes(bytes(data))
  os.utime(tensors, ns=(stat_before.st_atime_ns, stat_before.st_mtime_ns))
  assert tensors.stat().st_size == stat_before.st_size
  _, second, _ = models.load_model(ckpt)
  assert len(list(weights.iterdir())) == 2
  changed = [k for k in first if not np.array_equal(first[k], second[k])]
  assert len(changed) == 1


def test_converted_weights_another_key_wrote_are_converted_again(private, tmp_path, monkeypatch):
  """An entry with a valid digest but no tag of this user's key (someone else wrote it, with
  weights of their choice) is never read back."""
  ckpt = tiny_hf_checkpoint(tmp_path / "ckpt")
  source = models.resolve_model(ckpt)
  config, params, tokenizer = models.load_model(ckpt)
  entry = weight_cache.entry_dir(private / "weights", source)
  import shutil

  shutil.rmtree(entry)
  monkeypatch.setenv("KVJAX_CACHE_KEY_FILE", str(tmp_path / "theirs.key"))
  forged = {k: np.zeros_like(v) for k, v in params.items()}
  weight_cache.store(entry, source, config, forged, tokenizer)
  monkeypatch.setenv("KVJAX_CACHE_KEY_FILE", str(tmp_path / "config" / "cache.key"))
  with pytest.warns(UserWarning, match="not authenticated"):
    _, loaded, _ = models.load_model(ckpt)
  for k in params:
    np.testing.assert_array_equal(loaded[k], params[k])
  assert weight_cache.load(entry) is not None  # replaced by this user's own entry
