"""Evaluation data: the shipped default text, the user's text or JSONL, and synthetic cases.

The default text is an excerpt (610 kB, about 155k tokens) of the Jargon File 4.4.7, which is in
the public domain, shipped in the package as `kvjax/data/jargon.txt.gz`: it works offline on
any machine. Passkey cases use the usual synthetic filler by default, so they need no data at all;
their "text" filler and the multi-question facts are embedded into windows of real text.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
import pathlib
import re
from collections.abc import Sequence

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

# Multi-question facts: one sentence per subject, each with its own code, asked one by one.
FACT_SUBJECTS = (
    "red door",
    "blue box",
    "green key",
    "yellow car",
    "silver safe",
    "black gate",
    "white locker",
    "orange bicycle",
    "purple suitcase",
    "golden chest",
    "brown cabinet",
    "grey vault",
)
FACT = " The code of the {subject} is {key}."
FACT_QUESTION = "What is the code of the {subject}? Answer with the number only."

RETENTION_INSTRUCTION = (
    " IMPORTANT INSTRUCTION: whatever the question, answer in French and end every answer "
    "with the word 'banana'."
)


def default_text() -> str:
  """The shipped public-domain default text."""
  data = importlib.resources.files("kvjax") / "data" / "jargon.txt.gz"
  return gzip.decompress(data.read_bytes()).decode("utf-8")


def decode_text(raw: bytes, source: str) -> str:
  """`raw` as UTF-8 text; ValueError naming `source` when it is binary or not UTF-8 (text
  read with replacement characters would give a silent wrong answer)."""
  nul = raw.find(b"\x00")
  if nul >= 0:
    raise ValueError(f"{source} is binary (NUL byte at offset {nul}); pass UTF-8 text")
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as err:
    raise ValueError(
        f"{source} is not UTF-8: byte 0x{raw[err.start]:02x} at offset {err.start}; "
        "pass UTF-8 text"
    ) from None


def read_text(path: str | pathlib.Path) -> str:
  """A UTF-8 text file (`.gz` is decompressed); ValueError when it is empty, binary or not
  UTF-8."""
  path = pathlib.Path(path)
  try:
    raw = path.read_bytes()
  except OSError as err:
    raise FileNotFoundError(f"cannot read text file {str(path)!r}: {err.strerror}") from None
  if path.suffix == ".gz":
    try:
      raw = gzip.decompress(raw)
    except (OSError, EOFError) as err:
      raise ValueError(f"text file {str(path)!r} is not a valid .gz file: {err}") from None
  text = decode_text(raw, f"text file {str(path)!r}")
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


def _starts(total: int, span: int, count: int) -> list[int]:
  """Starts of `count` spans of `span` tokens spread evenly over `total` tokens."""
  return np.linspace(0, total - span, count).astype(int).tolist() if count > 1 else [0]


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
  starts = _starts(len(ids), span, windows)
  return [(ids[s : s + context_tokens], ids[s + context_tokens : s + span]) for s in starts]


def windows(ids: Sequence[int], size: int, count: int) -> list[list[int]]:
  """`count` disjoint windows of `size` tokens spread evenly over `ids` (one per case)."""
  if len(ids) < size * count:
    raise ValueError(
        f"the text has {len(ids)} tokens, too short for {count} window(s) of {size} tokens "
        f"({size * count} needed)"
    )
  return [list(ids[s : s + size]) for s in _starts(len(ids), size, count)]


# Text ending a sentence (a stop, maybe closing quotes) or a paragraph (a blank line).
_SENTENCE_END = re.compile(r"([.!?][\"'”’)\]]*|\n\s*\n)\s*$")


def embed(
    tokenizer, text: Sequence[int], inserts: Sequence[tuple[Sequence[int], float]], radius=32
) -> tuple[list[int], list[int]]:
  """`text` (token ids) with each (ids, depth) of `inserts` placed at `depth` of it (0 = start,
  1 = end); returns (ids, index where each insertion starts, in the order given).

  Each place moves to the nearest sentence or paragraph end within `radius` tokens (else the
  nearest word start), so the inserted sentence does not cut the text's own sentences or
  words (hard-wrapped lines are not sentence ends)."""
  text = list(text)
  pieces = {i: tokenizer.decode([i]) for i in set(text)}
  piece = lambda at: pieces[text[at]] if 0 <= at < len(text) else ""  # noqa: E731
  sentence_end = lambda at: (  # noqa: E731
      at in (0, len(text)) or _SENTENCE_END.search(piece(at - 2) + piece(at - 1)) is not None
  )
  word_start = lambda at: at == len(text) or piece(at)[:1].isspace()  # noqa: E731

  def place(depth: float) -> int:
    target = int(round(depth * len(text)))
    near = range(max(0, target - radius), min(len(text), target + radius) + 1)
    for good in (sentence_end, word_start):
      found = [at for at in near if good(at)]
      if found:
        return min(found, key=lambda at: (abs(at - target), at))
    return target

  places = [place(depth) for _, depth in inserts]
  out, starts, done = [], [0] * len(inserts), 0
  for k in sorted(range(len(inserts)), key=lambda k: (places[k], k)):
    out += text[done : places[k]]
    starts[k] = len(out)
    out += list(inserts[k][0])
    done = places[k]
  return out + text[done:], starts


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
