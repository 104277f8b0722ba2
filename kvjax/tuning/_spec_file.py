"""The tuned spec on disk: `tuned.json` (the `CompressionSpec`, the target, the model, what
the tuner measured) and its learned allocation in an orbax directory beside it.

  <out>/tuned.json
  <out>/allocation/   (kvjax.eviction.allocation.HeadAllocation; absent when none was learned)
  <out>/front.png     (quality vs memory of every setting tried)
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

from kvjax.spec import CompressionSpec

FORMAT = "kvjax-tuned/1"
_KEYS = {
    "format",
    "spec",
    "model",
    "fingerprint",
    "target",
    "chosen",
    "why",
    "baseline",
    "held_out",
    "front",
    "points",
    "sample",
    "timing",
}


def spec_record(spec: CompressionSpec, allocation_dir: str | None) -> dict:
  """The spec's fields as the file stores them: defaults left out, the allocation as a path
  relative to the file."""
  out = {}
  for field in dataclasses.fields(CompressionSpec):
    value = getattr(spec, field.name)
    if field.name == "policy":
      value = spec.policy.name
    elif field.name == "allocation":
      value = allocation_dir if value is not None else None
    if value != field.default:
      out[field.name] = value
  return out


def load_spec(path: str | os.PathLike, model=None) -> CompressionSpec:
  """The `CompressionSpec` of a tuned spec file (`kvjax tune` writes it); with `model`,
  checks that it was tuned for that model. ValueError naming the file and what is wrong:
  unknown keys, another format, bad values, another model."""
  from kvjax.eval._data import read_text  # regular files within the size limit only

  path = pathlib.Path(path)
  if not path.exists():
    raise ValueError(f"{path}: no such tuned spec file")
  try:
    record = json.loads(read_text(path))
  except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
    raise ValueError(f"{path}: not a tuned spec file ({type(e).__name__}: {e})") from None
  if not isinstance(record, dict):
    raise ValueError(f"{path}: not a tuned spec file (a JSON object is expected)")
  if record.get("format") != FORMAT:
    raise ValueError(f"{path}: format {record.get('format')!r} is not {FORMAT!r}")
  unknown = set(record) - _KEYS
  if unknown:
    raise ValueError(f"{path}: unknown keys {sorted(unknown)} (known: {sorted(_KEYS)})")
  fields = record.get("spec")
  if not isinstance(fields, dict):
    raise ValueError(f"{path}: 'spec' must be an object of CompressionSpec fields")
  names = {f.name for f in dataclasses.fields(CompressionSpec)}
  unknown = set(fields) - names
  if unknown:
    raise ValueError(f"{path}: unknown spec fields {sorted(unknown)}")
  fields = dict(fields)
  if isinstance(fields.get("allocation"), str):
    fields["allocation"] = str((path.parent / fields["allocation"]).absolute())
  try:
    spec = CompressionSpec(**fields)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{path}: {e}") from None
  if model is not None:
    from kvjax.fingerprint import model_fingerprint

    if record.get("fingerprint") != model_fingerprint(model):
      name = getattr(model.config, "name", type(model).__name__)
      raise ValueError(
          f"{path} was tuned for {record.get('model')!r}, not for this model ({name}): run "
          "`kvjax tune` with it"
      )
  return spec
