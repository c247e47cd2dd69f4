"""What a learner sees on opening a notebook, before running anything (the stored outputs).

``notebooks/store.py`` stores every notebook as executed against the untouched exercise stubs, with widget views
removed; these checks keep it that way: no widget view (it would show "Error displaying widget: model not
found"), no error output, nothing graded from ``solutions/``, and every cell whose output depends on the
exercise tagged for nbval, which instead proves the solutions in CI (``grading.check`` raises in solutions mode
unless every check passes).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import REPO, WITHOUT_EXERCISE

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
IGNORE = "nbval-ignore-output"


def _code_cells(path: Path) -> list[dict]:
    return [cell for cell in json.loads(path.read_text())["cells"] if cell["cell_type"] == "code"]


def _text(output: dict) -> str:
    if "text" in output:
        return "".join(output["text"])
    return "".join(output.get("data", {}).get("text/plain", ""))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_stored_widget_view_or_widget_state(notebook):
    data = json.loads(notebook.read_text())
    assert "widgets" not in data.get("metadata", {}), "saved widget state: store with notebooks/store.py"
    for index, cell in enumerate(_code_cells(notebook)):
        for output in cell.get("outputs", []):
            assert WIDGET_VIEW not in output.get("data", {}), (
                f"{notebook.name}, code cell {index}: a stored widget view shows 'model not found' to a learner")


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_stored_error_and_nothing_graded_from_the_solutions(notebook):
    for index, cell in enumerate(_code_cells(notebook)):
        for output in cell.get("outputs", []):
            assert output["output_type"] != "error", f"{notebook.name}, code cell {index} stores a traceback"
            text = _text(output)
            assert "Traceback (most recent call last)" not in text or "RankFailed" in "".join(cell["source"]), (
                f"{notebook.name}, code cell {index} prints a traceback nobody asked for")
            assert "(solutions)" not in text and "solutions/" not in text, (
                f"{notebook.name}, code cell {index}: stored output comes from solutions mode")


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_cells_that_run_the_exercise_are_friendly_and_tagged_for_nbval(notebook):
    cells = _code_cells(notebook)
    grading_cells = [cell for cell in cells if re.search(r"grading\.check\(", "".join(cell["source"]))]
    if notebook.stem in WITHOUT_EXERCISE:  # said so, and kept so: a grading cell there would grade nothing new
        assert not grading_cells, f"{notebook.name} is listed without an exercise but has a grading cell"
    else:
        assert grading_cells, f"{notebook.name} has no grading cell"
    for cell in cells:
        source = "".join(cell["source"])
        uses_exercise = re.search(r"\bexercise\.\w+\(", source) or "grading.check(" in source
        if uses_exercise:
            assert IGNORE in cell.get("metadata", {}).get("tags", []), (
                f"{notebook.name}: a cell running the exercise must be tagged {IGNORE}:\n{source[:200]}")
        if re.search(r"\bexercise\.\w+\(", source):
            assert "grading.trying(" in source, (
                f"{notebook.name}: wrap the exercise's calls in `with grading.trying(...)`:\n{source[:200]}")


def _parsed(source: str):
    import ast

    # IPython's magics and shell escapes are not Python: blank them out before parsing.
    lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()]
    return ast.parse("\n".join(lines))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_claim_goes_through_labkit_claims_and_none_is_stored_missed(notebook):
    """labkit/claims.py: no bare assert (a measured one would abort a learner's Run All; a computed one prints
    nothing the text can point to); at least one claim; no stored output that records a missed claim."""
    import ast

    claims_made = 0
    for index, cell in enumerate(_code_cells(notebook)):
        source = "".join(cell["source"])
        tree = _parsed(source)
        asserts = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]
        assert not asserts, (f"{notebook.name}, code cell {index}: a bare assert (line {asserts[0]}); state the claim "
                             "with labkit.claims (exact/close/holds, or measured/measured_holds with a cited band)")
        claims_made += sum(1 for node in ast.walk(tree) if isinstance(node, ast.Call)
                           and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
                           and node.func.value.id == "claims")
        if IGNORE in cell.get("metadata", {}).get("tags", []):
            continue
        for output in cell.get("outputs", []):
            missed = [line for line in _text(output).splitlines() if line.startswith("✗ ")]
            assert not missed, f"{notebook.name}, code cell {index} stores a missed claim: {missed[0]}"
    assert claims_made, f"{notebook.name} states no claim through labkit.claims"
