"""A copy of what the guard switches off refuses as the original does, however it was loaded.

:mod:`labkit.grading.guard` switches off labkit's implementation of an exercise (and torch's, where a check names
it) by swapping the code of each function *object*.  The same source can run again as other objects: a module
loaded from labkit's file under another name (``importlib.util.spec_from_file_location``) or under none
(``module_from_spec`` and ``exec_module``, never registered in ``sys.modules``), the file's text executed into a
plain dict (``exec(open(path).read(), namespace)``), a function made from a code object taken before the guard
(``types.FunctionType(code, globals())``), any of these done when the student's file was imported, before the
check began.  Within :func:`refused` (every check: :func:`labkit.grading.guard.no_shortcuts`):

- every code object about to be executed (``exec``, ``eval``, ``runpy``, an import) or made into a function
  (``types.FunctionType``) is looked through, with the code nested in it, by an audit hook (PEP 578: Python
  raises the event in C, however the function was reached); a copy of a refused function raises
  :class:`~labkit.grading.Forbidden` there, before any of it runs;
- every function made before the block (when the student's file was imported) whose code is such a copy, or
  holds one (a factory that defines it), gets the refusing code as the originals do, until the block ends.  The
  hook, in place since the checker's import, saw that code made: only then are the process's functions listed
  (the garbage collector's list, ~0.1 s with torch loaded) to find the ones that hold it.

A copy is a code object with a refused function's qualified name and either its file (labkit's or torch's source
compiled again, whatever the flags) or, compiled from text with no file (``"<string>"``), its bytecode, names and
constants (its docstring aside, at whatever line).  Code from any other file is never a copy: a student's own
answer may read as labkit's does (three lines can).  Renaming the function in the text before compiling it, or
running it in another interpreter, still escapes: like the guard, this stops the shortcuts an honest student takes
(the library's source is right there to load), not an adversary.  Cost: a look-up by name per code object
executed or made a function.

:func:`refuse_copies_of_labkit`, which checks call before and after the student's code, names a module loaded
from labkit's file under another name even where nothing of it ran.
"""

from __future__ import annotations

import gc
import os
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from labkit.grading import DEFAULT_REASON, Forbidden

_LIBRARY_ROOT = Path(__file__).resolve().parents[2]  # the folder holding the labkit package


def refuse_copies_of_labkit() -> None:
    """Raise :class:`~labkit.grading.Forbidden` if any loaded module is a copy of one of labkit's files."""
    for name, loaded in list(sys.modules.items()):
        where = getattr(loaded, "__file__", None)
        if not where or loaded is sys.modules.get("__main__"):  # the program (`python -m labkit.cli`), not a copy
            continue
        path = Path(where).resolve()
        if _LIBRARY_ROOT / "labkit" not in path.parents:
            continue
        parts = path.relative_to(_LIBRARY_ROOT).with_suffix("").parts
        expected = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name != expected:
            raise Forbidden(f"used a copy of labkit's own {expected} ({name!r} loaded from {path.name}): "
                            f"{DEFAULT_REASON}")


# --------------------------------------------------------------------------------------------------------
# What a copy looks like


def fingerprint(code: types.CodeType) -> tuple:
    """What two compilations of one function's text share, wherever they were compiled from and at whatever line:
    its qualified name, bytecode, names and constants (nested code by its own fingerprint), less the docstring."""
    constants = tuple(fingerprint(constant) if type(constant) is types.CodeType else (type(constant), constant)
                      for constant in code.co_consts[1:])
    return (_qualname(code), code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars,
            code.co_argcount, code.co_kwonlyargcount, code.co_flags & 0xFFFF, constants)  # (not the __future__'s)


@dataclass
class Refused:
    """The refused functions of one guard, by qualified name: the fingerprints and files of their code."""

    messages: dict[str, dict[object, str]] = field(default_factory=dict)  # qualname -> fingerprint or file -> message
    originals: set[int] = field(default_factory=set)  # ids of the refused and allowed functions themselves
    verdicts: dict[int, tuple[types.CodeType, str | None]] = field(default_factory=dict)  # id(code) -> message

    @classmethod
    def of(cls, refusals: list[tuple[types.FunctionType, str, Any]], allowed: Iterable[types.FunctionType]) -> Refused:
        """The :class:`Refused` of a guard's ``(function, message, ...)`` refusals (:func:`labkit.grading.guard.
        forbid`'s), less the ``allowed`` functions: worked out from the functions' own code, so before the guard
        first swaps it (a check's decoration does it, at the checker's import); once per list of refusals."""
        if id(refusals) in _BUILT:
            return _BUILT[id(refusals)][1]
        refused = cls()
        for function, message, *_ in refusals:
            code = function.__code__
            if code.co_name in ("refused", "served", "observed") and code.co_filename == "<string>":
                raise RuntimeError(f"{function.__qualname__} is swapped already: find the refusals before the guard")
            refused.originals.add(id(function))
            path = _real_path(code.co_filename)
            named = function.__qualname__ if hasattr(code, "co_qualname") else function.__name__
            if path is None or _qualname(code) != named:  # code a decorator made or lent (a dataclass's __init__,
                continue  # contextmanager's helper): refused as the original only
            by_name = refused.messages.setdefault(_qualname(code), {})
            by_name[path] = by_name[fingerprint(code)] = message
        refused.originals.update(id(function) for function in allowed)
        for name, by_name in refused.messages.items():  # what the audit hook looks for outside the guards
            _ANY.messages.setdefault(name, {}).update(by_name)
        _BUILT[id(refusals)] = (refusals, refused)  # the list kept, so that its id is not reused
        return refused

    def copy_in(self, code: types.CodeType, remember: bool = True) -> str | None:
        """The message of the refused function ``code`` copies, or that code nested in it copies; else None.
        ``remember``: keep the answer (and the code, so that its id is not reused) for the next time."""
        known = self.verdicts.get(id(code))
        if known is not None and known[0] is code:
            return known[1]
        message = None
        by_name = self.messages.get(_qualname(code))
        if by_name is not None:  # from a file: by the file; from text with no file ("<string>"): by the code itself
            path = _real_path(code.co_filename)
            message = by_name.get(path) if path is not None else by_name.get(fingerprint(code))
        for constant in code.co_consts:
            if message is None and type(constant) is types.CodeType:
                message = self.copy_in(constant, remember)
        if remember:
            self.verdicts[id(code)] = (code, message)
        return message


def _qualname(code: types.CodeType) -> str:
    return getattr(code, "co_qualname", code.co_name)  # (Python 3.10's code has its name only)


@cache
def _real_path(name: str) -> str | None:
    return os.path.realpath(name) if name and not name.startswith("<") else None


# --------------------------------------------------------------------------------------------------------
# Refusing them


_WATCHING: list[Refused] = []  # the guards in force, innermost last: the audit hook reads the last
_BUILT: dict[int, tuple[list, Refused]] = {}  # by id of the guard's list of refusals
_ANY = Refused()  # every guard's refused functions: a copy made outside a guard is remembered, to look for after
_MADE_OUTSIDE: list[str] = []  # (the file a copy came from): while empty, a guard has no functions to look through


def _audit(event: str, args: tuple) -> None:
    if event in ("exec", "function.__new__") and args and type(args[0]) is types.CodeType:
        code = args[0]
        if not _WATCHING:  # a student's file being imported, before its checks
            if _ANY.copy_in(code, remember=False) is not None:
                _MADE_OUTSIDE.append(code.co_filename)
            return
        message = _WATCHING[-1].copy_in(code)
        if message is not None and code.co_name == "<module>":  # a file run again: name the first copy in it
            raise Forbidden(f"ran {code.co_filename} again, which holds a copy of {message.removeprefix('used ')}")
        if message is not None:
            raise Forbidden(f"used a copy of {message.removeprefix('used ')} (its code, loaded again from "
                            f"{code.co_filename})")


@contextmanager
def refused(watched: Refused, swap: Callable[[types.FunctionType, str, ExitStack], bool]) -> Iterator[None]:
    """Within the block, a copy of a function ``watched`` holds refuses too: refused when its code is executed or
    made a function, and, where a function made earlier holds it, given refusing code by ``swap(function, message,
    restore)`` (:func:`labkit.grading.guard.swap_code`)."""
    with ExitStack() as restore:
        for thing in gc.get_objects() if _MADE_OUTSIDE else ():  # (~0.1 s with torch loaded: only when needed)
            if type(thing) is types.FunctionType and id(thing) not in watched.originals:
                message = watched.copy_in(thing.__code__)
                if message is not None:
                    swap(thing, f"used a copy of {message.removeprefix('used ')} (its code, loaded again from "
                                f"{thing.__code__.co_filename})", restore)
        _WATCHING.append(watched)
        restore.callback(_WATCHING.pop)
        yield


sys.addaudithook(_audit)  # for good: a hook cannot be removed (one per process, this module's import)
