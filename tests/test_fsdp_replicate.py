"""labkit.parallel.fsdp with replicated parameters (``shard_modules``): Stanford CS336's FSDP test, and more.

CS336's 2026 ``test_fsdp_gradient_sync`` shards Linear and Embedding layers and expects every other parameter (the
norms' weights) to stay whole, with the same gradient on every rank.  Here, on world sizes 2, 3 and 4 (3 and 4 cut
the 37-row embedding unevenly), one launch per world size runs every case and the tests read its report:

- the CS336 check itself, on a model of its shape (Embedding, RMSNorm, Linear, LayerNorm, Linear, LM head), and
  each rank's gradients against one process on the whole batch (replicated: whole; sharded: this rank's rows);
- training with AdamW over two parameter groups against one process, and against FSDP2's ``fully_shard`` applied
  to the same Linear and Embedding submodules with the other gradients all-reduced by hand (losses, parameters,
  each rank's shards against ``to_local()``); TinyGPT (blocks as units, a tied embedding, LayerNorms in every unit);
- bytes: ``communication_per_step()`` against ``predicted_communication()`` and the count from the shapes, by kind;
  ``memory_breakdown()`` against ``predicted_memory()`` and ``labkit.costmodel.memory`` (ZeRO-3 for the sharded
  part plus stage 0 for the replicated part, to the byte where the shards divide evenly);
- gradient sync off and ``reduce_gradients()``, ``clip_grad_norm_``, and checkpoints of both layouts resumed bit
  for bit.

Every comparison has a control that misses it (everything sharded fails CS336's check; a gradient left
un-reduced, or a replicated gradient counted once per rank in the norm, misses the reference).
"""

from __future__ import annotations

import math
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit import checkpoint
from labkit.costmodel.memory import memory_per_rank
from labkit.launch import launch
from labkit.parallel.fsdp import FullyShardedDataParallel
from tests.test_zero import ATOL, MICRO, _difference, _groups, _make, _padded_and_local, _rows, _state

WORLD_SIZES = (2, 3, 4)
SHARD = (nn.Linear, nn.Embedding)
PER_RANK, SEQ, STEPS = 2, 5, 3


class RMSNorm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class Toy(nn.Module):
    """CS336's ``ToyFSDPModel``, smaller, with a LayerNorm (weight and bias) and a biased Linear added."""

    def __init__(self, vocab: int = 37, width: int = 16, hidden: int = 24):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(vocab, width)
        self.norm1 = RMSNorm(width)
        self.linear1 = nn.Linear(width, hidden, bias=False)
        self.norm2 = nn.LayerNorm(hidden)
        self.linear2 = nn.Linear(hidden, width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        with torch.no_grad():
            self.norm2.weight.add_(0.1 * torch.randn(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.linear1(self.norm1(self.embedding(x))))
        return self.lm_head(self.linear2(self.norm2(x)))


def _replicated_names(model: nn.Module) -> set[str]:
    """CS336's rule: the parameters whose module is neither a Linear nor an Embedding."""
    return {f"{prefix}.{name}" if prefix else name for prefix, module in model.named_modules()
            if not isinstance(module, SHARD) for name, _ in module.named_parameters(recurse=False)}


def _toy_batches(world_size: int, vocab: int = 37, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [tuple(torch.randint(0, vocab, (world_size * PER_RANK, SEQ), generator=generator) for _ in range(2))
            for _ in range(steps)]


def _slice(batch: tuple, rank: int) -> tuple:
    return tuple(tensor[rank * PER_RANK:(rank + 1) * PER_RANK] for tensor in batch)


def _loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    if x.shape[1] == 8:  # TinyGPT
        return model(x, y)[1]
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _expected(reference: nn.Module, replicated: set[str], world_size: int, rank: int) -> dict:
    """This rank's part of the reference's gradients: the replicated ones whole, the others' rows."""
    return {name: p.grad if name in replicated else _rows(p.grad, world_size, rank)
            for name, p in reference.named_parameters()}


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(_groups(params), lr=0.01)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple, replicated: list | None = None) -> float:
    """One step; ``replicated``: parameters whose gradients to all-reduce by hand (the ``fully_shard`` reference)."""
    optimizer.zero_grad()
    loss = _loss(model, batch)
    loss.backward()
    for p in replicated or ():
        dist.all_reduce(p.grad)
        p.grad.div_(dist.get_world_size())
    optimizer.step()
    return loss.item()


# --------------------------------------------------------------------------------------------------------
# What every rank runs


def _every_case() -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    report = {}
    for case in (_cs336_case, _training_case, _fully_shard_case, _gpt_case, _sync_case, _memory_case,
                 _clipping_case, _checkpoint_case):
        report.update(case(rank, world_size))
    return report


def _cs336_case(rank: int, world_size: int) -> dict:
    """One backward, as CS336's ``test_fsdp_gradient_sync``; everything sharded as the control."""
    batch = _toy_batches(world_size, steps=1)[0]
    reference = Toy()
    _loss(reference, batch).backward()
    replicated = _replicated_names(reference)
    found = {}
    for name, shard_modules in (("norms replicated", SHARD), ("by name", ["embedding", "linear1", "linear2",
                                                                          "lm_head"]),
                                ("everything sharded (control)", None)):
        model = FullyShardedDataParallel(Toy(), shard_modules=shard_modules)
        _loss(model, _slice(batch, rank)).backward()
        found[name] = {
            "like data": all(p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype
                             for p in model.module.parameters()),
            "replicated gradients": {n: p.grad.clone() for n, p in model.module.named_parameters() if n in replicated},
            "vs single": _difference(model.gradients(), _expected(
                reference, replicated if shard_modules else set(), world_size, rank)),
            "shapes": {n: tuple(p.shape) for n, p in model.module.named_parameters()}}
    local = Toy()
    _loss(local, _slice(batch, rank)).backward()
    found["local gradients (control)"] = _difference({n: p.grad for n, p in local.named_parameters()},
                                                     {n: p.grad for n, p in reference.named_parameters()})
    return {"cs336": found}


def _training_case(rank: int, world_size: int) -> dict:
    """Three AdamW steps over two parameter groups against one process on the whole batch."""
    batches = _toy_batches(world_size)
    reference = Toy()
    optimizer = _adamw(reference.named_parameters())
    expected = [_step(reference, optimizer, batch) for batch in batches]
    model = FullyShardedDataParallel(Toy(), shard_modules=SHARD)
    optimizer = _adamw(model.module.named_parameters())
    losses = [_step(model, optimizer, _slice(batch, rank)) for batch in batches]
    replicated = _replicated_names(reference)
    return {"training": {
        "vs single": _difference(_state(model), _state(reference)), "losses": losses, "single losses": expected,
        "communication": (model.communication_per_step(), model.predicted_communication()),
        "replicated values": {n: p.detach().clone() for n, p in model.module.named_parameters() if n in replicated}}}


def _fully_shard_case(rank: int, world_size: int) -> dict:
    """FSDP2's ``fully_shard`` on each Linear and Embedding, the other gradients all-reduced by hand: the same
    losses and parameters, and each rank's shards equal ``to_local()``; the control skips the all-reduce."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    batches = [_slice(batch, rank) for batch in _toy_batches(world_size)]
    found = {}
    for name, all_reduce in (("fully_shard", True), ("fully_shard, no all-reduce (control)", False)):
        theirs = Toy()
        replicated = [p for n, p in theirs.named_parameters() if n in _replicated_names(theirs)]
        for module in theirs.modules():
            if isinstance(module, SHARD):
                fully_shard(module, mesh=mesh)
        optimizer = _adamw(theirs.named_parameters())
        found[name] = ([_step(theirs, optimizer, batch, replicated if all_reduce else None) for batch in batches],
                       _state(theirs), {n: p.to_local().detach().clone() if hasattr(p, "to_local") else p.detach()
                                        for n, p in theirs.named_parameters()})
    model = FullyShardedDataParallel(Toy(), shard_modules=SHARD)
    optimizer = _adamw(model.module.named_parameters())
    losses = [_step(model, optimizer, batch) for batch in batches]
    mine = {n: p.detach() for n, p in model.module.named_parameters()}
    return {"vs fully_shard": {name: (max(abs(a - b) for a, b in zip(losses, their_losses, strict=True)),
                                      _difference(_state(model), state), _difference(mine, local))
                               for name, (their_losses, state, local) in found.items()}}


def _gpt_case(rank: int, world_size: int) -> dict:
    """TinyGPT (a unit per block; LayerNorms in every unit; a tied embedding): training and bytes moved; in bf16;
    with frozen parameters (a LayerNorm, the position embedding, a bias) among both kinds."""
    batches = [_slice(batch, rank) for batch in _gpt_batches(world_size)]
    found = {}
    for name, kind, compute_dtype in (("fp32", "gpt", None), ("bf16", "gpt", torch.bfloat16),
                                      ("frozen", "frozen", None)):
        reference = _make(kind)
        optimizer = _adamw(reference.named_parameters())
        for batch in _gpt_batches(world_size):
            _step(reference, optimizer, batch)
        model = FullyShardedDataParallel(_make(kind), shard_modules=SHARD, compute_dtype=compute_dtype)
        optimizer = _adamw(model.module.named_parameters())
        for batch in batches:
            _step(model, optimizer, batch)
        found[name] = {"vs single": _difference(_state(model), _state(reference)),
                       "communication": (model.communication_per_step(), model.predicted_communication()),
                       "replicated values": {n: p.detach().clone() for n, p in model.module.named_parameters()
                                             if n in _replicated_names(reference)},
                       "unsharded after": model.unsharded_bytes()}
    return {"gpt": found}


def _gpt_batches(world_size: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1234)
    return [tuple(torch.randint(0, 32, (world_size * PER_RANK, 8), generator=generator) for _ in range(2))
            for _ in range(steps)]


def _sync_case(rank: int, world_size: int) -> dict:
    """Three micro-batches, every forward then every backward with sync off, then ``reduce_gradients()``; or the
    last backward synced; or sync on throughout; the control reduces nothing."""
    batches = _gpt_batches(world_size, steps=MICRO)
    reference = _make("gpt")
    _loss(reference, tuple(torch.cat(parts) for parts in zip(*batches, strict=True))).backward()
    expected = _expected(reference, _replicated_names(reference), world_size, rank)
    found = {}
    for mode in ("reduce_gradients", "last backward synced", "sync on throughout", "no reduction (control)"):
        model = FullyShardedDataParallel(_make("gpt"), shard_modules=SHARD)
        model.set_requires_gradient_sync(False)
        losses = [_loss(model, _slice(batch, rank)) / MICRO for batch in batches]
        for index, loss in enumerate(losses):
            model.set_requires_gradient_sync(mode == "sync on throughout" or (
                mode == "last backward synced" and index == MICRO - 1))
            loss.backward()
        if mode == "reduce_gradients":
            model.reduce_gradients()
        found[mode] = (_difference(model.gradients(), expected), model.communication_per_step())
    return {"sync": found}


def _memory_case(rank: int, world_size: int) -> dict:
    """After one AdamW step: measured bytes and the layout's prediction, for a toy whose rows divide by 2 and 4
    (32-word vocabulary) and one whose embedding rows do not (37)."""
    found = {}
    for vocab in (32, 37):
        model = FullyShardedDataParallel(Toy(vocab), shard_modules=SHARD)
        _step(model, model.make_optimizer(torch.optim.AdamW, lr=0.01),
              _slice(_toy_batches(world_size, vocab, steps=1)[0], rank))
        found[vocab] = (model.memory_breakdown(), model.predicted_memory())
    return {"memory": found}


def _clipping_case(rank: int, world_size: int) -> dict:
    """``clip_grad_norm_`` against ``torch.nn.utils.clip_grad_norm_`` on the whole batch's gradient; the control
    counts each replicated gradient once per rank, as if it were a shard."""
    batch = _toy_batches(world_size, steps=1)[0]
    found = {}
    for norm_type in (2.0, math.inf):
        reference = Toy()
        _loss(reference, batch).backward()
        replicated = _replicated_names(reference)
        grads = {n: p.grad for n, p in reference.named_parameters()}
        max_norm = 0.5 * torch.nn.utils.get_total_norm(list(grads.values()), norm_type).item()
        counted_per_rank = math.sqrt(sum(g.pow(2).sum().item() * (world_size if n in replicated else 1)
                                         for n, g in grads.items()))
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type).item()
        model = FullyShardedDataParallel(Toy(), shard_modules=SHARD)
        _loss(model, _slice(batch, rank)).backward()
        norm = model.clip_grad_norm_(max_norm, norm_type).item()
        found[norm_type] = (abs(norm - expected), _difference(model.gradients(), _expected(
            reference, replicated, world_size, rank)))
        if norm_type == 2.0:
            found["control"] = abs(counted_per_rank - expected)
    return {"clipping": found}


def _checkpoint_case(rank: int, world_size: int) -> dict:
    """Save after two steps (full and sharded layouts), load into a model built from other weights, take the
    third step: bit for bit the run that never stopped."""
    batches = [_slice(batch, rank) for batch in _toy_batches(world_size)]

    def run(seed: int) -> tuple[FullyShardedDataParallel, torch.optim.Optimizer]:
        module = Toy()
        if seed:
            torch.manual_seed(seed)
            for p in module.parameters():
                torch.nn.init.normal_(p)
        model = FullyShardedDataParallel(module, shard_modules=SHARD)
        return model, model.make_optimizer(torch.optim.AdamW, lr=0.01, weight_decay=0.1)

    model, optimizer = run(0)
    for batch in batches:
        _step(model, optimizer, batch)
    straight = _state(model)
    found = {}
    directory = [tempfile.mkdtemp(prefix="fsdp-replicate-") if rank == 0 else None]
    dist.broadcast_object_list(directory)
    for layout in ("full", "sharded"):
        model, optimizer = run(0)
        for batch in batches[:2]:
            _step(model, optimizer, batch)
        path = checkpoint.save(f"{directory[0]}/{layout}", model, optimizer, 2, layout=layout)
        model, optimizer = run(1)
        checkpoint.load(path, model, optimizer)
        _step(model, optimizer, batches[2])
        found[layout] = all(torch.equal(tensor, straight[name]) for name, tensor in _state(model).items())
    found["control: other weights"] = _difference(_state(run(1)[0]), straight)
    return {"checkpoint": found}


@pytest.fixture(scope="module")
def reports() -> dict[int, list[dict]]:
    return {world_size: launch(_every_case, nprocs=world_size, timeout=300, rank_output="none")
            for world_size in WORLD_SIZES}


# --------------------------------------------------------------------------------------------------------
# What the layout says, from the shapes alone


def _toy_shapes(vocab: int = 37) -> tuple[list[torch.Size], int]:
    """The toy's sharded parameters' shapes (one flat parameter: everything is in the root) and how many
    elements it replicates."""
    named = dict(Toy(vocab).named_parameters())
    replicated = _replicated_names(Toy(vocab))
    return [p.shape for n, p in named.items() if n not in replicated], sum(named[n].numel() for n in replicated)


def _gpt_padded(world_size: int) -> tuple[int, int]:
    """Elements of TinyGPT's root and of one block's padded all-gather buffer (their sharded parameters)."""
    named = dict(_make("gpt").named_parameters())
    sharded = [n for n in named if n not in _replicated_names(_make("gpt"))]
    root = [named[n].shape for n in sharded if not n.startswith("blocks.")]
    block = [named[n].shape for n in sharded if n.startswith("blocks.0.")]
    return tuple(world_size * _padded_and_local(shapes, world_size, 0)[0] for shapes in (root, block))


GPT_REPLICATED = 2 * 8 + 2 * 2 * 2 * 8  # final norm; two LayerNorms (weight, bias) per block, two blocks


# --------------------------------------------------------------------------------------------------------
# CS336's test, and the same gradients as one process


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_cs336_gradient_sync_replicated_parameters_hold_the_same_gradient_on_every_rank(reports, world_size):
    per_rank = [report["cs336"] for report in reports[world_size]]
    for rank, found in enumerate(per_rank):
        for variant in ("norms replicated", "by name"):
            assert found[variant]["like data"], f"rank {rank}: a gradient unlike its parameter's shard"
            assert found[variant]["vs single"] <= ATOL, (rank, variant, found[variant]["vs single"])
            for name, gradient in found[variant]["replicated gradients"].items():
                assert torch.equal(gradient, per_rank[0][variant]["replicated gradients"][name]), (rank, name)
        assert found["local gradients (control)"] > 100 * ATOL
    assert per_rank[0]["by name"]["shapes"] == per_rank[0]["norms replicated"]["shapes"]  # names choose as types do
    control = [found["everything sharded (control)"]["replicated gradients"] for found in per_rank]
    assert any(not torch.equal(gradients[name], control[0][name]) if gradients[name].shape == control[0][name].shape
               else True for gradients in control[1:] for name in gradients), "CS336's check cannot fail here"
    assert all(found["everything sharded (control)"]["vs single"] <= ATOL for found in per_rank)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_replicated_parameters_train_like_a_single_process_and_stay_identical_on_every_rank(reports, world_size):
    per_rank = reports[world_size]
    for rank, report in enumerate(per_rank):
        found = report["training"]
        assert found["vs single"] <= ATOL, f"rank {rank}: differs from one process by {found['vs single']:.2e}"
        for name, value in found["replicated values"].items():
            assert torch.equal(value, per_rank[0]["training"]["replicated values"][name]), (rank, name)
    mean = [sum(losses) / world_size for losses in zip(*(r["training"]["losses"] for r in per_rank), strict=True)]
    assert mean == pytest.approx(per_rank[0]["training"]["single losses"], abs=ATOL, rel=0)
    for rank, report in enumerate(per_rank):  # TinyGPT: a unit per block, each with its LayerNorms replicated
        found = report["gpt"]
        assert found["fp32"]["vs single"] <= ATOL, f"rank {rank}: TinyGPT differs by {found['fp32']['vs single']}"
        assert 100 * ATOL < found["bf16"]["vs single"] < 0.05  # bf16 compute: close, and not fp32
        assert found["frozen"]["vs single"] <= ATOL, f"rank {rank}: frozen parameters: {found['frozen']['vs single']}"
        for precision in ("fp32", "bf16", "frozen"):
            assert found[precision]["unsharded after"] == 0
            for name, value in found[precision]["replicated values"].items():
                assert torch.equal(value, per_rank[0]["gpt"][precision]["replicated values"][name]), (rank, name)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_matches_fully_shard_applied_to_the_same_linear_and_embedding_submodules(reports, world_size):
    for rank, report in enumerate(reports[world_size]):
        losses, parameters, shards = report["vs fully_shard"]["fully_shard"]
        assert losses <= ATOL and parameters <= ATOL, (rank, losses, parameters)
        assert shards <= ATOL, f"rank {rank}: our pieces differ from to_local() by {shards:.2e}"
        assert report["vs fully_shard"]["fully_shard, no all-reduce (control)"][1] > 100 * ATOL


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gradient_sync_off_then_reduce_gradients_all_reduces_the_replicated_part(reports, world_size):
    root, block = _gpt_padded(world_size)
    gathers = 4 * (root + 2 * MICRO * 2 * block)  # the root once; each block before each forward and backward
    once = {"all_gather": gathers, "reduce_scatter": 4 * (root + 2 * block), "all_reduce": 4 * GPT_REPLICATED}
    for rank, report in enumerate(reports[world_size]):
        found = report["sync"]
        for mode in ("reduce_gradients", "last backward synced", "sync on throughout"):
            assert found[mode][0] <= ATOL, f"{mode}, rank {rank}: {found[mode][0]:.2e}"
        assert found["no reduction (control)"][0] > 100 * ATOL
        assert found["reduce_gradients"][1] == found["last backward synced"][1] == once
        # sync on throughout: each backward completes a step (the contract's), which re-gathers the blocks
        assert found["sync on throughout"][1] == {**once, "all_gather": 4 * 2 * block}
        assert found["no reduction (control)"][1] == {"all_gather": gathers}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_clip_grad_norm_counts_replicated_gradients_once(reports, world_size):
    for rank, report in enumerate(reports[world_size]):
        found = report["clipping"]
        for norm_type in (2.0, math.inf):
            norm, gradients = found[norm_type]
            assert norm <= ATOL and gradients <= ATOL, (rank, norm_type, norm, gradients)
        assert found["control"] > 100 * ATOL


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_checkpoints_of_both_layouts_resume_bit_for_bit(reports, world_size):
    for report in reports[world_size]:
        assert report["checkpoint"]["full"] and report["checkpoint"]["sharded"]
        assert report["checkpoint"]["control: other weights"] > 100 * ATOL


# --------------------------------------------------------------------------------------------------------
# Bytes: communication and memory, measured against the layout and the memory model


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bytes_communicated_are_predicted_to_the_byte_by_kind(reports, world_size):
    shapes, replicated = _toy_shapes()
    padded = world_size * _padded_and_local(shapes, world_size, 0)[0]
    root, block = _gpt_padded(world_size)
    for report in reports[world_size]:
        measured, predicted = report["gpt"]["fp32"]["communication"]
        expected = {"all_gather": 4 * (root + 2 * 2 * block), "reduce_scatter": 4 * (root + 2 * block),
                    "all_reduce": 4 * GPT_REPLICATED}
        assert measured == predicted == expected
        measured, predicted = report["gpt"]["bf16"]["communication"]  # gathered in bf16, reduced in fp32
        assert measured == predicted == {**expected, "all_gather": expected["all_gather"] // 2}
        measured, predicted = report["gpt"]["frozen"]["communication"]  # a frozen LayerNorm is not all-reduced
        assert measured == predicted and measured["all_gather"] == expected["all_gather"]
        assert measured["all_reduce"] == expected["all_reduce"] - 4 * 16
        assert measured["reduce_scatter"] < expected["reduce_scatter"]
        measured, predicted = report["training"]["communication"]  # the toy: one unit (the root), gathered once
        assert measured == predicted == {"all_gather": 4 * padded, "reduce_scatter": 4 * padded,
                                         "all_reduce": 4 * replicated}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_memory_breakdown_is_zero3_for_the_sharded_part_plus_stage_0_for_the_replicated_part(reports, world_size):
    for rank, report in enumerate(reports[world_size]):
        for vocab, (measured, predicted) in report["memory"].items():
            shapes, replicated = _toy_shapes(vocab)
            padded, real = _padded_and_local(shapes, world_size, rank)
            assert measured == {**predicted, "optimizer_other": 4 * (len(shapes) + 3)}  # AdamW's step counters
            assert predicted == {"weights": 4 * (padded + replicated), "gradients": 4 * (padded + replicated),
                                 "optimizer_states": 8 * (real + replicated)}
            if all(shape[0] % world_size == 0 for shape in shapes):  # even shards: the model's figures exactly
                sharded = sum(shape.numel() for shape in shapes)
                composed = {key: memory_per_rank(sharded, "fp32", "adam", zero_stage=3, dp_degree=world_size)[key]
                            + memory_per_rank(replicated, "fp32", "adam", zero_stage=0)[key] for key in predicted}
                assert predicted == composed, (vocab, predicted, composed)
    assert world_size == 3 or all(shape[0] % world_size == 0 for shape in _toy_shapes(32)[0])


# --------------------------------------------------------------------------------------------------------
# Bad input, checked before any communication


@pytest.mark.parametrize("shard_modules, error, words", [
    (["embedding", "linear9"], ValueError, "'linear9'"),
    ("lm_head.weight", ValueError, "'lm_head.weight'"),  # a parameter's name, not a module's
    ((nn.Conv2d,), ValueError, "'Conv2d'"),
    ((nn.ReLU,), ValueError, "'ReLU'"),  # a type the model holds no parameter of
    ([nn.Linear(2, 2)], ValueError, "not a submodule"),
    ((nn.Linear, 3), TypeError, "int: 3"),
    (3.5, TypeError, "3.5"),
])
def test_bad_shard_modules_raise_naming_the_value(shard_modules, error, words):
    with pytest.raises(error, match=words):
        FullyShardedDataParallel(Toy(), shard_modules=shard_modules)
