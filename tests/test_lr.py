"""Learning-rate scaling rules, warmup and decay: the formulas, hand-computed runs, and PyTorch's schedulers."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR, StepLR

from labkit.lr import global_batch_size, lr_factor, lr_schedule, scaled_lr, warmup_then_decay


def _optimizer(lr: float = 0.8, groups: int = 1) -> torch.optim.Optimizer:
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr / 10**group}
                            for group in range(groups)], lr=lr)


def _run(optimizer: torch.optim.Optimizer, scheduler, steps: int, group: int = 0) -> list[float]:
    """The learning rate each optimizer step uses, then the one after the last step: ``steps + 1`` values."""
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[group]["lr"])
        optimizer.step()
        scheduler.step()
    return rates + [optimizer.param_groups[group]["lr"]]


# --------------------------------------------------------------------------------------------------------
# Global batch and scaling rules


def test_global_batch_multiplies_per_rank_batch_world_size_and_accumulation():
    assert global_batch_size(32, 1) == 32
    assert global_batch_size(32, 8) == 256
    assert global_batch_size(32, 8, accumulation_steps=4) == 1024
    assert isinstance(global_batch_size(3, 5, 7), int)


def test_global_batch_is_counted_once_so_the_base_setup_keeps_its_base_lr():
    # 8 ranks x 16 samples x 2 accumulation steps is the 256-sample batch the base recipe used: no scaling.
    assert scaled_lr(0.1, 256, global_batch_size(16, 8, 2)) == 0.1
    # The same hardware without accumulation halves the batch, so the learning rate halves too.
    assert scaled_lr(0.1, 256, global_batch_size(16, 8, 1)) == pytest.approx(0.05, rel=1e-15)


@pytest.mark.parametrize(
    ("rule", "global_batch", "expected"),
    [
        ("linear", 1024, 0.4),  # Goyal et al.: 256 -> 8192 takes 0.1 -> 3.2; here 256 -> 1024 takes 0.1 -> 0.4
        ("linear", 8192, 3.2),
        ("linear", 64, 0.025),
        ("sqrt", 1024, 0.2),
        ("sqrt", 64, 0.05),
        ("none", 8192, 0.1),
    ],
)
def test_scaling_rules(rule, global_batch, expected):
    assert scaled_lr(0.1, 256, global_batch, rule) == pytest.approx(expected, rel=1e-14)


def test_linear_rule_makes_one_large_step_equal_k_small_steps_when_the_gradient_is_constant():
    """The rule's derivation, exactly: with a linear loss the gradient does not depend on the weights, so k SGD
    steps of batch B at lr equal one step of batch kB at the linearly scaled lr."""
    k, batch, base_lr = 4, 8, 0.05
    samples = torch.randn(k * batch, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    start = torch.randn(5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def train(lr: float, batches: list[torch.Tensor]) -> torch.Tensor:
        weights = torch.nn.Parameter(start.clone())
        optimizer = torch.optim.SGD([weights], lr=lr)
        for chunk in batches:
            optimizer.zero_grad()
            (chunk @ weights).mean().backward()
            optimizer.step()
        return weights.detach()

    small_steps = train(base_lr, list(samples.split(batch)))
    one_large_step = train(scaled_lr(base_lr, batch, global_batch_size(batch, 2, 2)), [samples])
    torch.testing.assert_close(one_large_step, small_steps, rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------------------------------------
# The schedule's shape


@pytest.mark.parametrize(
    ("step", "decay", "expected"),
    [
        (0, "cosine", 0.1),  # warmup starts at the start factor ...
        (5, "cosine", 0.55),  # ... climbs linearly ...
        (9, "cosine", 0.91),
        (10, "cosine", 1.0),  # ... and reaches the peak at step warmup_steps
        (55, "cosine", 0.5),  # halfway through the decay: cos(pi/2) = 0
        (100, "cosine", 0.0),
        (55, "linear", 0.5),
        (82, "linear", 0.2),
        (99, "constant", 1.0),
        (39, "step", 1.0),  # 29 steps after warmup: no decay yet
        (40, "step", 0.1),
        (70, "step", 0.01),
    ],
)
def test_lr_factor_equals_the_formulas_at_chosen_steps(step, decay, expected):
    factor = lr_factor(step, total_steps=100, warmup_steps=10, warmup_start_factor=0.1, decay=decay,
                       step_size=30, gamma=0.1)
    assert factor == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_min_factor_is_where_cosine_and_linear_decay_end():
    for decay in ("cosine", "linear"):
        assert lr_factor(100, 100, 10, decay=decay, min_factor=0.05) == pytest.approx(0.05, rel=1e-14)
        assert lr_factor(55, 100, 10, decay=decay, min_factor=0.2) == pytest.approx(0.6, rel=1e-14)


def test_steps_past_the_end_keep_the_final_factor():
    for decay in ("cosine", "linear", "step"):
        end = lr_factor(100, 100, 10, decay=decay, min_factor=0.1, step_size=7)
        assert lr_factor(250, 100, 10, decay=decay, min_factor=0.1, step_size=7) == end
    assert lr_factor(5, 5, warmup_steps=5, decay="linear") == 0.0  # all warmup: the decay phase is empty


def test_a_start_factor_of_zero_starts_at_zero():
    assert lr_factor(0, 20, warmup_steps=4) == 0.0  # torch's LinearLR refuses start_factor=0
    assert lr_factor(1, 20, warmup_steps=4) == 0.25


def test_scheduler_produces_the_hand_computed_sequence():
    optimizer = _optimizer(lr=1.0)
    scheduler = warmup_then_decay(optimizer, total_steps=6, warmup_steps=2, warmup_start_factor=0.5,
                                  decay="linear")
    assert _run(optimizer, scheduler, 6) == pytest.approx([0.5, 0.75, 1.0, 0.75, 0.5, 0.25, 0.0], abs=1e-15)

    optimizer = _optimizer(lr=2.0)
    cosine = _run(optimizer, warmup_then_decay(optimizer, total_steps=4), 4)
    assert cosine == pytest.approx([2.0, 1.0 + math.sqrt(0.5), 1.0, 1.0 - math.sqrt(0.5), 0.0], abs=1e-15)


def test_scheduler_scales_every_parameter_group_by_the_same_factor():
    optimizer = _optimizer(lr=0.8, groups=2)
    scheduler = warmup_then_decay(optimizer, total_steps=12, warmup_steps=3, warmup_start_factor=0.25)
    first, second = [], []
    for _ in range(12):
        first.append(optimizer.param_groups[0]["lr"])
        second.append(optimizer.param_groups[1]["lr"])
        optimizer.step()
        scheduler.step()
    assert second == pytest.approx([lr / 10 for lr in first], rel=1e-14)
    assert first[3] == pytest.approx(0.8, rel=1e-15)


def test_scheduler_resumes_from_a_checkpoint_on_the_same_sequence():
    reference_optimizer = _optimizer()
    expected = _run(reference_optimizer, warmup_then_decay(reference_optimizer, 30, 5, 0.2), 30)
    optimizer = _optimizer()
    scheduler = warmup_then_decay(optimizer, 30, 5, 0.2)
    before = _run(optimizer, scheduler, 12)[:-1]
    saved = optimizer.state_dict(), scheduler.state_dict()
    optimizer = _optimizer()
    scheduler = warmup_then_decay(optimizer, 30, 5, 0.2)
    optimizer.load_state_dict(saved[0])
    scheduler.load_state_dict(saved[1])
    assert before + _run(optimizer, scheduler, 18) == pytest.approx(expected, rel=1e-15)


def test_lr_schedule_is_the_scaled_peak_times_the_factor_at_every_step():
    rates = lr_schedule(base_lr=3e-4, base_batch=64, per_rank_batch=16, world_size=4, accumulation_steps=4,
                        rule="sqrt", total_steps=40, warmup_steps=8, warmup_start_factor=0.1)
    peak = 3e-4 * 2.0  # global batch 256 = 4 x base batch; square-root rule
    assert len(rates) == 40 and rates[8] == pytest.approx(peak, rel=1e-14)
    assert rates == pytest.approx([peak * lr_factor(step, 40, 8, 0.1) for step in range(40)], rel=1e-14)


# --------------------------------------------------------------------------------------------------------
# The same runs as PyTorch's built-in schedulers
#
# SequentialLR quirks worth knowing: every scheduler is built on the same optimizer *before* SequentialLR
# (each one's constructor changes the lr; SequentialLR resets it and undoes their first step); the second
# scheduler restarts its count at the milestone, so its T_max / total_iters is the length of the decay phase,
# not of the run; and CosineAnnealingLR takes eta_min as an absolute lr, not a factor.


def _torch_run(make_scheduler, steps: int, lr: float = 0.8) -> list[float]:
    optimizer = _optimizer(lr)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a misordered step() warns: make the comparison fail instead
        return _run(optimizer, make_scheduler(optimizer), steps)


def _ours(steps: int, lr: float = 0.8, **schedule) -> list[float]:
    optimizer = _optimizer(lr)
    return _run(optimizer, warmup_then_decay(optimizer, steps, **schedule), steps)


def _assert_same_run(ours: list[float], theirs: list[float]) -> None:
    worst = max(abs(a - b) for a, b in zip(ours, theirs, strict=True))
    assert worst < 1e-12, f"learning rates differ by up to {worst:.2e}"


@pytest.mark.parametrize(("total", "warmup", "start", "minimum"),
                         [(100, 10, 0.1, 0.0), (57, 13, 1 / 8, 0.05), (30, 1, 0.5, 0.01), (40, 39, 0.01, 0.0)])
def test_warmup_then_cosine_matches_linear_lr_then_cosine_annealing_lr(total, warmup, start, minimum):
    def torch_scheduler(optimizer):
        warm = LinearLR(optimizer, start_factor=start, end_factor=1.0, total_iters=warmup)
        cosine = CosineAnnealingLR(optimizer, T_max=total - warmup, eta_min=minimum * 0.8)
        return SequentialLR(optimizer, [warm, cosine], milestones=[warmup])

    _assert_same_run(_ours(total, warmup_steps=warmup, warmup_start_factor=start, decay="cosine",
                           min_factor=minimum), _torch_run(torch_scheduler, total))


def test_cosine_without_warmup_matches_cosine_annealing_lr():
    _assert_same_run(_ours(64, min_factor=0.1), _torch_run(lambda o: CosineAnnealingLR(o, 64, 0.08), 64))


@pytest.mark.parametrize(("total", "warmup", "step_size", "gamma"), [(100, 5, 30, 0.1), (50, 12, 7, 0.5)])
def test_warmup_then_step_decay_matches_linear_lr_then_step_lr(total, warmup, step_size, gamma):
    def torch_scheduler(optimizer):
        warm = LinearLR(optimizer, start_factor=0.25, total_iters=warmup)
        return SequentialLR(optimizer, [warm, StepLR(optimizer, step_size, gamma)], milestones=[warmup])

    ours = _ours(total, warmup_steps=warmup, warmup_start_factor=0.25, decay="step", step_size=step_size,
                 gamma=gamma)
    _assert_same_run(ours, _torch_run(torch_scheduler, total))


@pytest.mark.parametrize(("total", "warmup", "minimum"), [(80, 8, 0.0), (33, 4, 0.3)])
def test_warmup_then_linear_decay_matches_two_linear_lrs(total, warmup, minimum):
    def torch_scheduler(optimizer):
        warm = LinearLR(optimizer, start_factor=0.2, total_iters=warmup)
        down = LinearLR(optimizer, start_factor=1.0, end_factor=minimum, total_iters=total - warmup)
        return SequentialLR(optimizer, [warm, down], milestones=[warmup])

    ours = _ours(total, warmup_steps=warmup, warmup_start_factor=0.2, decay="linear", min_factor=minimum)
    _assert_same_run(ours, _torch_run(torch_scheduler, total))


def test_warmup_then_constant_matches_linear_lr():
    ours = _ours(40, warmup_steps=6, warmup_start_factor=0.3, decay="constant")
    _assert_same_run(ours, _torch_run(lambda o: LinearLR(o, start_factor=0.3, total_iters=6), 40))


# --------------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: global_batch_size(0, 4), "per_rank_batch"),
        (lambda: global_batch_size(8, 0), "world_size"),
        (lambda: global_batch_size(8, 2, accumulation_steps=0), "accumulation_steps"),
        (lambda: global_batch_size(8.0, 2), "per_rank_batch"),
        (lambda: scaled_lr(0.1, 0, 256), "base_batch"),
        (lambda: scaled_lr(0.1, 256, 0), "global_batch"),
        (lambda: scaled_lr(-0.1, 256, 512), "base_lr"),
        (lambda: scaled_lr(0.1, 256, 512, rule="cubic"), "cubic"),
        (lambda: lr_factor(-1, 100), "step"),
        (lambda: lr_factor(2.5, 100), "2.5"),
        (lambda: lr_factor(0, 0), "total_steps"),
        (lambda: lr_factor(0, 100, warmup_steps=-5), "warmup_steps"),
        (lambda: lr_factor(0, 100, warmup_steps=101), "warmup_steps=101 is longer than training"),
        (lambda: lr_factor(0, 100, 10, warmup_start_factor=1.5), "warmup_start_factor"),
        (lambda: lr_factor(0, 100, decay="exponential"), "exponential"),
        (lambda: lr_factor(0, 100, decay="step"), "step_size"),
        (lambda: lr_factor(0, 100, decay="step", step_size=0), "step_size"),
        (lambda: lr_factor(0, 100, decay="step", step_size=10, gamma=0.0), "gamma"),
        (lambda: lr_factor(0, 100, min_factor=-0.1), "min_factor"),
        (lambda: lr_schedule(0.1, 256, 32, 0, 100), "world_size"),
    ],
)
def test_bad_input_raises_value_error_naming_the_value(call, fragment):
    with pytest.raises(ValueError, match=fragment):
        call()


def test_a_bad_schedule_is_refused_before_the_optimizer_is_touched():
    optimizer = _optimizer(lr=0.8)
    with pytest.raises(ValueError, match="warmup_steps=20"):
        warmup_then_decay(optimizer, total_steps=10, warmup_steps=20)
    assert optimizer.param_groups[0]["lr"] == 0.8 and "initial_lr" not in optimizer.param_groups[0]

