"""The graders: full marks for the solution, zero for the stub, and every plausible wrong answer rejected."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from labkit import grading
from labkit.grading import guard
from labkit.grading.checkers import checkpointing as checkpointing_checks
from labkit.grading.checkers import collectives as collectives_checks
from labkit.grading.checkers import data_parallel as data_parallel_checks
from labkit.grading.checkers import lr_scaling as lr_scaling_checks
from labkit.grading.checkers import mixed_precision as mixed_precision_checks
from labkit.grading.checkers import parameter_server as parameter_server_checks
from labkit.grading.checkers import pipeline_parallel as pipeline_parallel_checks
from labkit.grading.checkers import planning as planning_checks
from labkit.grading.checkers import setup as setup_checks
from labkit.grading.checkers import tensor_parallel as tensor_parallel_checks
from labkit.grading.checkers import zero as zero_checks
from tests.conftest import REPO
from tests.wrong_answers import BY_NAME, WRONG_ANSWERS

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


@pytest.fixture(scope="module")
def solutions_graded() -> dict:
    """``labkit grade --solutions --json``, run once: what an instructor's tooling reads, and the solutions'
    scores (grading every solution takes seconds; the tests below share one run).  In this process, as
    ``labkit.cli.main``: the command's own process start is tested below (``labkit grade --dir``)."""
    from labkit import cli

    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert cli.main(["grade", "--solutions", "--json"]) == 0
    return json.loads(printed.getvalue())


@pytest.mark.parametrize("topic", list(grading.EXERCISES))
def test_the_solution_gets_full_marks(topic, solutions_graded):
    report = next(exercise for exercise in solutions_graded["exercises"] if exercise["topic"] == topic)
    assert report["passed"] == report["total"] > 0, [(c["name"], c["message"]) for c in report["checks"]
                                                     if not c["passed"]]


@pytest.mark.parametrize("topic", list(grading.EXERCISES))
def test_the_untouched_stub_gets_zero(topic):
    report = grading.check(topic, solutions=False, verbose=False)
    assert report.total > 0 and report.passed == 0
    assert all("not implemented yet" in result.message for result in report.checks)


GRADED_WRONG_ANSWERS = [answer for answer in WRONG_ANSWERS if answer.caught_by]


@pytest.mark.parametrize("answer", GRADED_WRONG_ANSWERS, ids=[answer.name for answer in GRADED_WRONG_ANSWERS])
def test_plausible_wrong_answers_fail_exactly_the_checks_that_catch_them(answer, tmp_path):
    checks = importlib.import_module(grading.EXERCISES[answer.topic][1]).CHECKS
    report = grading.check(answer.topic, directory=answer.write(tmp_path).parent, verbose=False)
    assert _failed(report) == {grading.check_name(checks[index]) for index in answer.caught_by}


def test_every_check_runs_the_students_code_under_the_guard():
    for topic, (_file, checker, _title) in grading.EXERCISES.items():
        for check in importlib.import_module(checker).CHECKS:
            assert getattr(check, "guarded", False), f"{topic}: {check.__name__} is not decorated with no_shortcuts"


def test_the_guard_refuses_labkits_implementations_however_they_were_bound_and_puts_them_back():
    import functools
    import types

    import labkit.collectives
    import labkit.lr
    from labkit.lr import scaled_lr  # bound before the guard, as a student's file would at import
    from labkit.precision import DynamicLossScaler

    student = types.ModuleType("student")
    student.bound, student.partial = scaled_lr, functools.partial(scaled_lr, 0.1)

    def with_default(rule=labkit.lr.scaled_lr):
        return rule(0.1, 32, 64)

    calls = [lambda: labkit.lr.scaled_lr(0.1, 32, 64), lambda: student.bound(0.1, 32, 64),
             lambda: student.partial(32, 64), with_default, DynamicLossScaler,
             lambda: labkit.collectives.chunk_bounds(10, 4)]
    with guard.forbid(student):
        for call in calls:
            with pytest.raises(guard.Forbidden, match="labkit's own implementation"):
                call()
    assert scaled_lr(0.1, 32, 64) == with_default() == 0.2 and DynamicLossScaler().get_scale() > 0
    with guard.forbid(student, allow=["labkit.costmodel.collectives.chunk_bounds"]):
        assert labkit.collectives.chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_the_guard_refuses_torchs_tensor_parallelism_where_a_check_names_it_and_puts_it_back():
    import torch
    import torch.distributed.nn.functional as differentiable
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    code = differentiable.all_reduce.__code__
    calls = [lambda: differentiable.all_reduce(torch.ones(2)), lambda: torch.distributed.nn.all_reduce(torch.ones(2)),
             lambda: DTensor.from_local(torch.ones(2)), ColwiseParallel,
             lambda: parallelize_module(torch.nn.Linear(2, 2), None, {})]
    with guard.forbid(library=tensor_parallel_checks.BUILT_INS):
        for call in calls:
            with pytest.raises(guard.Forbidden, match="a built-in: this exercise asks you to write it yourself"):
                call()
        assert torch.distributed.all_reduce.__code__.co_name != "refused"  # what f and g are built from stays
    assert differentiable.all_reduce.__code__ is code


@pytest.mark.parametrize("name, check, used", [
    ("tensor_parallel_g_torch_nn_all_reduce", "check_f_and_g", "torch.distributed.nn.functional.all_reduce, a built-in"),
    ("tensor_parallel_labkit_layers", "check_row_parallel_forward", "labkit's own implementation"),
])
def test_the_tensor_parallel_checks_refuse_torchs_differentiable_all_reduce_and_labkits_g(name, check, used, tmp_path):
    result = grading.run_check(getattr(tensor_parallel_checks, check), BY_NAME[name].write(tmp_path / name))
    assert not result.passed and used in result.message, result.message


@pytest.mark.parametrize("name, hints", [
    ("tensor_parallel_g_backward_averages", ["t=4, the default group (None), its rank 0, inputs [5, 5 features]: g "
                                             "(ReduceFromTensorParallel)'s backward ran c10d.allreduce_",
                                             "g's backward is the identity"]),
    ("tensor_parallel_f_forward_averages", ["f (CopyToTensorParallel)'s forward ran c10d.allreduce_",
                                            "every rank already holds x"]),
    ("tensor_parallel_f_backward_contiguous_alias", ["backward changed the gradient it was given, in place",
                                                     ".contiguous() and .reshape() of a contiguous tensor"]),
    ("tensor_parallel_f_backward_view_flat", ["laid out transposed (not contiguous): f (CopyToTensorParallel) raised "
                                              "RuntimeError: view size"]),
    ("tensor_parallel_f_backward_clone_keeps_strides", ["f (CopyToTensorParallel) handed c10d.allreduce_ a tensor "
                                                        "that is not contiguous", "NCCL refuses those"]),
    ("tensor_parallel_labkit_operators_bound_at_import", ["used labkit.parallel.tensor.ops._CopyToTensorParallel."
                                                          "forward, labkit's own implementation"]),
])
def test_the_f_and_g_probes_say_what_went_wrong_in_the_students_terms(name, hints, tmp_path):
    result = grading.run_check(tensor_parallel_checks.check_f_and_g, BY_NAME[name].write(tmp_path / name))
    assert not result.passed and all(hint in result.message for hint in hints), result.message


@pytest.mark.parametrize("name, check, hints", [
    ("tensor_parallel_column_broadcasts_x", 2, ["column_parallel_forward ran c10d.broadcast_ in forward, besides f "
                                                "and g", "every rank already holds the whole x"]),
    ("tensor_parallel_row_all_gathers_to_check", 3, ["row_parallel_forward ran c10d.allgather_ in forward, besides f "
                                                     "and g"]),
    ("tensor_parallel_f_backward_all_gather_sum", 0, ["f (CopyToTensorParallel)'s backward ran c10d.allgather_: one "
                                                      "all-reduce"]),
    ("tensor_parallel_g_reduce_then_broadcast", 0, ["g (ReduceFromTensorParallel)'s forward ran c10d.reduce_, "
                                                    "c10d.broadcast_"]),
    ("tensor_parallel_graders_f_imported_when_called", 2, ["imported labkit.grading.checkers.tensor_parallel, the "
                                                           "grader itself"]),
])
def test_a_layer_or_operator_sends_one_all_reduce_and_nothing_else(name, check, hints, tmp_path):
    result = grading.run_check(tensor_parallel_checks.CHECKS[check], BY_NAME[name].write(tmp_path / name))
    assert not result.passed and all(hint in result.message for hint in hints), result.message


def test_the_guard_keeps_the_graders_own_references_from_the_students_code():
    import types

    from labkit.grading.checkers import parallelism_3d as checks

    for source in ("from labkit.grading.checkers import parallelism_3d as grader\n",
                   "class F(__import__('labkit.grading.checkers.tensor_parallel', fromlist=['_'])._Copy):\n    pass\n"):
        student = types.ModuleType("labkit_exercise_held")
        exec(source, student.__dict__)
        with pytest.raises(guard.Forbidden, match="the grader itself"), guard.graders_off_limits(student):
            pass
    student = types.ModuleType("labkit_exercise_called")
    exec("def imports():\n    import labkit.grading\n\ndef calls(digits):\n    return digits(5, {'tp': 2, 'dp': 3}, "
         "'tp-dp')\n", student.__dict__)
    with guard.graders_off_limits(student):
        assert checks._digits(5, {"tp": 2, "dp": 3}, "tp-dp") == {"tp": 1, "dp": 2}  # the checker's own call
        with pytest.raises(guard.Forbidden, match="imported labkit.grading, the grader itself"):
            student.imports()
        with pytest.raises(guard.Forbidden, match="used labkit.grading.checkers.parallelism_3d._digits"):
            student.calls(checks._digits)
    assert student.calls(checks._digits) == {"tp": 1, "dp": 2}  # all put back


def test_an_average_over_the_group_fails_the_probes_by_its_numbers_alone():
    """Every rank's probe gradient differs, so an average is not the identity even where no message is seen."""
    from labkit.grading.checkers import tensor_parallel_fg as fg

    ranks = [0, 1, 2, 3]
    xs, grads = fg._truth("g", tuple(ranks), 0, len(ranks), "plain")
    out = {"error": None, "seen": [("forward", "c10d.allreduce_", True)], "x": xs[1], "y": sum(xs), "kept": True,
           "side": None, "grad": sum(grads) / 4}
    with pytest.raises(grading.CheckFailed, match="the mean of the 4 gradients the group's ranks were given, not its own"):
        fg._judge("g", out, ranks, 1, 0, "plain")
    fg._judge("g", {**out, "grad": grads[1]}, ranks, 1, 0, "plain")
    xs, _ = fg._truth("f", tuple(ranks), 0, len(ranks), "plain")
    with pytest.raises(grading.CheckFailed, match="f .CopyToTensorParallel.'s output differs from this rank's input"):
        fg._judge("f", {**out, "x": xs[2], "y": sum(xs) / 4, "seen": []}, ranks, 2, 0, "plain")


def _grows_late(scale, found_inf, good_steps, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
    if found_inf:
        return scale * backoff_factor, 0
    good_steps += 1
    if good_steps > growth_interval:
        return scale * growth_factor, 0
    return scale, good_steps


def test_the_update_scale_hint_says_what_was_observed():
    module = type("Student", (), {"update_scale": staticmethod(_grows_late)})
    with pytest.raises(grading.CheckFailed) as failure:
        mixed_precision_checks.check_update_scale.__wrapped__(module)
    message = str(failure.value)
    assert "never grows" not in message
    assert "good step 3 in a row, which completes growth_interval=3" in message
    assert "yours kept the scale at 65536 and counted 3" in message


def test_every_exercise_has_wrong_answers_that_apply_to_its_solution(tmp_path):
    for topic in grading.EXERCISES:
        assert any(answer.topic == topic for answer in GRADED_WRONG_ANSWERS), f"no wrong answer for {topic}"
    for answer in WRONG_ANSWERS:
        assert answer.write(tmp_path / answer.name).read_text() != (REPO / "solutions" / answer.file).read_text()


def _wrong(name: str, tmp_path: Path) -> Path:
    return BY_NAME[name].write(tmp_path / name).parent


def test_student_code_that_loops_for_ever_is_a_failed_check_not_a_stuck_grader(monkeypatch, tmp_path):
    monkeypatch.setattr(grading, "DEFAULT_CHECK_TIMEOUT", 1.0)  # the loop never ends: any limit proves it
    report = grading.check("setup", directory=_wrong("setup_endless_loop", tmp_path), verbose=False)
    looping = [r for r in report.checks if r.name in SETUP_CHECKS[:2]]
    assert all(not r.passed and "did not finish within 1 s" in r.message for r in looping)
    assert all(r.seconds < 10 for r in looping)


def test_student_code_that_hangs_in_a_collective_is_a_failed_check(monkeypatch, tmp_path):
    monkeypatch.setattr(setup_checks, "LAUNCH_TIMEOUT", 1.0)  # ranks 1 and up never join: any limit proves it
    report = grading.check("setup", directory=_wrong("setup_rank_zero_only", tmp_path), verbose=False)
    result = next(r for r in report.checks if r.name == SETUP_CHECKS[2])
    assert not result.passed and "hung" in result.message


def test_student_code_that_kills_its_process_is_a_failed_check(tmp_path):
    report = grading.check("setup", directory=_wrong("setup_crash", tmp_path), verbose=False)
    result = report.checks[0]
    assert not result.passed and "exit code 3" in result.message


def test_a_syntax_error_fails_every_check_with_the_import_error(tmp_path):
    report = grading.check("setup", directory=_wrong("setup_syntax_error", tmp_path), verbose=False)
    assert report.passed == 0
    assert all("could not import 00_setup.py: SyntaxError" in r.message for r in report.checks)


def test_check_prints_one_line_per_check_and_the_score(capsys, tmp_path):
    grading.check("setup", directory=_wrong("setup_mean_of_means", tmp_path))
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


def test_labkit_grade_json_reports_every_exercise_for_an_instructor(solutions_graded):
    data = solutions_graded
    assert [e["topic"] for e in data["exercises"]] == list(grading.EXERCISES)
    assert data["passed"] == data["total"] > 0


def test_labkit_grade_table_scores_a_folder_of_student_files(tmp_path):
    completed = _labkit("grade", "--dir", str(_wrong("setup_unbalanced", tmp_path)))
    assert completed.returncode == 0, completed.stderr
    assert "00_setup.py" in completed.stdout and "3/4" in completed.stdout
    assert "✗ " + SETUP_CHECKS[1] in completed.stdout
    assert "01_collectives.py" in completed.stdout and "no 01_collectives.py in" in completed.stdout  # missing: 0


def test_labkit_grade_rejects_a_missing_directory(capsys):
    from labkit import cli

    assert cli.main(["grade", "--dir", "/no/such/folder"]) == 2 and "not a directory" in capsys.readouterr().err


def test_labkit_doctor_runs_the_smoke_test_and_calibrates(tmp_path, monkeypatch):
    from labkit.costmodel.calibration import load

    monkeypatch.setenv("LABKIT_CALIBRATION", str(tmp_path / "calibration.json"))
    completed = _labkit("doctor", "--quick")  # the full calibration's arguments: the test below
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "torch" in completed.stdout and "smoke test" in completed.stdout and "ok ([3.0, 3.0], on cpu" in completed.stdout
    measured = load(tmp_path / "calibration.json")
    assert measured is not None and measured.ranks == 8 and 1e8 < measured.flops < 1e13
    assert f"saved to {tmp_path / 'calibration.json'}" in completed.stdout and "GFLOP/s" in completed.stdout
    # the links printed beside the copy that bounds them (issue 41), and held below it
    assert "below one thread's memory copy at" in completed.stdout
    assert max(measured.link.bandwidth_bytes_per_s, measured.loaded_link.bandwidth_bytes_per_s) <= measured.copy_bytes_per_s
    skipped = _labkit("doctor", "--no-calibrate")
    assert skipped.returncode == 0 and "calibration" not in skipped.stdout


def test_labkit_doctor_calibrates_with_calibrates_own_defaults_and_quick_with_fewer_samples(monkeypatch, capsys):
    """The test above runs ``doctor --quick``; plain ``doctor`` passes nothing but ``progress`` to ``calibrate``,
    whose defaults are the full calibration (wired here without running it)."""
    from labkit import calibrate, cli, launch
    from labkit.costmodel import calibration

    calls = []
    measured = type("Measured", (), {"describe": lambda self: "the constants"})()
    monkeypatch.setattr(calibrate, "calibrate", lambda **kwargs: calls.append(kwargs) or measured)
    monkeypatch.setattr(calibration, "save", lambda constants: "the path")
    monkeypatch.setattr(launch, "launch", lambda *args, nprocs, **kwargs: [(3.0, "cpu")] * nprocs)
    assert cli.main(["doctor"]) == 0 and cli.main(["doctor", "--quick"]) == 0
    assert [sorted(kwargs) for kwargs in calls] == [["progress"], sorted(["progress", *calibrate.QUICK])]
    assert {key: calls[1][key] for key in calibrate.QUICK} == calibrate.QUICK == {"micro_batches": (1, 4),
                                                                                 "repeats": 2}
    assert capsys.readouterr().out.count("the constants\n  saved to the path") == 2


def test_labkit_doctor_under_torchrun_checks_the_whole_job():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
               "-m", "labkit.cli", "doctor"]
    completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert completed.stdout.count("smoke test") == 1  # only rank 0 prints
    assert "torchrun job" in completed.stdout and "ok ([6.0, 6.0, 6.0]" in completed.stdout
    # torchrun started the processes: the time printed is the group's set-up, not a process start
    assert "joining the process group included" in completed.stdout and "starting the processes" not in completed.stdout


def test_labkit_bench_rejects_an_unknown_benchmark(capsys):
    from labkit import cli

    assert cli.main(["bench", "no-such-benchmark"]) == 2 and "unknown benchmark" in capsys.readouterr().err


def test_the_bucket_exercise_teaches_the_rule_labkit_ddp_uses():
    import torch

    from labkit.parallel.ddp import assign_buckets

    for sizes, cap, expected in data_parallel_checks.BUCKET_CASES:
        parameters = [(str(index), torch.zeros(size, dtype=torch.uint8)) for index, size in enumerate(sizes)]
        assert assign_buckets(parameters, cap) == expected, (sizes, cap)


# ---------------------------------------------------------------------------------------------------------
# Exercise 07: the 1F1B order


def test_the_guard_refuses_the_1f1b_generators_but_leaves_the_pipeline_checkers_tools_working():
    import enum
    import signal

    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from torch.distributed.pipelining.schedules import Schedule1F1B

    from labkit.parallel.pipeline import Action, Schedule, gpipe, one_f_one_b, simulate, validate

    code = get_schedule_ops.__code__
    library = guard.LABKIT_IMPLEMENTATIONS + pipeline_parallel_checks.BUILT_INS
    orders = [[Action(0, "F", 0), Action(0, "B", 0)], [Action(1, "F", 0), Action(1, "B", 0)]]
    with guard.forbid(library=library, allow=pipeline_parallel_checks.CHECKER_TOOLS):
        schedule = Schedule(2, 1, 1, "by hand", orders)
        validate(schedule)
        assert simulate(schedule, forward_s=1, backward_s=2).total == 6
        for call in (lambda: one_f_one_b(2, 1), lambda: gpipe(2, 1)):
            with pytest.raises(guard.Forbidden, match="labkit's own implementation"):
                call()
        for call in (lambda: get_schedule_ops("1F1B", 2, 2), lambda: Schedule1F1B._get_pipeline_order(None)):
            with pytest.raises(guard.Forbidden, match="a built-in: this exercise asks you to write it yourself"):
                call()
        assert signal.Signals(9) is signal.SIGKILL and isinstance(enum.Enum("E", "A").A, enum.Enum)  # enums whole
    assert get_schedule_ops.__code__ is code and one_f_one_b(2, 1).p == 2


@pytest.mark.parametrize("name, used", [
    ("pipeline_parallel_labkit_schedule", "labkit.parallel.pipeline.schedule.one_f_one_b, labkit's own"),
    ("pipeline_parallel_torch_schedule_ops", "torch.distributed.pipelining._schedule_visualizer.get_schedule_ops, a built-in"),
    ("pipeline_parallel_torch_1f1b_internals", "torch.distributed.pipelining.schedules.Schedule1F1B._get_pipeline_order, a built-in"),
])
def test_the_pipeline_checks_refuse_labkits_and_torchs_1f1b_tables(name, used, tmp_path):
    result = grading.run_check(pipeline_parallel_checks.check_orders_run, BY_NAME[name].write(tmp_path / name))
    assert not result.passed and used in result.message, result.message


@pytest.mark.parametrize("name, check, hints", [
    ("pipeline_parallel_warmup_one_long", 2, ["rank 0 of p=4, m=16 holds 5 micro-batches at peak; 1F1B holds "
                                              "min(p - rank, m) = 4: your warm-up runs too many forwards"]),
    ("pipeline_parallel_gpipe", 2, ["holds 16 micro-batches at peak", "all m of them, as GPipe does"]),
    ("pipeline_parallel_warmup_one_short_clamped", 1, ["p=4, m=16: your orders take 102 time units",
                                                       "3 (m + p - 1) = 57", "(p - 1)/(m + p - 1) = 3/19",
                                                       "rank 0 runs 3 forward(s) before its first backward"]),
    ("pipeline_parallel_cooldown_newest_first", 1, ["the warm-ups are right, but pass 30 of rank 0 is (\"B\", 15), "
                                                    "where 1F1B runs (\"B\", 13)"]),
    ("pipeline_parallel_warmup_ignores_rank", 1, ["rank 1 runs 4 forward(s) before its first backward, where 1F1B "
                                                  "runs min(p - rank, m) = 3"]),
    ("pipeline_parallel_no_cooldown", 0, ['never runs ("B", 13), ("B", 14), ("B", 15)', "the cool-down"]),
    ("pipeline_parallel_no_min_with_m", 0, ["('F', 2), but the micro-batches are numbered 0 to m - 1 = 1",
                                            "min(p - 1 - rank, m)"]),
    ("pipeline_parallel_warmup_one_short", 0, ["('F', -1)", "min(p - 1 - rank, m) = 0"]),
    ("pipeline_parallel_warmup_reversed", 0, ["cannot run these orders together: your 1F1B: deadlock",
                                              "rank 0 at 0B0 waits for 1B0", "2B5 is rank 2's (\"B\", 5)"]),
    ("pipeline_parallel_warmup_forwards_unordered", 0, ["rank=0, p=4, m=16) runs its forwards in the order [0, 2, 1, 3",
                                                        "micro-batch 2 before 1", "run them 0, 1, 2"]),
    ("pipeline_parallel_right_up_to_8_stages", 0, ["p=12, m=", "deadlock"]),
    ("pipeline_parallel_fixed_stage_counts_only", 2, ["all m of them, as GPipe does"]),
    ("pipeline_parallel_torch_warmup_count", 0, ["torch.distributed.pipelining.schedules._get_warmup_ops, a built-in"]),
])
def test_the_pipeline_hints_say_what_went_wrong_in_the_students_terms(name, check, hints, tmp_path):
    result = grading.run_check(pipeline_parallel_checks.CHECKS[check], BY_NAME[name].write(tmp_path / name))
    assert not result.passed and all(hint in result.message for hint in hints), result.message


# ---------------------------------------------------------------------------------------------------------
# Exercise 08: the parameter server's rule under a bounded delay


def test_the_guard_refuses_labkits_rule_but_leaves_its_parameter_server_working():
    from labkit.parallel.parameter_server import Decision, Gate, Stragglers
    from labkit.parallel.parameter_server.runtime import check_arguments

    with guard.forbid(library=guard.LABKIT_IMPLEMENTATIONS, allow=parameter_server_checks.CHECKER_TOOLS):
        with pytest.raises(guard.Forbidden, match="Gate.__init__, labkit's own implementation"):
            Gate("bounded_delay", 2, max_delay=1)
        check_arguments("bounded_delay", 3, 0.1, None, 0, 2, 1)  # run_parameter_server's argument check (the launched check)
        stragglers = Stragglers(slow={0: 0.25})
        assert stragglers.delay(0, stragglers.generator(0)) == 0.25 and Decision(apply=(1,)).apply == (1,)
    assert Gate("bounded_delay", 2, max_delay=1).arrive(0, 0) == Decision(apply=(0,), release=(0,))


def test_the_reference_plays_reach_the_bound_so_an_answer_off_by_one_has_somewhere_to_fail():
    reached: dict[tuple[int, int], set[int]] = {}
    for workers, bound, turns in parameter_server_checks.REFERENCE:
        pulled: dict[int, int] = {}
        for turn in turns:
            pulled[turn.worker] = turn.pulled
            reached.setdefault((workers, bound), set()).update(turn.version - pulled[w] for w in turn.apply)
    for (workers, bound), staleness in reached.items():
        if bound == parameter_server_checks.HUGE:
            assert max(staleness) > 4, workers  # asynchronous: well past every bound the checks use
        else:
            assert max(staleness) == (bound if workers > 1 else 0), (workers, bound, staleness)


@pytest.mark.parametrize("name, check, hints", [
    ("parameter_server_strict", 1, ["4 workers, tau=2, arrival 2", "would be 2 stale, which tau=2 allows (equal to "
                                    "tau is allowed: hold only while version + 1 - oldest > tau)", "; yours holds"]),
    ("parameter_server_sync", 1, ["yours holds (yours waits for every worker, as synchronous training does: that "
                                  "is tau = 0)"]),
    ("parameter_server_async", 1, ["more than tau=2 (one update more than tau allows): hold", "yours applies [1] "
                                   "(yours applies every gradient on arrival, as asynchronous training does"]),
    ("parameter_server_lenient", 0, ["worker 0, still computing on version 0, is 3 updates behind, so its gradient "
                                     "will arrive more than tau=2 stale. Hold"]),
    ("parameter_server_lenient", 1, ["(one update more than tau allows): hold (return [], []) until it arrives; "
                                     "yours applies [1] ("]),
    ("parameter_server_ssp_instead", 0, ["more than tau=2 stale (yours applies each gradient on arrival and holds "
                                         "only its worker: that is Ho et al.'s SSP, which bounds how far a worker's "
                                         "clock runs ahead, not staleness"]),
    ("parameter_server_ssp_instead", 1, ["hold (return [], []) until it arrives; yours applies [", "that is Ho et "
                                         "al.'s SSP"]),
    ("parameter_server_ssp_instead", 2, ["on 4 launched ranks (worker 0 slow), 3 workers, tau=1", "Ho et al.'s SSP"]),
    ("parameter_server_never_releases", 0, ["no worker computes any more: workers [0, 1, 2, 3] applied but never "
                                            "released", "the server would wait for ever"]),
    ("parameter_server_applies_held_twice", 0, ["but worker 3 is still computing", "(is self.held emptied"]),
    ("parameter_server_bounds_the_arriving_gradient", 1, ["yours applies [1] (and"]),
    ("parameter_server_never_releases", 2, ["on 4 launched ranks (worker 0 slow), 3 workers, tau=1",
                                            "applied but never released"]),
    ("parameter_server_lenient", 2, ["on 4 launched ranks (worker 0 slow), 3 workers, tau=1", "is 2 updates behind"]),
    ("parameter_server_labkit_gate", 2, ["rank 0 used labkit.parallel.parameter_server.runtime.Gate.__init__, labkit's own"]),
    ("parameter_server_releases_on_the_old_version", 1, ["yours holds. Your self.computing says {0: 2, 2: 1, 3: 2}: a "
                                                         "worker released by an update computes on the version that "
                                                         "update made"]),
    ("parameter_server_newest_computing", 0, ["worker 0, still computing on version 0, is 3 updates behind"]),
])
def test_the_parameter_server_hints_say_what_went_wrong_in_the_students_terms(name, check, hints, tmp_path):
    result = grading.run_check(parameter_server_checks.CHECKS[check], BY_NAME[name].write(tmp_path / name))
    assert not result.passed and all(hint in result.message for hint in hints), result.message


def test_a_rule_that_waits_inside_arrive_is_a_failed_check_not_a_hang(monkeypatch, tmp_path):
    monkeypatch.setattr(grading, "DEFAULT_CHECK_TIMEOUT", 1.0)  # arrive never returns: any limit proves it
    monkeypatch.setattr(parameter_server_checks, "LAUNCH_TIMEOUT", 2.0)
    report = grading.check("parameter_server", directory=_wrong("parameter_server_waits_inside_arrive", tmp_path),
                           verbose=False)
    assert report.passed == 0
    assert all("did not finish within 1 s" in result.message for result in report.checks[:2])
    assert "the run did not finish within 2 s" in report.checks[2].message and report.checks[2].seconds < 30


def test_a_check_that_launches_ranks_runs_after_a_backward_pass_in_the_caller():
    """A notebook that ran a backward pass (GNU OpenMP's threads alive) and then grades: the check's forked
    process once inherited the live thread pool's bookkeeping and hung pausing it before launching ranks."""
    script = """
import time, torch
from labkit import grading
from labkit.grading.checkers import parameter_server
torch.set_num_threads(2)
model = torch.nn.Linear(256, 256)
model(torch.randn(512, 256)).square().sum().backward()  # parallel regions: OpenMP's pool is up
start = time.monotonic()
result = grading.run_check(parameter_server.check_parameter_server_run, grading.exercise_path("parameter_server"))
print(round(time.monotonic() - start, 1), result.message)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "LABKIT_SOLUTIONS": "0"})
    seconds, _, message = done.stdout.strip().partition(" ")
    assert done.returncode == 0 and float(seconds) < 30 and "not implemented yet" in message, (done.stdout,
                                                                                               done.stderr[-2000:])


# ---------------------------------------------------------------------------------------------------------
# Exercise 09: saving and resuming a data-parallel run


def test_the_guard_refuses_labkits_and_torchs_checkpointing_but_leaves_labkits_ddp_working():
    import signal

    import torch
    import torch.distributed.checkpoint as dcp

    import labkit.checkpoint
    import labkit.checkpoint.files
    from labkit.parallel.ddp import DistributedDataParallel

    code = dcp.save.__code__
    library = guard.LABKIT_IMPLEMENTATIONS + checkpointing_checks.BUILT_INS
    with guard.forbid(library=library, allow=checkpointing_checks.CHECKER_TOOLS):
        for call in (lambda: labkit.checkpoint.save("x", None, None, 0), lambda: labkit.checkpoint.load("x", None, None),
                     lambda: labkit.checkpoint.files.set_rng_state({})):
            with pytest.raises(guard.Forbidden, match="labkit's own implementation"):
                call()
        for call in (lambda: dcp.save({}, checkpoint_id="x"), lambda: dcp.load({}, checkpoint_id="x")):
            with pytest.raises(guard.Forbidden, match="a built-in: this exercise asks you to write it yourself"):
                call()
        assert DistributedDataParallel.__init__.__code__.co_name != "refused"  # the checks train under it
        assert signal.Signals(9) is signal.SIGKILL  # enums whole: DCP's modules are not swapped wholesale
        assert torch.get_rng_state().dtype == torch.uint8
    assert dcp.save.__code__ is code


@pytest.mark.parametrize("name, check, hints", [
    ("checkpointing_forgets_rng", 0, ["2 ranks, saved after step 3 and resumed in new processes: from step 4 on, "
                                      "rank 0's loss is", "torch's RNG state (torch.get_rng_state()) is not the one "
                                      "this rank had when it saved", "torch.set_rng_state"]),
    ("checkpointing_forgets_sampler", 0, ["from step 4 on, rank 0's loss", "the sampler position was not restored",
                                          "generator.set_state"]),
    ("checkpointing_saves_only_rank_zero_rng", 0, ["from step 4 on, rank 1's loss", "it holds rank 0's"]),
    ("checkpointing_saves_only_rank_zero_rng", 2, ["the file holds the torch RNG state (torch.get_rng_state()) of "
                                                   "rank(s) [0] only, not that of rank(s) [1, 2]"]),
    ("checkpointing_forgets_sampler", 2, ["the file holds no rank's sampler generator state"]),
    ("checkpointing_saves_from_every_rank", 1, ["rank 1 wrote checkpoint.pt during save_checkpoint",
                                                "rank 0 alone writes"]),
    ("checkpointing_no_barrier", 1, ["an older checkpoint at path: the moment save_checkpoint returned on rank 1, "
                                     "path there still held the older checkpoint", "dist.barrier()"]),
    ("checkpointing_polls_for_the_file", 1, ["path there still held the older checkpoint", "waits for a file"]),
    ("checkpointing_step_from_the_optimizer", 0, ["load_checkpoint returned 2 on rank 0; return the step that "
                                                  "save_checkpoint was given (3)"]),
    ("checkpointing_load_skips_missing_state", 0, ["load_checkpoint of a file saved without scheduler=, given "
                                                   "scheduler=, returned on rank 0: raise ValueError"]),
    ("checkpointing_fsync_before_writing", 3, ["fsynced (or synced) the temporary file before its last bytes were "
                                               "written"]),
    ("checkpointing_sync_before_writing", 3, ["fsynced (or synced) the temporary file before its last bytes"]),
    ("checkpointing_folder_of_a_bare_name", 3, ['save_checkpoint("checkpoint.pt", ...), a path without a folder, '
                                                "raised on rank 0: FileNotFoundError"]),
    ("checkpointing_copies_the_tmp_file", 1, ["left checkpoint.pt.tmp beside the checkpoint", "os.replace"]),
    ("checkpointing_labkit_checkpoint", 0, ["rank 0 used labkit.checkpoint.state.save, labkit's own implementation"]),
    ("checkpointing_dcp", 1, ["used torch.distributed.checkpoint.state_dict_saver.save, a built-in"]),
    ("checkpointing_drops_scheduler", 0, ["from step 6 on, rank 0's loss", "the learning-rate schedule is not where it "
                                          "was (scheduler.state_dict(): last_epoch 3 saved, 0 after the load)"]),
    ("checkpointing_drops_scaler", 0, ["rank 0 resumes with the straight run's losses and weights for 3 steps, but not "
                                       "its state", "the GradScaler's state is not the one saved"]),
    ("checkpointing_every_rank_saves_imported_by_name", 1, ["3 ranks: rank 1 wrote checkpoint.pt during "
                                                            "save_checkpoint", "rank 0 alone writes"]),
    ("checkpointing_every_rank_renames_its_own_file", 1, ["3 ranks: rank 1 wrote checkpoint.pt.1.tmp"]),
    ("checkpointing_direct_save", 3, ["rank 0 opened path itself for writing", "path + '.tmp'"]),
    ("checkpointing_direct_save_imported_by_name", 3, ["rank 0 opened path itself for writing"]),
    ("checkpointing_no_fsync", 3, ["renamed the temporary file onto path without fsyncing it first: the data"]),
    ("checkpointing_fsync_after_the_rename", 3, ["without fsyncing it first (you fsync it after the rename"]),
    ("checkpointing_no_folder_fsync", 3, ["rank 0 did not fsync the folder after the rename"]),
    ("checkpointing_temporary_file_elsewhere", 3, ["onto path, from another folder"]),
])
def test_the_checkpointing_hints_say_what_went_wrong_in_the_students_terms(name, check, hints, tmp_path):
    result = grading.run_check(checkpointing_checks.CHECKS[check], BY_NAME[name].write(tmp_path / name))
    assert not result.passed and all(hint in result.message for hint in hints), result.message


def test_every_ranks_random_state_is_found_in_any_encoding(tmp_path):
    """States saved as lists of ints (``.tolist()``) resume as well as tensors do: the per-rank check finds them."""
    solution = (REPO / "solutions" / "09_checkpointing.py").read_text()
    old = 'mine = {"rng": torch.get_rng_state(), "sampler": generator.get_state()}'
    assert solution.count(old) == 1
    path = tmp_path / "09_checkpointing.py"
    path.write_text(solution.replace(old, 'mine = {"rng": torch.get_rng_state().tolist(), "sampler": '
                                          'bytes(generator.get_state().tolist())}')
                    .replace('torch.set_rng_state(mine["rng"])', 'torch.set_rng_state(torch.tensor(mine["rng"], '
                                                                'dtype=torch.uint8))')
                    .replace('generator.set_state(mine["sampler"])', 'generator.set_state(torch.tensor(list('
                                                                    'mine["sampler"]), dtype=torch.uint8))'))
    result = grading.run_check(checkpointing_checks.check_every_ranks_random_state, path)
    assert result.passed, result.message


def test_a_checkpoint_of_pickled_objects_is_refused_with_weights_only(tmp_path):
    solution = (REPO / "solutions" / "09_checkpointing.py").read_text()
    old = '"ranks": ranks, "step": step}'
    assert solution.count(old) == 1
    path = tmp_path / "09_checkpointing.py"
    path.write_text(solution.replace(old, '"ranks": ranks, "step": step, "when": __import__("datetime").date(2026, 1, 1)}'))
    result = grading.run_check(checkpointing_checks.check_writes, path)
    assert not result.passed and "torch.load(path, weights_only=True) refuses your checkpoint" in result.message, \
        result.message


def test_the_file_watcher_sees_writes_renames_and_fsyncs_whatever_names_they_were_made_through(tmp_path):
    import types

    import torch

    from labkit.grading import files

    student = types.ModuleType("student")  # names bound at import, before any watcher: torch's C++ writer, os's
    exec("import os\nfrom os import fsync, replace\nfrom pathlib import Path\nfrom torch import save\n\n"
         "def write(path, sync=fsync):\n    save({'a': 1}, path + '.tmp')\n"
         "    with open(path + '.tmp', 'rb') as file:\n        sync(file.fileno())\n    replace(path + '.tmp', path)\n"
         "    Path(path + '.log').write_bytes(b'x')\n    os.remove(path + '.log')\n", student.__dict__)
    path, originals = os.path.realpath(tmp_path / "x.pt"), (student.fsync, student.write.__defaults__, os.fsync,
                                                 torch.serialization._open_zipfile_writer_file.__init__.__code__)
    with files.FolderEvents(str(tmp_path)) as seen, files.watching(student) as log:
        student.write(path)
    identity = (os.stat(path).st_dev, os.stat(path).st_ino)
    assert log == [("write", path + ".tmp"), ("fsync", identity, False, files.state(os.stat(path))),
                   ("rename", path + ".tmp", path),
                   ("write", path + ".log"), ("remove", path + ".log")], log
    assert log.touched(str(tmp_path)) == ["x.pt.tmp", "x.pt", "x.pt.log"]
    assert (student.fsync, student.write.__defaults__, os.fsync,
            torch.serialization._open_zipfile_writer_file.__init__.__code__) == originals  # all put back
    if seen.events is not None:  # Linux: the kernel's record agrees, and x.pt itself was never written
        assert [kind for name, kind, _ in seen.events if name == "x.pt"] == ["MOVED_TO"], seen.events
    with files.watching(may_write=False) as log, pytest.raises(OSError):
        with open(tmp_path / "y", "wb") as file:
            file.write(b"any byte")
            file.flush()
    assert files.refused(log) and ("write", os.path.realpath(tmp_path / "y")) in log


def test_the_kernel_record_alone_catches_a_checkpoint_written_in_place():
    from labkit.grading import files
    from labkit.grading.checkers import checkpoint_writes

    path, nothing_logged = os.path.join(os.sep, "run", "checkpoint.pt"), files.Log()
    assert checkpoint_writes._in_place(path, nothing_logged, [("checkpoint.pt", "CREATE", 0)]) == \
        "the kernel saw path itself created"
    renamed = [("checkpoint.pt.tmp", "CREATE", 0), ("checkpoint.pt.tmp", "MODIFY", 0),
               ("checkpoint.pt.tmp", "CLOSE_WRITE", 0), ("checkpoint.pt.tmp", "MOVED_FROM", 7),
               ("checkpoint.pt", "MOVED_TO", 7)]
    assert checkpoint_writes._in_place(path, nothing_logged, renamed) is None


@pytest.mark.parametrize("name, check, says", [
    ("3d_labkit_mesh", 0, "used labkit.mesh.mesh_coordinates, labkit's own implementation"),
    ("3d_torch_device_mesh", 0, "used torch.distributed.device_mesh.DeviceMesh.__init__, a built-in"),
    ("3d_labkit_group_links", 2, "used labkit.viz.mesh_plots.group_links, labkit's own implementation"),
    ("3d_outermost_first", 0, "In 'tp-dp-pp' tp is innermost: its coordinate is rank % 2"),
    ("3d_wrong_radix", 0, "coordinates(3, {'tp': 4, 'dp': 3, 'pp': 2}, 'tp-dp-pp') returned"),
    ("3d_grouped_by_own_coordinate", 1, "2 group(s) of sizes [4]; expected 4 groups of 2 ranks"),
    ("3d_nodes_as_if_aligned", 2, "['pp'] is 1; expected 2, the nodes of the widest PP group, [3, 7]: nodes [0, 1]"),
    ("3d_nodes_round_robin", 2, "on node r // 8"),
    ("3d_nodes_counts_crossing_groups", 2, "['pp'] is 4; expected 2"),
    ("3d_mutates_sizes", 0, "changed the sizes it was given (to {}): the caller's dict is not yours to change"),
    ("3d_float_coordinates", 0, "returned {'tp': 0.0, 'dp': 0.0, 'pp': 0.0}: each coordinate is an int"),
    ("3d_torch_mesh_layout", 1, "used torch.distributed._mesh_layout._FlatLayout.__init__, a built-in"),
    ("3d_graders_reference", 0, "imported labkit.grading.checkers, the grader itself")])
def test_the_3d_checks_say_what_went_wrong_and_refuse_labkits_and_torchs_layouts(name, check, says, tmp_path):
    """Exercise 10's wrong answers fail for their own reason: the guard names labkit's layout (``labkit.mesh``,
    ``group_links``) and torch's mesh (not a syntax error or a crash), and the hints name the rank, the group or
    the nodes."""
    report = grading.check("3d_parallelism", directory=_wrong(name, tmp_path), verbose=False)
    assert says in report.checks[check].message, report.checks[check].message


def test_the_3d_checks_try_uneven_nodes_a_fourth_dimension_and_every_order_they_name():
    """The cases separate the rules a wrong answer might follow: a group of 3 ranks on nodes of 4 straddles two
    nodes, a node size (3) divides neither the world nor the groups, a fourth dimension (cp) is laid out too, and
    each of tp, dp and pp is innermost in some order."""
    from labkit.grading.checkers import parallelism_3d as checks

    assert 3 in checks.NODE_SIZES and any("cp" in sizes for sizes, _ in checks.CASES)
    assert {order.split("-")[0] for _, order in checks.CASES} >= {"tp", "dp", "pp"}
    straddling = [(sizes, order) for sizes, order in checks.CASES
                  if any(len({rank // 4 for rank in group}) > len(group) // 4 + (len(group) % 4 > 0)
                         for group in checks._reference_groups(sizes, order)["tp"])]
    assert straddling, "no case where a TP group spans more nodes of 4 than its size needs"


def test_the_3d_checks_take_any_collection_of_int_ranks_and_draw_cases_no_table_holds(tmp_path):
    """Groups as tuples, sets or numpy ints are the right groups; the random cases always have ep, which none of
    the fixed cases has, so a table of those cases cannot pass."""
    from labkit.grading.checkers import parallelism_3d as checks

    solution = (REPO / "solutions" / "10_3d_parallelism.py").read_text()
    old = "    return {dim: list(by_others.values()) for dim, by_others in found.items()}\n"
    assert solution.count(old) == 1
    path = tmp_path / "10_3d_parallelism.py"
    path.write_text(solution.replace(old, "    import numpy\n    kinds = (tuple, set, lambda g: [numpy.int64(r) for r in g])\n"
                                          "    return {dim: [kinds[i % 3](g) for i, g in enumerate(by_others.values())]\n"
                                          "            for dim, by_others in found.items()}\n"))
    assert all(grading.run_check(check, path).passed for check in checks.CHECKS)
    drawn = checks._cases()[len(checks.CASES):]
    assert len(drawn) == 2 and all("ep" in sizes for sizes, _ in drawn)
    assert not any("ep" in sizes for sizes, _ in checks.CASES)


# ---------------------------------------------------------------------------------------------------------
# Exercise 11: a 3D step's time by hand


def test_the_planning_guard_refuses_labkits_step_model_planner_and_ring_costs_but_not_the_counts_handed_out():
    from labkit.costmodel import collectives, planner, simulator, step
    from labkit.costmodel.compute import GPUS, model_flops_per_step
    from labkit.costmodel.hardware import NVLINK_LATENCY_S
    from labkit.costmodel.shapes import TransformerShape, num_parameters

    case = planning_checks.CASES[0]
    cluster = planner.Cluster(GPUS["A100 80GB"], 8)
    code = step.predict_step.__code__
    from labkit.costmodel import stages
    from labkit.parallel.pipeline import catalog, engine

    calls = [lambda: step.predict_step(case.shape, case.layout, case.global_batch, case.hardware),
             lambda: step.stage_times(case.shape, case.layout, case.global_batch, case.hardware),
             lambda: stages.chunk_costs(case.shape, case.layout, case.hardware),
             lambda: step.place_schedule("1f1b", 2, 2, 1, [1.0, 1.0], [2.0, 2.0]),
             lambda: engine.place(catalog.compiled("1f1b", 2, 2), [1.0] * 8),
             lambda: step.closed_form_makespan("1f1b", 4, 8, 1.0, 2.0),
             lambda: simulator.simulate_step(case.shape, case.layout, case.global_batch, case.hardware),
             lambda: planner.plan(case.shape, cluster, 8), lambda: collectives.ring_all_reduce_cost(64, 4),
             lambda: collectives.ring_reduce_scatter_cost(64, 4)]
    with guard.forbid(library=guard.LABKIT_IMPLEMENTATIONS + planning_checks.BUILT_INS):
        for call in calls:
            with pytest.raises(guard.Forbidden, match="labkit's own implementation"):
                call()
        shape = TransformerShape.preset("gpt2")  # what the exercise hands out still works
        assert num_parameters(shape) == 124_439_808 and model_flops_per_step(shape, 1) > 0
        assert case.layout.gpus == 1 and case.hardware.intra_node.alpha_s == NVLINK_LATENCY_S  # reading the arguments
    assert step.predict_step.__code__ is code
    assert step.closed_form_makespan("1f1b", 4, 8, 1.0, 2.0) == 33.0


def test_the_planning_cases_reach_every_regime_the_exercise_teaches():
    """Each mistake has a case to fail on: every schedule, recomputation, each degree from 1 to 64, TP inside and
    across nodes (also where t fits a node but does not divide it), DP hidden, partly exposed and across nodes
    where d alone would fit, fewer micro-batches than stages."""
    cases = planning_checks.CASES
    assert {case.layout.schedule for case in cases} == {"gpipe", "1f1b", "interleaved", "zb-h1"}
    assert {case.layout.recompute for case in cases} == {False, True}
    for dim in ("dp", "tp", "pp"):
        assert {1, 64} <= {getattr(case.layout, dim) for case in cases}, dim
    assert any(case.tp_link_inside and case.layout.tp > 1 for case in cases)
    assert any(not case.tp_link_inside and case.layout.tp < case.hardware.gpus_per_node for case in cases)
    assert any(not case.tp_link_inside and case.layout.tp > case.hardware.gpus_per_node for case in cases)
    assert any(case.want["dp"] == 0 and case.layout.dp > 1 for case in cases)
    assert any(0 < case.want["dp"] < case.dp_reduction for case in cases)
    assert any(not case.dp_link_inside and case.hardware.gpus_per_node % case.layout.dp == 0 for case in cases)
    assert any(case.m < case.layout.pp for case in cases) and any(case.m > case.layout.pp > 1 for case in cases)
    assert len({case.v for case in cases}) >= 4
    # each rule a link might be chosen by, told apart where the reduction is exposed: a DP group that fits in a
    # node without dividing it (t d <= G), one that fills a node exactly (t d = G), a TP group of a node
    exposed = [(case, case.layout.tp * case.layout.dp, case.hardware.gpus_per_node) for case in cases
               if case.want["dp"] > 0]
    assert sum(not case.dp_link_inside and span <= nodes for case, span, nodes in exposed) >= 3
    assert sum(case.dp_link_inside and span == nodes for case, span, nodes in exposed) >= 1
    assert sum(not case.dp_link_inside and nodes % case.layout.dp == 0 for case, _, nodes in exposed) >= 3
    assert sum(case.layout.tp == case.hardware.gpus_per_node for case in cases) >= 3
    assert sum(not case.tp_link_inside and case.layout.tp < case.hardware.gpus_per_node for case in cases) >= 4
    # ZB-H1 where an input-gradient pass (B / 2, recomputing) outlasts a forward
    assert sum(case.layout.schedule == "zb-h1" and case.want["backward"] > 2 * case.want["forward"]
               for case in cases) >= 10


def test_the_planning_worked_example_is_what_predict_step_gives_and_both_files_teach_it():
    from labkit.costmodel.collectives import LinkModel
    from labkit.costmodel.shapes import TransformerShape
    from labkit.costmodel.step import Hardware, Layout, predict_step

    arguments = (TransformerShape.preset("gpt2"), Layout(dp=4, tp=2, pp=2, micro_batch=2), 64,
                 Hardware(1e14, LinkModel(5e-6, 1 / 300e9), LinkModel(1e-5, 1 / 25e9), gpus_per_node=4))
    step = predict_step(*arguments, head_on_last_stage=False)  # the balanced pipeline the exercise computes
    milliseconds = [f"{seconds * 1e3:.2f} ms" for seconds in (step.compute_s, step.tp_s, step.bubble_s, step.dp_s,
                                                             step.step_s - step.pp_send_s, step.pp_send_s)]
    assert milliseconds == ["35.00 ms", "3.93 ms", "4.87 ms", "0.63 ms", "44.43 ms", "0.58 ms"]
    milliseconds.append(f"{predict_step(*arguments).step_s * 1e3:.2f} ms")  # the output layer on the last stage
    assert milliseconds[-1] == "54.85 ms"
    assert (f"{step.forward_s * 1e3:.3f} ms", f"{step.backward_s * 1e3:.3f} ms") == ("1.704 ms", "3.162 ms")
    texts = [(REPO / folder / "11_planning.py").read_text() for folder in ("exercises", "solutions")]
    exercise, solution = (text[:text.index('"""', 3)] for text in texts)
    assert exercise == solution.replace(" by hand (solution).", " by hand.")
    for number in milliseconds + ["1.704 ms", "3.162 ms", "0.246 ms"]:
        assert number.replace(" ms", "") in exercise, number


@pytest.mark.parametrize("name, check, hints", [
    ("planning_no_bubble", 2, ["gpt2, dp=1 tp=1 pp=4 ZeRO-0 b=1 1f1b, global batch 8 (m = 8 micro-batches), on A100 "
                               "nodes of 8", "your \"bubble\" is 0 ms, predict_step's 4.20647 ms ((p - 1)(F + B)",
                               "no bubble; the first stage waits p - 1 forwards"]),
    ("planning_bubble_over_m", 2, ["(p - 1) / m is the bubble's fraction of the ideal time m (F + B)"]),
    ("planning_interleaved_per_chunk", 2, ["interleaved v=3", "divided by v twice: in (p - 1)(F + B) / v, F and B "
                                           "are the whole rank's"]),
    ("planning_interleaved_not_over_v", 2, ["not divided by v: interleaving v = 3 chunks per rank"]),
    ("planning_bubble_without_tp", 2, ["the idle slots last a whole forward and backward, TP's all-reduces"]),
    ("planning_two_tp_all_reduces", 0, ["tp=2", "one all-reduce per layer each way, where Megatron's layer has two"]),
    ("planning_two_tp_all_reduces", 2, ["your bubble follows from your forward and backward", "see the first check"]),
    ("planning_recompute_forgets_tp", 1, ["recompute", "runs the forward's two all-reduces again inside the backward"]),
    ("planning_ring_without_factor", 0, ["your ring all-reduce sends 2 n beta; it sends 2 (N - 1) / N * n * beta"]),
    ("planning_ring_without_factor", 3, ["dp=16", "your ring all-reduce sends 2 n beta"]),
    ("planning_tp_always_intra_node", 0, ["tp=3", "a TP group of t = 3 on nodes of 8 spans nodes"]),
    ("planning_tp_link_by_size", 1, ["tp=3", "inside one only when t divides the GPUs a node"]),
    ("planning_dp_link_by_dp_alone", 3, ["a DP group's d = 4 ranks are t = 2 apart: they span t d = 8 ranks, more "
                                         "than a node of 4 holds"]),
    ("planning_dp_not_overlapped", 3, ["not overlapped: the reduction starts with the last micro-batch's backward"]),
    ("planning_dp_fully_overlapped", 3, ["all of it hidden; only one backward (B = 3.73908 ms) runs beside it"]),
    ("planning_tp_in_compute", 1, ["TP's all-reduces go in \"tp\", not in \"compute\""]),
    ("planning_labkit_predict_step", 0, ["used labkit.costmodel.step.predict_step, labkit's own implementation"]),
    ("planning_labkit_ring_cost", 3, ["used labkit.costmodel.collectives.ring_all_reduce_cost, labkit's own"]),
    ("planning_data_parallel_only", 0, ["tp=2", "the whole model's forward on one rank, as in plain data parallelism"]),
    ("planning_data_parallel_only", 4, ["your compute and tp differ from predict_step's"]),
    ("planning_dp_link_by_size", 3, ["dp=3 tp=1 pp=4", "they span t d = 3 ranks, and the blocks of 3 ranks that "
                                     "start at multiples of 3 do not all fit in nodes of 8"]),
    ("planning_dp_link_strict", 3, ["which divides a node of", "stays inside one: intra-node link"]),
    ("planning_tp_link_strict", 0, ["tp=3", "a TP group of t = 3 on nodes of 8 spans nodes"]),
    ("planning_zb_h1_forward_only", 2, ["recompute zb-h1", "(p - 1) F holds only while a forward is at least as "
                                        "long as an input-gradient pass (B / 2)"]),
])
def test_the_planning_hints_name_the_case_the_formula_and_the_mistake(name, check, hints, tmp_path):
    result = grading.run_check(planning_checks.CHECKS[check], BY_NAME[name].write(tmp_path / name))
    assert not result.passed and all(hint in result.message for hint in hints), result.message
