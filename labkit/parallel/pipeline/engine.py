"""Each rank's order placed in time: the one engine behind every pipeline table, simulation and step model.

A schedule decides only each rank's *order* of passes (:mod:`.schedule`, :mod:`.zero_bubble`).  Time follows from
one rule: a rank runs its order one pass after another, and a pass starts once its rank is free and its inputs
are done — the previous stage's ``F`` for a forward, its own ``F`` and the next stage's ``B`` or ``I`` for a
backward, its own ``I`` for a ``W`` — plus ``send_s`` when an input was produced on another rank.  An overlapped
pair (DualPipeV's ``F&B``) starts once the inputs of both its passes are done.

Everything that puts a schedule on a clock goes through here: :func:`~.schedule.validate` and the tables'
unit-time slots, :func:`~.simulate.simulate` and :func:`~.simulate.replay`, the 3D step model
(:func:`labkit.costmodel.step.predict_step`, which places hundreds of layouts) and the event-driven simulator of
:mod:`labkit.costmodel.simulator` (which reads the dependencies from here and adds contention of its own).
:func:`compile_orders` turns the orders into integer dependencies in a topological order once, raising
``ValueError`` on an order no runtime could run; :func:`place` is then one pass over the actions per set of
durations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

KIND_INDEX = {"F": 0, "B": 1, "I": 2, "W": 3}
RULES = {"F": "a forward needs the previous stage's forward of its micro-batch first",
         "B": "a backward needs its own forward and the next stage's backward (B or I) of its micro-batch first",
         "I": "a backward needs its own forward and the next stage's backward (B or I) of its micro-batch first",
         "W": "a weight gradient W needs its input gradient I first"}


@dataclass(frozen=True)
class Compiled:
    """A schedule's passes by id (each rank's order, rank after rank) and their dependencies.

    ``actions[i]`` is pass ``i``; ``first[r]`` the id of rank ``r``'s first pass (its passes are ``first[r]`` up
    to ``first[r + 1]``); ``pair_of[i]``: the backward that the forward ``i`` runs with as one unit, or -1;
    ``inputs[i]``: the ids of the passes on *other* ranks that ``i`` (with its pair) waits for — an input on its
    own rank ran earlier in that rank's order, so the rank's order alone holds it; ``steps``: in a topological
    order, ``(id, the id before it on its rank, first input, second input)``, where ``len(actions)`` stands
    for none;
    ``last_gradient[s]``: stage ``s``'s last gradient-producing pass (its last ``B``, or ``W`` when split);
    ``stage_ranks[s]``: the rank that holds stage ``s``."""

    p: int
    actions: tuple[Any, ...]
    first: tuple[int, ...]
    pair_of: tuple[int, ...]
    inputs: tuple[tuple[int, ...], ...]
    steps: tuple[tuple[int, int, int, int], ...]
    last_gradient: tuple[int, ...]
    stage_ranks: tuple[int, ...]

    def rank_ids(self, rank: int) -> range:
        """The ids of ``rank``'s passes, in its order."""
        return range(self.first[rank], self.first[rank + 1] if rank + 1 < self.p else len(self.actions))


def _name(stage: int, kind: str, microbatch: int) -> str:
    return f"{stage}{kind}{microbatch}"  # torch's compact form, as Action prints


def compile_orders(name: str, p: int, m: int, stages: int, orders: Sequence[Sequence[Any]],
                   rank_of: Callable[[int], int], pairs: Any = ()) -> Compiled:
    """Compile ``orders`` (per rank, actions with ``stage``, ``kind``, ``microbatch``) of a schedule named ``name``
    over ``p`` ranks, ``m`` micro-batches and ``stages`` stages, stage ``s`` on rank ``rank_of(s)``; ``pairs``:
    (forward, backward) run as one unit.  Raises ``ValueError`` when a rank would wait for a pass that it runs
    later (or never), or when no rank can progress (a deadlock), naming the passes."""
    slot = [-1] * (stages * 4 * m)  # (stage, kind, micro-batch) -> id
    actions: list[Any] = []
    first: list[int] = []
    rank: list[int] = []  # of each id
    for r, order in enumerate(orders):
        first.append(len(actions))
        for action in order:
            slot[(action.stage * 4 + KIND_INDEX[action.kind]) * m + action.microbatch] = len(actions)
            actions.append(action)
            rank.append(r)
    n = len(actions)
    pair_of = [-1] * n
    for forward, backward in pairs:
        pair_of[slot[(forward.stage * 4) * m + forward.microbatch]] = \
            slot[(backward.stage * 4 + KIND_INDEX[backward.kind]) * m + backward.microbatch]
    paired_second = {j for j in pair_of if j >= 0}

    def need(stage: int, kind: str, mb: int) -> tuple[int, int, str, int]:  # (id, or -1 if never run), the pass
        return slot[(stage * 4 + KIND_INDEX[kind]) * m + mb], stage, kind, mb

    def needs(i: int) -> list[tuple[int, int, str, int]]:  # a pass's inputs, in the rules' order
        s, kind, mb = actions[i].stage, actions[i].kind, actions[i].microbatch
        if kind == "F":
            return [need(s - 1, "F", mb)] if s > 0 else []
        if kind == "W":
            return [need(s, "I", mb)]
        found = [need(s, "F", mb)]  # B or I: the stage's own activations, and the gradient from downstream
        if s + 1 < stages:
            upstream = need(s + 1, "B", mb)
            split = need(s + 1, "I", mb)
            found.append(upstream if upstream[0] >= 0 or split[0] < 0 else split)
        return found

    unit_needs = []
    for i in range(n):
        found = needs(i)
        if pair_of[i] >= 0:
            found += needs(pair_of[i])
        unit_needs.append(found)
    # Run the orders: each rank goes as far as its inputs allow, in turns, until every rank is done.
    done = [False] * n + [False]  # done[-1]: a pass never run
    position, ends = list(first), [first[r + 1] if r + 1 < p else n for r in range(p)]
    topological: list[int] = []
    while len(topological) < n:
        progressed = False
        for r in range(p):
            i = position[r]
            while i < ends[r]:
                missing = [(stage, kind, mb) for j, stage, kind, mb in unit_needs[i] if not done[j]]
                if missing:
                    stage, kind, mb = missing[0]
                    if rank_of(stage) == r:
                        raise ValueError(f"{name}: rank {r} runs {actions[i]} before {_name(stage, kind, mb)} (or "
                                         f"never runs it): {RULES[actions[i].kind]}")
                    break
                unit = (i, pair_of[i]) if pair_of[i] >= 0 else (i,)
                for k in unit:
                    done[k] = True
                    topological.append(k)
                i += len(unit)
                progressed = True
            position[r] = i
        if not progressed:
            waits = [f"rank {r} at {actions[position[r]]} waits for "
                     f"{next(_name(*need[1:]) for need in unit_needs[position[r]] if not done[need[0]])}"
                     for r in range(p) if position[r] < ends[r]]
            raise ValueError(f"{name}: deadlock, no rank can progress: " + "; ".join(waits))
    none = n
    inputs = []
    for i in range(n):
        crossing = [need[0] for need in unit_needs[i] if rank[need[0]] != rank[i]] if i not in paired_second else []
        inputs.append(tuple(dict.fromkeys(crossing)))
        # a forward waits for the previous stage, a backward for the next one, a pair for both: never more
        assert len(inputs[-1]) <= 2, f"{name}: {actions[i]} waits on {len(inputs[-1])} other ranks' passes"
    steps = []
    for i in topological:
        before = i - 1 if i > first[rank[i]] else none
        crossing = inputs[i] + (none, none)
        steps.append((i, before, crossing[0], crossing[1]))
    last = [-1] * stages
    for i, action in enumerate(actions):
        if action.kind in ("B", "W"):
            last[action.stage] = i  # a rank's order visits its passes in time order: the last B or W
    return Compiled(p, tuple(actions), tuple(first), tuple(pair_of), tuple(inputs), tuple(steps), tuple(last),
                    tuple(rank_of(stage) for stage in range(stages)))


@dataclass(frozen=True)
class Placement:
    """Every pass's ``starts[i]`` and ``ends[i]`` (by id) once :func:`place` ran the orders."""

    compiled: Compiled
    starts: list[float]
    ends: list[float]

    @property
    def makespan(self) -> float:
        """When the last pass ends (0 for no pass)."""
        return max(self.ends, default=0)

    def span(self, i: int) -> tuple[float, float]:
        """``(start, end)`` of pass ``i``."""
        return self.starts[i], self.ends[i]

    def last_gradient(self, stage: int) -> tuple[float, float]:
        """``(start, end)`` of the pass that completes ``stage``'s gradients (its last ``B``, or ``W`` when split)."""
        return self.span(self.compiled.last_gradient[stage])

    def first_pass(self, rank: int) -> tuple[float, float]:
        """``(start, end)`` of ``rank``'s first pass."""
        return self.span(self.compiled.first[rank])

    def events(self) -> list[list[tuple[float, float, Any]]]:
        """Per rank, ``(start, end, action)`` of each of its passes, in its order."""
        return [[(self.starts[i], self.ends[i], self.compiled.actions[i]) for i in self.compiled.rank_ids(r)]
                for r in range(self.compiled.p)]


def place(compiled: Compiled, durations: Sequence[float], send_s: float = 0) -> Placement:
    """Run the compiled orders with pass ``i`` lasting ``durations[i]`` and every input from another rank arriving
    ``send_s`` after it ends.  A pair's two passes run one after the other from the moment both are ready: give
    them the durations they share (the pair's time split between them) to model an overlapped ``F&B``.  Exact
    numbers (``int``, ``fractions.Fraction``) stay exact."""
    n = len(compiled.actions)
    if len(durations) != n:
        raise ValueError(f"durations needs one value per pass: {n} passes, got {len(durations)}")
    starts: list[float] = [0] * n
    ends: list[float] = [0] * n + [0]  # ends[n]: "nothing before this pass on its rank", at time 0
    for i, before, first, second in compiled.steps:
        start = ends[before]
        if first < n:
            arrives = ends[first] + send_s
            if arrives > start:
                start = arrives
            if second < n:
                arrives = ends[second] + send_s
                if arrives > start:
                    start = arrives
        starts[i] = start
        ends[i] = start + durations[i]
    return Placement(compiled, starts, ends[:n])
