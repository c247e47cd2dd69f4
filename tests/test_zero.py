"""labkit.parallel.zero (ZeRO-1, -2) against single-process training and ZeroRedundancyOptimizer; the shard layout.

Every distributed case for one world size runs inside one launch (``_every_case``; launching ranks is the slow
part) and the tests read its report.  World sizes 2 and 3: with 3 ranks no shard divides evenly, so the
layouts pad.  Models: a tiny TinyGPT (tied embedding and LM head), the same with frozen parameters, and a
TinyMLP with odd widths.  "Equal" means ``allclose`` with ``ATOL`` after three steps of SGD (momentum, weight
decay) or AdamW (weight decay); a control case (each rank training on its own slice only) is checked to
*miss* that tolerance, so the comparison can fail.  ``tests/test_fsdp.py`` (ZeRO-3) reuses the helpers here.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from labkit.launch import launch
from labkit.models import GPTConfig, MLPConfig, TinyGPT, TinyMLP
from labkit.parallel.base import ParallelWrapper
from labkit.parallel.ddp import DistributedDataParallel
from labkit.parallel.flat_shards import FlatShards
from labkit.parallel.fsdp import FullyShardedDataParallel
from labkit.parallel.zero import ShardedOptimizer, ZeroDataParallel

ATOL = 1e-5
STEPS = 3
MICRO = 3  # micro-batches per step in the gradient-sync cases
PER_RANK = 2
GPT = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8)
PSI = (32 + 8) * 8 + 2 * 8 + 2 * (12 * 8 * 8 + 13 * 8)  # embeddings, final norm, two blocks: 2080
KINDS = ("gpt", "frozen", "mlp")
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
              "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1})}
VARIANTS = ("zero1+ddp", "zero1 alone", "zero2", "zero1 wrapper", "zero2 wrapper")
CONTROL = "local only (control)"
SYNC_MODES = ("reduce_gradients", "last backward synced", "sync on throughout")


# --------------------------------------------------------------------------------------------------------
# Models, data, training (shared with tests/test_fsdp.py)


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


def _whole(batches: list[tuple]) -> tuple:
    return tuple(torch.cat(parts) for parts in zip(*batches, strict=True))


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
    if isinstance(model, ParallelWrapper):
        state = model.full_state_dict()
    else:
        module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        state = {name: value.full_tensor() if hasattr(value, "full_tensor") else value
                 for name, value in module.state_dict().items()}
    return {name: value.detach().clone() for name, value in state.items()}


def _difference(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> float:
    """Largest absolute difference between same-named tensors (``None`` counts as zeros; shapes must agree)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    worst = 0.0
    for x, y in ((a[name], b[name]) for name in a):
        if x is None and y is None:
            continue
        x, y = (torch.zeros_like(y) if x is None else x), (torch.zeros_like(x) if y is None else y)
        if x.shape != y.shape:
            return math.inf
        worst = max(worst, (x.double() - y.double()).abs().max().item() if x.numel() else 0.0)
    return worst


def _rows(tensor: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """``rank``'s dim-0 shard of ``tensor`` as ``fully_shard`` cuts it (``torch.chunk``; possibly empty)."""
    chunks = torch.chunk(tensor, world_size)
    return chunks[rank] if rank < len(chunks) else tensor[:0]


def _padded_and_local(shapes: list[torch.Size], world_size: int, rank: int) -> tuple[int, int]:
    """(elements of one rank's padded shard, elements ``rank`` really holds) of tensors of ``shapes``."""
    chunks = [torch.empty(shape or (1,)).chunk(world_size) for shape in shapes]  # a 0-d tensor: one row
    padded = sum(parts[0].numel() for parts in chunks)
    return padded, sum(parts[rank].numel() for parts in chunks if rank < len(parts))


def _groups(named_parameters) -> list[dict]:
    decay, no_decay = [], []
    for name, p in named_parameters:
        (no_decay if "norm" in name or "bias" in name else decay).append(p)
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 0.02}]


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
    elif variant in ("zero1 wrapper", "zero2 wrapper"):  # stage 2 over the DeviceMesh, to take one
        stage = int(variant[4])
        model = ZeroDataParallel(_make(kind), stage=stage, bucket_cap_mb=0.001, group=mesh if stage == 2 else None)
        optimizer = model.make_optimizer(cls, **kwargs)
    elif variant == "zero3 explicit units":  # what is not in a unit (MLP: the first and last layer) is the root's
        model = _make(kind)
        units = [model.layers[1]] if kind == "mlp" else [model.blocks[0].attn, model.blocks[0].mlp, model.blocks[1]]
        model = FullyShardedDataParallel(model, units=units)
        optimizer = cls(model.parameters(), **kwargs)
    elif variant.startswith("zero3"):
        model = FullyShardedDataParallel(_make(kind), prefetch=variant == "zero3")
        optimizer = model.make_optimizer(cls, **kwargs)
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
    elif variant == CONTROL:
        model = _make(kind)
        optimizer = cls(model.parameters(), **kwargs)
    _train(model, optimizer, mine)
    model.optimizer = optimizer
    return model


def _vs_single(variants: tuple[str, ...], rank: int, world_size: int, mesh) -> dict:
    """Every variant and the control, every model and optimizer, against one process on the whole batch."""
    vs_single, states = {}, {}
    for kind in KINDS:
        batches = _batches(kind, world_size)
        for optimizer_name, (cls, kwargs) in OPTIMIZERS.items():
            reference = _make(kind)
            _train(reference, cls(reference.parameters(), **kwargs), batches)
            expected = _state(reference)
            for variant in (*variants, CONTROL):
                state = _state(_trained(variant, kind, optimizer_name, rank, batches, mesh))
                vs_single[variant, kind, optimizer_name] = _difference(state, expected)
                states[variant, kind, optimizer_name] = state
    return {"vs_single": vs_single, "states": states}


def _gradient_sync_case(wrap: Callable[[nn.Module], ParallelWrapper], rank: int, world_size: int) -> dict:
    """``MICRO`` micro-batches in a pipeline's order: every forward, then every backward (each loss divided by
    ``MICRO``) with gradient sync off, then ``reduce_gradients()``; or the last backward with sync back on; or
    sync on throughout.  Each against one process on the whole batch; the control skips the reduction."""
    batches = _batches("gpt", world_size, steps=MICRO)
    reference = _make("gpt")
    _loss(reference, _whole(batches)).backward()
    found = {}
    for mode in (*SYNC_MODES, "no reduction (control)"):
        model = wrap(_make("gpt"))
        if isinstance(model, ZeroDataParallel):
            model.make_optimizer(torch.optim.SGD, lr=0.1)
        model.set_requires_gradient_sync(False)
        losses = [_loss(model, _slice(batch, rank)) / MICRO for batch in batches]
        for index, loss in enumerate(losses):
            model.set_requires_gradient_sync(mode == "sync on throughout" or (
                mode == "last backward synced" and index == MICRO - 1))
            loss.backward()
        if mode == "reduce_gradients":
            model.reduce_gradients()
        gradients = model.gradients()
        expected = {name: _rows(p.grad, world_size, rank) if model._sharded() else p.grad
                    for name, p in reference.named_parameters()}
        found[mode] = {"difference": _difference(gradients, expected), "shapes": {
            name: (tuple(g.shape) if g is not None else None, tuple(expected[name].shape))
            for name, g in gradients.items()}, "communication": model.communication_per_step(),
            "unsharded": model.unsharded_bytes() if hasattr(model, "unsharded_bytes") else 0}
    return found


def _clipping_case(wrap: Callable[[nn.Module], tuple[ParallelWrapper, torch.optim.Optimizer]], rank: int,
                   world_size: int) -> dict:
    """``clip_grad_norm_`` on the wrapper (frozen parameters, two parameter groups, then an AdamW step)
    against ``torch.nn.utils.clip_grad_norm_`` on one process holding the whole batch's gradient; the control
    is the norm of this rank's gradients alone."""
    batch = _batches("frozen", world_size, steps=1)[0]
    found = {}
    for norm_type in (2.0, math.inf):
        reference = _make("frozen")
        optimizer = torch.optim.AdamW(_groups(reference.named_parameters()), lr=0.01)
        _loss(reference, batch).backward()
        max_norm = 0.5 * torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()
                                                       if p.grad is not None], norm_type).item()
        expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
        model, ours = wrap(_make("frozen"))
        _loss(model, _slice(batch, rank)).backward()
        local = [g for g in model.gradients().values() if g is not None]
        local_norm = torch.nn.utils.get_total_norm(local, norm_type) if local else torch.zeros(())
        norm = model.clip_grad_norm_(max_norm, norm_type)
        expected = {name: None if p.grad is None else _rows(p.grad, world_size, rank) if model._sharded()
                    else p.grad for name, p in reference.named_parameters()}
        gradients = _difference(model.gradients(), expected)
        optimizer.step()
        ours.step()
        found[norm_type] = {"norm": abs(norm.item() - expected_norm.item()), "gradients": gradients,
                            "local norm (control)": abs(local_norm.item() - expected_norm.item()),
                            "stepped": _difference(_state(model), _state(reference))}
    return found


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


# --------------------------------------------------------------------------------------------------------
# What every rank runs


def _every_case() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    report = _vs_single(VARIANTS, rank, world_size, mesh)
    report["vs_torch"] = {}
    for kind in ("gpt", "frozen"):
        batches = _batches(kind, world_size)
        for optimizer_name in OPTIMIZERS:
            theirs = _trained("torch zero1", kind, optimizer_name, rank, batches)
            report["vs_torch"][kind, optimizer_name] = _difference(
                report["states"]["zero1+ddp", kind, optimizer_name], _state(theirs))
    report["gradient sync"] = {stage: _gradient_sync_case(_zero_wrapper(stage), rank, world_size)
                               for stage in (1, 2)}
    report["clipping"] = {stage: _clipping_case(_zero_with_groups(stage), rank, world_size)
                          for stage in (1, 2)}
    for case in (_memory_case, _communication_case, _param_groups_case, _state_dict_case, _accumulation_case,
                 _bad_input_case):
        report.update(case(rank, world_size))
    return report


def _zero_wrapper(stage: int) -> Callable[[nn.Module], ZeroDataParallel]:
    return lambda module: ZeroDataParallel(module, stage=stage, bucket_cap_mb=0.001)


def _zero_with_groups(stage: int) -> Callable[[nn.Module], tuple[ZeroDataParallel, torch.optim.Optimizer]]:
    def wrap(module: nn.Module) -> tuple[ZeroDataParallel, torch.optim.Optimizer]:
        model = ZeroDataParallel(module, stage=stage, bucket_cap_mb=0.001)
        return model, model.make_optimizer(torch.optim.AdamW, params=_groups(module.named_parameters()), lr=0.01)
    return wrap


def _memory_case(rank: int, world_size: int) -> dict:
    """Measured bytes after one AdamW step; ZeRO-1's optimizer states beside ZeroRedundancyOptimizer's."""
    batches = _batches("gpt", world_size, steps=1)
    found = {}
    model = _trained("zero1 wrapper", "gpt", "adamw", rank, batches)
    found["zero1"] = model.memory_breakdown()
    theirs = _trained("torch zero1", "gpt", "adamw", rank, batches).optimizer.optim
    found["torch zero1 optimizer_states"] = sum(value.numel() * value.element_size()
                                                for p, state in theirs.state.items() for value in state.values()
                                                if value.shape == p.shape)
    model = ZeroDataParallel(_make("gpt"), stage=2, bucket_cap_mb=25.0)
    _train(model, model.make_optimizer(torch.optim.AdamW, lr=0.01), [_slice(batch, rank) for batch in batches])
    found["zero2"] = model.memory_breakdown()
    found["zero2 full gradients"] = [p.grad is not None for p in model.module.parameters()]
    return {"memory": found}


def _communication_case(rank: int, world_size: int) -> dict:
    """Bytes entering collectives in the second of two steps, measured, beside the layout's figure."""
    batches = [_slice(batch, rank) for batch in _batches("gpt", world_size, steps=2)]
    found = {}
    for stage in (1, 2):
        model = ZeroDataParallel(_make("gpt"), stage=stage)
        optimizer = model.make_optimizer(torch.optim.AdamW, lr=0.01)
        _train(model, optimizer, batches)
        found[stage] = {"measured": model.communication_per_step(), "predicted": model.predicted_communication(),
                        "optimizer measured": optimizer.communication_per_step(),
                        "optimizer predicted": optimizer.predicted_communication()}
        _loss(model, batches[0]).backward()  # a step's backward without its optimizer step: a smaller figure
        found[stage]["before step"] = model.communication_per_step()
    return {"communication": found}


def _param_groups_case(rank: int, world_size: int) -> dict:
    """Two parameter groups (own weight decay and LR) and a StepLR schedule, each stage."""
    batches = _batches("gpt", world_size)

    def schedule(optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    reference = _make("gpt")
    optimizer = torch.optim.AdamW(_groups(reference.named_parameters()), lr=0.01)
    _train(reference, optimizer, batches, schedule(optimizer))
    found = {}
    for stage in (1, 2):
        model = DistributedDataParallel(_make("gpt")) if stage == 1 else _make("gpt")
        optimizer = ShardedOptimizer(_groups(model.named_parameters()), torch.optim.AdamW, stage=stage, lr=0.01)
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
    """Two micro-batches per step, each with its own (synchronised) backward: the shards' gradients add up."""
    batches = _batches("gpt", world_size, steps=4)
    reference = _make("gpt")
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.1)
    _train(reference, optimizer, [_whole(batches[i:i + 2]) for i in (0, 2)])
    model = ZeroDataParallel(_make("gpt"), stage=2, bucket_cap_mb=0.001)
    optimizer = model.make_optimizer(torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    for i in (0, 2):
        optimizer.zero_grad()
        for batch in batches[i:i + 2]:
            (_loss(model, _slice(batch, rank)) / 2).backward()
        optimizer.step()
    return {"accumulation": _difference(_state(model), _state(reference))}


def _bad_input_case(rank: int, world_size: int) -> dict:
    different = nn.Linear(4, 4 + (rank == world_size - 1))
    optimizer = ShardedOptimizer(_make("gpt").parameters(), torch.optim.SGD, lr=0.1)
    bare = ZeroDataParallel(_make("gpt"), stage=2)
    built = ZeroDataParallel(_make("gpt"), stage=2)
    built.make_optimizer(torch.optim.SGD, lr=0.1)
    return {"errors": {
        "different models, zero1": _error(lambda: ShardedOptimizer(different.parameters(), torch.optim.SGD, lr=1)),
        "wrong state dict": _error(lambda: optimizer.load_state_dict({"state": {}, "param_groups": [
            {"params": [0, 1]}]})),
        "add_param_group": _error(lambda: optimizer.add_param_group({"params": [nn.Parameter(torch.ones(1))]})),
        "stage 2 all frozen": _error(lambda: ShardedOptimizer(nn.Linear(2, 2).requires_grad_(False).parameters(),
                                                              torch.optim.SGD, stage=2, lr=0.1)),
        "gradients before make_optimizer": _error(bare.gradients),
        "predicted before make_optimizer": _error(bare.predicted_communication),
        "memory before make_optimizer": _error(bare.memory_breakdown),
        "reduce before make_optimizer": _error(bare.reduce_gradients),
        "make_optimizer twice": _error(lambda: built.make_optimizer(torch.optim.SGD, lr=0.1)),
        "foreign params": _error(lambda: bare.make_optimizer(torch.optim.SGD, params=[nn.Parameter(torch.ones(2))],
                                                             lr=0.1)),
        "stage 1 optimizer reduce": _error(optimizer.reduce_gradients),
    }}


# --------------------------------------------------------------------------------------------------------
# Checks shared with tests/test_fsdp.py


def _check_trains_like_a_single_process(per_rank: list[dict], variant: str) -> None:
    for rank, report in enumerate(per_rank):
        for kind in KINDS:
            for optimizer_name in OPTIMIZERS:
                difference = report["vs_single"][variant, kind, optimizer_name]
                assert difference <= ATOL, (f"{variant}, {kind}, {optimizer_name}, rank {rank}/{len(per_rank)}: "
                                            f"parameters differ from single-process by {difference:.2e}")
    for kind in KINDS:  # the control: the comparison can fail
        for optimizer_name in OPTIMIZERS:
            assert per_rank[0]["vs_single"][CONTROL, kind, optimizer_name] > 100 * ATOL


def _check_bit_identical_on_every_rank(reports: dict[int, list[dict]]) -> None:
    for world_size, per_rank in reports.items():
        for case, state in per_rank[0]["states"].items():
            if case[0] == CONTROL:
                continue
            for rank, report in enumerate(per_rank[1:], start=1):
                assert all(torch.equal(state[name], report["states"][case][name]) for name in state), \
                    f"{case}: rank {rank} of {world_size} drifted from rank 0"


def _check_gradient_sync(found: dict, rank: int) -> None:
    for mode in SYNC_MODES:
        assert found[mode]["difference"] <= ATOL, f"{mode}, rank {rank}: {found[mode]['difference']:.2e}"
        assert all(ours == expected for ours, expected in found[mode]["shapes"].values()), found[mode]["shapes"]
    assert found["no reduction (control)"]["difference"] > 100 * ATOL


def _check_clipping(clipping: list[dict], sharded: bool) -> None:
    """``clipping``: each rank's report of :func:`_clipping_case`."""
    for rank, by_norm in enumerate(clipping):
        for norm_type, found in by_norm.items():
            for key in ("norm", "gradients", "stepped"):
                assert found[key] <= ATOL, f"norm {norm_type}, rank {rank}: {key} differs by {found[key]:.2e}"
    if sharded:  # each rank holds only its rows: its own norm is not the norm (for inf: on some rank)
        for norm_type in (2.0, math.inf):
            assert max(by_norm[norm_type]["local norm (control)"] for by_norm in clipping) > 100 * ATOL


def _check_vs_torch(per_rank: list[dict], cases: int) -> None:
    for rank, report in enumerate(per_rank):
        assert len(report["vs_torch"]) == cases
        for case, difference in report["vs_torch"].items():
            assert difference <= ATOL, f"{case}, rank {rank}/{len(per_rank)}: differs from torch by {difference:.2e}"


def _launch_every_case(every_case: Callable[[], dict]) -> dict[int, list[dict]]:
    """Each rank's report, for 2 and 3 ranks (3: no shard divides evenly)."""
    return {world_size: launch(every_case, nprocs=world_size, timeout=240, rank_output="none")
            for world_size in (2, 3)}


@pytest.fixture(scope="module")
def reports() -> dict[int, list[dict]]:
    return _launch_every_case(_every_case)


# --------------------------------------------------------------------------------------------------------
# Same training as one process, and as ZeroRedundancyOptimizer


@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_stage_trains_like_a_single_process_on_the_whole_batch(reports, world_size, variant):
    _check_trains_like_a_single_process(reports[world_size], variant)


@pytest.mark.parametrize("world_size", (2, 3))
def test_zero1_matches_zero_redundancy_optimizer(reports, world_size):
    _check_vs_torch(reports[world_size], cases=4)


def test_every_rank_ends_with_bit_identical_parameters(reports):
    _check_bit_identical_on_every_rank(reports)


# --------------------------------------------------------------------------------------------------------
# The contract: gradient sync, explicit reduction, clipping


@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("stage", (1, 2))
def test_m_forwards_then_m_backwards_with_sync_off_then_reduce_gradients_gives_the_whole_batch_gradient(
        reports, world_size, stage):
    for rank, report in enumerate(reports[world_size]):
        found = report["gradient sync"][stage]
        _check_gradient_sync(found, rank)
        # one reduction for the three micro-batches, and nothing during their backward passes
        one = 4 * (PSI if stage == 1 else world_size * _padded_and_local(
            [p.shape for p in _make("gpt").parameters()], world_size, rank)[0])
        kind = "all_reduce" if stage == 1 else "reduce_scatter"
        assert found["reduce_gradients"]["communication"] == {kind: one}
        assert found["no reduction (control)"]["communication"] == {}


@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("stage", (1, 2))
def test_clip_grad_norm_equals_torch_on_the_whole_batch_gradient(reports, world_size, stage):
    _check_clipping([report["clipping"][stage] for report in reports[world_size]], sharded=stage == 2)


# --------------------------------------------------------------------------------------------------------
# Memory and communication, measured against the layout


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
    shapes = [p.shape for p in _make("gpt").parameters()]
    held = []
    for rank, report in enumerate(reports[world_size]):
        found = report["memory"]
        padded, real = _padded_and_local(shapes, world_size, rank)  # one bucket holds everything
        assert found["zero2"]["weights"] == 4 * PSI
        assert found["zero2"]["gradients"] == 4 * padded
        assert found["zero2"]["optimizer_states"] == 8 * real
        assert not any(found["zero2 full gradients"]), "full gradients must not survive the backward pass"
        held.append(real)
    assert sum(held) == PSI


@pytest.mark.parametrize("world_size", (2, 3))
def test_bytes_communicated_per_step_are_measured_and_what_the_layout_says(reports, world_size):
    communication = reports[world_size][0]["communication"]
    padded = world_size * _padded_and_local([p.shape for p in _make("gpt").parameters()], world_size, 0)[0]
    stage1 = {"all_reduce": 4 * PSI, "broadcast": 4 * PSI}  # DDP's all-reduce and the updated parameters
    assert communication[1]["measured"] == communication[1]["predicted"] == stage1
    assert communication[1]["optimizer measured"] == communication[1]["optimizer predicted"] == {"broadcast": 4 * PSI}
    stage2 = {"reduce_scatter": 4 * padded, "all_gather": 4 * padded}
    assert communication[2]["measured"] == communication[2]["predicted"] == stage2
    assert communication[2]["optimizer measured"] == communication[2]["optimizer predicted"] == stage2
    assert communication[1]["before step"] == {"all_reduce": 4 * PSI}
    assert communication[2]["before step"] == {"reduce_scatter": 4 * padded}


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


def test_gradient_accumulation_over_several_synchronised_backward_passes(reports):
    for per_rank in reports.values():
        for report in per_rank:
            assert report["accumulation"] <= ATOL, f"differs by {report['accumulation']:.2e}"


# --------------------------------------------------------------------------------------------------------
# Bad input


def test_bad_input_raises_clearly_on_every_rank(reports):
    for per_rank in reports.values():
        for report in per_rank:
            errors = report["errors"]
            assert "ranks [" in errors["different models, zero1"]
            assert "parameter groups do not match" in errors["wrong state dict"]
            assert errors["add_param_group"].startswith("NotImplementedError")
            assert "requires a gradient" in errors["stage 2 all frozen"]
            for call in ("gradients", "predicted", "memory", "reduce"):
                assert errors[f"{call} before make_optimizer"].startswith("RuntimeError: call make_optimizer")
            assert "already called" in errors["make_optimizer twice"]
            assert errors["foreign params"].startswith("ValueError: params must be the module's")
            assert "is stage 2's" in errors["stage 1 optimizer reduce"]


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
    with pytest.raises(ValueError, match="stage must be 1"):
        ZeroDataParallel(nn.Linear(2, 2), stage=3)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        ZeroDataParallel("not a model")
    with pytest.raises(RuntimeError, match="no process group"):
        ZeroDataParallel(nn.Linear(2, 2), stage=2)


# --------------------------------------------------------------------------------------------------------
# The shard layout, on its own


LAYOUTS = [[(5, 3), (2,), (7, 2, 2)], [(), (4,), ()], [(1, 6), (3, 1, 5)], [(0, 4), (9,)], [(8, 8), (16,)]]


@pytest.mark.parametrize("world_size", (1, 2, 3, 4))
@pytest.mark.parametrize("shapes", LAYOUTS, ids=str)
def test_flat_shards_cut_every_tensor_along_dim_0_as_torch_chunk_does(shapes, world_size):
    tensors = [torch.randn(shape) for shape in shapes]
    layouts = [FlatShards(shapes, world_size, rank) for rank in range(world_size)]
    padded = _padded_and_local([torch.Size(shape) for shape in shapes], world_size, 0)[0]
    for rank, layout in enumerate(layouts):
        assert layout.shard_numel == max(1, padded)
        expected = [_rows(tensor.reshape(1) if tensor.dim() == 0 else tensor, world_size, rank) for tensor in tensors]
        views = layout.shard_views(layout.pack_shard(tensors))
        pieces = layout.pieces_of(tensors)
        for index, (view, piece, chunk) in enumerate(zip(views, pieces, expected, strict=True)):
            assert view.shape == piece.shape == chunk.shape == layout.local_shape(index), (index, rank)
            assert torch.equal(view, chunk) and torch.equal(piece, chunk), (index, rank)
    flat = layouts[0].pack(tensors, torch.full((layouts[0].padded_numel,), float("nan")))
    assert torch.equal(flat, torch.cat([layout.pack_shard(tensors) for layout in layouts])), \
        "the full buffer is the shards in rank order"
    ones = layouts[0].pack([torch.ones(shape) for shape in shapes], torch.empty(layouts[0].padded_numel))
    assert ones.sum().item() == sum(tensor.numel() for tensor in tensors), "every element once, padding zeros"
    one_by_one = torch.zeros(layouts[0].padded_numel)
    for index, tensor in enumerate(tensors):
        layouts[0].copy_in(index, tensor, one_by_one)
    assert torch.equal(one_by_one, flat)
    restored = [torch.zeros(shape) for shape in shapes]
    layouts[0].unpack(flat, restored)
    assert all(torch.equal(a, b) for a, b in zip(restored, tensors, strict=True))


def test_flat_shards_pieces_are_views_a_stepped_piece_changes_its_parameter():
    weight = torch.zeros(5, 3)
    piece = FlatShards([weight.shape], 2, 1).pieces_of([weight])[0]
    piece.add_(1.0)
    assert weight[3:].eq(1).all() and weight[:3].eq(0).all()
