"""Directories of learned parameters (`kvjax_store.files.write_params` / `read_params`: the learned
scorer, head allocations, `kvjax tune`): overwritten in one step, so a reader finds the old
directory or the new one, whole, at every moment and after a crash at any step."""

import os
import pathlib
import shutil
import threading

import numpy as np
import pytest

from kvjax_store import files as _files

# orbax leaves an asyncio callback behind when a read of a directory being replaced fails.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

FMT = "kvjax-test-params/1"
SHAPES = {"x": ((2048,), "float32"), "y": ((4, 4), "int32")}  # what `_write` writes


def _write(path, i: int, **kwargs):
  params = {"x": np.full(2048, i, np.float32), "y": np.full((4, 4), i, np.int32)}
  return _files.write_params(path, params, {"format": FMT, "i": i}, **kwargs)


def _read(path) -> int:
  """Which writing `path` holds; AssertionError if its parts come from two."""
  params, meta = _files.read_params(
      path, what="test artefact", fmt=FMT, expected=lambda meta, declared: SHAPES
  )
  i = meta["i"]
  assert (params["x"] == i).all() and (params["y"] == i).all(), (i, params["x"][:3])
  return i


def test_overwriting_shows_a_reader_the_old_or_the_new_directory_at_every_step(
    tmp_path, monkeypatch
):
  """After each filesystem step of an overwrite that touches the directory, a read finds
  the old or the new one, whole; a crash after any such step leaves one of them, and no
  hidden staging directory behind."""
  path = tmp_path / "p"
  _write(path, 0, overwrite=False)
  steps, crash_at = [], [None]

  def hooked(fn):
    def call(*args, **kwargs):
      out = fn(*args, **kwargs)
      if any(isinstance(a, (str, os.PathLike)) and pathlib.Path(a) == path for a in args):
        steps.append((fn.__name__, _read(path)))  # the old one or the new, never none
        if len(steps) == crash_at[0]:
          raise KeyboardInterrupt  # as a kill would stop it here
      return out

    return call

  monkeypatch.setattr(os, "rename", hooked(os.rename))
  monkeypatch.setattr(os, "replace", hooked(os.replace))
  monkeypatch.setattr(shutil, "rmtree", hooked(shutil.rmtree))
  if hasattr(_files, "_exchange"):
    monkeypatch.setattr(_files, "_exchange", hooked(_files._exchange))
  _write(path, 1, overwrite=True)
  assert steps and all(i in (0, 1) for _, i in steps), steps
  assert _read(path) == 1
  held = 1
  for k in range(1, len(steps) + 1):
    steps.clear()
    crash_at[0] = k
    with pytest.raises(KeyboardInterrupt):
      _write(path, held + 1, overwrite=True)
    now = _read(path)
    assert now in (held, held + 1), (k, now)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]
    held = now
  crash_at[0] = None
  _write(path, 99, overwrite=True)
  assert _read(path) == 99


def test_a_reader_never_finds_the_directory_missing_or_mixed_during_overwrites(tmp_path):
  """A thread reads the directory and another checks that it exists, nonstop, while it is
  overwritten again and again."""
  path = tmp_path / "p"
  _write(path, 0, overwrite=False)
  stop, errors, counts = threading.Event(), [], {"reads": 0, "checks": 0}

  def read_loop():
    while not stop.is_set():
      try:
        _read(path)
        counts["reads"] += 1
      except Exception as err:  # noqa: BLE001 - every failure counts
        errors.append(f"{type(err).__name__}: {err}"[:300])

  def exists_loop():
    while not stop.is_set():
      if not os.path.isdir(path / "meta"):
        errors.append("no directory")
      counts["checks"] += 1

  threads = [threading.Thread(target=read_loop), threading.Thread(target=exists_loop)]
  for thread in threads:
    thread.start()
  try:
    for i in range(1, 16):
      _write(path, i, overwrite=True)
  finally:
    stop.set()
    for thread in threads:
      thread.join()
  assert errors == [], errors[:5]
  assert counts["reads"] > 0 and counts["checks"] > 0
  assert _read(path) == 15


def test_without_an_atomic_exchange_an_overwrite_renames_twice_and_readers_wait(
    tmp_path, monkeypatch
):
  """Where two names cannot be swapped in one step, the old directory goes aside and the
  new one in; a read that falls between the two waits for the new one."""
  monkeypatch.setattr(_files, "_exchange", lambda a, b: False, raising=False)
  path = tmp_path / "p"
  _write(path, 0, overwrite=False)
  _write(path, 1, overwrite=True)
  assert _read(path) == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["p"]
  aside = tmp_path / ".p.aside"
  os.rename(path, aside)  # between the two renames
  threading.Timer(0.01, os.rename, (aside, path)).start()
  assert _read(path) == 1
  shutil.rmtree(path)
  with pytest.raises(ValueError, match="is not a test artefact"):  # gone: no wait, an error
    _read(path)


def test_a_directory_written_meanwhile_is_not_replaced_without_overwrite(tmp_path, monkeypatch):
  """Another process writes `path` while this one stages: without overwrite=True this
  writing fails, and theirs stays."""
  import orbax.checkpoint as ocp

  path = tmp_path / "p"
  save, theirs = ocp.Checkpointer.save, []

  def theirs_first(self, directory, *args, **kwargs):
    if not theirs:
      theirs.append(directory)
      _write(path, 7, overwrite=False)
    return save(self, directory, *args, **kwargs)

  monkeypatch.setattr(ocp.Checkpointer, "save", theirs_first)
  with pytest.raises(FileExistsError, match="overwrite=True"):
    _write(path, 1, overwrite=False)
  monkeypatch.undo()
  assert _read(path) == 7 and sorted(p.name for p in tmp_path.iterdir()) == ["p"]


def _resave(path, params):
  """Directory `path` rewritten by orbax with `params` (its meta kept): a hand-made one."""
  import orbax.checkpoint as ocp

  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    meta = checkpointer.restore(path, ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  shutil.rmtree(path)
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    checkpointer.save(
        path,
        ocp.args.Composite(params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta)),
    )


def test_a_directory_declaring_other_arrays_is_refused_before_any_is_restored(
    tmp_path, monkeypatch
):
  """An array more (zeros: orbax writes no chunk of them, so a few KB on disk can declare
  gigabytes), a larger one, another dtype, one missing: refused from orbax's metadata,
  naming the array, before any array is restored."""
  import orbax.checkpoint as ocp

  good = {"x": np.full(2048, 1, np.float32), "y": np.full((4, 4), 1, np.int32)}
  cases = {
      "more": ({**good, "junk": np.zeros(2**20, np.float32)}, "unexpected array 'junk'"),
      "larger": ({**good, "x": np.zeros(4096, np.float32)}, r"array 'x' is float32 \(4096,\)"),
      "dtype": ({**good, "y": good["y"].astype(np.int64)}, "array 'y' is int64"),
      "missing": ({"x": good["x"]}, "array 'y' is missing"),
  }
  for name, (params, _) in cases.items():
    _write(tmp_path / name, 1, overwrite=False)
    _resave(tmp_path / name, params)
  restored = []
  restore = ocp.Checkpointer.restore

  def spy(checkpointer, directory, args=None, *rest, **kwargs):
    restored.extend(k for k in (args.keys() if args is not None else ()) if k != "meta")
    return restore(checkpointer, directory, args, *rest, **kwargs)

  monkeypatch.setattr(ocp.Checkpointer, "restore", spy)
  for name, (_, message) in cases.items():
    with pytest.raises(ValueError, match=message):
      _read(tmp_path / name)
  assert restored == []  # refused from the metadata alone
  _write(tmp_path / "good", 3, overwrite=False)
  assert _read(tmp_path / "good") == 3 and restored == ["params"]


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_a_written_directory_is_private_whatever_the_umask(tmp_path, umask):
  """Files 0600 and directories 0700, the parents `write_params` makes included, under
  umask 022 (before: 0644 and 0755) and 000; an overwrite keeps the rule."""
  old = os.umask(umask)
  try:
    path = _write(tmp_path / "made" / "p", 0, overwrite=False)
    _write(path, 1, overwrite=True)
  finally:
    os.umask(old)
  modes = {
      str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777)
      for p in [tmp_path / "made", *(tmp_path / "made").rglob("*")]
  }
  loose = {p: m for p, m in modes.items() if m != ("0o700" if (tmp_path / p).is_dir() else "0o600")}
  assert not loose, loose
  assert _read(path) == 1


@pytest.mark.parametrize("planted", ["link to a directory", "dangling link", "file"])
def test_a_link_or_file_planted_at_the_path_is_replaced_never_followed(tmp_path, planted):
  """A shared output directory may hold a link someone else planted where a directory of
  parameters goes (`kvjax tune`'s `allocation/`): without overwrite it is refused, with
  overwrite it is replaced by the directory, and what it pointed at is left alone."""
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "theirs").write_text("not kvjax's\n")
  path = tmp_path / "out" / "allocation"
  path.parent.mkdir()
  if planted == "file":
    path.write_text("a file\n")
  else:
    path.symlink_to(outside if planted == "link to a directory" else tmp_path / "nowhere")
  with pytest.raises(FileExistsError, match="overwrite=True"):
    _write(path, 1, overwrite=False)
  _write(path, 2, overwrite=True)
  assert path.is_dir() and not path.is_symlink() and _read(path) == 2
  assert sorted(p.name for p in outside.iterdir()) == ["theirs"]
  assert (outside / "theirs").read_text() == "not kvjax's\n"
