"""The docs site (mkdocs.yml): it builds with `mkdocs build --strict` (a warning, e.g. a
docstring naming a parameter that does not exist or a broken link, fails it), every guide in
docs/ is in its nav, and its API reference documents every public name.

Public names: the `__all__` of each module in `PUBLIC_MODULES`. A name counts as documented
when the reference's inventory (`objects.inv`, which mkdocstrings writes) holds it at that
path, or holds the object it names at its own path (a name re-exported by two modules is
documented once: `kvjax.persistence.save_state` as `kvjax.save_state`, whose inventory entry
also records `kvjax.persistence._save.save_state`).
"""

import importlib
import inspect
import pathlib
import subprocess
import sys
import zlib

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]

PUBLIC_MODULES = (
    "kvjax",
    "kvjax.cache",
    "kvjax.eviction",
    "kvjax.policies",
    "kvjax.eval",
    "kvjax.tuning",
    "kvjax.persistence",
    "kvjax.seam",
    "kvjax.sharding",
    "kvjax.serving",
    "kvjax.spec",
    "kvjax.testing",
    "kvjax.fingerprint",
    "models",
    "pallas_kernels.paged_attention",
    "pallas_kernels.output_impact",
    "pallas_kernels.group_importance",
    "pallas_kernels.page_format",
    "kvjax_store.cache_dir",
    "kvjax_store.files",
)


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> tuple[pathlib.Path, subprocess.CompletedProcess]:
  """The site, built once for this file's tests: (its directory, the finished build)."""
  out = tmp_path_factory.mktemp("site")
  command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
  return out, subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def site(build) -> pathlib.Path:
  out, done = build
  if done.returncode != 0:
    pytest.fail("the site did not build: see test_site_builds_strict", pytrace=False)
  return out


def _inventory(site: pathlib.Path) -> set[str]:
  """The object names of a Sphinx inventory (v2): four header lines, then zlib-compressed
  lines `name domain:role priority uri display-name`."""
  data = (site / "objects.inv").read_bytes()
  header = data.split(b"\n", 4)
  assert header[0] == b"# Sphinx inventory version 2", header[0]
  body = zlib.decompress(header[4]).decode()
  return {line.split(" ", 1)[0] for line in body.splitlines() if line.strip()}


def _own_path(obj) -> str | None:
  """A class's or function's path where it is defined; None for other values."""
  obj = inspect.unwrap(obj) if callable(obj) else obj
  if inspect.isclass(obj) or inspect.isfunction(obj):
    return f"{obj.__module__}.{obj.__qualname__}"
  return None


def test_site_builds_strict(build):
  out, done = build
  if done.returncode != 0:
    output = done.stdout + done.stderr
    warnings = [line for line in output.splitlines() if line.startswith(("WARNING", "ERROR"))]
    pytest.fail(
        f"mkdocs build --strict exited {done.returncode}; its warnings and errors:\n"
        + "\n".join(warnings)
        + f"\n\nits whole output:\n{output}",
        pytrace=False,
    )
  assert (out / "index.html").is_file()
  assert (out / "reference" / "kvjax" / "index.html").is_file()


def test_every_guide_is_in_the_nav():
  config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

  def pages(nav):
    for entry in nav:
      if isinstance(entry, str):
        yield entry
      else:
        for value in entry.values():
          yield from pages(value) if isinstance(value, list) else [value]

  in_nav = set(pages(config["nav"]))
  guides = {p.name for p in (ROOT / "docs").glob("*.md")}
  assert guides - in_nav == set(), f"docs pages missing from mkdocs.yml's nav: {guides - in_nav}"


def test_no_guide_links_a_folder():
  """A link to a folder of docs/ has no page on the built site (mkdocs serves pages and
  files, not listings): a guide links the file a reader should open."""
  import re

  folders = []
  for page in sorted((ROOT / "docs").glob("*.md")):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(\s*<?([^)\s>]+)>?\)", text):
      if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
        continue
      if (page.parent / target.split("#", 1)[0]).is_dir():
        folders.append(f"{page.name}: {target}")
  assert not folders, f"guides link folders, which 404 on the site: {folders}"


def test_every_public_name_is_in_the_reference(site):
  documented = _inventory(site)
  missing, without_all = [], []
  for module_name in PUBLIC_MODULES:
    module = importlib.import_module(module_name)
    if not hasattr(module, "__all__"):
      without_all.append(module_name)
      continue
    for name in module.__all__:
      own = _own_path(getattr(module, name))
      if f"{module_name}.{name}" not in documented and own not in documented:
        path = f"{module_name}.{name}"
        missing.append(path + (f" (defined as {own})" if own and own != path else ""))
  assert not without_all, f"modules without __all__ (their public names): {without_all}"
  assert (
      not missing
  ), "public names missing from the API reference (docs/reference/*.md):\n" + "\n".join(missing)
