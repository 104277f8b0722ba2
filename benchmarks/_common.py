"""Helpers shared by the benchmark scripts (not a benchmark itself)."""

from __future__ import annotations

import gzip
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]  # the repository root


def print_table(columns: list[str], rows, *, numeric_from: int = 1) -> None:
  """Prints a Markdown table: `columns` as the header, each row's cells as given (already
  formatted); columns from `numeric_from` on are right-aligned."""
  print("| " + " | ".join(columns) + " |")
  print("|" + "|".join("---:" if i >= numeric_from else "---" for i in range(len(columns))) + "|")
  for row in rows:
    print("| " + " | ".join(str(cell) for cell in row) + " |")


def read_text(path: str | pathlib.Path) -> str:
  """A UTF-8 text file given with `--text` (`.gz` decompressed), as `kvjax --text` reads it."""
  path = pathlib.Path(path)
  raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
  text = raw.decode("utf-8")
  if not text.strip():
    raise ValueError(f"text file {str(path)!r} is empty")
  return text
