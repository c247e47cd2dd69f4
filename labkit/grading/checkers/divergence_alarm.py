"""Checks for lesson 12's first exercise (``12_divergence_alarm.py``): the divergence alarm's loss test, in three
functions.

1. ``deviations``: each rank's loss minus the others' mean, for 2 to 8 ranks, from a list, a tuple or a deque,
   returned as a list or tuple of plain numbers (not a generator, not tensors), the caller's losses untouched.  The
   mean of all ranks (the rank pulling the mean towards itself), the median and the reversed sign fail, named;
2. ``loss_band``: ``(sigma, limit)`` equal to the alarm's on rows with a steady offset, a drift, two to eight ranks,
   windows of 4 to 16 and z of 3 and 5, rows given as a deque; ``None`` where nothing changes.  The spread of the
   deviations (a steady offset widens its own band), the changes' mean not halved, the last window alone, the band
   without ``sqrt(window)``, the changes taken across ranks instead of checks: each fails, named;
3. ``departed``: the ranks the alarm names, as a tuple of ints: a rank up, a rank down, healthy ranks crossing the
   band beside the furthest (only the furthest), two ranks (both), an offset that began late (the last window's
   mean), a mean exactly at the limit (not beyond it);
4. what it is for: the three put together as the alarm uses them (a deque of the last 64 checks, judged from the
   32nd) and played on data-parallel runs of TinyMLP (4 ranks in one process, averaged gradients as DDP averages
   them): on the run whose rank 1 reads rolled labels they name rank 1 at the step lesson 12's alarm does, on four
   healthy runs nothing.

The references are labkit's own (:mod:`labkit.monitor.alarm`), computed when this module is imported, outside the
guard.  While the checks run, ``labkit.monitor`` is switched off, a copy of its files loaded under another name is
refused, and so is any function whose code comes from labkit's files however it was made (``exec`` of their source
into a namespace, a module loaded and never registered): its first call raises.
"""

from __future__ import annotations

import collections
import math
import numbers
import random
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from labkit import monitor
from labkit.data import make_classification
from labkit.grading import CheckFailed, copies, guard
from labkit.models import MLPConfig, TinyMLP

MONITOR = str(Path(monitor.__file__).resolve().parent) + "/"  # labkit/monitor/: none of the answer's code is from it
TOLERANCE = 1e-9


@contextmanager
def _own_code_only(module) -> Iterator[None]:
    """Refuse copies of labkit's code: a module registered under another name, a function in the student's file
    whose code was compiled from labkit's files, or (while the block runs) any call into such code."""
    copies.refuse_copies_of_labkit()
    for name, value in vars(module).items():
        code = getattr(value, "__code__", None)
        if code is not None and code.co_filename.startswith(MONITOR):
            raise guard.Forbidden(f"your {name} is labkit's own code ({Path(code.co_filename).name}): "
                                  f"{guard.DEFAULT_REASON}")

    def refuse(frame, event, _arg) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(MONITOR):
            raise guard.Forbidden(f"ran labkit's own {frame.f_code.co_name} ({Path(frame.f_code.co_filename).name}), "
                                  f"{guard.DEFAULT_REASON}")

    previous = sys.getprofile()
    sys.setprofile(refuse)
    try:
        yield
    finally:
        sys.setprofile(previous)
    copies.refuse_copies_of_labkit()


def _numbers(value, what: str, length: int) -> list[float]:
    """``value`` as a caller uses it: a list or tuple of ``length`` plain real numbers (no coercion: a generator
    is spent after one pass, a tensor's items are tensors)."""
    if not isinstance(value, (list, tuple)):
        raise CheckFailed(f"{what} returned {type(value).__name__}, not a list: a caller reads it more than once, "
                          "by index")
    if len(value) != length:
        raise CheckFailed(f"{what} returned {len(value)} values for {length} ranks")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, numbers.Real):
            raise CheckFailed(f"{what} holds {item!r} ({type(item).__name__}): return plain floats")
    return [float(item) for item in value]


def _call(function, *args):
    """The student's ``function(*args)``, a deque's refusal to be sliced turned into a hint."""
    try:
        return function(*args)
    except TypeError as error:
        if "slice" not in str(error):
            raise
        raise CheckFailed(f"{function.__name__} was given a collections.deque (what the alarm keeps) and sliced it: "
                          "a deque cannot be sliced; make a list of it first") from None


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=TOLERANCE, abs_tol=1e-12)


# --------------------------------------------------------------------------------------------------------
# 1. deviations

LOSS_CASES = [[1.0, 2.0, 4.0], [2.0, 2.5], [2.31, 2.29, 2.30, 2.45], [0.5, 0.7, 0.6, 0.9, 0.4],
              [3.0 + 0.01 * rank for rank in range(8)], [1e6, 1e6 + 1.0, 1e6 - 2.0], [-1.0, 0.0, 1.0, 2.0]]
EXPECTED_DEVIATIONS = [monitor.deviations(losses) for losses in LOSS_CASES]




def _deviation_mistakes(losses: list[float]) -> list[tuple[list[float], str]]:
    """What plausible mistakes return for ``losses``, each with its hint (worked out at import, outside the guard)."""
    n = len(losses)
    return [([loss - statistics.fmean(losses) for loss in losses],
             "you subtracted the mean of all the ranks, its own loss included: that mean leans towards the rank "
             f"itself, which shrinks every deviation to {n - 1}/{n} of it; take the others' mean"),
            ([-value for value in monitor.deviations(losses)],
             "the sign is reversed: the rank's loss minus the others' mean, so a rank whose loss is higher reads +"),
            ([loss - statistics.median(losses) for loss in losses],
             "you subtracted the median: the alarm's rule is the mean of the other ranks' losses")]


DEVIATION_MISTAKES = [_deviation_mistakes(losses) for losses in LOSS_CASES]


def _hint(got: list[float], mistakes: list[tuple[list[float], str]], otherwise: str) -> str:
    return next((hint for wrong, hint in mistakes
                 if all(_close(a, b) for a, b in zip(got, wrong, strict=True))), otherwise)


@guard.no_shortcuts(built_ins=["labkit.monitor"])
def check_deviations(module) -> None:
    """deviations: each rank's loss minus the other ranks' mean, a list of floats, for 2 to 8 ranks"""
    with _own_code_only(module):
        for losses, expected, mistakes in zip(LOSS_CASES, EXPECTED_DEVIATIONS, DEVIATION_MISTAKES, strict=True):
            for given in (list(losses), tuple(losses), collections.deque(losses)):
                kept = list(given)
                got = _numbers(_call(module.deviations, given), f"deviations({losses})", len(losses))
                if list(given) != kept:
                    raise CheckFailed(f"deviations({losses}) changed the losses it was given: work on a copy")
                if not all(_close(a, b) for a, b in zip(got, expected, strict=True)):
                    raise CheckFailed(f"deviations({losses}) returned {[round(x, 6) for x in got]}, expected "
                                      f"{[round(x, 6) for x in expected]}: "
                                      + _hint(got, mistakes, "each rank: its loss minus (the sum of all losses - "
                                                             "its loss) / (ranks - 1)"))


# --------------------------------------------------------------------------------------------------------
# 2. loss_band


def _rows(ranks: int, checks: int, seed: int, noise: float = 0.05, offset: float = 0.0, drift: float = 0.0
          ) -> list[list[float]]:
    """Deviation rows as the alarm keeps them: each rank's deviations from losses with Gaussian batch noise, the
    last rank ``offset`` higher throughout and ``drift`` more each check."""
    rng = random.Random(seed)
    return [monitor.deviations([2.0 + rng.gauss(0, noise) + (offset + drift * check if rank == ranks - 1 else 0)
                                for rank in range(ranks)]) for check in range(checks)]


BAND_CASES = [(_rows(4, 64, 0), 16, 5.0), (_rows(4, 64, 1, offset=0.5), 16, 5.0), (_rows(2, 40, 2), 16, 5.0),
              (_rows(8, 48, 3, drift=0.002), 8, 3.0), (_rows(3, 33, 4, noise=0.2), 4, 5.0),
              (_rows(5, 64, 5, offset=-0.3, drift=0.004), 16, 5.0)]
EXPECTED_BANDS = [monitor.loss_band(rows, window, z) for rows, window, z in BAND_CASES]
STILL = [[0.25, -0.25, 0.0, 0.0]] * 40  # deviations that never change: no noise to measure


def _band_mistakes(rows: list[list[float]], window: int, z: float) -> list[tuple[list[float], str]]:
    """``(sigma, limit)`` of plausible mistakes on ``rows``, each with its hint (worked out at import)."""
    sigma, limit = monitor.loss_band(rows, window, z)
    spread = statistics.pstdev([value for row in rows for value in row])
    last = monitor.loss_band(rows[-window:], window, z)[0]
    across = monitor.loss_band([list(column) for column in zip(*rows, strict=True)], window, z)
    mistakes = [([spread, z * spread / math.sqrt(window)], "sigma is the spread of the deviations themselves: a rank "
                 "with a steady offset then widens its own band; measure the changes from one check to the next"),
                ([sigma * math.sqrt(2), limit * math.sqrt(2)], "sigma is sqrt(2) too large: for independent d1, d2 the "
                 "mean of (d2 - d1)**2 is 2 sigma**2, so halve the mean before the square root"),
                ([last, z * last / math.sqrt(window)], "sigma is measured on the last window only: use every row "
                 "kept, the longer the better it is known"),
                ([sigma, z * sigma], "the limit is z sigma: the band holds a mean of `window` deviations, whose "
                 "standard error is sigma / sqrt(window)"),
                ([sigma, z * sigma / math.sqrt(window - 1)], "the limit divides by sqrt(window - 1): the standard "
                 "error of a mean of `window` independent deviations is sigma / sqrt(window)")]
    if across is not None:
        mistakes.append(([across[0], across[1]], "the changes were taken between ranks (along a row) instead of "
                         "from one check to the next (down a column)"))
    return mistakes


BAND_MISTAKES = [_band_mistakes(rows, window, z) for rows, window, z in BAND_CASES]


@guard.no_shortcuts(built_ins=["labkit.monitor"])
def check_loss_band(module) -> None:
    """loss_band: the noise of one check (von Neumann) and z standard errors of a window's mean, or None"""
    with _own_code_only(module):
        for (rows, window, z), (sigma, limit), mistakes in zip(BAND_CASES, EXPECTED_BANDS, BAND_MISTAKES, strict=True):
            given = collections.deque([list(row) for row in rows], maxlen=64)
            what = f"loss_band(<{len(rows)} checks of {len(rows[0])} ranks>, window={window}, z={z:g})"
            answer = _call(module.loss_band, given, window, z)
            if [list(row) for row in given] != rows:
                raise CheckFailed(f"{what} changed the rows it was given: work on a copy")
            if answer is None:
                raise CheckFailed(f"{what} returned None, but the deviations change: sigma = {sigma:.6f}")
            got = _numbers(answer, what, 2)
            if not (_close(got[0], sigma) and _close(got[1], limit)):
                raise CheckFailed(f"{what} returned sigma {got[0]:.6f}, limit {got[1]:.6f}; expected {sigma:.6f}, "
                                  f"{limit:.6f}: " + _hint(got, mistakes, "sigma = sqrt(mean of the squared "
                                  "changes / 2) over every rank and pair of consecutive checks, limit = z sigma / "
                                  "sqrt(window)"))
        answer = module.loss_band(tuple(tuple(row) for row in STILL), 16, 5.0)
        if answer is not None:
            raise CheckFailed(f"loss_band(<40 checks whose deviations never change>) returned {answer!r}: with sigma "
                              "0 there is no band (a zero limit would name any rank at any offset); return None")


# --------------------------------------------------------------------------------------------------------
# 3. departed

_up = _rows(4, 64, 6, offset=0.12)  # rank 3 a steady 0.12 nats above the others' mean
_down = [[-value if index == 3 else value for index, value in enumerate(row)] for row in _rows(4, 64, 7,
                                                                                                 offset=0.12)]
_late = _rows(4, 48, 8) + [[value + (0.3 if index == 2 else -0.1) for index, value in enumerate(row)]
                           for row in _rows(4, 16, 9)]  # rank 2 leaves in the last 16 checks only
_at_limit = [[0.5, -0.5 / 3, -0.5 / 3, -0.5 / 3]] * 16  # rank 0's mean exactly at the limit
DEPARTED_CASES = [("rank 3 above the others", _up, 16, 0.1), ("rank 3 below the others", _down, 16, 0.1),
                  ("three ranks beyond the band", _up, 16, 0.02), ("two ranks", _rows(2, 40, 10, offset=0.2), 16, 0.1),
                  ("rank 2 leaving in the last window", _late, 16, 0.1), ("healthy ranks", _rows(4, 64, 11), 16, 0.1),
                  ("a mean exactly at the limit", _at_limit, 16, 0.5), ("a window of 4", _late, 4, 0.1)]
EXPECTED_DEPARTED = [monitor.departed(rows, window, limit) for _, rows, window, limit in DEPARTED_CASES]


def _ranks(value, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)):
        raise CheckFailed(f"{what} returned {type(value).__name__}: return a tuple of ranks (ints), () for none")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, numbers.Integral):
            raise CheckFailed(f"{what} holds {item!r} ({type(item).__name__}): a rank is an int, usable as an index")
    return tuple(int(item) for item in value)


def _departed_hint(case: str, got: tuple[int, ...], expected: tuple[int, ...]) -> str:
    if case == "rank 3 below the others":
        return "a rank whose loss falls below the others' departs too: compare the mean's absolute value"
    if case == "three ranks beyond the band":
        return "name the furthest rank alone: the others' mean carries a third of its offset into every other " \
               "rank's deviation, so healthy ranks cross the band with it"
    if case == "two ranks":
        return "with two ranks the deviations are mirror images: which one left cannot be told, so name both"
    if case.startswith(("rank 2 leaving", "a window")):
        return "average over the last `window` rows only: an offset that began late is diluted in a longer mean"
    if case == "a mean exactly at the limit":
        return "a mean exactly at the limit has not left the band: beyond it means strictly greater"
    if case == "healthy ranks":
        return "no rank's mean leaves the band here: name nobody, ()"
    return f"expected ranks {expected}"


@guard.no_shortcuts(built_ins=["labkit.monitor"])
def check_departed(module) -> None:
    """departed: the furthest rank beyond the band over the last window (both of two), as a tuple of ints"""
    with _own_code_only(module):
        for (case, rows, window, limit), expected in zip(DEPARTED_CASES, EXPECTED_DEPARTED, strict=True):
            what = f"departed(<{case}>, window={window}, limit={limit:g})"
            given = collections.deque([list(row) for row in rows], maxlen=64)
            got = _ranks(_call(module.departed, given, window, limit), what)
            if [list(row) for row in given] != rows:
                raise CheckFailed(f"{what} changed the rows it was given: work on a copy")
            if got != expected:
                raise CheckFailed(f"{what} named {got}, expected {expected}: {_departed_hint(case, got, expected)}")


# --------------------------------------------------------------------------------------------------------
# 4. the alarm on data-parallel runs

RANKS, STEPS, WINDOW, HISTORY, Z = 4, 64, 16, 64, 5.0


def _data_parallel_losses(seed: int, rolled: int | None) -> list[list[float]]:
    """TinyMLP trained as DDP trains it, in one process: each of 4 ranks draws its own batch, the gradients are
    averaged, one AdamW step; rank ``rolled`` reads its batches' labels rolled by one.  Every rank's loss, each
    step."""
    config = MLPConfig(in_features=16, hidden_sizes=(64, 64), num_classes=4)
    model = TinyMLP(config, seed=seed)
    features, labels = make_classification(4096, 16, 4, seed=seed).tensors
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generators = [torch.Generator().manual_seed(1000 * seed + rank) for rank in range(RANKS)]
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        row = []
        for rank, generator in enumerate(generators):
            index = torch.randint(len(labels), (16,), generator=generator)
            targets = labels[index].roll(1) if rank == rolled else labels[index]
            loss = torch.nn.functional.cross_entropy(model(features[index]), targets)
            (loss / RANKS).backward()
            row.append(loss.item())
        optimizer.step()
        losses.append(row)
    return losses


def _alarm_steps(losses: list[list[float]], rule) -> list[tuple[int, tuple[int, ...]]]:
    """Play ``rule`` (``(deviations, loss_band, departed)``) as the alarm does: (step, ranks) each time it names."""
    deviations, band_of, named_by = rule
    kept: collections.deque = collections.deque(maxlen=HISTORY)
    found = []
    for step, row in enumerate(losses, start=1):
        kept.append(_call(deviations, list(row)))
        if len(kept) < HISTORY // 2:
            continue
        band = _call(band_of, kept, WINDOW, Z)
        named = () if band is None else _call(named_by, kept, WINDOW, band[1])
        if named:
            found.append((step, tuple(named)))
    return found


_threads = torch.get_num_threads()
torch.set_num_threads(1)  # products this small only lose time to more threads (a second on an idle laptop)
with torch.random.fork_rng():  # nothing of the importer's random state is used or moved
    RUNS = {"rank 1's labels rolled": _data_parallel_losses(0, rolled=1),
            **{f"healthy, seed {seed}": _data_parallel_losses(seed, rolled=None) for seed in (1, 2, 3, 4)}}
torch.set_num_threads(_threads)
EXPECTED_ALARMS = {name: _alarm_steps(losses, (monitor.deviations, monitor.loss_band, monitor.departed))
                   for name, losses in RUNS.items()}


@guard.no_shortcuts(built_ins=["labkit.monitor"])
def check_on_data_parallel_runs(module) -> None:
    """on data-parallel runs: rank 1's rolled labels named at the lesson alarm's step, healthy runs silent"""
    with _own_code_only(module):
        for name, losses in RUNS.items():
            got = _alarm_steps(losses, (module.deviations, module.loss_band, module.departed))
            expected = EXPECTED_ALARMS[name]
            if not expected and got:
                raise CheckFailed(f"a false alarm on the healthy run ({name}): your rule named ranks {got[0][1]} at "
                                  f"step {got[0][0]}, where the lesson's names nobody")
            if expected and (not got or got[0] != expected[0]):
                first = f"ranks {got[0][1]} first at step {got[0][0]}" if got else "nobody in 64 steps"
                raise CheckFailed(f"on the run where {name}, the lesson's alarm names rank {expected[0][1]} at step "
                                  f"{expected[0][0]}; your rule named {first}")


CHECKS = [check_deviations, check_loss_band, check_departed, check_on_data_parallel_runs]
