"""Converted weights kept as orbax checkpoints: a GGUF is dequantised (or a safetensors
checkpoint read) once, and later loads read the float32 arrays back.

  <cache dir>/weights/<name>-<key>/      one orbax-checkpoint composite checkpoint
    params/   StandardSave: the canonical float32 params (see the `models` docstring)
    meta/     JsonSave: format, source files, ModelConfig, tokenizer (JSON, special ids,
              chat template), a SHA-256 of the params, and an HMAC of all of it keyed by
              this user's cache key (`kvjax_store.cache_dir`)

`key` digests the source files' contents (SHA-256, ~0.2 s for the default model's 98 MB),
so an edited or replaced file is converted again. An entry is used only when its HMAC
checks (checked before its params are read: an entry someone else wrote is never read)
and its params match their digest; otherwise it is converted again and replaced.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np

from kvjax_store import cache_dir
from kvjax_store.files import arrays_digest
from .config import ModelConfig, check_params
from .source import ModelSource

FORMAT = "kvjax-weights/3"  # 3: model families (config fields), the tokenizer's add_bos


def entry_dir(weights: Path, source: ModelSource) -> Path:
  """Where `source`'s converted weights live in the weight cache directory `weights`."""
  files = [source.path] if source.kind == "gguf" else sorted(source.path.iterdir())
  digest = hashlib.sha256(f"{FORMAT};{source.kind};{source.path.resolve()};".encode())
  for f in files:
    if f.is_file():
      digest.update(f"{f.name}:{_file_digest(f)};".encode())
  return Path(weights) / f"{source.name}-{digest.hexdigest()[:32]}"


def _file_digest(path: Path) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(1 << 22):
      digest.update(block)
  return digest.hexdigest()


def _tag_pieces(path: Path, meta: dict) -> tuple[bytes, bytes]:
  """What an entry's HMAC covers: its name and its metadata (which holds its params'
  digest), as JSON gives the metadata back."""
  body = json.dumps({k: v for k, v in meta.items() if k != "tag"}, sort_keys=True)
  return path.name.encode(), body.encode()


def load(path: Path):
  """(ModelConfig, params, Tokenizer) from a cache entry, or None when there is none or it
  does not read back whole (with a warning: the caller converts again)."""
  if not (path / "meta").is_dir():
    return None
  import orbax.checkpoint as ocp

  from .tokenizer import Tokenizer

  try:
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
      meta = checkpointer.restore(path, ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
      if meta.get("format") != FORMAT:
        return None  # written by another kvjax: convert again
      if not cache_dir.verify(meta.get("tag"), "weights", *_tag_pieces(path, meta)):
        raise ValueError("its metadata is not authenticated by this user's cache key")
      target = {k: np.zeros(shape, np.float32) for k, shape in meta["shapes"].items()}
      params = checkpointer.restore(
          path, ocp.args.Composite(params=ocp.args.StandardRestore(target))
      )["params"]
    params = {k: np.asarray(v) for k, v in params.items()}
    if arrays_digest(params) != meta["digest"]:
      raise ValueError("the params' SHA-256 digest does not match")
    config = ModelConfig(**{**meta["config"], "eos_ids": tuple(meta["config"]["eos_ids"])})
    check_params(config, params, str(path), optional=("rope_freqs",))
    tokenizer = Tokenizer.from_json(
        meta["tokenizer"]["json"],
        bos_id=meta["tokenizer"]["bos_id"],
        add_bos=bool(meta["tokenizer"].get("add_bos", False)),
        eos_ids=meta["tokenizer"]["eos_ids"],
        chat_template=meta["tokenizer"]["chat_template"],
    )
  except Exception as err:  # noqa: BLE001 - any damage: convert again
    warnings.warn(
        f"ignoring the damaged weight cache {path} ({err}); converting again", stacklevel=3
    )
    return None
  return config, params, tokenizer


def store(path: Path, source: ModelSource, config: ModelConfig, params, tokenizer) -> None:
  """Writes a cache entry atomically (orbax's temporary directory, renamed when complete);
  a failure to write (read-only or full disk) only warns: the model is loaded anyway."""
  import orbax.checkpoint as ocp

  params = {k: np.asarray(v, np.float32) for k, v in params.items()}
  meta = {
      "format": FORMAT,
      "source": {"kind": source.kind, "path": str(source.path)},
      "config": dataclasses.asdict(config),
      "shapes": {k: list(v.shape) for k, v in params.items()},
      "digest": arrays_digest(params),
      "tokenizer": {
          "json": tokenizer.tok.to_str(),
          "bos_id": tokenizer.bos_id,
          "add_bos": tokenizer.add_bos,
          "eos_ids": list(tokenizer.eos_ids),
          "chat_template": tokenizer.chat_template,
      },
  }
  meta = json.loads(json.dumps(meta))  # fails here, not half-way; and as a load reads it
  meta["tag"] = cache_dir.tag("weights", *_tag_pieces(path, meta))
  staging = None
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    shutil.rmtree(staging)  # orbax creates it
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
      checkpointer.save(
          staging,
          ocp.args.Composite(params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta)),
      )
    if path.exists():
      shutil.rmtree(path)  # a damaged entry (`load` refused it)
    os.rename(staging, path)
  except OSError as err:
    if not (path / "meta").is_dir():  # another process may have won the race: fine
      warnings.warn(f"could not cache the converted weights in {path}: {err}", stacklevel=3)
  finally:
    if staging is not None:
      shutil.rmtree(staging, ignore_errors=True)
