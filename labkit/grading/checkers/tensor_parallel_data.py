"""What every check of exercise 06 shares (:mod:`labkit.grading.checkers.tensor_parallel`): the numbers, by key,
the same in every process; the layouts of tensor-parallel groups the ranks form; one launch that runs a test in
every group; and the comparison that says by what factor a result is off.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch

# launch() imports torch._dynamo before it forks the ranks, a second in every check process that lacks it:
# import it once, here, and the check processes forked later inherit it.
import torch._dynamo  # noqa: F401
import torch.distributed as dist

from labkit.grading import CheckFailed, compact
from labkit.launch import launch

LAUNCH_TIMEOUT = 60.0  # seconds a distributed check may take before the ranks count as hung
TOLERANCE = 1e-9  # float64 on one machine; the wrong answers miss by a factor or by a bias
# Besides labkit.parallel: torch's own tensor parallelism (DTensor, parallelize_module) and the differentiable
# collectives of torch.distributed.nn; dist.all_reduce, which f and g are built from, stays.
BUILT_INS = ("torch.distributed.tensor._api", "torch.distributed.tensor.parallel",
             "torch.distributed.nn.functional")
WORLD_SIZE = 4
# The groups of each layout (every rank is in one): t = 4, the default group (None); t = 3, not a power of two,
# beside [3], a group of one without rank 0 (t = 1); t = 2 twice, the second without rank 0.
LAYOUTS = [[[0, 1, 2, 3]], [[0, 1, 2], [3]], [[0, 1], [2, 3]]]
IN_FEATURES, HIDDEN, OUT_FEATURES = 12, 24, 10  # IN_FEATURES and HIDDEN divide by 2, 3 and 4
BATCH_SHAPES = [(5,), (2, 3)]  # inputs [5, features] and [2, 3, features]


def data(shape: tuple[int, ...], *key: object) -> torch.Tensor:
    """The same float64 numbers for the same key, in every process."""
    generator = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    return torch.randn(shape, generator=generator, dtype=torch.float64)


def block(size: int, rank: int, world_size: int) -> slice:
    return slice(rank * size // world_size, (rank + 1) * size // world_size)


def cuts(kind: str, r: int, t: int) -> dict[str, tuple]:
    """What rank ``r`` of ``t`` holds of a column- or row-parallel layer's input, weight, bias and output."""
    features = block(HIDDEN, r, t)  # the column layer's output features, the row layer's input features
    if kind == "column":
        return {"x": (...,), "weight": (features,), "bias": (features,), "y": (..., features)}
    return {"x": (..., features), "weight": (slice(None), features), "bias": (...,), "y": (...,)}


def layer(kind: str, key: tuple, index: int) -> dict[str, torch.Tensor]:
    """The dense layer's input, weight, bias and the gradient of its output: IN->HIDDEN or HIDDEN->OUT."""
    features_in, features_out = (IN_FEATURES, HIDDEN) if kind == "column" else (HIDDEN, OUT_FEATURES)
    batch = BATCH_SHAPES[index]
    return {"x": data((*batch, features_in), kind, "x", key, index),
            "weight": data((features_out, features_in), kind, "weight", key, index),
            "bias": data((features_out,), kind, "bias", key, index),
            "upstream": data((*batch, features_out), kind, "upstream", key, index)}


def _on_every_group(test: Callable, module) -> dict:
    """Runs on every rank: ``test(module, ranks, group, index)`` in this rank's group of each layout."""
    rank, results = dist.get_rank(), {}
    for groups in LAYOUTS:
        for ranks in groups:  # every rank creates every group, in the same order
            group = None if len(ranks) == WORLD_SIZE else dist.new_group(ranks)
            if rank in ranks:
                results[tuple(ranks)] = [test(module, ranks, group, index) for index in range(len(BATCH_SHAPES))]
    return compact(results)


def on_every_group(test: Callable, module) -> list[tuple[list[int], list[list]]]:
    """``(ranks, results)`` for every group, in layout order; ``results[r][index]`` from the group's rank r."""
    per_rank = launch(_on_every_group, test, module, nprocs=WORLD_SIZE, timeout=LAUNCH_TIMEOUT,
                      rank_output="none")
    return [(ranks, [per_rank[rank][tuple(ranks)] for rank in ranks]) for groups in LAYOUTS for ranks in groups]


def is_(got: torch.Tensor | None, want: torch.Tensor, factor: float = 1.0) -> bool:
    """``got`` is ``factor * want``, within the tolerance."""
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
        return False
    return (got - factor * want).abs().max().item() <= TOLERANCE * max(1.0, abs(factor))


def compare(got: torch.Tensor | None, want: torch.Tensor, what: str, hint: str = "",
            truth: str = "the dense layers'") -> None:
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"{what} is {got!r}, not a tensor" + (" (is every step differentiable, nothing "
                                                                 "detached?)" if got is None else ""))
    if tuple(got.shape) != tuple(want.shape):
        raise CheckFailed(f"{what} has shape {list(got.shape)}, expected {list(want.shape)}")
    worst = (got - want).abs().max().item()
    if worst > TOLERANCE:
        factor = ((got * want).sum() / (want * want).sum()).item() if want.any() else 0.0
        times = f"; it is {factor:.4g} times the right one" if is_(got, want, factor) and factor else ""
        raise CheckFailed(f"{what} differs from {truth} by up to {worst:.2e}{times}{hint}")


def where(ranks: list[int], r: int, index: int, features: str = "features") -> str:
    group = "the default group (None)" if len(ranks) == WORLD_SIZE else f"the group of ranks {ranks}"
    return f"t={len(ranks)}, {group}, its rank {r}, inputs [{', '.join(map(str, BATCH_SHAPES[index]))}, {features}]"


def group_hint(ranks: list[int]) -> str:
    return ("" if len(ranks) == WORLD_SIZE else " (the same passed on the default group of 4 ranks: do you pass "
            "group=group to every collective?)")
