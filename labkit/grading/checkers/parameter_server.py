"""Checks for exercise 08 (``08_parameter_server.py``): BoundedDelay, the server's rule under a bounded delay ``tau``
(no gradient applied more than ``tau`` updates stale; not Ho et al.'s SSP, which bounds clocks, not staleness).

A :class:`_Referee` plays the server around the student's rule, keeps its own account (who computes on which version,
what is held, what was applied) and holds every decision to what any bounded-delay rule owes: it applies only held
gradients, each once; releases only workers it applied; counts each update in ``version``; leaves no gradient
(applied, held or being computed) staler than ``tau``; and keeps some worker computing (else training stops for
ever).  An SSP in its place (each gradient applied on arrival, only its worker held) fails, and is named.

1. over random arrival orders (1 to 6 workers, ``tau`` 0 to 4, every other order with one slow worker), every
   decision passes the referee;
2. every decision is the bounded delay's: on arrivals played through labkit's own rule (:class:`Gate`
   ``"bounded_delay"``, run at import, outside the guard), the student's ``(apply, release)`` and ``version`` equal
   the reference's at each turn, ``tau = 0`` (sync) and a bound larger than any run (async) included.  A rule that
   holds one update too long, or keeps released workers on the old version, fails here only; the hint works out
   ``version + 1 - v`` for the oldest worker computing, names sync, async and SSP, and points at wrong books;
3. :func:`~labkit.parallel.parameter_server.run_parameter_server` trains TinyMLP on launched gloo ranks with the
   student's rule behind an adapter (the referee), worker 0 slow enough that the others reach the bound: the run
   finishes, every gradient sent is recorded once, the budget is spent, none is staler than ``tau``.  A rule that
   hangs fails when the launch times out; one the referee rejects fails the server's rank at once, with its hint.

:mod:`labkit.grading.guard` forbids ``labkit.parallel`` as for every exercise, less the parameter server itself
(:data:`CHECKER_TOOLS`: all ``parameter_server.runtime`` and ``.messages`` define but :class:`Gate`, and chunk_bounds).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from labkit.grading import CheckFailed, guard
from labkit.launch import CollectiveTimeout, RankFailed, launch
from labkit.models import MLPConfig, TinyMLP
from labkit.parallel.parameter_server import (
    Decision,
    Gate,
    Stragglers,
    messages,
    run_parameter_server,
    runtime,
)

# The first failing case is reported: 4 workers, tau = 2 first, where neither sync nor off by one can pass for it.
CASES = [(workers, bound) for workers in (4, 3, 2, 6, 5, 1) for bound in (2, 1, 0, 3, 4)]
HUGE = 10**9  # a bound no run reaches: asynchronous training
SEEDS = (0, 1, 2, 3)  # odd seeds: worker 0 is a straggler (arrives a fifth as often as the others)
ARRIVALS = 40
# The parameter server runs labkit's own code, all of it but the rule the student writes.
CHECKER_TOOLS = tuple(f"{module.__name__}.{name}" for module in (runtime, messages)
                      for name, value in vars(module).items()
                      if getattr(value, "__module__", None) == module.__name__ and value is not Gate) \
    + ("labkit.costmodel.collectives.chunk_bounds",)
# The launched runs: (workers, tau).  Worker 0 sleeps SLOW_S on every step, in which the fast workers (a step takes
# about a millisecond) reach the bound, so an answer that lets a gradient be tau + 1 stale shows it in every run.
RUNS = ((3, 1), (2, 2))
CONFIG = MLPConfig(in_features=8, hidden_sizes=(16,), num_classes=4)
UPDATES, LR, SLOW_S = 12, 0.1, 0.05
# Seconds one launched run may take before its ranks count as hung; the server's own limit on silence from workers
LAUNCH_TIMEOUT, SERVER_TIMEOUT_S = 30.0, 10.0
_CHECK_FAILED = f"{CheckFailed.__module__}.{CheckFailed.__qualname__}: "  # how a rank's traceback names it
_SSP = (" (yours applies each gradient on arrival and holds only its worker: that is Ho et al.'s SSP, which bounds "
        "how far a worker's clock runs ahead, not staleness; here the gradient waits)")


def _where(workers: int, bound: int) -> str:
    return f"{workers} worker{'s' * (workers != 1)}, tau={'10**9' if bound == HUGE else bound}"


def _next_arrival(rng: random.Random, computing: dict[int, int], slow: bool) -> int:
    candidates = sorted(computing)
    return rng.choices(candidates, [0.2 if slow and worker == 0 else 1.0 for worker in candidates])[0]


def _rng(workers: int, bound: int, seed: int) -> random.Random:
    return random.Random(f"{workers}-{bound}-{seed}")


def _rule(module, workers: int, bound: int):
    try:
        return module.BoundedDelay(workers, bound)
    except Exception as error:
        if isinstance(error, (NotImplementedError, CheckFailed)):
            raise
        raise CheckFailed(f"BoundedDelay({workers}, {bound}) raised {type(error).__name__}: {error}") from None


def _decide(rule, worker: int, pulled: int, where: str) -> tuple[list[int], list[int]]:
    """The student's ``(apply, release)`` for one arrival, as two lists of ints (or a hint)."""
    call = f"{where}: arrive({worker}, {pulled})"
    try:
        result = rule.arrive(worker, pulled)
    except (NotImplementedError, CheckFailed):
        raise
    except Exception as error:
        raise CheckFailed(f"{call} raised {type(error).__name__}: {error}") from None
    if not (isinstance(result, (tuple, list)) and len(result) == 2 and all(
            isinstance(part, (tuple, list)) and all(isinstance(w, int) and not isinstance(w, bool) for w in part)
            for part in result)):
        raise CheckFailed(f"{call} returned {result!r}; return a pair (apply, release) of lists of worker numbers, "
                          "([], []) to hold the gradient")
    return list(result[0]), list(result[1])


# --------------------------------------------------------------------------------------------------------
# The referee: what any bounded-delay rule owes


class _Referee:
    """Plays the server around the student's rule; a :class:`CheckFailed` hint at its first wrong decision."""

    def __init__(self, module, workers: int, bound: int, where: str = ""):
        self.module, self.rule, self.workers, self.bound = module, _rule(module, workers, bound), workers, bound
        self.where, self.version, self.arrivals = where + _where(workers, bound), 0, 0
        self.computing = dict.fromkeys(range(workers), 0)  # worker -> the version it computes on
        self.held: dict[int, int] = {}  # worker -> the version its held gradient was computed on
        self.idle: set[int] = set()  # applied, not released yet
        self.applied_at: dict[int, int] = {}  # worker -> the version its last gradient was applied at

    def arrive(self, worker: int) -> tuple[list[int], list[int]]:
        pulled = self.held[worker] = self.computing.pop(worker)
        self.arrivals += 1
        at = (f"{self.where}, arrival {self.arrivals} (worker {worker}'s gradient, computed on version {pulled}, "
              f"at version {self.version})")
        apply, release = _decide(self.rule, worker, pulled, at)
        self._apply(apply, f"{at}: yours applies {apply}")
        self._release(release, f"{at}: yours releases {release}")
        mine = getattr(self.rule, "version", None)
        if mine != self.version:
            raise CheckFailed(f"{at}: self.version is {mine!r} after {self.version} update(s); count each update "
                              "(version += 1 when you apply), and nothing else")
        self._bound(at)
        if not self.computing:
            waiting = [f"workers {sorted(self.held)} held"] if self.held else []
            if self.idle:
                waiting.append(f"workers {sorted(self.idle)} applied but never released (sent the new weights)")
            raise CheckFailed(f"{at}: no worker computes any more: {' and '.join(waiting)}. Nobody can send another "
                              "gradient, so the server would wait for ever: release the workers whose gradients you "
                              "apply, and apply what is held once nobody computes")
        return apply, release

    def _apply(self, apply: list[int], at: str) -> None:
        for index in apply:
            if apply.count(index) > 1:
                raise CheckFailed(f"{at}: worker {index}'s gradient twice in one update (is self.held emptied when "
                                  "you apply what it holds?)")
            if index in self.computing:
                again = f": its last gradient was applied at version {self.applied_at[index]} (is self.held " \
                    "emptied when you apply it?)" if index in self.applied_at else ""
                raise CheckFailed(f"{at}, but worker {index} is still computing its gradient (on version "
                                  f"{self.computing[index]}): apply only gradients that arrived{again}")
            if index in self.applied_at and index not in self.held:
                raise CheckFailed(f"{at}: worker {index}'s gradient was applied already, at version "
                                  f"{self.applied_at[index]}, and worker {index} has sent none since: empty "
                                  "self.held when you apply what it holds")
            if index not in self.held:
                raise CheckFailed(f"{at}, but there is no worker {index} (workers 0 to {self.workers - 1})")
        for index in apply:
            del self.held[index]
            self.applied_at[index] = self.version
            self.idle.add(index)
        self.version += bool(apply)

    def _release(self, release: list[int], at: str) -> None:
        for index in release:
            if release.count(index) > 1:
                raise CheckFailed(f"{at}: worker {index} twice")
            if index in self.computing:
                raise CheckFailed(f"{at}, but worker {index} is still computing: release only workers whose "
                                  "gradients you apply")
            if index in self.held:
                raise CheckFailed(f"{at}, but worker {index}'s gradient is held, not applied: it would compute "
                                  "again while its gradient waits; release a worker with the update that applies "
                                  "its gradient")
            if index not in self.idle:
                raise CheckFailed(f"{at}, but there is no worker {index} (workers 0 to {self.workers - 1})")
        for index in release:
            self.idle.discard(index)
            self.computing[index] = self.version

    def _bound(self, at: str) -> None:
        for index, pulled in sorted(self.held.items()):
            if self.version - pulled > self.bound:
                raise CheckFailed(f"{at}: worker {index}'s gradient, computed on version {pulled}, is still held at "
                                  f"version {self.version}, {self.version - pulled} updates stale already, more "
                                  f"than tau={self.bound}: it can never be applied within the bound. An update "
                                  "applies everything held")
        for index, pulled in sorted(self.computing.items()):
            if self.version - pulled > self.bound:
                raise CheckFailed(f"{at}: after this update worker {index}, still computing on version {pulled}, "
                                  f"is {self.version - pulled} updates behind, so its gradient will arrive more than "
                                  f"tau={self.bound} stale{_habit(self.module, self.workers, self.bound)}. Hold while "
                                  "version + 1 - (the oldest version a worker computes on) > tau")


def _failing(failures: list[str], cases: int) -> None:
    if failures:
        others = f" (and {len(failures) - 1} more of the {cases} plays)" if failures[1:] else ""
        raise CheckFailed(failures[0] + others)


# --------------------------------------------------------------------------------------------------------
# 1. The referee's rules, over random arrival orders


@guard.no_shortcuts(allow=CHECKER_TOOLS)
def check_bound_and_progress(module) -> None:
    """every gradient is applied once, none staler than tau, and some worker always computes (random orders)"""
    failures = []
    for workers, bound in CASES:
        for seed in SEEDS:
            referee, rng = _Referee(module, workers, bound), _rng(workers, bound, seed)
            try:
                for _ in range(ARRIVALS):
                    referee.arrive(_next_arrival(rng, referee.computing, slow=seed % 2 == 1))
            except CheckFailed as failure:
                if isinstance(failure, guard.Forbidden):
                    raise
                failures.append(str(failure))
    _failing(failures, len(CASES) * len(SEEDS))


# --------------------------------------------------------------------------------------------------------
# 2. The bounded delay's rule, decision by decision


@dataclass(frozen=True)
class _Turn:
    """One arrival played through labkit's rule: the state before it, and the reference's decision."""

    worker: int
    pulled: int
    version: int
    computing: dict[int, int]  # the other workers still computing, and on which version
    held: tuple[int, ...]
    apply: tuple[int, ...]
    release: tuple[int, ...]


def _reference_play(workers: int, bound: int, seed: int) -> list[_Turn]:
    gate, rng, turns = Gate("bounded_delay", workers, max_delay=bound), _rng(workers, bound, seed), []
    for _ in range(ARRIVALS):
        worker = _next_arrival(rng, gate.computing, slow=seed % 2 == 1)
        pulled, version, held = gate.computing[worker], gate.version, tuple(w for w, _ in gate.held)
        computing = {w: v for w, v in gate.computing.items() if w != worker}
        decision = gate.arrive(worker, pulled)
        turns.append(_Turn(worker, pulled, version, computing, held, decision.apply, decision.release))
    return turns


# Played now, at import, outside the guard (which forbids Gate to the student's code and so to the checks).
REFERENCE = [(workers, bound, _reference_play(workers, bound, seed))
             for workers, bound in [*CASES, *((workers, HUGE) for workers in (4, 3, 2))] for seed in SEEDS[:2]]


def _expected(turn: _Turn, bound: int) -> str:
    oldest = min(turn.computing.items(), key=lambda item: (item[1], item[0]), default=None)
    after = turn.version + 1
    if not turn.apply:
        worker, version = oldest
        over = " (one update more than tau allows)" if after - version == bound + 1 else ""
        return (f"applying would make version {after}, and worker {worker}'s gradient, still being computed on "
                f"version {version}, at least {after - version} stale, more than tau={bound}{over}: hold (return [], "
                "[]) until it arrives")
    if oldest is None:
        why = "nobody computes any more, so no gradient can become too stale"
    elif bound == HUGE:
        why = "no run reaches a bound this large, so the rule is asynchronous training"
    else:
        worker, version = oldest
        why = (f"applying makes version {after}, and the oldest gradient still being computed (worker {worker}'s, on "
               f"version {version}) would be {after - version} stale, which tau={bound} allows")
        if after - version == bound:
            why += " (equal to tau is allowed: hold only while version + 1 - oldest > tau)"
    return f"{why}: apply everything held, {sorted(turn.apply)}, as one update now, and release those workers"


def _habit(module, workers: int, bound: int) -> str:
    """What the student's rule, played on its own (worker 0 slow), turns out to be when it is not the rule:
    synchronous training (it applies exactly when nobody else computes), asynchronous (it applies each gradient on
    arrival and releases its worker), or Ho et al.'s SSP (it applies each on arrival, but holds some workers)."""
    computing, sync, asynchronous, ssp = dict.fromkeys(range(workers), 0), True, True, True
    try:
        rule, rng = _rule(module, workers, bound), _rng(workers, bound, 0)
        for _ in range(ARRIVALS):
            worker = _next_arrival(rng, computing, slow=True)
            pulled = computing.pop(worker)
            apply, release = _decide(rule, worker, pulled, "")
            sync, ssp = sync and bool(apply) == (not computing), ssp and apply == [worker]
            asynchronous = asynchronous and apply == [worker] and release == [worker]
            computing.update(dict.fromkeys(release, getattr(rule, "version", None)))
            if not computing:
                break
    except Exception:  # it fails on its own: the referee's check says how
        return ""
    if sync:
        return " (yours waits for every worker, as synchronous training does: that is tau = 0)"
    if asynchronous:
        return " (yours applies every gradient on arrival, as asynchronous training does: that is a bound no run " \
            "reaches)"
    return _SSP if ssp else ""


def _disagreement(module, workers: int, bound: int, number: int, turn: _Turn, apply: list[int],
                  release: list[int]) -> str:
    held = f"workers {list(turn.held)} held" if turn.held else "nothing held"
    computing = ", ".join(f"worker {w} on version {v}" for w, v in sorted(turn.computing.items())) + " computing" \
        if turn.computing else "nobody else computing"
    state = (f"{_where(workers, bound)}, arrival {number}: worker {turn.worker}'s gradient (computed on version "
             f"{turn.pulled}) arrives at version {turn.version}, with {held} and {computing}. ")
    if sorted(apply) != sorted(turn.apply) and bool(apply) == bool(turn.apply):
        return state + f"Apply everything held, {sorted(turn.apply)}, as one update; yours applies {sorted(apply)}"
    if sorted(apply) != sorted(turn.apply):
        expected, mine = _expected(turn, bound), f"yours applies {sorted(apply)}" if apply else "yours holds"
        return state + f"{expected[0].upper()}{expected[1:]}; {mine}{_habit(module, workers, bound)}"
    what = f"release the workers whose gradients you apply, {sorted(turn.release)}" if turn.apply else \
        "hold: release nobody"
    return state + f"Then {what}; yours releases {sorted(release)}"


def _books(rule, turn: _Turn, apply: list[int]) -> str:
    """What a rule that holds where it should apply records as the versions being computed on, if not the referee's."""
    mine = getattr(rule, "computing", None)
    return "" if apply or not turn.apply or not isinstance(mine, dict) or mine == turn.computing else (
        f". Your self.computing says {dict(sorted(mine.items()))}: a worker released by an update computes on the "
        "version that update made")


@guard.no_shortcuts(allow=CHECKER_TOOLS)
def check_applies_as_soon_as_the_bound_allows(module) -> None:
    """each decision is the bounded delay's: apply all held as soon as tau allows (tau = 0: sync; huge: async)"""
    failures = []
    for workers, bound, turns in REFERENCE:
        rule = _rule(module, workers, bound)
        for number, turn in enumerate(turns, 1):
            apply, release = _decide(rule, turn.worker, turn.pulled, f"{_where(workers, bound)}, arrival {number}")
            version = getattr(rule, "version", None)
            if sorted(apply) != sorted(turn.apply) or sorted(release) != sorted(turn.release):
                failures.append(_disagreement(module, workers, bound, number, turn, apply, release)
                                + _books(rule, turn, apply))
                break
            if version != turn.version + bool(turn.apply):
                failures.append(f"{_where(workers, bound)}, arrival {number}: self.version is {version!r} after "
                                f"{turn.version + bool(turn.apply)} update(s); count each update (version += 1 "
                                "when you apply)")
                break
    _failing(failures, len(REFERENCE))


# --------------------------------------------------------------------------------------------------------
# 3. A real parameter server, on launched ranks


class _ServerGate:
    """The student's rule as the server's gate (``arrive(worker, pulled) -> Decision``, ``version``, ``needed``),
    each decision passed through the referee first."""

    def __init__(self, referee: _Referee, updates: int):
        self.referee, self.updates, self.needed, self.version = referee, updates, referee.workers, 0

    def arrive(self, worker: int, pulled: int) -> Decision:
        apply, release = self.referee.arrive(worker)
        self.version = self.referee.version
        if self.referee.version >= self.updates and self.referee.held:
            raise CheckFailed(f"{self.referee.where}: update {self.updates}, the last of the run, leaves workers "
                              f"{sorted(self.referee.held)} held; the server stops after it, and they would wait "
                              "for ever. An update applies everything held")
        return Decision(apply=tuple(apply), release=tuple(release))


def _batches(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8, CONFIG.in_features, generator=torch.Generator().manual_seed(1000 * worker + step))
    return x, x[:, :CONFIG.num_classes].argmax(1)


def _train(module, workers: int, bound: int, where: str):
    import torch.distributed as dist

    torch.set_num_threads(1)
    gate = _ServerGate(_Referee(module, workers, bound, where), UPDATES) if dist.get_rank() == 0 else None
    run = run_parameter_server(TinyMLP(CONFIG, seed=0), _batches, mode="bounded_delay", max_delay=bound,
                               updates=UPDATES, lr=LR, stragglers=Stragglers(slow={0: SLOW_S}), gate=gate,
                               timeout_s=SERVER_TIMEOUT_S)
    return run if isinstance(run, int) else ([(r.worker, r.step, r.pulled, r.applied) for r in run.received],
                                             len(run.update_times_s))


def _real_run(module, workers: int, bound: int) -> None:
    where = f"on {workers + 1} launched ranks (worker 0 slow), "
    try:
        (received, updates), *sent = launch(_train, module, workers, bound, where, nprocs=workers + 1,
                                            timeout=LAUNCH_TIMEOUT, rank_output="none")
    except RankFailed as failure:
        last = failure.remote_traceback.strip().splitlines()[-1]
        if last.startswith(_CHECK_FAILED):
            raise CheckFailed(last[len(_CHECK_FAILED):]) from None
        raise
    except CollectiveTimeout as failure:
        raise CheckFailed(f"{where}{_where(workers, bound)}: the run did not finish within {LAUNCH_TIMEOUT:g} s "
                          f"(ranks {failure.stuck_ranks} were still running). arrive decides at once and returns; "
                          "it never waits for other workers (a held worker waits because it is not released)") \
            from None
    where += _where(workers, bound)
    if updates != UPDATES:
        raise CheckFailed(f"{where}: the server made {updates} updates of its budget of {UPDATES}")
    for worker, count in enumerate(sent):
        steps = sorted(step for index, step, _, _ in received if index == worker)
        if steps != list(range(count)):
            raise CheckFailed(f"{where}: worker {worker} sent {count} gradients, the server recorded steps {steps}")
    stale = sorted({applied - pulled for _, _, pulled, applied in received
                    if applied is not None and applied - pulled > bound})
    if stale:
        raise CheckFailed(f"{where}: gradients were applied {stale} updates stale, more than tau={bound}")


@guard.no_shortcuts(allow=CHECKER_TOOLS)
def check_parameter_server_run(module) -> None:
    """labkit's parameter server trains with your rule on launched ranks (one worker slow), none staler than tau"""
    for workers, bound in RUNS:
        _real_run(module, workers, bound)


check_parameter_server_run.timeout = 2 * LAUNCH_TIMEOUT + 30.0

CHECKS = [check_bound_and_progress, check_applies_as_soon_as_the_bound_allows, check_parameter_server_run]
