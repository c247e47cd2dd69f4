"""What ``labkit.train`` does with the scalars and the alarm each step, and the faults it injects on purpose.

:class:`TrainingMonitor` writes each step's scalars (:data:`~labkit.monitor.scalars.TAGS`) to this rank's
TensorBoard run, or with ``ranks="summary"`` to rank 0's summary of every rank, and runs the divergence alarm
every ``alarm_every`` steps.  ``LABKIT_TRAIN_FAULT=KIND:RANK`` (:data:`FAULTS`) makes the trainer break one rank
the way real runs break, so that the alarm's tests and lesson 12 can watch it being caught.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn

from labkit import dist, loader
from labkit.costmodel.hardware import GPUS
from labkit.monitor.alarm import Alarm, DivergenceAlarm, parameter_fingerprint
from labkit.monitor.scalars import RankLog, SummaryLog

LOG_RANKS = ("every", "summary")


def gpu_peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of this GPU (:data:`labkit.costmodel.hardware.GPUS`, by its model's name: "H100" in
    "NVIDIA H100 80GB HBM3"), the peak MFU is quoted against; ``None`` off a GPU or for a GPU not in the table."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((gpu.peak_bf16_flops for key, gpu in GPUS.items() if key.split()[0] in name), None)


class TrainingMonitor:
    """``labkit.train``'s monitoring: each step's scalars to TensorBoard (``tensorboard``: the folder, or ``None``;
    ``ranks``: ``"every"`` rank its own run, or ``"summary"``: rank 0's min, mean and max over every rank) and, every
    ``alarm_every`` steps (0: never), the divergence alarm over ``group`` (the data-parallel ranks).
    ``replicated``: every rank of ``group`` holds the same parameters (DDP, ZeRO-1/2), so their fingerprints are
    compared too."""

    def __init__(self, tensorboard: str | Path | None, alarm_every: int, group: Any, replicated: bool,
                 ranks: str = "every"):
        if ranks not in LOG_RANKS:
            raise ValueError(f"ranks must be one of {LOG_RANKS}, got {ranks!r}")
        self.log = None if tensorboard is None else RankLog(tensorboard) if ranks == "every" else \
            SummaryLog(tensorboard)
        several = torch_dist.is_initialized() and torch_dist.get_world_size(group) > 1
        self.alarm = DivergenceAlarm(group, every=alarm_every) if alarm_every and several else None
        self.replicated = replicated
        self.alarms: list[Alarm] = []
        self.peak = gpu_peak_flops(dist.device())

    def checks(self, step: int) -> bool:
        """Whether the alarm compares the ranks at ``step`` (the trainer computes the gradient norm only then, or
        when it logs or clips)."""
        return self.alarm is not None and step % self.alarm.every == 0

    def record(self, step: int, module: nn.Module, *, loss: float, lr: float, grad_norm: float, step_s: float,
               busy_s: float, data_wait_s: float, comm_bytes: int, tokens: int, flops: float) -> list[Alarm]:
        """Write step ``step``'s scalars (``busy_s``: this rank's own work in the step, ``flops``: the model FLOPs
        it computed) and run the alarm (collective over the group on the steps it checks); return the new alarms,
        the same on every rank of the group."""
        if self.log is not None:
            values = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens / step_s,
                      "step_ms": 1e3 * step_s, "busy_ms": 1e3 * busy_s, "data_wait_ms": 1e3 * data_wait_s,
                      "comm_bytes": comm_bytes, "tflops": flops / step_s / 1e12}
            if torch.cuda.is_available() and dist.device().type == "cuda":
                values["peak_memory_bytes"] = torch.cuda.max_memory_allocated(dist.device())
                values["memory_reserved_bytes"] = torch.cuda.memory_reserved(dist.device())
                values["mfu"] = flops / step_s / self.peak if self.peak else math.nan
            self.log.scalars(step, values)
        if self.alarm is None:
            return []
        fingerprint = parameter_fingerprint(module) if self.replicated and step % self.alarm.every == 0 else None
        found = self.alarm.observe(step, loss, grad_norm, fingerprint, busy_s)
        for alarm in found:
            if self.log is not None:
                self.log.alarm(alarm)
        self.alarms += found
        return found

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


# --------------------------------------------------------------------------------------------------------
# Faults injected on purpose

FAULT_VARIABLE = "LABKIT_TRAIN_FAULT"
NAN_STEP = 3  # the step at which "nan" corrupts one rank's batch
SLOW_S = 0.03  # the extra work a "slow" rank does every step
FAULTS = {
    "seed": "this rank's replica re-initialised from another seed after the wrapper's broadcast",
    "lr": "this rank's optimizer with ten times the learning rate",
    "shard": "this rank draws data-parallel rank 0's batches (a sampler that ignores its rank)",
    "data": "this rank's targets rolled by one position in each batch (a data bug on one rank)",
    "no-reduce": "no rank reduces its gradients (a data-parallel group that skips its all-reduce)",
    "nan": f"one sample of this rank's batch at step {NAN_STEP} holds an infinite feature (a corrupt record)",
    "slow": f"this rank does {1e3 * SLOW_S:g} ms more work every step (a slower device: a straggler)",
}


def fault_from_environment() -> tuple[str, int | None] | None:
    """``LABKIT_TRAIN_FAULT=KIND:RANK`` (``no-reduce``: every rank, no rank given): the misconfiguration that
    ``labkit.train`` injects on purpose, for the alarm's tests and lesson (:data:`FAULTS`); ``None`` when unset."""
    value = os.environ.get(FAULT_VARIABLE, "").strip()
    if not value:
        return None
    kind, _, rank = value.partition(":")
    if kind not in FAULTS:
        raise ValueError(f"{FAULT_VARIABLE}={value!r}: the kind must be one of {', '.join(FAULTS)}")
    if kind == "no-reduce":
        if rank:
            raise ValueError(f"{FAULT_VARIABLE}={value!r}: no-reduce applies to every rank; give no rank")
        return kind, None
    if not rank.isdigit():
        raise ValueError(f"{FAULT_VARIABLE}={value!r}: give the rank, as {kind}:RANK")
    return kind, int(rank)


def corrupt(fault: str | None, step: int, inputs: torch.Tensor, targets: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of ``step`` as the fault ``fault`` (this rank's, or ``None``) leaves it: ``data`` rolls the
    targets, ``nan`` writes an infinity into the first sample's features at :data:`NAN_STEP`, ``slow`` does
    :data:`SLOW_S` of extra work; the others touch no batch."""
    if fault == "data":
        targets = targets.roll(1, dims=-1)
    elif fault == "nan" and step == NAN_STEP:
        if not inputs.is_floating_point():
            raise ValueError("the nan fault writes an infinite feature: it needs a model fed features (tiny-mlp)")
        inputs = inputs.clone()
        inputs[0, 0] = math.inf
    elif fault == "slow":
        loader.burn(loader.work_units(SLOW_S))
    return inputs, targets
