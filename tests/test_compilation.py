"""kvjax.runtime.compilation: steps kept in the process, stored on disk, loaded without tracing."""

import json

import jax
import kvjax
import pytest
from kvjax.runtime import compilation
from kvjax.testing import ByteTokenizer, counting_traces, tiny_llama
from models.llama import Llama

SPEC = kvjax.CompressionSpec(policy="h2o", budget=8, page_size=4, prefill_chunk=8)


@pytest.fixture
def store(tmp_path, monkeypatch):
  """An empty cache directory with the executable store on, and no step kept in memory."""
  monkeypatch.setenv("KVJAX_CACHE_DIR", str(tmp_path))
  monkeypatch.delenv("KVJAX_EXECUTABLES")
  monkeypatch.setattr(compilation, "_KEPT", type(compilation._KEPT)())
  return tmp_path / "executables"


def _as_a_new_process():
  """No step kept by kvjax, no trace kept by jax."""
  compilation._KEPT.clear()
  jax.clear_caches()


def _traced_generate(monkeypatch, model):
  """Generates, counting the model's traces (a loaded step runs no Python of the model)."""
  with counting_traces() as traces:
    result = kvjax.generate(model, ByteTokenizer(), ["hello there, store"], SPEC, max_new_tokens=6)
  return result, traces


def test_a_stored_step_loads_without_tracing_and_computes_the_same(store, monkeypatch):
  model = tiny_llama()
  first, traces = _traced_generate(monkeypatch, model)
  assert traces and first.stats["compiles"] == 2 and first.stats["loaded"] == 0
  assert sorted(p.name.split("-")[0] for p in store.glob("*.bin")) == ["_decode", "_prefill_chunk"]

  _as_a_new_process()
  again, traces = _traced_generate(monkeypatch, model)
  assert traces == [], "a loaded step must not trace the model"
  assert again.stats["compiles"] == 2 and again.stats["loaded"] == 2
  assert again.tokens == first.tokens


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_other_weights_reuse_the_step_other_shapes_do_not(store, monkeypatch):
  kvjax.generate(tiny_llama(seed=0), ByteTokenizer(), ["abcdefghij"], SPEC, max_new_tokens=4)
  stored = set(store.glob("*.bin"))
  compilation._KEPT.clear()
  other = kvjax.generate(
      tiny_llama(seed=1), ByteTokenizer(), ["abcdefghij"], SPEC, max_new_tokens=4
  )
  assert other.stats["loaded"] == 2, "weights are arguments, not part of the step"
  compilation._KEPT.clear()
  deeper = kvjax.generate(
      tiny_llama(n_layers=3), ByteTokenizer(), ["abcdefghij"], SPEC, max_new_tokens=4
  )
  assert deeper.stats["loaded"] == 0 and len(set(store.glob("*.bin")) - stored) == 2


def test_a_damaged_entry_is_compiled_again_and_replaced(store, monkeypatch):
  model = tiny_llama()
  first, _ = _traced_generate(monkeypatch, model)
  for path in store.glob("*.bin"):
    path.write_bytes(b"not an executable")
  _as_a_new_process()
  again, traces = _traced_generate(monkeypatch, model)
  assert traces and again.stats["loaded"] == 0 and again.tokens == first.tokens
  for path in store.glob("*.bin"):  # replaced by authenticated entries of this format
    header = json.loads(path.read_bytes().partition(b"\n")[0])
    assert header["format"] == compilation._STORE_FORMAT and len(header["tag"]) == 64


@pytest.mark.slow  # ~10 s: -m slow
def test_entries_another_key_made_are_compiled_again(store, monkeypatch, tmp_path):
  """A store someone else filled (here: under another user's key) is never loaded."""
  model = tiny_llama()
  first, _ = _traced_generate(monkeypatch, model)
  made = {p: p.read_bytes() for p in store.glob("*.bin")}
  monkeypatch.setenv("KVJAX_CACHE_KEY_FILE", str(tmp_path / "another.key"))
  _as_a_new_process()
  again, traces = _traced_generate(monkeypatch, model)
  assert traces and again.stats["loaded"] == 0 and again.tokens == first.tokens
  assert all(path.read_bytes() != data for path, data in made.items())  # rebuilt


@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_a_step_in_jax_cache_is_compiled_afresh_for_the_store(store, monkeypatch):
  """XLA:CPU cannot serialise again what JAX's cache loaded (the copy fails when run), so a
  step the store will keep never comes from JAX's cache."""
  model = tiny_llama(n_layers=1)
  monkeypatch.setenv("KVJAX_EXECUTABLES", "off")
  first = kvjax.generate(model, ByteTokenizer(), ["abcdef"], SPEC, max_new_tokens=4)
  monkeypatch.delenv("KVJAX_EXECUTABLES")
  _as_a_new_process()
  stored = kvjax.generate(model, ByteTokenizer(), ["abcdef"], SPEC, max_new_tokens=4)
  # Both steps stored: neither came from JAX's cache (a step it served is not stored).
  assert stored.stats["loaded"] == 0 and len(list(store.glob("*.bin"))) == 2
  _as_a_new_process()
  loaded = kvjax.generate(model, ByteTokenizer(), ["abcdef"], SPEC, max_new_tokens=4)
  assert loaded.stats["loaded"] == 2 and loaded.tokens == stored.tokens == first.tokens


def test_code_outside_the_hashed_packages_is_never_stored(store):
  class OwnModel(Llama):  # defined here: its source is not in the key
    pass

  model = tiny_llama()
  model.__class__ = OwnModel
  result = kvjax.generate(model, ByteTokenizer(), ["abcdefghij"], SPEC, max_new_tokens=4)
  assert result.stats["compiles"] == 2 and not list(store.glob("*.bin"))


def test_the_store_can_be_turned_off(store, monkeypatch):
  monkeypatch.setenv("KVJAX_EXECUTABLES", "off")
  kvjax.generate(tiny_llama(), ByteTokenizer(), ["abcdefghij"], SPEC, max_new_tokens=4)
  assert not store.exists()


def test_only_the_code_kvjax_can_pin_is_trusted():
  assert compilation._code_is_pinned("models.llama")
  assert compilation._code_is_pinned("flax.nnx.graphlib")
  assert compilation._code_is_pinned("collections")
  assert not compilation._code_is_pinned("__main__")
  assert not compilation._code_is_pinned("my_models.llama")


def test_a_step_compiled_ahead_is_waited_for_not_compiled_again(store):
  traced = []

  @jax.jit
  def double(x):
    traced.append(x.shape)
    return 2 * x

  x = jax.numpy.arange(6.0).reshape(2, 3)
  abstract = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  before = kvjax.compile_stats()
  compilation.compile_ahead(double, {}, abstract, returns=lambda x: x)
  compilation.compile_ahead(double, {}, abstract, returns=lambda x: x)  # on its way: nothing
  step = compilation.compiled(double, {}, x, returns=lambda x: x)
  assert traced == [(2, 3)]
  assert kvjax.compile_stats()["compiles"] - before["compiles"] == 1
  assert compilation.compiled(double, {}, x, returns=lambda x: x) is step
  assert (step(x) == 2 * x).all()


def test_a_step_that_cannot_be_compiled_ahead_fails_where_it_is_asked_for(store):
  @jax.jit
  def broken(x):
    raise RuntimeError("no such step")

  x = jax.numpy.zeros(3)
  compilation.compile_ahead(broken, {}, x, returns=lambda x: x)  # never raises
  with pytest.raises(RuntimeError, match="no such step"):
    compilation.compiled(broken, {}, x, returns=lambda x: x)
