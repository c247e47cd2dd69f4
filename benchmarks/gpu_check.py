"""GPU check: the CUDA/NCCL paths and the mixed-precision figures that a CPU cannot give.

    python3 benchmarks/gpu_check.py          (or: bash benchmarks/gpu_check.sh)

On one GPU:
1. ``labkit.launch`` with ``backend="nccl"`` and 1 rank: an all-reduce, labkit's ring all-reduce, a
   ``Mesh(dp=1)`` on ``cuda`` device meshes, and one training step of TinyGPT on ``cuda:0`` through every
   wrapper's contract (DDP, ZeRO-1, ZeRO-2, FSDP in bf16: bytes measured == predicted, full state on the GPU;
   the NCCL code paths, end to end);
2. TinyGPT ("10m" preset) training step time in fp32, bf16 autocast, and fp16 autocast with labkit's
   ``DynamicLossScaler`` (and with ``torch.amp.GradScaler`` beside it), with the peak memory of each from
   ``torch.cuda.max_memory_allocated``.  Median of timed steps after warm-up, ``torch.cuda.synchronize`` around.
Prints tables; exits non-zero only when a path is broken (not for slow figures).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from labkit import collectives, data, launch  # noqa: E402
from labkit.mesh import Mesh  # noqa: E402
from labkit.models import GPTConfig, TinyGPT  # noqa: E402
from labkit.parallel.ddp import DistributedDataParallel  # noqa: E402
from labkit.parallel.fsdp import FullyShardedDataParallel  # noqa: E402
from labkit.parallel.zero import ZeroDataParallel  # noqa: E402
from labkit.precision import DynamicLossScaler  # noqa: E402


def nccl_paths() -> dict:
    device = torch.device("cuda", 0)
    tensor = torch.full((1 << 20,), float(dist.get_rank() + 1), device=device)
    dist.all_reduce(tensor)
    ring = torch.arange(1000.0, device=device)
    collectives.ring_all_reduce(ring)
    mesh = Mesh(dp=dist.get_world_size())
    config = GPTConfig.preset("1m")
    tokens = data.MarkovChain().sample(20_000, seed=0)
    x, y = (t.to(device) for t in data.batches(tokens, 4, config.block_size, torch.Generator().manual_seed(0)))
    wrappers = {
        "ddp": lambda m: DistributedDataParallel(m, group=mesh.group("dp")),
        "zero1": lambda m: ZeroDataParallel(m, stage=1, group=mesh.group("dp")),
        "zero2": lambda m: ZeroDataParallel(m, stage=2, group=mesh.group("dp")),
        "fsdp bf16": lambda m: FullyShardedDataParallel(m, compute_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                        group=mesh.group("dp")),
    }
    contract = {}
    for name, wrap in wrappers.items():
        model = wrap(TinyGPT(config, seed=0).to(device))
        optimizer = model.make_optimizer(torch.optim.AdamW, lr=1e-3)
        loss = model(x, y)[1]
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        full = model.full_state_dict()
        contract[name] = {"loss": round(loss.item(), 4),
                          "bytes_ok": model.communication_per_step() == model.predicted_communication(),
                          "state_on": str(next(iter(full.values())).device)}
    return {"backend": dist.get_backend(), "all_reduce": tensor[0].item(), "ring_ok": bool(
        torch.equal(ring.cpu(), torch.arange(1000.0))), "mesh": mesh.coords(),
        "mesh_device": mesh.device_mesh.device_type, "contract": contract}


def time_mode(mode: str, steps: int = 10, warmup: int = 3, batch: int = 16) -> tuple[float, int, int]:
    device = torch.device("cuda", 0)
    config = GPTConfig.preset("10m")
    model = TinyGPT(config, seed=0).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = data.MarkovChain().sample(200_000, seed=0)
    generator = torch.Generator().manual_seed(0)
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16+labkit scaler": torch.float16,
             "fp16+GradScaler": torch.float16}[mode]
    scaler = (DynamicLossScaler() if mode == "fp16+labkit scaler"
              else torch.amp.GradScaler("cuda") if mode == "fp16+GradScaler" else None)
    torch.cuda.reset_peak_memory_stats(device)
    samples, skipped = [], 0
    for step in range(warmup + steps):
        x, y = (t.to(device) for t in data.batches(tokens, batch, config.block_size, generator))
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model(x, y)[1]
        optimizer.zero_grad(set_to_none=True)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            stepped = scaler.step(optimizer)
            skipped += stepped is False
            scaler.update()
        torch.cuda.synchronize(device)
        if step >= warmup:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples), torch.cuda.max_memory_allocated(device), skipped


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; nothing to check here")
        return 1
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, "
          f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
    result = launch.launch(nccl_paths, nprocs=1, backend="nccl", timeout=300)[0]
    print(f"1. NCCL via labkit.launch: {result}")
    broken = result["backend"] != "nccl" or result["all_reduce"] != 1.0 or not result["ring_ok"] or \
        result["mesh_device"] != "cuda" or not all(case["bytes_ok"] and case["state_on"].startswith("cuda")
                                                   for case in result["contract"].values())
    print("\n2. TinyGPT 10m (9.96M parameters), batch 16 x 256 tokens, AdamW, one GPU")
    print(f"{'mode':<20} {'ms/step':>8} {'vs fp32':>8} {'peak MiB':>9} {'skipped':>8}")
    baseline = None
    for mode in ("fp32", "bf16", "fp16+labkit scaler", "fp16+GradScaler"):
        seconds, peak, skipped = time_mode(mode)
        baseline = baseline or seconds
        print(f"{mode:<20} {seconds * 1e3:>8.2f} {baseline / seconds:>7.2f}x {peak / 2**20:>9.0f} {skipped:>8}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
