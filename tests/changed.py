"""The test files that cover what changed: ``python tests/changed.py [BASE]`` prints them (``make check``).

What changed: the files that differ from ``BASE`` (default ``HEAD``: the working tree's edits, untracked files
included).  What covers it: a changed test file itself; for a changed module of ``labkit/``, every test file that
imports it by name (``import labkit.x.y``, ``from labkit.x import y``, ``from labkit.x.y import z``); for a
grading checker, exercise or solution, ``tests/test_grading.py``; for a notebook, ``tests/test_notebooks.py``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def changed_files(base: str) -> list[str]:
    def git(*args: str) -> list[str]:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()

    return sorted(set(git("diff", "--name-only", base)) | set(git("ls-files", "--others", "--exclude-standard")))


def imported_modules(test_file: Path) -> set[str]:
    """The labkit modules ``test_file`` names in its imports (a ``from a import b`` names ``a`` and ``a.b``)."""
    names = set()
    for node in ast.walk(ast.parse(test_file.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.split(".")[0] == "labkit"}


def covering_tests(paths: list[str]) -> list[str]:
    tests = sorted(REPO.glob("tests/test_*.py"))
    imports = {test: imported_modules(test) for test in tests}
    chosen: set[str] = set()
    for path in paths:
        if path.startswith("tests/test_") and path.endswith(".py") and (REPO / path).is_file():
            chosen.add(path)
        elif path.startswith(("labkit/grading/", "exercises/", "solutions/")):
            chosen.add("tests/test_grading.py")
        elif path.startswith("notebooks/"):
            chosen.add("tests/test_notebooks.py")
        if path.startswith("labkit/") and path.endswith(".py"):
            module = path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            chosen.update(str(test.relative_to(REPO)) for test in tests if module in imports[test])
    return sorted(chosen)


if __name__ == "__main__":
    print(" ".join(covering_tests(changed_files(sys.argv[1] if len(sys.argv) > 1 else "HEAD"))))
