"""A parameter server from point-to-point messages: synchronous, asynchronous, stale synchronous parallel,
bounded-delay and backup-worker training (lesson 08).

**Roles.**  One launch, one process group: rank 0 of ``group`` is the *server*, which holds the weights; the
other ``N`` ranks are *workers*.  A worker receives the weights with their *version* (how many updates the server
has applied), computes a gradient on its own batch, and sends it back with the version it was computed on; the
server decides when to apply it.  Everything travels as ``send``/``recv`` over the ordinary process group (gloo
or NCCL), not ``torch.distributed.rpc``: one message each way per gradient, ``[version, loss, step]`` followed by
the flat gradient (worker to server), ``[version]`` followed by the flat weights (server to worker; version ``-1``
tells the worker to stop).  The messages and the worker's loop are in :mod:`labkit.parallel.parameter_server.messages`.

**Sharded** (``servers=k``, Dean et al. 2012's Downpour): group ranks ``0 .. k-1`` are servers, the ``N = world -
k`` others workers.  The flat weights are cut into ``k`` contiguous shards of near-equal length (the first ``numel
% k`` one element longer; a shard may split a parameter); server ``i`` holds shard ``i`` and runs its own rule,
as one server does, on shard ``i`` of each gradient, with its own version and budget.  A worker pulls every shard,
sends each shard of its gradient to its server with the version it pulled from it, and trains until every server
has stopped it (on a stopped server's final shard meanwhile).  Shards update independently, so under async, ssp,
bounded_delay and backup a worker's shards may be of different versions and staleness is per shard; sync (and
``s = 0``, ``tau = 0``) make the same updates on every shard as one server.  Each server sends ``1/k`` of the bytes.

**The rule** (:class:`Gate`) decides, as each gradient arrives, which gradients to apply now (as one update) and
which workers to release (send the new weights).  A worker's *clock* is the number of gradients it has sent:

=============  ================================================================================================
mode           rule
=============  ================================================================================================
sync           hold every gradient until all ``N`` workers have sent theirs, then apply them together and release
               all: the same arithmetic as all-reduce data parallelism, and every worker waits for the slowest
async          apply each gradient on arrival and release its worker at once (Dean et al. 2012, Downpour SGD)
ssp            Stale Synchronous Parallel (Ho et al. 2013, "More Effective Distributed ML via a Stale Synchronous
               Parallel Parameter Server"): apply each gradient on arrival; a worker at clock ``c`` gets new
               weights only once the slowest worker's clock is ``>= c - s``, so no worker runs more than ``s``
               clocks ahead and its weights hold every gradient of clocks ``<= c - s - 1``.  The bound is on
               clocks, not staleness: the others' gradients still land while one is computed (with ``s = 0`` up
               to ``N - 1`` of them), and a persistent straggler sets everyone's pace once the others are ``s``
               clocks ahead.  ``s = 0`` makes sync's weights, one gradient per update
bounded_delay  a bound ``tau`` on staleness itself, counted in updates (the bounded delay of Li et al. 2014,
               "Scaling Distributed Machine Learning with the Parameter Server", applied to updates): hold what
               arrives, and apply everything held, as one update, unless that would leave a gradient still being
               computed more than ``tau`` updates stale; no applied gradient is ever staler than ``tau``, but
               clocks may drift apart without bound (with a persistent straggler the fast workers send more
               gradients than it, run after run).  ``tau = 0`` is sync, decision for decision; a large ``tau``
               is async
backup         ``N + b`` workers, the first ``N`` gradients of each version make the update; the ``b`` that arrive
               late are dropped and their workers get the new weights (Chen et al. 2016)
=============  ================================================================================================

**Staleness** of a gradient: the server's version when it is applied minus the version it was computed on: how
many updates landed in between.  Synchronous training has none; ``N`` equally fast asynchronous workers have
about ``N - 1``.  **Step size**: every applied gradient moves the weights by ``lr / N`` times itself (``N`` the
gradients a synchronous step averages), so ``N`` of them move the weights as far as one synchronous step of
their mean; with ``staleness_aware_lr`` a gradient of staleness ``k > 0`` moves them ``k`` times less (Zhang et
al. 2016, "Staleness-aware Async-SGD").

**Stragglers** (:class:`Stragglers`): a fixed extra time per step for chosen workers, and/or an exponentially
distributed delay on every step, drawn from a generator seeded per worker.  The server records every gradient it
receives (:class:`Received`): applied (with its staleness) or dropped (a backup's late gradient, or one that
arrives after the last update).  When the budget of updates is spent the server stops each worker at its next
message; it never waits for ever (``timeout_s`` without any message raises ``TimeoutError``, which ``launch``
reports as a failed rank; with ``k`` servers, :mod:`labkit.parallel.parameter_server.messages` says why none waits on another).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit.costmodel.collectives import chunk_bounds
from labkit.costmodel.stragglers import MODES
from labkit.dist import global_rank, require_group
from labkit.models import TinyGPT
from labkit.parallel.parameter_server.messages import STOP, Inbox, load, receive_shard, send_shard, work

__all__ = ["MODES", "STOP", "Decision", "Gate", "ParameterServerRun", "Received", "ShardRecord", "Stragglers",
           "run_parameter_server"]


@dataclass(frozen=True)
class Decision:
    """What the server does after a gradient arrives: ``apply`` and ``drop`` (workers whose gradients are applied
    now, as one update, or discarded), and ``release`` (workers sent the weights after it)."""

    apply: tuple[int, ...] = ()
    drop: tuple[int, ...] = ()
    release: tuple[int, ...] = ()


class Gate:
    """The server's rule for ``mode`` over ``workers`` workers (see the module docstring); pure bookkeeping.

    ``arrive(worker, pulled)`` is called when ``worker``'s gradient, computed on version ``pulled``, arrives;
    it returns a :class:`Decision`, and :attr:`version` counts the updates applied so far.  At the start every
    worker is computing on version 0.  :attr:`clocks` counts each worker's gradients that arrived (its clock, in
    Ho et al.'s terms); ``ssp`` bounds their spread, ``bounded_delay`` the staleness.
    """

    def __init__(self, mode: str, workers: int, staleness_bound: int | None = None, backup_workers: int = 0,
                 max_delay: int | None = None):
        check_arguments(mode, 1, 1.0, staleness_bound, backup_workers, workers, max_delay)
        self.mode, self.workers, self.staleness_bound = mode, workers, staleness_bound
        # the most updates a gradient may land behind (bounded_delay's tau; sync is tau = 0, async no bound)
        self.max_delay = {"sync": 0, "async": math.inf, "bounded_delay": max_delay}.get(mode)
        self.needed = workers - backup_workers  # gradients per synchronous update
        self.version = 0
        self.computing = dict.fromkeys(range(workers), 0)  # worker -> the version it is computing on
        self.held: list[tuple[int, int]] = []  # (worker, pulled): arrived, not applied yet
        self.clocks = [0] * workers  # gradients each worker has sent
        self.waiting: list[int] = []  # ssp: workers whose gradient is applied, held back by the clock bound

    def arrive(self, worker: int, pulled: int) -> Decision:
        del self.computing[worker]
        self.clocks[worker] += 1
        if self.mode == "ssp":  # apply on arrival; a worker c clocks in may go on once the slowest is at c - s
            self.version += 1
            self.waiting.append(worker)
            slowest = min(self.clocks)
            release = tuple(w for w in self.waiting if self.clocks[w] - slowest <= self.staleness_bound)
            self.waiting = [w for w in self.waiting if w not in release]
            self.computing.update(dict.fromkeys(release, self.version))
            return Decision(apply=(worker,), release=release)
        if self.mode == "backup":
            if pulled < self.version:  # late: this version's update was made without it
                self.computing[worker] = self.version
                return Decision(drop=(worker,), release=(worker,))
            self.held.append((worker, pulled))
            if len(self.held) < self.needed:
                return Decision()
            return self._apply_held()
        self.held.append((worker, pulled))
        # Applying now makes version + 1; a gradient still being computed on version v would then be at least
        # version + 1 - v stale when it arrives.
        oldest = min(self.computing.values(), default=None)
        if oldest is not None and self.version + 1 - oldest > self.max_delay:
            return Decision()
        return self._apply_held()

    def _apply_held(self) -> Decision:
        workers = tuple(worker for worker, _ in self.held)
        self.held.clear()
        self.version += 1
        for worker in workers:
            self.computing[worker] = self.version
        return Decision(apply=workers, release=workers)


@dataclass(frozen=True)
class Stragglers:
    """Delays added to workers' steps: ``slow`` maps a worker (0-based) to extra seconds on each of its steps;
    ``exponential_mean_s`` adds to every step a delay drawn from an exponential distribution of that mean
    (seeded by ``seed`` and the worker)."""

    slow: Mapping[int, float] = field(default_factory=dict)
    exponential_mean_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.exponential_mean_s < 0 or any(value < 0 for value in self.slow.values()):
            raise ValueError(f"straggler delays must be >= 0 seconds, got slow={dict(self.slow)}, "
                             f"exponential_mean_s={self.exponential_mean_s}")

    def generator(self, worker: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1009 + worker)

    def delay(self, worker: int, generator: torch.Generator) -> float:
        extra = self.slow.get(worker, 0.0)
        if self.exponential_mean_s > 0:
            extra += -self.exponential_mean_s * math.log(1.0 - torch.rand((), generator=generator).item())
        return extra


@dataclass(frozen=True)
class Received:
    """One gradient the server received: from ``worker`` (0-based), its ``step`` there, computed on version
    ``pulled``; ``applied`` is the version it was applied at (``None``: dropped); ``time_s`` when it was applied
    or dropped and ``arrived_s`` when it arrived (a held gradient waits in between), seconds since the start."""

    worker: int
    step: int
    pulled: int
    applied: int | None
    time_s: float
    loss: float
    arrived_s: float | None = None

    @property
    def staleness(self) -> int | None:
        return None if self.applied is None else self.applied - self.pulled


@dataclass
class ShardRecord:
    """What server ``server`` saw (``servers=k``): it held ``flat[start:stop]`` of the flat weights; every
    gradient received, in order, and the time of each update (seconds since its own start)."""

    server: int
    start: int
    stop: int
    received: list[Received]
    update_times_s: list[float]


@dataclass
class ParameterServerRun:
    """What the server saw: every gradient received, in order, the time of each update, and the final weights.
    With ``k`` servers: server 0's records, the full final weights, and in ``shards`` every server's record
    (``shards[0]`` is server 0's; with one server, its only record)."""

    mode: str
    workers: int
    received: list[Received]
    update_times_s: list[float]
    state: dict[str, torch.Tensor]
    shards: list[ShardRecord] = field(default_factory=list)

    @property
    def applied(self) -> list[Received]:
        return [r for r in self.received if r.applied is not None]

    def staleness(self) -> list[int]:
        return [r.staleness for r in self.applied]


def check_arguments(mode: Any, updates: Any, lr: Any, staleness_bound: Any, backup_workers: Any, workers: int,
                    max_delay: Any = None) -> None:
    """Raise ``ValueError`` naming the first argument of :func:`run_parameter_server` (or of its simulation)
    that no server can run with."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if isinstance(updates, bool) or not isinstance(updates, int) or updates < 1:
        raise ValueError(f"updates (the server's budget) must be an integer >= 1, got {updates!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"lr must be a number > 0, got {lr!r}")
    if workers < 1:
        raise ValueError("a parameter server needs at least 2 ranks: the server (rank 0) and a worker")
    for name, value, owner in (("staleness_bound", staleness_bound, "ssp"), ("max_delay", max_delay, "bounded_delay")):
        if (mode == owner) != (value is not None):
            raise ValueError(f"{name} belongs to mode={owner!r} (and it needs one), got mode={mode!r}, "
                             f"{name}={value!r}")
        if mode == owner and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if mode != "backup" and backup_workers:
        raise ValueError(f"backup_workers belongs to mode='backup', got mode={mode!r}, backup_workers={backup_workers}")
    if mode == "backup" and (isinstance(backup_workers, bool) or not isinstance(backup_workers, int)
                             or not 0 <= backup_workers < workers):
        raise ValueError(f"backup_workers must be an integer in [0, {workers}) with {workers} workers (the others "
                         f"make each update), got {backup_workers!r}")


def _default_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """TinyGPT's own loss; for any other model, the cross-entropy of its output against ``y``."""
    if isinstance(model, TinyGPT):
        return model(x, y)[1]
    return nn.functional.cross_entropy(model(x), y)


def _check_servers(servers: Any, ranks: int, gate: Any) -> int:
    """The workers ``servers`` leaves among ``ranks`` ranks, once ``servers`` is known to be good."""
    if isinstance(servers, bool) or not isinstance(servers, int) or servers < 1:
        raise ValueError(f"servers must be an integer >= 1, got {servers!r}")
    if servers >= ranks:
        raise ValueError(f"servers={servers} leaves no worker among the group's {ranks} ranks: a parameter server "
                         f"needs at least servers + 1 ranks (group ranks 0 .. {servers - 1} serve, the others work)")
    if servers > 1 and gate is not None:
        raise ValueError(f"a custom gate is one server's rule and each of the servers={servers} needs its own: "
                         "pass gate= with servers=1 only")
    return ranks - servers


def run_parameter_server(model: nn.Module, batches: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]], *,
                         mode: str = "sync", updates: int, lr: float, staleness_bound: int | None = None,
                         backup_workers: int = 0, staleness_aware_lr: bool = False,
                         stragglers: Stragglers | None = None,
                         loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                         group: Any = None, timeout_s: float = 60.0, gate: Any = None, servers: int = 1,
                         max_delay: int | None = None) -> ParameterServerRun | ShardRecord | int:
    """Train ``model`` with SGD through a parameter server: every rank of ``group`` calls this with the same
    model (same weights) and arguments.  Rank 0 serves and returns a :class:`ParameterServerRun`; worker ``w``
    (group rank ``w + servers``) trains on ``batches(w, step)`` for its steps ``0, 1, ...`` and returns how many
    gradients it computed.  ``updates``: the server's budget of updates; ``loss_fn(model, x, y)`` defaults to the
    model's own loss (TinyGPT) or cross-entropy of its output.  See the module docstring for the modes: ``ssp``
    takes ``staleness_bound`` (``s``, in clocks), ``bounded_delay`` ``max_delay`` (``tau``, in updates).

    ``servers``: how many ranks share the weights (group ranks ``0 .. servers-1``, each with its own rule,
    version and budget ``updates``); servers ``1 ..`` return their :class:`ShardRecord` after sending their shard
    and records to server 0, whose run has the full weights and every server's record in ``shards``.

    ``gate``: another rule for the server, an object like :class:`Gate` (``arrive(worker, pulled) ->
    Decision``, ``version`` counting one per update, ``needed``), e.g. an exercise's; by default ``Gate(mode,
    ...)``.  Only with one server (each server would need its own).  If the rule stops making updates (it holds
    workers with no gradient in flight), the server stops every worker and raises ``RuntimeError`` rather than
    wait."""
    group = require_group(group)
    workers = _check_servers(servers, dist.get_world_size(group), gate)
    check_arguments(mode, updates, lr, staleness_bound, backup_workers, workers, max_delay)
    if stragglers is not None and any(not 0 <= w < workers for w in stragglers.slow):
        raise ValueError(f"stragglers.slow names workers {sorted(stragglers.slow)}, but there are {workers} "
                         f"workers, 0 .. {workers - 1} (group ranks {servers} .. {servers + workers - 1})")
    parameters = [p for p in model.parameters() if p.requires_grad]
    # Messages carry their header's integers (versions, steps) in the weights' dtype: 16-bit weights travel,
    # and the server keeps them, in float32, where integers are exact up to 2^24.
    dtype = torch.float32 if parameters[0].dtype in (torch.float16, torch.bfloat16) else parameters[0].dtype
    flat = torch.cat([p.detach().reshape(-1).to(dtype) for p in parameters])
    if servers > flat.numel():
        raise ValueError(f"servers={servers} is more than the model's {flat.numel()} trainable elements: a server "
                         "would hold an empty shard")
    bounds = chunk_bounds(flat.numel(), servers)
    rank = dist.get_rank(group)
    if rank >= servers:
        return work(model, parameters, flat, group, rank - servers, bounds, batches, loss_fn or _default_loss,
                    stragglers or Stragglers())
    gate = Gate(mode, workers, staleness_bound, backup_workers, max_delay) if gate is None else gate
    start, stop = bounds[rank]
    shard = flat[start:stop].clone()
    record = ShardRecord(rank, start, stop, *_serve(shard, group, servers, workers, mode, updates, lr, gate,
                                                    staleness_aware_lr, timeout_s))
    if rank > 0:
        send_shard(group, [_row(r) for r in record.received], record.update_times_s, shard)
        return record
    flat[start:stop] = shard
    records = [record]
    for server in range(1, servers):
        start, stop = bounds[server]
        rows, update_times = receive_shard(group, server, _ROW, flat[start:stop])
        records.append(ShardRecord(server, start, stop, [_unrow(row) for row in rows], update_times))
    load(flat, parameters)
    return ParameterServerRun(mode, workers, record.received, record.update_times_s,
                              {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}, records)


_ROW = 7  # floats per record in a shard server's message to server 0


def _row(r: Received) -> tuple[float, ...]:
    """A record as floats, for the message to server 0 (``applied`` -1 and ``arrived_s`` NaN stand for None)."""
    return (r.worker, r.step, r.pulled, -1 if r.applied is None else r.applied, r.time_s, r.loss,
            math.nan if r.arrived_s is None else r.arrived_s)


def _unrow(row: list[float]) -> Received:
    worker, step, pulled, applied, time_s, loss, arrived_s = row
    return Received(int(worker), int(step), int(pulled), None if applied < 0 else int(applied), time_s, loss,
                    None if math.isnan(arrived_s) else arrived_s)


def _serve(flat, group, servers, workers, mode, updates, lr, gate, staleness_aware_lr,
           timeout_s) -> tuple[list[Received], list[float]]:
    """One server's loop over its shard ``flat`` (updated in place); its records and update times."""
    scale = lr / gate.needed
    ranks = [global_rank(group, w + servers) for w in range(workers)]
    inbox = Inbox(group, ranks, servers, 3 + flat.numel(), flat, timeout_s)
    received: list[Received] = []
    update_times: list[float] = []
    start = time.perf_counter()

    stopped: set[int] = set()

    def send(worker: int, version: float) -> None:
        if version == STOP:
            stopped.add(worker)
        else:
            inbox.expect(worker)  # posted before the worker can answer (NCCL matches in posting order)
        dist.send(torch.cat([torch.tensor([version], dtype=flat.dtype, device=flat.device), flat]),
                  dst=ranks[worker], group=group)

    for worker in range(workers):
        send(worker, 0.0)
    held: dict[int, tuple[int, int, float, float]] = {}  # worker -> (step, pulled, loss, arrived) not applied yet
    while inbox.expected:
        worker = inbox.next()
        header = inbox.buffers[worker][:3].tolist()
        step, pulled, loss, now = int(header[2]), int(header[0]), header[1], time.perf_counter() - start
        if len(update_times) >= updates:  # the budget is spent: this gradient comes too late
            received.append(Received(worker, step, pulled, None, now, loss, now))
            send(worker, STOP)
            continue
        held[worker] = (step, pulled, loss, now)
        decision = gate.arrive(worker, pulled)
        for index in decision.drop:
            step_, pulled_, loss_, arrived = held.pop(index)
            received.append(Received(index, step_, pulled_, None, now, loss_, arrived))
        if decision.apply:
            version = gate.version - 1  # the version these gradients are applied to
            for index in decision.apply:
                step_, pulled_, loss_, arrived = held.pop(index)
                staleness = version - pulled_
                factor = scale / staleness if staleness_aware_lr and staleness > 0 else scale
                flat.add_(inbox.buffers[index][3:], alpha=-factor)
                received.append(Received(index, step_, pulled_, version, now, loss_, arrived))
            update_times.append(now)
        for index in decision.release:
            send(index, STOP if len(update_times) >= updates else float(gate.version))
        if len(update_times) >= updates:  # no update will release a worker the rule still holds (ssp): stop it now
            for index in sorted(set(range(workers)) - stopped - set(inbox.expected)):
                send(index, STOP)
    # Every worker not stopped yet is held by the rule; stop it, then say why the budget was not spent.
    for worker in sorted(set(range(workers)) - stopped):
        send(worker, STOP)
    if len(update_times) < updates:
        raise RuntimeError(f"the {mode} rule made {len(update_times)} of {updates} updates, then held workers "
                           f"{sorted(held)} with no gradient in flight: nothing could release them")
    return received, update_times
