"""Saved states, scorers and head allocations that cannot hurt their reader: a hand-edited or
hostile directory (its digest recomputed, as anyone can) is refused with one
`StateFileError` naming the field, before a byte of an unexpected array is restored; what
kvjax writes is private; links are not followed. kvjax issue 45, findings 2, 3, 4, 6 and 9."""

import json
import os
import pathlib
import stat
import subprocess
import sys
import tempfile

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import kvjax
from kvjax import persistence
from kvjax.eviction.allocation import HeadAllocation
from kvjax.fingerprint import model_fingerprint
from kvjax.persistence import _format
from kvjax.policies.learned import Scorer
from kvjax.testing import assert_cache_invariants, tiny_llama

# orbax leaves an asyncio callback behind when a restore of damaged files fails.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

MODEL = dict(max_context=128, qk_scale=20.0)
PROMPT = [5, 17, 42, 9, 88, 23, 61, 7, 30, 12]  # 10 tokens, as the reproductions
SPECS = {
    "full": kvjax.CompressionSpec(),
    "h2o": kvjax.CompressionSpec(policy="h2o", budget=16, sink=2, page_size=4),
}


@pytest.fixture(scope="module")
def model():
  return tiny_llama(**MODEL)


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
  """A good saved state per spec (never edited: each test rewrites a copy)."""
  root = tmp_path_factory.mktemp("good")
  return {
      name: kvjax.save_state(
          root / name, kvjax.prefill(model, [PROMPT], spec), model, tokens=[PROMPT]
      )
      for name, spec in SPECS.items()
  }


def _read(version: pathlib.Path) -> tuple[dict, dict]:
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    restored = checkpointer.restore(
        version,
        ocp.args.Composite(meta=ocp.args.JsonRestore(), arrays=ocp.args.StandardRestore()),
    )
  return restored["meta"], {k: np.asarray(v) for k, v in restored["arrays"].items()}


def rewrite(source, target, edit, *, recompute_digest: bool = True) -> pathlib.Path:
  """A copy of the state at `source` in `target`, its metadata and arrays changed by
  `edit(meta, arrays)` and its digest recomputed: a state edited by hand, which the digest
  (a plain SHA-256) cannot tell from a saved one."""
  meta, arrays = _read(persistence.current_version(source))
  edit(meta, arrays)
  if recompute_digest:
    meta["digest"] = _format.digest(meta, arrays)
  target = pathlib.Path(target)
  target.mkdir(parents=True, exist_ok=True)
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    checkpointer.save(
        target / "v1",
        ocp.args.Composite(arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)),
    )
  (target / "CURRENT").write_text("v1\n")
  return target


class Restores:
  """Counts the bytes orbax restores of named arrays (an item other than JSON metadata)."""

  def __init__(self, monkeypatch):
    self.bytes = 0
    restore = ocp.Checkpointer.restore

    def counting(checkpointer, directory, args=None, *rest, **kwargs):
      out = restore(checkpointer, directory, args, *rest, **kwargs)
      for item in ("arrays", "params"):
        if args is not None and item in args:
          self.bytes += sum(np.asarray(x).nbytes for x in out[item].values())
      return out

    monkeypatch.setattr(ocp.Checkpointer, "restore", counting)


def _state_bytes(state) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(state))


def _refused(path, model, *words):
  """load_state and state_info both refuse `path` with one line holding `words`."""
  for read in (lambda: kvjax.load_state(path, model), lambda: kvjax.state_info(path)):
    with pytest.raises(kvjax.StateFileError) as err:
      read()
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


# ---- finding 2: small files that declare gigabytes ----------------------------------------


def test_an_extra_or_enlarged_array_is_refused_before_any_array_is_restored(
    model, saved, tmp_path, monkeypatch
):
  """A state with one more array (zeros: orbax writes no chunk of them, so it is a few
  KB on disk whatever it declares) or a larger one, with a valid digest: refused from
  orbax's metadata, before a byte is restored."""
  junk = lambda meta, arrays: arrays.update(junk=np.zeros(2**16, np.float32))  # noqa: E731

  def more_pages(meta, arrays):
    arrays["k_pages"] = np.concatenate([arrays["k_pages"], np.zeros_like(arrays["k_pages"])])

  paths = {
      name: rewrite(saved["full"], tmp_path / name, edit)
      for name, edit in [("junk", junk), ("pages", more_pages)]
  }
  restores = Restores(monkeypatch)
  _refused(paths["junk"], model, "unexpected array 'junk'")
  _refused(paths["pages"], model, "array 'k_pages'", "expected float32")
  assert restores.bytes == 0


@pytest.mark.parametrize("num_pages", [10**5, 2**33])
def test_a_pool_larger_than_the_state_can_use_is_refused_before_it_is_allocated(
    model, saved, tmp_path, monkeypatch, num_pages
):
  """num_pages with a valid digest: at most every sequence's page table full (+1 a head),
  refused before any array is read (it was 2.2 GB at 10**6, a MemoryError at 2**33)."""

  def edit(meta, arrays):
    meta["cache"]["num_pages"] = num_pages

  path = rewrite(saved["h2o"], tmp_path / "s", edit)
  restores = Restores(monkeypatch)  # from here: the loads' own restores
  _refused(path, model, "cache.num_pages", str(num_pages))
  assert restores.bytes == 0


def _scorer_dir(model, path) -> pathlib.Path:
  c = model.config
  rng = np.random.default_rng(0)
  weight = rng.normal(0, 0.1, (c.n_layers, c.d_model, c.n_kv_heads)).astype(np.float32)
  bias = np.zeros((c.n_layers, c.n_kv_heads), np.float32)
  Scorer(weight, bias, "tiny", model_fingerprint(model)).save(path)
  return path


def _rewrite_params(path, edit, name: str = "edited"):
  """A copy of directory `path` of `write_params` beside it (`path.name` + "." + `name`),
  with `edit(meta, params)` applied."""
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    restored = checkpointer.restore(
        path, ocp.args.Composite(meta=ocp.args.JsonRestore(), params=ocp.args.StandardRestore())
    )
  meta, params = restored["meta"], {k: np.asarray(v) for k, v in restored["params"].items()}
  edit(meta, params)
  edited = path.with_name(f"{path.name}.{name}")
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
    checkpointer.save(
        edited,
        ocp.args.Composite(params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta)),
    )
  return edited


def test_a_scorer_or_allocation_directory_declaring_more_is_refused_before_a_restore(
    model, tmp_path, monkeypatch
):
  """The learned scorer (`--policy learned --scorer DIR`) and a head allocation: an extra
  zero array, a larger weight (its meta agreeing), or a shape past any model's, refused
  from the directory's metadata; a good one still loads."""
  scorer = _scorer_dir(model, tmp_path / "scorer")
  allocation = HeadAllocation(
      np.zeros((2, 2), np.float32), "kvzip", True, 1.0, "tiny", model_fingerprint(model)
  ).save(tmp_path / "alloc")

  def junk(meta, params):
    params["junk"] = np.zeros(2**16, np.float32)

  def wider(meta, params):
    params["weight"] = np.zeros((2, 2**13, 2), np.float32)
    meta["hidden_size"] = 2**13  # consistent: refused by the cap only when past it

  def huge(meta, params):  # wider than any model's hidden state
    params["weight"] = np.zeros((1, 2**18, 1), np.float32)
    params["bias"] = np.zeros((1, 1), np.float32)
    meta.update(num_layers=1, hidden_size=2**18, num_kv_heads=1)

  hostile = {
      "junk": _rewrite_params(scorer, junk, "junk"),
      "huge": _rewrite_params(scorer, huge, "huge"),
      "allocation": _rewrite_params(pathlib.Path(allocation.path), junk, "junk"),
  }
  restores = Restores(monkeypatch)
  for name, words in [("junk", "unexpected array 'junk'"), ("huge", "hidden_size")]:
    with pytest.raises(ValueError, match=words):
      kvjax.CompressionSpec(policy="learned", budget=0.5, scorer=str(hostile[name]))
  with pytest.raises(ValueError, match="unexpected array 'junk'"):
    HeadAllocation.load(hostile["allocation"])
  assert restores.bytes == 0
  # A consistent, larger scorer within the caps is read (and refused later for its shape).
  edited = Scorer.load(_rewrite_params(scorer, wider, "wider"))
  assert edited.shape == (2, 2**13, 2) and restores.bytes > 0
  assert Scorer.load(scorer).shape == (2, model.config.d_model, 2)


# ---- finding 3: a hand-edited state, its digest recomputed ----------------------------------


def _set(path: str, value):
  """An edit setting meta field `path` ("plan.chunk", "plan.eviction.layer_budget.0")."""

  def edit(meta, arrays):
    *parents, last = path.split(".")
    node = meta
    try:
      for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
      if isinstance(node, list):
        node[int(last)] = value
      elif isinstance(node, dict) and last in node:
        node[last] = value
    except (KeyError, IndexError, TypeError):
      pass  # a field this state lacks (no eviction plan, fewer slots): left as saved

  return edit


def _share_a_page(meta, arrays):
  table = arrays["table"]  # [L, B, H, M]: head 1's first page becomes head 0's
  table[0, 0, 1, 0] = table[0, 0, 0, 0]


def _negative_entry(meta, arrays):
  arrays["table"][0, 0, 0, 0] = -3


def _negative_length(meta, arrays):
  arrays["length"][0, 0, 0] = -5


def _position(meta, arrays):
  arrays["position"][0] = -50
  meta["position"] = [-50]


def _head_dim_4(meta, arrays):
  for name in ("k_pages", "v_pages"):
    arrays[name] = np.ascontiguousarray(arrays[name][..., :4])


def _float16_pages(meta, arrays):
  for name in ("k_pages", "v_pages"):
    arrays[name] = arrays[name].astype(np.float16)


EDITS = {
    "two sequences share a page": ("full", _share_a_page, "array 'table'"),
    "negative page-table entry": ("full", _negative_entry, "array 'table'"),
    "negative length": ("full", _negative_length, "array 'length'"),
    "position -50": ("full", _position, "position[0]"),
    "plan.chunk 0": ("full", _set("plan.chunk", 0), "plan.chunk"),
    "plan.chunk -128": ("full", _set("plan.chunk", -128), "plan.chunk"),
    "layer budget 10**12": (
        "h2o",
        _set("plan.eviction.layer_budget.0", 10**12),
        "plan.eviction.layer_budget[0]",
    ),
    "head_dim 4": ("full", _head_dim_4, "array 'k_pages'"),
    "float16 pages under a float32 config": ("full", _float16_pages, "expected float32"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_a_hand_edited_state_is_refused_naming_the_field(model, saved, tmp_path, edit):
  """Each edit of the issue (each loaded, then answered other tokens or failed on first
  use with a raw error): one StateFileError naming the field, from load_state and
  state_info alike."""
  spec, change, field = EDITS[edit]
  path = rewrite(saved[spec], tmp_path / "s", change)
  _refused(path, model, field)


# ---- finding 4: links ------------------------------------------------------------------


def test_a_lock_link_is_refused_not_followed(model, saved, tmp_path):
  """`.lock` planted as a link to a file outside: the save refuses it, creates nothing
  there (before: `os.open(O_CREAT)` followed the link)."""
  state = kvjax.load_state(saved["full"], model)
  target = tmp_path / "s"
  target.mkdir()
  (target / ".lock").symlink_to(tmp_path / "outside")
  with pytest.raises(FileExistsError, match="symbolic link"):
    kvjax.save_state(target, state, model)
  assert not (tmp_path / "outside").exists()
  (target / ".lock").unlink()
  kvjax.save_state(target, state, model)  # a plain lock: saved


def test_a_version_that_links_elsewhere_is_refused(model, saved, tmp_path):
  """CURRENT naming a version that is a link (to another state's version), or a version
  holding a link: refused, by load_state and state_info."""
  path = tmp_path / "s"
  path.mkdir()
  (path / "v9").symlink_to(persistence.current_version(saved["full"]), target_is_directory=True)
  (path / "CURRENT").write_text("v9\n")
  _refused(path, model, "symbolic link")
  inner = rewrite(saved["full"], tmp_path / "inner", lambda meta, arrays: None)
  meta_dir = inner / "v1" / "meta"
  os.rename(meta_dir, inner / "elsewhere")
  meta_dir.symlink_to(inner / "elsewhere", target_is_directory=True)
  _refused(inner, model, "symbolic link")


_READ_EACH = """
import sys
import kvjax
for path in sys.argv[1:]:
  try:
    kvjax.state_info(path)
    print("loaded", flush=True)
  except kvjax.StateFileError as err:
    print("refused:", err, flush=True)
"""


def test_current_or_a_version_file_that_is_a_fifo_or_a_link_is_refused_at_once(
    model, saved, tmp_path
):
  """CURRENT as a link (to a file naming a version: it loaded) or a FIFO (a read waited
  forever), and a FIFO in place of a version's metadata: refused at once (each read in a
  process of its own, with a time limit)."""
  linked = rewrite(saved["full"], tmp_path / "linked", lambda meta, arrays: None)
  (tmp_path / "name").write_text("v1\n")
  (linked / "CURRENT").unlink()
  (linked / "CURRENT").symlink_to(tmp_path / "name")
  fifo = rewrite(saved["full"], tmp_path / "fifo", lambda meta, arrays: None)
  (fifo / "CURRENT").unlink()
  os.mkfifo(fifo / "CURRENT")
  inner = rewrite(saved["full"], tmp_path / "inner", lambda meta, arrays: None)
  meta_file = next(f for f in (inner / "v1" / "meta").iterdir() if f.name == "metadata")
  meta_file.unlink()
  os.mkfifo(meta_file)
  expected = {linked: "symbolic link", fifo: "not a regular file", inner: "special file"}
  try:
    out = subprocess.run(
        [sys.executable, "-c", _READ_EACH, *map(str, expected)],
        capture_output=True,
        text=True,
        timeout=90,
    )
  except subprocess.TimeoutExpired as err:
    pytest.fail(f"a read blocked; read before it: {err.stdout!r}")
  lines = out.stdout.splitlines()
  assert len(lines) == 3, out.stderr[-2000:]
  for line, words in zip(lines, expected.values()):
    assert line.startswith("refused:") and words in line, line


# ---- finding 6: modes --------------------------------------------------------------------


def _modes(root: pathlib.Path) -> dict[str, str]:
  out = {}
  for path in [root, *root.rglob("*")]:
    mode = path.lstat().st_mode
    out[str(path.relative_to(root.parent))] = ("d" if stat.S_ISDIR(mode) else "f") + oct(
        stat.S_IMODE(mode)
    )
  return out


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_everything_a_save_writes_is_private_whatever_the_umask(model, saved, tmp_path, umask):
  """One rule: files 0600, directories kvjax makes 0700, for a state (CURRENT, the lock,
  every file of its versions), a scorer and an allocation, under umask 022 and 000."""
  state = kvjax.load_state(saved["h2o"], model)
  old = os.umask(umask)
  try:
    path = kvjax.save_state(tmp_path / "new" / "state", state, model)
    kvjax.save_state(path, state, model, overwrite=True)
    _scorer_dir(model, tmp_path / "made" / "scorer")
    HeadAllocation(
        np.zeros((2, 2), np.float32), "kvzip", True, 1.0, "tiny", model_fingerprint(model)
    ).save(tmp_path / "alloc")
  finally:
    os.umask(old)
  modes = {
      **_modes(tmp_path / "new"),
      **_modes(tmp_path / "made"),
      **_modes(tmp_path / "alloc"),
  }
  loose = {p: m for p, m in modes.items() if m not in ("f0o600", "d0o700")}
  assert not loose, loose
  assert any(p.endswith("CURRENT") for p in modes) and any("/v2/" in p for p in modes)


def test_a_state_unreadable_for_permissions_says_permission_denied(
    model, saved, tmp_path, monkeypatch
):
  """CURRENT that cannot be read for its mode (another user's state): "permission denied",
  not "an interrupted first save" (simulated: these tests may run as root, whom modes do
  not stop)."""
  read_text, open_file = pathlib.Path.read_text, os.open

  def text_denied(self, *args, **kwargs):
    if self.name == "CURRENT":
      raise PermissionError(13, "Permission denied", str(self))
    return read_text(self, *args, **kwargs)

  def open_denied(file, *args, **kwargs):
    if os.path.basename(file) == "CURRENT":
      raise PermissionError(13, "Permission denied", str(file))
    return open_file(file, *args, **kwargs)

  monkeypatch.setattr(pathlib.Path, "read_text", text_denied)
  monkeypatch.setattr(os, "open", open_denied)
  _refused(saved["full"], model, "permission denied")


# ---- finding 9: state_info checks what load_state checks --------------------------------------


def test_state_info_refuses_an_edited_state_as_load_state_does(model, saved, tmp_path):
  """Edited tokens without a new digest (digest mismatch), and with one but a table that
  does not match: state_info refused neither before."""
  edited_tokens = lambda meta, arrays: meta.update(tokens=[[3] * len(PROMPT)])  # noqa: E731
  path = rewrite(saved["full"], tmp_path / "a", edited_tokens, recompute_digest=False)
  _refused(path, model, "digest")
  path = rewrite(saved["full"], tmp_path / "b", _share_a_page)
  _refused(path, model, "array 'table'")
  info = kvjax.state_info(saved["full"])  # the good one
  assert info["tokens"] == [PROMPT]


# ---- any structural edit: a checked state or one StateFileError ------------------------------

_META_FIELDS = [
    "batch_size",
    "position.0",
    "plan.chunk",
    "cache.chunk",
    "cache.num_pages",
    "cache.live_pages",
    "plan.config.max_tokens",
    "plan.config.page_size",
    "plan.config.num_pages",
    "plan.config.budget",
    "plan.eviction.layer_budget.1",
    "plan.eviction.per_head",
    "cache.kv_dtype",
    "cache.slots.3.1",
    "cache.extra",
    "key_impl",
    "model.head_dim",
    "tokens.0.0",
]
_VALUES = st.one_of(
    st.integers(-(2**34), 2**34),
    st.sampled_from([0, 1, 2, 3, 15, 16, 17, 64, 127, 128, 129, 10**6, 2**33, -1]),
    st.sampled_from([None, True, "float16", "int8", "rbg", [], ["x"], 2.5, {}]),
)
_INT_ARRAYS = ["table", "length", "position", "status", "peak_pages", "slot.position"]
_ARRAYS = [*_INT_ARRAYS, "k_pages", "v_pages", "logits", "key", "done", "slot.score"]


@st.composite
def _edits(draw):
  kind = draw(st.sampled_from(["meta", "value", "shape", "dtype", "add", "remove"]))
  if kind == "meta":
    return _set(draw(st.sampled_from(_META_FIELDS)), draw(_VALUES))
  name = draw(st.sampled_from(_ARRAYS))
  seed = draw(st.integers(0, 2**31))

  def edit(meta, arrays):
    if name not in arrays:
      return
    x, rng = arrays[name], np.random.default_rng(seed)
    if kind == "value" and x.size:
      flat = x.reshape(-1).copy()
      flat[rng.integers(x.size)] = rng.choice([-(2**31), -50, -1, 0, 1, 7, 2**20, 2**31 - 1])
      arrays[name] = flat.reshape(x.shape).astype(x.dtype)
    elif kind == "shape":
      axis = int(rng.integers(max(x.ndim, 1)))
      if x.ndim == 0:
        arrays[name] = x.reshape(1)
      else:
        size = max(x.shape[axis] + int(rng.choice([-1, 1, 3])), 1)  # orbax saves no empty array
        arrays[name] = np.resize(x, (*x.shape[:axis], size, *x.shape[axis + 1 :]))
    elif kind == "dtype":
      arrays[name] = x.astype(rng.choice([np.float16, np.int64, np.int8, np.float32, np.uint32]))
    elif kind == "add":
      arrays[f"extra.{name.replace('.', '_')}"] = np.zeros((2, 1, 4), np.float32)
    elif kind == "remove":
      del arrays[name]

  return edit


def _check_any_edit(model, saved, examples: int):
  good = {name: kvjax.load_state(path, model) for name, path in saved.items()}
  ceiling = {name: _state_bytes(state) for name, state in good.items()}

  @hypothesis.settings(
      max_examples=examples,
      deadline=None,
      suppress_health_check=list(hypothesis.HealthCheck),
      database=None,
      derandomize=True,
  )
  @hypothesis.given(spec=st.sampled_from(sorted(saved)), edit=_edits())
  def run(spec, edit):
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as monkeypatch:
      path = rewrite(saved[spec], pathlib.Path(tmp) / "s", edit)
      restores = Restores(monkeypatch)  # from here: the load's own restores
      try:
        state = kvjax.load_state(path, model)
      except kvjax.StateFileError as err:
        assert "\n" not in str(err)
        hypothesis.event("refused", str(err).split(": ", 1)[1].split(" ")[0])
        state = None
      # Memory: what orbax restored and what the loaded state holds, at most 2x the good
      # state's (each array's size is checked against the metadata before it is read).
      assert restores.bytes <= 2 * ceiling[spec], restores.bytes
      if state is not None:
        hypothesis.event("loaded")
        assert_cache_invariants(state.cache)
        assert _state_bytes(state) <= 2 * ceiling[spec]
        kvjax.decode(model, kvjax.extend(model, state, [[4, 5]]), 2)  # usable: no raw error

  run()


def test_any_structural_edit_loads_a_checked_state_or_is_refused(model, saved):
  _check_any_edit(model, saved, examples=12)


@pytest.mark.slow
def test_any_structural_edit_loads_a_checked_state_or_is_refused_many(model, saved):
  _check_any_edit(model, saved, examples=300)


# ---- peak memory of loading hostile files ---------------------------------------------------

_PEAK = """
import json, resource, sys
import kvjax
from kvjax.testing import tiny_llama
model = tiny_llama(**json.loads(sys.argv[1]))
what, path = sys.argv[2], sys.argv[3]
try:
  if what == "scorer":
    kvjax.CompressionSpec(policy="learned", budget=0.5, scorer=path)
  else:
    kvjax.load_state(path, model)
  outcome = "loaded"
except Exception as err:  # noqa: BLE001 - which one is the outcome (StateFileError expected)
  outcome = type(err).__name__
print(json.dumps([outcome, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss]))
"""


# ru_maxrss survives exec: a process started by this (large) one would report this one's
# peak. A small launcher in between starts the measured process from its own few MiB.
_LAUNCH = """
import subprocess, sys
out = subprocess.run(sys.argv[1:], capture_output=True, text=True)
sys.stdout.write(out.stdout)
sys.stderr.write(out.stderr)
sys.exit(out.returncode)
"""


def peak_rss(what: str, path) -> tuple[str, int]:
  """(outcome, peak RSS in KiB: `ru_maxrss`) of loading `path` in a fresh process."""
  measured = [sys.executable, "-c", _PEAK, json.dumps(MODEL), what, str(path)]
  out = subprocess.run(
      [sys.executable, "-c", _LAUNCH, *measured], capture_output=True, text=True, timeout=600
  )
  assert out.returncode == 0, out.stderr[-3000:]
  outcome, kib = json.loads(out.stdout.splitlines()[-1])
  return outcome, kib


def hostile_files(saved, model, root: pathlib.Path) -> dict[str, tuple[str, pathlib.Path]]:
  """The issue's hostile files (finding 2), each a few hundred KB on disk at most."""
  scorer = _scorer_dir(model, root / "scorer")

  def gigabyte(meta, arrays):
    arrays["junk"] = np.zeros(2**28, np.float32)  # 1 GiB of zeros: no chunk on disk

  pages = lambda n: _set("cache.num_pages", n)  # noqa: E731
  return {
      "extra 1 GiB zero array": ("state", rewrite(saved["full"], root / "gb", gigabyte)),
      "num_pages=10**6": ("state", rewrite(saved["h2o"], root / "m", pages(10**6))),
      "num_pages=2**33": ("state", rewrite(saved["h2o"], root / "t", pages(2**33))),
      "scorer with a 1 GiB zero array": ("scorer", _rewrite_params(scorer, gigabyte)),
  }


@pytest.mark.slow  # six processes, each importing jax
def test_loading_hostile_files_peaks_within_a_fifth_of_a_good_load(model, saved, tmp_path):
  _, good = peak_rss("state", saved["full"])
  for name, (what, path) in hostile_files(saved, model, tmp_path).items():
    outcome, kib = peak_rss(what, path)
    assert outcome in ("StateFileError", "ValueError"), (name, outcome)
    assert kib <= 1.2 * good, (name, kib, good)
