"""labkit.zero (ZeRO-1, -2, -3) against single-process training, ZeroRedundancyOptimizer and fully_shard.

Every distributed case for one world size runs inside one launch (``_every_case``; launching ranks is the slow
part) and the tests read its report.  World sizes 2 and 3: with 3 ranks no shard divides evenly, so the flat
layouts pad.  Models: a tiny TinyGPT (tied embedding and LM head), the same with frozen parameters, and a
TinyMLP with odd widths (its units are its layers; its root holds nothing).  "Equal" means ``allclose`` with
``ATOL`` after three steps of SGD (momentum, weight decay) or AdamW (weight decay); a control case (each rank
training on its own slice only) is checked to *miss* that tolerance, so the comparison can fail.

``fully_shard`` (FSDP2) runs on CPU and gloo in torch 2.14 over ``init_device_mesh("cpu", (N,))``; with the
same mixed-precision policy (bf16 gather, fp32 reduce) our ZeRO-3 matches it bit for bit.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from labkit.ddp import DistributedDataParallel
from labkit.launch import RankFailed, launch
from labkit.models import GPTConfig, MLPConfig, TinyGPT, TinyMLP
from labkit.zero import FlatLayout, FullyShardedDataParallel, ShardedOptimizer

ATOL = 1e-5
STEPS = 3
PER_RANK = 2
GPT = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8)
BLOCK_NUMEL = 12 * 8 * 8 + 13 * 8  # 872
ROOT_NUMEL = (32 + 8) * 8 + 2 * 8  # embeddings and final norm: 336
PSI = ROOT_NUMEL + 2 * BLOCK_NUMEL  # 2080
KINDS = ("gpt", "frozen", "mlp")
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
              "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1})}
VARIANTS = ("zero1+ddp", "zero1 alone", "zero2", "zero3", "zero3 no prefetch", "zero3 explicit units")


# --------------------------------------------------------------------------------------------------------
# Models, data, training


def _make(kind: str) -> nn.Module:
    if kind == "mlp":
        return TinyMLP(MLPConfig(in_features=6, hidden_sizes=(7, 5), num_classes=3), seed=0)
    model = TinyGPT(GPT, seed=0)
    if kind == "frozen":
        model.position_embedding.requires_grad_(False)
        model.blocks[0].attn_norm.requires_grad_(False)
        model.blocks[1].mlp.fc.bias.requires_grad_(False)
    return model


def _batches(kind: str, world_size: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1234)
    size = world_size * PER_RANK
    if kind == "mlp":
        return [(torch.randn(size, 6, generator=generator), torch.randint(0, 3, (size,), generator=generator))
                for _ in range(steps)]
    return [(torch.randint(0, 32, (size, 8), generator=generator),
             torch.randint(0, 32, (size, 8), generator=generator)) for _ in range(steps)]


def _slice(batch: tuple, rank: int) -> tuple:
    return tuple(tensor[rank * PER_RANK:(rank + 1) * PER_RANK] for tensor in batch)


def _loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    output = model(x, y) if x.dtype == torch.long else model(x)
    return output[1] if isinstance(output, tuple) else F.cross_entropy(output, y)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list, scheduler=None) -> None:
    for batch in batches:
        optimizer.zero_grad()
        _loss(model, batch).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    if isinstance(model, FullyShardedDataParallel):
        return model.gather_full_params()
    module = model.module if isinstance(model, (DistributedDataParallel, nn.parallel.DistributedDataParallel)) \
        else model
    return {name: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
            for name, value in module.state_dict().items()}


def _difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[name].double() - b[name].double()).abs().max().item() for name in a)


def _trained(variant: str, kind: str, optimizer_name: str, rank: int, batches: list, mesh=None) -> nn.Module:
    cls, kwargs = OPTIMIZERS[optimizer_name]
    mine = [_slice(batch, rank) for batch in batches]
    if variant == "zero1+ddp":
        model = DistributedDataParallel(_make(kind))
        optimizer = ShardedOptimizer(model.parameters(), cls, **kwargs)
    elif variant == "zero1 alone":  # every rank computes the gradient of the whole batch: replicated already
        model, mine = _make(kind), batches
        optimizer = ShardedOptimizer(model.parameters(), cls, **kwargs)
    elif variant == "zero2":
        model = _make(kind)
        optimizer = ShardedOptimizer(model.parameters(), cls, stage=2, bucket_cap_mb=0.001, **kwargs)
    elif variant == "zero3 explicit units":  # what is not in a unit (MLP: the first and last layer) is the root's
        model = _make(kind)
        units = [model.layers[1]] if kind == "mlp" else [model.blocks[0].attn, model.blocks[0].mlp, model.blocks[1]]
        model = FullyShardedDataParallel(model, units=units)
        optimizer = cls(model.parameters(), **kwargs)
    elif variant.startswith("zero3"):
        model = FullyShardedDataParallel(_make(kind), prefetch=variant == "zero3")
        optimizer = cls(model.parameters(), **kwargs)
    elif variant == "torch zero1":
        model = nn.parallel.DistributedDataParallel(_make(kind))
        optimizer = ZeroRedundancyOptimizer(model.parameters(), cls, **kwargs)
    elif variant == "torch fully_shard":
        from torch.distributed.fsdp import fully_shard
        model = _make(kind)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = cls(model.parameters(), **kwargs)
    elif variant == "local only (control)":
        model = _make(kind)
        optimizer = cls(model.parameters(), **kwargs)
    _train(model, optimizer, mine)
    model.optimizer = optimizer
    return model


# --------------------------------------------------------------------------------------------------------
# What every rank runs


def _every_case() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    report: dict = {"vs_single": {}, "vs_torch": {}, "states": {}}
    for kind in KINDS:
        batches = _batches(kind, world_size)
        for optimizer_name, (cls, kwargs) in OPTIMIZERS.items():
            reference = _make(kind)
            _train(reference, cls(reference.parameters(), **kwargs), batches)
            expected = _state(reference)
            for variant in (*VARIANTS, "local only (control)"):
                state = _state(_trained(variant, kind, optimizer_name, rank, batches))
                report["vs_single"][variant, kind, optimizer_name] = _difference(state, expected)
                report["states"][variant, kind, optimizer_name] = state
            if kind != "mlp":
                ours = report["states"]["zero1+ddp", kind, optimizer_name]
                theirs = _trained("torch zero1", kind, optimizer_name, rank, batches)
                report["vs_torch"]["zero1", kind, optimizer_name] = _difference(ours, _state(theirs))
                ours = report["states"]["zero3", kind, optimizer_name]
                theirs = _trained("torch fully_shard", kind, optimizer_name, rank, batches, mesh)
                report["vs_torch"]["zero3", kind, optimizer_name] = _difference(ours, _state(theirs))
    for case in (_memory_case, _communication_case, _unsharding_case, _mixed_precision_case,
                 _param_groups_case, _state_dict_case, _accumulation_case, _eval_case, _bad_input_case):
        report.update(case(rank, world_size))
    return report


def _memory_case(rank: int, world_size: int) -> dict:
    """Measured bytes after one AdamW step; ZeRO-1's optimizer states beside ZeroRedundancyOptimizer's."""
    batches = _batches("gpt", world_size, steps=1)
    found = {}
    model = _trained("zero1+ddp", "gpt", "adamw", rank, batches)
    found["zero1"] = model.optimizer.memory_breakdown()
    theirs = _trained("torch zero1", "gpt", "adamw", rank, batches).optimizer.optim
    found["torch zero1 optimizer_states"] = sum(value.numel() * value.element_size()
                                                for p, state in theirs.state.items() for value in state.values()
                                                if value.shape == p.shape)
    model = _make("gpt")
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, bucket_cap_mb=25.0, lr=0.01)
    _train(model, optimizer, [_slice(batch, rank) for batch in batches])
    found["zero2"] = optimizer.memory_breakdown()
    found["zero2 full gradients"] = [p.grad is not None for p in model.parameters()]
    model = _trained("zero3", "gpt", "adamw", rank, batches)
    found["zero3"] = model.memory_breakdown(model.optimizer)
    return {"memory": found}


def _communication_case(rank: int, world_size: int) -> dict:
    """Bytes counted entering collectives during one step, beside the layout's figure."""
    batches = _batches("gpt", world_size, steps=2)
    found = {}
    for stage in (1, 2):
        model = DistributedDataParallel(_make("gpt")) if stage == 1 else _make("gpt")
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=0.01)
        _train(model, optimizer, [_slice(batches[0], rank)])
        before = dict(optimizer.bytes_communicated)
        _train(model, optimizer, [_slice(batches[1], rank)])
        found[stage] = ({kind: optimizer.bytes_communicated[kind] - before.get(kind, 0)
                         for kind in optimizer.bytes_communicated}, optimizer.communication_per_step())
    for compute_dtype in (None, torch.bfloat16):
        model = FullyShardedDataParallel(_make("gpt"), compute_dtype=compute_dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        _train(model, optimizer, [_slice(batches[0], rank)])
        before = dict(model.bytes_communicated)
        _train(model, optimizer, [_slice(batches[1], rank)])
        found[3, compute_dtype] = ({kind: model.bytes_communicated[kind] - before.get(kind, 0)
                                    for kind in model.bytes_communicated}, model.communication_per_step())
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
                           "parameter shapes between steps": [tuple(p.shape) for p in model.module.parameters()]}
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
    return {"bf16": {"vs_fully_shard": _difference(model.gather_full_params(), _state(reference)),
                     "vs_fp32": _difference(model.gather_full_params(), _state(fp32)),
                     "compute dtypes": set(dtypes),
                     "shard dtypes": {p.dtype for p in model.parameters()}}}


def _groups(named_parameters) -> list[dict]:
    decay, no_decay = [], []
    for name, p in named_parameters:
        (no_decay if "norm" in name or "bias" in name else decay).append(p)
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 0.02}]


def _param_groups_case(rank: int, world_size: int) -> dict:
    """Two parameter groups (own weight decay and LR) and a StepLR schedule, each stage."""
    batches = _batches("gpt", world_size)

    def schedule(optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    reference = _make("gpt")
    optimizer = torch.optim.AdamW(_groups(reference.named_parameters()), lr=0.01)
    _train(reference, optimizer, batches, schedule(optimizer))
    found = {}
    for stage in (1, 2, 3):
        if stage == 3:
            model = FullyShardedDataParallel(_make("gpt"))
            optimizer = torch.optim.AdamW(_groups(model.module.named_parameters()), lr=0.01)
        else:
            model = DistributedDataParallel(_make("gpt")) if stage == 1 else _make("gpt")
            optimizer = ShardedOptimizer(_groups(model.named_parameters()), torch.optim.AdamW, stage=stage,
                                         lr=0.01)
        _train(model, optimizer, [_slice(batch, rank) for batch in batches], schedule(optimizer))
        found[stage] = (_difference(_state(model), _state(reference)),
                        [group["lr"] for group in optimizer.param_groups])
    return {"param_groups": found}


def _state_dict_case(rank: int, world_size: int) -> dict:
    """Consolidated state dicts equal a plain AdamW's; loading a plain one continues training identically."""
    batches = _batches("gpt", world_size)
    reference = _make("gpt")
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.1)
    _train(reference, optimizer, batches[:2])
    saved_model, saved_optimizer = _state(reference), copy.deepcopy(optimizer.state_dict())
    _train(reference, optimizer, batches[2:])
    found = {}
    for stage in (1, 2):
        model = _make("gpt")
        ours = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=0.01, weight_decay=0.1)
        _train(model, ours, batches[:2])  # every rank the whole batch: replicated gradients for stage 1
        consolidated = ours.state_dict()
        differences = [max((consolidated["state"][index][key].double() - value.double()).abs().max().item()
                           for key, value in entry.items()) for index, entry in saved_optimizer["state"].items()]
        model = _make("gpt")
        model.load_state_dict(saved_model)
        ours = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=0.5)
        ours.load_state_dict(saved_optimizer)
        plain = torch.optim.AdamW(_make("gpt").parameters())
        plain.load_state_dict(consolidated)  # a plain optimizer accepts ours
        _train(model, ours, batches[2:] if stage == 1 else [_slice(batches[2], rank)])
        found[stage] = {"state": max(differences), "keys": sorted(consolidated["state"]) == sorted(
                        saved_optimizer["state"]), "groups": consolidated["param_groups"] == saved_optimizer[
                        "param_groups"], "resumed": _difference(_state(model), _state(reference))}
    return {"state_dict": found}


def _accumulation_case(rank: int, world_size: int) -> dict:
    """Two micro-batches per step, each with its own backward, for stage 2 and stage 3."""
    batches = _batches("gpt", world_size, steps=4)
    reference = _make("gpt")
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.1)
    _train(reference, optimizer, [tuple(torch.cat(parts) for parts in zip(*batches[i:i + 2], strict=True))
                                  for i in (0, 2)])
    found = {}
    for stage in (2, 3):
        if stage == 2:
            model = _make("gpt")
            optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, bucket_cap_mb=0.001,
                                         lr=0.01, weight_decay=0.1)
        else:
            model = FullyShardedDataParallel(_make("gpt"))
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        for i in (0, 2):
            optimizer.zero_grad()
            for batch in batches[i:i + 2]:
                (_loss(model, _slice(batch, rank)) / 2).backward()
            optimizer.step()
        found[stage] = _difference(_state(model), _state(reference))
    return {"accumulation": found}


def _eval_case(rank: int, world_size: int) -> dict:
    x = _batches("gpt", world_size, 1)[0][0]
    model = FullyShardedDataParallel(_make("gpt"))
    with torch.no_grad():
        logits = model(x)[0]
    return {"eval": {"vs_single": (logits - _make("gpt")(x)[0]).abs().max().item(),
                     "unsharded after": model.unsharded_bytes()}}


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _bad_input_case(rank: int, world_size: int) -> dict:
    different = nn.Linear(4, 4 + (rank == world_size - 1))
    model = _make("gpt")
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    return {"errors": {
        "different models, zero3": _error(lambda: FullyShardedDataParallel(different)),
        "different models, zero1": _error(lambda: ShardedOptimizer(different.parameters(), torch.optim.SGD, lr=1)),
        "unit outside the module": _error(lambda: FullyShardedDataParallel(_make("gpt"), units=[nn.Linear(2, 2)])),
        "nested units": _error(lambda: FullyShardedDataParallel(model, units=[model.blocks[0],
                                                                              model.blocks[0].attn])),
        "integer compute dtype": _error(lambda: FullyShardedDataParallel(model, compute_dtype=torch.int32)),
        "wrong state dict": _error(lambda: optimizer.load_state_dict({"state": {}, "param_groups": [
            {"params": [0, 1]}]})),
        "add_param_group": _error(lambda: optimizer.add_param_group({"params": [nn.Parameter(torch.ones(1))]})),
        "stage 2 all frozen": _error(lambda: ShardedOptimizer(nn.Linear(2, 2).requires_grad_(False).parameters(),
                                                              torch.optim.SGD, stage=2, lr=0.1)),
    }}


@pytest.fixture(scope="module")
def reports() -> dict[int, list[dict]]:
    return {world_size: launch(_every_case, nprocs=world_size, timeout=240, rank_output="none")
            for world_size in (2, 3)}


# --------------------------------------------------------------------------------------------------------
# Same training as one process, and as PyTorch's implementations


@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_stage_trains_like_a_single_process_on_the_whole_batch(reports, world_size, variant):
    for rank, report in enumerate(reports[world_size]):
        for kind in KINDS:
            for optimizer_name in OPTIMIZERS:
                difference = report["vs_single"][variant, kind, optimizer_name]
                assert difference <= ATOL, (f"{variant}, {kind}, {optimizer_name}, rank {rank}/{world_size}: "
                                            f"parameters differ from single-process by {difference:.2e}")


@pytest.mark.parametrize("world_size", (2, 3))
def test_the_comparison_rejects_training_on_one_ranks_slice_only(reports, world_size):
    for kind in KINDS:
        for optimizer_name in OPTIMIZERS:
            assert reports[world_size][0]["vs_single"]["local only (control)", kind, optimizer_name] > 100 * ATOL


@pytest.mark.parametrize("world_size", (2, 3))
def test_zero1_matches_zero_redundancy_optimizer_and_zero3_matches_fully_shard(reports, world_size):
    for rank, report in enumerate(reports[world_size]):
        assert len(report["vs_torch"]) == 8
        for case, difference in report["vs_torch"].items():
            assert difference <= ATOL, f"{case}, rank {rank}/{world_size}: differs from torch by {difference:.2e}"


def test_every_rank_ends_with_bit_identical_parameters(reports):
    for world_size, per_rank in reports.items():
        for case, state in per_rank[0]["states"].items():
            if case[0] == "local only (control)":
                continue
            for rank, report in enumerate(per_rank[1:], start=1):
                assert all(torch.equal(state[name], report["states"][case][name]) for name in state), \
                    f"{case}: rank {rank} of {world_size} drifted from rank 0"


# --------------------------------------------------------------------------------------------------------
# Memory and communication, measured against the layout


def _shard(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """(padded shard size, elements this rank really holds) of a flat of ``numel`` elements."""
    size = math.ceil(numel / world_size)
    return size, max(0, min(size, numel - rank * size))


@pytest.mark.parametrize("world_size", (2, 3))
def test_zero1_shards_optimizer_states_by_whole_parameters_as_zero_redundancy_optimizer_does(reports, world_size):
    memory = [report["memory"] for report in reports[world_size]]
    for found in memory:
        assert found["zero1"]["weights"] == found["zero1"]["gradients"] == 4 * PSI  # replicated
        assert found["zero1"]["optimizer_states"] == found["torch zero1 optimizer_states"]
    per_rank = [found["zero1"]["optimizer_states"] for found in memory]
    assert sum(per_rank) == 8 * PSI
    largest = (32 * 8) * 4 * 2  # the embedding: balance is to within one parameter
    assert max(per_rank) - min(per_rank) <= largest


@pytest.mark.parametrize("world_size", (2, 3))
def test_zero2_keeps_full_weights_and_a_1_over_n_shard_of_gradients_and_optimizer_states(reports, world_size):
    held = []
    for rank, report in enumerate(reports[world_size]):
        found = report["memory"]
        padded, real = _shard(PSI, world_size, rank)  # one bucket holds everything
        assert found["zero2"]["weights"] == 4 * PSI
        assert found["zero2"]["gradients"] == 4 * padded
        assert found["zero2"]["optimizer_states"] == 8 * real
        assert not any(found["zero2 full gradients"]), "full gradients must not survive the backward pass"
        held.append(real)
    assert sum(held) == PSI


@pytest.mark.parametrize("world_size", (2, 3))
def test_zero3_holds_a_1_over_n_shard_of_every_model_state(reports, world_size):
    for rank, report in enumerate(reports[world_size]):
        found = report["memory"]["zero3"]
        flats = [_shard(ROOT_NUMEL, world_size, rank)] + [_shard(BLOCK_NUMEL, world_size, rank)] * 2
        assert found["weights"] == found["gradients"] == 4 * sum(padded for padded, _ in flats)
        assert found["optimizer_states"] == 8 * sum(real for _, real in flats)
        assert found["weights"] <= 4 * PSI / world_size + 4 * 3  # at most one padding element per unit


@pytest.mark.parametrize("world_size", (2, 3))
def test_bytes_communicated_per_step_are_what_the_layout_says(reports, world_size):
    communication = reports[world_size][0]["communication"]
    padded = world_size * math.ceil(PSI / world_size)
    assert communication[1] == ({"broadcast": 4 * PSI}, {"broadcast": 4 * PSI})
    assert communication[2] == ({"reduce_scatter": 4 * padded, "all_gather": 4 * padded},) * 2
    root, block = (world_size * math.ceil(n / world_size) for n in (ROOT_NUMEL, BLOCK_NUMEL))
    assert communication[3, None] == ({"all_gather": 4 * (root + 4 * block), "reduce_scatter": 4 * (root + 2 * block)},
                                      ) * 2
    # bf16 compute halves what is gathered; gradients are still reduce-scattered in fp32
    assert communication[3, torch.bfloat16] == (
        {"all_gather": 2 * (root + 4 * block), "reduce_scatter": 4 * (root + 2 * block)},) * 2


# --------------------------------------------------------------------------------------------------------
# ZeRO-3's gathering, freeing and prefetch; mixed precision; evaluation


@pytest.mark.parametrize("world_size", (2, 3))
def test_zero3_gathers_one_block_at_a_time_and_prefetches_the_next(reports, world_size):
    root, block = (4 * world_size * math.ceil(n / world_size) for n in (ROOT_NUMEL, BLOCK_NUMEL))
    found = reports[world_size][0]["unsharding"]
    # block 0 starts: root, block 0 and (prefetched) block 1 allocated; block 1 starts: block 0 freed
    assert [bytes_ for bytes_, _, _ in found[True]["at block forward"]] == [root + 2 * block, root + block]
    assert [started for _, started, _ in found[True]["at block forward"]] == [True, True]
    assert [bytes_ for bytes_, _, _ in found[False]["at block forward"]] == [root + block, root + block]
    assert [started for _, started, _ in found[False]["at block forward"]] == [False, True]
    for prefetch in (True, False):
        assert all(shape == (8, 8) for _, _, shape in found[prefetch]["at block forward"])
        assert found[prefetch]["after step"] == 0
        assert all(len(shape) == 1 for shape in found[prefetch]["parameter shapes between steps"])


def test_zero3_computes_in_bf16_on_fp32_master_shards(reports):
    for per_rank in reports.values():
        for report in per_rank:
            found = report["bf16"]
            assert found["compute dtypes"] == {torch.bfloat16}
            assert found["shard dtypes"] == {torch.float32}
            assert found["vs_fully_shard"] <= ATOL, f"differs from fully_shard by {found['vs_fully_shard']:.2e}"
            assert found["vs_fp32"] > 100 * ATOL  # the comparison can tell bf16 from fp32 compute


def test_zero3_evaluates_under_no_grad_and_frees_everything(reports):
    for per_rank in reports.values():
        for report in per_rank:
            assert report["eval"]["vs_single"] <= ATOL
            assert report["eval"]["unsharded after"] == 0


# --------------------------------------------------------------------------------------------------------
# Optimizer features


@pytest.mark.parametrize("world_size", (2, 3))
def test_param_groups_and_lr_schedulers_work_at_every_stage(reports, world_size):
    for report in reports[world_size]:
        for stage, (difference, lrs) in report["param_groups"].items():
            assert difference <= ATOL, f"stage {stage}: differs from single-process by {difference:.2e}"
            assert lrs == pytest.approx([0.01 * 0.5 ** STEPS, 0.02 * 0.5 ** STEPS])


@pytest.mark.parametrize("world_size", (2, 3))
def test_consolidated_state_dict_equals_a_plain_optimizers_and_loads_back(reports, world_size):
    for report in reports[world_size]:
        for stage, found in report["state_dict"].items():
            assert found["keys"] and found["groups"], stage
            assert found["state"] <= ATOL, f"stage {stage}: state differs by {found['state']:.2e}"
            assert found["resumed"] <= ATOL, f"stage {stage}: resumed training differs by {found['resumed']:.2e}"


def test_gradient_accumulation_over_several_backward_passes(reports):
    for per_rank in reports.values():
        for report in per_rank:
            for stage, difference in report["accumulation"].items():
                assert difference <= ATOL, f"stage {stage}: differs by {difference:.2e}"


# --------------------------------------------------------------------------------------------------------
# Bad input


def test_bad_input_raises_clearly_on_every_rank(reports):
    for per_rank in reports.values():
        for report in per_rank:
            errors = report["errors"]
            assert "ranks [" in errors["different models, zero3"] and "differ" in errors["different models, zero3"]
            assert "ranks [" in errors["different models, zero1"]
            assert "submodule" in errors["unit outside the module"]
            assert "nest" in errors["nested units"]
            assert "compute_dtype" in errors["integer compute dtype"]
            assert "parameter groups do not match" in errors["wrong state dict"]
            assert errors["add_param_group"].startswith("NotImplementedError")
            assert "requires a gradient" in errors["stage 2 all frozen"]


def test_arguments_are_checked_before_any_communication():
    params = [nn.Parameter(torch.ones(3))]
    with pytest.raises(TypeError, match="Optimizer subclass"):
        ShardedOptimizer(params, torch.optim.SGD(params, lr=0.1))
    with pytest.raises(ValueError, match="FullyShardedDataParallel"):
        ShardedOptimizer(params, torch.optim.SGD, stage=3, lr=0.1)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        ShardedOptimizer(params, torch.optim.SGD, stage=2, bucket_cap_mb=-1, lr=0.1)
    with pytest.raises(RuntimeError, match="no process group"):
        ShardedOptimizer(params, torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        FullyShardedDataParallel("not a model")
    with pytest.raises(RuntimeError, match="no process group"):
        FullyShardedDataParallel(nn.Linear(2, 2))


def test_a_failing_rank_is_reported_not_hung():
    def one_rank_shards_a_different_model():
        rank = dist.get_rank()
        FullyShardedDataParallel(nn.Linear(3, 3 + rank))

    with pytest.raises(RankFailed, match="differ from rank 0"):
        launch(one_rank_shards_a_different_model, nprocs=2, timeout=30, rank_output="none")


# --------------------------------------------------------------------------------------------------------
# The flat layout, on its own


@pytest.mark.parametrize("numels,world_size", [([5, 1, 7], 3), ([4, 4], 2), ([1], 4), ([10, 3], 4)])
def test_flat_layout_cuts_equal_shards_and_each_element_lives_on_exactly_one_rank(numels, world_size):
    tensors = [torch.arange(numel, dtype=torch.float32) + 100 * index for index, numel in enumerate(numels)]
    shards = [FlatLayout(numels, world_size, rank).pack_shard(tensors) for rank in range(world_size)]
    assert all(shard.numel() == math.ceil(sum(numels) / world_size) for shard in shards)
    layout = FlatLayout(numels, world_size, 0)
    restored = [torch.zeros_like(tensor) for tensor in tensors]
    layout.unpack(torch.cat(shards), restored)
    assert all(torch.equal(a, b) for a, b in zip(restored, tensors, strict=True))
    for index, tensor in enumerate(tensors):
        pieces = [FlatLayout(numels, world_size, rank).pieces()[index] for rank in range(world_size)]
        assert torch.equal(torch.cat([shards[rank][at:at + end - begin]
                                      for rank, (begin, end, at) in enumerate(pieces)]), tensor)
    assert torch.cat(shards)[sum(numels):].eq(0).all(), "padding is zeros"
