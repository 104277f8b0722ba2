"""Times every error of the table in docs/cli.md: each must come within about 2 s on a quiet
2-core machine (nothing heavy is loaded before the command line is checked).

    python -m benchmarks.cli_errors [--repeats 3]

Runs each example command in a new shell and prints its exit code, the median seconds and
the first error line. Commands marked "(after loading)" load the model first by design.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import statistics
import subprocess
import sys
import time

if not __package__:  # `python benchmarks/NAME.py`: import from the repository root, as -m does
  sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

TABLE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def table_rows(path: pathlib.Path = TABLE) -> list[dict]:
  """The rows of the error table with an example command: error, command, message, exit."""
  rows = []
  for line in path.read_text().splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 4 or not cells[1].startswith("`kvjax"):
      continue
    error, command, message, code = cells
    rows.append(
        {
            "error": error,
            "command": command.strip("`"),
            "message": re.sub(r"^`|`.*$", "", message),  # the quoted part
            "exit": int(code),
        }
    )
  return rows


def run(command: str, timeout: float = 300) -> subprocess.CompletedProcess:
  """`command` in bash (the table's examples use bash quoting), stdin closed."""
  return subprocess.run(
      ["bash", "-c", command],
      capture_output=True,
      stdin=subprocess.DEVNULL,
      timeout=timeout,
  )


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=3, help="runs per command (median)")
  args = parser.parse_args(argv)
  print("| exit | median s | command | first error line |")
  print("|---:|---:|---|---|")
  for row in table_rows():
    seconds = []
    for _ in range(args.repeats):
      start = time.perf_counter()
      done = run(row["command"])
      seconds.append(time.perf_counter() - start)
    lines = [x for x in done.stderr.decode().splitlines() if x.startswith("kvjax")]
    first = lines[0] if lines else "(none)"
    print(
        f"| {done.returncode} | {statistics.median(seconds):.2f} | `{row['command']}` | {first} |"
    )


if __name__ == "__main__":
  main()
