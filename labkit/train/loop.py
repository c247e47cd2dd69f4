"""``python -m labkit.train`` — one trainer, every strategy chosen by a flag.

On a laptop (gloo, N forked ranks)::

    python -m labkit.train --strategy single --model tiny-gpt --steps 200
    python -m labkit.train --strategy ddp --nprocs 2 --model tiny-gpt --steps 200

On GPUs (NCCL, one process per GPU; ``torchrun`` sets RANK/WORLD_SIZE and the trainer runs in place)::

    torchrun --nproc_per_node=8 -m labkit.train --strategy fsdp --model tiny-gpt --preset 10m --steps 1000

**3D parallelism** (lesson 10): ``--dp D --tp T --pp P`` with ``D T P`` equal to the number of ranks lays
them out on a :class:`labkit.mesh.Mesh` and wraps the model with :func:`labkit.parallel.parallelize.parallelize`:
pipeline stages over pp (``--schedule gpipe|1f1b|interleaved|zb-h1|interleaved-zb|zb-v|dualpipev``,
``--microbatches M``), tensor parallelism over tp, and over dp DDP, ZeRO-1, ZeRO-2 or FSDP (``--zero 0|1|2|3``).
A degree left out is 1, or for dp what the world size leaves; without ``--nprocs`` (and outside torchrun) the
degrees given, ``--dp`` among them, say how many ranks to fork.  The same command on a laptop (``--nprocs 8``, gloo) and on GPU nodes (``torchrun``, NCCL)::

    python -m labkit.train --dp 2 --tp 2 --pp 2 --nprocs 8 --steps 50
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
        -m labkit.train --dp 2 --tp 8 --pp 1 --zero 1 --preset 10m --steps 1000

``--precision bf16`` (autocast) or ``fp16`` (autocast and a dynamic loss scaler) works with every strategy (fp16
not with ZeRO-2, whose gradients live where the scaler does not look).  ``--trace PATH`` writes a
Chrome/Perfetto trace (chrome://tracing, ui.perfetto.dev) of the last step: every rank's compute, tensor-parallel
all-reduces, pipeline waits (the bubble) and data-parallel reduction on one timeline; ``--log-dir DIR`` writes
each rank's own progress to ``DIR/rank-R.log``.

**Monitoring** (:mod:`labkit.monitor`): ``--tensorboard DIR`` writes every rank's loss, learning rate, gradient
norm, tokens/s, step time, data-wait time, bytes sent and (on a GPU) peak memory to ``DIR/rank-R``, one
TensorBoard run per rank (``tensorboard --logdir DIR`` draws one curve per rank on each chart).  The divergence
alarm compares the data-parallel ranks every ``--alarm-every N`` steps (default 1; 0: off) with one all-gather of
three numbers each, and prints ``labkit.train: ALARM step S: rank R: ...`` when a rank leaves the others: its
gradient norm or weights not the same (to the bit) as its replicas', its loss beyond the ranks' spread, two ranks
on the same batches.  ``LABKIT_TRAIN_FAULT=KIND:RANK`` injects one such misconfiguration on purpose
(:data:`labkit.monitor.FAULTS`: ``seed``, ``lr``, ``shard``, ``data``; ``no-reduce`` on every rank).

Otherwise the ranks are all data-parallel, and the strategy is one of ``labkit.parallel``'s wrappers, chosen once
from :data:`STRATEGIES` (a name -> constructor table).  After that the loop knows nothing about which wrapper it
holds: it uses the contract of ``labkit.parallel.base`` only (``forward_backward``, ``make_optimizer``,
``clip_grad_norm_``, ``communication_per_step``, ``memory_breakdown``, ``full_state_dict``).  ``single`` is the same loop with no
wrapper at all (:class:`labkit.parallel.base.SingleProcess`).

The workload is :class:`labkit.models.TinyGPT` on text from :class:`labkit.data.MarkovChain`, whose best possible
loss (the entropy rate) is printed beside the loss so progress has a floor to aim at; or
:class:`labkit.models.TinyMLP` on Gaussian blobs.  Each *data-parallel* rank samples its own batches (seeded by
its data-parallel coordinate, so that ranks that split one model, later, see the same batch), so the global
batch is ``--batch-size x data-parallel ranks``.  Rank 0 prints progress with every rank's loss and the bytes
each step communicated.

**Checkpoints** (``labkit.checkpoint``, lesson 09): with ``--checkpoint-dir DIR`` the whole training state (model,
optimizer, step, the data sampler's position, every rank's RNGs) is saved every ``--save-every N`` steps and at
the end, into ``DIR/step-NNNNNNNN``, atomically, gathered and written by rank 0 or, with ``--checkpoint-layout
sharded``, by every rank (and then loadable on any number of ranks).  ``--resume PATH`` continues from a checkpoint exactly (the same
losses, bit for bit, as a run that never stopped); ``--resume latest`` from the newest finished checkpoint in
``DIR``, or from the start if there is none yet, which is what a job restarted by ``torchrun --max-restarts``
needs::

    torchrun --nproc_per_node=2 --max-restarts=2 -m labkit.train --strategy ddp --steps 1000 \
        --checkpoint-dir runs/a --save-every 100 --resume latest

**When something goes wrong** (:mod:`labkit.train.report`): a bad flag, a layout that cannot work, a checkpoint
directory that cannot be written or has no room for a checkpoint, a ``--resume`` of another model or number of
ranks: one line and exit status 2, before any process starts (:mod:`labkit.train.config`).  A rank that fails:
one line naming it and its error, the traceback kept in a file (``--traceback`` prints it), exit status 1.
``SIGTERM`` or Ctrl-C: every rank stopped, the last checkpoint named, exit status 128 + the signal.  What a save
killed mid-write left (a temporary file of a dead process) is removed by the next run, which says so.

``LABKIT_TRAIN_KILL=RANK:STEP`` kills that rank (``SIGKILL``) when it reaches that step, in the first attempt only
(``TORCHELASTIC_RESTART_COUNT`` unset or 0): the fault injection of the elastic test and of lesson 09.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from labkit import checkpoint, data, dist, launch, loader, monitor, precision, trace
from labkit.mesh import Mesh
from labkit.models import TinyGPT, TinyMLP
from labkit.parallel.base import ParallelWrapper, SingleProcess
from labkit.parallel.ddp import DistributedDataParallel
from labkit.parallel.experts.model import balance_experts
from labkit.parallel.fsdp import FullyShardedDataParallel
from labkit.parallel.parallelize import DP_WRAPPERS, parallelize
from labkit.parallel.zero import ZeroDataParallel
from labkit.train import report
from labkit.train.config import (
    MLP_CONFIG,
    MODELS,
    PRECISIONS,
    STRATEGY_NAMES,
    TrainConfig,
    parse_arguments,
)

__all__ = ["MODELS", "PRECISIONS", "STRATEGIES", "TrainConfig", "build", "main", "parse_arguments", "train"]

# The one place that knows the wrappers: a strategy's name -> how to wrap a plain model over the mesh.
STRATEGIES: dict[str, Callable[[nn.Module, Mesh | None, TrainConfig], ParallelWrapper]] = {
    "single": lambda model, mesh, config: SingleProcess(model),
    "ddp": lambda model, mesh, config: DistributedDataParallel(
        model, bucket_cap_mb=config.bucket_cap_mb, group=mesh.group("dp")),
    "zero1": lambda model, mesh, config: ZeroDataParallel(
        model, stage=1, bucket_cap_mb=config.bucket_cap_mb, group=mesh.group("dp")),
    "zero2": lambda model, mesh, config: ZeroDataParallel(
        model, stage=2, bucket_cap_mb=config.bucket_cap_mb, group=mesh.group("dp")),
    "fsdp": lambda model, mesh, config: FullyShardedDataParallel(model, group=mesh.group("dp")),
}
assert tuple(STRATEGIES) == STRATEGY_NAMES


def build(config: TrainConfig, dp_rank: int = 0, dp_size: int = 1
          ) -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]], float | None, torch.Generator]:
    """The plain model, a function ``step -> (inputs, targets)`` drawing this data-parallel rank's batch, the loss
    floor, and the sampler's generator (its state is the sampler's position).  Ranks with the same data-parallel
    coordinate draw the same batches.  With ``--workers`` or ``--data-ms``, the batches come through a
    ``DataLoader`` (:class:`labkit.loader.StepLoader`): step ``s``'s batch depends on ``s`` alone, so a resume
    needs no sampler state."""
    generator = data.data_parallel_generator(config.seed, dp_rank, dp_size)
    if config.model == "tiny-gpt":
        model_config = config.gpt_config()
        model, chain = TinyGPT(model_config, seed=config.seed), data.MarkovChain(seed=config.seed)
        tokens, floor = chain.sample(200_000, seed=config.seed), chain.entropy_rate()
        source = loader.RandomCrops(tokens, model_config.block_size)

        def batch(_step: int) -> tuple[torch.Tensor, torch.Tensor]:
            return data.batches(tokens, config.batch_size, model_config.block_size, generator)
    else:
        samples = data.make_classification(4096, MLP_CONFIG.in_features, MLP_CONFIG.num_classes, seed=config.seed)
        model, floor, source = TinyMLP(MLP_CONFIG, seed=config.seed), None, loader.JitteredSamples(*samples.tensors)

        def batch(_step: int) -> tuple[torch.Tensor, torch.Tensor]:
            index = torch.randint(len(samples), (config.batch_size,), generator=generator)
            return samples.tensors[0][index], samples.tensors[1][index]
    if config.input_pipeline:  # --workers / --data-ms: a DataLoader over samples that cost time (labkit.loader)
        dataset = loader.CostlyDataset(source, loader.work_units(config.data_ms / 1e3), config.seed, dp_rank)
        batch = loader.StepLoader(dataset, config.batch_size, dp_rank, dp_size, seed=config.seed,
                                  num_workers=config.workers or 0, prefetch_factor=config.prefetch_factor,
                                  persistent_workers=config.persistent_workers,
                                  pin_memory=dist.device().type == "cuda")
    return model, batch, floor, generator


def _wrap(plain: nn.Module, mesh: Mesh | None, config: TrainConfig) -> ParallelWrapper:
    """The model under its strategy: :func:`parallelize` for 3D runs, else one of :data:`STRATEGIES`."""
    if not config.three_d:
        return STRATEGIES[config.strategy](plain, mesh, config)
    return parallelize(plain, mesh, zero=config.zero, schedule=config.schedule, microbatches=config.microbatches,
                       virtual_stages=config.virtual_stages, micro_batch_size=config.batch_size // config.microbatches,
                       seq_len=plain.config.block_size, bucket_cap_mb=config.bucket_cap_mb, seed=config.seed,
                       cp_strategy=config.cp_strategy, cp_split=config.cp_split)


def train(config: TrainConfig) -> dict:
    """Run on every rank (or alone): returns this rank's loss history, step time, bytes communicated per step,
    model-state bytes held, a checksum of the unsharded parameters, its mesh coordinates and, on rank 0 with
    ``--trace``, every rank's spans of the last step."""
    device = dist.device()
    if (config.strategy != "single" or config.three_d) and not dist.is_initialized():
        raise ValueError(f"--strategy {config.strategy} needs several ranks: pass --nprocs N, or run under torchrun")
    world = dist.world_size()
    config.resolve(world)
    if config.three_d:
        mesh = Mesh(dp=config.dp, tp=config.tp, pp=config.pp, cp=config.cp, ep=config.ep)
    else:
        mesh = Mesh(dp=world) if dist.is_initialized() else None
    fault = _fault(config)
    coordinate = (mesh.rank("dp"), mesh.size("dp")) if mesh else (0, 1)
    plain, batch, floor, generator = build(config, 0 if fault == "shard" else coordinate[0], coordinate[1])
    torch.manual_seed(config.seed)  # the same default generator on every rank (tensor parallelism checks it)
    size = sum(p.numel() for p in plain.parameters())  # before wrapping: FSDP, TP and PP keep a part of each
    model = _wrap(plain.to(device), mesh, config)
    optimizer = model.make_optimizer(torch.optim.AdamW, lr=config.lr)
    if fault == "seed":  # what a loop without the wrapper's broadcast of rank 0's weights does
        model.module.load_state_dict(build(replace(config, seed=config.seed + 1))[0].state_dict())
    elif fault == "lr":
        for group in optimizer.param_groups:
            group["lr"] *= 10
    elif fault == "no-reduce":
        model.set_requires_gradient_sync(False)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.precision)
    scaler = precision.DynamicLossScaler(enabled=config.precision == "fp16")
    start = _resume(config, model, optimizer, generator, scaler)
    replicas = mesh.size("dp") if mesh else 1
    log = _rank_log(config, mesh)
    replicated = (config.zero if config.three_d else {"zero1": 1, "zero2": 2, "fsdp": 3}.get(config.strategy, 0)) < 3
    watch = monitor.TrainingMonitor(config.tensorboard, config.alarm_every, mesh.group("dp") if mesh else None,
                                    replicated, ranks=config.tensorboard_ranks)
    tokens = config.batch_size * (config.gpt_config().block_size if config.model == "tiny-gpt" else 1)
    flops = report.model_flops(config) / ((config.tp or 1) * (config.pp or 1) * (config.cp or 1))  # this rank's
    if dist.is_main():
        layout = (f"dp={config.dp} x tp={config.tp} x pp={config.pp}"
                  + (f" x cp={config.cp} ({config.cp_strategy}, {config.cp_split})" if config.cp > 1 else "")
                  + (f", experts over ep={config.ep}" if config.ep > 1 else "")
                  + f", {DP_WRAPPERS[config.zero]} over dp, "
                  f"{config.schedule} with {config.microbatches} micro-batch{'es' if config.microbatches > 1 else ''}"
                  if config.three_d
                  else config.strategy)
        low_precision = "" if config.precision == "fp32" else f" in {config.precision}"
        print(f"labkit.train: {layout} on {world} rank(s) ({dist.backend() or 'no process group'}, {device})"
              f"{low_precision}; {config.model} {size:,} parameters; global batch {config.batch_size * replicas}"
              + (f"; loss floor {floor:.3f} nats" if floor is not None else ""), flush=True)
    history: list[float] = []
    spans: list[trace.Span] | None = None
    began = time.perf_counter()
    for step in range(start + 1, config.steps + 1):
        _maybe_killed(step)
        fetched, working = time.perf_counter(), time.thread_time()  # wall clock; this thread's CPU time
        inputs, targets = (tensor.to(device, non_blocking=True) for tensor in batch(step))  # overlaps if pinned
        data_wait = time.perf_counter() - fetched
        inputs, targets = monitor.corrupt(fault, step, inputs, targets)  # LABKIT_TRAIN_FAULT: data, nan, slow
        traced = config.trace is not None and step == config.steps
        if traced:
            trace.enable(coords=mesh.coords() if mesh else None)
        optimizer.zero_grad(set_to_none=True)
        with precision.autocast(device, low) if low is not None else contextlib.nullcontext():
            loss = model.forward_backward(inputs, targets, loss_scale=scaler.get_scale())
        if scaler.is_enabled():
            scaler.unscale_(optimizer)
        grad_norm = math.nan
        if config.clip_grad_norm is not None or watch.log is not None or watch.checks(step):
            grad_norm = model.clip_grad_norm_(config.clip_grad_norm or math.inf).item()  # the norm before clipping
        with trace.span("optimizer step", "compute") if traced else contextlib.nullcontext():
            scaler.step(optimizer)
            scaler.update()
        if config.bias_update_rate:  # DeepSeek-V3's balancing, from the step's load over the data-parallel ranks
            balance_experts(model.module, config.bias_update_rate, mesh.group("dp_cp") if mesh else None)
        if traced:
            spans = _write_trace(config.trace)
        history.append(loss.item())
        alarms = watch.record(step, model.module, loss=history[-1], lr=optimizer.param_groups[0]["lr"],
                              grad_norm=grad_norm, step_s=time.perf_counter() - fetched, data_wait_s=data_wait,
                              busy_s=time.thread_time() - working, flops=flops,
                              comm_bytes=sum(model.communication_per_step().values()), tokens=tokens)
        for alarm in alarms:
            if dist.is_main():
                print(f"labkit.train: ALARM {alarm.message}", flush=True)
            if log is not None:
                log.write(f"ALARM {alarm.message}\n")
        if log is not None:
            log.write(f"step {step} loss {history[-1]:.6f} {1e3 * (time.perf_counter() - began) / len(history):.1f} "
                      "ms/step\n")
            log.flush()
        if step % config.log_every == 0 or step == config.steps:
            report.log_progress(step, start, config, loss.detach(), floor, time.perf_counter() - began,
                                model.communication_per_step(), report.moe_summary(model.module))
        if config.checkpoint_dir and (step == config.steps or (config.save_every and step % config.save_every == 0)):
            saved = checkpoint.save(checkpoint.step_directory(config.checkpoint_dir, step), model, optimizer, step,
                                    generators={"data": generator}, extra={"config": asdict(config)},
                                    layout=config.checkpoint_layout,
                                    scaler=scaler if scaler.is_enabled() else None)
            if dist.is_main():
                who = "rank 0 writes" if config.checkpoint_layout == "full" else "every rank writes its shard"
                print(f"checkpoint saved to {saved} ({who})", flush=True)
    seconds = time.perf_counter() - began
    full = model.full_state_dict()  # collective: every rank takes part
    checksum = float(sum(tensor.detach().double().sum() for name, tensor in full.items()
                         if name in dict(plain.named_parameters())))
    if log is not None:
        log.close()
    watch.close()
    if isinstance(batch, loader.StepLoader):
        batch.close()
    return {"rank": dist.rank(), "losses": history, "ms_per_step": 1e3 * seconds / max(1, len(history)),
            "communication": model.communication_per_step(), "memory": model.memory_breakdown(),
            "checksum": checksum, "coords": mesh.coords() if mesh else {"pp": 0, "dp": 0, "cp": 0, "tp": 0},
            "local_rank": dist.local_rank(), "node": int(os.environ.get("GROUP_RANK", "0")),
            "trace": spans,  # --trace: every rank's spans of the last step, on rank 0
            "alarms": [alarm.message for alarm in watch.alarms]}


def _fault(config: TrainConfig) -> str | None:
    """The misconfiguration ``LABKIT_TRAIN_FAULT`` asks of this rank (:data:`labkit.monitor.FAULTS`; checked with
    the flags, before any process starts), if any."""
    found = monitor.fault_from_environment()
    if found is None:
        return None
    kind, rank = found
    return kind if rank is None or rank == dist.rank() else None


def _rank_log(config: TrainConfig, mesh: Mesh | None) -> Any:
    """``--log-dir``: this rank's own file, opened for appending (a resumed run goes on in the same file)."""
    if config.log_dir is None:
        return None
    Path(config.log_dir).mkdir(parents=True, exist_ok=True)
    log = open(Path(config.log_dir) / f"rank-{dist.rank()}.log", "a")  # noqa: SIM115 (closed at the end of train)
    where = ", ".join(f"{dim}={index}" for dim, index in mesh.coords().items()) if mesh else "alone"
    node = os.environ.get("GROUP_RANK", "0")  # torchrun's node rank (--node_rank)
    log.write(f"# rank {dist.rank()} of {dist.world_size()} ({where}) on node {node} ({socket.gethostname()}), "
              f"local rank {dist.local_rank()}\n")
    return log


def _write_trace(path: str) -> list[trace.Span] | None:
    """Gather every rank's spans of the step just traced to rank 0, which writes them as a Chrome trace and
    returns them (``None`` elsewhere)."""
    spans = trace.gather()
    trace.disable()
    if dist.is_main():
        written = trace.write_chrome_trace(spans, path)
        print(f"trace of the last step ({len(spans)} spans, every rank) written to {written}: open it in "
              "ui.perfetto.dev or chrome://tracing", flush=True)
    return spans


def _resume(config: TrainConfig, model: ParallelWrapper, optimizer: torch.optim.Optimizer,
            generator: torch.Generator, scaler: precision.DynamicLossScaler) -> int:
    """Load ``--resume`` (or the newest checkpoint, for ``latest``); the step it reached (0: a fresh start)."""
    if config.resume is None:
        return 0
    path = checkpoint.latest(config.checkpoint_dir) if config.resume == "latest" else Path(config.resume)
    if path is None:
        if dist.is_main():
            print(f"labkit.train: no checkpoint in {config.checkpoint_dir} yet: starting from step 0", flush=True)
        return 0
    step = checkpoint.load(path, model, optimizer, generators={"data": generator},
                           scaler=scaler if scaler.is_enabled() else None).step
    if dist.is_main():
        print(f"labkit.train: resumed from {path} at step {step}", flush=True)
    return step


def _maybe_killed(step: int) -> None:
    """The fault injection of **When something goes wrong** (:mod:`labkit.train.report`): a bad flag, a layout that cannot work, a checkpoint
directory that cannot be written or has no room for a checkpoint, a ``--resume`` of another model or number of
ranks: one line and exit status 2, before any process starts (:mod:`labkit.train.config`).  A rank that fails:
one line naming it and its error, the traceback kept in a file (``--traceback`` prints it), exit status 1.
``SIGTERM`` or Ctrl-C: every rank stopped, the last checkpoint named, exit status 128 + the signal.  What a save
killed mid-write left (a temporary file of a dead process) is removed by the next run, which says so.

``LABKIT_TRAIN_KILL=RANK:STEP`` (first attempt only; see the module docstring)."""
    target = os.environ.get("LABKIT_TRAIN_KILL")
    if target and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        rank, _, at = target.partition(":")
        if int(rank) == dist.rank() and int(at) == step:
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    """``python -m labkit.train``: exit status 0 (trained), 1 (a rank failed, or the loss is NaN), 2 (bad flags:
    nothing started), 128 + the signal's number (stopped by ``SIGTERM``, or ``SIGINT``: Ctrl-C)."""
    try:
        config, nprocs = parse_arguments(argv)
    except ValueError as error:
        print(f"labkit.train: {error}", file=sys.stderr)
        return 2
    if config.checkpoint_dir is not None and dist.local_rank() == 0:  # one process per machine
        report.remove_stale_partial_files(config.checkpoint_dir)
    main_thread = threading.current_thread() is threading.main_thread()  # only it may set a signal handler
    previous = signal.signal(signal.SIGTERM, report.stop) if main_thread else None
    try:
        if config.strategy == "single" and not config.three_d and not dist.in_torchrun() and nprocs == 1:
            results = [train(config)]  # no process group
        else:
            results = launch.launch(train, config, nprocs=nprocs, timeout=None)
    except (report.Stopped, KeyboardInterrupt) as stop:
        signum = stop.signum if isinstance(stop, report.Stopped) else signal.SIGINT
        if dist.is_main():
            print(f"labkit.train: stopped by {signal.Signals(signum).name}"
                  f"{'' if dist.in_torchrun() else '; every rank was stopped'}{report.last_checkpoint(config)}",
                  file=sys.stderr, flush=True)
        return 128 + signum
    except Exception as error:  # noqa: BLE001 (every failure becomes one line, its traceback kept)
        print(report.failure(config, error), file=sys.stderr, flush=True)
        return 1
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    if not results[0]["losses"]:  # resumed at the last step: nothing left to train
        if dist.is_main():
            print(f"done: the checkpoint had reached step {config.steps} already; nothing to train")
        return 0
    if dist.is_main():
        final = [result["losses"][-1] for result in results]
        same = len({round(result["checksum"], 6) for result in results}) == 1
        print(f"done: final loss {sum(final) / len(final):.4f}; "
              f"{results[0]['ms_per_step']:.1f} ms/step; replicas identical: {'yes' if same else 'NO'}")
    return 0 if not math.isnan(results[0]["losses"][-1]) else 1

