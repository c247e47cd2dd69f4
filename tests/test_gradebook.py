"""``labkit grade --class``: a class of 30 folders graded in parallel into one CSV and a summary, whatever the
folders hold (answers right and wrong, untouched stubs, a hang, an exit, a kill, a syntax error, missing
files, no files); bad arguments refused before any process starts.

The class is graded on two exercises whose checks take a tenth of a second each (03 and 10) with a 3 s limit, so
that the 30 students take seconds on 2 cores; the machinery is the same for every exercise.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labkit import cli, grading
from tests.conftest import REPO, is_alive, live_descendants
from tests.wrong_answers import BY_NAME

TOPICS = "lr_scaling,3d_parallelism"
LR, MESH = "03_lr_scaling.py", "10_3d_parallelism.py"
NODES = "    \"\"\"For each dimension, the most nodes that one of its groups spans"

# student -> (points on lr_scaling /5, on 3d_parallelism /3, status, what the `failed` cell must say)
EXPECTED: dict[str, tuple[int, int, str, list[str]]] = {
    **{f"solution_{n:02d}": (5, 3, "full marks", []) for n in range(1, 11)},
    **{f"stub_{n}": (0, 0, "not started", ["lr_scaling: not implemented yet (all 5 checks)",
                                           "3d_parallelism: not implemented yet (all 3 checks)"]) for n in range(1, 6)},
    "wrong_lr_scaling_ignores_accumulation": (3, 3, "graded", ["lr_scaling: global_batch counts", "lr_scaling: lr_at peaks"]),
    "wrong_lr_scaling_no_decay": (4, 3, "graded", ["lr_scaling: lr_at decays"]),
    "wrong_lr_scaling_sqrt_rule": (3, 3, "graded", ["lr_scaling: scaled_lr follows", "lr_scaling: lr_at peaks"]),
    "wrong_lr_scaling_warmup_from_zero": (4, 3, "graded", ["lr_scaling: lr_at warms up"]),
    "wrong_3d_outermost_first": (5, 0, "graded", ["3d_parallelism: coordinates(", "3d_parallelism: groups("]),
    "wrong_3d_nodes_round_robin": (5, 2, "graded", ["3d_parallelism: nodes_spanned("]),
    "wrong_3d_float_coordinates": (5, 2, "graded", ["3d_parallelism: coordinates("]),
    "wrong_3d_grouped_by_own_coordinate": (5, 1, "graded", ["3d_parallelism: groups("]),
    "x_hangs": (5, 2, "timed out", ["3d_parallelism: nodes_spanned(", "your code did not finish within 3 s"]),
    "x_exits_on_import": (0, 3, "crashed", ["lr_scaling: your code ended the process (exit code 3) before the check "
                                            "finished (all 5 checks)"]),
    "x_killed": (5, 2, "crashed", ["3d_parallelism: nodes_spanned(", "your code crashed the process (SIGKILL)"]),
    "x_syntax_error": (0, 3, "import error", ["lr_scaling: could not import 03_lr_scaling.py: SyntaxError"]),
    "y_missing_a_file": (5, 0, f"missing {MESH}", [f"3d_parallelism: missing {MESH} (all 3 checks)"]),
    "z_empty": (0, 0, "no exercise files", ["no exercise files in the folder"]),
    "z_notes_only": (0, 0, "no exercise files", ["no exercise files in the folder"]),
}


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} no longer occurs once in {path.name}"
    path.write_text(text.replace(old, new))


def _make_class(root: Path) -> Path:
    """The 30 folders of :data:`EXPECTED`, beside what is not a student (a file, a hidden folder)."""
    for name in EXPECTED:
        folder = root / name
        if name.startswith("stub_"):
            shutil.copytree(REPO / "exercises", folder)
        elif not name.startswith("z_"):
            shutil.copytree(REPO / "solutions", folder)
        if name.startswith("wrong_"):
            BY_NAME[name.removeprefix("wrong_")].write(folder)
    _edit(root / "x_hangs" / MESH, NODES, "    while True:  # never returns\n        pass\n" + NODES)
    _edit(root / "x_killed" / MESH, NODES, "    import os\n    os.kill(os.getpid(), 9)  # as the OOM killer does\n" + NODES)
    (root / "x_exits_on_import" / LR).write_text("import os\nos._exit(3)\n" + (root / "x_exits_on_import" / LR).read_text())
    _edit(root / "x_syntax_error" / LR, "def scaled_lr(", "def scaled_lr(:")
    for file in (root / "y_missing_a_file").iterdir():
        if file.name != LR:
            file.unlink()
    (root / "z_empty").mkdir()
    (root / "z_notes_only").mkdir()
    (root / "z_notes_only" / "notes.txt").write_text("I will do it tomorrow\n")
    (root / ".ipynb_checkpoints").mkdir()
    (root / "roster.txt").write_text("\n".join(EXPECTED))
    return root


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> dict:
    """``labkit grade --class`` on the 30 folders, run once (in this process, as ``labkit.cli.main``)."""
    root = _make_class(tmp_path_factory.mktemp("class"))
    before = live_descendants()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["grade", "--class", str(root), "--only", TOPICS, "--timeout", "3", "--jobs", "2"])
    with (root / "gradebook.csv").open() as table, (root / "gradebook_checks.csv").open() as checks:
        rows, check_rows = list(csv.DictReader(table)), list(csv.DictReader(checks))
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(), "rows": rows, "checks": check_rows,
            "left": {pid for pid in live_descendants() - before if is_alive(pid)}}


def test_every_folder_is_a_row_with_its_scores_status_and_reasons(graded):
    assert graded["code"] == 0, graded["stderr"]
    rows = {row["student"]: row for row in graded["rows"]}
    assert list(rows) == sorted(EXPECTED)  # one row per folder, by name; the file and the hidden folder are not
    for name, (lr, mesh, status, reasons) in EXPECTED.items():
        row = rows[name]
        got = (int(row["lr_scaling /5"]), int(row["3d_parallelism /3"]), row["status"])
        assert got == (lr, mesh, status), (name, got, row["failed"])
        assert (int(row["points"]), int(row["total"])) == (lr + mesh, 8), name
        assert all(reason in row["failed"] for reason in reasons), (name, row["failed"])
        assert bool(row["failed"]) == (lr + mesh < 8), name
    assert list(graded["rows"][0]) == ["student", "status", "points", "total", "lr_scaling /5", "3d_parallelism /3",
                                       "seconds", "failed"]


def test_the_long_csv_holds_every_check_of_every_student_with_its_full_message(graded):
    checks = graded["checks"]
    assert len(checks) == 30 * 8
    assert sum(int(row["passed"]) for row in checks) == sum(lr + mesh for lr, mesh, *_ in EXPECTED.values())
    hung = [row for row in checks if row["student"] == "x_hangs" and row["passed"] == "0"]
    assert len(hung) == 1 and hung[0]["check"].startswith("nodes_spanned(") and 3 <= float(hung[0]["seconds"]) < 10
    assert {row["message"] for row in checks if row["student"] == "y_missing_a_file" and row["exercise"] ==
            "3d_parallelism"} == {f"missing {MESH}"}


def test_the_summary_gives_each_exercises_mean_full_marks_and_most_failed_checks(graded):
    out = graded["stdout"]
    assert "30 students, 2 exercise(s)" in out and "by 2 worker(s)" in out
    # lr_scaling: 99 points of 150, 17 full marks; 3d: 57 of 90, 16; the total 156 of 240, 10 (see EXPECTED)
    assert re.search(r"03_lr_scaling\.py +3\.3/5 \(66%\) +17 of 30", out), out
    assert re.search(r"10_3d_parallelism\.py +1\.9/3 \(63%\) +16 of 30", out), out
    assert re.search(r"total +5\.2/8 \(65%\) +10 of 30", out), out
    lr_block = out.split("03_lr_scaling.py")[1].split("10_3d_parallelism.py")[0]
    assert "✗ 11 of 30 failed: lr_at peaks" in lr_block.splitlines()[1]  # the most failed first
    mesh_block = out.split("10_3d_parallelism.py", 1)[1].split("total")[0]
    assert "✗ 13 of 30 failed: nodes_spanned(" in mesh_block.splitlines()[1]
    look = out.split("needs a look: ")[1]
    assert all(f"{name} ({status})" in look for name, (*_, status, _) in EXPECTED.items()
               if name.startswith(("x_", "y_", "z_")))
    assert "solution_01" not in look and "stub_1" not in look


def test_a_progress_line_per_student_on_stderr_and_nothing_left_running(graded):
    lines = [line for line in graded["stderr"].splitlines() if line.startswith("[")]
    assert len(lines) == 30
    assert sorted(int(line[1:].split("/")[0]) for line in lines) == list(range(1, 31))
    assert all(re.match(r"\[\d+/30\] \S+: \d/8 \(\d+\.\d s of checks\), \d+:\d\d elapsed", line) for line in lines)
    assert any(line.endswith("[timed out]") and "x_hangs: 7/8" in line for line in lines)
    assert not graded["left"], f"processes left behind: {graded['left']}"


def test_the_command_writes_json_and_the_csv_where_asked_and_grades_lessons_12_to_14_under_python_m(tmp_path):
    """Run as ``python -m labkit.cli``: the program's ``__main__`` (labkit/cli.py) is not a copy of labkit that
    the guard of exercises 12-14 refuses."""
    shutil.copytree(REPO / "solutions", tmp_path / "class" / "ada")
    shutil.copytree(REPO / "exercises", tmp_path / "class" / "bo")
    completed = subprocess.run([sys.executable, "-m", "labkit.cli", "grade", "--class", str(tmp_path / "class"),
                                "--only", "divergence_alarm", "--json", "--out", str(tmp_path / "out" / "book.csv")],
                               cwd=REPO, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    data = json.loads(completed.stdout)
    assert [(s["student"], s["points"], s["total"], s["status"]) for s in data["students"]] == \
        [("ada", 4, 4, "full marks"), ("bo", 0, 4, "not started")], data
    assert "[2/2]" in completed.stderr and (tmp_path / "out" / "book_checks.csv").is_file()
    assert (tmp_path / "out" / "book.csv").read_text().splitlines()[1].startswith("ada,full marks,4,4,4,")


@pytest.mark.parametrize("args, says", [
    (["--class", "/no/such/class"], "--class '/no/such/class' is not a directory"),
    (["--class", "{empty}"], "holds no student folders"),
    (["--class", "{one_student}"], "holds no student folders (it holds exercise files: grade one student's folder "
                                   "with --dir)"),
    (["--class", "{class}", "--jobs", "0"], "--jobs must be an integer >= 1, got 0"),
    (["--class", "{class}", "--timeout", "0"], "--timeout must be a number of seconds > 0, got 0.0"),
    (["--class", "{class}", "--only", "setup,nope"], "--only: unknown exercise topic 'nope'; known topics: setup, "
                                                     "collectives,"),
    (["--class", "{class}", "--dir", "{class}"], "not with --dir or --solutions"),
    (["--class", "{class}", "--solutions"], "not with --dir or --solutions"),
    (["--class", "{class}", "--out", "{class}"], "is a directory: name a file"),
    (["--only", "setup"], "--only goes with --class DIR"),
], ids=["missing", "empty", "a-student-folder", "jobs-0", "timeout-0", "unknown-topic", "with-dir", "with-solutions",
        "out-a-folder", "only-alone"])
def test_bad_arguments_exit_2_naming_the_value_before_anything_starts(args, says, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "one_student").mkdir()
    (tmp_path / "one_student" / LR).write_text("")
    (tmp_path / "class" / "ada").mkdir(parents=True)
    folders = {name: str(tmp_path / name) for name in ("empty", "one_student", "class")}
    before = live_descendants()
    assert cli.main(["grade", *(arg.format(**folders) for arg in args)]) == 2
    assert says in capsys.readouterr().err
    assert not live_descendants() - before and not (tmp_path / "class" / "gradebook.csv").exists()


def _sleeps(module) -> None:
    """sleeps longer than any limit here"""
    time.sleep(30)


_sleeps.timeout = 1.0


def test_a_timeout_caps_each_checks_own_limit_and_never_raises_it(tmp_path):
    (tmp_path / "answer.py").write_text("")
    assert "within 1 s" in grading.run_check(_sleeps, tmp_path / "answer.py", timeout=20.0).message  # its own
    assert "within 0.5 s" in grading.run_check(_sleeps, tmp_path / "answer.py", timeout=0.5).message
