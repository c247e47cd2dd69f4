"""Checks for exercise 02 (``02_data_parallel.py``): broadcast_parameters, average_gradient_hook, assign_buckets.

The distributed checks build a small model with a *different* seed on every rank (so a missing broadcast
shows), give every rank a different slice of one batch, and compare against one process training on the whole
batch — the definition of correct data parallelism.  float64 keeps the comparison tight (1e-10; both runs are
on this machine, and the wrong answers miss by a factor).  ``labkit.parallel`` (DDP's broadcast and bucket rule)
is forbidden to the student by :mod:`labkit.grading.guard`; ``torch.distributed``'s collectives are what the
exercise teaches, and stay.
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
STEPS = 4
BATCH = 24  # split over 2 or 3 ranks: 12 or 8 samples each


class _Net(nn.Module):
    """Two layers and a buffer (a fixed input scaling) that must be broadcast too."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out = nn.Linear(6, 16), nn.Linear(16, 3)
        self.register_buffer("input_scale", torch.rand(6) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x * self.input_scale)))


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return _Net().double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return (torch.randn(BATCH, 6, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (BATCH,), generator=generator))


def _single_process_training() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    model = _model(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    first_gradients = None
    for step in range(STEPS):
        x, y = _batch(step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if first_gradients is None:
            first_gradients = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], first_gradients


def _data_parallel_training(broadcast_parameters, average_gradient_hook):
    """Runs on every rank: the student's broadcast + hook around a plain training loop."""
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _model(seed=rank)  # different on every rank: broadcast must fix that
    broadcast_parameters(model)
    after_broadcast = [p.detach().clone() for p in model.parameters()] + [b.clone() for b in model.buffers()]
    for parameter in model.parameters():
        parameter.register_post_accumulate_grad_hook(average_gradient_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    share = BATCH // world_size
    first_gradients = None
    for step in range(STEPS):
        x, y = _batch(step)
        x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if first_gradients is None:
            first_gradients = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
    return after_broadcast, first_gradients, [p.detach().clone() for p in model.parameters()]


def _reference_broadcast(model: nn.Module) -> None:
    import torch.distributed as dist

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=0)


def _reference_hook(parameter: torch.Tensor) -> None:
    import torch.distributed as dist

    dist.all_reduce(parameter.grad)
    parameter.grad /= dist.get_world_size()


def _run(module, world_size: int, broadcast: bool = True, hook: bool = True):
    """Train on ``world_size`` ranks with the student's broadcast and/or hook (the reference otherwise), so
    each check grades one function."""
    return launch(_data_parallel_training, module.broadcast_parameters if broadcast else _reference_broadcast,
                  module.average_gradient_hook if hook else _reference_hook,
                  nprocs=world_size, timeout=LAUNCH_TIMEOUT, rank_output="none")


@guard.no_shortcuts
def check_broadcast(module) -> None:
    """broadcast_parameters gives every rank rank 0's parameters and buffers"""
    original = _model(seed=0)
    reference = [p.detach() for p in original.parameters()] + list(original.buffers())
    for world_size in (2, 3):
        for rank, (after_broadcast, _gradients, _final) in enumerate(_run(module, world_size, hook=False)):
            for index, (got, expected) in enumerate(zip(after_broadcast, reference, strict=True)):
                if not torch.equal(got, expected):
                    raise CheckFailed(f"{world_size} ranks: after broadcast_parameters, tensor {index} on rank {rank} "
                                      "differs from rank 0's initial value (every replica must start identical; "
                                      "did you broadcast every parameter and buffer from src=0?)")


@guard.no_shortcuts
def check_gradients_are_averaged(module) -> None:
    """average_gradient_hook leaves every rank with the gradient of the whole batch (the average)"""
    _final, expected = _single_process_training()
    for world_size in (2, 3):
        for rank, (_after, gradients, _final_params) in enumerate(_run(module, world_size, broadcast=False)):
            for index, (got, want) in enumerate(zip(gradients, expected, strict=True)):
                if not torch.allclose(got, want, rtol=1e-9, atol=1e-10):
                    ratio = (got.norm() / want.norm()).item() if want.norm() > 0 else float("nan")
                    hint = (f" (it is {ratio:.2f}x the right size: a sum instead of an average?)"
                            if abs(ratio - world_size) < 0.05 else "")
                    raise CheckFailed(f"{world_size} ranks: gradient {index} on rank {rank} is not the whole batch's "
                                      f"gradient{hint}")


@guard.no_shortcuts
def check_training_matches_single_process(module) -> None:
    """training with your broadcast and hook equals one process training on the whole batch"""
    expected, _gradients = _single_process_training()
    for world_size in (2, 3):
        for rank, (_after, _gradients, final) in enumerate(_run(module, world_size)):
            worst = max((got - want).abs().max().item() for got, want in zip(final, expected, strict=True))
            if worst > 1e-10:
                raise CheckFailed(f"{world_size} ranks: after {STEPS} SGD steps rank {rank}'s parameters differ from "
                                  f"single-process training by up to {worst:.2e}")


BUCKET_CASES = [
    ([4, 4, 4, 4, 4], 8, [[4, 3], [2, 1], [0]]),
    ([4, 4, 4], 8, [[2, 1], [0]]),  # a bucket may reach the cap exactly
    ([4, 4, 4, 4, 4], 0, [[4], [3], [2], [1], [0]]),
    ([4, 4, 4, 4, 4], 1000, [[4, 3, 2, 1, 0]]),
    ([100, 1, 1, 1, 100], 50, [[4], [3, 2, 1], [0]]),  # a parameter larger than the cap sits alone
    ([10, 20, 30], 25, [[2], [1], [0]]),
    ([8], 4, [[0]]),
    ([], 8, []),
]


@guard.no_shortcuts
def check_buckets(module) -> None:
    """assign_buckets fills buckets from the last parameter to the first, never past the cap"""
    for sizes, cap, expected in BUCKET_CASES:
        got = module.assign_buckets(list(sizes), cap)
        if got != expected:
            raise CheckFailed(f"assign_buckets({sizes}, {cap}) returned {got}, expected {expected} (walk the "
                              "parameters from last to first; close a bucket before a parameter that would push it past the cap)")


for _check_fn in (check_broadcast, check_gradients_are_averaged, check_training_matches_single_process):
    _check_fn.timeout = 120.0

CHECKS = [check_broadcast, check_gradients_are_averaged, check_training_matches_single_process, check_buckets]
