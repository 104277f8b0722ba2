"""The store of compressed contexts (kvjax.serving._contexts): a context's lifecycle (save,
get, list by pages, a new lifetime or name, expiry, delete), quotas counted over every
process of one model, other models' contexts never seen nor removed, and files that cannot
be read answered as errors, never deleted."""

import multiprocessing
import time

import pytest

import kvjax
from kvjax.serving._contexts import ContextStore, QuotaExceeded
from kvjax.testing import ByteTokenizer, tiny_llama

TOK = ByteTokenizer()
SPEC = kvjax.CompressionSpec(policy="h2o", budget=16, page_size=4)


@pytest.fixture(scope="module")
def model():
  return tiny_llama(max_context=128)


@pytest.fixture(scope="module")
def state(model):
  return kvjax.prefill(model, [TOK.encode("a document to keep " * 3)], SPEC, reserve=0)


def _store(root, model, **kw):
  return ContextStore(root, model, TOK, **{"ttl": 60.0, "quota": 10**7, **kw})


def test_a_context_is_listed_by_pages_renamed_kept_longer_and_deleted(tmp_path, model, state):
  store = _store(tmp_path, model, model_name="tiny")
  made = [
      store.save("alice", state, 57, name=f"doc {i}", policy="h2o, budget 16") for i in range(5)
  ]
  first = made[0]
  assert first.model == "tiny" and first.policy == "h2o, budget 16" and first.name == "doc 0"
  assert first.document_tokens == 57 and 0 < first.kept_share < 1
  assert first.kv_bytes < first.full_kv_bytes and first.disk_bytes > 0
  assert store.get("alice", first.id) == first
  page, more = store.list("alice", limit=2)
  assert [c.id for c in page] == [c.id for c in made[:2]] and more
  page, more = store.list("alice", after=page[-1].id, limit=2)
  assert [c.id for c in page] == [c.id for c in made[2:4]] and more
  page, more = store.list("alice", after=page[-1].id, limit=2)
  assert [c.id for c in page] == [made[4].id] and not more
  longer = store.update("alice", first.id, ttl=3600.0, name="renamed")
  assert longer.name == "renamed" and longer.expires > first.expires + 3000
  assert store.get("alice", first.id) == longer  # stored, not only answered
  assert store.update("alice", first.id, name=None).name is None
  assert store.load("alice", first.id) is not None
  assert store.delete("alice", first.id) and not store.delete("alice", first.id)
  assert store.get("alice", first.id) is None and store.load("alice", first.id) is None
  assert store.update("alice", first.id, ttl=5.0) is None


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"ttl": float("inf")}, "finite"),
        ({"ttl": 0}, "> 0"),
        ({"ttl": True}, "number"),
        ({"name": "x" * 300}, "at most 256"),
        ({"name": "two\nlines"}, "printable"),
    ],
)
def test_an_update_out_of_range_names_what(tmp_path, model, state, kwargs, error):
  store = _store(tmp_path, model)
  made = store.save("alice", state, 57)
  with pytest.raises((ValueError, TypeError), match=error):
    store.update("alice", made.id, **kwargs)


def test_another_tenant_sees_nothing_of_a_context(tmp_path, model, state):
  store = _store(tmp_path, model)
  made = store.save("alice", state, 57)
  assert store.get("bob", made.id) is None and store.load("bob", made.id) is None
  assert store.list("bob") == ([], False)
  assert not store.delete("bob", made.id) and store.update("bob", made.id, ttl=9.0) is None
  assert store.get("alice", made.id) == made


def test_an_expired_context_is_removed_and_not_counted(tmp_path, model, state):
  store = _store(tmp_path, model, ttl=0.5)
  made = store.save("alice", state, 57)
  assert store.usage("alice") == made.disk_bytes
  time.sleep(0.6)
  assert store.get("alice", made.id) is None and store.usage("alice") == 0
  assert store.list("alice") == ([], False)
  assert not any(p.name.startswith("ctx-") for p in store._dir("alice").iterdir())


def test_the_quota_is_checked_before_the_work_and_at_save(tmp_path, model, state):
  one = _store(tmp_path, model).save("alice", state, 57).disk_bytes
  store = _store(tmp_path / "other", model, quota=one + state.kv_bytes() // 2)
  store.check_quota("alice", state.kv_bytes())
  store.save("alice", state, 57)
  with pytest.raises(QuotaExceeded, match="quota"):
    store.check_quota("alice", state.kv_bytes())
  with pytest.raises(QuotaExceeded, match="quota"):
    store.save("alice", state, 57)
  store.check_quota("bob", state.kv_bytes())  # each tenant has its own


def test_replicas_share_contexts_and_another_model_neither_sees_nor_removes_them(
    tmp_path, model, state
):
  first, replica = _store(tmp_path, model), _store(tmp_path, model)
  made = first.save("alice", state, 57)
  assert replica.get("alice", made.id) == made and replica.load("alice", made.id) is not None
  other = _store(tmp_path, tiny_llama(max_context=128, seed=1))
  assert other.get("alice", made.id) is None and other.list("alice") == ([], False)
  other.save("alice", kvjax.prefill(other.model, [TOK.encode("x" * 40)], SPEC, reserve=0), 40)
  assert first.get("alice", made.id) == made  # untouched by the other model's server
  assert replica.delete("alice", made.id) and first.get("alice", made.id) is None


def test_files_that_cannot_be_read_are_an_error_not_a_deletion(tmp_path, model, state, monkeypatch):
  store = _store(tmp_path, model)
  made = store.save("alice", state, 57)

  def unreadable(*args, **kwargs):
    raise OSError(24, "Too many open files")

  monkeypatch.setattr("kvjax.serving._contexts.load_state", unreadable)
  with pytest.raises(OSError, match="Too many open files"):
    store.load("alice", made.id)
  monkeypatch.undo()
  assert store.load("alice", made.id) is not None


def test_what_a_killed_save_left_is_invisible_and_removed(tmp_path, model, state):
  store = _store(tmp_path, model)
  made = store.save("alice", state, 57)
  store._path("alice", made.id).with_suffix(".json").unlink()  # killed before its record
  assert store.get("alice", made.id) is None and store.usage("alice") == 0
  assert not store._path("alice", made.id).exists()


def _save_in_a_process(root, quota, results):
  """One replica's save (a process of its own): 'saved' or 'quota'."""
  model = tiny_llama(max_context=128)
  state = kvjax.prefill(model, [TOK.encode("a document to keep " * 3)], SPEC, reserve=0)
  try:
    _store(root, model, quota=quota).save("alice", state, 57)
    results.put("saved")
  except QuotaExceeded:
    results.put("quota")


@pytest.mark.slow  # four processes, each loading JAX
def test_replicas_saving_at_once_keep_the_quota(tmp_path, model, state):
  one = _store(tmp_path / "size", model).save("alice", state, 57).disk_bytes
  ctx = multiprocessing.get_context("spawn")
  results = ctx.Queue()
  procs = [
      ctx.Process(target=_save_in_a_process, args=(tmp_path / "shared", 2 * one + 100, results))
      for _ in range(4)
  ]
  for p in procs:
    p.start()
  for p in procs:
    p.join(300)
  outcomes = sorted(results.get(timeout=10) for _ in procs)
  assert outcomes == ["quota", "quota", "saved", "saved"]
