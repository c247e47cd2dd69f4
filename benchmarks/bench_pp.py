"""labkit's pipeline runtime beside torch's ``torch.distributed.pipelining``, and the bubble measured against theory.

    python benchmarks/bench_pp.py [--quick] [--steps N] [--preset NAME]

1. **labkit 1F1B against torch's ``Schedule1F1B``**: ``TinyGPT(GPTConfig.preset("10m", tie_weights=False))`` cut
   into 2 stages on 2 gloo ranks (one thread each), ``m = 8`` micro-batches of 2 x 128 tokens, fp32.  Both
   runtimes hold the same stages (the same weights, built by :func:`labkit.parallel.pipeline.build_stage`) and
   take turns step by step in one launched job (a barrier before each step, the order flipping every round,
   warm-up steps first).  A step is one pipeline pass over the batch (every forward and backward, with their
   messages), the slowest rank's time; the optimizer, identical for both, is left out.  ``vs torch`` is the
   median over rounds of labkit's step / torch's in the same round.  Target: <= 1.0.
2. **The bubble of real stages**, p = 2, 1F1B, m = 2, 4, 8, 16 (the same model and micro-batch size): the idle
   fraction measured from the runtime's spans (``Timeline.bubble_fraction``: idle rank-time / (p x step)),
   beside the closed form ``(p-1)/(m+p-1)`` and the simulator fed with the medians of the measured F and B of
   each stage.
3. **The bubble of every schedule at p = 4 and 8**, on stages whose compute is a timed wait
   (:class:`labkit.parallel.pipeline.TimedStage`: F = 30 ms, B = 60 ms, W = 30 ms of it, per chunk 1/v of
   that), where 2 cores cannot distort the durations: measured beside the closed form.
4. **The schedules of 2024-25 against torch's**: labkit's interleaved zero bubble, ZB-V and DualPipeV beside
   torch's ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` on the same four
   stages of the same model, paired step by step as in 1 (reported, not gated).

The target is reported as a PASS/FAIL line; the script exits 0 and
``labkit bench`` gates on them (exit 1 on a FAIL line unless ``--report-only``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from steptiming import paired_ratios  # beside this script

from labkit.data import MarkovChain, batches
from labkit.launch import launch
from labkit.models import PRESETS, GPTConfig
from labkit.parallel.pipeline import (
    build_pipeline,
    dualpipe_v,
    gpipe,
    interleaved_1f1b,
    interleaved_zb,
    one_f_one_b,
    run_schedule,
    simulate,
    timed_pipeline,
    zb_h1,
    zb_v,
)
from labkit.parallel.pipeline.torch_reference import torch_pipeline, torch_step

TARGET_RATIO = 1.0
MICRO_BATCH, SEQUENCE = 2, 128
TIMED_F = 0.03  # seconds: the timed-wait stages' forward; B = 2 F, W = F


def _batch(config: GPTConfig, m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = MarkovChain(vocab_size=config.vocab_size).sample(50_000, seed=1)
    return batches(tokens, m * MICRO_BATCH, SEQUENCE, torch.Generator().manual_seed(seed))


PAIRED = {"1F1B": lambda p, m: one_f_one_b(p, m), "Interleaved ZB": lambda p, m: interleaved_zb(p, m, 2),
          "ZB-V": zb_v, "DualPipeV": dualpipe_v}  # labkit's table for each torch schedule compared


def _versus_torch(preset: str, m: int, steps: int, warmup: int, name: str = "1F1B") -> dict:
    torch.set_num_threads(1)
    config = GPTConfig.preset(preset, tie_weights=False)
    schedule = PAIRED[name](dist.get_world_size(), m)
    ours = build_pipeline(config, 0, schedule, micro_batch_size=MICRO_BATCH, seq_len=SEQUENCE)
    theirs, modules = torch_pipeline(config, 0, name, schedule.p, m, schedule.v)
    times: dict[str, list[float]] = {"labkit": [], "torch": []}
    losses: dict[str, float | None] = {}
    for step in range(warmup + steps):
        ids, targets = _batch(config, m, step)
        runs = [("labkit", lambda x=ids, y=targets: run_schedule(schedule, ours, x, y, timeline=False).losses),
                ("torch", lambda x=ids, y=targets: torch_step(theirs, modules, x, y))]
        for name, run in runs if step % 2 == 0 else reversed(runs):
            dist.barrier()
            start = time.perf_counter()
            step_losses = run()
            if step >= warmup:
                times[name].append(time.perf_counter() - start)
            losses[name] = None if step_losses is None else sum(step_losses) / len(step_losses)
        for module in [stage.module for stage in ours] + modules:
            module.zero_grad(set_to_none=True)
    return {"times": times, "losses": losses}


def _real_bubble(preset: str, ms: list[int], repeats: int) -> list:
    torch.set_num_threads(1)
    config = GPTConfig.preset(preset, tie_weights=False)
    rows = []
    for m in ms:
        schedule = one_f_one_b(dist.get_world_size(), m)
        stages = build_pipeline(config, 0, schedule, micro_batch_size=MICRO_BATCH, seq_len=SEQUENCE)
        ids, targets = _batch(config, m, 0)
        timelines = [run_schedule(schedule, stages, ids, targets).timeline for _ in range(repeats + 1)][1:]
        rows.append((m, timelines))
    return rows


def _timed_bubbles(m: int) -> dict:
    p = dist.get_world_size()
    out = {}
    for schedule in (gpipe(p, m), one_f_one_b(p, m), interleaved_1f1b(p, m, 2), zb_h1(p, m)):
        v = schedule.v
        stages = timed_pipeline(schedule, TIMED_F / v, 2 * TIMED_F / v, TIMED_F / v)
        ids = torch.zeros(m, 4, dtype=torch.long)
        out[schedule.name] = run_schedule(schedule, stages, ids, ids).timeline
    return out


def _median_durations(timeline) -> tuple[list[float], list[float]]:
    """Per stage, the median measured F and B (seconds)."""
    stages = timeline.schedule.stages
    f: list[list[float]] = [[] for _ in range(stages)]
    b: list[list[float]] = [[] for _ in range(stages)]
    for row in timeline.events:
        for start, end, action in row:
            (f if action.kind == "F" else b)[action.stage].append(end - start)
    return [statistics.median(x) for x in f], [statistics.median(x) for x in b]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (about a minute)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per runtime (default 12, quick 5)")
    parser.add_argument("--preset", default="10m", choices=sorted(PRESETS), help="TinyGPT preset (default 10m)")
    args = parser.parse_args()
    steps, warmup, m = args.steps or (5 if args.quick else 12), 2, 8

    started = time.perf_counter()
    result = launch(_versus_torch, args.preset, m, steps, warmup, nprocs=2, timeout=1200, rank_output="none")
    step = {name: [max(r["times"][name][i] for r in result) for i in range(steps)] for name in ("labkit", "torch")}
    ratios = paired_ratios(step["labkit"], step["torch"])
    print(f"1. labkit 1F1B against torch Schedule1F1B: TinyGPT {args.preset} (untied), p = 2 gloo ranks x 1 thread, "
          f"m = {m} micro-batches of {MICRO_BATCH} x {SEQUENCE} tokens; {steps} timed steps after {warmup} warm-up, "
          f"interleaved (took {time.perf_counter() - started:.0f} s)\n")
    print(f"{'runtime':<8} {'step ms':>8} {'p10-p90 ms':>12} {'loss':>8}")
    for name in ("labkit", "torch"):
        ordered = sorted(step[name])
        loss = result[-1]["losses"][name]
        print(f"{name:<8} {1e3 * statistics.median(ordered):>8.1f} {1e3 * ordered[len(ordered) // 10]:>5.0f}-"
              f"{1e3 * ordered[(9 * len(ordered)) // 10]:<6.0f} {loss:>8.4f}")
    ratio = statistics.median(ratios)
    print(f"{'PASS' if ratio <= TARGET_RATIO else 'FAIL'}: labkit 1F1B / torch Schedule1F1B step time = "
          f"{ratio:.2f}x (per round p25-p75 {ratios[len(ratios) // 4]:.2f}-{ratios[(3 * len(ratios)) // 4]:.2f}; "
          f"target <= {TARGET_RATIO})\n")

    started = time.perf_counter()
    ms = [2, 4, 8] if args.quick else [2, 4, 8, 16]
    rows = launch(_real_bubble, args.preset, ms, 2 if args.quick else 3, nprocs=2, timeout=1200,
                  rank_output="none")[0]
    print(f"2. The bubble of real stages: TinyGPT {args.preset}, 1F1B, p = 2, micro-batches of {MICRO_BATCH} x "
          f"{SEQUENCE} tokens (took {time.perf_counter() - started:.0f} s)\n")
    print(f"{'m':>3} {'measured %':>10} {'formula %':>9} {'simulated %':>11} {'step ms':>8} {'F ms (s0, s1)':>14} "
          f"{'B ms (s0, s1)':>14}")
    for m_, timelines in rows:
        measured = statistics.median(t.bubble_fraction for t in timelines)
        f, b = _median_durations(timelines[-1])
        simulated = simulate(timelines[-1].schedule, f, b).bubble_fraction
        print(f"{m_:>3} {100 * measured:>10.1f} {100 / (m_ + 1):>9.1f} {100 * simulated:>11.1f} "
              f"{1e3 * statistics.median(t.total for t in timelines):>8.0f} "
              f"{1e3 * f[0]:>6.1f}, {1e3 * f[1]:<6.1f} {1e3 * b[0]:>6.1f}, {1e3 * b[1]:<6.1f}")
    print("measured = median over steps of idle / (p x step) from the runtime's spans; simulated = the simulator "
          "with each stage's median measured F and B.\n")

    started = time.perf_counter()
    print(f"3. The bubble of every schedule on timed-wait stages (F = {1e3 * TIMED_F:.0f} ms, B = 2F, W = F; "
          f"per chunk 1/v of that), m = 8")
    print(f"{'p':>2} {'schedule':<17} {'measured %':>10} {'formula %':>9} {'difference':>10}")
    for p in (4, 8):
        timelines = launch(_timed_bubbles, 8, nprocs=p, timeout=600, rank_output="none")[0]
        for name, timeline in timelines.items():
            formula = simulate(timeline.schedule, TIMED_F / timeline.schedule.v, 2 * TIMED_F / timeline.schedule.v,
                               TIMED_F / timeline.schedule.v).bubble_fraction
            print(f"{p:>2} {name:<17} {100 * timeline.bubble_fraction:>10.1f} {100 * formula:>9.1f} "
                  f"{100 * (timeline.bubble_fraction - formula):>+10.1f}")
    print(f"formula = the closed form, which the simulator reproduces exactly for uniform stages (GPipe, 1F1B "
          f"(p-1)/(m+p-1); interleaved (p-1)/(v m+p-1); ZB-H1 (p-1)/(3m+p-1)) (took "
          f"{time.perf_counter() - started:.0f} s)\n")

    started = time.perf_counter()
    print(f"4. The schedules of 2024-25 against torch's own: TinyGPT {args.preset} (untied) in 4 stages on p = 2 gloo "
          f"ranks x 1 thread (ZB-V and DualPipeV in a V, interleaved ZB with v = 2), m = {m}; {steps} timed steps "
          f"after {warmup} warm-up, labkit and torch in turn\n")
    print(f"{'schedule':<15} {'labkit ms':>9} {'torch ms':>9} {'labkit / torch':>14} {'p25-p75':>10} {'loss gap':>9}")
    for name in ("Interleaved ZB", "ZB-V", "DualPipeV"):
        result = launch(_versus_torch, args.preset, m, steps, warmup, name, nprocs=2, timeout=1200,
                        rank_output="none")
        step = {who: [max(r["times"][who][i] for r in result) for i in range(steps)] for who in ("labkit", "torch")}
        ratios = paired_ratios(step["labkit"], step["torch"])
        losses = next(r["losses"] for r in result if r["losses"]["labkit"] is not None)
        print(f"{name:<15} {1e3 * statistics.median(step['labkit']):>9.1f} {1e3 * statistics.median(step['torch']):>9.1f} "
              f"{statistics.median(ratios):>13.2f}x {ratios[len(ratios) // 4]:>5.2f}-{ratios[(3 * len(ratios)) // 4]:<4.2f} "
              f"{abs(losses['labkit'] - losses['torch']):>9.1e}")
    print(f"(reported, not gated; took {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
