"""Lesson 12, measured: the input pipeline's stall against its model, labkit's step loader against a plain
``DataLoader``, and the divergence alarm's cost, detections and false alarms.

    python benchmarks/bench_input.py [--quick]

1. **The stall** (one process, one thread): batches costing ``T_DATA`` of CPU work, ``T_COMPUTE`` of compute a
   step, for 0, 1, 2 and 4 workers; each step's time and data wait beside :func:`labkit.loader.stall_model`
   without a core limit and with this machine's cores, fed the two costs measured alone.
2. **labkit's StepLoader against torch's DataLoader**: the same data set (no work per item: the overhead alone),
   the same workers, batches drawn in order; target: the step-indexed wrapper within 1.25x of the plain loader.
3. **The alarm**: ``labkit.train`` on 4 ranks with the alarm against ``--alarm-every 0`` (one all-gather of 3
   numbers a check, the gradient norm and the fingerprint): the ratio of their step times for TinyMLP (a step of a
   few milliseconds, where a check's few milliseconds on 4 gloo ranks sharing 2 cores show), at every step and
   every 10, and for TinyGPT at every step (target: under 1.25x); every ``LABKIT_TRAIN_FAULT`` detected with its
   rank; the false alarms (every test: the loss band, the exact ones, the straggler's) over healthy runs of every
   data-parallel strategy and several seeds (target: 0).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.utils.data import DataLoader

from labkit import loader, monitor, train
from labkit.launch import launch

T_DATA, T_COMPUTE, WORKERS = 0.060, 0.020, (0, 1, 2, 4)


def stall_table(steps: int) -> None:
    cores = len(os.sched_getaffinity(0))
    alone = {"data": [], "compute": []}
    for _ in range(3):
        for part, seconds in (("data", T_DATA), ("compute", T_COMPUTE)):
            began = time.perf_counter()
            loader.burn(loader.work_units(seconds))
            alone[part].append(time.perf_counter() - began)
    t_data, t_compute = min(alone["data"]), min(alone["compute"])
    print(f"1. the stall: t_data {1e3 * t_data:.1f} ms, t_compute {1e3 * t_compute:.1f} ms (alone), {cores} cores")
    print(f"{'W':>3} {'wait ms':>8} {'step ms':>8} {'model':>7} {f'model {cores} cores':>14} {'measured/model':>15}")
    for workers in WORKERS:
        measured = loader.measure_stall(T_DATA, T_COMPUTE, workers, steps=steps, warmup=4)
        unlimited = t_compute + loader.stall_model(t_data, t_compute, workers)
        cored = t_compute + loader.stall_model(t_data, t_compute, workers, cores=cores)
        print(f"{workers:>3} {1e3 * measured['wait_s']:>8.1f} {1e3 * measured['step_s']:>8.1f} {1e3 * unlimited:>7.1f} "
              f"{1e3 * cored:>14.1f} {measured['step_s'] / cored:>15.2f}")


def loader_overhead(batches: int) -> None:
    samples = loader.JitteredSamples(torch.randn(4096, 16), torch.zeros(4096, dtype=torch.long))
    dataset = loader.CostlyDataset(samples, 0)
    print("\n2. labkit's StepLoader against torch's DataLoader (same data set and workers, no work per item)")
    for workers in (0, 2):
        times = {"torch": [], "labkit": []}
        for _ in range(3):
            sampler = loader.EpochSampler(len(dataset), 0, 1)
            plain = DataLoader(dataset, batch_size=16, sampler=sampler, num_workers=workers, drop_last=True)
            began = time.perf_counter()
            for count, _batch in enumerate(plain, 1):
                if count == batches:
                    break
            times["torch"].append(time.perf_counter() - began)
            stepped = loader.StepLoader(dataset, 16, 0, 1, num_workers=workers)
            began = time.perf_counter()
            for step in range(1, batches + 1):
                stepped(step)
            times["labkit"].append(time.perf_counter() - began)
            stepped.close()
        ratio = min(times["labkit"]) / min(times["torch"])
        print(f"   {workers} workers: torch {1e3 * min(times['torch']) / batches:.2f} ms/batch, labkit "
              f"{1e3 * min(times['labkit']) / batches:.2f} ms/batch, ratio {ratio:.2f}x")
        print(f"{'PASS' if ratio < 1.25 else 'FAIL'}: StepLoader within 1.25x of DataLoader at {workers} workers "
              f"({ratio:.2f}x)")


def run(fault: str | None = None, **settings) -> list[dict]:
    os.environ.pop(monitor.FAULT_VARIABLE, None)
    if fault:
        os.environ[monitor.FAULT_VARIABLE] = fault
    try:
        config = train.TrainConfig(**{"strategy": "ddp", "model": "tiny-mlp", "log_every": 10_000, **settings})
        config.validate()
        return launch(train.train, config, nprocs=4, rank_output="none")
    finally:
        os.environ.pop(monitor.FAULT_VARIABLE, None)


def alarm(seeds: int) -> None:
    torch.set_num_threads(1)
    print("\n3. the divergence alarm on 4 ranks (TinyMLP and TinyGPT)")
    cost = {}
    for model, steps, every in (("tiny-mlp", 200, 1), ("tiny-mlp", 200, 10), ("tiny-gpt", 100, 1)):
        with_alarm, without = (statistics.median(run(model=model, steps=steps, alarm_every=setting)[0]["ms_per_step"]
                                                 for _ in range(3)) for setting in (every, 0))
        cost[model, every] = with_alarm / without
        print(f"   {model}, the alarm every {every} step(s): {with_alarm:.2f} ms a step, without {without:.2f} ms: "
              f"{with_alarm / without:.2f}x")
    print(f"{'PASS' if cost['tiny-gpt', 1] < 1.25 else 'FAIL'}: the alarm at every step costs TinyGPT under 1.25x a "
          f"step ({cost['tiny-gpt', 1]:.2f}x)")
    for fault, strategy, steps in (("seed:2", "ddp", 4), ("lr:1", "ddp", 4), ("shard:3", "ddp", 4),
                                   ("no-reduce", "ddp", 4), ("data:1", "fsdp", 48), ("data:2", "ddp", 48),
                                   ("nan:1", "ddp", 4), ("slow:2", "zero2", 16)):
        found = run(fault, strategy=strategy, steps=steps)[0]["alarms"]
        print(f"   {fault:>9} ({strategy}): {found[0].split(' (')[0] if found else 'NOT DETECTED'}")
    false_alarms, checks = [], 0
    for strategy in ("ddp", "zero1", "zero2", "fsdp"):
        for seed in range(seeds):
            for model, steps in (("tiny-mlp", 96), ("tiny-gpt", 64)):
                found = run(strategy=strategy, model=model, seed=seed, steps=steps)[0]["alarms"]
                checks += steps
                false_alarms += [f"{strategy} {model} seed {seed}: {message}" for message in found]
    print(f"   healthy runs: {4 * seeds * 2} runs, {checks} checks, {len(false_alarms)} false alarm(s)")
    for message in false_alarms:
        print(f"     {message.split(' (')[0]}")
    print(f"{'PASS' if not false_alarms else 'FAIL'}: no false alarm on healthy runs ({len(false_alarms)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and seeds")
    args = parser.parse_args()
    stall_table(steps=16 if args.quick else 28)
    loader_overhead(batches=64 if args.quick else 200)
    alarm(seeds=1 if args.quick else 5)


if __name__ == "__main__":
    main()
