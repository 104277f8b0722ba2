"""Files written atomically: text and binary files, and small learned artefacts (the learned scorer, a
tuned head allocation) as a directory of orbax-checkpoint items `params` (StandardSave of
named arrays) and `meta` (JsonSave): a complete file or directory, or the old one."""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

import numpy as np


def write_params(
    path: str | os.PathLike, params: dict, meta: dict, *, overwrite: bool
) -> pathlib.Path:
  """Writes `params` (arrays by name) and `meta` (JSON values) to directory `path`: staged
  beside it, renamed into place when complete."""
  import orbax.checkpoint as ocp

  path = pathlib.Path(path).absolute()
  if path.exists() and not overwrite:
    raise FileExistsError(f"{path} exists; choose another directory or overwrite=True")
  path.parent.mkdir(parents=True, exist_ok=True)
  staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
  shutil.rmtree(staging)  # orbax creates the directory itself
  try:
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
      checkpointer.save(
          staging,
          ocp.args.Composite(params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta)),
      )
    if path.exists():
      shutil.rmtree(path)
    staging.rename(path)
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return path


def read_params(path: str | os.PathLike, *, what: str, fmt: str) -> tuple[dict, dict]:
  """(params as numpy arrays, meta) of a directory written by `write` whose meta format is
  `fmt`; ValueError naming the path (and `what` it should be) otherwise."""
  import orbax.checkpoint as ocp

  path = pathlib.Path(path).absolute()
  if not (path / "meta").is_dir() or not (path / "params").is_dir():
    raise ValueError(f"{path} is not a {what} (no params/ and meta/ inside)")
  try:
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
      restored = checkpointer.restore(
          path,
          ocp.args.Composite(params=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()),
      )
  except (OSError, ValueError, KeyError) as e:
    raise ValueError(f"{path}: cannot read this {what}: {type(e).__name__}: {e}") from None
  meta, params = restored["meta"], restored["params"]
  if not isinstance(meta, dict) or meta.get("format") != fmt:
    found = meta.get("format") if isinstance(meta, dict) else None
    raise ValueError(f"{path}: unknown {what} format {found!r}, need {fmt!r}")
  return {k: np.asarray(v) for k, v in params.items()}, meta


def write_text(path: str | os.PathLike, text: str) -> None:
  """`text` in `path`, or the old file (see `write_bytes`)."""
  write_bytes(path, text.encode("utf-8"))


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
  """`data` in `path`, or the old file: a temporary file beside it, flushed to disk, renamed,
  and the rename flushed too."""
  path = pathlib.Path(path)
  fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(temporary, path)
  except BaseException:
    pathlib.Path(temporary).unlink(missing_ok=True)
    raise
  directory = os.open(path.parent, os.O_RDONLY)
  try:
    os.fsync(directory)
  finally:
    os.close(directory)
