"""Checks for exercise 03 (``03_lr_scaling.py``): global_batch, scaled_lr, lr_at.

The checks compare the student's numbers with the reference formulas below (written out here, not imported
from ``solutions/``) on a grid of runs.  Each part of ``lr_at`` is checked on its own: the peak on runs where
world size, accumulation and base batch all differ, while the warmup and decay checks use one rank, no
accumulation and ``per_rank_batch == base_batch`` (so the peak *is* ``base_lr``) — a scaling mistake then fails
one check, not three.  When a wrong answer matches a known mistake (accumulation ignored, warmup from 0,
a warmup one step ahead, no decay) the hint says so.
"""

from __future__ import annotations

import itertools
import math

from labkit.grading import CheckFailed

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


def _reference_lr(step: int, run: dict) -> float:
    if step < run["warmup_steps"]:
        return _peak(run) * _warmup_factor(step, run["warmup_steps"], run["warmup_start_factor"])
    return _peak(run) * _cosine_factor(step, run["warmup_steps"], run["total_steps"])


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


def check_peak(module) -> None:
    """lr_at peaks at the LR scaled for the global batch (world size and accumulation steps both count)"""
    grid = itertools.product((2, 4, 8), (2, 4, 1), (32, 256), (16, 64), (5, 0))
    for world_size, accumulation_steps, base_batch, per_rank_batch, warmup_steps in grid:
        run = _run(base_lr=0.05, base_batch=base_batch, per_rank_batch=per_rank_batch, world_size=world_size,
                   accumulation_steps=accumulation_steps, warmup_steps=warmup_steps, total_steps=30)
        got, call = _lr_at(module, warmup_steps, run)
        expected = _peak(run)
        if not _close(got, expected, expected):
            hint = ""
            if _close(got, _peak({**run, "accumulation_steps": 1}), expected):
                hint = (" — that is the rate scaled for world_size alone: accumulation_steps multiplies the "
                        "global batch too")
            elif _close(got, run["base_lr"] * world_size, expected):
                hint = (" — that is base_lr x world_size: the rule scales by global_batch / base_batch, and the "
                        "global batch also counts the per-rank batch and the accumulation steps")
            elif _close(got, run["base_lr"] * math.sqrt(expected / run["base_lr"]), expected):
                hint = " — that is the square-root rule; this exercise asks for the linear rule"
            elif _close(got, run["base_lr"], expected):
                hint = " — that is base_lr, not scaled at all"
            raise CheckFailed(f"at the end of warmup, {call} returned {got:.10g}, expected the scaled rate "
                              f"{expected:.10g}{hint}")


def check_warmup(module) -> None:
    """lr_at warms up linearly from warmup_start_factor x the peak at step 0 to the peak at step warmup_steps"""
    for base_lr, warmup_steps, start_factor, after in itertools.product((0.1, 3e-4), (1, 4, 10),
                                                                          (0.1, 0.25, 0.5, 0.0), (1, 20)):
        run = _run(base_lr=base_lr, warmup_steps=warmup_steps, warmup_start_factor=start_factor,
                   total_steps=warmup_steps + after)  # one rank, no accumulation, base batch: the peak is base_lr
        for step in range(warmup_steps + 1):
            got, call = _lr_at(module, step, run)
            expected = _reference_lr(step, run)
            if not _close(got, expected, base_lr):
                hint = ""
                if step == 0 and start_factor > 0 and _close(got, 0.0, base_lr):
                    hint = (f" — your warmup starts at 0, but with warmup_start_factor={start_factor} it starts at "
                            f"{start_factor} x the peak")
                elif step < warmup_steps and _close(got, _reference_lr(step + 1, run), base_lr):
                    hint = (" — your warmup is one step ahead: step 0 is the first step, and the peak is reached "
                            "at step warmup_steps, not before")
                elif step > 0 and _close(got, _reference_lr(step - 1, run), base_lr):
                    hint = " — your warmup is one step behind: the peak is reached at step warmup_steps"
                raise CheckFailed(f"{call} returned {got:.10g}, expected {expected:.10g}{hint}")


def check_decay(module) -> None:
    """lr_at decays along a cosine from the peak at step warmup_steps to 0 at step total_steps"""
    for base_lr, warmup_steps, after in itertools.product((0.1, 3e-4), (0, 3, 10), (1, 2, 7, 50)):
        run = _run(base_lr=base_lr, warmup_steps=warmup_steps, warmup_start_factor=0.2,
                   total_steps=warmup_steps + after)
        for step in range(warmup_steps, warmup_steps + after + 1):
            got, call = _lr_at(module, step, run)
            expected = _reference_lr(step, run)
            if not _close(got, expected, base_lr):
                hint = ""
                if step > warmup_steps and _close(got, base_lr, base_lr):
                    hint = " — the rate stays at the peak after warmup: did you forget the cosine decay?"
                elif _close(got, base_lr * (1 - (step - warmup_steps) / after), base_lr):
                    hint = " — that is a linear decay; the exercise asks for (1 + cos(pi x progress)) / 2"
                raise CheckFailed(f"{call} returned {got:.10g}, expected {expected:.10g} (progress "
                                  f"{step - warmup_steps}/{after} through the decay){hint}")


CHECKS = [check_global_batch, check_scaled_lr, check_peak, check_warmup, check_decay]
