"""The parameter server's stragglers and staleness, measured on launched ranks beside the formulas.

    python benchmarks/bench_ps.py [--quick] [--updates N]

One server and 4 workers (5 gloo ranks, one thread each) train ``TinyMLP`` through
:func:`labkit.parallel.parameter_server.run_parameter_server`.  A gradient takes a millisecond or two, so the
injected delays dominate and 5 ranks on 2 cores measure the schedule, not the cores.

1. **Random delays** (every gradient late by an exponential delay of mean ``MEAN_S`` = 80 ms): seconds per
   update of sync (the slowest of N: ``base + mu H_N``), backup with b = 1 (the 3rd fastest of 4: ``base + mu
   (H_4 - H_1)``, and the simulator, which knows that a late worker finishes its gradient first), and async (the
   renewal rate ``1 / sum_i 1 / c_i``).  ``base`` is the measured seconds per update of sync with no delay:
   compute, two messages and the server's work.
2. **A fixed straggler** (worker 0 is ``SLOW_S`` = 80 ms slower on every gradient): sync waits for it every
   update; async does not, and the straggler's gradients are the stalest.
3. **Staleness and clocks**: mean staleness of async against ``N - 1``; the bounded delay with tau = 1 never above
   1; SSP with s = 1 (Ho et al.) never lets a worker pull more than 1 clock ahead of the slowest, while worker 0,
   the straggler, sets everyone's pace (gradients per worker equal within s + 1).

It reports figures and has no target (no PASS/FAIL line), so ``labkit bench`` never fails on it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from labkit.costmodel.stragglers import async_update_s, harmonic
from labkit.launch import launch
from labkit.models import MLPConfig, TinyMLP
from labkit.parallel.parameter_server import Stragglers, run_parameter_server
from labkit.parallel.parameter_server.simulate import clock_gap, simulate_parameter_server

CONFIG = MLPConfig(in_features=32, hidden_sizes=(64, 64), num_classes=4)
WORKERS, MEAN_S, SLOW_S = 4, 0.080, 0.080


def batches(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * worker + step)
    x = torch.randn(16, CONFIG.in_features, generator=generator)
    return x, x[:, :CONFIG.num_classes].argmax(1)


def _run(mode: str, updates: int, options: dict) -> dict | int:
    torch.set_num_threads(1)
    run = run_parameter_server(TinyMLP(CONFIG, seed=0), batches, mode=mode, updates=updates, lr=0.05, **options)
    if isinstance(run, int):
        return run
    times = run.update_times_s
    per_update = (times[-1] - times[0]) / (len(times) - 1)  # steady state: from the first update to the last
    staleness = {w: [r.staleness for r in run.applied if r.worker == w] for w in range(run.workers)}
    return {"per_update": per_update, "staleness": staleness, "dropped": len(run.received) - len(run.applied),
            "clock_gap": clock_gap(run.received, run.workers)}


def measure(mode: str, updates: int, **options) -> dict:
    return launch(_run, mode, updates, options, nprocs=WORKERS + 1, timeout=600, rank_output="none")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer updates (about 20 s)")
    parser.add_argument("--updates", type=int, default=None, help="updates per run (default 80, quick 30)")
    args = parser.parse_args()
    updates = args.updates or (30 if args.quick else 80)
    started = time.perf_counter()
    base = measure("sync", updates)["per_update"]
    random_delays = Stragglers(exponential_mean_s=MEAN_S, seed=1)
    print(f"1. Random delays: every gradient late by Exp(mean {MEAN_S * 1e3:.0f} ms); {WORKERS} workers, {updates} "
          f"updates per run; base (sync, no delay) {base * 1e3:.2f} ms per update\n")
    print(f"{'mode':<14} {'measured ms/update':>18} {'formula':>8} {'simulated':>9}  formula")
    rows = [("sync", {}, base + MEAN_S * harmonic(WORKERS), f"base + mu H_{WORKERS}"),
            ("backup b=1", {"backup_workers": 1}, base + MEAN_S * (harmonic(WORKERS) - harmonic(1)),
             f"base + mu (H_{WORKERS} - H_1)")]
    for label, options, formula, text in rows:
        mode = label.split()[0]
        found = measure(mode, updates, stragglers=random_delays, **options)
        simulated = simulate_parameter_server(mode, WORKERS, max(updates, 400), compute_s=base,
                                              stragglers=random_delays, **options).seconds_per_update
        print(f"{label:<14} {found['per_update'] * 1e3:>18.2f} {formula * 1e3:>8.2f} {simulated * 1e3:>9.2f}  {text}")
    found = measure("async", updates * WORKERS, stragglers=random_delays)
    formula = async_update_s([base + MEAN_S] * WORKERS)
    print(f"{'async':<14} {found['per_update'] * 1e3:>18.2f} {formula * 1e3:>8.2f} {'':>9}  "
          f"1 / sum_i 1/(base + mu)   (one gradient per update)")

    print(f"\n2. A fixed straggler: worker 0 is {SLOW_S * 1e3:.0f} ms slower on every gradient")
    slow = Stragglers(slow={0: SLOW_S})
    sync = measure("sync", updates, stragglers=slow)
    asynchronous = measure("async", updates * WORKERS, stragglers=slow)
    print(f"sync:  {sync['per_update'] * 1e3:.2f} ms per update (base + slow = {(base + SLOW_S) * 1e3:.2f})")
    rate = async_update_s([base + SLOW_S] + [base] * (WORKERS - 1))
    print(f"async: {asynchronous['per_update'] * 1e3:.2f} ms per gradient (1 / sum_i 1/c_i = {rate * 1e3:.2f}); mean "
          "staleness per worker: " + ", ".join(f"w{w} {statistics.mean(s):.1f}"
                                                for w, s in asynchronous["staleness"].items() if s))

    print("\n3. Staleness and clocks")
    asynchronous = measure("async", updates * WORKERS)
    everyone = [x for s in asynchronous["staleness"].values() for x in s]
    print(f"async: mean staleness {statistics.mean(everyone):.2f} (N - 1 = {WORKERS - 1}), max {max(everyone)}")
    bounded = measure("bounded_delay", updates * WORKERS, max_delay=1, stragglers=random_delays)
    everyone = [x for s in bounded["staleness"].values() for x in s]
    print(f"bounded_delay tau=1 (random delays): mean staleness {statistics.mean(everyone):.2f}, max {max(everyone)} "
          "(bound 1)")
    ssp = measure("ssp", updates * WORKERS, staleness_bound=1, stragglers=slow)
    everyone = [x for s in ssp["staleness"].values() for x in s]
    print(f"ssp s=1 (worker 0 slow): largest clock gap {ssp['clock_gap']} (bound 1); gradients per worker "
          f"{[len(s) for s in ssp['staleness'].values()]}; staleness mean {statistics.mean(everyone):.2f}, max "
          f"{max(everyone)} (not bounded by s); {ssp['per_update'] * 1e3:.2f} ms per gradient (the straggler's pace, "
          f"(base + slow) / N = {(base + SLOW_S) / WORKERS * 1e3:.2f})")
    print(f"\n(took {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
