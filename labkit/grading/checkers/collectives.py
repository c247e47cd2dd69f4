"""Checks for exercise 01 (``01_collectives.py``): ring reduce-scatter, all-gather and all-reduce.

Every check runs the student's functions on 2, 3 and 4 gloo ranks, on sizes that do not divide by the world
size (and one smaller than it, so some chunks are empty).  Data are small integers in float64, so every sum is
exact and any wrong chunk index or missed step shows up as a wrong number, not a rounding question.

The functions run under :func:`labkit.grading.guard.point_to_point_only`: every built-in collective raises,
however it is reached (``dist.all_reduce``, ``distributed_c10d``, a name bound at import, a process group's
method, the functional collectives), and so does labkit's own ``labkit.collectives``.  The last check reads the
messages each rank posted and compares them with the ring's schedule — one chunk to the right neighbour per
step, ``N - 1`` steps per phase, so ``2 (N-1)`` messages of about ``n/N`` elements for an all-reduce — which a
correct sum reached another way (the whole tensor passed round the ring, a parameter server) does not match.
"""

from __future__ import annotations

import torch

from labkit.collectives import chunk_bounds
from labkit.grading import CheckFailed, compact, guard
from labkit.launch import launch

WORLD_SIZES = (2, 3, 4)
SIZES = (12, 7, 13, 3, 101)  # 3 < 4 ranks: empty chunks
LAUNCH_TIMEOUT = 30.0  # seconds a distributed check may take before the ranks count as hung
FUNCTIONS = {"reduce_scatter": "ring_reduce_scatter", "all_gather": "ring_all_gather", "all_reduce": "ring_all_reduce"}
ELEMENT_BYTES = 8  # float64
HANDED_OUT = ("labkit.costmodel.collectives.chunk_bounds",)  # the stub imports it: not a shortcut here


def _data(rank: int, n: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + n)
    return torch.randint(-50, 50, (n,), generator=generator).double()


def _truth(world_size: int, n: int) -> torch.Tensor:
    return sum(_data(rank, n) for rank in range(world_size))


def _run_phases(student, phases: tuple[str, ...]):
    """Runs on every rank: apply the student's functions to each size, point-to-point only; return what came
    out and the messages posted, per phase and size."""
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    outputs = {}
    for phase in phases:
        function = getattr(student, FUNCTIONS[phase])
        outputs[phase] = []
        for n in SIZES:
            flat = _data(rank, n)
            if phase == "all_gather":  # only this rank's chunk is valid: the rest is poison
                start, stop = chunk_bounds(n, world_size)[rank]
                full = _truth(world_size, n)
                flat = torch.full((n,), float("nan"), dtype=torch.float64)
                flat[start:stop] = full[start:stop]
            with guard.point_to_point_only(student) as traffic:
                result = function(flat)
            messages = [(message.direction, message.peer, message.nbytes) for message in traffic]
            outputs[phase].append((flat.clone(), None if result is None else result.detach().clone(), messages))
    return compact(outputs)


def _launch(module, phases: tuple[str, ...], world_size: int):
    return launch(_run_phases, module, phases, nprocs=world_size, timeout=LAUNCH_TIMEOUT, rank_output="none")


def _check_values(module, phase: str) -> None:
    for world_size in WORLD_SIZES:
        for rank, outputs in enumerate(_launch(module, (phase,), world_size)):
            for n, (flat, result, _messages) in zip(SIZES, outputs[phase], strict=True):
                truth = _truth(world_size, n)
                start, stop = chunk_bounds(n, world_size)[rank]
                where = f"{world_size} ranks, {n} elements, rank {rank}"
                if phase == "reduce_scatter":
                    if result is None or result.shape != (stop - start,):
                        shape = None if result is None else tuple(result.shape)
                        raise CheckFailed(f"{where}: expected chunk {rank} back (shape {(stop - start,)}), got "
                                          f"{shape}")
                    if not torch.equal(result, truth[start:stop]):
                        wrong = _first_difference(result, truth[start:stop])
                        raise CheckFailed(f"{where}: chunk {rank} is wrong at element {start + wrong} "
                                          f"(got {result[wrong].item():g}, the sum over ranks is "
                                          f"{truth[start + wrong].item():g}) — a chunk index or a step off?")
                elif not torch.equal(flat, truth):
                    wrong = _first_difference(flat, truth)
                    owner = next(c for c, (a, b) in enumerate(chunk_bounds(n, world_size)) if a <= wrong < b)
                    raise CheckFailed(f"{where}: element {wrong} (chunk {owner}) is {flat[wrong].item():g}, "
                                      f"expected {truth[wrong].item():g} — a chunk index or a step off?")


def _first_difference(got: torch.Tensor, expected: torch.Tensor) -> int:
    differs = ~((got == expected) | (got.isnan() & expected.isnan()))
    return int(differs.nonzero()[0].item())


# --------------------------------------------------------------------------------------------------------
# The ring's schedule


def _schedule(phase: str, rank: int, world_size: int, n: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(peer, bytes)`` of every message ``rank`` sends and receives in the ring, in order."""
    bounds = chunk_bounds(n, world_size)
    steps = []  # (chunk sent, chunk received) at each step
    if phase in ("reduce_scatter", "all_reduce"):
        steps += [((rank - s - 1) % world_size, (rank - s - 2) % world_size) for s in range(world_size - 1)]
    if phase in ("all_gather", "all_reduce"):
        steps += [((rank - s) % world_size, (rank - s - 1) % world_size) for s in range(world_size - 1)]

    def size(chunk: int) -> int:
        return (bounds[chunk][1] - bounds[chunk][0]) * ELEMENT_BYTES

    return ([((rank + 1) % world_size, size(sent)) for sent, _ in steps],
            [((rank - 1) % world_size, size(received)) for _, received in steps])


def _describe(messages: list[tuple[int, int]]) -> str:
    if not messages:
        return "no message with data"
    return (f"{len(messages)} message(s) of {[nbytes for _, nbytes in messages]} bytes "
            f"({sum(nbytes for _, nbytes in messages)} in all)")


def _compare_traffic(phase: str, world_size: int, rank: int, n: int, messages) -> None:
    # Empty chunks (n < N) may be sent as empty messages or not at all: only messages with data count.
    sent = [(peer, nbytes) for direction, peer, nbytes in messages if direction == "send" and nbytes]
    received = [(peer, nbytes) for direction, peer, nbytes in messages if direction == "recv" and nbytes]
    expected_sent, expected_received = (
        [(peer, nbytes) for peer, nbytes in schedule if nbytes] for schedule in _schedule(phase, rank, world_size, n))
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    where = f"{world_size} ranks, {n} elements, {FUNCTIONS[phase]} on rank {rank}"
    steps = "N - 1 steps" if phase != "all_reduce" else "2 (N - 1) steps (reduce-scatter, then all-gather)"
    for what, got, expected, neighbour, side in (("sent", sent, expected_sent, right, "right"),
                                                 ("received", received, expected_received, left, "left")):
        strangers = sorted({peer for peer, _ in got if peer != neighbour}, key=str)  # None: from any source
        if strangers:
            raise CheckFailed(f"{where}: {what} messages {'to' if what == 'sent' else 'from'} rank(s) {strangers}; "
                              f"in a ring rank {rank} talks only to its {side} neighbour, rank {neighbour} "
                              "(a parameter server or a tree is another algorithm)")
        if got != expected:
            raise CheckFailed(f"{where}: {what} {_describe(got)}; the ring's {steps}, one chunk each, make "
                              f"{_describe(expected)} (float64: {ELEMENT_BYTES} bytes per element)"
                              + _traffic_hint(got, expected, -(-n // world_size) * ELEMENT_BYTES))


def _traffic_hint(got: list[tuple[int, int]], expected: list[tuple[int, int]], chunk_bytes: int) -> str:
    """Name what differs from the schedule: a message larger than any chunk, a count, or one message's size."""
    largest = max((nbytes for _, nbytes in got), default=0)
    if largest > chunk_bytes:
        return (f" — one message carried {largest} bytes, more than any chunk: each step sends one chunk of about "
                "n/N elements, not the whole tensor")
    if len(got) != len(expected):
        return f" — {'fewer' if len(got) < len(expected) else 'more'} messages than the ring's steps"
    index = next(i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b)
    return (f" — message {index + 1} carried {got[index][1]} bytes where the ring's step sends a chunk of "
            f"{expected[index][1]}: a chunk index off?")


# --------------------------------------------------------------------------------------------------------
# The checks


@guard.no_shortcuts(allow=HANDED_OUT)
def check_reduce_scatter(module) -> None:
    """ring_reduce_scatter leaves rank r holding chunk r summed over all ranks (2-4 ranks, uneven sizes)"""
    _check_values(module, "reduce_scatter")


@guard.no_shortcuts(allow=HANDED_OUT)
def check_all_gather(module) -> None:
    """ring_all_gather fills every chunk from the rank that owns it (2-4 ranks, uneven sizes)"""
    _check_values(module, "all_gather")


@guard.no_shortcuts(allow=HANDED_OUT)
def check_all_reduce(module) -> None:
    """ring_all_reduce equals the sum over all ranks, on every rank (2-4 ranks, uneven sizes)"""
    _check_values(module, "all_reduce")


@guard.no_shortcuts(allow=HANDED_OUT)
def check_ring_messages(module) -> None:
    """each function sends the ring's messages: one chunk per step, to the right neighbour only"""
    for world_size in WORLD_SIZES:
        for rank, outputs in enumerate(_launch(module, tuple(FUNCTIONS), world_size)):
            for phase in FUNCTIONS:
                for n, (_flat, _result, messages) in zip(SIZES, outputs[phase], strict=True):
                    _compare_traffic(phase, world_size, rank, n, messages)


CHECKS = [check_reduce_scatter, check_all_gather, check_all_reduce, check_ring_messages]

for _check_fn in CHECKS:
    _check_fn.timeout = 120.0
