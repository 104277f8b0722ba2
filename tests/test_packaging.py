"""What the wheel holds, and what the benchmarks beside it may import.

The wheel carries the packages and their data, and nothing that needs the test extras: no
`benchmarks/` (they live beside the packages, out of the wheel) and no module importing
torch or transformers (only tests and benchmarks compare against them). The benchmarks use
kvjax's public API only, so that they keep working through internal moves.
"""

from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OURS = ("kvjax", "kvjax_store", "models", "pallas_kernels")  # the project's packages
HEAVY = ("torch", "transformers")  # test extras: no module of the wheel may import them
# Build outputs and caches of the working tree: not the project's sources.
NOT_COPIED = (".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
  """The wheel built from a copy of the working tree (setuptools writes build/ and
  *.egg-info beside the sources, and a stale build/ would leak old files into the wheel)."""
  tmp = tmp_path_factory.mktemp("wheel")
  source = tmp / "src"
  shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_COPIED))
  out = tmp / "dist"
  done = subprocess.run(
      [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
       "-q", "-w", str(out)],
      capture_output=True,
      text=True,
      timeout=300,
  )  # fmt: skip
  assert done.returncode == 0, done.stdout + done.stderr
  (path,) = out.glob("kvjax-*.whl")
  with zipfile.ZipFile(path) as archive:
    yield archive


def test_the_wheel_holds_the_packages_and_their_data(wheel):
  names = wheel.namelist()
  for package in OURS:
    assert f"{package}/__init__.py" in names, f"the wheel lacks {package}/"
  assert "kvjax/data/jargon.txt.gz" in names
  scorers = [n for n in names if n.startswith("kvjax/data/scorers/") and not n.endswith("/")]
  assert scorers, "the wheel lacks the shipped scorers (kvjax/data/scorers/...)"
  on_disk = {
      p.relative_to(ROOT).as_posix()
      for p in (ROOT / "kvjax" / "data" / "scorers").rglob("*")
      if p.is_file()
  }
  assert on_disk <= set(scorers), f"scorer files missing from the wheel: {on_disk - set(scorers)}"


def test_the_wheel_holds_no_benchmarks(wheel):
  found = [n for n in wheel.namelist() if "benchmarks" in pathlib.PurePosixPath(n).parts]
  assert not found, f"benchmarks inside the wheel: {found[:5]}"
  tops = {pathlib.PurePosixPath(n).parts[0] for n in wheel.namelist()}
  assert not {"benchmarks", "tests", "docs", "examples"} & tops, sorted(tops)


def _imported_modules(tree: ast.AST):
  """(line, module) of every import anywhere in a module: top level, functions, branches."""
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield node.lineno, alias.name
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      yield node.lineno, node.module


def test_no_module_of_the_wheel_imports_torch_or_transformers(wheel):
  offenders = []
  for name in wheel.namelist():
    if not name.endswith(".py"):
      continue
    tree = ast.parse(wheel.read(name), filename=name)
    for line, module in _imported_modules(tree):
      if module.split(".")[0] in HEAVY:
        offenders.append(f"{name}:{line}: imports {module}")
  assert not offenders, "\n".join(offenders)


# ---- the benchmarks import kvjax's public API only ----------------------------------------

# Not benchmarks/probes/: diagnostics that look inside kvjax (their README says so).
BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py"))
DUNDER_OK = {"__future__", "__version__"}
# The public faces: names exported by these modules (their `__all__` where they have one),
# and their submodules only where listed. `pallas_kernels.<op>` modules are public as a whole.
PUBLIC_MODULES = {
    "kvjax",
    "kvjax.eval",
    "kvjax.policies",
    "kvjax.cache",
    "kvjax.eviction",
    "kvjax.tuning",
    "kvjax.testing",
    "kvjax.seam",
    "kvjax.sharding",
    # Shared infrastructure, in the API reference (docs/reference/kvjax_store.md).
    "kvjax_store.cache_dir",
    "kvjax_store.files",
    "models",
    "models.registry",
    "pallas_kernels",
}


def _module_file(module: str) -> pathlib.Path | None:
  path = ROOT.joinpath(*module.split("."))
  for candidate in (path / "__init__.py", path.with_suffix(".py")):
    if candidate.is_file():
      return candidate
  return None


def _is_public_module(module: str) -> bool:
  parts = module.split(".")
  if parts[0] == "pallas_kernels" and len(parts) == 2:
    return not parts[1].startswith("_")
  return module in PUBLIC_MODULES


def _exported(module: str) -> set[str] | None:
  """The module's `__all__` when it spells one out as a literal, else None."""
  tree = ast.parse(_module_file(module).read_text())
  for node in tree.body:
    if isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
    ):
      return set(ast.literal_eval(node.value))
  return None


def _private_parts(module: str, names=()) -> list[str]:
  return [p for p in (*module.split("."), *names) if p.startswith("_") and p not in DUNDER_OK]


def _our_imports(path: pathlib.Path):
  """(line, module, imported names) of every import of the project's packages in `path`;
  `from a import b` where a.b is a module counts as an import of module a.b."""
  for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.split(".")[0] in OURS:
          yield node.lineno, alias.name, ()
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      if node.module.split(".")[0] not in OURS:
        continue
      names = []
      for alias in node.names:
        submodule = f"{node.module}.{alias.name}"
        if _module_file(submodule) is not None:
          yield node.lineno, submodule, ()
        else:
          names.append(alias.name)
      if names:
        yield node.lineno, node.module, tuple(names)


def test_there_are_benchmarks_to_check():
  assert len(BENCHMARKS) >= 10, BENCHMARKS


@pytest.mark.parametrize("path", BENCHMARKS, ids=[p.name for p in BENCHMARKS])
def test_benchmarks_import_no_private_kvjax_module_or_name(path):
  offenders = [
      f"{path.relative_to(ROOT)}:{line}: imports {module}"
      + (f" ({', '.join(names)})" if names else "")
      + f": private {', '.join(private)}"
      for line, module, names in _our_imports(path)
      if (private := _private_parts(module, names))
  ]
  assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("path", BENCHMARKS, ids=[p.name for p in BENCHMARKS])
def test_benchmarks_import_only_the_public_faces(path):
  """Only the public modules, and from those with an `__all__` only its names: a name
  reached through an internal module (`kvjax.cache.sizing`, `kvjax.runtime.session`) moves
  with the internals."""
  offenders = []
  for line, module, names in _our_imports(path):
    where = f"{path.relative_to(ROOT)}:{line}: imports {module}"
    if _private_parts(module, names):
      continue  # the test above names it
    if not _is_public_module(module):
      offenders.append(f"{where}: not a public module ({', '.join(sorted(PUBLIC_MODULES))}, "
                       "pallas_kernels.<op>)")  # fmt: skip
      continue
    exported = _exported(module)
    hidden = [n for n in names if exported is not None and n not in exported | DUNDER_OK | {"*"}]
    if hidden:
      offenders.append(f"{where}: {', '.join(hidden)} not in its __all__")
  assert not offenders, "\n".join(offenders)
