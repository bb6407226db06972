"""The quickstart notebook runs top to bottom on a CPU."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # the dev extra (absent from the GPU image: skipped there)
NotebookClient = pytest.importorskip("nbclient").NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_executes():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs)
    assert "loss" in outputs and "->" in outputs
