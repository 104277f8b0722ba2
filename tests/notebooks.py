"""The Colab notebook and its reviewable source: examples/colab_demo.py (jupytext "percent"
format: `# %%` starts a code cell, `# %% [markdown]` a markdown cell whose lines are
commented) is the source; examples/colab_demo.ipynb is built from it, without outputs.

    python tests/notebooks.py      # rewrite the .ipynb after editing the .py

tests/test_colab_demo.py checks that the two agree and executes the notebook.
"""

from __future__ import annotations

import pathlib
import re

import nbformat

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE = ROOT / "examples" / "colab_demo.py"
NOTEBOOK = ROOT / "examples" / "colab_demo.ipynb"

# Opens on Colab with a GPU runtime; Jupyter elsewhere uses the python3 kernel.
METADATA = {
    "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
    "accelerator": "GPU",
    "colab": {"provenance": [], "gpuType": "T4"},
}


def cells(source: str) -> list[tuple[str, str]]:
  """(kind, text) per cell of a percent-format script; the header before the first cell
  (jupytext's metadata block) is dropped."""
  parts = re.split(r"^# %%(.*)$", source, flags=re.M)
  out = []
  for marker, body in zip(parts[1::2], parts[2::2]):
    lines = body.strip("\n").splitlines()
    if "[markdown]" in marker:
      text = "\n".join(re.sub(r"^# ?", "", line) for line in lines)
      out.append(("markdown", text))
    else:
      out.append(("code", "\n".join(lines)))
  return out


def build(source: str = None) -> nbformat.NotebookNode:
  source = SOURCE.read_text() if source is None else source
  new = {"markdown": nbformat.v4.new_markdown_cell, "code": nbformat.v4.new_code_cell}
  notebook = nbformat.v4.new_notebook(
      cells=[new[kind](text) for kind, text in cells(source)], metadata=METADATA
  )
  for i, cell in enumerate(notebook.cells):
    cell["id"] = f"cell-{i}"  # stable ids: the file changes only when the source does
  return notebook


def main() -> None:
  nbformat.write(build(), NOTEBOOK)
  print(f"wrote {NOTEBOOK.relative_to(ROOT)}")


if __name__ == "__main__":
  main()
