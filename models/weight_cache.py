"""Converted weights kept as orbax checkpoints: a GGUF is dequantised (or a safetensors
checkpoint read) once, and later loads read the float32 arrays back.

  <cache dir>/weights/<name>-<key>/      one orbax-checkpoint composite checkpoint
    params/   StandardSave: the canonical float32 params (see the `models` docstring)
    meta/     JsonSave: format, source files, ModelConfig, tokenizer (JSON, special ids,
              chat template) and a SHA-256 of the params

`key` digests the source files' paths, sizes and modification times, so an edited or
replaced file is converted again. A cache entry that does not read back whole (a
truncated file, a digest that does not match) is converted again, never used.
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

from .config import ModelConfig, check_params
from .registry import ModelSource

FORMAT = "kvjax-weights/1"


def entry_dir(root: Path, source: ModelSource) -> Path:
  """Where `source`'s converted weights live under the cache directory `root`."""
  files = [source.path] if source.kind == "gguf" else sorted(source.path.iterdir())
  digest = hashlib.sha256(f"{FORMAT};{source.kind};{source.path.resolve()};".encode())
  for f in files:
    if f.is_file():
      stat = f.stat()
      digest.update(f"{f.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
  return Path(root) / "weights" / f"{source.name}-{digest.hexdigest()[:16]}"


def arrays_digest(arrays: dict[str, np.ndarray]) -> str:
  """SHA-256 of named arrays: each one's name, dtype, shape and bytes, in name order."""
  digest = hashlib.sha256()
  for name in sorted(arrays):
    x = np.ascontiguousarray(arrays[name])
    digest.update(f"{name}:{x.dtype.name}:{x.shape};".encode())
    digest.update(x.reshape(-1).view(np.uint8).data)  # any dtype (bfloat16 too), no copy
  return digest.hexdigest()


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
          "eos_ids": list(tokenizer.eos_ids),
          "chat_template": tokenizer.chat_template,
      },
  }
  json.dumps(meta)  # fails here, not half-way through a save
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
