"""examples/colab_demo.ipynb: built from its source, free of outputs, executed top to bottom
on CPU (SMALL settings) with its plots checked, and its text free of numbers it does not
compute."""

import base64
import io
import re
import time

import matplotlib.image
import nbformat
import numpy as np
import pytest
from notebooks import NOTEBOOK, ROOT, build


def _cells(notebook):
  return [(cell.cell_type, cell.source) for cell in notebook.cells]


def test_notebook_is_built_from_its_source_without_outputs():
  committed = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(committed)
  assert _cells(committed) == _cells(build()), "run `python tests/notebooks.py` after editing"
  for cell in committed.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, "outputs are not committed"


def test_the_first_code_cell_runs_kvjax_doctor():
  code = [cell.source for cell in build().cells if cell.cell_type == "code"]
  assert '"kvjax.cli", "doctor"' in code[0]


def test_the_text_states_no_number_the_notebook_does_not_compute():
  """Markdown cells carry no figures: every number the reader sees is an output."""
  for cell in build().cells:
    if cell.cell_type == "markdown":
      # Code spans are names (`h2o`, `SMALL`), not figures; so is the model's name.
      text = re.sub(r"`[^`]*`", "", cell.source).replace("SmolLM2-135M-Instruct", "")
      assert not re.search(r"\d", text), text


def _png_images(notebook):
  for cell in notebook.cells:
    for output in cell.get("outputs", []):
      data = output.get("data", {})
      if "image/png" in data:
        yield base64.b64decode(data["image/png"])


# About three minutes (its first cell runs `kvjax doctor`'s self-check, test_doctor's own
# subject): under -m slow, run before a change to the notebook or the APIs it calls lands.
@pytest.mark.slow
def test_notebook_runs_top_to_bottom_on_cpu():
  from nbclient import NotebookClient

  notebook = build()
  start = time.perf_counter()
  NotebookClient(
      notebook, timeout=1200, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
  ).execute()  # raises CellExecutionError naming the cell that failed
  seconds = time.perf_counter() - start
  images = list(_png_images(notebook))
  assert len(images) == 2, f"expected the memory and the quality plots, got {len(images)}"
  for png in images:
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    pixels = matplotlib.image.imread(io.BytesIO(png), format="png")
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100 and np.std(pixels) > 0.01
  text = "".join(
      output.get("text", "") for cell in notebook.cells for output in cell.get("outputs", [])
  )
  assert "self-check:" in text and "passed" in text and "SMALL = True" in text
  print(f"notebook executed in {seconds:.0f} s")


if __name__ == "__main__":
  pytest.main([__file__, "-q", "-s"])
