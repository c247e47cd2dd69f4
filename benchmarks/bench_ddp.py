"""labkit's DistributedDataParallel beside PyTorch's, training TinyGPT (~10M parameters) on 2 gloo ranks.

    python benchmarks/bench_ddp.py [--quick] [--steps N] [--batch-size B] [--sequence-length T]

What is measured: the time of one training step (forward, backward with the gradient all-reduce, AdamW step,
``zero_grad``) of ``TinyGPT(GPTConfig.preset("10m"))``, 9,956,480 float32 parameters, so every synchronised
step all-reduces 39.8 MB of gradients.  Each rank trains on its own batch of 2 sequences of 128 tokens from
the default ``MarkovChain`` (one step takes roughly 250 ms of compute on one core), drawn with
``seed_for_rank(0, rank)``: every variant sees the same batches and starts from the same weights.

The variants, all alive at once in one launched job of 2 ranks, one model and one optimizer each:

- ``no DDP``: the same model and step on each rank, no wrapper and no communication: what the step costs
  without data parallelism, under the same load (both ranks compute at the same time, as in the DDP rows);
- ``labkit``: :class:`labkit.parallel.ddp.DistributedDataParallel` with ``bucket_cap_mb`` 0 (one all-reduce per
  parameter), 1, 5, 25 and 100 MiB, overlap on, each ``.grad`` a view into its bucket (``grad = view``,
  labkit's default); at 25 MiB also with overlap off, and with ``gradient_as_bucket_view=False`` (``grad =
  copy``: each gradient copied into its bucket and the mean copied back);
- ``torch``: ``torch.nn.parallel.DistributedDataParallel`` with the same caps and
  ``gradient_as_bucket_view=True`` (buckets rebuilt in gradient arrival order after the first step); at 25 MiB
  also with ``gradient_as_bucket_view=False``, torch's default.  ``vs torch`` compares like with like: the
  same cap and the same ``gradient_as_bucket_view``.

How: every rank uses one thread (``torch.set_num_threads(1)``; on a 2-core machine the gloo threads then
compete with compute, as they would on any fully loaded CPU node).  The variants take turns step by step
(A, B, C, ..., then C, B, A, ...: the order flips every round so no variant always follows the same one) so a
burst of load from elsewhere hits all of them alike; before the timed steps every variant takes warm-up steps
(torch rebuilds its buckets after the first).  Each step starts after a barrier; a step's time is its slowest
rank's, and the table shows the median over steps, with the forward, backward (which includes waiting for
the gradients: both DDPs finish synchronising at the end of backward) and optimizer phases beside it, and the
10th-90th percentile of the step times.  ``grad MB`` is what each synchronised step all-reduces;
``buckets`` how many all-reduces that takes (torch's count after its rebuild).

Wall-clock time on a shared machine also counts the time the operating system gave to other processes, so
the table adds CPU time per step (median over steps, larger rank): of the rank's main thread (forward,
backward, the DDP's hooks and copies, the optimizer) and of its other threads (gloo's, which run the
all-reduces).  CPU time moves much less than wall-clock time when a neighbour loads the machine, so it shows
small overheads, such as the DDPs' own work on the main thread, that the wall-clock spread hides.

Ratios (``vs torch``, ``vs no DDP``, overlap off / on, and the target's) are *paired*: the median over rounds
of the ratio of the two variants' step times in that round, taken seconds apart (labkit and torch at the
same cap run one right after the other).  A burst of load that lasts a few rounds then cancels out of the
ratio, where it would shift one variant's median more than another's; the verdict line also prints the
ratio of the two medians.

The target (labkit within 1.15x of torch at the same bucket size and gradient layout, 25 MiB, overlap on,
``grad = view``) is reported as a PASS/FAIL line, beside the ratio of the two libraries' defaults (labkit's
views against torch's copies); the script exits 0 and
``labkit bench`` gates on them (exit 1 on a FAIL line unless ``--report-only``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from steptiming import paired_ratios, step_times, summarise, timed_step  # beside this script

from labkit.data import MarkovChain, batches, seed_for_rank
from labkit.launch import launch
from labkit.models import GPTConfig, TinyGPT
from labkit.parallel.ddp import DistributedDataParallel

TARGET_RATIO = 1.15
TARGET_BUCKET_MB = 25.0
WORLD_SIZE = 2


@dataclass(frozen=True)
class Variant:
    kind: str  # "none" (no DDP), "labkit" or "torch"
    bucket_cap_mb: float = 0.0
    overlap: bool = True  # labkit only
    gradient_as_bucket_view: bool = True

    @property
    def name(self) -> str:
        if self.kind == "none":
            return "no DDP (no communication)"
        overlap = "" if self.overlap else ", overlap off"
        view = "view" if self.gradient_as_bucket_view else "copy"
        return f"{self.kind} {self.bucket_cap_mb:g} MiB{overlap}, grad = {view}"


def variants(quick: bool) -> list[Variant]:
    cap = TARGET_BUCKET_MB
    headline = [Variant("none"), Variant("labkit", cap), Variant("torch", cap),
                Variant("labkit", cap, gradient_as_bucket_view=False),
                Variant("torch", cap, gradient_as_bucket_view=False), Variant("labkit", cap, overlap=False)]
    caps = (0.0, 5.0) if quick else (0.0, 1.0, 5.0, 100.0)
    # torch's smallest cap: 0 MiB puts every parameter in its own bucket, as labkit's 0 does.
    sweep = [Variant(kind, cap) for cap in caps for kind in ("labkit", "torch")]
    return headline + sweep


def _wrap(variant: Variant, model: torch.nn.Module) -> torch.nn.Module:
    if variant.kind == "labkit":
        return DistributedDataParallel(model, bucket_cap_mb=variant.bucket_cap_mb, overlap=variant.overlap,
                                       gradient_as_bucket_view=variant.gradient_as_bucket_view)
    if variant.kind == "torch":
        return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=variant.bucket_cap_mb,
                                                         gradient_as_bucket_view=variant.gradient_as_bucket_view)
    return model


def run_on_each_rank(chosen: list[Variant], steps: int, warmup: int, batch_size: int,
                     sequence_length: int) -> dict:
    """Train every variant ``warmup + steps`` steps, taking turns; return this rank's phase times per step."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    config = GPTConfig.preset("10m")
    tokens = MarkovChain().sample(200_000, seed=1)
    runs = []
    for variant in chosen:
        model = _wrap(variant, TinyGPT(config, seed=0))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        generator = torch.Generator().manual_seed(seed_for_rank(0, rank))
        runs.append((model, optimizer, generator))
    gradient_bytes = sum(p.numel() * p.element_size() for p in runs[0][0].parameters() if p.requires_grad)
    # [variant][step] -> [forward, backward, optimizer, main-thread CPU, other threads' CPU] in seconds
    times: list[list[list[float]]] = [[] for _ in chosen]
    for step in range(warmup + steps):
        order = list(enumerate(runs))
        for index, (model, optimizer, generator) in order if step % 2 == 0 else reversed(order):
            x, y = batches(tokens, batch_size, sequence_length, generator)
            dist.barrier()
            timing = timed_step(model, optimizer, x, y)
            if step >= warmup:
                times[index].append(timing)
    buckets = [len(model.buckets) if isinstance(model, DistributedDataParallel)
               else _torch_bucket_count(model) for model, _, _ in runs]
    return {"times": times, "gradient_bytes": gradient_bytes, "buckets": buckets}


def _torch_bucket_count(model: torch.nn.Module) -> int | None:
    """How many buckets torch's Reducer uses now (after its rebuild), or None without DDP."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return None
    try:
        return len(model._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(", "))
    except (KeyError, AttributeError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer variants and steps (about a minute)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 24, quick 10)")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank and step (default 2)")
    parser.add_argument("--sequence-length", type=int, default=128, help="tokens per sequence (default 128)")
    args = parser.parse_args()
    steps = args.steps or (10 if args.quick else 24)
    warmup = 2
    chosen = variants(args.quick)

    started = time.perf_counter()
    results = launch(run_on_each_rank, chosen, steps, warmup, args.batch_size, args.sequence_length,
                     nprocs=WORLD_SIZE, timeout=1200, rank_output="none")
    summaries = [summarise([result["times"][index] for result in results]) for index in range(len(chosen))]
    steps_of = {variant: step_times([result["times"][index] for result in results])
                for index, variant in enumerate(chosen)}
    gradient_mb = results[0]["gradient_bytes"] / 1e6
    by_variant = dict(zip(chosen, summaries, strict=True))
    none = Variant("none")

    def paired(ours: Variant, theirs: Variant) -> float:
        return statistics.median(paired_ratios(steps_of[ours], steps_of[theirs]))

    print(f"TinyGPT 10m (9,956,480 parameters), {WORLD_SIZE} gloo ranks x 1 thread, per-rank batch "
          f"{args.batch_size} x {args.sequence_length} tokens, AdamW; {steps} timed steps per variant after "
          f"{warmup} warm-up, variants interleaved; ms = median over steps of the slowest rank "
          f"(run took {time.perf_counter() - started:.0f} s)\n")
    print(f"{'':<53}{'---------- wall-clock ms ----------':^47} {'-- CPU ms --':^13}")
    header = (f"{'variant':<37} {'buckets':>7} {'grad MB':>7} {'forward':>8} {'backward':>8} {'optim':>6} "
              f"{'step':>6} {'p10-p90':>9} {'main':>6} {'gloo':>6} {'vs torch':>8} {'vs no DDP':>9}")
    print(header)
    print("-" * len(header))
    for index, (variant, summary) in enumerate(zip(chosen, summaries, strict=True)):
        torch_twin = Variant("torch", variant.bucket_cap_mb, gradient_as_bucket_view=variant.gradient_as_bucket_view)
        versus_torch = f"{paired(variant, torch_twin):.2f}x" \
            if variant.kind == "labkit" and torch_twin in steps_of else ""
        buckets = results[0]["buckets"][index]
        print(f"{variant.name:<37} {'' if buckets is None else buckets:>7} "
              f"{0 if variant.kind == 'none' else gradient_mb:>7.1f} {summary['forward']:>8.1f} "
              f"{summary['backward']:>8.1f} {summary['optimizer']:>6.1f} {summary['step']:>6.1f} "
              f"{summary['p10']:>4.0f}-{summary['p90']:<4.0f} {summary['cpu main']:>6.1f} "
              f"{summary['cpu other']:>6.1f} {versus_torch:>8} {paired(variant, none):>8.2f}x")
    print("\nstep = forward + backward (with the gradient sync) + optimizer; main / gloo = CPU time of the main "
          "thread / of the other threads;\nvs torch = labkit / torch step at the same bucket cap and gradient layout "
          "(below 1.0: labkit is faster); vs no DDP = step / the no-communication step; both paired: median over "
          "rounds of the ratio.")
    labkit, torch_variant = Variant("labkit", TARGET_BUCKET_MB), Variant("torch", TARGET_BUCKET_MB)
    labkit_copy = Variant("labkit", TARGET_BUCKET_MB, gradient_as_bucket_view=False)
    torch_copy = Variant("torch", TARGET_BUCKET_MB, gradient_as_bucket_view=False)
    ours, baseline = by_variant[labkit], by_variant[none]
    added = statistics.median(a - b for a, b in zip(steps_of[labkit], steps_of[none], strict=True))
    print(f"labkit {TARGET_BUCKET_MB:g} MiB: overlap off / on = "
          f"{paired(Variant('labkit', TARGET_BUCKET_MB, overlap=False), labkit):.2f}x.  Against no DDP it adds "
          f"{1000 * added:.0f} ms per step (median of per-round differences), of which CPU time: "
          f"{ours['cpu main'] - baseline['cpu main']:.0f} ms on the main thread (hooks, each gradient's copy into "
          f"its bucket) and {ours['cpu other'] - baseline['cpu other']:.0f} ms in gloo's threads (the all-reduces, "
          "which compete with the other rank's compute for the cores); the rest is waiting.")
    print(f"labkit {TARGET_BUCKET_MB:g} MiB: grad = view / grad = copy = {paired(labkit, labkit_copy):.2f}x "
          f"(main-thread CPU {ours['cpu main']:.0f} / {by_variant[labkit_copy]['cpu main']:.0f} ms); torch: "
          f"{paired(torch_variant, torch_copy):.2f}x ({by_variant[torch_variant]['cpu main']:.0f} / "
          f"{by_variant[torch_copy]['cpu main']:.0f} ms).  The defaults, labkit (views) / torch (copies): "
          f"{paired(labkit, torch_copy):.2f}x.\n")
    ratios = paired_ratios(steps_of[labkit], steps_of[torch_variant])
    ratio = statistics.median(ratios)
    print(f"labkit / torch at {TARGET_BUCKET_MB:g} MiB: per round p25-p75 {ratios[len(ratios) // 4]:.2f}-"
          f"{ratios[(3 * len(ratios)) // 4]:.2f}x; ratio of the median steps {ours['step'] / by_variant[torch_variant]['step']:.2f}x; "
          f"main-thread CPU {ours['cpu main'] / by_variant[torch_variant]['cpu main']:.3f}x")
    verdict = "PASS" if ratio <= TARGET_RATIO else "FAIL"
    print(f"{verdict}: labkit / torch DDP step time at {TARGET_BUCKET_MB:g} MiB buckets, grad = view = {ratio:.2f}x "
          f"(median over rounds; target <= {TARGET_RATIO})")


if __name__ == "__main__":
    main()
