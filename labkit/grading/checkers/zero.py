"""Checks for exercise 05 (``05_zero.py``): shard_parameters, make_local_optimizer, zero1_step.

Each check grades one function; the others are the reference's.  ``shard_parameters`` is compared with the
greedy rule on size lists built to tell it apart from round-robin, from greedy without the sort and from a
count of parameters instead of elements.  ``make_local_optimizer`` runs in this process for every rank of 2
and 3: its optimizer must hold state for exactly the rank's own parameters (an AdamW over all of them is
DDP's memory, not ZeRO's) and move them as AdamW does.  ``zero1_step`` trains a small model on 2 and 3 gloo
ranks, the same batch on every rank (so the gradients are already the average), and every rank must end with
the parameters of one process training with AdamW over all of them — which fails without the broadcast, since
each rank then only ever sees its own parameters move.  That AdamW's ``eps`` is about the gradients' size, so
that a step on gradients summed once more over the ranks misses by 2e-2, not by the 5e-7 of the default eps.
Tensors have up to four dimensions (and none), so ``len(p)`` for ``p.numel()`` fails.  Every comparison is
between float64 runs on this machine (1e-9).  ``labkit.parallel`` (its ZeRO and its sharding rule) is forbidden
to the student by :mod:`labkit.grading.guard`.
"""

from __future__ import annotations

import torch

# Building a torch optimizer imports torch._dynamo, seconds in every check process and rank that lacks it:
# import it once, here, and the checks and ranks forked later inherit it.
import torch._dynamo  # noqa: F401
from torch import nn

from labkit.grading import CheckFailed, guard
from labkit.launch import launch

LAUNCH_TIMEOUT = 60.0  # seconds a distributed check may take before the ranks count as hung
STEPS = 3
BATCH = 16
LR, WEIGHT_DECAY = 0.05, 0.1
# zero1_step's AdamW takes eps about the size of the gradients, so that its step depends on how large they are
# (with the default 1e-8 a step on gradients twice too large moves the weights by 5e-7 more; with 0.1, by 2e-2).
ZERO1_EPS = 0.1
# Every comparison is between runs on this machine, in float64, with the same kernels (ranks may split matrix
# products over other thread counts: 1e-16 relative); the wrong answers miss by 1e-3 or more.
TOLERANCE = 1e-9

# --------------------------------------------------------------------------------------------------------
# The reference


def _reference_shard_parameters(sizes: list[int], world_size: int) -> list[int]:
    load, owners = [0] * world_size, [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: sizes[i], reverse=True):
        rank = load.index(min(load))
        owners[index], load[rank] = rank, load[rank] + sizes[index]
    return owners


def _reference_make_local_optimizer(parameters, owners, rank, lr, weight_decay, **options) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p, owner in zip(parameters, owners, strict=True) if owner == rank],
                             lr=lr, weight_decay=weight_decay, **options)


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
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, eps=ZERO1_EPS)
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

# (shapes, world_size, owners): tensors of up to four dimensions (and a 0-d one), so that len(p) or p.shape[0]
# in place of p.numel() gives other owners.
SHARD_CASES = [
    ([(10, 10), (1,), (1,), (1, 1)], 2, [0, 1, 1, 1]),  # round-robin by index gives [0, 1, 0, 1]
    ([(1,), (2, 1), (3,), (2, 2), (5,), (2, 3)], 3, [0, 1, 2, 2, 1, 0]),  # no sort: [0, 1, 2, 0, 1, 2]
    ([(5,), (5,), (5,), (5,), (4, 5)], 2, [1, 1, 1, 1, 0]),  # balancing the count of parameters: [1, 0, 1, 0, 0]
    ([(4,), (2, 4), (2, 2), (8,)], 2, [0, 0, 1, 1]),  # ties: equal sizes in index order, the lowest least-loaded
    ([(10,), (2, 5), (5, 2), (10, 1), (1, 10)], 3, [0, 1, 2, 0, 1]),
    ([(16, 6), (16,), (3, 16), (3,)], 3, [0, 2, 1, 2]),  # the model the other checks train
    ([(3, 4, 5), (60,), (7, 9), (2, 2, 2, 2), (5, 1, 1)], 3, [1, 2, 0, 1, 2]),  # uneven, up to 4-D
    ([(7,), (), (3,)], 4, [0, 2, 1]),  # a 0-d parameter (one element); more ranks than parameters
    ([], 2, []),
]


def _load(sizes: list[int], owners: list[int], world_size: int) -> list[int]:
    load = [0] * world_size
    for size, owner in zip(sizes, owners, strict=True):
        load[owner] += size
    return load


@guard.no_shortcuts
def check_shard_parameters(module) -> None:
    """shard_parameters gives each parameter, largest first, to the rank holding the fewest elements"""
    for shapes, world_size, expected in SHARD_CASES:
        tensors = [torch.zeros(shape) for shape in shapes]
        sizes = [tensor.numel() for tensor in tensors]
        call = f"shard_parameters(tensors of shapes {shapes}, world_size={world_size})"
        got = module.shard_parameters(tensors, world_size)
        try:
            got = [int(owner) for owner in got]
        except (TypeError, ValueError):
            raise CheckFailed(f"{call} returned {got!r}; return a list with the owner rank of each parameter "
                              "(did you forget the return?)") from None
        if len(got) != len(sizes) or not all(0 <= owner < world_size for owner in got):
            raise CheckFailed(f"{call} returned {got}: expected {len(sizes)} ranks (one per parameter), each in "
                              f"0..{world_size - 1}")
        if got != expected:
            rows = [tensor.shape[0] if tensor.dim() else 1 for tensor in tensors]
            hint = (" — that balances len(p), the first dimension: count elements with p.numel()"
                    if got == _reference_shard_parameters(rows, world_size) else "")
            raise CheckFailed(f"{call} returned {got}, expected {expected} (elements per rank: yours "
                              f"{_load(sizes, got, world_size)}, expected {_load(sizes, expected, world_size)}; "
                              "take the parameters largest first, equal sizes in index order, each to the rank "
                              f"with the fewest elements so far, the lowest rank on a tie){hint}")


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


@guard.no_shortcuts
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


def _zero1_training(zero1_step) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    """Runs on every rank: the reference shard and local optimizer, the student's step, the same data.  Returns
    the initial and final parameters, and how much larger the gradients were after the first step than before
    (1 when zero1_step leaves them alone, as it should)."""
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _model()  # the same seed on every rank: no broadcast needed at the start
    parameters = list(model.parameters())
    initial = [p.detach().clone() for p in parameters]
    owners = _reference_shard_parameters([p.numel() for p in parameters], world_size)
    local_optimizer = _reference_make_local_optimizer(parameters, owners, rank, LR, WEIGHT_DECAY, eps=ZERO1_EPS)
    growth = 1.0
    for step in range(STEPS):
        x, y = _batch(step)  # the whole batch on every rank: the gradients are already the average
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        before = torch.cat([p.grad.reshape(-1) for p in parameters]).norm()
        zero1_step(parameters, list(owners), local_optimizer)
        if step == 0 and all(p.grad is not None for p in parameters):
            growth = (torch.cat([p.grad.reshape(-1) for p in parameters]).norm() / before).item()
    return initial, [p.detach().clone() for p in parameters], growth


@guard.no_shortcuts
def check_zero1_step(module) -> None:
    """zero1_step leaves every rank with the parameters of single-process AdamW (step, then broadcast)"""
    expected = _single_process_training()
    for world_size in (2, 3):
        owners = _owners(world_size)
        results = launch(_zero1_training, module.zero1_step, nprocs=world_size, timeout=LAUNCH_TIMEOUT,
                         rank_output="none")
        for rank, (initial, final, _growth) in enumerate(results):  # a parameter that never moved: clearest hint
            for index, (got, want, before) in enumerate(zip(final, expected, initial, strict=True)):
                if torch.equal(got, before) and not torch.equal(want, before):
                    raise CheckFailed(f"{world_size} ranks: after {STEPS} steps, parameter {index} (owned by rank "
                                      f"{owners[index]}) on rank {rank} still holds its initial value: after the "
                                      "local step, broadcast each parameter from its owner (src=owners[i]) so every "
                                      "rank gets the update")
        for rank, (_initial, final, growth) in enumerate(results):
            for index, (got, want) in enumerate(zip(final, expected, strict=True)):
                worst = (got - want).abs().max().item()
                if worst <= TOLERANCE:
                    continue
                others = [other for other, (_, final_other, _) in enumerate(results)
                          if not torch.equal(final_other[index], got)]
                if abs(growth - 1) > 1e-6:
                    raise CheckFailed(f"{world_size} ranks: after {STEPS} steps, parameter {index} on rank {rank} "
                                      f"differs from single-process AdamW by up to {worst:.2e}, and your zero1_step "
                                      f"made the gradients {growth:.3g}x as large: they arrive already averaged "
                                      "(summing them again over the ranks multiplies them by the world size); "
                                      "step the local optimizer on them as they are")
                raise CheckFailed(f"{world_size} ranks: after {STEPS} steps, parameter {index} (owned by rank "
                                  f"{owners[index]}) on rank {rank} differs from single-process AdamW by up to "
                                  f"{worst:.2e}"
                                  + (f" and from rank(s) {others}'s copy: the ranks diverged (broadcast every "
                                     "parameter from its owner after the step)" if others else
                                     " (step the local optimizer once, then broadcast each parameter from its owner)"))


check_zero1_step.timeout = 120.0

CHECKS = [check_shard_parameters, check_local_optimizer, check_zero1_step]
