"""labkit.parallel.fsdp (ZeRO-3) against single-process training and ``fully_shard`` (FSDP2).

As in ``tests/test_zero.py`` (whose models, data and helpers this file uses) every distributed case for one
world size runs inside one launch, world sizes 2 and 3, and a control shows each comparison can fail.
``fully_shard`` runs on CPU and gloo in torch 2.14 over ``init_device_mesh("cpu", (N,))``; our parameters are
sharded as its are (dim 0, ``torch.chunk``), so each rank's shard of each parameter, by name, equals its
``DTensor.to_local()``; with the same mixed-precision policy (bf16 gather, fp32 reduce) training matches it
bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from labkit.launch import RankFailed, launch
from labkit.parallel.fsdp import FullyShardedDataParallel
from tests.test_zero import (
    ATOL,
    MICRO,
    OPTIMIZERS,
    PSI,
    STEPS,
    SYNC_MODES,
    _batches,
    _check_bit_identical_on_every_rank,
    _check_clipping,
    _check_gradient_sync,
    _check_trains_like_a_single_process,
    _check_vs_torch,
    _clipping_case,
    _difference,
    _error,
    _gradient_sync_case,
    _groups,
    _launch_every_case,
    _loss,
    _make,
    _padded_and_local,
    _rows,
    _slice,
    _state,
    _train,
    _trained,
    _vs_single,
)

VARIANTS = ("zero3", "zero3 no prefetch", "zero3 explicit units")


def _unit_shapes() -> list[list[torch.Size]]:
    """The GPT's parameter shapes per unit: the root (embeddings, tied head, final norm), then each block."""
    named = list(_make("gpt").named_parameters())
    return [[p.shape for name, p in named if not name.startswith("blocks.")]] + [
        [p.shape for name, p in named if name.startswith(f"blocks.{index}.")] for index in (0, 1)]


def _padded(world_size: int) -> list[int]:
    """Elements of each unit's padded all-gather / reduce-scatter buffer."""
    return [world_size * _padded_and_local(shapes, world_size, 0)[0] for shapes in _unit_shapes()]


# --------------------------------------------------------------------------------------------------------
# What every rank runs


def _every_case() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    report = _vs_single(VARIANTS, rank, world_size, mesh)
    report["vs_torch"], report["local shards"] = {}, {}
    for kind in ("gpt", "frozen"):
        batches = _batches(kind, world_size)
        for optimizer_name in OPTIMIZERS:
            theirs = _trained("torch fully_shard", kind, optimizer_name, rank, batches, mesh)
            report["vs_torch"][kind, optimizer_name] = _difference(
                report["states"]["zero3", kind, optimizer_name], _state(theirs))
            ours = _trained("zero3", kind, optimizer_name, rank, batches)
            theirs_local = {name: p.to_local() for name, p in theirs.named_parameters()}
            other_rank = {name: _rows(p.full_tensor(), world_size, (rank + 1) % world_size)
                          for name, p in theirs.named_parameters()}
            mine = {name: p.detach() for name, p in ours.module.named_parameters()}
            report["local shards"][kind, optimizer_name] = (_difference(mine, theirs_local),
                                                            _difference(mine, other_rank))
    report["gradient sync"] = _gradient_sync_case(FullyShardedDataParallel, rank, world_size)
    report["clipping"] = _clipping_case(_with_groups, rank, world_size)
    for case in (_memory_case, _communication_case, _unsharding_case, _mixed_precision_case, _param_groups_case,
                 _accumulation_case, _eval_and_buffers_case, _bad_input_case):
        report.update(case(rank, world_size))
    return report


def _with_groups(module: nn.Module) -> tuple[FullyShardedDataParallel, torch.optim.Optimizer]:
    model = FullyShardedDataParallel(module)
    return model, torch.optim.AdamW(_groups(model.module.named_parameters()), lr=0.01)


def _memory_case(rank: int, world_size: int) -> dict:
    model = _trained("zero3", "gpt", "adamw", rank, _batches("gpt", world_size, steps=1))
    return {"memory": model.memory_breakdown()}


def _communication_case(rank: int, world_size: int) -> dict:
    """Bytes entering collectives in the second of two steps, measured, beside the layout's figure."""
    batches = [_slice(batch, rank) for batch in _batches("gpt", world_size, steps=2)]
    found = {}
    for compute_dtype in (None, torch.bfloat16):
        model = FullyShardedDataParallel(_make("gpt"), compute_dtype=compute_dtype)
        _train(model, model.make_optimizer(torch.optim.AdamW, lr=0.01), batches)
        found[compute_dtype] = (model.communication_per_step(), model.predicted_communication())
    return {"communication": found}


def _unsharding_case(rank: int, world_size: int) -> dict:
    """What is gathered when each block's forward starts, with and without prefetch; nothing after a step."""
    found = {}
    for prefetch in (True, False):
        model = FullyShardedDataParallel(_make("gpt"), prefetch=prefetch)
        seen = []

        def record(module, args, model=model, seen=seen):
            following = model.units[2].flats
            seen.append((model.unsharded_bytes(), any(f.handle is not None or f.gathered for f in following),
                         module.attn.query.weight.shape))

        for block in model.module.blocks:
            block.register_forward_pre_hook(record)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        _train(model, optimizer, [_slice(_batches("gpt", world_size, 1)[0], rank)])
        found[prefetch] = {"at block forward": seen, "after step": model.unsharded_bytes(),
                           "parameter shapes between steps": {
                               name: tuple(p.shape) for name, p in model.module.named_parameters()}}
    return {"unsharding": found}


def _mixed_precision_case(rank: int, world_size: int) -> dict:
    """bf16 compute on fp32 shards, against fully_shard with the same policy (gathered in bf16, reduced in
    fp32): bf16 rounding makes both differ from fp32 training, but in the same way."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    batches = [_slice(batch, rank) for batch in _batches("gpt", world_size)]
    reference = _make("gpt")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in reference.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(reference, mesh=mesh, mp_policy=policy)
    _train(reference, torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.1), batches)
    model = FullyShardedDataParallel(_make("gpt"), compute_dtype=torch.bfloat16)
    dtypes = []
    model.module.blocks[0].register_forward_pre_hook(lambda m, a: dtypes.append(m.mlp.fc.weight.dtype))
    _train(model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1), batches)
    fp32 = _trained("zero3", "gpt", "adamw", rank, _batches("gpt", world_size))
    return {"bf16": {"vs_fully_shard": _difference(_state(model), _state(reference)),
                     "vs_fp32": _difference(_state(model), _state(fp32)),
                     "compute dtypes": set(dtypes),
                     "shard dtypes": {p.dtype for p in model.parameters()}}}


def _param_groups_case(rank: int, world_size: int) -> dict:
    """Two parameter groups (own weight decay and LR) on the shards, and a StepLR schedule."""
    batches = _batches("gpt", world_size)
    reference = _make("gpt")
    optimizer = torch.optim.AdamW(_groups(reference.named_parameters()), lr=0.01)
    _train(reference, optimizer, batches, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))
    model = FullyShardedDataParallel(_make("gpt"))
    optimizer = torch.optim.AdamW(_groups(model.module.named_parameters()), lr=0.01)
    _train(model, optimizer, [_slice(batch, rank) for batch in batches],
           torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))
    return {"param_groups": (_difference(_state(model), _state(reference)),
                             [group["lr"] for group in optimizer.param_groups])}


def _accumulation_case(rank: int, world_size: int) -> dict:
    """Two micro-batches per step, each with its own synchronised forward and backward."""
    batches = _batches("gpt", world_size, steps=4)
    reference = _make("gpt")
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.1)
    _train(reference, optimizer, [tuple(torch.cat(parts) for parts in zip(*batches[i:i + 2], strict=True))
                                  for i in (0, 2)])
    model = FullyShardedDataParallel(_make("gpt"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for i in (0, 2):
        optimizer.zero_grad()
        for batch in batches[i:i + 2]:
            (_loss(model, _slice(batch, rank)) / 2).backward()
        optimizer.step()
    return {"accumulation": _difference(_state(model), _state(reference))}


def _eval_and_buffers_case(rank: int, world_size: int) -> dict:
    """Evaluation under no_grad frees everything; full_state_dict() holds the buffers (BatchNorm's) too."""
    x = _batches("gpt", world_size, 1)[0][0]
    model = FullyShardedDataParallel(_make("gpt"))
    with torch.no_grad():
        logits = model(x)[0]
    found = {"vs_single": (logits - _make("gpt")(x)[0]).abs().max().item(), "unsharded after": model.unsharded_bytes()}

    def normed() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))

    inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    plain, sharded = normed(), FullyShardedDataParallel(normed(), units=[])
    plain(inputs).sum().backward()
    sharded(inputs).sum().backward()
    found["with buffers"] = _difference(sharded.full_state_dict(), plain.state_dict())
    found["control: buffers before the forward"] = _difference(sharded.full_state_dict(), normed().state_dict())
    return {"eval": found}


class _OneLayerTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2, 2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](self.layers[0](x))


def _bad_input_case(rank: int, world_size: int) -> dict:
    different = nn.Linear(4, 4 + (rank == world_size - 1))
    model = _make("gpt")
    twice = FullyShardedDataParallel(_OneLayerTwice())
    return {"errors": {
        "unit run twice": _error(lambda: twice(torch.ones(1, 2))),
        "different models": _error(lambda: FullyShardedDataParallel(different)),
        "unit outside the module": _error(lambda: FullyShardedDataParallel(_make("gpt"), units=[nn.Linear(2, 2)])),
        "nested units": _error(lambda: FullyShardedDataParallel(model, units=[model.blocks[0],
                                                                              model.blocks[0].attn])),
        "integer compute dtype": _error(lambda: FullyShardedDataParallel(model, compute_dtype=torch.int32)),
    }}


@pytest.fixture(scope="module")
def reports() -> dict[int, list[dict]]:
    return _launch_every_case(_every_case)


# --------------------------------------------------------------------------------------------------------
# Same training as one process, and as fully_shard


@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("variant", VARIANTS)
def test_zero3_trains_like_a_single_process_on_the_whole_batch(reports, world_size, variant):
    _check_trains_like_a_single_process(reports[world_size], variant)


@pytest.mark.parametrize("world_size", (2, 3))
def test_zero3_matches_fully_shard_and_holds_the_same_shard_of_each_parameter(reports, world_size):
    _check_vs_torch(reports[world_size], cases=4)
    for rank, report in enumerate(reports[world_size]):
        assert len(report["local shards"]) == 4
        for case, (difference, control) in report["local shards"].items():
            assert difference <= ATOL, f"{case}, rank {rank}: our shards differ from to_local() by {difference:.2e}"
            assert control > 100 * ATOL, f"{case}: the next rank's rows should not match this rank's shard"


def test_every_rank_ends_with_bit_identical_parameters(reports):
    _check_bit_identical_on_every_rank(reports)


# --------------------------------------------------------------------------------------------------------
# The contract: m forwards then m backwards, explicit reduction, clipping


@pytest.mark.parametrize("world_size", (2, 3))
def test_m_forwards_then_m_backwards_with_sync_off_then_reduce_gradients_gives_the_whole_batch_gradient(
        reports, world_size):
    root, block = (4 * n for n in _padded(world_size)[:2])
    for rank, report in enumerate(reports[world_size]):
        found = report["gradient sync"]
        _check_gradient_sync(found, rank)
        for mode in SYNC_MODES:
            assert found[mode]["unsharded"] == 0, f"{mode}: full parameters left gathered after backward"
        # the root gathered once for all micro-batches, each block before each forward and each backward;
        # one reduce-scatter per unit for the whole step
        gathers = root + 2 * MICRO * 2 * block
        for mode in ("reduce_gradients", "last backward synced"):
            assert found[mode]["communication"] == {"all_gather": gathers, "reduce_scatter": root + 2 * block}
        assert found["no reduction (control)"]["communication"] == {"all_gather": gathers}


@pytest.mark.parametrize("world_size", (2, 3))
def test_clip_grad_norm_equals_torch_on_the_whole_batch_gradient(reports, world_size):
    _check_clipping([report["clipping"] for report in reports[world_size]], sharded=True)


# --------------------------------------------------------------------------------------------------------
# Memory and communication, measured against the layout


@pytest.mark.parametrize("world_size", (2, 3))
def test_zero3_holds_a_1_over_n_shard_of_every_model_state(reports, world_size):
    for rank, report in enumerate(reports[world_size]):
        found = report["memory"]
        units = [_padded_and_local(shapes, world_size, rank) for shapes in _unit_shapes()]
        assert found["weights"] == found["gradients"] == 4 * sum(padded for padded, _ in units)
        assert found["optimizer_states"] == 8 * sum(real for _, real in units)
        rows = sum(shape[1:].numel() for shapes in _unit_shapes() for shape in shapes)
        assert found["weights"] <= 4 * (PSI / world_size + rows)  # at most one padding row per parameter


@pytest.mark.parametrize("world_size", (2, 3))
def test_bytes_communicated_per_step_are_measured_and_what_the_layout_says(reports, world_size):
    communication = reports[world_size][0]["communication"]
    root, block, _ = _padded(world_size)
    fp32 = {"all_gather": 4 * (root + 4 * block), "reduce_scatter": 4 * (root + 2 * block)}
    assert communication[None] == (fp32, fp32)
    # bf16 compute halves what is gathered; gradients are still reduce-scattered in fp32
    bf16 = {"all_gather": 2 * (root + 4 * block), "reduce_scatter": 4 * (root + 2 * block)}
    assert communication[torch.bfloat16] == (bf16, bf16)


# --------------------------------------------------------------------------------------------------------
# Gathering, freeing and prefetch; mixed precision; evaluation; optimizer features


@pytest.mark.parametrize("world_size", (2, 3))
def test_zero3_gathers_one_block_at_a_time_and_prefetches_the_next(reports, world_size):
    root, block = (4 * sum(shape.numel() for shape in shapes) for shapes in _unit_shapes()[:2])
    in_flight = 4 * _padded(world_size)[1]  # block 1's all-gather buffer, before it is copied out
    for rank, report in enumerate(reports[world_size]):
        found = report["unsharding"]
        # block 0 starts: root, block 0 and (prefetched) block 1's buffer allocated; block 1 starts: block 0 freed
        assert [bytes_ for bytes_, _, _ in found[True]["at block forward"]] == [root + block + in_flight,
                                                                                root + block]
        assert [started for _, started, _ in found[True]["at block forward"]] == [True, True]
        assert [bytes_ for bytes_, _, _ in found[False]["at block forward"]] == [root + block, root + block]
        assert [started for _, started, _ in found[False]["at block forward"]] == [False, True]
        expected = {name: tuple(_rows(p, world_size, rank).shape) for name, p in _make("gpt").named_parameters()}
        for prefetch in (True, False):
            assert all(shape == (8, 8) for _, _, shape in found[prefetch]["at block forward"])
            assert found[prefetch]["after step"] == 0
            assert found[prefetch]["parameter shapes between steps"] == expected


def test_zero3_computes_in_bf16_on_fp32_master_shards(reports):
    for per_rank in reports.values():
        for report in per_rank:
            found = report["bf16"]
            assert found["compute dtypes"] == {torch.bfloat16}
            assert found["shard dtypes"] == {torch.float32}
            assert found["vs_fully_shard"] <= ATOL, f"differs from fully_shard by {found['vs_fully_shard']:.2e}"
            assert found["vs_fp32"] > 100 * ATOL  # the comparison can tell bf16 from fp32 compute


def test_zero3_evaluates_under_no_grad_frees_everything_and_saves_buffers(reports):
    for per_rank in reports.values():
        for report in per_rank:
            assert report["eval"]["vs_single"] <= ATOL
            assert report["eval"]["unsharded after"] == 0
            assert report["eval"]["with buffers"] <= ATOL
            assert report["eval"]["control: buffers before the forward"] > 100 * ATOL


@pytest.mark.parametrize("world_size", (2, 3))
def test_param_groups_lr_schedulers_and_accumulation_work_on_the_shards(reports, world_size):
    for report in reports[world_size]:
        difference, lrs = report["param_groups"]
        assert difference <= ATOL, f"param groups: differs from single-process by {difference:.2e}"
        assert lrs == pytest.approx([0.01 * 0.5 ** STEPS, 0.02 * 0.5 ** STEPS])
        assert report["accumulation"] <= ATOL, f"accumulation: differs by {report['accumulation']:.2e}"


# --------------------------------------------------------------------------------------------------------
# Bad input


def test_bad_input_raises_clearly_on_every_rank(reports):
    for per_rank in reports.values():
        for report in per_rank:
            errors = report["errors"]
            assert "ranks [" in errors["different models"] and "differ" in errors["different models"]
            assert "submodule" in errors["unit outside the module"]
            assert "nest" in errors["nested units"]
            assert "compute_dtype" in errors["integer compute dtype"]
            assert errors["unit run twice"].startswith("RuntimeError: unit Linear ran twice")


def test_arguments_are_checked_before_any_communication():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        FullyShardedDataParallel("not a model")
    with pytest.raises(ValueError, match="compute_dtype"):
        FullyShardedDataParallel(nn.Linear(2, 2), compute_dtype=torch.int32)
    with pytest.raises(RuntimeError, match="no process group"):
        FullyShardedDataParallel(nn.Linear(2, 2))


def test_a_failing_rank_is_reported_not_hung():
    def one_rank_shards_a_different_model():
        rank = dist.get_rank()
        FullyShardedDataParallel(nn.Linear(3, 3 + rank))

    with pytest.raises(RankFailed, match="every rank must wrap the same model"):
        launch(one_rank_shards_a_different_model, nprocs=2, timeout=30, rank_output="none")
