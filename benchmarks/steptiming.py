"""Step-timing helpers shared by the training benchmarks (bench_ddp.py, bench_zero.py).

Each rank records, per timed step, ``[forward s, backward s, optimizer s, main-thread CPU s, other-threads CPU s]``;
these functions turn every rank's records into the figures the tables print.  A step's time is its slowest
rank's (a synchronous step is done when the last rank is).
"""

from __future__ import annotations

import statistics

PHASES = ("forward", "backward", "optimizer", "step")


def step_times(per_rank: list[list[list[float]]]) -> list[float]:
    """Per step, the slowest rank's wall-clock time (s)."""
    return [max(sum(rank_times[step][:3]) for rank_times in per_rank) for step in range(len(per_rank[0]))]


def paired_ratios(ours: list[float], theirs: list[float]) -> list[float]:
    """Per round, ``ours / theirs`` (step times of the same round), sorted."""
    return sorted(a / b for a, b in zip(ours, theirs, strict=True))


def summarise(per_rank: list[list[list[float]]]) -> dict[str, float]:
    """In ms: medians over steps of the slowest rank's phases, the step-time spread, and CPU times."""
    steps = len(per_rank[0])
    slowest = []  # per step: the phases of the rank whose step took longest
    for step in range(steps):
        phases = max((rank_times[step][:3] for rank_times in per_rank), key=sum)
        slowest.append([*phases, sum(phases)])
    summary = {phase: 1000 * statistics.median(step[i] for step in slowest) for i, phase in enumerate(PHASES)}
    totals = sorted(step[-1] for step in slowest)
    summary["p10"], summary["p90"] = 1000 * totals[steps // 10], 1000 * totals[(9 * steps) // 10]
    for column, name in ((3, "cpu main"), (4, "cpu other")):
        summary[name] = 1000 * max(statistics.median(step[column] for step in rank_times)
                                   for rank_times in per_rank)
    return summary
