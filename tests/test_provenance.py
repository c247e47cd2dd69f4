"""The sanitizer masks by provenance: a changed model constant or formula fails the notebooks that print it.

``notebooks/sanitize.cfg`` masks only values marked measured (``~``), so what the cost model, the planner and the
memory model print is compared digit for digit.  These tests prove it the way a contributor would meet it: copy
the library and the notebooks, perturb one cost-model constant (the H100's bf16 peak) and one memory-model term
(Korthikanti et al.'s 34 bytes per ``sbh`` of a layer's activations), run the notebooks that print them, and
compare each cell's outputs with the stored ones as nbval does.  The perturbed copy must differ; the same cells run
from an untouched copy must not, so the difference is the perturbation's and nothing else's.

Only each notebook's analytical opening is run — its cells before the first that launches ranks — which is where
these lessons print their models' figures, and which takes seconds.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.notebook_outputs import output_differences

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

MUTATIONS = {  # name -> (text in labkit/costmodel, its replacement, notebooks that print a figure it changes)
    "the H100's bf16 peak, a cost-model constant": (
        '"H100 80GB": GPU("H100 80GB", 80e9, 989e12,', '"H100 80GB": GPU("H100 80GB", 80e9, 990e12,',
        ("00_setup", "06_tensor_parallel")),
    "the 24 sbh bytes tensor parallelism splits, a memory-model term (Korthikanti's 34 = 10 + 24)": (
        "return s * b * h * (replicated + 24 / t", "return s * b * h * (replicated + 25 / t", ("06_tensor_parallel",)),
}


def _file_holding(root: Path, text: str) -> Path:
    holding = [path for path in (root / "labkit" / "costmodel").rglob("*.py") if text in path.read_text()]
    assert len(holding) == 1, f"{text!r} occurs in {len(holding)} files of labkit/costmodel: update MUTATIONS"
    return holding[0]


def _copy(destination: Path) -> Path:
    for folder in ("labkit", "notebooks", "exercises", "solutions"):
        shutil.copytree(REPO / folder, destination / folder,
                        ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints"))
    return destination


def _analytical_opening(notebook: nbformat.NotebookNode) -> int:
    """How many cells come before the first code cell that launches ranks."""
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type == "code" and "launch(" in cell.source:
            return index
    return len(notebook.cells)


def _run_opening(root: Path, name: str) -> list[str]:
    """Run the analytical opening of ``root``'s notebook ``name`` with ``root``'s labkit first on the path; return
    its differences from the stored outputs of the repository's own notebook."""
    stored = nbformat.read(REPO / "notebooks" / f"{name}.ipynb", as_version=4)
    count = _analytical_opening(stored)
    notebook = nbformat.read(root / "notebooks" / f"{name}.ipynb", as_version=4)
    notebook.cells = notebook.cells[:count]
    environment = {key: value for key, value in os.environ.items() if key != "LABKIT_SOLUTIONS"}
    environment.update(PYTHONPATH=str(root), LABKIT_STRICT_CLAIMS="1")
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3", allow_errors=True,
                                     resources={"metadata": {"path": str(root / "notebooks")}})
    previous = dict(os.environ)
    os.environ.clear()
    os.environ.update(environment)  # the kernel inherits this process's environment
    try:
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(previous)
    fresh = [cell.get("outputs", []) for cell in notebook.cells]
    return output_differences(stored.cells[:count], fresh, lambda index: f"{name} cell {index}")


@pytest.fixture(scope="module")
def untouched(tmp_path_factory):
    """The differences of an untouched copy's notebook opening from the stored outputs, by notebook name: each
    opening run once for the module (two mutations print through notebook 06)."""
    root, differences = _copy(tmp_path_factory.mktemp("untouched")), {}

    def run(name: str) -> list[str]:
        if name not in differences:
            differences[name] = _run_opening(root, name)
        return differences[name]

    return run


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_a_perturbed_model_fails_the_notebooks_that_print_it(mutation, untouched, tmp_path):
    text, replacement, notebooks = MUTATIONS[mutation]
    root = _copy(tmp_path)
    path = _file_holding(root, text)
    path.write_text(path.read_text().replace(text, replacement))
    for name in notebooks:
        assert not untouched(name), f"{name}: the untouched copy already differs from the stored outputs"
        found = _run_opening(root, name)
        assert found, f"{name}: perturbing {mutation} changed nothing nbval compares: is its output masked?"
