"""Checks for exercise 01 (``01_collectives.py``): ring reduce-scatter, all-gather and all-reduce.

Every check runs the student's functions on 2, 3 and 4 gloo ranks, on sizes that do not divide by the world
size (and one smaller than it, so some chunks are empty).  Data are small integers in float64, so every sum is
exact and any wrong chunk index or missed step shows up as a wrong number, not a rounding question.
"""

from __future__ import annotations

import torch

from labkit.collectives import chunk_bounds
from labkit.grading import CheckFailed
from labkit.launch import launch

WORLD_SIZES = (2, 3, 4)
SIZES = (12, 7, 13, 3, 101)  # 3 < 4 ranks: empty chunks
LAUNCH_TIMEOUT = 30.0  # seconds a distributed check may take before the ranks count as hung
BUILT_IN_COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather",
                        "all_gather_into_tensor", "broadcast", "reduce", "gather", "scatter", "all_to_all",
                        "all_to_all_single", "all_gather_object")


def _data(rank: int, n: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + n)
    return torch.randint(-50, 50, (n,), generator=generator).double()


def _truth(world_size: int, n: int) -> torch.Tensor:
    return sum(_data(rank, n) for rank in range(world_size))


def _run_phase(phase: str, function, forbid_built_ins: bool):
    """Runs on every rank: apply the student's function to each size, return what came out."""
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    if forbid_built_ins:
        def refuse(name):
            def built_in(*args, **kwargs):
                raise RuntimeError(f"used torch.distributed.{name}: build it from isend/irecv instead")
            return built_in
        for name in BUILT_IN_COLLECTIVES:
            setattr(dist, name, refuse(name))
    outputs = []
    for n in SIZES:
        flat = _data(rank, n)
        if phase == "all_gather":  # only this rank's chunk is valid: the rest is poison
            start, stop = chunk_bounds(n, world_size)[rank]
            full = _truth(world_size, n)
            flat = torch.full((n,), float("nan"), dtype=torch.float64)
            flat[start:stop] = full[start:stop]
        result = function(flat)
        outputs.append((flat.clone(), None if result is None else result.detach().clone()))
    return outputs


def _check(module, phase: str, name: str, forbid_built_ins: bool = False) -> None:
    for world_size in WORLD_SIZES:
        per_rank = launch(_run_phase, phase, getattr(module, name), forbid_built_ins, nprocs=world_size,
                          timeout=LAUNCH_TIMEOUT, rank_output="none")
        for rank, outputs in enumerate(per_rank):
            for n, (flat, result) in zip(SIZES, outputs, strict=True):
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
                else:
                    if not torch.equal(flat, truth):
                        wrong = _first_difference(flat, truth)
                        owner = next(c for c, (a, b) in enumerate(chunk_bounds(n, world_size)) if a <= wrong < b)
                        raise CheckFailed(f"{where}: element {wrong} (chunk {owner}) is {flat[wrong].item():g}, "
                                          f"expected {truth[wrong].item():g} — a chunk index or a step off?")


def _first_difference(got: torch.Tensor, expected: torch.Tensor) -> int:
    differs = ~((got == expected) | (got.isnan() & expected.isnan()))
    return int(differs.nonzero()[0].item())


def check_reduce_scatter(module) -> None:
    """ring_reduce_scatter leaves rank r holding chunk r summed over all ranks (2-4 ranks, uneven sizes)"""
    _check(module, "reduce_scatter", "ring_reduce_scatter")


def check_all_gather(module) -> None:
    """ring_all_gather fills every chunk from the rank that owns it (2-4 ranks, uneven sizes)"""
    _check(module, "all_gather", "ring_all_gather")


def check_all_reduce(module) -> None:
    """ring_all_reduce equals the sum over all ranks, on every rank (2-4 ranks, uneven sizes)"""
    _check(module, "all_reduce", "ring_all_reduce")


def check_point_to_point_only(module) -> None:
    """ring_all_reduce is built from point-to-point messages only (no built-in collective)"""
    _check(module, "all_reduce", "ring_all_reduce", forbid_built_ins=True)


for _check_fn in (check_reduce_scatter, check_all_gather, check_all_reduce, check_point_to_point_only):
    _check_fn.timeout = 120.0

CHECKS = [check_reduce_scatter, check_all_gather, check_all_reduce, check_point_to_point_only]
