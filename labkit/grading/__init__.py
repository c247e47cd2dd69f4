"""Graded exercises: load a student's file, run its checker, print ✓/✗ with hints and a score.

Each notebook ends with an exercise in ``exercises/NN_topic.py`` (stubs that raise ``NotImplementedError``);
``solutions/NN_topic.py`` holds the answers.  ``check("topic")`` grades the student's file — or the solution
when ``LABKIT_SOLUTIONS=1``, which is how CI proves the checkers and the notebooks agree::

    from labkit import grading
    grading.check("setup")

In solutions mode a failing check raises ``AssertionError`` after the report (the reference must pass: this is
what nbval proves in CI); in the student's mode nothing raises, the score is the answer.  :func:`trying`
turns an unfinished stub in a notebook's try-it cell into a line saying what to do next.

Every check runs in its own child process with a time limit, so student code that crashes, hangs in a
collective, or loops for ever becomes a failed check with a message — never a stuck notebook.
"""

from __future__ import annotations

import importlib.util
import io
import multiprocessing as mp
import os
import re
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from labkit import launch as launch_module

# topic -> (file name, checker module, title).  Course order.
EXERCISES: dict[str, tuple[str, str, str]] = {
    "setup": ("00_setup.py", "labkit.grading.checkers.setup", "Ranks, shards and your first all-reduce"),
    "collectives": ("01_collectives.py", "labkit.grading.checkers.collectives",
                    "Ring reduce-scatter, all-gather and all-reduce from send/recv"),
    "data_parallel": ("02_data_parallel.py", "labkit.grading.checkers.data_parallel",
                      "Data parallelism: broadcast, the averaging hook, buckets"),
    "lr_scaling": ("03_lr_scaling.py", "labkit.grading.checkers.lr_scaling",
                   "Scaling the learning rate: the global batch, warmup and decay"),
    "mixed_precision": ("04_mixed_precision.py", "labkit.grading.checkers.mixed_precision",
                        "Mixed precision: unscale, skip on overflow, the dynamic loss scale"),
    "zero": ("05_zero.py", "labkit.grading.checkers.zero",
             "ZeRO-1: shard the optimizer state, step the local shard, broadcast the updates"),
    "tensor_parallel": ("06_tensor_parallel.py", "labkit.grading.checkers.tensor_parallel",
                        "Tensor parallelism: the f and g operators, column- and row-parallel linear layers"),
    "pipeline_parallel": ("07_pipeline_parallel.py", "labkit.grading.checkers.pipeline_parallel",
                          "Pipeline parallelism: the 1F1B order of one rank"),
    "parameter_server": ("08_parameter_server.py", "labkit.grading.checkers.parameter_server",
                         "A parameter server: the rule for applying gradients under a bounded delay"),
    "checkpointing": ("09_checkpointing.py", "labkit.grading.checkers.checkpointing",
                      "Checkpointing: save a data-parallel run on rank 0 and resume it bit for bit"),
    "3d_parallelism": ("10_3d_parallelism.py", "labkit.grading.checkers.parallelism_3d",
                       "3D parallelism: a mesh laid out in any order, and the nodes its groups span"),
    "planning": ("11_planning.py", "labkit.grading.checkers.planning",
                 "Planning a training run: one 3D step's time by hand (compute, TP, bubble, DP)"),
    "divergence_alarm": ("12_divergence_alarm.py", "labkit.grading.checkers.divergence_alarm",
                         "The divergence alarm: each rank's deviation, the noise band, the rank that left"),
    "input_pipeline": ("12_input_pipeline.py", "labkit.grading.checkers.input_pipeline",
                       "The input pipeline: the seed of one sample's augmentation, the same in every process"),
    "long_context": ("13_long_context.py", "labkit.grading.checkers.long_context",
                     "Long sequences: the LSE merge of partial attention, the zig-zag split, blockwise attention"),
    "mixture_of_experts": ("14_mixture_of_experts.py", "labkit.grading.checkers.mixture_of_experts",
                           "Mixture of experts: the router's choice and weights, the capacity's drops, balance"),
}

DEFAULT_CHECK_TIMEOUT = 60.0


class CheckFailed(AssertionError):
    """Raised by a check with a hint for the student (what was expected, what came back)."""


class Forbidden(CheckFailed):
    """Student code called something the exercise asks it to write (labkit's or torch's own, or a copy of it): the
    message says what, and why.  :mod:`labkit.grading.guard` and :mod:`labkit.grading.copies` raise it."""


DEFAULT_REASON = "this exercise asks you to write it yourself"  # why, unless a check says otherwise


@dataclass
class CheckResult:
    name: str
    passed: bool
    message: str = ""
    seconds: float = 0.0


@dataclass
class Report:
    topic: str
    path: str
    checks: list[CheckResult] = field(default_factory=list)
    printed: bool = False

    @property
    def passed(self) -> int:
        return sum(check.passed for check in self.checks)

    @property
    def total(self) -> int:
        return len(self.checks)

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total

    def to_dict(self) -> dict[str, Any]:
        return {"topic": self.topic, "path": self.path, "passed": self.passed, "total": self.total,
                "checks": [asdict(check) for check in self.checks]}

    def __repr__(self) -> str:
        return f"<grading report {self.topic!r}: {self.passed}/{self.total} checks passed>"

    def _ipython_display_(self) -> None:
        # check() has already printed the report line by line; do not print it twice in a notebook.
        if not self.printed:
            print(format_report(self))


def check(topic: str, *, solutions: bool | None = None, directory: str | os.PathLike | None = None,
          verbose: bool = True, timeout: float | None = None) -> Report:
    """Grade one exercise and print a line per check and the score.

    Args:
        topic: the exercise's name, e.g. ``"setup"`` for ``00_setup.py``.
        solutions: grade ``solutions/`` instead of ``exercises/``; default: ``$LABKIT_SOLUTIONS`` is set to 1.
        directory: grade the file in this folder instead of the course's ``exercises/``/``solutions/``.
        timeout: at most this many seconds a check (default: each check's own limit; ``labkit grade --class``).
    """
    if topic not in EXERCISES:
        raise ValueError(f"unknown exercise topic {topic!r}; known topics: {', '.join(EXERCISES)}")
    file_name, checker_name, _ = EXERCISES[topic]
    path = exercise_path(topic, solutions=solutions, directory=directory)
    checker = importlib.import_module(checker_name)
    report = Report(topic=topic, path=str(path))
    if verbose:
        print(f"Checking {path.name} ({'solutions' if _solutions_mode(solutions) else 'exercises'}):")
    for check_fn in checker.CHECKS:
        result = run_check(check_fn, path, timeout)
        report.checks.append(result)
        if verbose:
            print(format_check(result), flush=True)
    if verbose:
        print(f"Score: {report.passed}/{report.total}" + ("  — all checks passed!" if report.all_passed else ""))
        report.printed = True
    if _solutions_mode(solutions) and directory is None and not report.all_passed:
        failed = ", ".join(result.name for result in report.checks if not result.passed)
        raise AssertionError(f"the reference solution {path} fails its own checks: {failed}")
    return report


@contextmanager
def trying(topic: str) -> Iterator[None]:
    """Run a notebook's "try your functions" cell: an unfinished stub becomes a line saying what to do next.

    ``NotImplementedError`` raised by the exercise (here, or inside a rank of a ``launch``) is caught and
    reported in a line or two; every other error is left alone, so a real bug still shows its traceback::

        with grading.trying("setup"):
            print(exercise.shard_bounds(10, 0, 4))
    """
    if topic not in EXERCISES:
        raise ValueError(f"unknown exercise topic {topic!r}; known topics: {', '.join(EXERCISES)}")
    try:
        yield
    except (NotImplementedError, launch_module.RankFailed) as error:
        text = error.remote_traceback if isinstance(error, launch_module.RankFailed) else \
            "".join(traceback.format_exception(type(error), error, error.__traceback__))
        if "NotImplementedError" not in text:
            raise
        names = re.findall(r'File "[^"]*exercises[/\\][^"]*", line \d+, in (\w+)', text)
        what = f"`{names[-1]}`" if names else "a function"
        print(f"✗ {what} is not written yet: complete it in exercises/{EXERCISES[topic][0]}, save, then run this "
              "cell again.\n  The grading cell below checks all of them and gives a hint for each.")


def grade_all(*, solutions: bool | None = None, directory: str | os.PathLike | None = None,
              progress: Callable[[str], None] | None = None) -> list[Report]:
    """Grade every exercise, in course order (``labkit grade``)."""
    reports = []
    for topic in EXERCISES:
        if progress:
            progress(topic)
        try:
            reports.append(check(topic, solutions=solutions, directory=directory, verbose=False))
        except FileNotFoundError as missing:  # a missing file scores zero on each of its checks
            checker = importlib.import_module(EXERCISES[topic][1])
            reports.append(Report(topic=topic, path=EXERCISES[topic][0], checks=[
                CheckResult(check_name(check_fn), False, str(missing)) for check_fn in checker.CHECKS]))
    return reports


# --------------------------------------------------------------------------------------------------------
# Finding and loading the student's file


def _solutions_mode(solutions: bool | None) -> bool:
    if solutions is None:
        return os.environ.get("LABKIT_SOLUTIONS", "").strip().lower() in ("1", "true", "yes")
    return solutions


def exercise_path(topic: str, *, solutions: bool | None = None,
                  directory: str | os.PathLike | None = None) -> Path:
    """Where the file for ``topic`` is: in ``directory`` if given, else the course's exercises/ or solutions/.

    The course folder is looked for from the current directory upwards (a notebook runs in ``notebooks/``),
    then beside the installed ``labkit`` package (an editable install of the repository).
    """
    file_name = EXERCISES[topic][0]
    if directory is not None:
        path = Path(directory) / file_name
        if not path.is_file():
            raise FileNotFoundError(f"no {file_name} in {directory}")
        return path
    folder = "solutions" if _solutions_mode(solutions) else "exercises"
    candidates = [parent / folder for parent in (Path.cwd(), *Path.cwd().parents)]
    candidates.append(Path(__file__).resolve().parents[2] / folder)
    for candidate in candidates:
        if (candidate / file_name).is_file():
            return candidate / file_name
    raise FileNotFoundError(f"could not find {folder}/{file_name} from {Path.cwd()}; pass directory=")


def load_exercise(path: str | os.PathLike) -> ModuleType:
    """Import a student's file as a fresh module (never cached: every check sees the file as saved now)."""
    path = Path(path)
    name = f"labkit_exercise_{path.stem}_{os.getpid()}_{time.monotonic_ns()}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------------------------
# Running one check in isolation


def check_name(check_fn: Callable) -> str:
    return (check_fn.__doc__ or check_fn.__name__).strip().splitlines()[0]


def run_check(check_fn: Callable[[ModuleType], None], path: Path, timeout: float | None = None) -> CheckResult:
    """Run ``check_fn(student_module)`` in a child process with a time limit (the check's own, or ``timeout`` where
    shorter); never raises."""
    name = check_name(check_fn)
    timeout = min(getattr(check_fn, "timeout", DEFAULT_CHECK_TIMEOUT), timeout or float("inf"))
    start = time.monotonic()
    if "fork" not in mp.get_all_start_methods():  # no isolation available (Windows): run in place
        passed, message = _run_check_here(check_fn, path)
        return CheckResult(name, passed, message, time.monotonic() - start)
    context = mp.get_context("fork")
    launch_module.prepare_to_fork()  # the check may launch ranks: its fork must not inherit a live OpenMP pool
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(target=_check_child, args=(check_fn, path, writer), name="labkit-check")
    process.start()
    writer.close()
    try:
        if reader.poll(timeout):
            try:
                passed, message = reader.recv()
            except EOFError:
                passed, message = False, _crash_message(process)
        else:
            passed, message = False, (f"your code did not finish within {timeout:g} s (an endless loop, or a "
                                      "collective that not every rank calls?)")
    finally:
        _kill_tree(process)
        reader.close()
    return CheckResult(name, passed, message, round(time.monotonic() - start, 3))


def _check_child(check_fn, path, writer) -> None:
    os.setpgrp()  # own process group: a timeout kills this check and every rank it launched
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stdout = sys.stderr = io.StringIO()  # student prints stay out of the report
    writer.send(_run_check_here(check_fn, path))
    writer.close()
    os._exit(0)


def _run_check_here(check_fn, path) -> tuple[bool, str]:
    try:
        module = load_exercise(path)
    except BaseException as error:  # a syntax error in the student's file is a failed check, not a crash
        return False, f"could not import {Path(path).name}: {type(error).__name__}: {error}"
    try:
        check_fn(module)
        return True, ""
    except CheckFailed as failure:
        return False, str(failure)
    except NotImplementedError as error:
        return False, f"not implemented yet ({error or 'NotImplementedError'}): complete the TODO"
    except launch_module.RankFailed as failure:
        last = failure.remote_traceback.strip().splitlines()[-1]
        if last.startswith(_FORBIDDEN):  # the guard refused a shortcut: its message is the hint
            return False, f"rank {failure.rank} {last[len(_FORBIDDEN):]}"
        if last.startswith("NotImplementedError"):
            what = last.partition(":")[2].strip() or "NotImplementedError"
            return False, f"not implemented yet ({what}, raised on rank {failure.rank}): complete the TODO"
        return False, f"rank {failure.rank} raised {last}"
    except launch_module.CollectiveTimeout as failure:
        return False, (f"rank(s) {failure.stuck_ranks} hung: did every rank call the same collectives "
                       "in the same order?")
    except BaseException as error:
        last = traceback.format_exception_only(type(error), error)[-1].strip()
        return False, f"raised {last}"


_FORBIDDEN = "labkit.grading.Forbidden: "  # how a rank's traceback names Forbidden


def _crash_message(process) -> str:
    process.join(1.0)
    code = process.exitcode
    if code is not None and code < 0:
        return f"your code crashed the process ({signal.Signals(-code).name})"
    return f"your code ended the process (exit code {code}) before the check finished"


def _kill_tree(process) -> None:
    if process.is_alive() and process.pid:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            process.kill()
    process.join(5.0)
    try:  # ranks launched by the check are in its process group; make sure none outlive it
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# --------------------------------------------------------------------------------------------------------
# What a check's ranks send back


def compact(value: Any) -> Any:
    """``value`` (a rank's result) with each plain CPU tensor in its dicts, lists and tuples sent back as its bytes:
    it arrives a tensor of the same dtype, shape and values (contiguous, detached).  Pickled as itself, a tensor
    is a zip archive written and read back by ``torch.save``/``torch.load``, a millisecond each: a check's ranks
    send hundreds."""
    if type(value) is dict:
        return {key: compact(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(compact(item) for item in value)
    if type(value) is _torch().Tensor and value.device.type == "cpu" and value.layout == _torch().strided and \
            not value.is_quantized:
        return _AsBytes(value)
    return value


class _AsBytes:
    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def __reduce__(self) -> tuple:
        tensor = self.tensor.detach().resolve_conj().resolve_neg().contiguous()
        raw = tensor.reshape(-1).view(_torch().uint8).numpy().tobytes()
        return _tensor_from_bytes, (raw, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


def _tensor_from_bytes(raw: bytes, dtype: str, shape: tuple[int, ...]) -> Any:
    torch = _torch()
    if not raw:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


def _torch() -> ModuleType:
    import torch

    return torch


# --------------------------------------------------------------------------------------------------------
# Formatting


def format_check(result: CheckResult) -> str:
    if result.passed:
        return f"  ✓ {result.name}"
    return f"  ✗ {result.name}\n      → {result.message}"


def format_report(report: Report) -> str:
    lines = [f"{Path(report.path).name}:"] + [format_check(result) for result in report.checks]
    lines.append(f"Score: {report.passed}/{report.total}")
    return "\n".join(lines)


def format_table(reports: list[Report]) -> str:
    """The table ``labkit grade`` prints: one row per exercise, then the total."""
    width = max([len(EXERCISES[r.topic][0]) for r in reports] + [8])
    lines = [f"{'exercise':<{width}}  {'score':>7}  {'':>4}  title", "-" * (width + 40)]
    for report in reports:
        percent = 100.0 * report.passed / report.total if report.total else 0.0
        lines.append(f"{EXERCISES[report.topic][0]:<{width}}  {report.passed:>3}/{report.total:<3}  "
                     f"{percent:>3.0f}%  {EXERCISES[report.topic][2]}")
        for result in report.checks:
            if not result.passed:
                lines.append(f"{'':<{width}}    ✗ {result.name}: {result.message}")
    passed = sum(r.passed for r in reports)
    total = sum(r.total for r in reports)
    lines.append("-" * (width + 40))
    lines.append(f"{'total':<{width}}  {passed:>3}/{total:<3}  {100.0 * passed / max(total, 1):>3.0f}%")
    return "\n".join(lines)
