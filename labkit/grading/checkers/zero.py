"""Checks for exercise 05 (``05_zero.py``): shard_parameters, make_local_optimizer, zero1_step.

Each check grades one function; the others are the reference's.  ``shard_parameters`` is compared with the
greedy rule on size lists built to tell it apart from round-robin, from greedy without the sort and from a
count of parameters instead of elements.  ``make_local_optimizer`` runs in this process for every rank of 2
and 3: its optimizer must hold state for exactly the rank's own parameters (an AdamW over all of them is
DDP's memory, not ZeRO's) and move them as AdamW does.  ``zero1_step`` trains a small model on 2 and 3 gloo
ranks, the same batch on every rank (so the gradients are already the average), and every rank must end with
the parameters of one process training with AdamW over all of them — which fails without the broadcast, since
each rank then only ever sees its own parameters move.  float64 keeps the comparisons tight (1e-10).
"""

from __future__ import annotations

import torch
from torch import nn

from labkit.grading import CheckFailed
from labkit.launch import launch

LAUNCH_TIMEOUT = 60.0  # seconds a distributed check may take before the ranks count as hung
STEPS = 3
BATCH = 16
LR, WEIGHT_DECAY = 0.05, 0.1
TOLERANCE = 1e-10

# --------------------------------------------------------------------------------------------------------
# The reference


def _reference_shard_parameters(sizes: list[int], world_size: int) -> list[int]:
    load, owners = [0] * world_size, [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: sizes[i], reverse=True):
        rank = load.index(min(load))
        owners[index], load[rank] = rank, load[rank] + sizes[index]
    return owners


def _reference_make_local_optimizer(parameters, owners, rank, lr, weight_decay) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p, owner in zip(parameters, owners, strict=True) if owner == rank],
                             lr=lr, weight_decay=weight_decay)


class _Net(nn.Module):
    """Four parameters of 96, 16, 48 and 3 elements: on 3 ranks the owners are [0, 2, 1, 2]."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Net().double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(200 + step)
    return (torch.randn(BATCH, 6, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (BATCH,), generator=generator))


def _single_process_training() -> list[torch.Tensor]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for step in range(STEPS):
        x, y = _batch(step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _owners(world_size: int) -> list[int]:
    return _reference_shard_parameters([p.numel() for p in _model().parameters()], world_size)


# --------------------------------------------------------------------------------------------------------
# shard_parameters

# (sizes, world_size, owners)
SHARD_CASES = [
    ([100, 1, 1, 1], 2, [0, 1, 1, 1]),  # round-robin by index gives [0, 1, 0, 1]
    ([1, 2, 3, 4, 5, 6], 3, [0, 1, 2, 2, 1, 0]),  # greedy in index order (no sort) gives [0, 1, 2, 0, 1, 2]
    ([5, 5, 5, 5, 20], 2, [1, 1, 1, 1, 0]),  # balancing the count of parameters gives [1, 0, 1, 0, 0]
    ([4, 8, 4, 8], 2, [0, 0, 1, 1]),  # ties: equal sizes in index order, the lowest least-loaded rank
    ([10, 10, 10, 10, 10], 3, [0, 1, 2, 0, 1]),
    ([96, 16, 48, 3], 3, [0, 2, 1, 2]),  # the model the other checks train
    ([7, 3], 4, [0, 1]),  # more ranks than parameters
    ([], 2, []),
]


def _load(sizes: list[int], owners: list[int], world_size: int) -> list[int]:
    load = [0] * world_size
    for size, owner in zip(sizes, owners, strict=True):
        load[owner] += size
    return load


def check_shard_parameters(module) -> None:
    """shard_parameters gives each parameter, largest first, to the rank holding the fewest elements"""
    for sizes, world_size, expected in SHARD_CASES:
        call = f"shard_parameters(tensors of {sizes} elements, world_size={world_size})"
        got = module.shard_parameters([torch.zeros(size) for size in sizes], world_size)
        try:
            got = [int(owner) for owner in got]
        except (TypeError, ValueError):
            raise CheckFailed(f"{call} returned {got!r}; return a list with the owner rank of each parameter "
                              "(did you forget the return?)") from None
        if len(got) != len(sizes) or not all(0 <= owner < world_size for owner in got):
            raise CheckFailed(f"{call} returned {got}: expected {len(sizes)} ranks (one per parameter), each in "
                              f"0..{world_size - 1}")
        if got != expected:
            raise CheckFailed(f"{call} returned {got}, expected {expected} (elements per rank: yours "
                              f"{_load(sizes, got, world_size)}, expected {_load(sizes, expected, world_size)}; "
                              "take the parameters largest first, equal sizes in index order, each to the rank "
                              "with the fewest elements so far, the lowest rank on a tie)")


# --------------------------------------------------------------------------------------------------------
# make_local_optimizer


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of per-element state (``exp_avg``, ``exp_avg_sq``); AdamW's scalar ``step`` is not counted."""
    return sum(value.nbytes for state in optimizer.state.values() for value in state.values()
               if torch.is_tensor(value) and value.dim() >= 1)


def _gradients(parameters: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(300 + step)
    return [torch.randn(p.shape, generator=generator, dtype=p.dtype) for p in parameters]


def _fresh_parameters() -> list[nn.Parameter]:
    return [nn.Parameter(p.detach().clone()) for p in _model().parameters()]


def check_local_optimizer(module) -> None:
    """make_local_optimizer builds AdamW over this rank's parameters only: state for its shard alone"""
    expected_parameters = _fresh_parameters()
    reference = torch.optim.AdamW(expected_parameters, lr=LR, weight_decay=WEIGHT_DECAY)
    for step in range(2):
        for p, gradient in zip(expected_parameters, _gradients(expected_parameters, step), strict=True):
            p.grad = gradient
        reference.step()
    for world_size in (2, 3):
        owners = _owners(world_size)
        for rank in range(world_size):
            parameters = _fresh_parameters()
            initial = [p.detach().clone() for p in parameters]
            mine = [index for index, owner in enumerate(owners) if owner == rank]
            where = f"rank {rank} of {world_size} (owners {owners})"
            optimizer = module.make_local_optimizer(parameters, list(owners), rank, LR, WEIGHT_DECAY)
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise CheckFailed(f"on {where} make_local_optimizer returned {optimizer!r}; return the "
                                  "torch.optim.AdamW you built (did you forget the return?)")
            for step in range(2):
                for p, gradient in zip(parameters, _gradients(parameters, step), strict=True):
                    p.grad = gradient
                optimizer.step()
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
            stateful = {id(p) for p in optimizer.state}
            index_of = {id(p): index for index, p in enumerate(parameters)}
            if held != {id(parameters[index]) for index in mine} or stateful - held:
                extra = sorted(index_of.get(key, -1) for key in held | stateful if index_of.get(key) not in mine)
                missing = sorted(index for index in mine if id(parameters[index]) not in held)
                expected_bytes = sum(parameters[index].nbytes for index in mine) * 2
                raise CheckFailed(
                    f"on {where} the optimizer works on parameters {sorted(index_of.get(k, -1) for k in held)} and "
                    f"after two steps holds {_state_bytes(optimizer)} bytes of state; this rank owns parameters "
                    f"{mine}: {expected_bytes} bytes of exp_avg and exp_avg_sq"
                    + (f" (parameters {extra} belong to other ranks: an optimizer over every parameter keeps DDP's "
                       "full copy of the state, which is what ZeRO-1 removes)" if extra else "")
                    + (f" (parameters {missing} are missing: nobody else updates them)" if missing else ""))
            for index, (got, before, want) in enumerate(zip(parameters, initial, expected_parameters, strict=True)):
                want = want if index in mine else before
                worst = (got.detach() - want).abs().max().item()
                if worst > TOLERANCE:
                    raise CheckFailed(
                        f"on {where}, after two steps parameter {index} differs by up to {worst:.2e} from "
                        + (f"torch.optim.AdamW(lr={LR}, weight_decay={WEIGHT_DECAY}) (AdamW, not Adam; pass lr and "
                           "weight_decay, leave the rest at their defaults)" if index in mine else
                           "its initial value: it belongs to another rank and must not move here"))


# --------------------------------------------------------------------------------------------------------
# zero1_step


def _zero1_training(zero1_step) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Runs on every rank: the reference shard and local optimizer, the student's step, the same data."""
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _model()  # the same seed on every rank: no broadcast needed at the start
    parameters = list(model.parameters())
    initial = [p.detach().clone() for p in parameters]
    owners = _reference_shard_parameters([p.numel() for p in parameters], world_size)
    local_optimizer = _reference_make_local_optimizer(parameters, owners, rank, LR, WEIGHT_DECAY)
    for step in range(STEPS):
        x, y = _batch(step)  # the whole batch on every rank: the gradients are already the average
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        zero1_step(parameters, list(owners), local_optimizer)
    return initial, [p.detach().clone() for p in parameters]


def check_zero1_step(module) -> None:
    """zero1_step leaves every rank with the parameters of single-process AdamW (step, then broadcast)"""
    expected = _single_process_training()
    for world_size in (2, 3):
        owners = _owners(world_size)
        results = launch(_zero1_training, module.zero1_step, nprocs=world_size, timeout=LAUNCH_TIMEOUT,
                         rank_output="none")
        for rank, (initial, final) in enumerate(results):  # a parameter that never moved is the clearest hint
            for index, (got, want, before) in enumerate(zip(final, expected, initial, strict=True)):
                if torch.equal(got, before) and not torch.equal(want, before):
                    raise CheckFailed(f"{world_size} ranks: after {STEPS} steps, parameter {index} (owned by rank "
                                      f"{owners[index]}) on rank {rank} still holds its initial value: after the "
                                      "local step, broadcast each parameter from its owner (src=owners[i]) so every "
                                      "rank gets the update")
        for rank, (_initial, final) in enumerate(results):
            for index, (got, want) in enumerate(zip(final, expected, strict=True)):
                worst = (got - want).abs().max().item()
                if worst <= TOLERANCE:
                    continue
                others = [other for other, (_, final_other) in enumerate(results)
                          if not torch.equal(final_other[index], got)]
                raise CheckFailed(f"{world_size} ranks: after {STEPS} steps, parameter {index} (owned by rank "
                                  f"{owners[index]}) on rank {rank} differs from single-process AdamW by up to "
                                  f"{worst:.2e}"
                                  + (f" and from rank(s) {others}'s copy: the ranks diverged (broadcast every "
                                     "parameter from its owner after the step)" if others else
                                     " (step the local optimizer once, then broadcast each parameter from its owner)"))


check_zero1_step.timeout = 120.0

CHECKS = [check_shard_parameters, check_local_optimizer, check_zero1_step]
