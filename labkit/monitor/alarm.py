"""The divergence alarm: compare the data-parallel ranks every few steps and name the one that trains apart.

A chart catches what somebody looks at; :class:`DivergenceAlarm` compares the ranks every ``every`` steps with one
all-gather of four numbers per rank and names the rank, the step and the reason.  What data-parallel replicas must
agree on decides each test:

- *the gradient norm, to the bit*: after the all-reduce every replica holds the same averaged gradient (a ring or a
  tree all-reduce hands every rank the same bits), so every rank computes the same norm.  A rank whose norm differs
  did not take part in the reduction.
- *a parameter fingerprint, to the bit* (:func:`parameter_fingerprint`, the sum of every parameter's squares in
  float64; only where the replicas hold whole copies: not under FSDP/ZeRO-3): replicas that start equal and apply
  equal updates stay equal.  Megatron-LM checks the same at scale with a hash per parameter
  (``--check-weight-hash-across-dp-replicas-interval``: Megatron-Core's ``check_param_hashes_across_dp_replicas``
  all-gathers SHA hashes computed on the CPU and compares them with replica 0's, too dear for every step); one sum
  costs a pass over the weights and 8 bytes on the wire.
- *the loss, within the data-parallel spread* (:func:`deviations`, :func:`loss_band`, :func:`departed`): each rank
  measures its loss on its own batch, so the ranks disagree by the batch-to-batch noise, and only that.  Each
  check, every rank's deviation from the mean loss of the *other* ranks is kept, for the last ``history`` checks
  (judged from ``history // 2`` on).  The noise ``sigma`` of one deviation comes from how much deviations change
  from one check to the next (von Neumann's mean square successive difference, halved: a rank's steady offset,
  however large, does not enlarge it); a rank whose mean deviation over the last ``window`` checks exceeds ``z``
  standard errors, ``z sigma / sqrt(window)``, trains apart from the rest, and the furthest such rank is named
  (with two ranks, both: which one left cannot be told).  This test needs no replicas (it works under FSDP and for
  tensor-parallel shards) and catches what the others cannot see: a model that is the same everywhere but fed
  differently on one rank.  A loss that is not finite is named at once, on the rank where it appears.
- *losses equal to the bit* on two ranks for ``repeats`` checks running: two ranks reading the same batches (the
  same shard; a sampler that ignores its rank).  Different batches give equal float losses essentially never.
- *a straggler* (:func:`stragglers`): in synchronous training every rank waits for the slowest in each collective,
  so their wall-clock step times are equal and cannot name it.  What differs is each rank's *own* time, the work it
  did in the step (here the CPU time of its training thread, to which a wait in a collective adds nothing, nor do
  gloo's or TensorBoard's own threads): a rank whose own time exceeds ``straggler_ratio`` times the median of the
  ranks' for ``straggler_checks`` checks running is named, as Megatron-LM's straggler detector (``--log-straggler``)
  reports the ranks of lowest and highest throughput, timing each rank's own GPU work.  On a GPU the CPU time counts
  kernel launches and a spinning wait, not the kernels: there, time the compute with CUDA events.

Each alarm is raised once per reason and set of ranks; every rank gets the same list (the all-gather is collective).
"""

from __future__ import annotations

import collections
import itertools
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn

from labkit import dist


@dataclass(frozen=True)
class Alarm:
    step: int
    kind: str  # "grad_norm", "parameters", "loss", "same_batches" or "straggler"
    ranks: tuple[int, ...]
    message: str


def parameter_fingerprint(module: nn.Module) -> float:
    """The sum of every parameter's squares, in float64: equal on replicas that hold the same values (to the bit),
    and moved by any update (no sign cancels it).  An expert-parallel rank's own experts are left out: the data-
    parallel ranks hold different ones."""
    with torch.no_grad():
        return float(sum(parameter.detach().double().square().sum() for parameter in module.parameters()
                         if not getattr(parameter, "expert_parallel", False)))


# --------------------------------------------------------------------------------------------------------
# The loss test's rule, on plain numbers (lesson 12's first exercise writes these three)


def deviations(losses: Sequence[float]) -> list[float]:
    """One check: each rank's loss minus the mean of the *other* ranks' losses (at least two ranks).  Against the
    others' mean, not everybody's: a rank's own loss would pull the mean towards itself."""
    if len(losses) < 2:
        raise ValueError(f"need the losses of at least two ranks, got {len(losses)}")
    total = sum(losses)
    return [loss - (total - loss) / (len(losses) - 1) for loss in losses]


def loss_band(rows: Sequence[Sequence[float]], window: int, z: float) -> tuple[float, float] | None:
    """``(sigma, limit)`` from the kept deviations (``rows``: one row per check, oldest first, one column per rank):
    ``sigma`` the noise of one check's deviation, from the squared changes between consecutive checks of every rank
    (their mean, halved: von Neumann), and ``limit = z sigma / sqrt(window)``, the band a rank's mean over the last
    ``window`` checks may not leave.  ``None`` when nothing changes (no noise to measure a band by)."""
    kept = list(rows)
    if len(kept) < 2:
        raise ValueError(f"need at least two checks to see the deviations change, got {len(kept)}")
    squares = [(now - before) ** 2 for previous, current in itertools.pairwise(kept)
               for before, now in zip(previous, current, strict=True)]
    sigma = math.sqrt(statistics.fmean(squares) / 2)
    if sigma == 0:
        return None
    return sigma, z * sigma / math.sqrt(window)


def departed(rows: Sequence[Sequence[float]], window: int, limit: float) -> tuple[int, ...]:
    """The columns (ranks) the alarm names: each rank's mean deviation over the last ``window`` rows; if the one
    furthest from 0 lies beyond ``+-limit``, that rank alone, or with two ranks both (their deviations are mirror
    images); else none.  The furthest alone: the others' mean carries a third of a departing rank's offset into
    every other deviation (with four ranks), so healthy ranks may cross the band too."""
    recent = list(rows)[-window:]
    if not recent or len(recent[0]) < 2:
        raise ValueError(f"need at least one check of at least two ranks, got {len(recent)} check(s)")
    ranks = len(recent[0])
    means = [statistics.fmean(row[index] for row in recent) for index in range(ranks)]
    furthest = max(range(ranks), key=lambda index: abs(means[index]))
    if abs(means[furthest]) <= limit:
        return ()
    return (furthest,) if ranks > 2 else tuple(range(ranks))


def stragglers(own_times: Sequence[Sequence[float]], ratio: float) -> tuple[int, ...]:
    """The ranks whose own time exceeds ``ratio`` times the median rank's in *every* row of ``own_times`` (one row
    per check, one column per rank): a rank slow once is noise, slow every check a straggler."""
    rows = list(own_times)
    slow = [{index for index, value in enumerate(row) if value > ratio * statistics.median(row)} for row in rows]
    return tuple(sorted(set.intersection(*slow))) if slow else ()


# --------------------------------------------------------------------------------------------------------
# The alarm


class DivergenceAlarm:
    """Compare the ranks of ``group`` (default: every rank) each ``every`` steps; see the module docstring.

    ``observe(step, loss, grad_norm, fingerprint, own_s)`` is collective over ``group`` on the steps it checks and
    returns the new alarms (the same on every rank); pass ``fingerprint=None`` where replicas are sharded and
    ``own_s=None`` where this rank's own time is not measured.  :meth:`judge` is the rule alone, on the gathered
    numbers, without a process group."""

    def __init__(self, group: Any = None, every: int = 1, window: int = 16, history: int = 64, z: float = 5.0,
                 repeats: int = 2, straggler_ratio: float = 1.5, straggler_checks: int = 8):
        for name, value in (("every", every), ("window", window), ("history", history), ("repeats", repeats),
                            ("straggler_checks", straggler_checks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 2 <= window <= history:
            raise ValueError(f"window must be at least 2 checks and at most history ({history}), got {window}")
        if not z > 0:
            raise ValueError(f"z must be positive, got {z!r}")
        if not straggler_ratio > 1:
            raise ValueError(f"straggler_ratio must be above 1 (a multiple of the median rank's time), got "
                             f"{straggler_ratio!r}")
        self.group, self.every, self.window, self.history, self.z = group, every, window, history, z
        self.repeats, self.straggler_ratio = repeats, straggler_ratio
        self.deviations: deque[list[float]] = deque(maxlen=history)
        self.own_times: deque[list[float]] = deque(maxlen=straggler_checks)
        self.equal_runs: dict[tuple[int, int], int] = {}
        self.raised: set[tuple[str, tuple[int, ...]]] = set()

    def observe(self, step: int, loss: float, grad_norm: float, fingerprint: float | None = None,
                own_s: float | None = None) -> list[Alarm]:
        if step % self.every:
            return []
        mine = torch.tensor([loss, grad_norm, math.nan if fingerprint is None else fingerprint,
                             math.nan if own_s is None else own_s], dtype=torch.float64, device=dist.device())
        size = torch_dist.get_world_size(self.group)
        gathered = [torch.empty_like(mine) for _ in range(size)]
        torch_dist.all_gather(gathered, mine, group=self.group)
        ranks = [dist.global_rank(self.group, index) for index in range(size)]
        columns = list(zip(*(row.tolist() for row in gathered), strict=True))
        return self.judge(step, ranks, *(list(column) for column in columns))

    def judge(self, step: int, ranks: list[int], losses: list[float], grad_norms: list[float],
              fingerprints: list[float], own_times: list[float] | None = None) -> list[Alarm]:
        """The alarms of one check, given every rank's numbers (NaN fingerprints or own times: not compared)."""
        alarms = [*self._exact("grad_norm", step, ranks, grad_norms, "gradient norm",
                               "a rank that did not take part in the gradient reduction"),
                  *self._exact("parameters", step, ranks, fingerprints, "parameter fingerprint",
                               "a replica apart: another initialisation, learning rate or a missed reduction")]
        alarms += self._same_batches(step, ranks, losses)
        alarms += self._loss_band(step, ranks, losses)
        alarms += self._stragglers(step, ranks, own_times)
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
        """``(sigma, limit)`` of the deviations kept (:func:`loss_band`); ``None`` while too few checks are kept to
        know the noise by (``history // 2``), or the deviations never change."""
        if len(self.deviations) < max(self.window, self.history // 2):
            return None
        return loss_band(self.deviations, self.window, self.z)

    def _loss_band(self, step: int, ranks: list[int], losses: list[float]) -> list[Alarm]:
        broken = tuple(rank for rank, loss in zip(ranks, losses, strict=True) if not math.isfinite(loss))
        if broken:
            names = ", ".join(f"rank {rank}" for rank in broken)
            shown = ", ".join(f"rank {rank} {loss}" for rank, loss in zip(ranks, losses, strict=True))
            return self._raise("loss", step, broken, f"{names}: the loss is not finite ({shown})")
        if len(ranks) < 2:
            return []
        self.deviations.append(deviations(losses))
        band = self.loss_band()
        if band is None or not (named := departed(self.deviations, self.window, band[1])):
            return []
        sigma, limit = band
        recent = list(self.deviations)[-self.window:]
        means = [statistics.fmean(row[index] for row in recent) for index in range(len(ranks))]
        shown = ", ".join(f"rank {rank} {mean:+.4f}" for rank, mean in zip(ranks, means, strict=True))
        odd = tuple(ranks[index] for index in named)
        names = " and ".join(f"rank {rank}" for rank in odd)
        return self._raise("loss", step, odd,
                           f"{names}: loss departs from the other ranks' mean by more than {self.z:g} standard "
                           f"errors ({limit:.4f}) over the last {self.window} checks (mean deviations: {shown}; "
                           f"noise of one check {sigma:.4f})")

    def _stragglers(self, step: int, ranks: list[int], own_times: list[float] | None) -> list[Alarm]:
        if own_times is None or len(ranks) < 3 or any(math.isnan(value) for value in own_times):
            return []  # with two ranks the median is their mean: neither can be named
        self.own_times.append(list(own_times))
        if len(self.own_times) < (self.own_times.maxlen or 1):
            return []
        alarms = []
        for index in stragglers(self.own_times, self.straggler_ratio):
            mine = statistics.fmean(row[index] for row in self.own_times)
            median = statistics.fmean(statistics.median(row) for row in self.own_times)
            alarms += self._raise("straggler", step, (ranks[index],),
                                  f"rank {ranks[index]}: a straggler, every other rank waits for it (its own work "
                                  f"{mine / median:.2f}x the median rank's, {1e3 * mine:.1f} ms against "
                                  f"{1e3 * median:.1f} ms a step, {len(self.own_times)} checks running)")
        return alarms
