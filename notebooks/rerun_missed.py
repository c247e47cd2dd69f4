"""``make nbval`` with one more run for a notebook whose first failure is a measured claim's miss.

    python notebooks/rerun_missed.py notebooks -- env LABKIT_STRICT_CLAIMS=1 python -m pytest notebooks --nbval ...

runs the pytest command after ``--``; where it fails, each notebook whose *first* failing cell is a measured
claim missing its band in strict mode (:func:`labkit.claims.strict_miss`) is run again, whole, in a fresh kernel
(the command with the path before ``--`` replaced by those notebooks), and the status is that second run's.  A
notebook that fails any other way, first, is not run again and the status is the first run's.

Why: each timing band comes from the spread of many runs on the reference machine, and a notebook run makes some
twenty such claims, so on a busy 2-core machine one of them misses now and then by chance; a model that drifted,
or a band too tight for the machine, misses on the second run too.  Later failures in a notebook whose first one
was a miss are re-checked by its second run (a cell that fails after a raised claim may only lack its variables).

Loaded by pytest as a plugin (``-p rerun_missed``), it records every failing test in order, with its report, in
the JSON file ``$RERUN_MISSED_FAILURES``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from labkit.claims import strict_miss

HERE = Path(__file__).resolve().parent
FAILURES_VARIABLE = "RERUN_MISSED_FAILURES"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def pytest_runtest_logreport(report) -> None:  # noqa: ANN001 (pytest's TestReport)
    """As a pytest plugin: append each failing test's node id and report text to ``$RERUN_MISSED_FAILURES``."""
    path = os.environ.get(FAILURES_VARIABLE)
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as failures:
            failures.write(json.dumps({"nodeid": report.nodeid, "text": ANSI.sub("", str(report.longrepr))}) + "\n")


def to_run_again(failures: list[dict[str, str]]) -> list[str] | None:
    """The notebooks to run once more (in the order they failed), or ``None`` when a notebook's first failure is
    not a measured claim's miss (or nothing was recorded: the run failed before any cell)."""
    first: dict[str, str] = {}
    for failure in failures:
        first.setdefault(failure["nodeid"].split("::")[0], failure["text"])
    if not first or not all(strict_miss(text) for text in first.values()):
        return None
    return list(first)


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") != 1 or argv[0] not in argv[2:]:
        sys.exit("usage: rerun_missed.py PATH -- PYTEST-COMMAND (the command names PATH, which a second run "
                 "replaces by the notebooks to run again)")
    target, command = argv[0], argv[2:]
    failures_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"rerun-missed-{os.getpid()}.jsonl"
    env = {**os.environ, FAILURES_VARIABLE: str(failures_path),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    try:
        status = subprocess.call([*command, "-p", "rerun_missed"], env=env)
        if status == 0 or not failures_path.exists():
            return status
        failures = [json.loads(line) for line in failures_path.read_text().splitlines() if line.strip()]
        again = to_run_again(failures)
        if again is None:
            return status
        print(f"\nrerun_missed.py: the first failure of {', '.join(again)} was a measured claim's miss "
              f"(strict mode); running {'it' if len(again) == 1 else 'them'} once more, whole, in a fresh kernel; "
              "a second miss fails the run\n", flush=True)
        index = command.index(target)
        return subprocess.call([*command[:index], *again, *command[index + 1:]], env={**os.environ})
    finally:
        failures_path.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
