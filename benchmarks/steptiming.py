"""Step-timing helpers shared by the training benchmarks (bench_ddp.py, bench_zero.py).

Each rank records, per timed step, ``[forward s, backward s, optimizer s, main-thread CPU s, other-threads CPU s]``;
these functions turn every rank's records into the figures the tables print.  A step's time is its slowest
rank's (a synchronous step is done when the last rank is).
"""

from __future__ import annotations

import statistics
import time

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


def timed_step(model, optimizer, x, y, after_step=None) -> list[float]:
    """One training step of a model returning ``(logits, loss)``, timed by phase: ``[forward, backward,
    optimizer (step + zero_grad), main-thread CPU, other threads' CPU]`` in seconds.

    ``after_step(loss)``, when given, runs between ``optimizer.step()`` and ``zero_grad`` (gradients and optimizer
    state both alive: the moment to measure memory); its wall-clock and CPU time are left out.
    """
    cpu_main, cpu_process = time.thread_time(), time.process_time()
    begin = time.perf_counter()
    _, loss = model(x, y)
    forward_done = time.perf_counter()
    loss.backward()
    backward_done = time.perf_counter()
    optimizer.step()
    untimed = (0.0, 0.0, 0.0)
    if after_step is not None:
        pause, pause_main, pause_process = time.perf_counter(), time.thread_time(), time.process_time()
        after_step(loss)
        untimed = (time.perf_counter() - pause, time.thread_time() - pause_main, time.process_time() - pause_process)
    optimizer.zero_grad(set_to_none=True)
    end = time.perf_counter() - untimed[0]
    cpu_main = time.thread_time() - cpu_main - untimed[1]
    cpu_process = time.process_time() - cpu_process - untimed[2]
    return [forward_done - begin, backward_done - forward_done, end - backward_done, cpu_main, cpu_process - cpu_main]
