"""`save_state`: a state's live pages and what a load must check, written as a new complete
version of its directory."""

from __future__ import annotations

import json
import os
import pathlib

from kvjax.cache import pages
from kvjax.persistence._directory import (
  CURRENT,
  check_target,
  current_name,
  remove_stale,
  versions,
)
from kvjax.persistence._format import describe, digest, live_arrays
from kvjax.runtime.state import State
from kvjax_store import files
from kvjax_store.files import locked


def save_state(
    path: str | os.PathLike,
    state: State,
    model,
    *,
    tokenizer=None,
    tokens=None,
    info: dict | None = None,
    overwrite: bool = False,
) -> pathlib.Path:
  """Writes `state` to directory `path`: only its live pages, with what a load checks.

  Args:
    state: a `kvjax.State` (from `prefill`, `extend` or `decode`).
    model: the model the state was made with (its fingerprint is recorded).
    tokenizer: recorded by fingerprint, so a load with another tokenizer is refused.
    tokens: the token ids the state has read, per row (recorded; `state_info` returns them).
    info: your own JSON-serialisable metadata (e.g. how the prompt was built).
    overwrite: replace the state already saved at `path` (atomically: a reader or a crash
      sees the old state or the new one, never a mixture). Saves into one directory from
      several processes run one after another (a lock in the directory).
  Returns the directory.
  """
  if not isinstance(state, State):
    raise TypeError(f"state must be a kvjax.State, got {type(state).__name__}")
  if state.cache.mesh is not None:
    raise ValueError(
        "save_state: the state is sharded over a mesh, which kvjax does not save yet; "
        "prefill without mesh= to save it"
    )
  path = pathlib.Path(path).absolute()
  check_target(path, overwrite)  # before anything is written or locked
  # As JSON gives it back (string keys, lists): the digest must match what a load reads.
  meta = json.loads(json.dumps(describe(state, model, tokenizer, tokens, info)))
  arrays = live_arrays(state)
  meta["cache"]["live_pages"] = int(arrays["table"].max(initial=pages.NULL_PAGE))
  meta["digest"] = digest(meta, arrays)

  import orbax.checkpoint as ocp

  files.make_dirs(path)  # 0700 where kvjax makes it
  with locked(path):
    check_target(path, overwrite)  # again: another process may have saved meanwhile
    previous = current_name(path)
    name = f"v{1 + max(versions(path), default=0)}"
    with files.private_checkpointer() as checkpointer:
      checkpointer.save(  # a temporary directory (0700), renamed to `name` once complete
          path / name,
          ocp.args.Composite(arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)),
      )
    files.make_private(path / name)  # files 0600, as CURRENT (`write_text`) and the lock
    files.write_text(path / CURRENT, name + "\n")
    # The previous version stays until the next save: a reader may have just read its name.
    remove_stale(path, keep={name, previous})
  return path
