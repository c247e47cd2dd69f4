"""How a notebook states a claim: the words, the value, what it is held to, and where that band comes from.

A lesson makes two kinds of claim, and they fail in different ways.

**Computed claims** are what the analytical models, the simulator and the planner compute, what a parallel
wrapper counts (bytes, parameters, activations) and what one process and several ranks compute alike (parity, to
the rounding of sums taken in another order).  The same code gives the same answer on every machine, so a miss is
a bug, in the library or in the lesson: :func:`exact`, :func:`close` and :func:`holds` raise
:class:`ClaimFailed` in every run, a learner's included.

**Measured claims** are what a busy machine moves: wall-clock times, speed-ups, bubbles, anything that depends on
when the operating system ran a process.  Each is held to a :class:`Band` around what it is compared with, and
the band says where it comes from: the model's own slack (a runtime can only add idle time to a schedule, never
remove it), or the run-to-run spread measured on the course's reference machine (2 cores, the suite running
beside it), cited in the band's ``source``.  What happens on a miss depends on who is running:

- a learner (the default): :func:`measured` and :func:`measured_holds` print a visible verdict — what was
  expected, within what, what was measured, and that a busy machine does this — and the notebook goes on, so a
  laptop busy with a video call never stops a Run All before the exercise;
- strict mode (``LABKIT_STRICT_CLAIMS=1``: nbval, the browser test and ``notebooks/store.py`` set it): the miss
  raises :class:`ClaimFailed`, so a band too tight for the machine, or a model that drifted, fails CI.  A notebook
  whose first failure is such a miss is run once more, whole, in a fresh kernel (:func:`strict_miss`), and
  fails if anything fails again: by chance a claim leaves a band now and then, a broken model every time.

**What is printed, and what the sanitizer masks.**  Every claim prints one line: ``✓`` (or ``✗``), the claim in
words, the values.  A value that was measured, or computed from a measurement, prints with a leading ``~``
(``~49.7 ms``); that mark is the only thing ``notebooks/sanitize.cfg`` masks in a number.  Everything printed
without it — a model's prediction, a byte count, a planner's step time — is compared by nbval digit for digit,
so a changed constant or formula fails the notebooks that print it.  :func:`approx` formats a measured number
that way for a notebook's own prints.

**A record of every claim.**  With ``LABKIT_CLAIMS_LOG=PATH`` set, every claim appends one JSON line to ``PATH``
(its kind, words, values, band, source and verdict); ``python -m labkit.claims PATH...`` prints them as a table,
per notebook, which is how the course's list of claims and their bands is kept honest.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

STRICT_VARIABLE = "LABKIT_STRICT_CLAIMS"
LOG_VARIABLE = "LABKIT_CLAIMS_LOG"
PASS, MISS = "✓", "✗"
BUSY = "a busy machine does this: re-run the cell"


class ClaimFailed(AssertionError):
    """A claim that did not hold: a computed one in any run, a measured one in strict mode."""


def strict() -> bool:
    """Whether a measured claim that misses raises (``LABKIT_STRICT_CLAIMS=1``: nbval, CI, storing a notebook)."""
    return os.environ.get(STRICT_VARIABLE, "").strip().lower() in ("1", "true", "yes")


def strict_miss(error: str) -> bool:
    """Whether an error's text is a measured claim's miss in strict mode, rather than a computed claim's or any
    other failure.  The suite's notebook runs (``make nbval``, the browser test) give a notebook whose first
    failure is such a miss one more run, in a fresh kernel: a band drawn from the reference machine's spread is
    missed now and then by chance, twice in a row only by a model or a machine that left it."""
    return f"(strict mode: {STRICT_VARIABLE}=1)" in error


def approx(value: float, spec: str = ".3g") -> str:
    """A measured number as notebooks print it: ``~`` and the number (``approx(0.0497, ".4f")`` -> ``~0.0497``)."""
    return f"~{value:{spec}}"


@dataclass(frozen=True)
class Band:
    """Where a measured value may fall around the value it is compared with, and why.

    ``relative=True``: the ratio measured / expected lies in ``[low, high]``; ``relative=False``: the difference
    measured - expected does (in the value's own unit).  ``source`` says where the band comes from: the model's
    slack, or a run-to-run spread measured on the reference machine (say how many runs, the range, under what
    load).  A band is part of the claim: it is printed beside every verdict.
    """

    low: float
    high: float
    source: str
    relative: bool = True

    def __post_init__(self) -> None:
        if not self.low <= self.high:
            raise ValueError(f"a band needs low <= high, got low={self.low!r}, high={self.high!r}")
        if not self.source.strip():
            raise ValueError("a band must say where it comes from (source=...): the model, or a measured spread")

    def contains(self, measured: float, expected: float) -> bool:
        """Whether ``measured`` lies in this band around ``expected`` (a NaN never does)."""
        if self.relative:
            if expected == 0:
                return False
            offset = measured / expected
        else:
            offset = measured - expected
        return self.low <= offset <= self.high

    def describe(self, expected: str, unit: str = "", scale: float = 1.0) -> str:
        """The band in words around ``expected`` (already formatted): "0.8x to 1.25x of 30.6 ms",
        "-0.5 to +10 points of 27.3%"."""
        if self.relative:
            return f"{self.low:g}x to {self.high:g}x of {expected}"
        points = unit == "%"
        low, high = self.low * scale, self.high * scale
        span = f"{low:+g} to {high:+g}" + (" points" if points else f" {unit}".rstrip())
        return f"{span} of {expected}"


def _format(value: Any, spec: str, unit: str, scale: float) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        text = f"{value * scale:{spec}}"
    else:
        text = str(value)
    return f"{text}{'' if unit in ('', '%', 'x') else ' '}{unit}"


def _record(kind: str, statement: str, holds: bool, **fields: Any) -> None:
    path = os.environ.get(LOG_VARIABLE)
    if not path:
        return
    entry = {"kind": kind, "statement": statement, "holds": holds, "strict": strict(), **fields}
    with open(path, "a", encoding="utf-8") as log:
        log.write(json.dumps(entry, default=str) + "\n")


def _say(holds: bool, statement: str, detail: str) -> None:
    print(f"{PASS if holds else MISS} {statement}" + (f": {detail}" if detail else ""), flush=True)


# --------------------------------------------------------------------------------------------------------
# Computed claims: asserted in every run


def exact(statement: str, value: Any, expected: Any, *, shown: str | None = None) -> Any:
    """A computed claim: ``value == expected`` (numbers, Fractions, strings, lists, dicts), in every run.

    Prints ``✓ statement`` and ``shown`` (default: the value, when it is short); raises :class:`ClaimFailed`
    naming both values otherwise.  Returns ``value``.
    """
    ok = bool(value == expected)
    _record("exact", statement, ok, value=value, expected=expected)
    if not ok:
        raise ClaimFailed(f"{statement}: expected {expected!r}, got {value!r}")
    if shown is None:
        shown = repr(value) if len(repr(value)) <= 60 else ""
    _say(True, statement, shown)
    return value


def holds(statement: str, condition: bool, *, shown: str = "") -> bool:
    """A computed claim that is a condition (an order, a sign, a set of cases), in every run.

    ``shown`` gives the values the condition was read from, as the notebook should print them.
    """
    ok = bool(condition)
    _record("holds", statement, ok, shown=shown)
    if not ok:
        raise ClaimFailed(f"{statement}: does not hold" + (f" ({shown})" if shown else ""))
    _say(True, statement, shown)
    return True


def close(statement: str, value: float, expected: float = 0.0, *, tolerance: float, relative: bool = False,
          spec: str = ".1e") -> float:
    """A computed claim up to floating-point rounding: ``|value - expected| <= tolerance`` (relative to
    ``|expected|`` when ``relative``), in every run.

    For parity (a split model against one process: sums added in another order) and for models evaluated in
    floats.  The difference varies with the CPU's kernels, so it prints as measured (``~``); the tolerance is
    part of the claim and prints exactly (the values themselves are the notebook's to print).  Returns the
    difference.
    """
    difference = abs(value - expected)
    scale = abs(expected) if relative else 1.0
    ok = difference <= tolerance * scale and not math.isnan(difference)
    bound = f"{tolerance:g}" + (" relative" if relative else "")
    _record("close", statement, ok, value=value, expected=expected, tolerance=tolerance, relative=relative)
    if not ok:
        raise ClaimFailed(f"{statement}: {value!r} is {difference:.3g} from {expected!r}, beyond {bound}")
    shown = f"differs by {approx(difference, spec)}"
    _say(True, statement, f"{shown} (within {bound})")
    return difference


# --------------------------------------------------------------------------------------------------------
# Measured claims: a visible verdict for a learner, a failure in strict mode


def _miss(statement: str, verdict: str, source: str) -> None:
    message = f"{statement}: {verdict}"
    if strict():
        raise ClaimFailed(f"{message} (strict mode: {STRICT_VARIABLE}=1). Band: {source}")
    print(f"{MISS} {message}; {BUSY}.\n  (The band comes from: {source})", flush=True)


def measured(statement: str, value: float, expected: float, band: Band, *, unit: str = "", scale: float = 1.0,
             spec: str = ".3g", expected_measured: bool = False) -> bool:
    """A measured claim: ``value`` lies in ``band`` around ``expected``.

    ``unit``, ``scale`` and ``spec`` say how both print (``scale=1e3, unit="ms"`` for seconds shown in
    milliseconds; ``scale=100, unit="%"`` for a fraction, where a difference band reads in points).
    ``expected_measured``: the value compared with was itself computed from a measurement (a model fed measured
    durations), so it prints as measured too.  Returns whether the claim held; see the module docstring for a
    miss.
    """
    ok = band.contains(value, expected)
    shown_value = "~" + _format(value, spec, unit, scale)
    shown_expected = ("~" if expected_measured else "") + _format(expected, spec, unit, scale)
    within = band.describe(shown_expected, unit, scale)
    _record("measured", statement, ok, value=value, expected=expected, low=band.low, high=band.high,
            relative=band.relative, source=band.source)
    if ok:
        _say(True, statement, f"measured {shown_value}, within {within}")
    else:
        offset = value / expected if band.relative and expected else value - expected
        found = f"{offset:.3g}x" if band.relative else f"{offset * scale:+.3g}" + (" points" if unit == "%" else "")
        _miss(statement, f"expected {within}, measured {shown_value} (~{found})", band.source)
    return ok


def measured_holds(statement: str, condition: bool, *, shown: str, source: str) -> bool:
    """A measured claim that is a condition (an order of measured times, a sign): ``shown`` prints the measured
    values it was read from (with ``~``), ``source`` says why the condition should hold on a busy machine too
    (the margin it has, measured).  Returns whether it held; a miss is a verdict or, in strict mode, a failure."""
    if not source.strip():
        raise ValueError("a measured claim must say where its margin comes from (source=...)")
    ok = bool(condition)
    _record("measured_holds", statement, ok, shown=shown, source=source)
    if ok:
        _say(True, statement, shown)
    else:
        _miss(statement, f"not so this time ({shown})", source)
    return ok


# --------------------------------------------------------------------------------------------------------
# The record


def read_log(paths: Iterable[str]) -> list[dict[str, Any]]:
    """Every claim recorded in the ``LABKIT_CLAIMS_LOG`` files ``paths``, each with its ``file``."""
    entries = []
    for path in paths:
        with open(path, encoding="utf-8") as log:
            entries += [{"file": os.path.basename(path), **json.loads(line)} for line in log if line.strip()]
    return entries


def report(entries: list[dict[str, Any]]) -> str:
    """The claims as a table per file: kind, verdict, words, and for a measured one its band and source."""
    lines, current = [], None
    for entry in entries:
        if entry["file"] != current:
            current = entry["file"]
            lines.append(f"\n## {current}")
        mark = PASS if entry["holds"] else MISS
        band = ""
        if entry["kind"] == "measured":
            kind = "x" if entry["relative"] else " (difference)"
            band = f" | band {entry['low']:g} to {entry['high']:g}{kind}; {entry['source']}"
        elif entry["kind"] == "measured_holds":
            band = f" | margin: {entry['source']}"
        elif entry["kind"] == "close":
            band = f" | within {entry['tolerance']:g}" + (" relative" if entry["relative"] else "")
        lines.append(f"{mark} [{entry['kind']}] {entry['statement']}{band}")
    return "\n".join(lines).lstrip("\n")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m labkit.claims LOG.jsonl [LOG.jsonl ...]  (written with LABKIT_CLAIMS_LOG=PATH)")
    print(report(read_log(sys.argv[1:])))
