"""Benchmark scripts (`python -m benchmarks.NAME`); they print Markdown tables."""


def print_table(columns: list[str], rows, *, numeric_from: int = 1) -> None:
  """Prints a Markdown table: `columns` as the header, each row's cells as given (already
  formatted); columns from `numeric_from` on are right-aligned."""
  print("| " + " | ".join(columns) + " |")
  print("|" + "|".join("---:" if i >= numeric_from else "---" for i in range(len(columns))) + "|")
  for row in rows:
    print("| " + " | ".join(str(cell) for cell in row) + " |")
