"""3D parallelism on 8 gloo ranks: labkit's ``parallelize`` beside torch's DDP, and six layouts' step times.

    python benchmarks/bench_3d.py [--quick] [--steps N] [--preset NAME] [--global-batch B]

What is measured: the time of one training step (the pipeline schedule's forwards and backwards with the
tensor-parallel collectives inside them, the data-parallel reduction, AdamW's step) of
``TinyGPT(GPTConfig.preset(preset, tie_weights=False))`` on 8 ranks, fp32, one thread per rank
(``torch.set_num_threads(1)``), the global batch split over the data-parallel replicas and, with a pipeline,
into ``2 pp`` micro-batches.  A step's time is its slowest rank's (a barrier before each step).

1. **labkit against torch**: ``parallelize`` at dp=8, tp=pp=1 (labkit's DDP under the 3D wrapper, the schedule
   runtime with one stage, ``overlap_dp``: the buckets leave during the backward, as torch's do) and ``torch.nn.parallel.DistributedDataParallel`` on the same batches from the same
   weights, alive at once, taking turns step by step (the order flipping every round).  ``labkit / torch`` is
   paired: the median over rounds of labkit's step over torch's in the same round.
2. **Six layouts** (8x1x1, 4x2x1, 4x1x2, 2x2x2, 2x4x1, 1x2x4 as dp x tp x pp, DDP over dp, 1F1B): the median
   step, then one traced step split by ``labkit.parallel.parallelize.timing.step_breakdown`` into compute, tensor-parallel
   communication, bubble, data-parallel reduction and optimizer (the mean over ranks), and the bytes each rank
   put into each dimension's collectives in a step (``communication_per_step()``, the mean over ranks).  On 2
   cores, 8 ranks share the CPU: compute does not shrink with more ranks, and the layouts' order says what
   their communication and bubbles cost here, not on GPUs (lesson 11's planner predicts both).

3. **Predicted beside measured** (lesson 11): this machine calibrated in the same run, just before the layouts
   are timed and just after (``labkit.calibrate.calibrate``: one rank's FLOP rate and per-layer and per-pass
   overheads, the share of the cores 8 busy ranks get and their stragglers, the gloo ring step's alpha-beta with
   8 ranks at once and amid compute, AdamW per parameter), the two averaged
   (``labkit.costmodel.calibration.average``: a machine whose speed drifts is predicted at the window's mean),
   then each layout's step simulated event by event
   (``labkit.costmodel.calibration.Calibration.simulate``: processor sharing of the cores, queued sends, the DP
   reduction after the schedule as ``labkit.train`` runs it).  Printed: measured, predicted, the error, and
   Spearman's rank correlation of the two orders.

The targets (labkit / torch <= 1.0 at 8x1x1; every prediction within 30 %) are reported as PASS/FAIL lines;
the script exits 0 and ``labkit bench`` gates on them (exit 1 on a FAIL line unless ``--report-only``).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from labkit.calibrate import calibrate
from labkit.costmodel.calibration import average, rank_correlation
from labkit.costmodel.shapes import TransformerShape
from labkit.costmodel.step import Layout
from labkit.launch import launch
from labkit.mesh import Mesh
from labkit.models import GPTConfig, TinyGPT
from labkit.parallel.parallelize import parallelize
from labkit.parallel.parallelize.timing import LR, PARTS, slowest_rank_seconds, step_batch, time_layouts

TARGET_RATIO = 1.0
TARGET_PREDICTION_ERROR = 0.30
LAYOUTS = ((8, 1, 1), (4, 2, 1), (4, 1, 2), (2, 2, 2), (2, 4, 1), (1, 2, 4))


def _against_torch(config: GPTConfig, steps: int, global_batch: int) -> dict:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    ours = parallelize(TinyGPT(config, seed=0), Mesh(dp=8), microbatches=1, micro_batch_size=global_batch // 8,
                       seq_len=config.block_size, overlap_dp=True)  # DDP's buckets during backward, as torch's
    our_optimizer = ours.make_optimizer(torch.optim.AdamW, lr=LR)
    theirs = torch.nn.parallel.DistributedDataParallel(TinyGPT(config, seed=0))
    their_optimizer = torch.optim.AdamW(theirs.parameters(), lr=LR)

    def our_step(x, y):
        our_optimizer.zero_grad(set_to_none=True)
        ours.forward_backward(x, y)
        our_optimizer.step()

    def their_step(x, y):
        their_optimizer.zero_grad(set_to_none=True)
        theirs(x, y)[1].backward()
        their_optimizer.step()

    times: dict[str, list[float]] = {"labkit": [], "torch": []}
    for step in range(steps + 2):
        x, y = step_batch(config, global_batch, 8, rank, step)
        order = [("labkit", our_step), ("torch", their_step)]
        for name, fn in order if step % 2 else order[::-1]:
            seconds = slowest_rank_seconds(fn, x, y)
            if step >= 2:  # warm-up
                times[name].append(seconds)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--preset", default="1m")
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--no-torch", action="store_true", help="skip part 1 (labkit against torch's DDP)")
    args = parser.parse_args()
    steps = 3 if args.quick else args.steps
    config = GPTConfig.preset(args.preset, tie_weights=False)
    print(f"bench_3d: TinyGPT {args.preset} (untied), global batch {args.global_batch} x {config.block_size} "
          f"tokens, 8 gloo ranks, one thread each, {steps} timed steps after 2 warm-up", flush=True)

    if not args.no_torch:
        times = launch(_against_torch, config, steps, args.global_batch, nprocs=8, timeout=1800,
                       rank_output="none")[0]
        ratios = sorted(a / b for a, b in zip(times["labkit"], times["torch"], strict=True))
        ratio = statistics.median(ratios)
        print("\n1. dp=8 (tp=pp=1): labkit parallelize (DDP) against torch DistributedDataParallel")
        print(f"   median step: labkit {1e3 * statistics.median(times['labkit']):.1f} ms, torch "
              f"{1e3 * statistics.median(times['torch']):.1f} ms; labkit / torch = {ratio:.2f}x (paired, p25-p75 "
              f"{ratios[len(ratios) // 4]:.2f}-{ratios[(3 * len(ratios)) // 4]:.2f})")
        print(f"   {'PASS' if ratio <= TARGET_RATIO else 'FAIL'}: labkit / torch <= {TARGET_RATIO}")

    print("\n3. predicted beside measured: calibrating this machine before the layouts are timed ...", flush=True)
    before = calibrate(progress=lambda line: print(f"   {line}", flush=True))
    rows = time_layouts(config, LAYOUTS, steps, args.global_batch)
    print("\n2. six layouts (dp x tp x pp), DDP over dp, 1F1B with 2 pp micro-batches; ms per step (traced step's "
          "parts: mean over ranks)")
    header = f"   {'layout':>7} {'median':>8} " + " ".join(f"{part:>16}" for part in PARTS) + "   MiB/step by dimension"
    print(header)
    for row in rows:
        sent = ", ".join(f"{kind} {nbytes / 2**20:.2f}" for kind, nbytes in row.sent_bytes.items())
        print(f"   {row.label:>7} {1e3 * row.median_s:>8.1f} "
              + " ".join(f"{1e3 * row.parts[part]:>16.1f}" for part in PARTS) + f"   {sent}")
    fastest = min(rows, key=lambda row: row.median_s)
    print(f"   fastest here: {fastest.label}")

    print("\n3. predicted beside measured: calibrating again, after the timings ...", flush=True)
    after = calibrate(progress=lambda line: print(f"   {line}", flush=True))
    calibration = average([before, after])
    print(f"   before: {before.describe()}\n   after:  {after.describe()}\n   the two averaged: "
          f"{calibration.describe()}; the FLOP rate drifted {after.flops / before.flops - 1:+.0%} over the run")
    shape = TransformerShape.from_gpt_config(config)
    predicted = []
    for row in rows:
        predicted.append(calibration.simulate(shape, Layout(row.dp, row.tp, row.pp, micro_batch=row.micro_batch),
                                              args.global_batch))
    print(f"   {'layout':>7} {'measured':>9} {'predicted':>9} {'error':>7}   predicted parts (ms, mean over ranks)")
    errors = []
    for row, step in zip(rows, predicted, strict=True):
        errors.append(step.step_s / row.median_s - 1)
        parts = ", ".join(f"{part} {1e3 * seconds:.0f}" for part, seconds in step.mean_parts.items() if seconds)
        print(f"   {row.label:>7} {1e3 * row.median_s:>9.1f} {1e3 * step.step_s:>9.1f} {errors[-1]:>+7.0%}   {parts}")
    correlation = rank_correlation([row.median_s for row in rows], [step.step_s for step in predicted])
    worst = max(errors, key=abs)
    print(f"   rank correlation (Spearman) of measured and predicted order: {correlation:+.2f}; "
          f"largest error {worst:+.0%}")
    print(f"   {'PASS' if abs(worst) <= TARGET_PREDICTION_ERROR else 'FAIL'}: every prediction within "
          f"{TARGET_PREDICTION_ERROR:.0%}")


if __name__ == "__main__":
    main()
