"""The notebooks (notebooks/*.ipynb) run top to bottom on a CPU with their parameters shrunk, and the assertions in
their own cells hold: the quickstart's loss falls and it answers, answers become right, a trace rebuilds its sampler's
answers, DFlash's accepted lengths add up to its answer, the Monte-Carlo likelihood's spread falls with ``mc_num``, RL
lifts held-out accuracy.

Shrinking is papermill's: a cell inserted after the one tagged ``parameters`` assigns the values below (and a
``RUN_DIR`` in the test's folder). Run as shipped, each notebook takes under 5 minutes on a 2-core CPU."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # the dev extra (absent from the GPU image: skipped there)
NotebookClient = pytest.importorskip("nbclient").NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
SHRUNK = {
    "quickstart.ipynb": {"STEPS": 200},
    # as shipped: at 300 steps its exact match sat on the cells' thresholds (0.50-0.70, by sampler and run; 0.97 at 600)
    "mdlm.ipynb": {"STEPS": 600, "VAL_EVERY": 150},
    "diffusion_gemma.ipynb": {"STEPS": 200, "VAL_EVERY": 100},
    "dflash.ipynb": {"TARGET_STEPS": 200, "DRAFT_STEPS": 200, "VAL_EVERY": 100},
    "evaluation.ipynb": {"STEPS": 350, "LIMIT": 32, "SEEDS": 8},
    "rl.ipynb": {"RL_STEPS": 20, "VAL_EVERY": 5},
}
"""Each notebook's parameters in the tests (under 90 s each on a 2-core CPU; the MDLM notebook about 150 s)."""
PRINTED = {"quickstart.ipynb": ["loss", "->"]}
"""What a notebook's outputs must show beside its own assertions (the quickstart: its loss, and answers)."""


def parameters_cell(notebook) -> int:
    return next(i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", []))


def run_notebook(name: str, parameters: dict, run_dir: Path):
    """The notebook ``name`` executed with ``parameters`` injected after its parameters cell."""
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    injected = "\n".join(f"{key} = {value!r}" for key, value in {**parameters, "RUN_DIR": str(run_dir)}.items())
    notebook.cells.insert(parameters_cell(notebook) + 1,
                          nbformat.v4.new_code_cell(injected, metadata={"tags": ["injected-parameters"]}))
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return notebook


def test_every_notebook_is_run_here_and_shrinks_only_its_own_parameters():
    assert sorted(path.name for path in NOTEBOOKS.glob("*.ipynb")) == sorted(SHRUNK)
    for name, parameters in SHRUNK.items():
        notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
        assigned = notebook.cells[parameters_cell(notebook)].source
        assert all(f"\n{key} = " in f"\n{assigned}" for key in [*parameters, "RUN_DIR"]), name
        assert not any(cell.get("outputs") for cell in notebook.cells), f"{name} is stored with outputs"


@pytest.mark.parametrize("name", SHRUNK)
def test_the_notebook_runs_and_its_assertions_hold(name, tmp_path):
    notebook = run_notebook(name, SHRUNK[name], tmp_path)
    pictures = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
                if "image/png" in output.get("data", {})]
    assert pictures  # its curves, traces or spreads were drawn
    assert list(tmp_path.glob("*/version_0/events.out.tfevents.*"))  # the curves came from the run's own logs
    printed = "".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                      for output in cell.outputs)
    assert all(text in printed for text in PRINTED.get(name, [])), name
