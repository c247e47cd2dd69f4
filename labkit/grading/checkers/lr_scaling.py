"""Checks for exercise 03 (``03_lr_scaling.py``): global_batch, scaled_lr, lr_at.

The checks compare the student's numbers with the reference formulas below (written out here, not imported
from ``solutions/``, and with ``labkit.lr`` forbidden to the student by :mod:`labkit.grading.guard`) on a grid of
runs.  Each part of ``lr_at`` is checked on its own: the peak on runs where world size, accumulation and base
batch all differ; the warmup and decay on runs whose peak is scaled (1 to 8 ranks), measured against the peak
the student's own ``scaled_lr`` and ``global_batch`` give — so a warmup that ramps toward ``base_lr``, or starts
from a fraction of it, fails, while a scaling mistake fails one check, not three.  When a wrong answer matches a
known mistake (accumulation ignored, warmup from 0 or toward ``base_lr``, a warmup one step ahead, no decay) the
hint says so.
"""

from __future__ import annotations

import itertools
import math

from labkit.grading import CheckFailed, guard

RELATIVE_TOLERANCE = 1e-9


# --------------------------------------------------------------------------------------------------------
# The reference


def _global_batch(per_rank_batch: int, world_size: int, accumulation_steps: int) -> int:
    return per_rank_batch * world_size * accumulation_steps


def _peak(run: dict) -> float:
    global_batch = _global_batch(run["per_rank_batch"], run["world_size"], run["accumulation_steps"])
    return run["base_lr"] * global_batch / run["base_batch"]


def _warmup_factor(step: int, warmup_steps: int, start_factor: float) -> float:
    return start_factor + (1 - start_factor) * step / warmup_steps


def _cosine_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    return (1 + math.cos(math.pi * (step - warmup_steps) / (total_steps - warmup_steps))) / 2


# --------------------------------------------------------------------------------------------------------
# Helpers


def _number(value, call: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise CheckFailed(f"{call} returned {value!r}; expected a number") from None


def _close(got: float, expected: float, scale: float) -> bool:
    return math.isclose(got, expected, rel_tol=RELATIVE_TOLERANCE, abs_tol=RELATIVE_TOLERANCE * 1e-3 * scale)


def _lr_at(module, step: int, run: dict) -> tuple[float, str]:
    call = f"lr_at({step}, " + ", ".join(f"{key}={value}" for key, value in run.items()) + ")"
    return _number(module.lr_at(step, **run), call), call


def _run(base_lr=0.1, base_batch=256, per_rank_batch=256, world_size=1, accumulation_steps=1, warmup_steps=5,
         warmup_start_factor=0.1, total_steps=20) -> dict:
    return {"base_lr": base_lr, "base_batch": base_batch, "per_rank_batch": per_rank_batch,
            "world_size": world_size, "accumulation_steps": accumulation_steps, "warmup_steps": warmup_steps,
            "warmup_start_factor": warmup_start_factor, "total_steps": total_steps}


# --------------------------------------------------------------------------------------------------------
# The checks


@guard.no_shortcuts
def check_global_batch(module) -> None:
    """global_batch counts per-rank batch x world size x accumulation steps"""
    for per_rank_batch, world_size, accumulation_steps in itertools.product((16, 48, 1), (2, 8, 1), (4, 3, 1)):
        call = f"global_batch({per_rank_batch}, {world_size}, {accumulation_steps})"
        got = module.global_batch(per_rank_batch, world_size, accumulation_steps)
        expected = _global_batch(per_rank_batch, world_size, accumulation_steps)
        if got != expected:
            hint = ""
            if got == per_rank_batch * world_size:
                hint = " (you left out accumulation_steps: each accumulated micro-batch adds samples to the step)"
            raise CheckFailed(f"{call} returned {got!r}, expected {expected}{hint}")


@guard.no_shortcuts
def check_scaled_lr(module) -> None:
    """scaled_lr follows the linear scaling rule: base_lr x global_batch / base_batch"""
    for base_lr, base_batch, global_batch in itertools.product((0.1, 3e-4), (32, 256), (32, 64, 1024, 8192)):
        call = f"scaled_lr({base_lr}, {base_batch}, {global_batch})"
        got = _number(module.scaled_lr(base_lr, base_batch, global_batch), call)
        expected = base_lr * global_batch / base_batch
        if not _close(got, expected, expected):
            hint = ""
            if _close(got, base_lr * math.sqrt(global_batch / base_batch), expected):
                hint = " (that is the square-root rule, used for Adam; this exercise asks for the linear rule)"
            elif _close(got, base_lr * base_batch / global_batch, expected):
                hint = " (the ratio is upside down: a larger batch takes a larger learning rate)"
            raise CheckFailed(f"{call} returned {got:.10g}, expected {expected:.10g}{hint}")


@guard.no_shortcuts
def check_peak(module) -> None:
    """lr_at peaks at the LR scaled for the global batch (world size and accumulation steps both count)"""
    grid = itertools.product((2, 4, 8), (2, 4, 1), (32, 256), (16, 64), (5, 0))
    results = []  # (run, what lr_at returned, the call, the scaled rate)
    for world_size, accumulation_steps, base_batch, per_rank_batch, warmup_steps in grid:
        run = _run(base_lr=0.05, base_batch=base_batch, per_rank_batch=per_rank_batch, world_size=world_size,
                   accumulation_steps=accumulation_steps, warmup_steps=warmup_steps, total_steps=30)
        results.append((run, *_lr_at(module, warmup_steps, run), _peak(run)))
    for _, got, call, expected in results:
        if not _close(got, expected, expected):
            raise CheckFailed(f"at the end of warmup, {call} returned {got:.10g}, expected the scaled rate "
                              f"{expected:.10g}{_peak_hint(results)}")


def _peak_hint(results: list[tuple[dict, float, str, float]]) -> str:
    """The known mistake that every run's value follows, if any (one run alone can fit two of them)."""
    mistakes = [
        (lambda run: _peak({**run, "accumulation_steps": 1}),
         "that is the rate scaled for world_size alone: accumulation_steps multiplies the global batch too"),
        (lambda run: run["base_lr"] * run["world_size"],
         "that is base_lr x world_size: the rule scales by global_batch / base_batch, and the global batch also "
         "counts the per-rank batch and the accumulation steps"),
        (lambda run: run["base_lr"] * math.sqrt(_peak(run) / run["base_lr"]),
         "that is the square-root rule; this exercise asks for the linear rule"),
        (lambda run: run["base_lr"], "that is base_lr, not scaled at all"),
    ]
    for formula, hint in mistakes:
        if all(_close(got, formula(run), expected) for run, got, _call, expected in results):
            return f" — {hint}"
    return ""


# Runs for the warmup and decay checks: scaled peaks (world_size ranks, each a base batch's worth of samples per
# step, in one or in four micro-batches), so a warmup that ramps toward base_lr instead of the peak shows.
SCALED = [(world_size, per_rank_batch, accumulation_steps)
          for world_size in (1, 2, 8) for per_rank_batch, accumulation_steps in ((256, 1), (64, 4))]


def _your_peak(module, run: dict) -> float:
    """The peak from the student's own ``scaled_lr`` and ``global_batch`` (graded by their own checks)."""
    batch = module.global_batch(run["per_rank_batch"], run["world_size"], run["accumulation_steps"])
    return _number(module.scaled_lr(run["base_lr"], run["base_batch"], batch),
                   f"scaled_lr({run['base_lr']}, {run['base_batch']}, {batch})")


@guard.no_shortcuts
def check_warmup(module) -> None:
    """lr_at warms up linearly from warmup_start_factor x the peak at step 0 toward the peak at step warmup_steps"""
    grid = itertools.product((0.1, 3e-4), SCALED, (10, 4, 1), (0.1, 0.25, 0.5, 0.0), (1, 20))
    for base_lr, (world_size, per_rank_batch, accumulation_steps), warmup_steps, start_factor, after in grid:
        run = _run(base_lr=base_lr, per_rank_batch=per_rank_batch, world_size=world_size,
                   accumulation_steps=accumulation_steps, warmup_steps=warmup_steps, warmup_start_factor=start_factor,
                   total_steps=warmup_steps + after)
        peak = _your_peak(module, run)  # a scaling mistake is check_peak's, not this check's
        # Steps 0 .. warmup_steps - 1; step warmup_steps is the decay's first (and check_peak's).
        got = [_lr_at(module, step, run)[0] for step in range(warmup_steps)]
        for step, value in enumerate(got):
            expected = peak * _warmup_factor(step, warmup_steps, start_factor)
            if not _close(value, expected, peak):
                raise CheckFailed(f"{_lr_at(module, step, run)[1]} returned {value:.10g}, expected {expected:.10g} "
                                  f"(the peak is {peak:.10g}){_warmup_hint(got, run, peak)}")


def _warmup_hint(got: list[float], run: dict, peak: float) -> str:
    """Which known mistake the whole warmup of this run follows, if any."""
    base_lr, warmup_steps, start = run["base_lr"], run["warmup_steps"], run["warmup_start_factor"]
    mistakes = [
        (lambda step: peak * step / warmup_steps, start > 0,
         f"your warmup starts at 0, but with warmup_start_factor={start} it starts at {start} x the peak"),
        (lambda step: base_lr * _warmup_factor(step, warmup_steps, start), peak != base_lr,
         f"your warmup ramps toward base_lr={base_lr:g}; it ramps toward the peak, the rate scaled for the global "
         f"batch ({peak:.10g})"),
        (lambda step: start * base_lr + (peak - start * base_lr) * step / warmup_steps, peak != base_lr,
         f"your warmup starts at warmup_start_factor x base_lr = {start * base_lr:.10g}; it starts at "
         f"warmup_start_factor x the peak = {start * peak:.10g}"),
        (lambda step: peak * _warmup_factor(step + 1, warmup_steps, start), True,
         "your warmup is one step ahead: step 0 is the first step, and the peak is reached at step warmup_steps, "
         "not before"),
        (lambda step: peak * _warmup_factor(step - 1, warmup_steps, start), len(got) > 1,
         "your warmup is one step behind: the peak is reached at step warmup_steps"),
    ]
    for formula, applies, hint in mistakes:
        steps = range(1 if "behind" in hint else 0, len(got))
        if applies and all(_close(got[step], formula(step), peak) for step in steps):
            return f" — {hint}"
    return ""


@guard.no_shortcuts
def check_decay(module) -> None:
    """lr_at decays along a cosine from the peak at step warmup_steps to 0 at step total_steps"""
    grid = itertools.product((0.1, 3e-4), SCALED[::2], (0, 3, 10), (1, 2, 7, 50))
    for base_lr, (world_size, per_rank_batch, accumulation_steps), warmup_steps, after in grid:
        run = _run(base_lr=base_lr, per_rank_batch=per_rank_batch, world_size=world_size,
                   accumulation_steps=accumulation_steps, warmup_steps=warmup_steps, warmup_start_factor=0.2,
                   total_steps=warmup_steps + after)
        peak = _your_peak(module, run)
        for step in range(warmup_steps, warmup_steps + after + 1):
            got, call = _lr_at(module, step, run)
            expected = peak * _cosine_factor(step, warmup_steps, run["total_steps"])
            if not _close(got, expected, peak):
                hint = ""
                if step > warmup_steps and _close(got, peak, peak):
                    hint = " — the rate stays at the peak after warmup: did you forget the cosine decay?"
                elif _close(got, peak * (1 - (step - warmup_steps) / after), peak):
                    hint = " — that is a linear decay; the exercise asks for (1 + cos(pi x progress)) / 2"
                elif peak != base_lr and _close(got, base_lr * _cosine_factor(step, warmup_steps, run["total_steps"]),
                                                peak):
                    hint = f" — your decay starts from base_lr={base_lr:g}; it starts from the peak, the scaled rate"
                raise CheckFailed(f"{call} returned {got:.10g}, expected {expected:.10g} (the peak is {peak:.10g}, "
                                  f"progress {step - warmup_steps}/{after} through the decay){hint}")


CHECKS = [check_global_batch, check_scaled_lr, check_peak, check_warmup, check_decay]
