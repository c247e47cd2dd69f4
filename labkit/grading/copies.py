"""A fresh copy of one of labkit's files, loaded under another name, escapes the guard: refuse it.

:mod:`labkit.grading.guard` switches off the functions of labkit's modules as imported.  A student's file can
load the same source again under a new name (``importlib.util.spec_from_file_location`` on labkit's path), whose
functions the guard never saw.  :func:`refuse_copies_of_labkit`, called by a check before and after the student's
code runs, finds any module whose file is labkit's but whose name is not that file's.
"""

from __future__ import annotations

import sys
from pathlib import Path

from labkit.grading.guard import DEFAULT_REASON, Forbidden

_LIBRARY_ROOT = Path(__file__).resolve().parents[2]  # the folder holding the labkit package


def refuse_copies_of_labkit() -> None:
    """Raise :class:`~labkit.grading.guard.Forbidden` if any loaded module is a copy of one of labkit's files."""
    for name, loaded in list(sys.modules.items()):
        where = getattr(loaded, "__file__", None)
        if not where:
            continue
        path = Path(where).resolve()
        if _LIBRARY_ROOT / "labkit" not in path.parents:
            continue
        parts = path.relative_to(_LIBRARY_ROOT).with_suffix("").parts
        expected = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name != expected:
            raise Forbidden(f"used a copy of labkit's own {expected} ({name!r} loaded from {path.name}): "
                            f"{DEFAULT_REASON}")
