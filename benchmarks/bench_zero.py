"""labkit's ZeRO stages 1-3 beside PyTorch's ZeroRedundancyOptimizer and fully_shard: TinyGPT (~10M), 2 gloo ranks.

    python benchmarks/bench_zero.py [--quick] [--steps N] [--batch-size B] [--sequence-length T]

What is measured, for ``TinyGPT(GPTConfig.preset("10m"))`` (9,956,480 float32 parameters, AdamW, fp32
throughout: 4 + 4 + 8 = 16 bytes of model state per parameter), on 2 ranks with gloo:

- the time of one training step: forward, backward (with whatever communication the variant does in it),
  optimizer step (with the all-gather / broadcast of updated parameters for the sharded ones) and
  ``zero_grad``;
- the *model-state* bytes each rank holds right after ``optimizer.step()`` (before ``zero_grad``, so the
  gradients are still there): the storages behind the parameters, their gradients and the optimizer's state,
  each storage counted once (``labkit.measure.storage_bytes``).  labkit's variants report it themselves
  (``memory_breakdown()``); for torch's the script counts the same storages: the parameters, their ``.grad``
  and ``optimizer.state`` of the local optimizer (``ZeroRedundancyOptimizer.optim``), and for ``fully_shard``
  the DTensors' local shards (``.to_local()``).  Communication buffers are not model state and are not
  counted (DDP's persistent buckets, 4 bytes per parameter in both DDPs; the transient gather / scatter
  buffers of ZeRO-2 and -3);
- beside it the analytical model, ``labkit.costmodel.memory.memory_per_rank(9_956_480, precision="fp32",
  optimizer="adam", zero_stage=s, dp_degree=2)``, and the ratio measured / model;
- the bytes entering collectives per step: from the layout (``predicted_communication()``) and as counted
  while running the last step (``communication_per_step()``), both from the contract every labkit wrapper
  keeps (``labkit.parallel.base``); torch's classes count nothing, so their rows are empty.

The variants, all alive at once in one launched job of 2 ranks, one model and one optimizer each, all
starting from the same weights and seeing the same batches (2 sequences of 128 tokens per rank from the
default ``MarkovChain``, drawn with ``seed_for_rank(0, rank)``):

- ``labkit DDP``: :class:`labkit.parallel.ddp.DistributedDataParallel` (25 MiB buckets) + ``torch.optim.AdamW``;
- ``labkit ZeRO-1``: ``ZeroDataParallel(stage=1)``: the same DDP + a ``ShardedOptimizer(..., AdamW, stage=1)``
  (whole parameters per rank, updated ones broadcast: ``ZeroRedundancyOptimizer``'s scheme);
- ``labkit ZeRO-2``: ``ZeroDataParallel(stage=2)``: the plain model + ``ShardedOptimizer(..., AdamW, stage=2)``
  (gradients reduce-scattered in backward, 25 MiB buckets);
- ``labkit ZeRO-3``: ``FullyShardedDataParallel`` (one unit per transformer block, the rest in the root,
  prefetch on) + ``AdamW`` on its parameters (the shards);
- ``torch ZeRO-1``: ``torch.nn.parallel.DistributedDataParallel`` + ``ZeroRedundancyOptimizer(AdamW)``;
- ``torch fully_shard``: ``fully_shard`` on every block and then on the root, over
  ``init_device_mesh("cpu", (2,))`` (FSDP2 defaults: blocks resharded after forward, the root kept), +
  ``AdamW`` on the DTensor parameters.

How (as ``bench_ddp.py``): every rank uses one thread (``torch.set_num_threads(1)``); the variants take turns
step by step, the order flipping every round; every variant first takes warm-up steps; each step starts
after a barrier; a step's time is its slowest rank's and the table shows the median over steps, the
forward / backward / optimizer phases of the slowest rank, the 10th-90th percentile, and CPU time per step
of the main thread and of the other threads (gloo's), larger rank.  The ZeRO-3 / fully_shard verdict also
gives the median of the per-round ratios, each from two steps taken one right after the other.

Targets, reported as PASS/FAIL lines (the script exits 0; ``labkit bench`` gates on them): labkit
ZeRO-3 step time <= 1.3x torch ``fully_shard``; each labkit variant's measured model-state bytes within 5%
of the model, on every rank.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from steptiming import step_times, summarise, timed_step  # beside this script

from labkit.costmodel.memory import memory_per_rank
from labkit.data import MarkovChain, batches, seed_for_rank
from labkit.launch import launch
from labkit.measure import storage_bytes
from labkit.models import GPTConfig, TinyGPT
from labkit.parallel.ddp import DistributedDataParallel
from labkit.parallel.fsdp import FullyShardedDataParallel
from labkit.parallel.zero import ZeroDataParallel

WORLD_SIZE = 2
NUM_PARAMETERS = 9_956_480
TARGET_TIME_RATIO = 1.3
TARGET_MEMORY_TOLERANCE = 0.05
LR = 3e-4
# name -> (ZeRO stage for the memory model, labkit's or torch's)
VARIANTS = {
    "labkit DDP": (0, "labkit"),
    "labkit ZeRO-1": (1, "labkit"),
    "labkit ZeRO-2": (2, "labkit"),
    "labkit ZeRO-3": (3, "labkit"),
    "torch ZeRO-1 (ZeRO-RO)": (1, "torch"),
    "torch fully_shard": (3, "torch"),
}
KINDS = ("weights", "gradients", "optimizer_states", "optimizer_other")


LABKIT = {  # labkit's variants, used through the contract only once built
    "labkit DDP": lambda model: DistributedDataParallel(model, bucket_cap_mb=25),
    "labkit ZeRO-1": lambda model: ZeroDataParallel(model, stage=1, bucket_cap_mb=25),
    "labkit ZeRO-2": lambda model: ZeroDataParallel(model, stage=2, bucket_cap_mb=25),
    "labkit ZeRO-3": lambda model: FullyShardedDataParallel(model, prefetch=True),
}


def _build(name: str, config: GPTConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = TinyGPT(config, seed=0)
    if name in LABKIT:
        model = LABKIT[name](model)
        return model, model.make_optimizer(torch.optim.AdamW, lr=LR)
    if name == "torch ZeRO-1 (ZeRO-RO)":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    if name == "torch fully_shard":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=LR)
    raise ValueError(name)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _torch_breakdown(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """``model_state_bytes``' keys, counted on torch's variants (local shards of DTensors)."""
    local_optimizer = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's here
    seen: set[int] = set()
    parameters = list(model.parameters())
    weights = storage_bytes([_local(p) for p in parameters], seen)
    gradients = storage_bytes([_local(p.grad) for p in parameters if p.grad is not None], seen)
    states = other = 0
    for group in local_optimizer.param_groups:
        for p in group["params"]:
            for value in local_optimizer.state.get(p, {}).values():
                if torch.is_tensor(value):
                    if value.shape == p.shape and value.dim() > 0:
                        states += storage_bytes([_local(value)], seen)
                    else:
                        other += storage_bytes([_local(value)], seen)
    return {"weights": weights, "gradients": gradients, "optimizer_states": states, "optimizer_other": other}


def _breakdown(name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    return model.memory_breakdown() if name in LABKIT else _torch_breakdown(model, optimizer)


def _communication(name: str, model: torch.nn.Module) -> tuple[int | None, int | None]:
    """Bytes entering collectives per step: from the layout, and counted in the last step (None: torch's
    classes, which do not say)."""
    if name not in LABKIT:
        return None, None
    return sum(model.predicted_communication().values()), sum(model.communication_per_step().values())


def run_on_each_rank(names: list[str], steps: int, warmup: int, batch_size: int, sequence_length: int) -> dict:
    """Train every variant ``warmup + steps`` steps, taking turns; return this rank's times and bytes."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    config = GPTConfig.preset("10m")
    tokens = MarkovChain().sample(200_000, seed=1)
    runs = []
    for name in names:
        model, optimizer = _build(name, config)
        runs.append((name, model, optimizer, torch.Generator().manual_seed(seed_for_rank(0, rank))))
    times: list[list[list[float]]] = [[] for _ in names]  # [variant][step] -> fwd, bwd, opt, cpu main, other
    memory: list[dict[str, int]] = [{} for _ in names]
    losses: list[float] = [0.0 for _ in names]
    for step in range(warmup + steps):
        order = list(enumerate(runs))
        for index, (name, model, optimizer, generator) in order if step % 2 == 0 else reversed(order):
            x, y = batches(tokens, batch_size, sequence_length, generator)
            dist.barrier()

            def measure(loss, index=index, name=name, model=model, optimizer=optimizer):
                memory[index] = _breakdown(name, model, optimizer)
                losses[index] = loss.item()

            last = step == warmup + steps - 1  # gradients and optimizer state both alive: the model's moment
            timing = timed_step(model, optimizer, x, y, after_step=measure if last else None)
            if step >= warmup:
                times[index].append(timing)
    layout, counted = zip(*(_communication(name, model) for name, model, _, _ in runs), strict=True)
    parameters = sum(p.numel() for p in runs[0][1].parameters())
    return {"times": times, "memory": memory, "counted": counted, "layout": layout, "losses": losses,
            "parameters": parameters}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (under a minute)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 30, quick 10)")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank and step (default 2)")
    parser.add_argument("--sequence-length", type=int, default=128, help="tokens per sequence (default 128)")
    args = parser.parse_args()
    steps = args.steps or (10 if args.quick else 30)
    warmup = 2
    names = list(VARIANTS)

    started = time.perf_counter()
    results = launch(run_on_each_rank, names, steps, warmup, args.batch_size, args.sequence_length,
                     nprocs=WORLD_SIZE, timeout=1200, rank_output="none")
    summaries = {name: summarise([result["times"][index] for result in results])
                 for index, name in enumerate(names)}
    reference = summaries["torch fully_shard"]["step"]
    parameters = results[0]["parameters"]

    print(f"TinyGPT 10m ({parameters:,} parameters), {WORLD_SIZE} gloo ranks x 1 thread, per-rank batch "
          f"{args.batch_size} x {args.sequence_length} tokens, AdamW fp32; {steps} timed steps per variant after "
          f"{warmup} warm-up, variants interleaved; ms = median over steps of the slowest rank "
          f"(run took {time.perf_counter() - started:.0f} s)\n")
    print(f"{'':<23}{'------------- wall-clock ms -------------':^49} {'-- CPU ms --':^13}")
    header = (f"{'variant':<23} {'forward':>8} {'backward':>8} {'optim':>6} {'step':>7} {'p10-p90':>11} "
              f"{'main':>6} {'gloo':>6} {'vs fully_shard':>14} {'loss':>6}")
    print(header)
    print("-" * len(header))
    for index, name in enumerate(names):
        s = summaries[name]
        print(f"{name:<23} {s['forward']:>8.1f} {s['backward']:>8.1f} {s['optimizer']:>6.1f} {s['step']:>7.1f} "
              f"{s['p10']:>5.0f}-{s['p90']:<5.0f} {s['cpu main']:>6.1f} {s['cpu other']:>6.1f} "
              f"{s['step'] / reference:>13.2f}x {results[0]['losses'][index]:>6.3f}")
    print("\nstep = forward + backward + optimizer (+ zero_grad); main / gloo = CPU time of the main thread / of the "
          "other threads;\nvs fully_shard = step / torch fully_shard's step; loss = rank 0's last training loss "
          "(same data and weights in every row).\n")

    print("Model-state bytes per rank, measured after optimizer.step() (gradients still held), MB = 1e6 bytes; "
          "model = memory_per_rank(fp32, adam, stage, dp=2)")
    header = (f"{'variant':<23} {'stage':>5} {'weights':>8} {'grads':>8} {'opt st':>8} {'other':>8} "
              f"{'total r0':>9} {'total r1':>9} {'model':>8} {'meas/model':>10} {'comm MB/step':>13} {'counted':>8}")
    print(header)
    print("-" * len(header))
    memory_verdicts = []
    for index, (name, (stage, origin)) in enumerate(VARIANTS.items()):
        model = memory_per_rank(NUM_PARAMETERS, precision="fp32", optimizer="adam", zero_stage=stage,
                                dp_degree=WORLD_SIZE)
        model_total = model["weights"] + model["gradients"] + model["optimizer_states"]
        per_rank = [result["memory"][index] for result in results]
        totals = [sum(m[kind] for kind in KINDS) for m in per_rank]
        worst = max(range(WORLD_SIZE), key=lambda r: abs(totals[r] / model_total - 1))
        ratios = [total / model_total for total in totals]
        largest = max(range(WORLD_SIZE), key=lambda r: totals[r])
        shown = per_rank[largest]
        layout, counted = results[0]["layout"][index], results[0]["counted"][index]
        print(f"{name:<23} {stage:>5} " + " ".join(f"{shown[kind] / 1e6:>8.3f}" for kind in KINDS) +
              f" {totals[0] / 1e6:>9.3f} {totals[1] / 1e6:>9.3f} {model_total / 1e6:>8.3f} "
              f"{ratios[worst]:>10.4f} {'' if layout is None else f'{layout / 1e6:.1f}':>13} "
              f"{'' if counted is None else f'{counted / 1e6:.1f}':>8}")
        if origin == "labkit":
            memory_verdicts.append((name, ratios, per_rank, model))
    print("\nweights ... other: the larger rank's breakdown (other = Adam's step counters, one scalar per local "
          "tensor); meas/model: the rank farthest from the model;\ncomm MB/step: bytes entering collectives per "
          "step from the layout, counted = what the classes counted while running the last step.")
    print("Not counted as model state: communication buffers (each DDP's persistent buckets: 4 bytes per "
          "parameter, another ~39.8 MB; ZeRO-2/3's transient full-size buffers).\n")

    ours, theirs = summaries["labkit ZeRO-3"], summaries["torch fully_shard"]
    paired = sorted(a / b for a, b in zip(*(
        step_times([result["times"][names.index(name)] for result in results])
        for name in ("labkit ZeRO-3", "torch fully_shard")), strict=True))
    ratio = ours["step"] / theirs["step"]
    print(f"labkit ZeRO-3 / fully_shard per round: median {statistics.median(paired):.2f}x (p25-p75 "
          f"{paired[len(paired) // 4]:.2f}-{paired[(3 * len(paired)) // 4]:.2f}); phases forward "
          f"{ours['forward']:.0f} vs {theirs['forward']:.0f} ms, backward {ours['backward']:.0f} vs "
          f"{theirs['backward']:.0f} ms, optimizer {ours['optimizer']:.0f} vs {theirs['optimizer']:.0f} ms; "
          f"CPU main {ours['cpu main']:.0f} vs {theirs['cpu main']:.0f} ms, gloo {ours['cpu other']:.0f} vs "
          f"{theirs['cpu other']:.0f} ms")
    verdict = "PASS" if ratio <= TARGET_TIME_RATIO else "FAIL"
    print(f"{verdict}: labkit ZeRO-3 / torch fully_shard step time = {ratio:.2f}x (target <= {TARGET_TIME_RATIO})")
    for name, ratios, per_rank, model in memory_verdicts:
        ok = all(abs(r - 1) <= TARGET_MEMORY_TOLERANCE for r in ratios)
        detail = ", ".join(f"r{rank} {r:.4f}" for rank, r in enumerate(ratios))
        excess = []
        other = max(m["optimizer_other"] for m in per_rank)
        if other:
            excess.append(f"step counters {other / 1e3:.1f} kB")
        for kind in ("weights", "gradients", "optimizer_states"):
            extra = max(m[kind] for m in per_rank) - model[kind]
            if abs(extra) >= 1:
                excess.append(f"{kind} {extra / 1e3:+.1f} kB")
        print(f"{'PASS' if ok else 'FAIL'}: {name} measured / model = {detail} (target within "
              f"{TARGET_MEMORY_TOLERANCE:.0%}); beyond the model on the larger rank: {', '.join(excess) or 'none'}")


if __name__ == "__main__":
    main()
