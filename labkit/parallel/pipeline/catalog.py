"""Every pipeline schedule by the name the command line, :func:`labkit.parallel.parallelize` and the planner use.

``v`` is the number of stages a rank holds: the interleaved schedules take it (``interleaved`` at least 2), ZB-V
and DualPipeV always hold two, in a V, and the others one.  The split schedules run weight gradients (``W``)
apart from the backward, which FSDP's per-unit hooks cannot follow.

:data:`ORDERS` gives a schedule's per-rank orders (the generators' one definition), :data:`SCHEDULES` the same
orders given time slots (the table the runtime, the plots and the tests read), and :func:`compiled` the orders
compiled once for the engine (:mod:`.engine`), which the step model places with its own durations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from labkit.parallel.pipeline import schedule as tables
from labkit.parallel.pipeline import zero_bubble
from labkit.parallel.pipeline.engine import Compiled
from labkit.parallel.pipeline.schedule import Schedule, compile_schedule, with_time_slots

ORDERS: dict[str, Callable[[int, int, int], Schedule]] = {  # each rank's order, no idle slots
    "gpipe": lambda p, m, v: tables.gpipe_orders(p, m),
    "1f1b": lambda p, m, v: tables.one_f_one_b_orders(p, m),
    "interleaved": tables.interleaved_1f1b_orders,
    "zb-h1": lambda p, m, v: tables.one_f_one_b_orders(p, m, split=True),
    "interleaved-zb": zero_bubble.interleaved_zb_orders,
    "zb-v": lambda p, m, v: zero_bubble.zb_v_orders(p, m),
    "dualpipev": lambda p, m, v: zero_bubble.dualpipe_v_orders(p, m),
}


def _table(name: str, p: int, m: int, v: int) -> Schedule:
    return with_time_slots(ORDERS[name](p, m, v))


SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {name: functools.partial(_table, name) for name in ORDERS}
SPLIT_BACKWARD = frozenset({"zb-h1", "interleaved-zb", "zb-v", "dualpipev"})  # W passes apart from the backward
V_SHAPED = frozenset({"zb-v", "dualpipev"})  # two stages a rank: r and 2p - 1 - r


def stages_per_rank(schedule: str, virtual_stages: int) -> int:
    """How many stages each rank holds under ``schedule``: ``virtual_stages`` for the interleaved ones, 2 for a
    V, else 1.  Raises ``ValueError`` for an unknown name or ``interleaved`` with fewer than 2."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {tuple(SCHEDULES)}, got {schedule!r}")
    if schedule == "interleaved" and virtual_stages < 2:
        raise ValueError(f"the interleaved schedule needs virtual_stages >= 2 stages per rank, got {virtual_stages}")
    return virtual_stages if schedule.startswith("interleaved") else 2 if schedule in V_SHAPED else 1


@functools.lru_cache(maxsize=64)
def compiled(schedule: str, p: int, m: int, v: int = 1) -> Compiled:
    """``schedule``'s orders over ``p`` ranks, ``m`` micro-batches and ``v`` stages a rank, compiled once (a
    planner places one schedule with many durations).  Raises ``ValueError`` for an unknown name."""
    if schedule not in ORDERS:
        raise ValueError(f"schedule must be one of {tuple(ORDERS)}, got {schedule!r}")
    return compile_schedule(ORDERS[schedule](p, m, v))
