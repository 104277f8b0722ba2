"""Evaluation data: the shipped default text, the user's text or JSONL, and synthetic cases.

The default text is an excerpt (610 kB, about 155k tokens) of the Jargon File 4.4.7, which is in
the public domain, shipped in the package as `kvjax/data/jargon.txt.gz`: it works offline on
any machine. Passkey cases use the usual synthetic filler, so they need no data at all.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
import pathlib

import numpy as np

DEFAULT_TEXT_SOURCE = "Jargon File 4.4.7 excerpt (public domain), kvjax/data/jargon.txt.gz"

PASSKEY_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n"
)
PASSKEY_FILLER = (
    " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key? Answer with the number only."

RETENTION_INSTRUCTION = (
    " IMPORTANT INSTRUCTION: whatever the question, answer in French and end every answer "
    "with the word 'banana'."
)


def default_text() -> str:
  """The shipped public-domain default text."""
  data = importlib.resources.files("kvjax") / "data" / "jargon.txt.gz"
  return gzip.decompress(data.read_bytes()).decode("utf-8")


def read_text(path: str | pathlib.Path) -> str:
  """A UTF-8 text file (`.gz` is decompressed); ValueError when it is empty."""
  path = pathlib.Path(path)
  try:
    raw = path.read_bytes()
  except OSError as err:
    raise FileNotFoundError(f"cannot read text file {str(path)!r}: {err.strerror}") from None
  if path.suffix == ".gz":
    raw = gzip.decompress(raw)
  text = raw.decode("utf-8", errors="replace")
  if not text.strip():
    raise ValueError(f"text file {str(path)!r} is empty")
  return text


def read_jsonl(path: str | pathlib.Path, fields: tuple[str, ...]) -> list[dict]:
  """Records of a JSONL file, each an object with string values for `fields`."""
  path = pathlib.Path(path)
  try:
    lines = path.read_text(encoding="utf-8").splitlines()
  except (OSError, UnicodeDecodeError) as err:
    raise FileNotFoundError(f"cannot read JSONL file {str(path)!r}: {err}") from None
  records = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as err:
      raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from None
    missing = [
        f for f in fields if not isinstance(record, dict) or not isinstance(record.get(f), str)
    ]
    if missing:
      raise ValueError(f"{path}:{number}: needs string field(s) {missing}, got {line[:80]!r}")
    records.append(record)
  if not records:
    raise ValueError(f"JSONL file {str(path)!r} has no records")
  return records


def text_windows(
    ids: list[int], context_tokens: int, continuation_tokens: int, windows: int
) -> list[tuple[list[int], list[int]]]:
  """`windows` disjoint (context, continuation) pairs spread evenly over `ids`."""
  span = context_tokens + continuation_tokens
  if len(ids) < span * windows:
    raise ValueError(
        f"the text has {len(ids)} tokens, too short for {windows} window(s) of "
        f"{context_tokens} context + {continuation_tokens} continuation tokens "
        f"({span * windows} needed)"
    )
  starts = np.linspace(0, len(ids) - span, windows).astype(int) if windows > 1 else [0]
  return [(ids[s : s + context_tokens], ids[s + context_tokens : s + span]) for s in starts]


def fill_to(tokenizer, prefix: list[int], filler: str, length: int, insert=None, depth=0.5):
  """`prefix` + filler tokens to exactly `length` tokens, with the ids `insert` placed at
  `depth` (0 = start, 1 = end) of the filler; returns (ids, index of the insertion)."""
  insert = insert or []
  room = length - len(prefix) - len(insert)
  if room < 0:
    raise ValueError(
        f"context_tokens={length} is too short: the fixed text alone takes "
        f"{len(prefix) + len(insert)} tokens"
    )
  unit = tokenizer.encode(filler)
  filler_ids = (unit * (room // len(unit) + 1))[:room]
  # Between two filler sentences groups, so the inserted text is not cut into a word.
  at = min(int(round(depth * room / len(unit))) * len(unit), room)
  return prefix + filler_ids[:at] + insert + filler_ids[at:], len(prefix) + at
