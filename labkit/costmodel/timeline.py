"""A pipeline schedule placed in time, fast: the step model's inner loop (:func:`labkit.costmodel.step.predict_step`).

:func:`labkit.parallel.pipeline.simulate` places a schedule's actions as a runtime runs them: each rank runs its
order, an action starts when its rank is free and its inputs are done, plus the send's time when an input
crosses ranks.  It builds the schedule's table first (every action given a unit time slot, and validated),
which for the interleaved schedule with ``v = 16`` chunks and hundreds of micro-batches takes seconds; the
planner prices hundreds of such layouts.  This module runs the same placement on each rank's *order* alone
(the generators' orders, as :mod:`labkit.parallel.pipeline.schedule` builds them, without the table), compiled
once per ``(schedule, p, m, v)`` into integer dependencies in a topological order, so that each placement is
one pass over the actions.  It gives :func:`~labkit.parallel.pipeline.simulate`'s makespan and every action's
start and end (tests/test_costmodel_planning.py holds the two equal), plus what the step model reads off the
timeline: when each chunk's gradients are complete and when each rank's first forward runs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from labkit.parallel.pipeline import catalog
from labkit.parallel.pipeline.schedule import Action, _one_f_one_b_order, stage_rank

SCHEDULES = tuple(catalog.SCHEDULES)
_HAND_WRITTEN = ("gpipe", "1f1b", "zb-h1", "interleaved")  # the others: read off the catalog's table


def orders(schedule: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Each rank's actions in the order it runs them, as :mod:`labkit.parallel.pipeline.schedule`'s generators
    order them (``gpipe``, ``one_f_one_b``, ``zb_h1``, ``interleaved_1f1b``: Megatron's warm-up of
    ``(v - 1) p + 2 (p - 1 - r)`` forwards, then one forward and one backward, chunks visited in groups of
    ``p`` micro-batches)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule not in _HAND_WRITTEN:
        return catalog.SCHEDULES[schedule](p, m, v).orders()
    if schedule == "gpipe":
        return [[Action(r, "F", mb) for mb in range(m)] + [Action(r, "B", mb) for mb in range(m)] for r in range(p)]
    if schedule in ("1f1b", "zb-h1"):
        return [_one_f_one_b_order(r, p, m, split=schedule == "zb-h1") for r in range(p)]
    if m % p:
        raise ValueError(f"interleaved 1F1B runs micro-batches in groups of p, so m must be a multiple of p: "
                         f"got m={m}, p={p}")
    total = m * v
    result = []
    for rank in range(p):
        def forward(k: int, rank: int = rank) -> Action:
            return Action(((k // p) % v) * p + rank, "F", (k // (p * v)) * p + k % p)

        def backward(k: int, rank: int = rank) -> Action:
            return Action((v - 1 - (k // p) % v) * p + rank, "B", (k // (p * v)) * p + k % p)

        warmup = min((v - 1) * p + 2 * (p - 1 - rank), total)
        order = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [forward(warmup + k), backward(k)]
        order += [backward(k) for k in range(total - warmup, total)]
        result.append(order)
    return result


@dataclass(frozen=True)
class Compiled:
    """A schedule's actions (ids: each rank's order, rank after rank) in a topological order.  ``kind`` and
    ``chunk`` of each id; ``steps``: in that order, ``(id, the id before it on its rank, first input, whether it
    crosses ranks, second input, whether it does)``, where ``len(kind)`` stands for none (it ends at 0);
    ``last_gradient``: each chunk's last gradient-producing pass (its last ``B``, or ``W`` when split);
    ``first_forward``: each rank's first pass."""

    p: int
    kind: tuple[str, ...]
    chunk: tuple[int, ...]
    steps: tuple[tuple[int, int, int, bool, int, bool], ...]
    last_gradient: tuple[int, ...]
    first_forward: tuple[int, ...]


_KINDS = "FBIW"


def _integer_orders(schedule: str, p: int, m: int, v: int) -> list[list[tuple[int, int, int]]]:
    """:func:`orders` as ``(chunk, kind, micro-batch)`` integers (kind: 0 F, 1 B, 2 I, 3 W), without building an
    :class:`~labkit.parallel.pipeline.schedule.Action` per pass (the same orders: tests compare them); the
    schedules of :mod:`~labkit.parallel.pipeline.zero_bubble` are read off their tables."""
    if schedule not in _HAND_WRITTEN:
        return [[(a.stage, _KINDS.index(a.kind), a.microbatch) for a in order] for order in orders(schedule, p, m, v)]
    if schedule == "gpipe":
        return [[(r, 0, mb) for mb in range(m)] + [(r, 1, mb) for mb in range(m)] for r in range(p)]
    if schedule in ("1f1b", "zb-h1"):
        split = schedule == "zb-h1"
        result = []
        for rank in range(p):  # labkit.parallel.pipeline.schedule._one_f_one_b_order
            warmup = min(p - 1 - rank, m)
            order = [(rank, 0, mb) for mb in range(warmup)]
            for mb in range(m):
                if warmup + mb < m:
                    order.append((rank, 0, warmup + mb))
                order.append((rank, 2 if split else 1, mb))
                if split and mb - rank >= 0:
                    order.append((rank, 3, mb - rank))
            if split:
                order += [(rank, 3, mb) for mb in range(max(m - rank, 0), m)]
            result.append(order)
        return result
    total, result = m * v, []
    for rank in range(p):  # labkit.parallel.pipeline.schedule.interleaved_1f1b
        forward = [(((k // p) % v) * p + rank, 0, (k // (p * v)) * p + k % p) for k in range(total)]
        backward = [((v - 1 - (k // p) % v) * p + rank, 1, (k // (p * v)) * p + k % p) for k in range(total)]
        warmup = min((v - 1) * p + 2 * (p - 1 - rank), total)
        order = forward[:warmup]
        for k in range(total - warmup):
            order += [forward[warmup + k], backward[k]]
        result.append(order + backward[total - warmup:])
    return result


@functools.lru_cache(maxsize=64)
def compile_schedule(schedule: str, p: int, m: int, v: int = 1) -> Compiled:
    """:func:`orders` compiled (see :class:`Compiled`); raises ``ValueError`` if the orders deadlock.  The
    inputs follow :func:`labkit.parallel.pipeline.schedule._inputs`'s rule: a forward needs the previous
    chunk's forward, a backward (B or I) its own forward and the next chunk's backward, a W its I."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == "interleaved" and m % p:
        raise ValueError(f"interleaved 1F1B runs micro-batches in groups of p, so m must be a multiple of p: "
                         f"got m={m}, p={p}")
    ranked = _integer_orders(schedule, p, m, v)
    stages = p * catalog.stages_per_rank(schedule, v)
    owner = [stage_rank(c, p, "v" if schedule in catalog.V_SHAPED else "loop") for c in range(stages)]
    pairs = {(f.stage, f.microbatch): (b.stage, b.microbatch)  # DualPipeV's F&B: F waits for B's input too
             for f, b in (catalog.SCHEDULES[schedule](p, m, v).pairs if schedule == "dualpipev" else ())}
    slot = [-1] * (stages * 4 * m)  # (chunk, kind, micro-batch) -> id
    kinds, chunks, micros, first = [], [], [], []
    for order in ranked:
        first.append(len(kinds))
        for c, k, mb in order:
            slot[(c * 4 + k) * m + mb] = len(kinds)
            kinds.append(k)
            chunks.append(c)
            micros.append(mb)
    none = len(kinds)
    need1, cross1, need2, cross2 = [none] * none, [False] * none, [none] * none, [False] * none

    def upstream(c: int, mb: int) -> tuple[int, bool]:  # the next chunk's backward (B, or I when split)
        found = slot[((c + 1) * 4 + 1) * m + mb]
        return (found if found >= 0 else slot[((c + 1) * 4 + 2) * m + mb]), owner[c + 1] != owner[c]

    for i, (c, k, mb) in enumerate(zip(chunks, kinds, micros, strict=True)):
        if k == 0:
            if c > 0:
                need1[i], cross1[i] = slot[((c - 1) * 4) * m + mb], owner[c - 1] != owner[c]
            paired = pairs.get((c, mb))
            if paired is not None and paired[0] + 1 < stages:
                need2[i], cross2[i] = upstream(*paired)
        elif k == 3:
            need1[i] = slot[(c * 4 + 2) * m + mb]
        else:
            need1[i] = slot[(c * 4) * m + mb]
            if c + 1 < stages:
                need2[i], cross2[i] = upstream(c, mb)
    if min(need1) < 0 or min(need2) < 0:
        raise ValueError(f"{schedule} (p={p}, m={m}, v={v}): an input is never run")
    # a topological order: each rank runs its order while its next pass's inputs are placed
    done = [False] * (none + 1)
    done[none] = True
    ends = first[1:] + [none]
    position, steps = list(first), []
    while len(steps) < none:
        progressed = False
        for r in range(p):
            i, end = position[r], ends[r]
            while i < end and done[need1[i]] and done[need2[i]]:
                done[i] = True
                steps.append((i, i - 1 if i > first[r] else none, need1[i], cross1[i], need2[i], cross2[i]))
                i += 1
            progressed |= i > position[r]
            position[r] = i
        if not progressed:
            raise ValueError(f"{schedule} (p={p}, m={m}, v={v}): the ranks' orders deadlock")
    last = [-1] * stages
    for i, k in enumerate(kinds):
        if k in (1, 3):
            last[chunks[i]] = i  # each rank's order visits its passes in time order: the last B or W
    return Compiled(p, tuple(_KINDS[k] for k in kinds), tuple(chunks), tuple(steps), tuple(last), tuple(first))


def place(compiled: Compiled, forward_s: list[float], backward_s: list[float], send_s: float = 0.0
          ) -> tuple[list[float], list[float]]:
    """Every action's ``(starts, ends)`` (by id): ``forward_s`` and ``backward_s`` per chunk; a split backward
    is ``I`` and ``W`` of half the ``B`` each (:func:`~labkit.parallel.pipeline.simulate`'s default)."""
    half = [b / 2 for b in backward_s]
    table = {"F": forward_s, "B": backward_s, "I": half, "W": half}
    duration = [table[k][c] for k, c in zip(compiled.kind, compiled.chunk, strict=True)]
    n = len(duration)
    starts, ends = [0.0] * n, [0.0] * (n + 1)  # ends[n]: "nothing before", at 0
    for i, before, first, crosses, second, also in compiled.steps:
        start = ends[before]
        arrives = ends[first] + send_s if crosses else ends[first]
        if arrives > start:
            start = arrives
        arrives = ends[second] + send_s if also else ends[second]
        if arrives > start:
            start = arrives
        starts[i] = start
        ends[i] = start + duration[i]
    return starts, ends[:n]


@dataclass(frozen=True)
class Pipeline:
    """What the step model reads off a placed schedule: the makespan, each chunk's last gradient-producing pass
    ``(start, end)`` and each rank's first forward ``(start, end)``."""

    total: float
    last_gradient: tuple[tuple[float, float], ...]
    first_forward: tuple[tuple[float, float], ...]


def _read(compiled: Compiled, starts: list[float], ends: list[float]) -> Pipeline:
    return Pipeline(max(ends), tuple((starts[i], ends[i]) for i in compiled.last_gradient),
                    tuple((starts[i], ends[i]) for i in compiled.first_forward))


def pipeline(schedule: str, p: int, m: int, v: int, forward_s: list[float], backward_s: list[float],
             send_s: float = 0.0) -> Pipeline:
    """``schedule`` placed with ``m`` micro-batches (:func:`place`), read as a :class:`Pipeline`.  (Placing a
    few micro-batches and extrapolating is not exact: with a heavier last stage a pipeline can take tens of
    micro-batches to settle into its periodic regime.)"""
    compiled = compile_schedule(schedule, p, m, v)
    return _read(compiled, *place(compiled, forward_s, backward_s, send_s))
