"""Learning rates for large batches: the linear and square-root scaling rules, warmup, and decay.

**The global batch.**  What the optimizer sees in one update is the gradient averaged over every sample that
went into it: each rank's batch, on every rank, over every accumulated micro-batch::

    global_batch = per_rank_batch * world_size * accumulation_steps

That product is computed in one place (:func:`global_batch_size`) and everything else takes the result.  A
scaling rule that multiplies by the number of GPUs but forgets gradient accumulation (or multiplies by the
world size twice) is the commonest way to train with the wrong learning rate.

**The linear scaling rule** (Krizhevsky 2014, "One weird trick"; Goyal et al. 2017, "Accurate, Large
Minibatch SGD: Training ImageNet in 1 Hour"): *when the global batch is multiplied by k, multiply the
learning rate by k*::

    lr = base_lr * global_batch / base_batch

Why: ``k`` SGD steps of batch ``B`` at learning rate ``eta`` move the weights by ``-eta * sum_j g_j`` (one mean
gradient ``g_j`` per step); one step of batch ``kB`` moves them by ``-eta' * (1/k) sum_j g_j``, taken at the
first step's weights.  If the gradients barely change over ``k`` steps the two agree exactly when
``eta' = k * eta``.  The assumption fails (i) early in training, when the weights move fast — hence warmup —
and (ii) beyond a *critical batch size* where extra samples no longer reduce the gradient noise (McCandlish et
al. 2018, "An Empirical Model of Large-Batch Training"): there the rule promises a speed-up it cannot deliver.

**The square-root rule** (Krizhevsky 2014; Hoffer et al. 2017, "Train longer, generalize better"; Malladi et
al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms")::

    lr = base_lr * sqrt(global_batch / base_batch)

A mean over ``B`` samples has noise of standard deviation ``~ 1/sqrt(B)``.  Hoffer et al. keep the weights'
random walk the same by scaling SGD's step by ``sqrt(k)``; Malladi et al. show that for Adam and RMSprop, whose
update is already divided by the gradient's running RMS, the square-root rule (with ``1 - beta`` and ``eps``
adjusted too) is what keeps the training dynamics the same.  Use ``rule="sqrt"`` for adaptive optimizers and
``"linear"`` for SGD with momentum; ``"none"`` keeps ``base_lr`` whatever the batch.

**Gradual warmup** (Goyal et al. 2017).  At large ``k`` the scaled learning rate diverges in the first steps,
so it is approached linearly from ``warmup_start_factor * lr`` over ``warmup_steps`` steps (Goyal et al.
start from the small-batch rate, a start factor of ``1/k``, and warm up over 5 epochs).  After warmup the
rate *decays*: ``constant`` (none), ``step`` (times ``gamma`` every ``step_size`` steps, as in ResNet
training), ``cosine`` (Loshchilov & Hutter 2017, "SGDR") or ``linear``, down to ``min_factor * lr`` at
``total_steps``.

**Conventions.**  ``step`` counts the optimizer steps already taken, so step 0 is the first update and a run of
``total_steps`` updates uses steps ``0 .. total_steps - 1``.  :func:`lr_factor` is the multiplier of the peak
(scaled) learning rate at a step, with ``p = (step - warmup_steps) / (total_steps - warmup_steps)``::

    step < warmup_steps:    s + (1 - s) * step / warmup_steps               s = warmup_start_factor
    constant:               1
    step:                   gamma ** ((step - warmup_steps) // step_size)
    cosine:                 m + (1 - m) * (1 + cos(pi * p)) / 2              m = min_factor
    linear:                 m + (1 - m) * (1 - p)

So the factor is ``s`` at step 0 and exactly 1 at step ``warmup_steps`` (the first step after warmup), reaches
``m`` at ``total_steps`` and stays there for any later step (a scheduler stepped once too often does not climb
again).  A start factor of 0 is allowed, though it wastes the first step.  :func:`warmup_then_decay` wraps the
same function in a ``torch.optim.lr_scheduler.LambdaLR``: the optimizer's ``lr`` at construction is the peak,
the scheduler sets ``lr = peak * lr_factor(0)`` at once, and the ``k``-th ``scheduler.step()`` (called after
each ``optimizer.step()``) sets ``peak * lr_factor(k)``.

**PyTorch's built-ins** give the same sequence: ``SequentialLR([LinearLR(start_factor=s, total_iters=w),
CosineAnnealingLR(T_max=total - w, eta_min=m * lr)], milestones=[w])`` (``StepLR`` or ``LinearLR(1, m)`` for
the other decays).  Differences: ``LinearLR`` refuses a start factor of 0; ``CosineAnnealingLR`` climbs back up
after ``T_max``; and those schedulers are *recursive* (each multiplies the current ``lr``), so an ``lr`` changed
by hand is carried forward, where ``LambdaLR`` recomputes ``initial_lr * factor`` from scratch every step.

**Cost.**  None at run time (a few flops per step).  The price of warmup is steps spent below the peak rate;
the price of a badly scaled rate is a run that diverges or crawls.
"""

from __future__ import annotations

import math
import numbers
from functools import partial
from typing import Literal

import torch
from torch.optim.lr_scheduler import LambdaLR

ScalingRule = Literal["linear", "sqrt", "none"]
Decay = Literal["constant", "step", "cosine", "linear"]
SCALING_RULES = ("linear", "sqrt", "none")
DECAYS = ("constant", "step", "cosine", "linear")


def _check_integer(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_fraction(name: str, value: float, *, allow_zero: bool = True) -> None:
    low_ok = value >= 0.0 if allow_zero else value > 0.0
    if not (isinstance(value, numbers.Real) and low_ok and value <= 1.0):
        raise ValueError(f"{name} must be in {'[0, 1]' if allow_zero else '(0, 1]'}, got {value!r}")


# --------------------------------------------------------------------------------------------------------
# How big is the batch, and how large the learning rate


def global_batch_size(per_rank_batch: int, world_size: int, accumulation_steps: int = 1) -> int:
    """The number of samples whose gradients are averaged into one optimizer step."""
    _check_integer("per_rank_batch", per_rank_batch, 1)
    _check_integer("world_size", world_size, 1)
    _check_integer("accumulation_steps", accumulation_steps, 1)
    return int(per_rank_batch) * int(world_size) * int(accumulation_steps)


def scaled_lr(base_lr: float, base_batch: int, global_batch: int, rule: ScalingRule = "linear") -> float:
    """The learning rate for ``global_batch``, given one (``base_lr``) known to work at ``base_batch``.

    ``rule``: ``"linear"`` (``base_lr * global_batch / base_batch``, Goyal et al. 2017; SGD), ``"sqrt"``
    (``base_lr * sqrt(global_batch / base_batch)``, Hoffer et al. 2017 / Malladi et al. 2022; Adam) or
    ``"none"`` (``base_lr``).  ``global_batch`` is :func:`global_batch_size`'s answer, not the per-rank batch.
    """
    if not (isinstance(base_lr, numbers.Real) and math.isfinite(base_lr) and base_lr > 0):
        raise ValueError(f"base_lr must be a positive finite number, got {base_lr!r}")
    _check_integer("base_batch", base_batch, 1)
    _check_integer("global_batch", global_batch, 1)
    ratio = global_batch / base_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    if rule == "none":
        return float(base_lr)
    raise ValueError(f"rule must be one of {SCALING_RULES}, got {rule!r}")


# --------------------------------------------------------------------------------------------------------
# The shape of the schedule: warmup, then decay


def _check_schedule(total_steps: int, warmup_steps: int, warmup_start_factor: float, decay: str,
                    min_factor: float, step_size: int | None, gamma: float) -> None:
    _check_integer("total_steps", total_steps, 1)
    _check_integer("warmup_steps", warmup_steps, 0)
    if warmup_steps > total_steps:
        raise ValueError(f"warmup_steps={warmup_steps} is longer than training (total_steps={total_steps})")
    _check_fraction("warmup_start_factor", warmup_start_factor)
    if decay not in DECAYS:
        raise ValueError(f"decay must be one of {DECAYS}, got {decay!r}")
    _check_fraction("min_factor", min_factor)
    if decay == "step":
        if step_size is None:
            raise ValueError("decay='step' needs step_size (decay by gamma every step_size steps)")
        _check_integer("step_size", step_size, 1)
        _check_fraction("gamma", gamma, allow_zero=False)


def lr_factor(step: int, total_steps: int, warmup_steps: int = 0, warmup_start_factor: float = 0.0,
              decay: Decay = "cosine", min_factor: float = 0.0, step_size: int | None = None,
              gamma: float = 0.1) -> float:
    """The multiplier of the peak learning rate at optimizer step ``step`` (0 = the first update).

    Linear warmup from ``warmup_start_factor`` at step 0 to 1 at step ``warmup_steps``, then ``decay``
    (``"constant"``, ``"step"``: times ``gamma`` every ``step_size`` steps, ``"cosine"`` or ``"linear"``: down
    to ``min_factor`` at ``total_steps``).  Steps past ``total_steps`` keep the final factor.  The formulas are
    in the module docstring.
    """
    _check_schedule(total_steps, warmup_steps, warmup_start_factor, decay, min_factor, step_size, gamma)
    _check_integer("step", step, 0)
    if step < warmup_steps:
        return warmup_start_factor + (1.0 - warmup_start_factor) * step / warmup_steps
    since_warmup = min(step, total_steps) - warmup_steps
    decay_steps = total_steps - warmup_steps
    if decay == "constant":
        return 1.0
    if decay == "step":
        return gamma ** (since_warmup // step_size)
    progress = since_warmup / decay_steps if decay_steps > 0 else 1.0
    if decay == "cosine":
        return min_factor + (1.0 - min_factor) * (1.0 + math.cos(math.pi * progress)) / 2.0
    return min_factor + (1.0 - min_factor) * (1.0 - progress)  # linear


def warmup_then_decay(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
                      warmup_start_factor: float = 0.0, decay: Decay = "cosine", min_factor: float = 0.0,
                      step_size: int | None = None, gamma: float = 0.1) -> LambdaLR:
    """A ``LambdaLR`` that multiplies every parameter group's ``lr`` (the peak) by :func:`lr_factor`.

    Build the optimizer with ``lr=scaled_lr(...)``, then call ``scheduler.step()`` after every
    ``optimizer.step()``.  Bad arguments raise ``ValueError`` here, before the optimizer is touched.
    """
    _check_schedule(total_steps, warmup_steps, warmup_start_factor, decay, min_factor, step_size, gamma)
    factor = partial(lr_factor, total_steps=total_steps, warmup_steps=warmup_steps,
                     warmup_start_factor=warmup_start_factor, decay=decay, min_factor=min_factor,
                     step_size=step_size, gamma=gamma)
    return LambdaLR(optimizer, factor)


def lr_schedule(base_lr: float, base_batch: int, per_rank_batch: int, world_size: int, total_steps: int,
                accumulation_steps: int = 1, rule: ScalingRule = "linear", warmup_steps: int = 0,
                warmup_start_factor: float = 0.0, decay: Decay = "cosine", min_factor: float = 0.0,
                step_size: int | None = None, gamma: float = 0.1) -> list[float]:
    """The learning rate of every step of a run, ``[lr(0), ..., lr(total_steps - 1)]``: the whole recipe in
    one call (global batch -> scaled peak -> warmup and decay), for plots and widgets."""
    peak = scaled_lr(base_lr, base_batch, global_batch_size(per_rank_batch, world_size, accumulation_steps), rule)
    _check_schedule(total_steps, warmup_steps, warmup_start_factor, decay, min_factor, step_size, gamma)
    return [peak * lr_factor(step, total_steps, warmup_steps, warmup_start_factor, decay, min_factor, step_size,
                             gamma) for step in range(total_steps)]
