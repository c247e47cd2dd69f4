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
import dataclasses
import io
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from labkit.parallel.pipeline.engine import Compiled, compile_orders, place

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


def check_positive(**numbers: int) -> None:
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
        check_positive(p=self.p, m=self.m, v=self.v)
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
# Validation: the table's own rules, then its orders run by the one engine (:mod:`.engine`).


def compile_schedule(schedule: Schedule) -> Compiled:
    """``schedule``'s orders compiled by :func:`~.engine.compile_orders` (its idle slots dropped): the form that
    :func:`~.engine.place` puts in time.  Raises ``ValueError`` on orders that deadlock."""
    return compile_orders(schedule.name, schedule.p, schedule.m, schedule.stages, schedule.orders(),
                          schedule.rank_of, schedule.pairs)


def validate(schedule: Schedule) -> None:
    """Raise ValueError naming the first action that breaks a rule; return None for a schedule a runtime can run.

    Rules: every action names a stage of its rank (``stage % p == rank``) and a micro-batch below ``m``; each
    (stage, micro-batch) has one ``F`` and either one ``B`` or one ``I`` and one ``W``, none twice; and running
    each rank's order (a rank blocks until an action's input exists) finishes: a forward after the previous
    stage's forward, a ``B``/``I`` after its own forward and the next stage's ``B``/``I``, a ``W`` after its
    ``I``.  A rank that blocks on an action it runs later, or ranks that all block on one another (the sends
    and receives cannot be matched), is a deadlock.
    """
    check_table(schedule)
    compile_schedule(schedule)


def check_table(schedule: Schedule) -> None:
    """The rules a table breaks without running: stages on their ranks, micro-batches in range, each pass once,
    pairs adjacent."""
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


# ---------------------------------------------------------------------------------------------------------
# Generators: each decides the order of every rank (``*_orders``, a schedule without idle slots);
# with_time_slots places it.


def with_time_slots(unplaced: Schedule) -> Schedule:
    """Time slots for a schedule given as orders (``unplaced.table``: each rank's passes, no idle slot): every
    action one slot long, starting as soon as its rank and inputs allow (:func:`~.engine.place`).  Validated."""
    check_table(unplaced)
    placed = place(compile_schedule(unplaced), [1] * sum(len(order) for order in unplaced.orders()))
    rows: list[list[Action | None]] = []
    for events in placed.events():
        row: list[Action | None] = [None] * (int(events[-1][1]) if events else 0)
        for start, _, action in events:
            row[int(start)] = action
        rows.append(row)
    return dataclasses.replace(unplaced, table=rows)


def gpipe_orders(p: int, m: int) -> Schedule:
    """:func:`gpipe`'s orders: every forward, then every backward."""
    check_positive(p=p, m=m)
    orders = [[Action(r, "F", mb) for mb in range(m)] + [Action(r, "B", mb) for mb in range(m)] for r in range(p)]
    return Schedule(p, m, 1, "GPipe", orders)


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward; each stage holds all ``m`` micro-batches."""
    return with_time_slots(gpipe_orders(p, m))


def _one_f_one_b_order(rank: int, p: int, m: int, split: bool = False) -> list[Action]:
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


def one_f_one_b_orders(p: int, m: int, split: bool = False) -> Schedule:
    """:func:`one_f_one_b`'s orders, or with ``split`` :func:`zb_h1`'s."""
    check_positive(p=p, m=m)
    return Schedule(p, m, 1, "ZB-H1" if split else "1F1B", [_one_f_one_b_order(r, p, m, split) for r in range(p)])


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): rank ``r`` runs ``p-1-r`` forwards, then alternates one
    forward and one backward, then the remaining backwards.  GPipe's bubble, but ``p - r`` micro-batches held."""
    return with_time_slots(one_f_one_b_orders(p, m))


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with each B split into ``I`` (the input
    gradient, on the critical path) and ``W`` (the weight gradient, which nothing waits for).  Rank ``r`` runs
    ``W`` of micro-batch ``k`` after ``I`` of ``k + r``, so the ``W``'s it deferred fill the cool-down bubble:
    with F = I = W the idle time is ``(p-1)`` slots per rank instead of 1F1B's ``3 (p-1)``.  Micro-batches
    between ``F`` and ``I`` stay at 1F1B's ``p - r``; each deferred ``W`` keeps only its layer inputs and
    output gradient."""
    return with_time_slots(one_f_one_b_orders(p, m, split=True))


def interleaved_1f1b_orders(p: int, m: int, v: int) -> Schedule:
    """:func:`interleaved_1f1b`'s orders."""
    check_positive(p=p, m=m, v=v)
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
    return Schedule(p, m, v, "Interleaved 1F1B", orders)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM's order): each rank holds ``v`` chunks (stages
    ``r, r+p, ...``) and runs micro-batches in groups of ``p`` through one chunk, then the next.  The bubble
    shrinks ``v``-fold, for ``v`` times as many point-to-point sends.

    This is Megatron's original order, and like it (Narayanan et al. 2021, section 2.2.2) it needs ``m`` a
    multiple of ``p``.  That is a property of the order, not of interleaving: Llama 3 (Dubey et al. 2024,
    section 3.3.2) made the group size free, and ``torch.distributed.pipelining.ScheduleInterleaved1F1B`` runs
    groups of ``m // max(1, m // p)`` (any ``m`` that many groups divide, e.g. ``m = 6`` on ``p = 4``)."""
    return with_time_slots(interleaved_1f1b_orders(p, m, v))


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
