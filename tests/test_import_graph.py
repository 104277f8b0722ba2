"""The packages' import graph has no cycle, counting imports inside functions too: a cycle
hidden by a deferred import is still two modules that cannot be read (or moved) apart."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("kvjax", "kvjax_store", "models", "pallas_kernels")


def _modules() -> dict[str, pathlib.Path]:
  modules = {}
  for package in PACKAGES:
    for path in (ROOT / package).rglob("*.py"):
      parts = list(path.relative_to(ROOT).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts.pop()
      modules[".".join(parts)] = path
  return modules


def _targets(module: str, path: pathlib.Path, node, modules) -> list[str]:
  """The modules of ours an import statement in `module` loads."""
  if isinstance(node, ast.Import):
    names = [alias.name for alias in node.names]
  else:
    base = node.module or ""
    if node.level:  # relative: from the module's package, `level - 1` packages up
      package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
      package = package[: len(package) - (node.level - 1)]
      base = ".".join(package + ([base] if base else []))
    names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
  found = []
  for name in names:
    while name and name not in modules:
      name = name.rpartition(".")[0]
    if name and name != module:
      found.append(name)
  return found


def import_graph() -> dict[str, set[str]]:
  modules = _modules()
  graph = {m: set() for m in modules}
  for module, path in modules.items():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        graph[module].update(_targets(module, path, node, modules))
  return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan, iterative)."""
  index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], 0
  for start in graph:
    if start in index:
      continue
    work = [(start, iter(sorted(graph[start])))]
    index[start] = low[start] = counter
    counter += 1
    stack.append(start)
    on_stack.add(start)
    while work:
      node, edges = work[-1]
      for nxt in edges:
        if nxt not in index:
          index[nxt] = low[nxt] = counter
          counter += 1
          stack.append(nxt)
          on_stack.add(nxt)
          work.append((nxt, iter(sorted(graph[nxt]))))
          break
        if nxt in on_stack:
          low[node] = min(low[node], index[nxt])
      else:
        work.pop()
        if work:
          low[work[-1][0]] = min(low[work[-1][0]], low[node])
        if low[node] == index[node]:
          component = []
          while True:
            member = stack.pop()
            on_stack.discard(member)
            component.append(member)
            if member == node:
              break
          if len(component) > 1:
            found.append(sorted(component))
  return found


def test_the_finder_sees_a_cycle():
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
  graph = import_graph()
  assert {"kvjax.runtime.session", "kvjax.cache.pages", "models.registry"} <= graph.keys()
  assert "kvjax.cache.pages" in graph["kvjax.runtime.pool"]  # the graph sees our imports
  assert cycles(graph) == []
