"""Every pipeline schedule by the name the command line, :func:`labkit.parallel.parallelize` and the planner use.

``v`` is the number of stages a rank holds: the interleaved schedules take it (``interleaved`` at least 2), ZB-V
and DualPipeV always hold two, in a V, and the others one.  The split schedules run weight gradients (``W``)
apart from the backward, which FSDP's per-unit hooks cannot follow.
"""

from __future__ import annotations

from collections.abc import Callable

from labkit.parallel.pipeline import schedule as tables
from labkit.parallel.pipeline import zero_bubble
from labkit.parallel.pipeline.schedule import Schedule

SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {
    "gpipe": lambda p, m, v: tables.gpipe(p, m),
    "1f1b": lambda p, m, v: tables.one_f_one_b(p, m),
    "interleaved": tables.interleaved_1f1b,
    "zb-h1": lambda p, m, v: tables.zb_h1(p, m),
    "interleaved-zb": zero_bubble.interleaved_zb,
    "zb-v": lambda p, m, v: zero_bubble.zb_v(p, m),
    "dualpipev": lambda p, m, v: zero_bubble.dualpipe_v(p, m),
}
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
