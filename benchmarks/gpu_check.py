"""GPU check: the CUDA/NCCL paths and the mixed-precision figures that a CPU cannot give.

    python3 benchmarks/gpu_check.py          (or: bash benchmarks/gpu_check.sh)

On one GPU:
1. ``labkit.launch`` with ``backend="nccl"`` and 1 rank: an all-reduce, labkit's ring all-reduce, a
   ``Mesh(dp=1)`` on ``cuda`` device meshes, and one training step of TinyGPT on ``cuda:0`` through every
   wrapper's contract (DDP, ZeRO-1, ZeRO-2, FSDP in bf16: bytes measured == predicted, full state on the GPU;
   the NCCL code paths, end to end);
2. TinyGPT ("10m" preset) training step time in fp32, bf16 autocast, and fp16 autocast with labkit's
   ``DynamicLossScaler`` (and with ``torch.amp.GradScaler`` beside it), with the peak memory of each from
   ``torch.cuda.max_memory_allocated``.  Median of timed steps after warm-up, ``torch.cuda.synchronize`` around;
3. tensor parallelism (``labkit.parallel.tensor``) on ``cuda:0`` through NCCL, on the one rank one GPU allows:
   the operators' collectives (all-reduce, all-gather, reduce-scatter, each forward and backward: their autograd
   Functions applied directly, since the public operators are the identity on one rank), the split layers and
   the vocabulary-parallel cross-entropy (fp32 and bf16 logits, a padded vocabulary) forward and backward
   against their dense twins, ``parallelize_tensor`` with ``tp=1`` (with and without sequence parallelism,
   untied and tied) against the dense model with the wrapper contract, the split regions' dropout generator
   on the CUDA RNG, and the step time of the wrapper beside the plain model.
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
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from labkit import collectives, data, launch  # noqa: E402
from labkit import dist as labkit_dist  # noqa: E402
from labkit.mesh import Mesh  # noqa: E402
from labkit.models import GPTConfig, TinyGPT  # noqa: E402
from labkit.parallel.ddp import DistributedDataParallel  # noqa: E402
from labkit.parallel.fsdp import FullyShardedDataParallel  # noqa: E402
from labkit.parallel.tensor import (  # noqa: E402
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelGroup,
    VocabParallelEmbedding,
    parallelize_tensor,
    vocab_parallel_cross_entropy,
)
from labkit.parallel.tensor.ops import (  # noqa: E402  (the Functions behind f, g and their SP forms)
    _CopyToTensorParallel,
    _GatheredLinears,
    _GatherFromSequenceParallel,
    _ReduceFromTensorParallel,
    _ReduceScatterToSequenceParallel,
)
from labkit.parallel.zero import ZeroDataParallel  # noqa: E402
from labkit.precision import DynamicLossScaler  # noqa: E402

TP_TOLERANCE = 1e-4  # fp32 on the GPU: the same kernels as the dense twin, but summed in other orders


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


def _largest(pairs) -> float:
    """The largest absolute difference over ``(ours, reference)`` pairs of tensors."""
    return max((a.detach().float() - b.detach().float()).abs().max().item() for a, b in pairs)


def _operators_check(tp: TensorParallelGroup, device: torch.device) -> dict:
    """On one rank every collective is the identity: each operator must return its input, forward and backward,
    and the fused all-gather + column-parallel linears must equal ``F.linear``, gradients included."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 16, generator=generator).to(device).requires_grad_()
    upstream = torch.randn(2, 8, 16, generator=generator).to(device)
    identities = True
    for function in (_CopyToTensorParallel, _ReduceFromTensorParallel, _GatherFromSequenceParallel,
                     _ReduceScatterToSequenceParallel):
        x.grad = None
        out = function.apply(x, tp, "check")
        out.backward(upstream)
        identities &= bool(torch.equal(out, x) and torch.equal(x.grad, upstream))
    x.grad = None
    weights = [torch.randn(shape, generator=generator).to(device).requires_grad_()
               for shape in ((12, 16), (12,), (20, 16), (20,))]  # two linears: weight, bias, weight, bias
    fused = _GatheredLinears.apply(x, tp, "check", *weights)
    sum((out * out).sum() for out in fused).backward()
    dense = [t.detach().clone().requires_grad_() for t in [x, *weights]]
    reference = [F.linear(dense[0], dense[1 + 2 * i], dense[2 + 2 * i]) for i in range(2)]
    sum((out * out).sum() for out in reference).backward()
    pairs = list(zip(fused, reference, strict=True)) + [(ours.grad, theirs.grad) for ours, theirs in
                                                        zip([x, *weights], dense, strict=True)]
    return {"identities": identities, "gathered_linears": _largest(pairs)}


def _layers_check(tp: TensorParallelGroup, device: torch.device) -> dict:
    """The split layers and the cross-entropy against their dense twins, forward and backward."""
    torch.manual_seed(0)
    fc, proj, table = nn.Linear(16, 64).to(device), nn.Linear(64, 16).to(device), nn.Embedding(32, 16).to(device)
    column, row = ColumnParallelLinear.from_dense(fc, tp), RowParallelLinear.from_dense(proj, tp)
    embedding = VocabParallelEmbedding.from_dense(table, tp)
    ids = torch.randint(0, 32, (4, 8), device=device)
    ours, theirs = row(F.gelu(column(embedding(ids)))), proj(F.gelu(fc(table(ids))))
    (ours ** 2).sum().backward()
    (theirs ** 2).sum().backward()
    layers = _largest([(ours, theirs), (column.weight.grad, fc.weight.grad), (column.bias.grad, fc.bias.grad),
                       (row.weight.grad, proj.weight.grad), (row.bias.grad, proj.bias.grad),
                       (embedding.weight.grad, table.weight.grad)])
    targets = torch.randint(0, 30, (4, 8), device=device)
    entropy = {}
    for dtype in (torch.float32, torch.bfloat16):  # 32 columns, the last 2 padding: left out of the softmax
        logits = torch.randn(4, 8, 32, device=device).to(dtype).requires_grad_()
        loss = vocab_parallel_cross_entropy(logits, targets, tp, vocab_size=30)
        loss.backward()
        real = logits.detach().float()[..., :30].requires_grad_()
        reference = F.cross_entropy(real.reshape(-1, 30), targets.reshape(-1))
        reference.backward()
        entropy[str(dtype).removeprefix("torch.")] = {
            "loss": abs(loss.item() - reference.item()),
            "grad": _largest([(logits.grad[..., :30], real.grad.to(dtype))]),
            "padding_grad": logits.grad[..., 30:].abs().max().item(), "grad_dtype": str(logits.grad.dtype)}
    return {"layers": layers, "cross_entropy": entropy}


def _wrapper_check(mesh: Mesh, device: torch.device) -> dict:
    """``parallelize_tensor`` at tp=1 against the dense model: one AdamW step, the wrapper contract."""
    cases = {}
    for name, sequence_parallel, tied in (("tp", False, False), ("tp+sp", True, False), ("tp tied", False, True)):
        config = GPTConfig.preset("1m", tie_weights=tied)
        tokens = data.MarkovChain().sample(20_000, seed=0)
        x, y = (t.to(device) for t in data.batches(tokens, 4, config.block_size, torch.Generator().manual_seed(0)))
        dense = TinyGPT(config, seed=0).to(device)
        dense_loss = dense(x, y)[1]
        dense_loss.backward()
        model = parallelize_tensor(TinyGPT(config, seed=0).to(device), mesh, sequence_parallel=sequence_parallel)
        optimizer = model.make_optimizer(torch.optim.AdamW, lr=1e-3)
        loss = model(x, y)[1]
        loss.backward()
        grads = model.gradients()
        gradient = _largest((grads[name], p.grad) for name, p in dense.named_parameters())
        model.clip_grad_norm_(1.0)
        optimizer.step()
        full = model.full_state_dict()
        cases[name] = {"loss": abs(loss.item() - dense_loss.item()), "gradient": gradient,
                       "bytes_ok": model.communication_per_step() == model.predicted_communication(),
                       "state_on": str(next(iter(full.values())).device),
                       "state_keys_ok": full.keys() == dense.state_dict().keys()}
    return cases


def _dropout_check(mesh: Mesh, device: torch.device) -> dict:
    """With sequence parallelism every dropout draws from the split regions' generator, forked around them:
    a training forward must leave the device's default generator where it was and move the rank's own."""
    config = GPTConfig.preset("1m", dropout=0.1)
    model = parallelize_tensor(TinyGPT(config, seed=0).to(device), mesh, sequence_parallel=True, seed=0)
    x, y = (torch.randint(0, config.vocab_size, (2, 64), device=device) for _ in range(2))

    def default_state() -> torch.Tensor:
        return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()

    before, own_before = default_state(), model.rng.state.clone()
    loss = model(x, y)[1]
    loss.backward()
    model.eval()
    with torch.no_grad():
        evaluation = model(x, y)[1]
    return {"default_untouched": bool(torch.equal(before, default_state())),
            "own_moved": not torch.equal(own_before, model.rng.state), "loss_finite": bool(torch.isfinite(loss)),
            "dropout_changed_loss": abs(loss.item() - evaluation.item()) > 1e-6}


def _time_wrapper(mesh: Mesh, device: torch.device, steps: int = 10, warmup: int = 3, batch: int = 16) -> dict:
    """Median ms per AdamW step of TinyGPT 10m (untied), plain and wrapped by ``parallelize_tensor`` at tp=1."""
    config = GPTConfig.preset("10m", tie_weights=False)
    tokens = data.MarkovChain().sample(200_000, seed=0)
    timings = {}
    for name in ("plain", "labkit TP (tp=1)"):
        model = TinyGPT(config, seed=0).to(device)
        model = parallelize_tensor(model, mesh) if name != "plain" else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        generator = torch.Generator().manual_seed(0)
        samples = []
        for step in range(warmup + steps):
            x, y = (t.to(device) for t in data.batches(tokens, batch, config.block_size, generator))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            model(x, y)[1].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step >= warmup:
                samples.append(time.perf_counter() - start)
        timings[name] = 1e3 * statistics.median(samples)
    return timings


def tensor_parallel_paths() -> dict:
    """Section 3 on this rank's device (``cuda:0`` under NCCL; it also runs on the CPU under gloo)."""
    device = labkit_dist.device()
    mesh = Mesh(tp=dist.get_world_size())
    kinds: set[str] = set()
    tp = TensorParallelGroup(mesh.group("tp"), on_collective=lambda phase, kind, where, tensor: kinds.add(kind))
    report = {"backend": dist.get_backend(), "device": str(device), **_operators_check(tp, device)}
    report["collectives_run"] = sorted(kinds)
    report.update(_layers_check(tp, device))
    report["wrapper"] = _wrapper_check(mesh, device)
    report["dropout"] = _dropout_check(mesh, device)
    report["ms_per_step"] = _time_wrapper(mesh, device)
    return report


def tensor_parallel_broken(report: dict) -> list[str]:
    """What section 3 found broken (empty: every path works)."""
    problems = []
    if report["backend"] != "nccl" or not report["device"].startswith("cuda"):
        problems.append(f"ran on {report['backend']} / {report['device']}, not nccl / cuda")
    if not report["identities"]:
        problems.append("an operator is not the identity on one rank")
    if report["collectives_run"] != ["all_gather", "all_reduce", "reduce_scatter"]:
        problems.append(f"collectives run: {report['collectives_run']}")
    if report["gathered_linears"] > TP_TOLERANCE or report["layers"] > TP_TOLERANCE:
        problems.append("a split layer differs from its dense twin")
    for dtype, found in report["cross_entropy"].items():
        if found["loss"] > TP_TOLERANCE or found["grad"] > TP_TOLERANCE or found["padding_grad"] != 0 \
                or found["grad_dtype"] != f"torch.{dtype}":
            problems.append(f"vocab-parallel cross-entropy ({dtype}): {found}")
    for name, case in report["wrapper"].items():
        if case["loss"] > TP_TOLERANCE or case["gradient"] > TP_TOLERANCE or not case["bytes_ok"] \
                or not case["state_on"].startswith("cuda") or not case["state_keys_ok"]:
            problems.append(f"parallelize_tensor {name}: {case}")
    if not all(report["dropout"].values()):
        problems.append(f"dropout generator: {report['dropout']}")
    return problems


def print_tensor_parallel(report: dict) -> None:
    print(f"operators, forward and backward: {report['collectives_run']} ran; identities on one rank: "
          f"{report['identities']}; fused gather + linears vs F.linear max |diff| {report['gathered_linears']:.1e}; "
          f"split layers vs dense {report['layers']:.1e}")
    for dtype, found in report["cross_entropy"].items():
        print(f"vocab-parallel cross-entropy, {dtype} logits, 30 of 32 columns real: |loss diff| {found['loss']:.1e}, "
              f"max |grad diff| {found['grad']:.1e}, padding grad {found['padding_grad']}, grad {found['grad_dtype']}")
    header = f"{'parallelize_tensor, tp=1':<25} {'|loss diff|':>11} {'max |grad diff|':>15} {'bytes ok':>8} {'state on':>8}"
    print(header)
    for name, case in report["wrapper"].items():
        print(f"{name:<25} {case['loss']:>11.1e} {case['gradient']:>15.1e} {case['bytes_ok']!s:>8} "
              f"{case['state_on']:>8}")
    print(f"dropout with sequence parallelism (the split regions' generator): {report['dropout']}")
    timings = report["ms_per_step"]
    plain, wrapped = timings["plain"], timings["labkit TP (tp=1)"]
    print(f"TinyGPT 10m (untied), batch 16 x 256, AdamW fp32: plain {plain:.2f} ms/step, labkit TP at tp=1 "
          f"{wrapped:.2f} ms/step ({wrapped / plain:.2f}x)")


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

    print("\n3. Tensor parallelism on cuda:0 through NCCL, 1 rank (labkit.parallel.tensor)")
    try:
        report = launch.launch(tensor_parallel_paths, nprocs=1, backend="nccl", timeout=300)[0]
    except launch.LaunchError as error:
        print(f"BROKEN: {error}")
        return 1
    print_tensor_parallel(report)
    problems = tensor_parallel_broken(report)
    for problem in problems:
        print(f"BROKEN: {problem}")
    return 1 if broken or problems else 0


if __name__ == "__main__":
    sys.exit(main())
