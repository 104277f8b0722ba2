"""The code stays readable in pieces: no module of kvjax over 600 lines, no function over 100
lines anywhere outside the tests, and no folder or file named after a work item."""

import ast
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
CODE = ("kvjax", "kvjax_store", "models", "pallas_kernels", "benchmarks", "examples")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 100


def _sources(folders):
  for folder in folders:
    yield from sorted((ROOT / folder).rglob("*.py"))


def test_no_kvjax_module_is_over_600_lines():
  long = {
      str(p.relative_to(ROOT)): n
      for p in _sources(("kvjax", "kvjax_store"))
      if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
  }
  assert long == {}, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_over_100_lines():
  long = []
  for path in _sources(CODE):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = node.end_lineno - node.lineno + 1
        if lines > MAX_FUNCTION_LINES:
          long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
  assert long == [], "functions over 100 lines:\n" + "\n".join(long)


def test_no_path_names_a_work_item():
  tracked = subprocess.run(
      ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
  ).stdout.split()
  work_item = re.compile(r"(^|[/_.-])(issue|i|gh|pr)[_-]?\d+([/_.-]|$)", re.I)
  named = [p for p in tracked if work_item.search(p)]
  assert named == [], f"paths named after work items: {named}"
