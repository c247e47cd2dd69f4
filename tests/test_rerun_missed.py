"""One more run for a notebook whose first failure is a measured claim's miss (``make nbval``:
notebooks/rerun_missed.py; the browser test: ``first_failure_is_a_measured_miss``), and for nothing else."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.test_browser import first_failure_is_a_measured_miss

SCRIPT = REPO / "notebooks" / "rerun_missed.py"
_spec = importlib.util.spec_from_file_location("rerun_missed", SCRIPT)
rerun_missed = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rerun_missed)

MISS = "ClaimFailed: the step: expected 0.8x to 1.25x of 1.00, measured ~1.3 (strict mode: LABKIT_STRICT_CLAIMS=1)"
COMPUTED = "ClaimFailed: bytes sent equal the model's: expected 2, got 1"


def test_only_notebooks_whose_first_failure_is_a_measured_miss_run_again():
    def failure(nodeid: str, text: str) -> dict[str, str]:
        return {"nodeid": nodeid, "text": text}

    later_fallout = [failure("notebooks/07.ipynb::Cell 6", MISS), failure("notebooks/07.ipynb::Cell 9", "NameError")]
    assert rerun_missed.to_run_again(later_fallout) == ["notebooks/07.ipynb"]
    assert rerun_missed.to_run_again([failure("notebooks/11.ipynb::Cell 24", MISS),
                                      failure("notebooks/00.ipynb::Cell 3", MISS)]) == ["notebooks/11.ipynb",
                                                                                        "notebooks/00.ipynb"]
    assert rerun_missed.to_run_again([failure("notebooks/07.ipynb::Cell 2", "NameError"),
                                      failure("notebooks/07.ipynb::Cell 6", MISS)]) is None
    assert rerun_missed.to_run_again([failure("notebooks/04.ipynb::Cell 14", COMPUTED)]) is None
    assert rerun_missed.to_run_again([failure("notebooks/11.ipynb::Cell 24", MISS),
                                      failure("notebooks/04.ipynb::Cell 14", COMPUTED)]) is None
    assert rerun_missed.to_run_again([]) is None


def test_the_browser_test_runs_again_only_after_a_measured_miss_came_first():
    error = "Run All: error in cell 24 (In [12]: 'import statistics'): "
    never_ran = "Run All: cell 26 (In [ ]: 'grading.check(\"planning\")') never ran"
    assert first_failure_is_a_measured_miss([error + MISS, never_ran, error + "NameError: x"])
    assert not first_failure_is_a_measured_miss([error + "NameError: x", error + MISS])
    assert not first_failure_is_a_measured_miss([error + COMPUTED])
    assert not first_failure_is_a_measured_miss(["Run All: the command failed: Error", error + MISS])
    assert not first_failure_is_a_measured_miss([never_ran])


FLAKY = '''
from pathlib import Path
from labkit import claims

def test_a_timed_cell(monkeypatch):
    monkeypatch.setenv(claims.STRICT_VARIABLE, "1")
    runs = Path(__file__).with_suffix(".runs")
    runs.write_text(runs.read_text() + "x" if runs.exists() else "x")
    missed = len(runs.read_text()) <= {misses}
    claims.measured("the step", 2.0 if missed else 1.0, 1.0, claims.Band(0.8, 1.25, source="10 runs"))

def test_a_cell_after_it():
    assert {fine}
'''


@pytest.mark.parametrize("misses, fine, status, runs", [
    (1, True, 0, 2),    # a miss, then a pass: the second run decides
    (2, True, 1, 2),    # missed twice: fails
    (0, False, 1, 1),   # a plain failure: no second run
    (1, False, 1, 2),   # a miss first, and a failure after it: run again, where the other failure fails it
])
def test_rerun_missed_runs_a_notebook_again_once_and_its_status_is_the_second_runs(tmp_path, misses, fine,
                                                                                    status, runs):
    folder = tmp_path / "notebooks"
    folder.mkdir()
    (folder / "test_lesson.py").write_text(FLAKY.format(misses=misses, fine=fine))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(folder)]
    done = subprocess.run([sys.executable, str(SCRIPT), str(folder), "--", *command], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120,
                          env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})  # nbval & co.: seconds each
    assert done.returncode == status, done.stdout + done.stderr
    ran = len((folder / "test_lesson.runs").read_text())
    assert ran == runs, done.stdout
    assert ("once more" in done.stdout) == (misses > 0), done.stdout
