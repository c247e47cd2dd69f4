"""A class's gradebook: every student folder graded in parallel, one CSV, a summary per exercise.

``labkit grade --class DIR`` grades each immediate subfolder of ``DIR`` (a student's copy of ``exercises/``,
sorted by name; hidden folders and ``__pycache__`` aside) exactly as ``labkit grade --dir`` grades one: every
check in its own child process with its time limit (:func:`labkit.grading.run_check`), so a student's file that
crashes, hangs or does not import costs that student points, never the run.  A folder missing an exercise file
scores 0 on that exercise's checks ("missing 05_zero.py"), without a process; one with no exercise file at all is
a row that says so.

Parallelism: a pool of ``jobs`` worker processes (default: one per core) takes one (student, exercise) at a time,
in student order.  Exercises are the unit rather than whole students because their costs differ by 100x (a
pure function's checks take 0.3 s, exercise 14's take 7 s; a hung check takes its whole time limit): with whole
students, the last worker to start a slow student finishes alone.  Each worker is forked once and grades many
exercises, so torch is imported once per worker, not per student.  A check that launches ranks runs them beside
the other workers' checks: ``jobs`` counts graders, not processes, and ``--jobs 1`` is the quiet run.

The CSV (``gradebook.csv`` in ``DIR`` unless ``--out`` says otherwise; a file, so never taken for a student) has
one row per student, for a spreadsheet:

    student, status, points, total, <topic> /<checks> for each exercise graded, seconds, failed

``status`` is ``full marks``, ``graded`` (some checks failed on their own terms), ``not started`` (every check
failed as not implemented yet) or what needs a look: ``no exercise files``, ``missing 05_zero.py`` (or ``missing 3 files``), ``timed out``, ``crashed``, ``import error``,
``grader error``, several joined by ``; ``.  ``failed`` lists each failed check as ``topic: check: reason`` (the
check's first words, the reason's first line, both cut short), joined by `` | ``; an exercise whose checks all
failed for one reason (a missing file, a syntax error, an untouched stub) is one entry.  Beside it,
``gradebook_checks.csv`` holds one row per (student, check) with the full name and message (long format: filter
or pivot it).
"""

from __future__ import annotations

import csv
import importlib
import multiprocessing as mp
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit import grading
from labkit.launch import prepare_to_fork

# Words that run_check puts in a failed check's message, and the status each stands for.
PROBLEMS = {"did not finish within": "timed out", "crashed the process": "crashed",
            "ended the process": "crashed", "could not import": "import error", "the grader failed": "grader error"}
NOT_STARTED = "not implemented yet"


@dataclass
class StudentGrade:
    """One student's row: a report per exercise graded (a missing file's checks failed, with no process run)."""

    name: str
    folder: Path
    reports: list[grading.Report] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # exercise files graded but absent
    has_files: bool = True  # any of the course's exercise files at all

    @property
    def points(self) -> int:
        return sum(report.passed for report in self.reports)

    @property
    def total(self) -> int:
        return sum(report.total for report in self.reports)

    @property
    def seconds(self) -> float:
        return sum(check.seconds for report in self.reports for check in report.checks)

    @property
    def status(self) -> str:
        if not self.has_files:
            return "no exercise files"
        flags = [f"missing {self.missing[0]}" if len(self.missing) == 1 else f"missing {len(self.missing)} files"] \
            if self.missing else []
        failures = [check for report in self.reports for check in report.checks if not check.passed]
        for check in failures:
            flags += [kind for words, kind in PROBLEMS.items() if words in check.message and kind not in flags]
        if flags or not failures:
            return "; ".join(flags) or "full marks"
        return "not started" if all(NOT_STARTED in check.message for check in failures) else "graded"

    @property
    def needs_a_look(self) -> bool:
        """Whether the folder, not only the answers, went wrong: files missing, a hang, a crash, an import error."""
        return self.status not in ("full marks", "graded", "not started")

    def failed(self) -> str:
        """The ``failed`` cell: ``topic: check: reason`` a failed check, one entry where an exercise failed whole."""
        if not self.has_files:
            return "no exercise files in the folder"
        entries = []
        for report in self.reports:
            failures = [check for check in report.checks if not check.passed]
            reasons = {short(check.message, 100) for check in failures}
            if failures and len(failures) == report.total and len(reasons) == 1:
                entries.append(f"{report.topic}: {reasons.pop()} (all {report.total} checks)")
            elif failures and len(failures) == report.total and all(NOT_STARTED in c.message for c in failures):
                entries.append(f"{report.topic}: {NOT_STARTED} (all {report.total} checks)")
            else:
                entries += [f"{report.topic}: {short(check.name, 40)}: {short(check.message, 100)}"
                            for check in failures]
        return " | ".join(entries)


@dataclass
class Gradebook:
    """Every student's grade, in name order, with the exercises graded and how the run went."""

    students: list[StudentGrade]
    topics: list[str]
    jobs: int
    seconds: float = 0.0

    def checks(self, topic: str) -> int:
        return len(check_names(topic))

    def to_dict(self) -> dict[str, Any]:
        return {"topics": self.topics, "jobs": self.jobs, "seconds": round(self.seconds, 1),
                "students": [{"student": s.name, "status": s.status, "points": s.points, "total": s.total,
                              "exercises": [report.to_dict() for report in s.reports]} for s in self.students]}


def short(text: str, width: int) -> str:
    """``text`` on one line, its first line only, cut to ``width`` characters (``…`` where cut)."""
    line = " ".join(text.strip().splitlines()[0].split()) if text.strip() else ""
    return line if len(line) <= width else line[:width - 1].rstrip() + "…"


def check_names(topic: str) -> list[str]:
    """The names of ``topic``'s checks, in order (what a missing file fails)."""
    return [grading.check_name(check) for check in importlib.import_module(grading.EXERCISES[topic][1]).CHECKS]


# --------------------------------------------------------------------------------------------------------
# What to grade: validated before any process starts


def parse_topics(text: str | None) -> list[str]:
    """``"setup,lr_scaling"`` -> those topics in course order; ``None``: every exercise.  ``ValueError`` naming
    an unknown topic and the known ones."""
    if text is None:
        return list(grading.EXERCISES)
    asked = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [topic for topic in asked if topic not in grading.EXERCISES]
    if unknown or not asked:
        raise ValueError(f"--only: unknown exercise topic {(unknown or [text])[0]!r}; known topics: "
                         f"{', '.join(grading.EXERCISES)}")
    return [topic for topic in grading.EXERCISES if topic in asked]


def student_folders(directory: str | os.PathLike) -> list[Path]:
    """The student folders of a class: ``directory``'s immediate subfolders, by name (hidden ones and
    ``__pycache__`` aside).  ``ValueError`` naming ``directory`` if it is not a folder or holds none."""
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"--class {str(directory)!r} is not a directory")
    folders = sorted(path for path in root.iterdir()
                     if path.is_dir() and not path.name.startswith(".") and path.name != "__pycache__")
    if not folders:
        hint = " (it holds exercise files: grade one student's folder with --dir)" \
            if any((root / file).is_file() for file, _, _ in grading.EXERCISES.values()) else ""
        raise ValueError(f"--class {str(directory)!r} holds no student folders{hint}")
    return folders


def validate(*, jobs: int | None, timeout: float | None) -> int:
    """The number of workers (``jobs``, default one per core); ``ValueError`` naming a bad ``jobs`` or ``timeout``."""
    if jobs is not None and jobs < 1:
        raise ValueError(f"--jobs must be an integer >= 1, got {jobs}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"--timeout must be a number of seconds > 0, got {timeout}")
    return jobs or os.cpu_count() or 1


# --------------------------------------------------------------------------------------------------------
# Grading in parallel


def grade_exercise(folder: str, topic: str, timeout: float | None) -> grading.Report:
    """One student's exercise, in a worker of the pool: each check in its own child process, as ``grading.check``
    runs them."""
    return grading.check(topic, directory=folder, verbose=False, timeout=timeout)


def failed_report(topic: str, path: str, reason: str) -> grading.Report:
    """``topic``'s every check failed with ``reason``: a missing file, or a worker that could not grade it."""
    return grading.Report(topic=topic, path=path, checks=[grading.CheckResult(name, False, reason)
                                                          for name in check_names(topic)])


def grade_class(directory: str | os.PathLike, *, topics: Iterable[str] | None = None, jobs: int | None = None,
                timeout: float | None = None, progress: Callable[[str], None] | None = None) -> Gradebook:
    """Grade every student folder in ``directory`` on ``topics`` (default: every exercise) with ``jobs`` workers.

    ``timeout`` caps each check's time limit (a check's own limit still holds where shorter).  ``progress`` gets
    a line per student finished (``[12/30] alice: 61/65 (38 s of checks), 1:02 elapsed``).  Never raises for what
    a student's folder holds; ``ValueError`` for bad arguments, before any process starts.
    """
    topics = parse_topics(None if topics is None else ",".join(topics))  # known ones, in course order
    workers = validate(jobs=jobs, timeout=timeout)
    start = time.monotonic()
    students = [StudentGrade(folder.name, folder) for folder in student_folders(directory)]
    waiting: dict[int, int] = {}  # student index -> exercises not back yet
    tasks: list[tuple[int, str]] = []
    for index, student in enumerate(students):
        student.has_files = any((student.folder / file).is_file() for file, _, _ in grading.EXERCISES.values())
        for topic in topics:
            file_name = grading.EXERCISES[topic][0]
            if not (student.folder / file_name).is_file():
                student.missing.append(file_name)
                reason = "no exercise files in the folder" if not student.has_files else f"missing {file_name}"
                student.reports.append(failed_report(topic, file_name, reason))
            else:  # until its report comes back
                student.reports.append(failed_report(topic, file_name, "not graded: the run was interrupted"))
                tasks.append((index, topic))
                waiting[index] = waiting.get(index, 0) + 1
    finished = 0

    def done(index: int) -> None:
        nonlocal finished
        finished += 1
        student = students[index]
        if progress:
            elapsed = int(time.monotonic() - start)
            progress(f"[{finished}/{len(students)}] {student.name}: {student.points}/{student.total} "
                     f"({student.seconds:.1f} s of checks), {elapsed // 60}:{elapsed % 60:02d} elapsed"
                     + (f"  [{student.status}]" if student.needs_a_look else ""))

    for index in range(len(students)):
        if index not in waiting:
            done(index)
    if tasks:
        for task, report in _run_pool(students, tasks, workers, timeout):
            index, topic = tasks[task]
            students[index].reports[topics.index(topic)] = report
            waiting[index] -= 1
            if waiting[index] == 0:
                done(index)
    return Gradebook(students, topics, workers, time.monotonic() - start)


def _run_pool(students: list[StudentGrade], tasks: list[tuple[int, str]], workers: int,
              timeout: float | None) -> Iterator[tuple[int, grading.Report]]:
    """(task's index, its report) as the pool finishes each; a worker's failure is the task's reason."""
    prepare_to_fork()  # once here, so the forked workers do not each import torch._dynamo
    fork = "fork" in mp.get_all_start_methods()
    with ProcessPoolExecutor(max_workers=min(workers, len(tasks)),
                             mp_context=mp.get_context("fork") if fork else None) as pool:
        futures = {pool.submit(grade_exercise, str(students[index].folder), topic, timeout): task
                   for task, (index, topic) in enumerate(tasks)}
        try:
            for future in as_completed(futures):
                task = futures[future]
                try:
                    yield task, future.result()
                except Exception as error:  # the worker, not the student's code (that runs in a check's child)
                    topic = tasks[task][1]
                    yield task, failed_report(topic, grading.EXERCISES[topic][0],
                                              f"the grader failed: {type(error).__name__}: {error}")
        finally:  # an interrupted run starts nothing more; each running check still kills its own tree
            pool.shutdown(wait=True, cancel_futures=True)


# --------------------------------------------------------------------------------------------------------
# The CSV and the summary


def write_csv(book: Gradebook, path: str | os.PathLike) -> tuple[Path, Path]:
    """Write the gradebook (one row per student) to ``path`` and every check's result beside it
    (``<stem>_checks.csv``, one row per student and check); return both paths."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["student", "status", "points", "total",
                         *(f"{topic} /{book.checks(topic)}" for topic in book.topics), "seconds", "failed"])
        for student in book.students:
            writer.writerow([student.name, student.status, student.points, student.total,
                             *(report.passed for report in student.reports), f"{student.seconds:.1f}",
                             student.failed()])
    checks = path.with_name(f"{path.stem}_checks.csv")
    with checks.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["student", "exercise", "check", "passed", "seconds", "message"])
        for student in book.students:
            for report in student.reports:
                writer.writerows([student.name, report.topic, check.name, int(check.passed), check.seconds,
                                  check.message] for check in report.checks)
    return path, checks


def format_summary(book: Gradebook, most_failed: int = 3) -> str:
    """The table ``labkit grade --class`` prints: per exercise, the mean score, how many students got full
    marks and the checks that failed most (with how many students failed each); then the total, and the students
    whose folder needs a look (no files, missing files, a hang, a crash, an import error)."""
    count = len(book.students)
    width = max([len(grading.EXERCISES[topic][0]) for topic in book.topics] + [8])

    def row(name: str, points: list[int], total: int) -> str:
        mean = sum(points) / count
        full = sum(value == total for value in points)
        return f"{name:<{width}}  {f'{mean:.1f}/{total} ({100 * mean / total:.0f}%)':>16}  {f'{full} of {count}':>10}"

    lines = [f"{'exercise':<{width}}  {'mean points':>16}  {'full marks':>10}", "-" * (width + 30)]
    for column, topic in enumerate(book.topics):
        reports = [student.reports[column] for student in book.students]
        lines.append(row(grading.EXERCISES[topic][0], [report.passed for report in reports], book.checks(topic)))
        failures = Counter(check.name for report in reports for check in report.checks if not check.passed)
        lines += [f"    ✗ {times} of {count} failed: {short(name, width + 60)}"
                  for name, times in failures.most_common(most_failed)]
    lines += ["-" * (width + 30), row("total", [student.points for student in book.students],
                                      sum(book.checks(topic) for topic in book.topics))]
    look = [f"{student.name} ({student.status})" for student in book.students
            if student.needs_a_look]
    if look:
        lines.append(f"needs a look: {', '.join(look)}")
    return "\n".join(lines)
