"""Monitoring every rank: each rank's scalars in TensorBoard, and an alarm when one rank trains apart from the rest.

"Use centralized logging (like Weights & Biases or TensorBoard) to monitor the loss curves of all ranks.  If one
rank shows a different loss behavior, it is a clear indicator of a configuration error."  Two tools for that.

**Per-rank scalars** (:class:`RankLog`).  Each rank writes its own TensorBoard run, ``DIR/rank-R``, under the same
tags (:data:`TAGS`: loss, learning rate, gradient norm, tokens/s, step time, data-wait time, bytes sent per step
and, on a GPU, peak memory).  TensorBoard takes every sub-folder of the folder it is given for a run and draws one
curve per run on each tag's chart, so ``tensorboard --logdir DIR`` overlays every rank's loss on one chart.
:func:`read_scalars` reads the event files back with TensorBoard's own reader.  Writing is asynchronous (the
writer's thread), a few microseconds per scalar.

**The divergence alarm** (:class:`DivergenceAlarm`).  A chart catches what somebody looks at; the alarm compares the
ranks every ``every`` steps with one all-gather of three numbers per rank and names the rank, the step and the
reason.  What data-parallel replicas must agree on decides each test:

- *the gradient norm, to the bit*: after the all-reduce every replica holds the same averaged gradient (a ring or
  a tree all-reduce hands every rank the same bits), so every rank computes the same norm.  A rank whose norm
  differs did not take part in the reduction.
- *a parameter fingerprint, to the bit* (the sum of every parameter's squares, in float64; only where the replicas
  hold whole copies: not under FSDP/ZeRO-3): replicas that start equal and apply equal updates stay equal.  A
  rank initialised from another seed differs from the first check, one with another learning rate from its first
  update.
- *the loss, within the data-parallel spread*: each rank measures its loss on its own batch, so the ranks disagree
  by the batch-to-batch noise, and only that.  Each check, every rank's deviation from the mean loss of the other
  ranks is kept, for the last ``history`` checks (judged from ``history // 2`` on).  The noise ``sigma`` of one
  deviation comes from how much deviations change from one check to the next (von Neumann's mean square
  successive difference, halved: a rank's steady offset, however large, does not enlarge it); a rank whose mean
  deviation over the last ``window`` checks exceeds ``z`` standard errors, ``z sigma / sqrt(window)``, trains
  apart from the rest, and the furthest such rank is named (with two ranks, both: which one left cannot be
  told).  This test needs no replicas (it works under FSDP and for tensor-parallel shards) and catches what the
  others cannot see: a model that is the same everywhere but fed differently on one rank.
- *losses equal to the bit* on two ranks for ``repeats`` checks running: two ranks reading the same batches (the
  same shard; a sampler that ignores its rank).  Different batches give equal float losses essentially never.

Each alarm is raised once per reason and set of ranks; every rank gets the same list (the all-gather is
collective), and the trainer prints it on rank 0 and writes it to each rank's TensorBoard run as text.
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import statistics
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn

from labkit import dist

TAGS = ("loss", "lr", "grad_norm", "tokens_per_s", "step_ms", "data_wait_ms", "comm_bytes", "peak_memory_bytes")


def rank_directory(directory: str | Path, rank: int) -> Path:
    """The TensorBoard run of ``rank`` inside ``directory``: one sub-folder per rank, so their curves overlay."""
    return Path(directory) / f"rank-{rank}"


class RankLog:
    """This rank's TensorBoard run: :meth:`scalars` writes the step's values under ``train/<tag>``, :meth:`alarm`
    a divergence alarm as text under ``alarm`` (and as the scalar ``alarm/<kind>`` = 1, a mark on the charts)."""

    def __init__(self, directory: str | Path, rank: int | None = None, flush_secs: float = 5.0):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:  # tensorboard is a dependency of labkit; a stripped environment may lack it
            raise ImportError("--tensorboard needs the tensorboard package: pip install tensorboard") from error
        self.rank = dist.rank() if rank is None else rank
        self.path = rank_directory(directory, self.rank)
        self.writer = SummaryWriter(log_dir=str(self.path), flush_secs=flush_secs)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        unknown = set(values) - set(TAGS)
        if unknown:
            raise ValueError(f"unknown scalar tag(s) {sorted(unknown)}; the tags are {TAGS}")
        for tag, value in values.items():
            self.writer.add_scalar(f"train/{tag}", float(value), step)

    def alarm(self, alarm: Alarm) -> None:
        self.writer.add_text("alarm", alarm.message, alarm.step)
        self.writer.add_scalar(f"alarm/{alarm.kind}", 1.0, alarm.step)

    def close(self) -> None:
        self.writer.close()


def read_scalars(directory: str | Path) -> dict[int, dict[str, list[tuple[int, float]]]]:
    """Every rank's scalars under ``directory`` (as :class:`RankLog` wrote them): ``{rank: {tag: [(step, value),
    ...]}}``, read with TensorBoard's own event reader; tags without their ``train/`` prefix."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[int, dict[str, list[tuple[int, float]]]] = {}
    for run in sorted(Path(directory).glob("rank-*")):
        events = EventAccumulator(str(run), size_guidance={"scalars": 0})  # 0: keep every point
        events.Reload()
        rank = int(run.name.removeprefix("rank-"))
        found[rank] = {tag.removeprefix("train/"): [(event.step, event.value) for event in events.Scalars(tag)]
                       for tag in events.Tags()["scalars"]}
    return found


@dataclass(frozen=True)
class Alarm:
    step: int
    kind: str  # "grad_norm", "parameters", "loss" or "same_batches"
    ranks: tuple[int, ...]
    message: str


def parameter_fingerprint(module: nn.Module) -> float:
    """The sum of every parameter's squares, in float64: equal on replicas that hold the same values (to the bit),
    and moved by any update (no sign cancels it).  An expert-parallel rank's own experts are left out: the data-
    parallel ranks hold different ones."""
    with torch.no_grad():
        return float(sum(parameter.detach().double().square().sum() for parameter in module.parameters()
                         if not getattr(parameter, "expert_parallel", False)))


class DivergenceAlarm:
    """Compare the ranks of ``group`` (default: every rank) each ``every`` steps; see the module docstring.

    ``observe(step, loss, grad_norm, fingerprint)`` is collective over ``group`` on the steps it checks and
    returns the new alarms (the same on every rank); pass ``fingerprint=None`` where replicas are sharded.
    :meth:`judge` is the rule alone, on the gathered numbers, without a process group."""

    def __init__(self, group: Any = None, every: int = 1, window: int = 16, history: int = 64, z: float = 5.0,
                 repeats: int = 2):
        for name, value in (("every", every), ("window", window), ("history", history), ("repeats", repeats)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 2 <= window <= history:
            raise ValueError(f"window must be at least 2 checks and at most history ({history}), got {window}")
        if not z > 0:
            raise ValueError(f"z must be positive, got {z!r}")
        self.group, self.every, self.window, self.history, self.z = group, every, window, history, z
        self.repeats = repeats
        self.deviations: deque[list[float]] = deque(maxlen=history)
        self.equal_runs: dict[tuple[int, int], int] = {}
        self.raised: set[tuple[str, tuple[int, ...]]] = set()

    def observe(self, step: int, loss: float, grad_norm: float, fingerprint: float | None = None) -> list[Alarm]:
        if step % self.every:
            return []
        mine = torch.tensor([loss, grad_norm, math.nan if fingerprint is None else fingerprint], dtype=torch.float64,
                            device=dist.device())
        size = torch_dist.get_world_size(self.group)
        gathered = [torch.empty_like(mine) for _ in range(size)]
        torch_dist.all_gather(gathered, mine, group=self.group)
        ranks = [dist.global_rank(self.group, index) for index in range(size)]
        rows = [row.tolist() for row in gathered]
        return self.judge(step, ranks, [row[0] for row in rows], [row[1] for row in rows], [row[2] for row in rows])

    def judge(self, step: int, ranks: list[int], losses: list[float], grad_norms: list[float],
              fingerprints: list[float]) -> list[Alarm]:
        """The alarms of one check, given every rank's numbers (NaN fingerprints: not compared)."""
        alarms = [*self._exact("grad_norm", step, ranks, grad_norms, "gradient norm",
                               "a rank that did not take part in the gradient reduction"),
                  *self._exact("parameters", step, ranks, fingerprints, "parameter fingerprint",
                               "a replica apart: another initialisation, learning rate or a missed reduction")]
        alarms += self._same_batches(step, ranks, losses)
        alarms += self._loss_band(step, ranks, losses)
        return alarms

    def _raise(self, kind: str, step: int, ranks: tuple[int, ...], message: str) -> list[Alarm]:
        if (kind, ranks) in self.raised:
            return []
        self.raised.add((kind, ranks))
        return [Alarm(step, kind, ranks, f"step {step}: {message}")]

    def _exact(self, kind: str, step: int, ranks: list[int], values: list[float], what: str,
               why: str) -> list[Alarm]:
        if any(math.isnan(value) for value in values) or len(set(values)) == 1:
            return []
        common, held_by = collections.Counter(values).most_common(1)[0]
        shown = ", ".join(f"rank {rank} {value!r}" for rank, value in zip(ranks, values, strict=True))
        if 2 * held_by <= len(values):  # no majority (two ranks, say): which one left cannot be told
            return self._raise(kind, step, tuple(ranks), f"the ranks disagree on the {what} ({shown}); {why}")
        odd = tuple(rank for rank, value in zip(ranks, values, strict=True) if value != common)
        names = ", ".join(f"rank {rank}" for rank in odd)
        return self._raise(kind, step, odd, f"{names}: {what} differs from the other ranks' ({shown}); {why}")

    def _same_batches(self, step: int, ranks: list[int], losses: list[float]) -> list[Alarm]:
        alarms = []
        for first in range(len(ranks)):
            for second in range(first + 1, len(ranks)):
                pair = (ranks[first], ranks[second])
                equal = losses[first] == losses[second]
                self.equal_runs[pair] = self.equal_runs.get(pair, 0) + 1 if equal else 0
                if self.equal_runs[pair] >= self.repeats:
                    alarms += self._raise("same_batches", step, pair,
                                          f"ranks {pair[0]} and {pair[1]} report the same loss, to the bit, "
                                          f"{self.equal_runs[pair]} checks running ({losses[first]:.6g}): they "
                                          "read the same batches (the same shard, or a sampler without its rank)")
        return alarms

    def loss_band(self) -> tuple[float, float] | None:
        """``(sigma, limit)``: the noise of one check's deviation and the band a rank's mean deviation over the last
        ``window`` checks may not leave; ``None`` while too few checks are kept (or the deviations never change)."""
        if len(self.deviations) < max(self.window, self.history // 2):  # too few checks to know the noise by
            return None
        rows = list(self.deviations)
        squares = [(now - before) ** 2 for previous, current in itertools.pairwise(rows)
                   for before, now in zip(previous, current, strict=True)]
        sigma = math.sqrt(statistics.fmean(squares) / 2)
        if sigma == 0:  # nothing to measure a spread by
            return None
        return sigma, self.z * sigma / math.sqrt(self.window)

    def _loss_band(self, step: int, ranks: list[int], losses: list[float]) -> list[Alarm]:
        broken = tuple(rank for rank, loss in zip(ranks, losses, strict=True) if not math.isfinite(loss))
        if broken:
            names = ", ".join(f"rank {rank}" for rank in broken)
            return self._raise("loss", step, broken, f"{names}: the loss is not finite "
                               f"({', '.join(f'rank {rank} {loss}' for rank, loss in zip(ranks, losses, strict=True))})")
        if len(ranks) < 2:
            return []
        total = sum(losses)
        self.deviations.append([loss - (total - loss) / (len(losses) - 1) for loss in losses])  # minus the others' mean
        band = self.loss_band()
        if band is None:
            return []
        sigma, limit = band
        rows = list(self.deviations)
        means = [statistics.fmean(row[index] for row in rows[-self.window:]) for index in range(len(ranks))]
        furthest = max(range(len(ranks)), key=lambda index: abs(means[index]))
        if abs(means[furthest]) <= limit:
            return []
        # The others' mean carries 1/(n-1) of the furthest rank's offset into every other deviation, so with three
        # ranks a healthy one can cross the band too: name the furthest alone (with two, both are as far).
        odd = (ranks[furthest],) if len(ranks) > 2 else tuple(ranks)
        shown = ", ".join(f"rank {rank} {mean:+.4f}" for rank, mean in zip(ranks, means, strict=True))
        names = " and ".join(f"rank {rank}" for rank in odd)
        return self._raise("loss", step, odd,
                           f"{names}: loss departs from the other ranks' mean by more than {self.z:g} standard "
                           f"errors ({limit:.4f}) over the last {self.window} checks (mean deviations: {shown}; "
                           f"noise of one check {sigma:.4f})")


# --------------------------------------------------------------------------------------------------------
# What labkit.train does with both, each step


class TrainingMonitor:
    """``labkit.train``'s monitoring: each step's scalars to this rank's TensorBoard run (``tensorboard``: the run
    folder, or ``None``) and, every ``alarm_every`` steps (0: never), the divergence alarm over ``group`` (the
    data-parallel ranks).  ``replicated``: every rank of ``group`` holds the same parameters (DDP, ZeRO-1/2), so
    their fingerprints are compared too."""

    def __init__(self, tensorboard: str | Path | None, alarm_every: int, group: Any, replicated: bool):
        self.log = RankLog(tensorboard) if tensorboard is not None else None
        several = torch_dist.is_initialized() and torch_dist.get_world_size(group) > 1
        self.alarm = DivergenceAlarm(group, every=alarm_every) if alarm_every and several else None
        self.replicated = replicated
        self.alarms: list[Alarm] = []

    def checks(self, step: int) -> bool:
        """Whether the alarm compares the ranks at ``step`` (the trainer computes the gradient norm only then, or
        when it logs or clips)."""
        return self.alarm is not None and step % self.alarm.every == 0

    def record(self, step: int, module: nn.Module, *, loss: float, lr: float, grad_norm: float, step_s: float,
               data_wait_s: float, comm_bytes: int, tokens: int) -> list[Alarm]:
        """Write step ``step``'s scalars and run the alarm (collective over the group on the steps it checks);
        return the new alarms, the same on every rank of the group."""
        if self.log is not None:
            values = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens / step_s,
                      "step_ms": 1e3 * step_s, "data_wait_ms": 1e3 * data_wait_s, "comm_bytes": comm_bytes}
            if torch.cuda.is_available() and dist.device().type == "cuda":
                values["peak_memory_bytes"] = torch.cuda.max_memory_allocated(dist.device())
            self.log.scalars(step, values)
        if self.alarm is None:
            return []
        fingerprint = parameter_fingerprint(module) if self.replicated and step % self.alarm.every == 0 else None
        found = self.alarm.observe(step, loss, grad_norm, fingerprint)
        for alarm in found:
            if self.log is not None:
                self.log.alarm(alarm)
        self.alarms += found
        return found

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


FAULT_VARIABLE = "LABKIT_TRAIN_FAULT"
FAULTS = {
    "seed": "this rank's replica re-initialised from another seed after the wrapper's broadcast",
    "lr": "this rank's optimizer with ten times the learning rate",
    "shard": "this rank draws data-parallel rank 0's batches (a sampler that ignores its rank)",
    "data": "this rank's targets rolled by one position in each batch (a data bug on one rank)",
    "no-reduce": "no rank reduces its gradients (a data-parallel group that skips its all-reduce)",
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
