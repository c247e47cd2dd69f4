"""Checks for exercise 04 (``04_mixed_precision.py``): unscale_gradients, scaled_step, update_scale.

The first three checks grade one function each, on hand-made gradients and overflow sequences (``scaled_step``
runs with the reference ``unscale_gradients``, so a mistake there is not counted twice).  Gradients come in
several shapes (a scalar to a 3-D tensor), some parameters have none, and the optimizers have several parameter
groups, so code that unscales only the first group, or stops at the first overflow and leaves the later
gradients scaled, fails.  The last check trains a small model under fp16 autocast, engineered to overflow (a
high initial scale, a short growth interval, two batches of huge inputs), with two parameter groups, once with
the student's three functions and once with ``torch.amp.GradScaler``, and asks for the same scale before every
step, the same skipped steps and bit-identical weights.  Every scale in these runs is a power of two, so
dividing by it is exact and equality is the right test — on any CPU, since both runs use the same kernels.
``labkit.precision`` (labkit's own loss scaler) is forbidden to the student by :mod:`labkit.grading.guard`."""

from __future__ import annotations

import math

import torch

# Building a torch optimizer imports torch._dynamo, seconds in every check process and rank that lacks it:
# import it once, here, and the checks and ranks forked later inherit it.
import torch._dynamo  # noqa: F401
from torch import nn

from labkit.grading import CheckFailed, guard
from labkit.models import MLPConfig, TinyMLP

# --------------------------------------------------------------------------------------------------------
# The reference


def _reference_unscale_gradients(parameters: list[nn.Parameter], scale: float) -> bool:
    found_inf = False
    for parameter in parameters:
        if parameter.grad is not None:
            found_inf = found_inf or not torch.isfinite(parameter.grad).all().item()
            parameter.grad.div_(scale)
    return found_inf


def _reference_update_scale(scale: float, found_inf: bool, good_steps: int, growth_factor: float,
                            backoff_factor: float, growth_interval: int) -> tuple[float, int]:
    if found_inf:
        return scale * backoff_factor, 0
    if good_steps + 1 == growth_interval:
        return scale * growth_factor, 0
    return scale, good_steps + 1


# --------------------------------------------------------------------------------------------------------
# unscale_gradients


def _parameters(*gradients: torch.Tensor | None) -> list[nn.Parameter]:
    parameters = []
    for index, gradient in enumerate(gradients):
        parameter = nn.Parameter(torch.ones(gradient.shape if gradient is not None else (index + 1,)))
        parameter.grad = None if gradient is None else gradient.clone()
        parameters.append(parameter)
    return parameters


def _as_bool(value, call: str) -> bool:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return bool(value.item())
    if not isinstance(value, bool):
        raise CheckFailed(f"{call} returned {value!r}; return True or False (did you forget the return?)")
    return value


def _same(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal, nan for nan (an overflowed entry stays inf or nan after the division)."""
    return got.shape == expected.shape and bool(((got == expected) | (got.isnan() & expected.isnan())).all())


def _gradients(bad: float | None = None, where: int = 0) -> list[torch.Tensor | None]:
    """Gradients of several shapes (a vector, a matrix, a 3-D tensor, a scalar) and one missing, with ``bad``
    (inf or nan) in gradient ``where`` if given."""
    gradients = [torch.tensor([2.0, 4.0, -8.0]), None, torch.tensor([[1024.0, 0.5], [-3.0, 6.0]]),
                 torch.arange(24.0).reshape(2, 3, 4) - 12.0, torch.tensor(10.0)]
    if bad is not None:
        gradients[where].view(-1)[-1] = bad
    return gradients


@guard.no_shortcuts
def check_unscale_gradients(module) -> None:
    """unscale_gradients divides every gradient by the scale and reports inf and nan"""
    for bad, where in ((None, 0), (math.inf, 0), (-math.inf, 4), (math.nan, 3), (math.nan, 0)):
        gradients = _gradients(bad, where)
        parameters = _parameters(*gradients)
        what = "finite gradients" if bad is None else f"{bad} in gradient {where} of {len(gradients)}"
        call = f"unscale_gradients(parameters, scale=4.0) with {what}"
        found_inf = _as_bool(module.unscale_gradients(parameters, 4.0), call)
        if bad is None and found_inf:
            raise CheckFailed(f"{call} returned True; no gradient holds an inf or a nan")
        if bad is not None and not found_inf:
            raise CheckFailed(f"{call} returned False, expected True (torch.isfinite is False for inf, -inf "
                              "and nan; look at every gradient)")
        for index, (parameter, gradient) in enumerate(zip(parameters, gradients, strict=True)):
            if gradient is None:
                if parameter.grad is not None:
                    raise CheckFailed(f"{call}: parameter {index} had no gradient (None) but now has one; skip it")
                continue
            if not _same(parameter.grad, gradient / 4.0):
                if _same(parameter.grad, gradient * 4.0):
                    hint = " (multiplied instead of divided?)"
                elif _same(parameter.grad, gradient):
                    hint = (" — left as it was" + (f", after the {bad} in gradient {where}: divide every gradient "
                                                    "even after finding an overflow (the caller may still clip or "
                                                    "log them)" if bad is not None and index >= where else ""))
                else:
                    hint = ""
                raise CheckFailed(f"{call}: gradient {index} (shape {tuple(gradient.shape)}) is "
                                  f"{parameter.grad.tolist()}, expected {(gradient / 4.0).tolist()}{hint}")


# --------------------------------------------------------------------------------------------------------
# scaled_step


class _CountingSGD(torch.optim.SGD):
    steps = 0

    def step(self, closure=None):
        self.steps += 1
        return super().step(closure)


def _optimizer(gradients: list[list[torch.Tensor | None]]) -> tuple[list[nn.Parameter], _CountingSGD]:
    """SGD with momentum over one parameter group per list of gradients, each group with its own learning rate
    (a ``None`` gradient: a parameter that took no part in the loss)."""
    generator = torch.Generator().manual_seed(4)
    groups, parameters = [], []
    for index, group in enumerate(gradients):
        mine = []
        for gradient in group:
            shape = gradient.shape if gradient is not None else (3,)
            parameter = nn.Parameter(torch.randn(shape, generator=generator))
            parameter.grad = None if gradient is None else gradient.clone()
            mine.append(parameter)
        groups.append({"params": mine, "lr": 0.1 / (index + 1)})
        parameters += mine
    return parameters, _CountingSGD(groups, lr=0.1, momentum=0.9)


SCALED_STEP_GRADIENTS = [[torch.tensor([0.5, -1.0]), torch.tensor([[2.0, 0.25], [1.0, 4.0]])],
                         [torch.tensor([[[1.0, -2.0], [0.5, 3.0]]]), None],
                         [torch.tensor(1.5)]]


@guard.no_shortcuts
def check_scaled_step(module) -> None:
    """scaled_step unscales every parameter group, skips optimizer.step() when a gradient overflowed, steps otherwise"""
    module.unscale_gradients = _reference_unscale_gradients  # grade scaled_step alone
    scale = 8.0

    def scaled(bad: float | None = None, group: int = 0) -> list[list[torch.Tensor | None]]:
        result = [[None if g is None else g * scale for g in gradients] for gradients in SCALED_STEP_GRADIENTS]
        if bad is not None:
            result[group][0].view(-1)[0] = bad
        return result

    parameters, optimizer = _optimizer(scaled())
    expected_parameters, expected_optimizer = _optimizer(SCALED_STEP_GRADIENTS)
    expected_optimizer.step()
    call = f"scaled_step(optimizer, {scale:g}) on {len(SCALED_STEP_GRADIENTS)} parameter groups"
    stepped = _as_bool(module.scaled_step(optimizer, scale), call)
    if not stepped or optimizer.steps != 1:
        raise CheckFailed(f"with finite gradients {call} returned {stepped} after calling optimizer.step() "
                          f"{optimizer.steps} time(s); expected True after exactly one step")
    for index, (got, want) in enumerate(zip(parameters, expected_parameters, strict=True)):
        if not torch.equal(got, want):
            group = _group_of(optimizer, got)
            raise CheckFailed(f"after {call} parameter {index} (group {group}) is {got.tolist()}, expected "
                              f"{want.tolist()} (unscale the gradients of every group before optimizer.step(); "
                              "they are all in optimizer.param_groups)")
    for bad, group in ((math.inf, 0), (math.nan, 0), (math.inf, 2), (math.nan, 2)):
        overflowed = scaled(bad, group)
        parameters, optimizer = _optimizer(overflowed)
        before = [parameter.detach().clone() for parameter in parameters]
        stepped = _as_bool(module.scaled_step(optimizer, scale), call)
        if optimizer.steps:
            raise CheckFailed(f"a gradient in group {group} held {bad} but {call} called optimizer.step(): the "
                              f"{bad} went into the weights; skip the step when unscale_gradients reports an overflow")
        if stepped:
            raise CheckFailed(f"a gradient held {bad}, the step was skipped, but scaled_step returned True; "
                              "return whether the optimizer stepped")
        if not all(torch.equal(a, b) for a, b in zip(parameters, before, strict=True)):
            raise CheckFailed(f"a gradient held {bad}: scaled_step must leave the parameters untouched")
        originals = [g for gradients in overflowed for g in gradients]
        for index, (parameter, gradient) in enumerate(zip(parameters, originals, strict=True)):
            if gradient is not None and not _same(parameter.grad, gradient / scale):
                raise CheckFailed(f"with {bad} in group {group}, {call} skipped the step but left the gradient of "
                                  f"parameter {index} (group {_group_of(optimizer, parameter)}) "
                                  + ("scaled" if _same(parameter.grad, gradient) else "wrong")
                                  + ": unscale every group's gradients first, then decide whether to step (the "
                                    "caller may still clip or log them)")


def _group_of(optimizer: torch.optim.Optimizer, parameter: torch.Tensor) -> int:
    return next(index for index, group in enumerate(optimizer.param_groups)
                if any(p is parameter for p in group["params"]))


# --------------------------------------------------------------------------------------------------------
# update_scale

# (growth_factor, backoff_factor, growth_interval, initial scale, overflow on each step?)
UPDATE_CASES = [
    (2.0, 0.5, 3, 2.0 ** 16, [False] * 7 + [True, False, False, True, True] + [False] * 4),
    (2.0, 0.5, 1, 1024.0, [False, False, True, False, True, True, False]),  # grows after every good step
    (4.0, 0.25, 2, 64.0, [False, True, False, False, False, True, False, False]),  # other factors
    (2.0, 0.5, 2000, 2.0 ** 16, [False] * 5 + [True] * 3),  # the defaults: 5 good steps are not enough
]


@guard.no_shortcuts
def check_update_scale(module) -> None:
    """update_scale backs off on overflow and grows after growth_interval good steps"""
    for growth_factor, backoff_factor, growth_interval, scale, overflows in UPDATE_CASES:
        good_steps = 0
        for found_inf in overflows:
            expected = _reference_update_scale(scale, found_inf, good_steps, growth_factor, backoff_factor,
                                               growth_interval)
            call = (f"update_scale(scale={scale:g}, found_inf={found_inf}, good_steps={good_steps}, "
                    f"growth_factor={growth_factor:g}, backoff_factor={backoff_factor:g}, "
                    f"growth_interval={growth_interval})")
            got = module.update_scale(scale, found_inf, good_steps, growth_factor, backoff_factor, growth_interval)
            if not (isinstance(got, tuple) and len(got) == 2):
                raise CheckFailed(f"{call} returned {got!r}; return a pair (new_scale, new_good_steps)")
            got = (float(got[0]), int(got[1]))
            if got != expected:
                raise CheckFailed(f"{call} returned {got}, expected {expected}"
                                  f"{_update_hint(found_inf, got, expected, good_steps, growth_interval)}")
            scale, good_steps = expected


def _update_hint(found_inf: bool, got: tuple[float, int], expected: tuple[float, int], good_steps: int,
                 growth_interval: int) -> str:
    """Say what was observed at this step, and the rule it breaks."""
    if found_inf and got[0] == expected[0]:
        return f" (after an overflow the count of good steps starts again from 0; yours is {got[1]})"
    if found_inf:
        return " (after an overflow multiply the scale by backoff_factor)"
    count = good_steps + 1  # this step's place in the run of good steps
    if got[0] > expected[0]:
        return (f" (your scale grew at good step {count} in a row; it grows only when the count reaches "
                f"growth_interval={growth_interval})")
    if got[0] < expected[0]:
        return (f" (this is good step {count} in a row, which completes growth_interval={growth_interval}: multiply "
                f"the scale by growth_factor and restart the count at 0; yours kept the scale at {got[0]:g} and "
                f"counted {got[1]})")
    return (f" (the scale is right but the count of good steps should be {expected[1]}, yours is {got[1]}: count "
            "this good step, and restart from 0 when the scale grows)")


# --------------------------------------------------------------------------------------------------------
# Against torch.amp.GradScaler

INIT_SCALE = 2.0 ** 20
GROWTH_INTERVAL = 3
TRAIN_STEPS = 30
HUGE_INPUT_STEPS = (12, 13)  # inputs 1e30 times too large: an overflow at any scale


def _train(scaled_step_and_update) -> tuple[list[float], list[bool], list[list[torch.Tensor]]]:
    """A TinyMLP under fp16 autocast, its optimizer with two parameter groups; ``scaled_step_and_update(optimizer,
    loss)`` does backward, step and update and returns (scale used, stepped).  Returns the scales, whether each
    step was taken, and the weights after each step."""
    model = TinyMLP(MLPConfig(8, (16,), 32), seed=0)
    matrices = [p for p in model.parameters() if p.dim() >= 2]  # two groups, as for weight decay on matrices only
    others = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.SGD([{"params": matrices, "weight_decay": 1e-2}, {"params": others, "lr": 0.05}],
                                lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(0)
    scales, stepped, weights = [], [], []
    for step in range(TRAIN_STEPS):
        x, y = torch.randn(16, 8, generator=generator), torch.randint(0, 32, (16,), generator=generator)
        if step in HUGE_INPUT_STEPS:
            x = x * 1e30
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scale, did_step = scaled_step_and_update(optimizer, loss)
        scales.append(scale)
        stepped.append(did_step)
        weights.append([parameter.detach().clone() for parameter in model.parameters()])
    return scales, stepped, weights


def _with_grad_scaler():
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)

    def step(optimizer, loss):
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return scale, scaler.get_scale() >= scale  # GradScaler lowers the scale exactly when it skipped

    return _train(step)


def _with_student(module):
    state = {"scale": INIT_SCALE, "good_steps": 0}

    def step(optimizer, loss):
        scale = state["scale"]
        (loss * scale).backward()
        did_step = _as_bool(module.scaled_step(optimizer, scale), f"scaled_step(optimizer, {scale:g})")
        new_scale, good_steps = module.update_scale(scale, not did_step, state["good_steps"], 2.0, 0.5,
                                                    GROWTH_INTERVAL)
        state.update(scale=float(new_scale), good_steps=int(good_steps))
        return scale, did_step

    return _train(step)


@guard.no_shortcuts
def check_matches_grad_scaler(module) -> None:
    """training in fp16 with your functions matches torch.amp.GradScaler step for step"""
    expected_scales, expected_stepped, expected_weights = _with_grad_scaler()
    scales, stepped, weights = _with_student(module)
    for step in range(TRAIN_STEPS):  # the first step where the runs part, and how
        if scales[step] != expected_scales[step]:
            raise CheckFailed(f"before step {step} your scale is {scales[step]:g}, GradScaler's is "
                              f"{expected_scales[step]:g} (scales so far: GradScaler {expected_scales[:step + 1]}, "
                              f"yours {scales[:step + 1]})")
        if stepped[step] != expected_stepped[step]:
            why = (" — no gradient overflowed at this step" if expected_stepped[step] else
                   " — a gradient overflowed at this step: look at the gradients of every parameter group")
            raise CheckFailed(f"at step {step} you {'stepped' if stepped[step] else 'skipped'}, GradScaler "
                              f"{'stepped' if expected_stepped[step] else 'skipped'}{why}")
        for index, (got, want) in enumerate(zip(weights[step], expected_weights[step], strict=True)):
            if torch.equal(got, want):
                continue
            seen = ("holds inf/nan" if not torch.isfinite(got).all() else
                    f"differs from GradScaler's by up to {(got - want).abs().max().item():.3g}")
            raise CheckFailed(f"after step {step} (taken by both runs, at scale {scales[step]:g}) parameter {index} "
                              f"{seen}: are the gradients of every parameter group divided by the scale before "
                              "the step?")


check_matches_grad_scaler.timeout = 120.0

CHECKS = [check_unscale_gradients, check_scaled_step, check_update_scale, check_matches_grad_scaler]
