"""While a student's function runs, no code of labkit's implementation of the exercise may run, however loaded.

:mod:`labkit.grading.guard` swaps the code of the functions a check refuses, and :mod:`labkit.grading.copies`
refuses copies of those functions however they were loaded.  An exercise whose whole subject is a folder of labkit
(exercise 14: ``labkit.parallel.experts``) needs more than its refused list: a helper of that folder, or a copy of
one, must not run inside the student's answer either.  :func:`only_own_code` does that for the files a checker
names (labkit's implementation, the checker's own): while the block runs, a profile hook sees every Python function about to start and refuses one

- whose code was compiled from one of those files (a module built from the file keeps its name), or
- whose bytecode and names are those of a function of those files, compiled anywhere but in the student's own
  file (the same source compiles to the same code, whatever name ``exec`` gives it).

The student's own file is not compared: a short answer may well compile to what labkit's does.  A refusal is
recorded even when the student's code catches the exception, and raised again when the block ends.  Cost: one
Python call per function call while the student's code runs.  Like the guard, this stops shortcuts, not an
adversary who rewrites the code.
"""

from __future__ import annotations

import functools
import os
import sys
import types
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from labkit.grading.guard import DEFAULT_REASON, Forbidden

LIBRARY = Path(__file__).resolve().parents[2]  # the labkit package
MIN_CODE_BYTES = 16  # shorter code (a property returning an attribute) is not compared: it is anyone's


@functools.cache
def _real(path: str) -> str:
    return os.path.realpath(path)


@functools.cache
def fingerprints(files: tuple[str, ...]) -> frozenset[tuple[bytes, tuple[str, ...]]]:
    """``(bytecode, names)`` of every code object compiled from ``files``: module bodies, functions, nested ones."""
    found: set[tuple[bytes, tuple[str, ...]]] = set()
    for file in files:
        stack = [compile(Path(file).read_text(), file, "exec", dont_inherit=True)]
        while stack:
            code = stack.pop()
            if len(code.co_code) >= MIN_CODE_BYTES:
                found.add((code.co_code, code.co_names))
            stack.extend(constant for constant in code.co_consts if isinstance(constant, types.CodeType))
    return frozenset(found)


def implementation_files(*paths: str | Path) -> tuple[str, ...]:
    """The ``.py`` files of ``paths`` (files, or folders taken whole), resolved, relative ones to the labkit package."""
    files: set[str] = set()
    for path in paths:
        path = Path(path) if Path(path).is_absolute() else LIBRARY / path
        files.update(str(file.resolve()) for file in ([path] if path.is_file() else path.rglob("*.py")))
    return tuple(sorted(files))


@contextmanager
def only_own_code(files: tuple[str, ...], student_file: str | None, allowed: Iterable[types.CodeType] = ()
                  ) -> Iterator[None]:
    """Within the block, any Python function from ``files``, or compiled to the same code outside
    ``student_file``, raises :class:`~labkit.grading.guard.Forbidden`; ``allowed``: code the checker itself hands
    to the student's call (a kernel it registered)."""
    names, prints = set(files), fingerprints(files)
    own = _real(student_file) if student_file else None
    allowed_ids = {id(code) for code in allowed}
    verdicts: dict[int, tuple[types.CodeType, str | None]] = {}  # by id, the code held so that ids stay unique
    refused: list[str] = []
    previous = sys.getprofile()

    def verdict(code: types.CodeType) -> str | None:
        if id(code) in allowed_ids:
            return None
        where = _real(code.co_filename)
        if where in names:
            return f"{code.co_name} from labkit's {Path(where).relative_to(LIBRARY.parent)}"
        if where != own and (code.co_code, code.co_names) in prints:
            return f"{code.co_name}, a copy of labkit's own code (run from {code.co_filename})"
        return None

    def hook(frame: types.FrameType, event: str, arg: object) -> None:
        if previous is not None:  # a profile hook set before this one (a guard's, a profiler) still sees every event
            previous(frame, event, arg)
        if event != "call":
            return
        code = frame.f_code
        known = verdicts.get(id(code))
        why = known[1] if known is not None else verdicts.setdefault(id(code), (code, verdict(code)))[1]
        if why is not None:
            refused.append(why)
            raise Forbidden(f"ran {why}: {DEFAULT_REASON}")

    sys.setprofile(hook)
    try:
        yield
    except BaseException:
        if not refused:
            raise
    finally:
        sys.setprofile(previous)
    if refused:  # raised again, had the student's code caught it (or raised something else instead)
        raise Forbidden(f"ran {refused[0]}: {DEFAULT_REASON}")
