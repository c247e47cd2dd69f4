"""labkit.parallel.compression: accuracy, error feedback, exactness and bytes, on 2 and 3 gloo ranks.

Every case for one world size runs inside one launch (``_every_case``); the tests read its report.  Each
compression is called directly through the protocol DDP uses (``launch`` then ``complete`` on a flat bucket
and its views), and also inside ``labkit.parallel.ddp.DistributedDataParallel`` on a small regression problem.
Tolerances are stated where they are used.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from labkit.launch import launch
from labkit.parallel.compression import (
    BF16Compression,
    CastCompression,
    FP16Compression,
    PowerSGDCompression,
    TopKCompression,
)
from labkit.parallel.ddp import DistributedDataParallel

WORLD_SIZES = (2, 3)
STEPS = 5


def _mean_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    total = tensor.double().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def _through_protocol(compression, key: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Pack ``tensors`` into one flat bucket, run launch + complete, return the results in their shapes."""
    flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
    views, offset = [], 0
    for tensor in tensors:
        views.append(flat[offset:offset + tensor.numel()].view(tensor.shape))
        offset += tensor.numel()
    compression.complete(compression.launch(key, flat, views, None))
    return [view.clone() for view in views]


def _rank_one(rank: int, step: int) -> torch.Tensor:
    """``c u v^T + d w z^T`` with c, d different per rank and step and the d summing to zero over ranks:
    each rank's gradient has rank 2, their mean rank 1.  (Only a Q shared by all ranks recovers the mean.)"""
    generator = torch.Generator().manual_seed(7)
    u, w = torch.randn(32, 1, generator=generator), torch.randn(32, 1, generator=generator)
    v, z = torch.randn(24, 1, generator=generator), torch.randn(24, 1, generator=generator)
    d = (rank - (dist.get_world_size() - 1) / 2) * (1 + step)
    return (rank + 1 + step) * (u @ v.t()) + d * (w @ z.t())


def _rank_two(rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(8)
    u, v = torch.randn(32, 2, generator=generator), torch.randn(24, 2, generator=generator)
    return u @ torch.diag(torch.tensor([rank + 1.0 + step, 2.0 - rank])) @ v.t()


def _train_regression(compression, steps: int, lr: float = 0.2) -> list[float]:
    """Each rank fits a shared random linear target on its own data; returns the global loss per step."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.0, compression=compression)
    target = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)) / 4
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 16, generator=generator)
        loss = nn.functional.mse_loss(ddp(x), x @ target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(_mean_over_ranks(loss.detach()).item())
    return losses


# --------------------------------------------------------------------------------------------------------
# What every rank runs


def _every_case() -> dict:
    rank = dist.get_rank()
    report: dict = {}

    # fp16 / bf16: error against the exact mean, relative to the largest gradient entry
    gradient = torch.randn(1000, generator=torch.Generator().manual_seed(rank)) * 10
    exact = _mean_over_ranks(gradient)
    for name, compression in (("fp16", FP16Compression()), ("bf16", BF16Compression())):
        (result,) = _through_protocol(compression, 0, [gradient.clone()])
        error = (result.double() - exact).abs().max() / gradient.abs().max()
        report[name] = {"relative_error": error.item(), "bytes_sent": compression.bytes_sent,
                        "bytes_uncompressed": compression.bytes_uncompressed, "dtype": result.dtype}

    # top-k: error feedback carries what was not sent
    topk = TopKCompression(fraction=0.1)
    applied, true_total, nonzeros = torch.zeros(100, dtype=torch.float64), torch.zeros(100), []
    for step in range(STEPS):
        g = torch.randn(100, generator=torch.Generator().manual_seed(10 * step + rank))
        (result,) = _through_protocol(topk, 0, [g.clone()])
        applied += result.double()
        true_total += g
        nonzeros.append(int((result != 0).sum()))
    report["topk"] = {
        "applied_plus_residual_error": (applied + _mean_over_ranks(topk.residuals[0])
                                        - _mean_over_ranks(true_total)).abs().max().item(),
        "applied_alone_error": (applied - _mean_over_ranks(true_total)).abs().max().item(),
        "nonzeros": nonzeros, "bytes_sent": topk.bytes_sent, "bytes_uncompressed": topk.bytes_uncompressed}

    # PowerSGD: exact for a rank-1 mean gradient; a 1-D tensor and a tiny matrix go uncompressed
    bias = torch.randn(32, generator=torch.Generator().manual_seed(rank))
    tiny = torch.randn(2, 3, generator=torch.Generator().manual_seed(50 + rank))
    for rank_r in (1, 2):
        power = PowerSGDCompression(rank=rank_r)
        errors = []
        for step in range(STEPS):
            matrix = _rank_one(rank, step)
            out_matrix, out_bias, out_tiny = _through_protocol(power, 3, [matrix, bias.clone(), tiny.clone()])
            errors.append(max(((out_matrix.double() - _mean_over_ranks(matrix)).abs().max()
                               / matrix.abs().max()).item(),
                              (out_bias.double() - _mean_over_ranks(bias)).abs().max().item(),
                              (out_tiny.double() - _mean_over_ranks(tiny)).abs().max().item()))
        report[f"powersgd_rank_{rank_r}"] = {
            "relative_errors": errors, "bytes_sent": power.bytes_sent,
            "bytes_uncompressed": power.bytes_uncompressed,
            "compressed": [power.matrix_shape(t) for t in (matrix, bias, tiny)]}

    # PowerSGD rank 1 on a rank-2 mean gradient: not exact, but error feedback keeps the books
    power = PowerSGDCompression(rank=1)
    applied, true_total, first_error, output_ranks = torch.zeros(32, 24, dtype=torch.float64), 0, None, []
    for step in range(STEPS):
        matrix = _rank_two(rank, step)
        (result,) = _through_protocol(power, 0, [matrix.clone()])
        if first_error is None:
            first_error = ((result.double() - _mean_over_ranks(matrix)).abs().max()
                           / matrix.abs().max()).item()
        output_ranks.append(int(torch.linalg.matrix_rank(result)))
        applied += result.double()
        true_total = true_total + _mean_over_ranks(matrix)
    report["powersgd_low_rank"] = {
        "first_relative_error": first_error, "output_ranks": output_ranks,
        "applied_plus_error_error": (applied + _mean_over_ranks(power.errors[0, 0])
                                     - true_total).abs().max().item()}

    # PowerSGD warm start: with error feedback switched off, repeated compression of one matrix is power
    # iteration, and the rank-1 result converges to the best rank-1 approximation (singular values 3, 1, 0.3)
    power = PowerSGDCompression(rank=1)
    generator = torch.Generator().manual_seed(9)
    u = torch.linalg.qr(torch.randn(32, 3, generator=generator)).Q
    v = torch.linalg.qr(torch.randn(24, 3, generator=generator)).Q
    matrix = u @ torch.diag(torch.tensor([3.0, 1.0, 0.3])) @ v.t()
    best = 3.0 * u[:, :1] @ v[:, :1].t()
    distances = []
    for _ in range(8):
        (result,) = _through_protocol(power, 0, [matrix.clone()])
        power.errors.clear()
        distances.append(((result - best).norm() / best.norm()).item())
    report["powersgd_warm_start"] = distances

    # Inside DDP: loss curves, and the byte counters against DDP's own count
    report["training"] = {name: _train_regression(compression, steps=30) for name, compression in (
        ("none", None), ("fp16", FP16Compression()), ("topk", TopKCompression(0.25)),
        ("powersgd", PowerSGDCompression(rank=2)))}
    report["ddp_bytes"] = {}
    for name, compression in (("fp16", FP16Compression()), ("topk", TopKCompression(0.1)),
                              ("powersgd", PowerSGDCompression(rank=2))):
        torch.manual_seed(0)
        ddp = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8)), bucket_cap_mb=0.0,
                                      compression=compression)
        for _ in range(2):  # the second step's count starts afresh
            ddp(torch.randn(4, 16)).sum().backward()
        report["ddp_bytes"][name] = {"sent": compression.bytes_sent // 2, "measured": ddp.communication_per_step(),
                                     "uncompressed": compression.bytes_uncompressed // 2,
                                     "predicted": ddp.predicted_communication()}
    return report


@pytest.fixture(scope="module")
def reports() -> dict[int, list[dict]]:
    return {world_size: launch(_every_case, nprocs=world_size, timeout=120, rank_output="none")
            for world_size in WORLD_SIZES}


# --------------------------------------------------------------------------------------------------------
# fp16 / bf16


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fp16_and_bf16_all_reduce_are_within_their_rounding_of_the_exact_mean(reports, world_size):
    # |error| <= 2^-10 * max|g| for fp16 (10 mantissa bits) and 2^-7 * max|g| for bf16 (7 bits): a rounding of
    # each rank's contribution and of each partial sum, each at most half an ulp.
    for rank, report in enumerate(reports[world_size]):
        assert 0 < report["fp16"]["relative_error"] <= 2**-10, (rank, report["fp16"])
        assert 0 < report["bf16"]["relative_error"] <= 2**-7, (rank, report["bf16"])
        assert report["bf16"]["relative_error"] > report["fp16"]["relative_error"]  # 3 fewer mantissa bits
        assert report["fp16"]["dtype"] == torch.float32  # cast back into the bucket's dtype


def test_casting_sends_half_the_bytes_of_float32(reports):
    for name in ("fp16", "bf16"):
        report = reports[2][0][name]
        assert report["bytes_uncompressed"] == 1000 * 4 and report["bytes_sent"] == 1000 * 2


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ddp_counts_what_each_compression_puts_into_its_collectives(reports, world_size):
    counted = reports[world_size][0]["ddp_bytes"]
    plain = (16 * 32 + 32 + 32 * 8 + 8) * 4
    for name, found in counted.items():
        assert found["uncompressed"] == plain and found["predicted"] == {"all_reduce": plain}, name
    assert counted["fp16"]["measured"] == {"all_reduce": plain // 2} and counted["fp16"]["sent"] == plain // 2
    # top-k all-gathers: each rank contributes k values and int32 indices per bucket (bytes_sent); the
    # collective's size n, as labkit counts an all-gather, is its output: every rank's contribution
    k_total = sum(math.ceil(0.1 * numel) for numel in (16 * 32, 32, 32 * 8, 8))
    assert counted["topk"]["sent"] == k_total * (4 + 4)
    assert counted["topk"]["measured"] == {"all_gather": world_size * k_total * (4 + 4)}
    # PowerSGD: P and Q all-reduces for the matrices, the biases uncompressed, in every bucket
    assert counted["powersgd"]["measured"] == {"all_reduce": counted["powersgd"]["sent"]}
    assert counted["powersgd"]["sent"] == ((32 + 16) * 2 + (8 + 32) * 2 + 32 + 8) * 4


# --------------------------------------------------------------------------------------------------------
# top-k with error feedback


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_topk_residual_carries_exactly_the_mass_that_was_not_sent(reports, world_size):
    # sum over steps of applied updates + mean residual == mean over ranks of the summed true gradients
    for rank, report in enumerate(reports[world_size]):
        assert report["topk"]["applied_plus_residual_error"] < 1e-5, (rank, report["topk"])
        assert report["topk"]["applied_alone_error"] > 0.1  # without the residual the books do not balance


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_topk_sends_k_values_and_int32_indices_per_rank(reports, world_size):
    k = math.ceil(0.1 * 100)
    report = reports[world_size][0]["topk"]
    assert report["bytes_sent"] == STEPS * k * (4 + 4)
    assert report["bytes_uncompressed"] == STEPS * 100 * 4
    assert all(0 < count <= world_size * k for count in report["nonzeros"]), report["nonzeros"]


# --------------------------------------------------------------------------------------------------------
# PowerSGD


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("rank_r", (1, 2))
def test_powersgd_is_exact_for_a_rank_one_mean_gradient(reports, world_size, rank_r):
    for rank, report in enumerate(reports[world_size]):
        errors = report[f"powersgd_rank_{rank_r}"]["relative_errors"]
        assert max(errors) < 1e-5, f"rank {rank}, PowerSGD rank {rank_r}: relative errors per step {errors}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_powersgd_rank_one_misses_a_rank_two_gradient_but_error_feedback_balances_the_books(reports,
                                                                                           world_size):
    for report in reports[world_size]:
        low_rank = report["powersgd_low_rank"]
        assert low_rank["first_relative_error"] > 1e-2, low_rank  # the exactness test above can fail
        assert set(low_rank["output_ranks"]) == {1}
        assert low_rank["applied_plus_error_error"] < 1e-4, low_rank


def test_powersgd_warm_start_converges_to_the_best_rank_one_approximation(reports):
    distances = reports[2][0]["powersgd_warm_start"]
    assert distances[0] > 1e-2, distances  # one power-iteration step from a random Q is not enough
    assert distances[-1] < 1e-5, distances  # but Q carried over from step to step converges, as (1/3)^(2t)
    assert all(later <= earlier for earlier, later in zip(distances[:4], distances[1:5], strict=True)), \
        distances


@pytest.mark.parametrize("rank_r", (1, 2))
def test_powersgd_bytes_follow_n_plus_m_times_r_and_small_tensors_go_uncompressed(reports, rank_r):
    report = reports[2][0][f"powersgd_rank_{rank_r}"]
    assert report["compressed"] == [(32, 24, rank_r), None, None]  # the 2 x 3 matrix would not shrink 2x
    per_step = ((32 + 24) * rank_r + 32 + 2 * 3) * 4
    assert report["bytes_sent"] == STEPS * per_step
    assert report["bytes_uncompressed"] == STEPS * (32 * 24 + 32 + 6) * 4


# --------------------------------------------------------------------------------------------------------
# Inside DDP


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_training_with_each_compression_still_reduces_the_loss(reports, world_size):
    training = reports[world_size][0]["training"]
    for name, losses in training.items():
        assert losses[-1] < 0.5 * losses[0], f"{name}: loss went from {losses[0]:.3f} to {losses[-1]:.3f}"
    # fp16 follows the uncompressed run closely (2^-11 relative rounding per step)
    assert max(abs(a - b) for a, b in zip(training["fp16"], training["none"], strict=True)) < 1e-3


def test_every_rank_sees_the_same_loss_curve(reports):
    for world_size, per_rank in reports.items():
        assert all(report["training"] == per_rank[0]["training"] for report in per_rank), world_size


def test_bad_compression_arguments_raise_naming_the_value():
    for fraction in (0, 1.5, -0.1, True):
        with pytest.raises(ValueError, match=repr(fraction)):
            TopKCompression(fraction)
    with pytest.raises(ValueError, match="rank.*0"):
        PowerSGDCompression(rank=0)
    with pytest.raises(ValueError, match="min_compression_rate.*0.5"):
        PowerSGDCompression(min_compression_rate=0.5)
    with pytest.raises(ValueError, match="float32"):
        CastCompression(torch.float32)
