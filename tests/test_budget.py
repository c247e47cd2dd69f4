"""The suite's time budget (.ci/budget.py): each stage's wall time recorded, printed against its budget, and an
overrun past the margin failing the run where the budget applies (CI, or LABKIT_BUDGET=enforce)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from tests.conftest import REPO

BUDGET = [sys.executable, str(REPO / ".ci" / "budget.py")]
_spec = importlib.util.spec_from_file_location("budget", REPO / ".ci" / "budget.py")
module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(module)


def budget(*args: str, tmp_path, enforce: bool = False) -> subprocess.CompletedProcess:
    environment = {"LABKIT_TIMINGS": str(tmp_path / "timings.tsv"), "PATH": "/usr/bin:/bin"}
    if enforce:
        environment["LABKIT_BUDGET"] = "enforce"
    return subprocess.run([*BUDGET, *args], capture_output=True, text=True, env=environment, timeout=60)


def test_a_stage_is_timed_and_passes_on_its_commands_exit_status(tmp_path):
    ran = budget("run", "unit", "--", sys.executable, "-c", "import sys, time; time.sleep(0.2); sys.exit(3)",
                 tmp_path=tmp_path)
    assert ran.returncode == 3 and "[budget] unit: 0 min 00." in ran.stdout
    stage, seconds, status = (tmp_path / "timings.tsv").read_text().split()
    assert stage == "unit" and 0.2 <= float(seconds) < 10 and status == "3"


def test_an_overrun_past_the_margin_fails_only_where_the_budget_applies(tmp_path):
    limit = module.BUDGETS["nbval"] * (1 + module.MARGIN)
    (tmp_path / "timings.tsv").write_text(f"venv\t10.0\t0\nnbval\t{limit + 1:.1f}\t0\n")
    printed = budget("report", tmp_path=tmp_path)
    assert printed.returncode == 0 and "OVER BUDGET" in printed.stdout and "not enforced here" in printed.stdout
    enforced = budget("report", tmp_path=tmp_path, enforce=True)
    assert enforced.returncode == 1 and "FAILED: the suite's time budget: stage 'nbval' took" in enforced.stdout
    (tmp_path / "timings.tsv").write_text(f"venv\t10.0\t0\nnbval\t{limit - 1:.1f}\t0\n")
    within = budget("report", tmp_path=tmp_path, enforce=True)
    assert within.returncode == 0 and "OVER BUDGET" not in within.stdout and "venv" in within.stdout


def test_the_targets_hold_the_issues_limits_margin_included():
    with_margin = {stage: seconds * (1 + module.MARGIN) for stage, seconds in module.TARGETS.items()}
    assert module.TARGETS.keys() == module.BUDGETS.keys()
    assert all(module.TARGETS[stage] <= module.BUDGETS[stage] for stage in module.BUDGETS)
    assert with_margin["unit"] + with_margin["browser"] <= 12 * 60  # make test
    assert sum(with_margin.values()) <= 20 * 60  # .ci/run


def test_an_unknown_stage_is_refused(tmp_path):
    refused = budget("run", "lint", "--", "true", tmp_path=tmp_path)
    assert refused.returncode != 0 and "unknown stage 'lint'" in refused.stderr
