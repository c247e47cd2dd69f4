"""Checks for exercise 04 (``04_mixed_precision.py``): unscale_gradients, scaled_step, update_scale.

The first three checks grade one function each, on hand-made gradients and overflow sequences (``scaled_step``
runs with the reference ``unscale_gradients``, so a mistake there is not counted twice).  The last trains a
small model under fp16 autocast, engineered to overflow (a high initial scale, a short growth interval, two
batches of huge inputs), once with the student's three functions and once with ``torch.amp.GradScaler``, and
asks for the same scale before every step, the same skipped steps and bit-identical weights.  Every scale in
these runs is a power of two, so dividing by it is exact and equality is the right test.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from labkit.grading import CheckFailed
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


def check_unscale_gradients(module) -> None:
    """unscale_gradients divides every gradient by the scale and reports inf and nan"""
    gradients = [torch.tensor([2.0, 4.0, -8.0]), None, torch.tensor([[1024.0, 0.5]])]
    parameters = _parameters(*gradients)
    call = "unscale_gradients(parameters, scale=4.0) with finite gradients"
    found_inf = _as_bool(module.unscale_gradients(parameters, 4.0), call)
    if found_inf:
        raise CheckFailed(f"{call} returned True; no gradient holds an inf or a nan")
    for index, (parameter, gradient) in enumerate(zip(parameters, gradients, strict=True)):
        if gradient is None:
            if parameter.grad is not None:
                raise CheckFailed(f"{call}: parameter {index} had no gradient (None) but now has one; skip it")
            continue
        if not torch.equal(parameter.grad, gradient / 4.0):
            hint = " (multiplied instead of divided?)" if torch.equal(parameter.grad, gradient * 4.0) else ""
            raise CheckFailed(f"{call}: gradient {index} is {parameter.grad.tolist()}, expected "
                              f"{(gradient / 4.0).tolist()}{hint}")
    for bad, where in ((math.inf, "the first"), (-math.inf, "the last"), (math.nan, "the last"),
                       (math.nan, "the first")):
        first, last = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
        (first if where == "the first" else last)[1] = bad
        call = f"unscale_gradients with {bad} in {where} parameter's gradient"
        if not _as_bool(module.unscale_gradients(_parameters(first, None, last), 2.0), call):
            raise CheckFailed(f"{call} returned False, expected True (torch.isfinite is False for inf, -inf "
                              "and nan; look at every gradient)")


# --------------------------------------------------------------------------------------------------------
# scaled_step


class _CountingSGD(torch.optim.SGD):
    steps = 0

    def step(self, closure=None):
        self.steps += 1
        return super().step(closure)


def _optimizer(gradients: list[torch.Tensor]) -> tuple[list[nn.Parameter], _CountingSGD]:
    generator = torch.Generator().manual_seed(4)
    parameters = [nn.Parameter(torch.randn(gradient.shape, generator=generator)) for gradient in gradients]
    optimizer = _CountingSGD(parameters, lr=0.1, momentum=0.9)
    for parameter, gradient in zip(parameters, gradients, strict=True):
        parameter.grad = gradient.clone()
    return parameters, optimizer


def check_scaled_step(module) -> None:
    """scaled_step skips optimizer.step() when a gradient overflowed, and steps otherwise"""
    module.unscale_gradients = _reference_unscale_gradients  # grade scaled_step alone
    gradients = [torch.tensor([0.5, -1.0]), torch.tensor([[2.0, 0.25], [1.0, 4.0]])]
    parameters, optimizer = _optimizer([gradient * 8.0 for gradient in gradients])
    expected_parameters, expected_optimizer = _optimizer(gradients)
    expected_optimizer.step()
    stepped = _as_bool(module.scaled_step(optimizer, 8.0), "scaled_step(optimizer, 8.0)")
    if not stepped or optimizer.steps != 1:
        raise CheckFailed(f"with finite gradients scaled_step returned {stepped} after calling optimizer.step() "
                          f"{optimizer.steps} time(s); expected True after exactly one step")
    for index, (got, want) in enumerate(zip(parameters, expected_parameters, strict=True)):
        if not torch.equal(got, want):
            raise CheckFailed(f"after scaled_step(optimizer, 8.0) parameter {index} is {got.tolist()}, expected "
                              f"{want.tolist()} (unscale the gradients before optimizer.step())")
    for bad in (math.inf, math.nan):
        overflowed = [gradient * 8.0 for gradient in gradients]
        overflowed[1][0, 1] = bad
        parameters, optimizer = _optimizer(overflowed)
        before = [parameter.detach().clone() for parameter in parameters]
        stepped = _as_bool(module.scaled_step(optimizer, 8.0), "scaled_step(optimizer, 8.0)")
        if optimizer.steps:
            raise CheckFailed(f"a gradient held {bad} but scaled_step called optimizer.step(): the {bad} went into "
                              "the weights; skip the step when unscale_gradients reports an overflow")
        if stepped:
            raise CheckFailed(f"a gradient held {bad}, the step was skipped, but scaled_step returned True; "
                              "return whether the optimizer stepped")
        if not all(torch.equal(a, b) for a, b in zip(parameters, before, strict=True)):
            raise CheckFailed(f"a gradient held {bad}: scaled_step must leave the parameters untouched")


# --------------------------------------------------------------------------------------------------------
# update_scale

# (growth_factor, backoff_factor, growth_interval, initial scale, overflow on each step?)
UPDATE_CASES = [
    (2.0, 0.5, 3, 2.0 ** 16, [False] * 7 + [True, False, False, True, True] + [False] * 4),
    (2.0, 0.5, 1, 1024.0, [False, False, True, False, True, True, False]),  # grows after every good step
    (4.0, 0.25, 2, 64.0, [False, True, False, False, False, True, False, False]),  # other factors
    (2.0, 0.5, 2000, 2.0 ** 16, [False] * 5 + [True] * 3),  # the defaults: 5 good steps are not enough
]


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
                raise CheckFailed(f"{call} returned {got}, expected {expected}{_update_hint(found_inf, got, expected)}")
            scale, good_steps = expected


def _update_hint(found_inf: bool, got: tuple[float, int], expected: tuple[float, int]) -> str:
    if found_inf and got[0] == expected[0]:
        return " (after an overflow the count of good steps starts again from 0)"
    if found_inf:
        return " (after an overflow multiply the scale by backoff_factor)"
    if got[0] > expected[0]:
        return " (grow only when the count of good steps reaches growth_interval)"
    if got[0] < expected[0]:
        return (" (the scale never grows? after growth_interval good steps in a row multiply it by "
                "growth_factor)")
    return " (count this good step; restart from 0 when the scale grows)"


# --------------------------------------------------------------------------------------------------------
# Against torch.amp.GradScaler

INIT_SCALE = 2.0 ** 20
GROWTH_INTERVAL = 3
TRAIN_STEPS = 30
HUGE_INPUT_STEPS = (12, 13)  # inputs 1e30 times too large: an overflow at any scale


def _train(scaled_step_and_update) -> tuple[list[float], list[bool], list[torch.Tensor]]:
    """A TinyMLP under fp16 autocast; ``scaled_step_and_update(optimizer, loss)`` does backward, step and
    update and returns (scale used, stepped)."""
    model = TinyMLP(MLPConfig(8, (16,), 32), seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(0)
    scales, stepped = [], []
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
    return scales, stepped, [parameter.detach().clone() for parameter in model.parameters()]


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


def check_matches_grad_scaler(module) -> None:
    """training in fp16 with your functions matches torch.amp.GradScaler step for step"""
    expected_scales, expected_stepped, expected_parameters = _with_grad_scaler()
    scales, stepped, parameters = _with_student(module)
    if not all(torch.isfinite(parameter).all() for parameter in parameters):
        raise CheckFailed("after training with your functions the weights hold inf/nan: a step whose gradients "
                          "overflowed was taken")
    for step in range(TRAIN_STEPS):
        if scales[step] != expected_scales[step]:
            raise CheckFailed(f"before step {step} your scale is {scales[step]:g}, GradScaler's is "
                              f"{expected_scales[step]:g} (scales so far: GradScaler {expected_scales[:step + 1]}, "
                              f"yours {scales[:step + 1]})")
        if stepped[step] != expected_stepped[step]:
            raise CheckFailed(f"at step {step} you {'stepped' if stepped[step] else 'skipped'}, GradScaler "
                              f"{'stepped' if expected_stepped[step] else 'skipped'}")
    for index, (got, want) in enumerate(zip(parameters, expected_parameters, strict=True)):
        if not torch.equal(got, want):
            raise CheckFailed(f"after {TRAIN_STEPS} steps parameter {index} differs from GradScaler's run "
                              f"(by up to {(got - want).abs().max().item():.3g}): are the gradients divided by the "
                              "scale before the step?")


check_matches_grad_scaler.timeout = 120.0

CHECKS = [check_unscale_gradients, check_scaled_step, check_update_scale, check_matches_grad_scaler]
