"""Pipeline schedules as data: per rank, the order of forward and backward passes over micro-batches.

A pipeline cuts the model into ``S = p v`` *stages*; rank ``r`` of ``p`` holds stages ``r, r + p, r + 2p, ...``
(``v`` chunks each, round-robin, as in Narayanan et al. 2021).  The batch is cut into ``m`` micro-batches.  A
*schedule* says, per rank and time slot, which :class:`Action` runs: ``F`` (forward of one stage on one
micro-batch), ``B`` (its full backward), or, split as in zero-bubble (Qi et al. 2023), ``I`` (the gradient with
respect to the stage's input, which the previous stage is waiting for) and ``W`` (the weight gradient, which no
one waits for).  ``None`` is an idle slot: the *bubble*.  The letters and the compact form ``"1F0"`` (stage 1,
forward, micro-batch 0) are PyTorch's (``torch.distributed.pipelining``), and so is the CSV, one row per rank.

=========================  ========================================  =================  ==========================
schedule                   order on rank ``r``                       bubble fraction    activations held, rank r
=========================  ========================================  =================  ==========================
:func:`gpipe`              all ``m`` forwards, then all backwards    (p-1) / (m+p-1)    ``m`` micro-batches
:func:`one_f_one_b`        ``p-1-r`` forwards, then F B F B ...,     (p-1) / (m+p-1)    ``p - r``
                           then the remaining backwards
:func:`interleaved_1f1b`   1F1B over ``v`` chunks per rank, in       (p-1) / (v m+p-1)  ``(v-1)p + 2(p-1-r) + 1``
                           groups of ``p`` micro-batches             (chunk = 1/v)      chunks of ``1/v`` stage
:func:`zb_h1`              1F1B with B split into I and W, each W    (p-1) / (3m+p-1)   ``p - r`` (from F to I)
                           deferred ``r`` micro-batches              (F = I = W = 1)
:func:`zb_v`               two stages a rank in a V (r, 2p-1-r),     (p-1) / (6m+p-1)   1F1B's, ``p`` of a rank's
                           F I W on each in turn (torch's ZBV)       (m >= 2p-1; a      layers (Qi et al.)
                                                                     stage = 1/2)
=========================  ========================================  =================  ==========================

Bubbles are for F = 1, B = 2 and no send latency, and need ``m >= p``; the interleaved count is at most ``m v``.
The bubble fraction above is idle rank-time over total rank-time; :mod:`.simulate` states the convention and
how it relates to Narayanan's ``(p-1)/m``.  A generator decides only each rank's *order*; the time slots come
from running that order with every action one slot long (:func:`validate` runs it too): an action starts when
its rank is free and its input exists, i.e. the previous stage's ``F`` for a forward and the next stage's ``B``
or ``I`` for a backward.  The same table feeds the runtime that executes it, the simulator, the plots and the
tests.
"""

from __future__ import annotations

import csv
import io
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

KINDS = ("F", "B", "I", "W")
PLACEMENTS = ("loop", "v")
_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")
# torch's lowered schedules also hold communication and FSDP actions; they take a slot but compute nothing here.
_TORCH_NON_COMPUTE = re.compile(r"^\d+(UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)\d*$")


@dataclass(frozen=True)
class Action:
    """One pass of one stage over one micro-batch; ``str`` and :meth:`parse` use torch's ``"1F0"``."""

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Action kind must be one of {KINDS}, got {self.kind!r}")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"Action stage and microbatch must be >= 0, got {self.stage} and {self.microbatch}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION.match(text.strip())
        if not match:
            raise ValueError(f"cannot read {text!r} as an action: expected <stage><F|B|I|W><microbatch>, e.g. 1F0")
        return cls(int(match[1]), match[2], int(match[3]))


def stage_rank(stage: int, p: int, placement: str = "loop") -> int:
    """The pipeline rank that holds ``stage`` of ``p`` ranks: ``stage % p`` round-robin (``"loop"``), or in a V
    (``"v"``: rank ``r`` holds stages ``r`` and ``2p - 1 - r``) ``min(stage, 2p - 1 - stage)``."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    return stage % p if placement == "loop" else min(stage, 2 * p - 1 - stage)


def _check_positive(**numbers: int) -> None:
    for name, value in numbers.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Schedule:
    """``table[rank][slot]``: the action rank ``rank`` runs in that time slot, ``None`` when it idles."""

    p: int
    m: int
    v: int
    name: str
    table: tuple[tuple[Action | None, ...], ...]
    placement: str = "loop"  # stage s on rank s % p; "v": rank r holds stages r and 2p - 1 - r (ZB-V, DualPipeV)
    # (forward, backward) run as one overlapped unit (DualPipe's F&B): adjacent in their rank's order, F first
    pairs: frozenset[tuple[Action, Action]] = frozenset()

    def __post_init__(self) -> None:
        _check_positive(p=self.p, m=self.m, v=self.v)
        if self.placement not in PLACEMENTS or (self.placement == "v" and self.v != 2):
            raise ValueError(f"placement must be one of {PLACEMENTS} ('v' with v = 2 stages per rank), got "
                             f"{self.placement!r} with v={self.v}")
        object.__setattr__(self, "table", tuple(tuple(row) for row in self.table))
        object.__setattr__(self, "pairs", frozenset(self.pairs))
        if len(self.table) != self.p:
            raise ValueError(f"a schedule over p={self.p} ranks needs {self.p} rows, got {len(self.table)}")

    @property
    def stages(self) -> int:
        return self.p * self.v

    def rank_of(self, stage: int) -> int:
        """The rank holding ``stage``: ``stage % p``, or under the V placement ``min(stage, 2p - 1 - stage)``."""
        return stage_rank(stage, self.p, self.placement)

    def stages_of(self, rank: int) -> list[int]:
        """The stages ``rank`` holds, in increasing order."""
        return [stage for stage in range(self.stages) if self.rank_of(stage) == rank]

    def orders(self) -> list[list[Action]]:
        """Each rank's actions in the order it runs them (the idle slots dropped)."""
        return [[action for action in row if action is not None] for row in self.table]

    def to_text(self) -> str:
        """The table as a grid, one rank per row, ``.`` for idle; ``1F0`` is stage 1's forward of micro-batch 0."""
        slots = max((len(row) for row in self.table), default=0)
        width = max([len(str(a)) for row in self.table for a in row if a is not None] + [len(str(slots - 1)), 1])
        lines = [" " * 7 + " ".join(f"{t:>{width}}" for t in range(slots))]
        for rank, row in enumerate(self.table):
            cells = [str(a) if a is not None else "." for a in row] + ["."] * (slots - len(row))
            lines.append(f"rank {rank:<2}" + " ".join(f"{c:>{width}}" for c in cells))
        return f"{self.name} (p={self.p}, m={self.m}, v={self.v})\n" + "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# Dependencies and execution in order: what validate checks and what simulate times.


def _inputs(action: Action, stages: int, backward_kind: dict[tuple[int, int], str]) -> list[Action]:
    """The actions whose results ``action`` consumes."""
    s, mb = action.stage, action.microbatch
    if action.kind == "F":
        return [Action(s - 1, "F", mb)] if s > 0 else []
    if action.kind == "W":
        return [Action(s, "I", mb)]
    needs = [Action(s, "F", mb)]  # B or I: the stage's own activations, and the gradient from downstream
    if s + 1 < stages:
        needs.append(Action(s + 1, backward_kind.get((s + 1, mb), "B"), mb))
    return needs


_RULES = {"F": "a forward needs the previous stage's forward of its micro-batch first",
          "B": "a backward needs its own forward and the next stage's backward (B or I) of its micro-batch first",
          "I": "a backward needs its own forward and the next stage's backward (B or I) of its micro-batch first",
          "W": "a weight gradient W needs its input gradient I first"}


def _execute(schedule: Schedule, duration: Callable[[Action], float], send_s: float = 0,
             pair_s: Callable[[Action, Action], float] | None = None) -> list[list[tuple[float, float, Action]]]:
    """Run every rank's order: an action starts when its rank is free and its inputs are done (plus ``send_s``
    when they come from another rank).  An overlapped pair (``schedule.pairs``) starts when both its actions'
    inputs are done and lasts ``pair_s(forward, backward)`` (their sum by default), split between the two in
    proportion.  Raises ValueError if a rank waits on itself or no rank can progress."""
    orders = schedule.orders()
    follows = dict(schedule.pairs)
    backward_kind = {(a.stage, a.microbatch): a.kind for order in orders for a in order if a.kind in "BI"}
    done: dict[Action, float] = {}
    free: list[float] = [0] * schedule.p
    position = [0] * schedule.p
    events: list[list[tuple[float, float, Action]]] = [[] for _ in range(schedule.p)]
    while any(position[r] < len(orders[r]) for r in range(schedule.p)):
        progressed = False
        for rank in range(schedule.p):
            while position[rank] < len(orders[rank]):
                action = orders[rank][position[rank]]
                unit = [action, follows[action]] if action in follows else [action]
                needs = [need for a in unit for need in _inputs(a, schedule.stages, backward_kind)]
                missing = [need for need in needs if need not in done]
                if missing:
                    if schedule.rank_of(missing[0].stage) == rank:
                        raise ValueError(f"{schedule.name}: rank {rank} runs {action} before {missing[0]} "
                                         f"(or never runs it): {_RULES[action.kind]}")
                    break
                start = max([free[rank]] + [done[need] + (send_s if schedule.rank_of(need.stage) != rank else 0)
                                            for need in needs])
                lengths = [duration(a) for a in unit]
                total = pair_s(*unit) if len(unit) == 2 and pair_s is not None else sum(lengths)
                for a, length in zip(unit, lengths, strict=True):  # a pair's time shared in proportion
                    end = start + (length if len(unit) == 1 else total * length / sum(lengths) if sum(lengths) else 0)
                    done[a], free[rank] = end, end
                    events[rank].append((start, end, a))
                    start = end
                position[rank] += len(unit)
                progressed = True
        if not progressed:
            waits = [f"rank {r} at {orders[r][position[r]]} waits for "
                     f"{[n for n in _inputs(orders[r][position[r]], schedule.stages, backward_kind) if n not in done][0]}"
                     for r in range(schedule.p) if position[r] < len(orders[r])]
            raise ValueError(f"{schedule.name}: deadlock, no rank can progress: " + "; ".join(waits))
    return events


def validate(schedule: Schedule) -> None:
    """Raise ValueError naming the first action that breaks a rule; return None for a schedule a runtime can run.

    Rules: every action names a stage of its rank (``stage % p == rank``) and a micro-batch below ``m``; each
    (stage, micro-batch) has one ``F`` and either one ``B`` or one ``I`` and one ``W``, none twice; and running
    each rank's order (a rank blocks until an action's input exists) finishes: a forward after the previous
    stage's forward, a ``B``/``I`` after its own forward and the next stage's ``B``/``I``, a ``W`` after its
    ``I``.  A rank that blocks on an action it runs later, or ranks that all block on one another (the sends
    and receives cannot be matched), is a deadlock.
    """
    counts: Counter[Action] = Counter()
    for rank, order in enumerate(schedule.orders()):
        for action in order:
            if action.stage >= schedule.stages or schedule.rank_of(action.stage) != rank:
                where = "round-robin" if schedule.placement == "loop" else "in a V"
                raise ValueError(f"{schedule.name}: rank {rank} runs {action}, but stage {action.stage} belongs to "
                                 f"rank {schedule.rank_of(action.stage) if action.stage < schedule.stages else '-'} "
                                 f"of p={schedule.p} (stages 0..{schedule.stages - 1} {where})")
            if action.microbatch >= schedule.m:
                raise ValueError(f"{schedule.name}: {action} names micro-batch {action.microbatch}, "
                                 f"but there are m={schedule.m}")
            counts[action] += 1
            if counts[action] > 1:
                raise ValueError(f"{schedule.name}: {action} appears twice; each action runs exactly once")
        for forward, backward in schedule.pairs:
            if forward in order and (forward.kind != "F" or backward.kind == "F"
                                     or order.index(forward) + 1 >= len(order)
                                     or order[order.index(forward) + 1] != backward):
                raise ValueError(f"{schedule.name}: the overlapped pair ({forward}, {backward}) must be a forward "
                                 f"and a backward run one after the other on rank {rank}")
    if any(forward not in counts for forward, _ in schedule.pairs):
        raise ValueError(f"{schedule.name}: an overlapped pair names an action the schedule does not run")
    for stage in range(schedule.stages):
        for mb in range(schedule.m):
            has = {kind for kind in KINDS if Action(stage, kind, mb) in counts}
            if "B" in has and "I" in has:
                raise ValueError(f"{schedule.name}: stage {stage} micro-batch {mb} has both B and I; "
                                 "a backward is either full (B) or split (I then W)")
            need = {"F", "I", "W"} if has & {"I", "W"} else {"F", "B"}
            for kind in KINDS:
                if kind in need and kind not in has:
                    raise ValueError(f"{schedule.name}: {Action(stage, kind, mb)} is missing; every stage runs "
                                     f"F and B (or I and W) once for each of the m={schedule.m} micro-batches")
    _execute(schedule, lambda action: 1)


# ---------------------------------------------------------------------------------------------------------
# Generators: each decides the order of every rank; _place gives it time slots.


def _place(name: str, p: int, m: int, v: int, orders: list[list[Action]], placement: str = "loop",
           pairs: frozenset[tuple[Action, Action]] = frozenset()) -> Schedule:
    """Time slots for ``orders``: every action one slot long, starting as soon as its rank and inputs allow."""
    unplaced = Schedule(p, m, v, name, orders, placement, pairs)
    validate(unplaced)
    table: list[list[Action | None]] = []
    for events in _execute(unplaced, lambda action: 1):
        row: list[Action | None] = [None] * (int(events[-1][1]) if events else 0)
        for start, _, action in events:
            row[int(start)] = action
        table.append(row)
    return Schedule(p, m, v, name, table, placement, pairs)


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward; each stage holds all ``m`` micro-batches."""
    _check_positive(p=p, m=m)
    orders = [[Action(r, "F", mb) for mb in range(m)] + [Action(r, "B", mb) for mb in range(m)] for r in range(p)]
    return _place("GPipe", p, m, 1, orders)


def _one_f_one_b_order(rank: int, p: int, m: int, split: bool) -> list[Action]:
    """1F1B's order on ``rank``; with ``split`` each B becomes I, and W follows ``rank`` micro-batches later."""
    warmup = min(p - 1 - rank, m)
    order = [Action(rank, "F", mb) for mb in range(warmup)]
    backward = ["I"] if split else ["B"]
    delay = rank  # ZB-H1: the last rank defers the most W's; they fill the cool-down while upstream I's drain
    for mb in range(m):
        if warmup + mb < m:
            order.append(Action(rank, "F", warmup + mb))
        order += [Action(rank, kind, mb) for kind in backward]
        if split and mb - delay >= 0:
            order.append(Action(rank, "W", mb - delay))
    if split:
        order += [Action(rank, "W", mb) for mb in range(max(m - delay, 0), m)]
    return order


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): rank ``r`` runs ``p-1-r`` forwards, then alternates one
    forward and one backward, then the remaining backwards.  GPipe's bubble, but ``p - r`` micro-batches held."""
    _check_positive(p=p, m=m)
    return _place("1F1B", p, m, 1, [_one_f_one_b_order(r, p, m, split=False) for r in range(p)])


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with each B split into ``I`` (the input
    gradient, on the critical path) and ``W`` (the weight gradient, which nothing waits for).  Rank ``r`` runs
    ``W`` of micro-batch ``k`` after ``I`` of ``k + r``, so the ``W``'s it deferred fill the cool-down bubble:
    with F = I = W the idle time is ``(p-1)`` slots per rank instead of 1F1B's ``3 (p-1)``.  Micro-batches
    between ``F`` and ``I`` stay at 1F1B's ``p - r``; each deferred ``W`` keeps only its layer inputs and
    output gradient."""
    _check_positive(p=p, m=m)
    return _place("ZB-H1", p, m, 1, [_one_f_one_b_order(r, p, m, split=True) for r in range(p)])


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM's order): each rank holds ``v`` chunks (stages
    ``r, r+p, ...``) and runs micro-batches in groups of ``p`` through one chunk, then the next.  The bubble
    shrinks ``v``-fold, for ``v`` times as many point-to-point sends.

    This is Megatron's original order, and like it (Narayanan et al. 2021, section 2.2.2) it needs ``m`` a
    multiple of ``p``.  That is a property of the order, not of interleaving: Llama 3 (Dubey et al. 2024,
    section 3.3.2) made the group size free, and ``torch.distributed.pipelining.ScheduleInterleaved1F1B`` runs
    groups of ``m // max(1, m // p)`` (any ``m`` that many groups divide, e.g. ``m = 6`` on ``p = 4``)."""
    _check_positive(p=p, m=m, v=v)
    if m % p:
        raise ValueError(f"labkit's interleaved 1F1B keeps Megatron's original order, micro-batches in groups of p, "
                         f"so m must be a multiple of p: got m={m}, p={p} (Llama 3's schedule and torch's "
                         f"ScheduleInterleaved1F1B relax this)")
    total = m * v

    def forward(rank: int, k: int) -> Action:  # the k-th forward a rank runs: chunk (k // p) % v, in groups of p
        return Action(((k // p) % v) * p + rank, "F", (k // (p * v)) * p + k % p)

    def backward(rank: int, k: int) -> Action:  # backwards visit the chunks in reverse
        return Action((v - 1 - (k // p) % v) * p + rank, "B", (k // (p * v)) * p + k % p)

    orders = []
    for rank in range(p):
        warmup = min((v - 1) * p + 2 * (p - 1 - rank), total)  # Megatron's: the last chunk needs p ahead
        order = [forward(rank, k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [forward(rank, warmup + k), backward(rank, k)]
        order += [backward(rank, k) for k in range(total - warmup, total)]
        orders.append(order)
    return _place("Interleaved 1F1B", p, m, v, orders)


# ---------------------------------------------------------------------------------------------------------
# torch's compute-only CSV: one row per rank, a cell per time slot ("0F0"), empty when idle.


def to_csv(schedule: Schedule) -> str:
    """The table as torch's ``_dump_csv`` writes it (``csv.writer``: ``\\r\\n`` line ends, empty cell = idle)."""
    out = io.StringIO()
    writer = csv.writer(out)
    for row in schedule.table:
        writer.writerow(["" if action is None else str(action) for action in row])
    return out.getvalue()


def from_csv(text: str, p: int, m: int, v: int = 1, name: str = "csv") -> Schedule:
    """Read torch's compute-only CSV.  Its non-compute cells (``0REDUCE_GRAD``, ``1SEND_F0``, ...) become idle
    slots: communication and gradient reduction are the runtime's business, not the schedule's."""
    rows: list[Sequence[Action | None]] = []
    for row in csv.reader(io.StringIO(text)):
        rows.append([None if not cell.strip() or _TORCH_NON_COMPUTE.match(cell.strip()) else Action.parse(cell)
                     for cell in row])
    if len(rows) != p:
        raise ValueError(f"the CSV has {len(rows)} rows, one per rank, but p={p}")
    return Schedule(p, m, v, name, rows)
