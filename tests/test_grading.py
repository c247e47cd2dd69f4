"""The graders: full marks for the solution, zero for the stub, and every plausible wrong answer rejected."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from labkit import grading
from labkit.grading.checkers import collectives as collectives_checks
from labkit.grading.checkers import data_parallel as data_parallel_checks
from labkit.grading.checkers import lr_scaling as lr_scaling_checks
from labkit.grading.checkers import mixed_precision as mixed_precision_checks
from labkit.grading.checkers import setup as setup_checks
from labkit.grading.checkers import zero as zero_checks
from tests.conftest import REPO

WRONG = REPO / "tests" / "wrong_answers"
SETUP_CHECKS = [grading.check_name(check) for check in setup_checks.CHECKS]
COLLECTIVES_CHECKS = [grading.check_name(check) for check in collectives_checks.CHECKS]
DATA_PARALLEL_CHECKS = [grading.check_name(check) for check in data_parallel_checks.CHECKS]
LR_SCALING_CHECKS = [grading.check_name(check) for check in lr_scaling_checks.CHECKS]
MP = [grading.check_name(check) for check in mixed_precision_checks.CHECKS]
ZERO_CHECKS = [grading.check_name(check) for check in zero_checks.CHECKS]


def _failed(report: grading.Report) -> set[str]:
    return {result.name for result in report.checks if not result.passed}


def test_every_exercise_has_a_stub_a_solution_and_a_checker():
    for topic, (file_name, checker, _title) in grading.EXERCISES.items():
        assert (REPO / "exercises" / file_name).is_file(), topic
        assert (REPO / "solutions" / file_name).is_file(), topic
        assert __import__(checker, fromlist=["CHECKS"]).CHECKS, topic


@pytest.mark.parametrize("topic", list(grading.EXERCISES))
def test_the_solution_gets_full_marks(topic):
    report = grading.check(topic, solutions=True, verbose=False)
    assert report.all_passed, [(r.name, r.message) for r in report.checks if not r.passed]


@pytest.mark.parametrize("topic", list(grading.EXERCISES))
def test_the_untouched_stub_gets_zero(topic):
    report = grading.check(topic, solutions=False, verbose=False)
    assert report.total > 0 and report.passed == 0
    assert all("not implemented yet" in result.message for result in report.checks)


@pytest.mark.parametrize(
    ("topic", "folder", "caught_by"),
    [
        ("setup", "setup_unbalanced", {SETUP_CHECKS[1]}),
        ("setup", "setup_no_all_reduce", {SETUP_CHECKS[2]}),
        ("setup", "setup_mean_of_means", {SETUP_CHECKS[3]}),
        ("collectives", "collectives_wrong_chunk", set(COLLECTIVES_CHECKS) - {COLLECTIVES_CHECKS[1]}),
        ("collectives", "collectives_missed_step", set(COLLECTIVES_CHECKS) - {COLLECTIVES_CHECKS[1]}),
        ("collectives", "collectives_all_gather_missed_step", set(COLLECTIVES_CHECKS) - {COLLECTIVES_CHECKS[0]}),
        ("collectives", "collectives_built_in", {COLLECTIVES_CHECKS[3]}),
        ("data_parallel", "data_parallel_no_broadcast", {DATA_PARALLEL_CHECKS[0], DATA_PARALLEL_CHECKS[2]}),
        ("data_parallel", "data_parallel_params_only", {DATA_PARALLEL_CHECKS[0], DATA_PARALLEL_CHECKS[2]}),
        ("data_parallel", "data_parallel_sum_not_average", {DATA_PARALLEL_CHECKS[1], DATA_PARALLEL_CHECKS[2]}),
        ("data_parallel", "data_parallel_buckets_forward", {DATA_PARALLEL_CHECKS[3]}),
        ("data_parallel", "data_parallel_buckets_overflow", {DATA_PARALLEL_CHECKS[3]}),
        ("lr_scaling", "lr_scaling_warmup_from_zero", {LR_SCALING_CHECKS[3]}),
        ("lr_scaling", "lr_scaling_ignores_accumulation", {LR_SCALING_CHECKS[0], LR_SCALING_CHECKS[2]}),
        ("lr_scaling", "lr_scaling_lr_times_world_size", {LR_SCALING_CHECKS[2]}),
        ("lr_scaling", "lr_scaling_warmup_off_by_one", {LR_SCALING_CHECKS[3]}),
        ("lr_scaling", "lr_scaling_no_decay", {LR_SCALING_CHECKS[4]}),
        ("lr_scaling", "lr_scaling_sqrt_rule", {LR_SCALING_CHECKS[1], LR_SCALING_CHECKS[2]}),
        ("mixed_precision", "mixed_precision_never_grows", {MP[2], MP[3]}),
        ("mixed_precision", "mixed_precision_steps_on_overflow", {MP[1], MP[3]}),
        ("mixed_precision", "mixed_precision_no_reset", {MP[2], MP[3]}),
        ("mixed_precision", "mixed_precision_grows_every_step", {MP[2], MP[3]}),
        ("mixed_precision", "mixed_precision_misses_nan", {MP[0], MP[3]}),
        ("mixed_precision", "mixed_precision_multiplies", {MP[0], MP[3]}),
        ("zero", "zero_unsharded_state", {ZERO_CHECKS[1]}),
        ("zero", "zero_missing_gather", {ZERO_CHECKS[2]}),
        ("zero", "zero_round_robin", {ZERO_CHECKS[0]}),
        ("zero", "zero_unsorted_greedy", {ZERO_CHECKS[0]}),
        ("zero", "zero_counts_parameters", {ZERO_CHECKS[0]}),
        ("zero", "zero_broadcast_from_rank_zero", {ZERO_CHECKS[2]}),
        ("zero", "zero_adam_not_adamw", {ZERO_CHECKS[1]}),
    ],
)
def test_plausible_wrong_answers_fail_exactly_the_checks_that_catch_them(topic, folder, caught_by):
    report = grading.check(topic, directory=WRONG / folder, verbose=False)
    assert _failed(report) == caught_by


def test_student_code_that_loops_for_ever_is_a_failed_check_not_a_stuck_grader(monkeypatch):
    monkeypatch.setattr(grading, "DEFAULT_CHECK_TIMEOUT", 3.0)
    report = grading.check("setup", directory=WRONG / "setup_endless_loop", verbose=False)
    looping = [r for r in report.checks if r.name in SETUP_CHECKS[:2]]
    assert all(not r.passed and "did not finish within 3 s" in r.message for r in looping)
    assert all(r.seconds < 10 for r in looping)


def test_student_code_that_hangs_in_a_collective_is_a_failed_check(monkeypatch):
    monkeypatch.setattr(setup_checks, "LAUNCH_TIMEOUT", 3.0)
    report = grading.check("setup", directory=WRONG / "setup_rank_zero_only", verbose=False)
    result = next(r for r in report.checks if r.name == SETUP_CHECKS[2])
    assert not result.passed and "hung" in result.message


def test_student_code_that_kills_its_process_is_a_failed_check():
    report = grading.check("setup", directory=WRONG / "setup_crash", verbose=False)
    result = report.checks[0]
    assert not result.passed and "exit code 3" in result.message


def test_a_syntax_error_fails_every_check_with_the_import_error():
    report = grading.check("setup", directory=WRONG / "setup_syntax_error", verbose=False)
    assert report.passed == 0
    assert all("could not import 00_setup.py: SyntaxError" in r.message for r in report.checks)


def test_check_prints_one_line_per_check_and_the_score(capsys):
    grading.check("setup", directory=WRONG / "setup_mean_of_means")
    out = capsys.readouterr().out
    assert out.count("✓") == 3 and out.count("✗") == 1
    assert "Score: 3/4" in out
    assert "→" in out  # the hint


def test_labkit_solutions_environment_variable_selects_the_solutions(monkeypatch):
    monkeypatch.setenv("LABKIT_SOLUTIONS", "1")
    assert grading.exercise_path("setup").parent.name == "solutions"
    monkeypatch.setenv("LABKIT_SOLUTIONS", "0")
    assert grading.exercise_path("setup").parent.name == "exercises"
    monkeypatch.delenv("LABKIT_SOLUTIONS")
    assert grading.exercise_path("setup").parent.name == "exercises"


def test_an_unknown_topic_is_a_value_error():
    with pytest.raises(ValueError, match="unknown exercise topic 'nope'"):
        grading.check("nope")


def test_a_missing_file_names_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="00_setup.py"):
        grading.check("setup", directory=tmp_path)


# ---------------------------------------------------------------------------------------------------------
# The command line


def _labkit(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "labkit.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_labkit_grade_json_reports_every_exercise_for_an_instructor():
    completed = _labkit("grade", "--solutions", "--json")
    assert completed.returncode == 0, completed.stderr
    data = json.loads(completed.stdout)
    assert [e["topic"] for e in data["exercises"]] == list(grading.EXERCISES)
    assert data["passed"] == data["total"] > 0


def test_labkit_grade_table_scores_a_folder_of_student_files():
    completed = _labkit("grade", "--dir", str(WRONG / "setup_unbalanced"))
    assert completed.returncode == 0, completed.stderr
    assert "00_setup.py" in completed.stdout and "3/4" in completed.stdout
    assert "✗ " + SETUP_CHECKS[1] in completed.stdout
    assert "01_collectives.py" in completed.stdout and "no 01_collectives.py in" in completed.stdout  # missing: 0


def test_labkit_grade_rejects_a_missing_directory():
    completed = _labkit("grade", "--dir", "/no/such/folder")
    assert completed.returncode == 2 and "not a directory" in completed.stderr


def test_labkit_doctor_runs_the_smoke_test():
    completed = _labkit("doctor")
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "torch" in completed.stdout and "smoke test" in completed.stdout and "ok ([3.0, 3.0], on cpu" in completed.stdout


def test_labkit_doctor_under_torchrun_checks_the_whole_job():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
               "-m", "labkit.cli", "doctor"]
    completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert completed.stdout.count("smoke test") == 1  # only rank 0 prints
    assert "torchrun job" in completed.stdout and "ok ([6.0, 6.0, 6.0]" in completed.stdout


def test_labkit_bench_rejects_an_unknown_benchmark():
    completed = _labkit("bench", "no-such-benchmark")
    assert completed.returncode == 2 and "unknown benchmark" in completed.stderr


def test_the_bucket_exercise_teaches_the_rule_labkit_ddp_uses():
    import torch

    from labkit.ddp import assign_buckets

    for sizes, cap, expected in data_parallel_checks.BUCKET_CASES:
        parameters = [(str(index), torch.zeros(size, dtype=torch.uint8)) for index, size in enumerate(sizes)]
        assert assign_buckets(parameters, cap) == expected, (sizes, cap)
