"""labkit.precision: formats, gradient underflow on a real model, master weights, and the dynamic loss scaler
against ``torch.amp.GradScaler`` (step for step) and under data parallelism on 2 gloo ranks."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from labkit.launch import launch
from labkit.measure import time_step
from labkit.models import GPTConfig, MLPConfig, TinyGPT, TinyMLP
from labkit.parallel.ddp import DistributedDataParallel
from labkit.precision import (
    DynamicLossScaler,
    MasterWeights,
    autocast,
    autocast_dtype,
    float_format,
    format_table,
    gradient_underflow,
    needs_loss_scaling,
    overflow_fraction,
    underflow_fraction,
)

# --------------------------------------------------------------------------------------------------------
# Formats and underflow


def test_float_formats_match_the_ieee_layouts():
    fp32, fp16, bf16 = (float_format(dtype) for dtype in (torch.float32, torch.float16, torch.bfloat16))
    assert (fp32.exponent_bits, fp32.mantissa_bits) == (8, 23)
    assert (fp16.exponent_bits, fp16.mantissa_bits, fp16.max) == (5, 10, 65504.0)
    assert (bf16.exponent_bits, bf16.mantissa_bits) == (8, 7)
    assert fp16.smallest_subnormal == 2.0 ** -24 and fp32.smallest_subnormal == 2.0 ** -149
    assert torch.tensor(fp16.smallest_subnormal, dtype=torch.float16).item() > 0
    assert torch.tensor(fp16.smallest_subnormal / 4, dtype=torch.float16).item() == 0
    assert "bf16" in format_table() and "6.55e+04" in format_table()


def test_underflow_and_overflow_fractions_count_values_lost_in_the_cast():
    values = torch.tensor([1e-10, 1e-6, 1.0, 1e5, 0.0])
    assert underflow_fraction(values, torch.float16) == 0.25  # 1e-10 of the four nonzero values
    assert underflow_fraction(values, torch.bfloat16) == 0.0
    assert overflow_fraction(values, torch.float16) == 0.2  # 1e5 > 65504
    assert overflow_fraction(values, torch.bfloat16) == 0.0


def test_gradients_of_a_real_model_vanish_in_fp16_and_survive_with_scaling_or_bf16():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig.preset("100k"))
    idx, targets = torch.randint(0, 32, (2, 64)), torch.randint(0, 32, (2, 64))

    def loss_fn(m):  # one of 64 accumulated micro-batches: the loss is divided by 64
        return m(idx, targets)[1] / 64

    report = gradient_underflow(model, loss_fn, scale=2.0 ** 16)
    assert report["fp16"].vanished > 0.02
    assert report["fp16_scaled"].vanished < report["fp16"].vanished / 100
    assert report["bf16"].vanished < report["fp16"].vanished / 100
    assert not any(result.overflowed for result in report.values())
    assert report["fp16_scaled"].relative_error < report["fp16"].relative_error
    assert all(parameter.grad is None for parameter in model.parameters())
    too_large = gradient_underflow(model, loss_fn, scale=2.0 ** 40)["fp16_scaled"]
    assert too_large.overflowed and too_large.relative_error == math.inf


def test_the_autocast_policy_is_bf16_on_a_cpu_and_only_fp16_needs_scaling():
    assert autocast_dtype("cpu") == torch.bfloat16
    assert needs_loss_scaling(torch.float16) and not needs_loss_scaling(torch.bfloat16)
    layer = nn.Linear(4, 4)
    with autocast("cpu"):
        assert layer(torch.randn(2, 4)).dtype == torch.bfloat16


def test_time_step_measures_a_positive_step_time_and_leaves_the_model_alone():
    model = TinyMLP(MLPConfig(8, (16,), 4))
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    seconds = time_step(model, lambda m: nn.functional.cross_entropy(m(x), y), torch.bfloat16, repeats=2)
    assert seconds > 0 and all(parameter.grad is None for parameter in model.parameters())


# --------------------------------------------------------------------------------------------------------
# Master weights


def test_master_weights_keep_updates_that_bf16_weights_round_away():
    # lr * grad = 1e-3 is below half the bf16 spacing at 1.0 (2^-8): added to a bf16 weight it is lost.
    plain = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    with_master = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    master = MasterWeights([with_master])
    plain_optimizer = torch.optim.SGD([plain], lr=1e-3)
    master_optimizer = torch.optim.SGD(master.parameters(), lr=1e-3)
    for _ in range(10):
        for parameter in (plain, with_master):
            parameter.grad = torch.ones(4, dtype=torch.bfloat16)
        plain_optimizer.step()
        assert master.step(master_optimizer)
    assert torch.equal(plain, torch.ones(4, dtype=torch.bfloat16))  # ten updates, no change
    assert torch.allclose(master.parameters()[0], torch.full((4,), 0.99), atol=1e-6)
    assert torch.equal(with_master, torch.full((4,), 0.99).to(torch.bfloat16))
    assert master.parameters()[0].grad is None  # the fp32 gradients are freed after the step


def test_master_weights_over_an_fp32_model_train_exactly_like_the_plain_optimizer():
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    plain, mastered = TinyMLP(MLPConfig(8, (16,), 4)), TinyMLP(MLPConfig(8, (16,), 4))
    master = MasterWeights(mastered.parameters())
    optimizers = [torch.optim.AdamW(plain.parameters(), lr=0.01), torch.optim.AdamW(master.parameters(), lr=0.01)]
    for _ in range(3):
        for model, optimizer in zip((plain, mastered), optimizers, strict=True):
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            master.step(optimizer) if model is mastered else optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), mastered.parameters(), strict=True))


# --------------------------------------------------------------------------------------------------------
# The dynamic loss scaler against torch.amp.GradScaler


def _train_with_scaler(scaler, dtype: torch.dtype, reduction: str, steps: int = 30):
    """A TinyMLP run engineered to overflow: a high initial scale, a short growth interval, and two steps
    whose inputs are 1e30 times too large.  Returns the scale before each step, which steps stepped, the
    final parameters."""
    model = TinyMLP(MLPConfig(8, (16,), 32), seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    steps_taken = []
    original_step = optimizer.step

    def counting_step(*args, **kwargs):
        steps_taken.append(True)
        return original_step(*args, **kwargs)

    optimizer.step = counting_step
    generator = torch.Generator().manual_seed(0)
    scales, stepped = [], []
    for step in range(steps):
        x, y = torch.randn(16, 8, generator=generator), torch.randint(0, 32, (16,), generator=generator)
        if step in (12, 13):
            x = x * 1e30
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = nn.functional.cross_entropy(model(x), y, reduction=reduction)
        scales.append(scaler.get_scale())
        scaler.scale(loss).backward()
        before = len(steps_taken)
        scaler.step(optimizer)
        scaler.update()
        stepped.append(len(steps_taken) > before)
    return scales, stepped, [parameter.detach().clone() for parameter in model.parameters()]


@pytest.mark.parametrize(("dtype", "init_scale", "reduction"), [
    (torch.float16, 2.0 ** 20, "mean"),  # fp16's range overflows in backward
    (torch.bfloat16, 2.0 ** 126, "sum"),  # float32's top: overflows, and growth to 2^128 = inf is refused
])
def test_dynamic_loss_scaler_matches_grad_scaler_step_for_step(dtype, init_scale, reduction):
    arguments = {"init_scale": init_scale, "growth_interval": 3}
    ours = _train_with_scaler(DynamicLossScaler(**arguments), dtype, reduction)
    torchs = _train_with_scaler(torch.amp.GradScaler("cpu", **arguments), dtype, reduction)
    assert ours[0] == torchs[0], "scale sequences differ"
    assert ours[1] == torchs[1], "skipped steps differ"
    assert all(torch.equal(a, b) for a, b in zip(ours[2], torchs[2], strict=True))
    scales, stepped = ours[0], ours[1]
    assert stepped.count(False) >= 4 and not stepped[12] and not stepped[13]  # overflows happened ...
    assert sum(later > earlier for earlier, later in itertools.pairwise(scales)) >= 3  # ... and so did growth


def test_the_scaler_state_dict_loads_into_grad_scaler_and_back():
    ours = DynamicLossScaler(init_scale=1024.0, growth_interval=7)
    ours._growth_tracker = 3
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(ours.state_dict())
    assert theirs.state_dict() == ours.state_dict()
    again = DynamicLossScaler()
    again.load_state_dict(theirs.state_dict())
    assert again.state_dict() == ours.state_dict()


def test_a_disabled_scaler_is_a_plain_optimizer_step():
    scaler = DynamicLossScaler(enabled=False)
    parameter = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    loss = parameter.sum()
    assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    loss.backward()
    assert scaler.step(optimizer) and torch.equal(parameter.detach(), torch.zeros(2))
    scaler.update()


def test_the_scaler_rejects_bad_arguments_and_misuse():
    for bad in ({"init_scale": 0.0}, {"init_scale": math.inf}, {"growth_factor": 1.0}, {"backoff_factor": 1.0},
                {"growth_interval": 0}):
        with pytest.raises(ValueError):
            DynamicLossScaler(**bad)
    scaler = DynamicLossScaler()
    parameter = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    with pytest.raises(RuntimeError, match="no inf checks"):
        scaler.update()
    scaler.scale(parameter.sum()).backward()
    scaler.unscale_(optimizer)
    assert torch.equal(parameter.grad, torch.ones(2))
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(optimizer)
    assert scaler.step(optimizer)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.step(optimizer)


# --------------------------------------------------------------------------------------------------------
# Under data parallelism: ranks agree to skip


def _overflow_on_one_rank() -> dict[str, tuple]:
    """On 2 ranks: rank 1 alone overflows on steps 1 and 3.  Three set-ups, one result each:
    ``ddp``: rank 1's *input* is too large, so its local gradient is inf before the all-reduce;
    ``shard``: after DDP's all-reduce, rank 1 alone finds an inf (as a rank checking its own ZeRO shard would);
    ``shard_unsynced``: the same, with the flag all-reduce switched off (the control: ranks diverge)."""
    rank = dist.get_rank()
    results = {}
    for name, sync in (("ddp", True), ("shard", True), ("shard_unsynced", False)):
        model = DistributedDataParallel(TinyMLP(MLPConfig(8, (16,), 4), seed=0))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = DynamicLossScaler(init_scale=2.0 ** 8, growth_interval=2, sync_found_inf=sync)
        generator = torch.Generator().manual_seed(rank)
        scales, stepped = [], []
        for step in range(5):
            x, y = torch.randn(8, 8, generator=generator), torch.randint(0, 4, (8,), generator=generator)
            overflow_here = rank == 1 and step in (1, 3)
            if name == "ddp" and overflow_here:
                x = x * 1e38
            optimizer.zero_grad()
            scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
            if name != "ddp" and overflow_here:
                next(model.parameters()).grad[0, 0] = math.inf
            scales.append(scaler.get_scale())
            stepped.append(scaler.step(optimizer))
            scaler.update()
        results[name] = (scales, stepped, [parameter.detach().clone() for parameter in model.parameters()])
    return results


def test_ranks_skip_the_same_steps_when_only_one_rank_overflows():
    rank0, rank1 = launch(_overflow_on_one_rank, nprocs=2, timeout=60, rank_output="none")
    for name in ("ddp", "shard"):
        assert rank0[name][1] == rank1[name][1] == [True, False, True, False, True], name
        assert rank0[name][0] == rank1[name][0], name
        assert all(torch.equal(a, b) for a, b in zip(rank0[name][2], rank1[name][2], strict=True)), name
    # Without agreeing on the flag, rank 0 steps where rank 1 skips, and the replicas drift apart.
    assert rank0["shard_unsynced"][1] == [True] * 5 and rank1["shard_unsynced"][1] == [True, False, True, False, True]
    assert not all(torch.equal(a, b) for a, b in zip(rank0["shard_unsynced"][2], rank1["shard_unsynced"][2],
                                                      strict=True))


def test_the_exercise_teaches_the_update_rule_the_scaler_uses():
    from labkit.grading.checkers.mixed_precision import UPDATE_CASES, _reference_update_scale

    for growth_factor, backoff_factor, growth_interval, init_scale, overflows in UPDATE_CASES:
        scaler = DynamicLossScaler(init_scale, growth_factor, backoff_factor, growth_interval)
        parameter = nn.Parameter(torch.zeros(1))
        optimizer = torch.optim.SGD([parameter], lr=0.0)
        scale, good_steps = init_scale, 0
        for found_inf in overflows:
            parameter.grad = torch.tensor([math.inf if found_inf else 1.0])
            assert scaler.step(optimizer) is not found_inf
            scaler.update()
            scale, good_steps = _reference_update_scale(scale, found_inf, good_steps, growth_factor,
                                                        backoff_factor, growth_interval)
            assert (scaler.get_scale(), scaler.state_dict()["_growth_tracker"]) == (scale, good_steps)
