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
import os
import pathlib
import re
import stat
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import BinaryIO

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
PASSKEY_CUE = "The pass key is"  # a plain-text model's answer starts so (`encode_question`)
# Several needles: a key per door in one text, one door asked (the others are distractors).
DOORS = ("red", "green", "blue")
DOOR_NEEDLE = " The pass key of the {door} door is {key}. Remember it. {key} opens the {door} door."
DOOR_QUESTION = "What is the pass key of the {door} door? Answer with the number only."
DOOR_CUE = "The pass key of the {door} door is"

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
FACT_CUE = "The code of the {subject} is"

RETENTION_INSTRUCTION = (
    " IMPORTANT INSTRUCTION: whatever the question, answer in French and end every answer "
    "with the word 'banana'."
)


def default_text() -> str:
  """The shipped public-domain default text."""
  data = importlib.resources.files("kvjax") / "data" / "jargon.txt.gz"
  return gzip.decompress(data.read_bytes()).decode("utf-8")


# Text read from a file or stdin at most (after decompression): a prompt, a context or an
# eval text is far smaller, and a mistaken input (/dev/zero, a gzip bomb) must fail with one
# line, never grow until MemoryError. KVJAX_MAX_TEXT_BYTES (bytes) sets another limit.
MAX_TEXT_BYTES = 64 * 2**20
MAX_TEXT_ENV = "KVJAX_MAX_TEXT_BYTES"
_BLOCK = 2**20  # bytes read (or decompressed) at a time


def max_text_bytes() -> int:
  """The limit on text read: `MAX_TEXT_BYTES`, or KVJAX_MAX_TEXT_BYTES when it is set."""
  raw = os.environ.get(MAX_TEXT_ENV, "").strip()
  if not raw:
    return MAX_TEXT_BYTES
  try:
    value = int(raw)
  except ValueError:
    value = 0
  if value < 1:
    raise ValueError(f"{MAX_TEXT_ENV} must be a number of bytes >= 1, got {raw!r}")
  return value


def _size(n: int) -> str:
  return f"{n / 2**20:g} MiB" if n % 2**20 == 0 else f"{n} bytes"


def _binary(offset: int) -> str:
  return f"binary (NUL byte at offset {offset}); pass UTF-8 text"


def decode_text(raw: bytes | bytearray, source: str) -> str:
  """`raw` as UTF-8 text; ValueError naming `source` when it is binary or not UTF-8 (text
  read with replacement characters would give a silent wrong answer)."""
  nul = raw.find(b"\x00")
  if nul >= 0:
    raise ValueError(f"{source} is {_binary(nul)}")
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as err:
    raise ValueError(
        f"{source} is not UTF-8: byte 0x{raw[err.start]:02x} at offset {err.start}; "
        "pass UTF-8 text"
    ) from None


def _kind(mode: int) -> str | None:
  """What a file that is not a regular file is (None for a regular file)."""
  for test, name in (
      (stat.S_ISDIR, "a directory"),
      (stat.S_ISCHR, "a character device"),
      (stat.S_ISBLK, "a block device"),
      (stat.S_ISFIFO, "a FIFO (named pipe)"),
      (stat.S_ISSOCK, "a socket"),
  ):
    if test(mode):
      return name
  return None if stat.S_ISREG(mode) else "not a regular file"


def _open_regular(path: pathlib.Path, cannot_read: str, refuse: Callable[[str], Exception]):
  """`path` opened for reading in binary, refused unless it is a regular file: a device
  (/dev/zero) or a pipe never ends, and a FIFO without a writer blocks the open."""
  try:
    kind = _kind(os.stat(path).st_mode)
    if kind is None:
      # Non-blocking, and checked again on the open file, in case it changed in between.
      fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
      kind = _kind(os.fstat(fd).st_mode)
      if kind is not None:
        os.close(fd)
  except OSError as err:
    raise FileNotFoundError(f"cannot read {cannot_read}: {err.strerror}") from None
  if kind is not None:
    raise refuse(f"{kind}, not a regular file")
  return os.fdopen(fd, "rb")


def _blocks(
    stream: BinaryIO, refuse: Callable[[str], Exception], *, compressed: bool = False
) -> Iterator[bytes]:
  """The bytes of `stream` block by block, at most `max_text_bytes()` of them; `refuse(why)`
  is raised past that or at a NUL byte (binary input fails on its first block)."""
  limit, total = max_text_bytes(), 0
  while True:
    try:
      block = stream.read(min(_BLOCK, limit + 1 - total))  # one byte past the limit tells
    except (OSError, EOFError, zlib.error) as err:
      if not compressed:
        raise
      raise refuse(f"not a valid .gz file: {err}") from None
    if not block:
      return
    nul = block.find(b"\x00")
    if nul >= 0:
      raise refuse(_binary(total + nul))
    total += len(block)
    if total > limit:
      unpacked = " once decompressed" if compressed else ""
      raise refuse(
          f"larger than {_size(limit)}{unpacked}, the limit on text read "
          f"({MAX_TEXT_ENV}=BYTES sets another)"
      )
    yield block


def read_stream(stream: BinaryIO, source: str) -> str:
  """UTF-8 text from an open binary stream (stdin), read in blocks up to `max_text_bytes()`;
  ValueError naming `source` when it is larger, binary or not UTF-8."""
  raw = bytearray()
  for block in _blocks(stream, lambda why: ValueError(f"{source} is {why}")):
    raw += block
  return decode_text(raw, source)


def read_text(path: str | pathlib.Path) -> str:
  """A UTF-8 text file (`.gz` is decompressed as it is read), at most `max_text_bytes()`
  of text; ValueError when it is not a regular file, larger, empty, binary or not UTF-8."""
  path = pathlib.Path(path)
  source = f"text file {str(path)!r}"
  refuse = lambda why: ValueError(f"{source} is {why}")  # noqa: E731
  raw = bytearray()
  with _open_regular(path, source, refuse) as file:
    compressed = path.suffix == ".gz"
    stream = gzip.GzipFile(fileobj=file, mode="rb") if compressed else file
    try:
      for block in _blocks(stream, refuse, compressed=compressed):
        raw += block
    except OSError as err:
      raise FileNotFoundError(f"cannot read {source}: {err.strerror or err}") from None
  text = decode_text(raw, source)
  if not text.strip():
    raise ValueError(f"{source} is empty")
  return text


def _lines(blocks: Iterator[bytes]) -> Iterator[bytes]:
  """The lines (without their newline) of a stream of blocks."""
  pending = bytearray()
  for block in blocks:
    pending += block
    end = pending.rfind(b"\n")
    if end >= 0:
      yield from bytes(pending[:end]).split(b"\n")
      del pending[: end + 1]
  if pending:
    yield bytes(pending)


def read_jsonl(path: str | pathlib.Path, fields: tuple[str, ...]) -> list[dict]:
  """Records of a JSONL file, each an object with string values for `fields`; read line by
  line, at most `max_text_bytes()`, and refused unless it is a regular UTF-8 text file."""
  path = pathlib.Path(path)
  source = f"JSONL file {str(path)!r}"
  refuse = lambda why: ValueError(f"cannot read {source}: {why}")  # noqa: E731
  records = []
  with _open_regular(path, source, refuse) as file:
    try:
      for number, raw in enumerate(_lines(_blocks(file, refuse)), 1):
        try:
          line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
          raise refuse(
              f"line {number} is not UTF-8 (byte 0x{raw[err.start]:02x}); pass UTF-8 text"
          ) from None
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
    except OSError as err:
      raise FileNotFoundError(f"cannot read {source}: {err.strerror or err}") from None
  if not records:
    raise ValueError(f"{source} has no records")
  return records


def _starts(total: int, span: int, count: int) -> list[int]:
  """Starts of `count` spans of `span` tokens spread evenly over `total` tokens."""
  return np.linspace(0, total - span, count).astype(int).tolist() if count > 1 else [0]


def document_start(tokenizer) -> list[int]:
  """The ids a document begins with: the tokenizer's BOS where it adds one (Gemma's), none
  otherwise. A window cut from a text is read as a document, as the model was trained."""
  if getattr(tokenizer, "add_bos", False) and getattr(tokenizer, "bos_id", None) is not None:
    return [tokenizer.bos_id]
  return []


def text_windows(
    ids: list[int],
    context_tokens: int,
    continuation_tokens: int,
    windows: int,
    start: Sequence[int] = (),
) -> list[tuple[list[int], list[int]]]:
  """`windows` disjoint (context, continuation) pairs spread evenly over `ids`; each context
  begins with `start` (e.g. `document_start`) and holds `context_tokens` in all."""
  start = list(start)
  if start:
    pairs = text_windows(ids, context_tokens - len(start), continuation_tokens, windows)
    return [(start + context, continuation) for context, continuation in pairs]
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
  """`count` windows of `size` tokens spread evenly over `ids` (one per case): disjoint
  where the text holds `count` of them, else overlapping (the shipped text holds 18 of
  8192 tokens; each case still hides its own key at its own depth)."""
  if len(ids) < size:
    raise ValueError(f"the text has {len(ids)} tokens, too short for a window of {size} tokens")
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
