"""Checks for exercise 07 (``07_pipeline_parallel.py``): one_f_one_b_order, the 1F1B order of one rank.

The student's function gives the order of every rank of ``p`` = 4, 2, 3, 5, 6, 8, 12, 16 and 1, for ``m`` of 1,
2, 6, 7, ``p - 1``, ``p``, ``p + 1`` and ``2p`` micro-batches, and up to ``p = 8`` ``3p + 1`` and 16 too (fewer
than the stages, as many, not a multiple of ``p``, many more), and two ``(p, m)`` drawn at random each time
(``p`` up to 24 and none of those, ``m`` up to ``2p``), so that no table of the fixed cases passes.  The orders
become one :class:`~labkit.parallel.pipeline.schedule.Schedule` (stage = rank, no idle slots: the time slots come
from running the orders), which three checks hold to 1F1B:

1. it is a schedule at all: each entry a pair ``("F" | "B", micro-batch)``, each forward and backward once per
   rank, a backward after its own forward, and :func:`~labkit.parallel.pipeline.schedule.validate` finds no
   deadlock between the ranks; and each rank runs its forwards, and its backwards, in micro-batch order (a
   runtime receives micro-batch k's activations and gradients before k + 1's: run out of order, a pass gets
   another micro-batch's tensors);
2. the step takes 1F1B's time: :func:`~labkit.parallel.pipeline.simulate.simulate` with a forward of 1 and a
   backward of 2 (exact integers) gives ``3 (m + p - 1)``, a bubble of exactly ``(p - 1) / (m + p - 1)``;
3. it holds 1F1B's memory: rank ``r`` keeps at most ``min(p - r, m)`` micro-batches' activations at once, and
   that many (fewer would mean a longer step), where GPipe, with the same bubble, keeps ``m``.

An order that is no schedule fails all three (there is nothing to time).  Hints name the rank, ``p`` and ``m``,
compare the forwards a rank runs before its first backward with 1F1B's ``min(p - rank, m)`` (its warm-up of
``min(p - 1 - rank, m)`` and the steady state's first forward), and recognise GPipe.  :mod:`labkit.grading.guard`
forbids ``labkit.parallel`` as for every exercise, less the checker's own tools (``Schedule``, ``validate``,
``simulate``: they time an answer, they do not write one), and the 1F1B tables of
``torch.distributed.pipelining``.
"""

from __future__ import annotations

import random
from collections import Counter
from fractions import Fraction

from labkit.grading import CheckFailed, guard
from labkit.parallel.pipeline.schedule import Action, Schedule, validate
from labkit.parallel.pipeline.simulate import Timeline, simulate

# The first failing case is the one reported: p = 4 first, its many micro-batches first, where the contrast with
# GPipe (16 micro-batches held, against 1F1B's 4) and the cool-down (three backwards owed) show best.
CASES = [(p, m) for p in (4, 2, 3, 5, 6, 8, 12, 16, 1)  # 3p + 1 and 16 only up to p = 8: time in p * m
         for m in sorted({1, 2, 6, 7, p - 1, p, p + 1, 2 * p} - {0} | ({3 * p + 1, 16} if p <= 8 else set()),
                         reverse=True)]
RANDOM = random.SystemRandom()  # not the random module's state, which the student's file could seed


def _cases() -> list[tuple[int, int]]:
    """:data:`CASES`, then two drawn at random: ``p`` up to 24 and none of theirs, ``m`` of 2 to ``2p``."""
    drawn = RANDOM.sample(sorted(set(range(7, 25)) - {p for p, _ in CASES}), 2)
    return CASES + [(p, RANDOM.randint(2, 2 * p)) for p in drawn]
FORWARD_S, BACKWARD_S = 1, 2
# What validate and simulate run on: the checker's tools, left working under the guard (the engine places an
# order in time; it writes none).  The generators (gpipe, one_f_one_b, one_f_one_b_orders, with_time_slots, the
# catalog, ...) are not named here, so they stay forbidden.
_SCHEDULE = "labkit.parallel.pipeline.schedule"
CHECKER_TOOLS = ("labkit.parallel.pipeline.simulate", "labkit.parallel.pipeline.engine", f"{_SCHEDULE}.Action",
                 f"{_SCHEDULE}.Schedule", f"{_SCHEDULE}.validate", f"{_SCHEDULE}.check_table",
                 f"{_SCHEDULE}.compile_schedule", f"{_SCHEDULE}.check_positive", f"{_SCHEDULE}.stage_rank")
# torch's 1F1B tables: the classes' pipeline_order, the interleaved schedules' per-rank builder, the visualizer's
# get_schedule_ops("1F1B", p, m).  Named one by one: the whole module would also swap Enum.__new__ (its enum's).
# (torch 2.14's Schedule1F1B table is off by one on the last stage, F1..Fm: the checks would catch it anyway.)
_TORCH = "torch.distributed.pipelining"
BUILT_INS = tuple(f"{_TORCH}.schedules.{name}" for name in (
    "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble", "ScheduleDualPipeV", "_get_1f1b_rank_ops", "_get_warmup_ops")) + (
    f"{_TORCH}._schedule_visualizer.get_schedule_ops",)
NAME = "your 1F1B"
NOTATION = "(in that notation 2B5 is rank 2's (\"B\", 5): stage 2's backward of micro-batch 5, one stage per rank)"


def _reference(rank: int, p: int, m: int) -> list[tuple[str, int]]:
    """1F1B's order, written out here (the hints quote it; the checks themselves measure)."""
    warmup = min(p - 1 - rank, m)
    order = [("F", k) for k in range(warmup)]
    for k in range(m - warmup):
        order += [("F", warmup + k), ("B", k)]
    return order + [("B", k) for k in range(m - warmup, m)]


def _forwards_first(order: list[Action]) -> int:
    """Forwards before the first backward: 1F1B's ``min(p - rank, m)``, its warm-up of ``min(p - 1 - rank, m)``
    and the steady state's first forward (none when the warm-up took them all)."""
    return next((index for index, action in enumerate(order) if action.kind == "B"), len(order))


def _first_backward_hint(rank: int, p: int, m: int, forwards: int) -> str:
    return (f"rank {rank} runs {forwards} forward(s) before its first backward, where 1F1B runs min(p - rank, m) "
            f"= {min(p - rank, m)}: a warm-up of min(p - 1 - rank, m) = {min(p - 1 - rank, m)}, then the steady "
            "state's first forward")


def _pair(action: Action) -> str:
    return f'("{action.kind}", {action.microbatch})'


# --------------------------------------------------------------------------------------------------------
# From the student's pairs to a validated schedule


def _order(module, rank: int, p: int, m: int) -> list[Action]:
    call = f"one_f_one_b_order(rank={rank}, p={p}, m={m})"
    try:
        order = module.one_f_one_b_order(rank, p, m)
    except (NotImplementedError, CheckFailed):
        raise
    except Exception as error:
        raise CheckFailed(f"{call} raised {type(error).__name__}: {error}") from None
    if not isinstance(order, list):
        raise CheckFailed(f"{call} returned {type(order).__name__}; return a list of (\"F\", k) and (\"B\", k) "
                          "pairs, in the order the rank runs them")
    actions = []
    for index, item in enumerate(order):
        if not (isinstance(item, tuple) and len(item) == 2 and item[0] in ("F", "B") and isinstance(item[1], int)
                and not isinstance(item[1], bool)):
            raise CheckFailed(f"{call}[{index}] is {item!r}: each entry is a tuple (\"F\", k) or (\"B\", k), the "
                              "forward or the backward of micro-batch k (an int)")
        kind, k = item
        if not 0 <= k < m:
            hint = (f"; with fewer micro-batches than stages the warm-up stops at m: min(p - 1 - rank, m) = "
                    f"{min(p - 1 - rank, m)} forwards" if k >= m and m < p else
                    "; a negative count of forwards? The last rank's warm-up is min(p - 1 - rank, m) = 0" if k < 0
                    else "")
            raise CheckFailed(f"{call}[{index}] is {item!r}, but the micro-batches are numbered 0 to m - 1 = "
                              f"{m - 1}{hint}")
        actions.append(Action(rank, kind, k))
    return actions


def _check_each_pass_once(order: list[Action], rank: int, p: int, m: int) -> None:
    call = f"one_f_one_b_order(rank={rank}, p={p}, m={m})"
    counts = Counter(order)
    twice = [action for action, count in counts.items() if count > 1]
    if twice:
        raise CheckFailed(f"{call} runs {_pair(twice[0])} {counts[twice[0]]} times: each forward and each backward "
                          "runs once")
    for kind, what in (("F", "forwards"), ("B", "backwards")):
        missing = [Action(rank, kind, k) for k in range(m) if Action(rank, kind, k) not in counts]
        if missing:
            hint = (": after the steady state (one forward, one backward) the cool-down runs the backwards still "
                    "owed" if kind == "B" and [a.microbatch for a in missing] == list(range(m - len(missing), m))
                    else "")
            raise CheckFailed(f"{call} never runs {', '.join(map(_pair, missing))}: every rank runs the {what} of "
                              f"all m={m} micro-batches{hint}")
    seen: set[int] = set()
    for action in order:
        if action.kind == "B" and action.microbatch not in seen:
            raise CheckFailed(f"{call} runs {_pair(action)} before (\"F\", {action.microbatch}): a backward needs "
                              "the activations its forward kept")
        if action.kind == "F":
            seen.add(action.microbatch)


def _schedule(module, p: int, m: int) -> Schedule:
    orders = []
    for rank in range(p):
        orders.append(_order(module, rank, p, m))
        _check_each_pass_once(orders[-1], rank, p, m)
    schedule = Schedule(p, m, 1, NAME, orders)
    try:
        validate(schedule)
    except ValueError as error:
        raise CheckFailed(f"p={p}, m={m}: the ranks cannot run these orders together: {error} {NOTATION}. A rank "
                          "that waits for a gradient from downstream must not hold back a forward that downstream "
                          "is waiting for") from None
    return schedule


def _in_order(order: list[Action], rank: int, p: int, m: int) -> None:
    for kind, what in (("F", "forwards"), ("B", "backwards")):
        run = [action.microbatch for action in order if action.kind == kind]
        if run != sorted(run):
            k = next(index for index, (got, want) in enumerate(zip(run, sorted(run), strict=True)) if got != want)
            raise CheckFailed(f"one_f_one_b_order(rank={rank}, p={p}, m={m}) runs its {what} in the order {run}: "
                              f"micro-batch {run[k]} before {sorted(run)[k]}. A runtime receives each micro-batch's "
                              f"{'activations' if kind == 'F' else 'gradients'} in micro-batch order, so run out of "
                              "order a pass gets another micro-batch's tensors: run them 0, 1, 2, ...")


def _timelines(module) -> list[tuple[int, int, Schedule, Timeline]]:
    timelines = []
    for p, m in _cases():
        schedule = _schedule(module, p, m)
        timelines.append((p, m, schedule, simulate(schedule, forward_s=FORWARD_S, backward_s=BACKWARD_S)))
    return timelines


def _failing(failures: list[str]) -> None:
    if failures:
        others = f" (and {len(failures) - 1} more of the {len(CASES) + 2} cases (p, m) checked)" if failures[1:] else ""
        raise CheckFailed(failures[0] + others)


# --------------------------------------------------------------------------------------------------------
# The checks


@guard.no_shortcuts(allow=CHECKER_TOOLS, built_ins=BUILT_INS)
def check_orders_run(module) -> None:
    """every rank runs each forward and backward once, in micro-batch order, in orders the ranks can run together"""
    for p, m in _cases():
        for rank, order in enumerate(_schedule(module, p, m).orders()):
            _in_order(order, rank, p, m)


def _bubble_hint(schedule: Schedule) -> str:
    p, m = schedule.p, schedule.m
    orders = schedule.orders()
    for rank, order in enumerate(orders):
        forwards = _forwards_first(order)
        if forwards < min(p - rank, m):
            return (f": {_first_backward_hint(rank, p, m, forwards)}; with fewer it waits for a gradient from "
                    "downstream when it could be running forwards, and the ranks downstream wait for those forwards")
        if forwards > min(p - rank, m):
            return (f": {_first_backward_hint(rank, p, m, forwards)}; the extra forwards delay the backward that "
                    "the ranks upstream wait for")
    for rank, order in enumerate(orders):
        want = _reference(rank, p, m)
        for position, (action, expected) in enumerate(zip(order, want, strict=True)):
            if (action.kind, action.microbatch) != expected:
                return (f": the warm-ups are right, but pass {position + 1} of rank {rank} is {_pair(action)}, where "
                        f"1F1B runs (\"{expected[0]}\", {expected[1]}): after the warm-up alternate one forward and "
                        "one backward, then run the backwards left, each time the backward of the oldest micro-batch")
    return ""


@guard.no_shortcuts(allow=CHECKER_TOOLS, built_ins=BUILT_INS)
def check_bubble(module) -> None:
    """the step takes 1F1B's time (forward 1, backward 2): a bubble of (p-1)/(m+p-1) of the ranks' time"""
    failures = []
    for p, m, schedule, timeline in _timelines(module):
        bubble, want = Fraction(timeline.idle) / (p * Fraction(timeline.total)), Fraction(p - 1, m + p - 1)
        if bubble != want:
            failures.append(f"p={p}, m={m}: your orders take {timeline.total:g} time units (forward 1, backward 2), "
                            f"so the ranks idle {bubble} ({float(bubble):.3f}) of the time; 1F1B takes 3 (m + p - "
                            f"1) = {3 * (m + p - 1)}, a bubble of (p - 1)/(m + p - 1) = {want}"
                            + _bubble_hint(schedule))
    _failing(failures)


@guard.no_shortcuts(allow=CHECKER_TOOLS, built_ins=BUILT_INS)
def check_activations(module) -> None:
    """rank r holds at most min(p - r, m) micro-batches' activations at once, not GPipe's m"""
    failures = []
    for p, m, schedule, timeline in _timelines(module):
        orders = schedule.orders()
        gpipe = all(_forwards_first(order) == m for order in orders)  # every forward, then every backward
        for rank, (order, peak) in enumerate(zip(orders, timeline.peak_activations, strict=True)):
            want, forwards = min(p - rank, m), _forwards_first(order)
            if peak == want:
                continue
            message = (f"rank {rank} of p={p}, m={m} holds {peak} micro-batches at peak; 1F1B holds "
                       f"min(p - rank, m) = {want}")
            if peak > want and gpipe:
                message += (f": all m of them, as GPipe does (every forward before the first backward, on every "
                            f"rank); after a warm-up of min(p - 1 - rank, m) = {min(p - 1 - rank, m)} forwards, "
                            "alternate one forward and one backward, so that each backward frees a micro-batch "
                            "before the next forward")
            elif peak > want and forwards > want:
                message += (f": your warm-up runs too many forwards before the first backward "
                            f"({_first_backward_hint(rank, p, m, forwards)})")
            elif peak > want:
                message += (": after the warm-up, each forward is followed by a backward, which frees a "
                            "micro-batch, before the next forward")
            else:
                message += (f": your warm-up runs too few forwards ({_first_backward_hint(rank, p, m, forwards)}), "
                            "so the pipeline runs dry (the step-time check says by how much)")
            failures.append(message)
            break
    _failing(failures)


CHECKS = [check_orders_run, check_bubble, check_activations]
