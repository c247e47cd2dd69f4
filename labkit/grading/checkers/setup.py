"""Checks for exercise 00 (``00_setup.py``): shard_bounds, global_sum, global_mean.

Each check is a function of the student's module that raises ``CheckFailed`` with a hint.  Its docstring's
first line is what the student sees.  The distributed checks run the student's functions on several gloo
ranks, each holding a different, unevenly sized shard, so an answer that skips the all-reduce, or averages the
per-rank means, gets a different number than the truth.  Every check runs under
:func:`labkit.grading.guard.no_shortcuts`: labkit's own implementations raise, among them ``chunk_bounds``,
which is ``shard_bounds`` verbatim.
"""

from __future__ import annotations

import torch

from labkit.grading import CheckFailed, guard
from labkit.launch import launch

SIZES = (0, 1, 2, 5, 7, 10, 16, 17, 101)
LAUNCH_TIMEOUT = 30.0  # seconds a distributed check may take before the ranks count as hung
WORLD_SIZES = (1, 2, 3, 4, 5, 8)


def _bounds_for_every_rank(module, n: int, world_size: int) -> list[tuple[int, int]]:
    bounds = []
    for rank in range(world_size):
        result = module.shard_bounds(n, rank, world_size)
        if not (isinstance(result, tuple) and len(result) == 2 and all(isinstance(x, int) for x in result)):
            raise CheckFailed(f"shard_bounds({n}, {rank}, {world_size}) returned {result!r}; "
                              "expected a tuple of two ints (start, stop)")
        bounds.append(result)
    return bounds


@guard.no_shortcuts
def check_shards_cover_every_item_once(module) -> None:
    """shard_bounds gives every item to exactly one rank, in contiguous slices in rank order"""
    for n in SIZES:
        for world_size in WORLD_SIZES:
            bounds = _bounds_for_every_rank(module, n, world_size)
            owned = [item for start, stop in bounds for item in range(start, stop)]
            if owned != list(range(n)) or any(stop < start for start, stop in bounds):
                raise CheckFailed(f"n={n}, world_size={world_size}: your slices are {bounds}; together they must "
                                  f"be 0..{n} with no gap or overlap (items owned: {owned[:12]}"
                                  f"{'...' if len(owned) > 12 else ''})")


@guard.no_shortcuts
def check_shards_are_balanced(module) -> None:
    """shard_bounds balances the load: slice sizes differ by at most one, the larger ones first"""
    for n in SIZES:
        for world_size in WORLD_SIZES:
            bounds = _bounds_for_every_rank(module, n, world_size)
            sizes = [stop - start for start, stop in bounds]
            expected = [n // world_size + (1 if rank < n % world_size else 0) for rank in range(world_size)]
            if sizes != expected:
                raise CheckFailed(f"n={n}, world_size={world_size}: your slice sizes are {sizes}, expected "
                                  f"{expected} (the slowest rank sets the pace, so no rank may hold more than "
                                  "one extra item)")


def _shards(n: int, world_size: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    data = torch.randn(n, generator=generator, dtype=torch.float64) + 0.5
    # deliberately uneven: rank r gets a slice whose length grows with r
    weights = [rank + 1 for rank in range(world_size)]
    stops = [round(n * sum(weights[: rank + 1]) / sum(weights)) for rank in range(world_size)]
    starts = [0] + stops[:-1]
    return [data[start:stop].clone() for start, stop in zip(starts, stops, strict=True)]


def _run_on_rank(function, shards: list[torch.Tensor]):
    import torch.distributed as dist

    local = shards[dist.get_rank()]
    before = local.clone()
    result = function(local)
    return result, torch.equal(local, before)


def _distributed(module, name: str, n: int, world_size: int, reduce) -> None:
    shards = _shards(n, world_size, seed=n * 31 + world_size)
    truth = reduce(torch.cat(shards))
    outputs = launch(_run_on_rank, getattr(module, name), shards, nprocs=world_size, timeout=LAUNCH_TIMEOUT,
                     rank_output="none")
    sizes = [len(shard) for shard in shards]
    for rank, (result, untouched) in enumerate(outputs):
        if not isinstance(result, torch.Tensor):
            raise CheckFailed(f"{name} returned {type(result).__name__} on rank {rank}; expected a tensor")
        if not untouched:
            raise CheckFailed(f"{name} modified its input tensor on rank {rank}: all_reduce works in place, so "
                              "reduce a new tensor, not the caller's data")
        if result.numel() != 1 or not torch.allclose(result.double().reshape(()), truth, rtol=1e-6, atol=1e-9):
            got = result.reshape(-1)[:3].tolist()
            raise CheckFailed(f"{world_size} ranks holding {sizes} items: rank {rank} returned {got}, the true "
                              f"value over all ranks is {truth.item():.6f}")


@guard.no_shortcuts
def check_global_sum(module) -> None:
    """global_sum returns the sum over every rank's data, on every rank"""
    for n, world_size in ((10, 2), (13, 3), (40, 4)):
        _distributed(module, "global_sum", n, world_size, torch.sum)


check_global_sum.timeout = 90.0


@guard.no_shortcuts
def check_global_mean(module) -> None:
    """global_mean weighs every item equally when ranks hold different numbers of items"""
    for n, world_size in ((10, 2), (13, 3), (3, 4)):  # 3 items on 4 ranks: one rank holds nothing
        _distributed(module, "global_mean", n, world_size, torch.mean)


check_global_mean.timeout = 90.0

CHECKS = [check_shards_cover_every_item_once, check_shards_are_balanced, check_global_sum, check_global_mean]
