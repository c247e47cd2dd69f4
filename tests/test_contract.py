"""Every parallel wrapper through the same generic code: the contract of ``labkit.parallel.base``.

DDP, ZeRO-1, ZeRO-2 and FSDP are built from one table and then used only through the contract: a few training
steps, ``communication_per_step()`` against ``predicted_communication()`` and the bytes the layout implies,
``memory_breakdown()`` against the bytes each stage should hold, ``m`` forwards then ``m`` backwards with
gradient sync off and one explicit ``reduce_gradients()`` (a pipeline schedule's order), ``gradients()`` by name,
global-norm clipping, and ``full_state_dict()``; each is compared with one process training on the whole batch.
One launch per world size runs every case (launching ranks is the slow part); 3 ranks make every shard uneven.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist

from labkit.launch import launch
from labkit.models import GPTConfig, TinyGPT
from labkit.parallel.base import SingleProcess
from labkit.parallel.ddp import DistributedDataParallel
from labkit.parallel.fsdp import FullyShardedDataParallel
from labkit.parallel.zero import ZeroDataParallel

GPT = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8)  # tied embedding and head
WRAPPERS = {
    "ddp": lambda model: DistributedDataParallel(model, bucket_cap_mb=0.002),
    "zero1": lambda model: ZeroDataParallel(model, stage=1, bucket_cap_mb=0.002),
    "zero2": lambda model: ZeroDataParallel(model, stage=2, bucket_cap_mb=1000.0),  # one bucket: exact bytes below
    "fsdp": lambda model: FullyShardedDataParallel(model),
    # FSDP2's habit: only the Linear and Embedding layers sharded, the norms replicated and all-reduced
    "fsdp shard linear": lambda model: FullyShardedDataParallel(model, shard_modules=(torch.nn.Linear, torch.nn.Embedding)),
}
PER_RANK, MICRO_BATCHES, STEPS, ATOL = 2, 3, 3, 2e-5
SGD = {"lr": 0.1, "momentum": 0.9}


def _batch(world_size: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a (step, micro-batch): ``PER_RANK`` sequences per rank, rank r's rows r*PER_RANK..."""
    generator = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, GPT.vocab_size, (world_size * PER_RANK, GPT.block_size + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _mine(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    return tensor[rank * PER_RANK:(rank + 1) * PER_RANK]


def _rows(full: torch.Tensor, local: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """The rows of ``full`` a rank holds when ``local`` is its shard (``torch.chunk`` along dim 0) or all of it."""
    if local.shape == full.shape:
        return full
    full = full.reshape(1) if full.dim() == 0 else full
    chunk = math.ceil(full.shape[0] / world_size)
    return full[min(rank * chunk, full.shape[0]):min((rank + 1) * chunk, full.shape[0])]


def _largest_difference(gradients: dict, reference: dict, rank: int, world_size: int) -> float:
    """Largest absolute difference between this rank's gradients (full, or its shard) and the reference's rows."""
    return max((g - _rows(reference[n], g, rank, world_size)).abs().max().item()
               for n, g in gradients.items() if g is not None and g.numel())


def _padded(shape: torch.Size, world_size: int) -> int:
    """Elements a tensor occupies in the flat buffers of the shard layout: ``N`` chunks of ``ceil(rows/N)`` rows."""
    rows = shape[0] if len(shape) else 1
    return world_size * math.ceil(rows / world_size) * (math.prod(shape[1:]) if len(shape) else 1)


def _expected_bytes(name: str, model: torch.nn.Module, wrapper, world_size: int) -> dict[str, int]:
    """The bytes entering each collective per step, from the parameter shapes alone."""
    parameters = list(model.parameters())
    psi = 4 * sum(p.numel() for p in parameters)
    padded = 4 * sum(_padded(p.shape, world_size) for p in parameters)
    if name == "ddp":
        return {"all_reduce": psi}
    if name == "zero1":
        return {"all_reduce": psi, "broadcast": psi}
    if name == "zero2":
        return {"reduce_scatter": padded, "all_gather": padded}
    sharded = {f"{module_name}.{name}".lstrip(".") for module_name, module in model.named_modules()
               if name_filter(module) for name, _ in module.named_parameters(recurse=False)}
    if name == "fsdp":  # every parameter sharded
        sharded = {n for n, _ in model.named_parameters()}
    shards = {n: p for n, p in model.named_parameters() if n in sharded}
    padded = 4 * sum(_padded(p.shape, world_size) for p in shards.values())
    in_blocks = 4 * sum(_padded(p.shape, world_size) for n, p in shards.items() if n.startswith("blocks."))
    expected = {"all_gather": padded + in_blocks, "reduce_scatter": padded}  # blocks gathered again for backward
    replicated = 4 * sum(p.numel() for n, p in model.named_parameters() if n not in sharded)
    return {**expected, "all_reduce": replicated} if replicated else expected


def name_filter(module: torch.nn.Module) -> bool:
    """FSDP2's habit (the "fsdp shard linear" wrapper): shard the Linear and Embedding layers only."""
    return isinstance(module, (torch.nn.Linear, torch.nn.Embedding))


def _every_case() -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    report: dict = {}
    reference = SingleProcess(TinyGPT(GPT, seed=0))
    reference_optimizer = reference.make_optimizer(torch.optim.SGD, **SGD)
    for step in range(STEPS):
        inputs, targets = _batch(world_size, step)
        reference_optimizer.zero_grad()
        reference(inputs, targets)[1].backward()
        reference_optimizer.step()
    # m micro-batches, whole global batch, one process, at the trained weights: the gradient to reproduce
    accumulated = copy.deepcopy(reference.module)
    accumulated.zero_grad(set_to_none=True)
    for micro in range(MICRO_BATCHES):
        (accumulated(*_batch(world_size, 99, micro))[1] / MICRO_BATCHES).backward()
    whole_gradients = {n: p.grad.clone() for n, p in accumulated.named_parameters()}
    clipped = copy.deepcopy(reference.module)
    clipped.zero_grad(set_to_none=True)
    clipped(*_batch(world_size, 5))[1].backward()
    clip_norm = float(torch.nn.utils.clip_grad_norm_(clipped.parameters(), 0.05))
    clipped_gradients = {n: p.grad.clone() for n, p in clipped.named_parameters()}

    for name, wrap in WRAPPERS.items():
        case: dict = {}
        plain = TinyGPT(GPT, seed=0)
        model = wrap(plain)
        optimizer = model.make_optimizer(torch.optim.SGD, **SGD)
        for step in range(STEPS):
            inputs, targets = _batch(world_size, step)
            optimizer.zero_grad()
            model(_mine(inputs, rank), _mine(targets, rank))[1].backward()
            optimizer.step()
        case["communication"] = model.communication_per_step()
        case["predicted"] = model.predicted_communication()
        case["expected"] = _expected_bytes(name, TinyGPT(GPT, seed=0), model, world_size)
        case["memory"] = model.memory_breakdown()
        full = model.full_state_dict()
        case["state_error"] = max((full[n] - t).abs().max().item() for n, t in reference.module.state_dict().items())
        case["state_keys_match"] = sorted(full) == sorted(reference.module.state_dict())

        # m forwards, then m backwards, sync off; then one explicit reduction
        optimizer.zero_grad()
        model.set_requires_gradient_sync(False)
        losses = [model(*(_mine(t, rank) for t in _batch(world_size, 99, micro)))[1] / MICRO_BATCHES
                  for micro in range(MICRO_BATCHES)]
        for loss in losses:
            loss.backward()
        quiet = model.communication_per_step()
        model.reduce_gradients()
        model.set_requires_gradient_sync(True)
        gradients = model.gradients()
        case["gradient_names_match"] = sorted(gradients) == sorted(whole_gradients)
        case["gradient_error"] = _largest_difference(gradients, whole_gradients, rank, world_size)
        case["sync_off_all_reduce_bytes"] = quiet.get("all_reduce", 0) + quiet.get("reduce_scatter", 0)

        # global-norm clipping through the contract
        optimizer.zero_grad()
        inputs, targets = _batch(world_size, 5)
        model(_mine(inputs, rank), _mine(targets, rank))[1].backward()
        norm = float(model.clip_grad_norm_(0.05))
        case["clip_norm_error"] = abs(norm - clip_norm)
        case["clip_error"] = _largest_difference(model.gradients(), clipped_gradients, rank, world_size)
        report[name] = case
    return report


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def reports(request) -> tuple[int, list[dict]]:
    return request.param, launch(_every_case, nprocs=request.param, timeout=240, rank_output="none")


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_every_wrapper_trains_like_one_process_and_gives_back_the_full_model(reports, name):
    _, per_rank = reports
    for case in (report[name] for report in per_rank):
        assert case["state_keys_match"]
        assert case["state_error"] < ATOL, f"{name}: full_state_dict differs from one process by {case['state_error']}"


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_measured_bytes_per_step_equal_the_layouts_prediction_and_the_parameter_count(reports, name):
    _, per_rank = reports
    for case in (report[name] for report in per_rank):
        assert case["communication"] == case["predicted"] == case["expected"], name


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_m_forwards_then_m_backwards_then_one_reduction_give_the_whole_batch_gradient(reports, name):
    _, per_rank = reports
    for case in (report[name] for report in per_rank):
        assert case["gradient_names_match"]
        assert case["gradient_error"] < ATOL, f"{name}: gradient off by {case['gradient_error']}"
        assert case["sync_off_all_reduce_bytes"] == 0, f"{name} reduced gradients while sync was off"


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_clipping_by_the_global_norm_equals_clip_grad_norm_on_one_process(reports, name):
    _, per_rank = reports
    for case in (report[name] for report in per_rank):
        assert case["clip_norm_error"] < 1e-5 and case["clip_error"] < 1e-6, name


def test_memory_breakdown_shrinks_stage_by_stage_as_zero_says(reports):
    world_size, per_rank = reports
    psi = 4 * TinyGPT(GPT, seed=0).num_parameters()
    for report in per_rank:
        ddp, zero1, zero2, fsdp = (report[name]["memory"] for name in ("ddp", "zero1", "zero2", "fsdp"))
        assert ddp["weights"] == psi and ddp["optimizer_states"] == psi  # SGD momentum: one buffer per weight
        assert zero1["weights"] == psi and zero1["optimizer_states"] < psi
        assert zero2["weights"] == psi and zero2["gradients"] < psi and zero2["optimizer_states"] < psi
        assert fsdp["weights"] < psi and fsdp["optimizer_states"] < psi
    for name in ("zero1", "zero2", "fsdp"):  # the shards add up to one copy of the momentum
        assert sum(report[name]["memory"]["optimizer_states"] for report in per_rank) == psi, name
    padded = 4 * sum(_padded(p.shape, world_size) for p in TinyGPT(GPT, seed=0).parameters())
    assert sum(report["fsdp"]["memory"]["weights"] for report in per_rank) <= padded + 4 * world_size * 8
