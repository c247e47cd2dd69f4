"""labkit.parallel.ddp against single-process training and torch's DistributedDataParallel, on 2 and 3 gloo ranks.

Launching ranks is the slow part, so every case for one world size runs inside one launch (``_every_case``)
and the tests read its report.  Models are tiny and float32; "equal" means ``torch.allclose(atol=1e-6)``
after several SGD steps (the sums are taken in a different order than in one process, so bit-equality is not
expected).  A control case (each rank training on its own slice, without DDP) is checked to *miss* that
tolerance, so the comparison can fail.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from labkit import trace
from labkit.launch import launch
from labkit.models import GPTConfig, TinyGPT
from labkit.parallel.ddp import DistributedDataParallel, assign_buckets

ATOL = 1e-6
STEPS = 3
LR = 0.1
PER_RANK_BATCH = 4
KINDS = ("mlp", "tied", "frozen")
# 0: one bucket per parameter; 0.0003 MiB (314 bytes): the MLP's six tensors in three buckets;
# 25: one bucket for everything.
BUCKET_CAPS = (0.0, 0.0003, 25.0)
Batch = tuple[torch.Tensor, ...]


# --------------------------------------------------------------------------------------------------------
# Small models: plain, with a tied weight, with frozen parameters, with BatchNorm buffers, with a branch


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second, self.third = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 6)

    def forward(self, x):
        return self.third(torch.tanh(self.second(torch.tanh(self.first(x)))))


class Tied(nn.Module):
    """The decoder shares the encoder's weight (as a language model ties its embeddings)."""

    def __init__(self):
        super().__init__()
        self.encoder, self.hidden, self.decoder = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.decoder.weight = self.encoder.weight

    def forward(self, x):
        return self.decoder(torch.tanh(self.hidden(torch.tanh(self.encoder(x)))))


class Frozen(MLP):
    """The first layer and a scale factor are frozen (requires_grad=False)."""

    def __init__(self):
        super().__init__()
        self.first.requires_grad_(False)
        self.scale = nn.Parameter(torch.tensor(1.5), requires_grad=False)

    def forward(self, x):
        return self.scale * super().forward(x)


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.norm, self.second = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 6)

    def forward(self, x):
        return self.second(torch.relu(self.norm(self.first(x))))


class Branchy(nn.Module):
    """``branch`` is used only when asked; ``spare`` never."""

    def __init__(self):
        super().__init__()
        self.main, self.branch, self.spare = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x, use_branch: bool):
        return self.main(x) + (self.branch(x) if use_branch else 0)


class Deep(nn.Module):
    def __init__(self, width: int = 128, depth: int = 8):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                                      for _ in range(depth)])

    def forward(self, x):
        return self.layers(x)


MODELS = {"mlp": MLP, "tied": Tied, "frozen": Frozen, "batchnorm": WithBatchNorm}


def _model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[kind]()


def _full_batches(steps: int, world_size: int, per_rank: int = PER_RANK_BATCH) -> list[Batch]:
    generator = torch.Generator().manual_seed(1234)
    return [(torch.randn(world_size * per_rank, 6, generator=generator),
             torch.randn(world_size * per_rank, 6, generator=generator)) for _ in range(steps)]


def _slice(batch: Batch, rank: int, per_rank: int = PER_RANK_BATCH) -> Batch:
    return tuple(tensor[rank * per_rank:(rank + 1) * per_rank] for tensor in batch)


def _train(model: nn.Module, batches: list[Batch]) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[name].double() - b[name].double()).abs().max().item() for name in a)


# --------------------------------------------------------------------------------------------------------
# What every rank runs


def _every_case() -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batches = _full_batches(STEPS, world_size)
    mine = [_slice(batch, rank) for batch in batches]
    report: dict = {"vs_single": {}, "vs_torch": {}, "states": {}, "buckets": {}, "predicted": {},
                    "measured": {}}

    for kind in KINDS:
        reference = _model(kind, seed=0)  # rank 0's initial weights; every rank below starts elsewhere
        _train(reference, batches)
        local_only = _model(kind, seed=0)
        _train(local_only, mine)
        report["vs_single"][kind, "local only (control)"] = _max_difference(_state(local_only),
                                                                            _state(reference))
        for cap in BUCKET_CAPS:
            torch_ddp = nn.parallel.DistributedDataParallel(_model(kind, seed=rank), bucket_cap_mb=cap)
            _train(torch_ddp, mine)
            for overlap in (True, False):
                ddp = DistributedDataParallel(_model(kind, seed=rank), bucket_cap_mb=cap, overlap=overlap)
                _train(ddp, mine)
                report["vs_single"][kind, cap, overlap] = _max_difference(_state(ddp), _state(reference))
                report["vs_torch"][kind, cap, overlap] = _max_difference(_state(ddp),
                                                                         _state(torch_ddp.module))
                report["states"][kind, cap, overlap] = _state(ddp)
                report["measured"][kind, cap, overlap] = ddp.communication_per_step()
            report["buckets"][kind, cap] = ddp.buckets
            report["predicted"][kind, cap] = ddp.predicted_communication()

    report.update(_batchnorm_case(rank, mine))
    report.update(_no_sync_case(rank, world_size))
    report.update(_finish_case(rank, mine))
    report.update(_unused_parameter_case(rank))
    report.update(_overlap_trace_case())
    report.update(_state_dict_case())
    report.update(_subgroup_case(rank, world_size))
    report.update(_pipeline_order_case(rank, world_size))
    report.update(_sync_decided_at_backward_case(rank, world_size))
    try:  # rank-dependent architectures must fail on every rank, not hang
        DistributedDataParallel(nn.Linear(6, 6 + (rank == world_size - 1)))
        report["different_models"] = "no error"
    except ValueError as error:
        report["different_models"] = str(error)
    return report


def _batchnorm_case(rank: int, mine: list) -> dict:
    models = {}
    for name in ("ours", "torch"):
        models[name] = _model("batchnorm", seed=rank)
        models[name].norm.running_mean.fill_(rank + 1.0)  # buffers differ per rank too
    before = _state(models["ours"])
    ours = DistributedDataParallel(models["ours"], bucket_cap_mb=0.0003)
    after_wrapping = _state(ours)
    reference = nn.parallel.DistributedDataParallel(models["torch"], bucket_cap_mb=0.0003)
    _train(ours, mine)
    _train(reference, mine)
    return {"batchnorm_before_wrapping": before, "batchnorm_after_wrapping": after_wrapping,
            "batchnorm_vs_torch": _max_difference(_state(ours), _state(reference.module)),
            "batchnorm_communication": (ours.communication_per_step(), ours.predicted_communication())}


def _no_sync_case(rank: int, world_size: int) -> dict:
    """Two optimizer steps, each accumulating 3 micro-batches (the first 2 under no_sync)."""
    micro_batches, steps = 3, 2
    batches = _full_batches(steps * micro_batches, world_size)
    reference = _model("mlp", seed=0)
    _train(reference, [tuple(torch.cat(parts) for parts in zip(*batches[i:i + micro_batches], strict=True))
                       for i in range(0, len(batches), micro_batches)])
    results, grads_differ_after_no_sync = {}, []
    for name, wrap in (("ours", lambda m: DistributedDataParallel(m, bucket_cap_mb=0.0003)),
                       ("torch", lambda m: nn.parallel.DistributedDataParallel(m, bucket_cap_mb=0.0003))):
        model = wrap(_model("mlp", seed=rank))
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        for start in range(0, len(batches), micro_batches):
            optimizer.zero_grad()
            for index in range(start, start + micro_batches):
                x, y = _slice(batches[index], rank)
                if index < start + micro_batches - 1:
                    with model.no_sync():
                        (nn.functional.mse_loss(model(x), y) / micro_batches).backward()
                    if name == "ours":  # nothing was averaged: the ranks' gradients still differ
                        local = model.module.first.weight.grad.clone()
                        everyone = [torch.empty_like(local) for _ in range(world_size)]
                        dist.all_gather(everyone, local)
                        grads_differ_after_no_sync.append(not torch.equal(everyone[0], everyone[1]))
                else:
                    (nn.functional.mse_loss(model(x), y) / micro_batches).backward()
            optimizer.step()
        results[name] = _state(model.module)
        if name == "ours":
            communication = (model.communication_per_step(), model.predicted_communication())
    return {"no_sync_vs_single": _max_difference(results["ours"], _state(reference)),
            "no_sync_vs_torch": _max_difference(results["ours"], results["torch"]),
            "grads_differ_after_no_sync": grads_differ_after_no_sync, "no_sync_communication": communication}


def _finish_case(rank: int, mine: list) -> dict:
    ddp = DistributedDataParallel(_model("mlp", seed=0), bucket_cap_mb=0.0003)
    ddp.finish_gradient_synchronization()  # before any backward: nothing to do, and no collective issued
    x, y = mine[0]
    nn.functional.mse_loss(ddp(x), y).backward()
    synchronised = {name: p.grad.clone() for name, p in ddp.module.named_parameters()}
    for _ in range(3 if rank == 0 else 1):  # ranks calling it different numbers of times must not hang
        ddp.finish_gradient_synchronization()
    unchanged = all(torch.equal(p.grad, synchronised[name]) for name, p in ddp.module.named_parameters())
    probe = torch.tensor([float(rank)])
    dist.all_reduce(probe)  # would pair with a stray bucket all-reduce and come out wrong
    everyone = [torch.empty_like(synchronised["first.weight"]) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, synchronised["first.weight"])
    return {"finish_leaves_grads_unchanged": unchanged, "probe_after_finish": probe.item(),
            "grads_equal_on_every_rank": all(torch.equal(other, everyone[0]) for other in everyone)}


def _unused_parameter_case(rank: int) -> dict:
    """Rank 0 uses ``branch``, the others do not; nobody uses ``spare``."""
    torch.manual_seed(0)
    x = torch.randn(4, 6) + rank
    grads, unused = {}, None
    for name in ("ours", "torch"):
        torch.manual_seed(0)
        model = Branchy()
        if name == "ours":
            wrapped = DistributedDataParallel(model, bucket_cap_mb=0.0)
        else:
            wrapped = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0,
                                                          find_unused_parameters=True)
        wrapped(x, use_branch=rank == 0).square().mean().backward()
        grads[name] = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        if name == "ours":
            unused = wrapped.unused_parameters
    return {"unused_grads": grads, "unused_parameters": unused}


def _overlap_trace_case() -> dict:
    """With overlap, a bucket's all-reduce starts before the backward computation ends; without, after."""
    found = {}
    for overlap in (True, False):
        ddp = DistributedDataParallel(_model_deep(), bucket_cap_mb=0.0, overlap=overlap)
        x = torch.randn(64, 128)
        trace.enable()
        ddp(x).square().mean().backward()
        deadline = time.monotonic() + 5.0  # comm spans are recorded by the backend's callback thread
        while sum(s.kind == "comm" for s in trace.spans()) < len(ddp.buckets) and time.monotonic() < deadline:
            time.sleep(0.01)
        spans = trace.spans()
        trace.disable()
        comm = [s for s in spans if s.kind == "comm"]
        compute = [s for s in spans if s.kind == "compute"]
        found[overlap] = {"comm": len(comm), "buckets": len(ddp.buckets), "compute": len(compute),
                          "first_comm_start": min(s.start_s for s in comm),
                          "last_compute_end": max(s.end_s for s in compute)}
    return {"overlap_trace": found}


def _model_deep() -> nn.Module:
    torch.manual_seed(0)
    return Deep()


def _state_dict_case() -> dict:
    module = _model("mlp", seed=0)
    ddp = DistributedDataParallel(module)
    plain = _model("mlp", seed=5)
    plain.load_state_dict(ddp.state_dict())
    ddp.load_state_dict(_model("mlp", seed=7).state_dict())
    full = ddp.full_state_dict()
    return {"state_dict_keys": sorted(ddp.state_dict()), "module_keys": sorted(module.state_dict()),
            "full_state_dict_is_the_modules": sorted(full) == sorted(module.state_dict()) and all(
                torch.equal(full[name], tensor) for name, tensor in module.state_dict().items()),
            "loads_into_plain_model": _max_difference(_state(plain), _state(_model("mlp", seed=0))),
            "loads_from_plain_model": _max_difference(_state(module), _state(_model("mlp", seed=7))),
            "same_parameter_objects": list(map(id, ddp.parameters())) == list(map(id, module.parameters())),
            "module_is_wrapped": ddp.module is module}


def _subgroup_case(rank: int, world_size: int) -> dict:
    """On ranks 1..N-1 only: rank 1 (group rank 0) is the broadcast source."""
    if world_size < 3:
        return {}
    members = list(range(1, world_size))
    group = dist.new_group(members)
    if rank not in members:
        return {"subgroup_vs_single": 0.0}
    batches = _full_batches(STEPS, len(members))
    reference = _model("mlp", seed=1)
    _train(reference, batches)
    ddp = DistributedDataParallel(_model("mlp", seed=rank), bucket_cap_mb=0.0003, group=group)
    _train(ddp, [_slice(batch, rank - 1) for batch in batches])
    return {"subgroup_vs_single": _max_difference(_state(ddp), _state(reference))}


GPT = GPTConfig(block_size=8, n_layer=2, n_head=2, n_embd=10)  # tied embeddings; shapes 32x10, 40x10, 10x40...
PIPELINE_CAPS = (0.0, 0.002, 25.0)  # one bucket per tensor; ~500 floats (a few tensors) per bucket; one
MICRO_BATCHES = 3
MAX_NORM = 0.1


def _gpt_batches(steps: int, rows: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(99)
    return [tuple(torch.randint(GPT.vocab_size, (rows, GPT.block_size), generator=generator) for _ in range(2))
            for _ in range(steps)]


def _gpt_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """Two parameter groups: weight decay on matrices, another learning rate for vectors (biases, norms)."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.SGD([{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "lr": 0.05}],
                           lr=0.1, momentum=0.9)


def _pipeline_order_case(rank: int, world_size: int) -> dict:
    """A pipeline schedule's order: m forwards (sync on: the forward must not decide), m backwards with sync
    off (in reverse, as a pipeline drains), one reduce_gradients(), clip, step; two steps; TinyGPT with tied
    embeddings; against one process on the whole batch, clipped with torch.nn.utils.clip_grad_norm_."""
    per_micro = 2
    batches = _gpt_batches(2, world_size * MICRO_BATCHES * per_micro)
    reference = TinyGPT(GPT, seed=0)
    optimizer = _gpt_optimizer(reference)
    expected = []
    for x, y in batches:
        optimizer.zero_grad()
        reference(x, y)[1].backward()
        gradients = {name: p.grad.clone() for name, p in reference.named_parameters()}
        expected.append((gradients, torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)))
        optimizer.step()
    found = {}
    for cap in PIPELINE_CAPS:
        ddp = DistributedDataParallel(TinyGPT(GPT, seed=rank), bucket_cap_mb=cap)
        optimizer = _gpt_optimizer(ddp.module)
        gradient_error, norm_error, silent, counted = 0.0, 0.0, [], []
        for (x, y), (gradients, norm) in zip(batches, expected, strict=True):
            optimizer.zero_grad()
            rows = [slice((rank * MICRO_BATCHES + j) * per_micro, (rank * MICRO_BATCHES + j + 1) * per_micro)
                    for j in range(MICRO_BATCHES)]
            losses = [ddp(x[r], y[r])[1] for r in rows]
            ddp.set_requires_gradient_sync(False)
            for loss in reversed(losses):
                (loss / MICRO_BATCHES).backward()
            silent.append(ddp.communication_per_step())
            ddp.reduce_gradients()
            ddp.set_requires_gradient_sync(True)
            counted.append(ddp.communication_per_step() == ddp.predicted_communication())
            gradient_error = max(gradient_error, _max_difference(ddp.gradients(), gradients))
            norm_error = max(norm_error, abs(ddp.clip_grad_norm_(MAX_NORM).item() - norm.item()))
            optimizer.step()
        found[cap] = {"gradients": gradient_error, "norm": norm_error, "buckets": len(ddp.buckets),
                      "parameters": _max_difference(_state(ddp), _state(reference)),
                      "silent_during_backward": silent, "one_reduction_counted": counted}
    return {"pipeline": found, "pipeline_norms": [norm.item() for _, norm in expected]}


def _sync_decided_at_backward_case(rank: int, world_size: int) -> dict:
    """A forward inside no_sync with its backward outside is synchronised; the other way round is not."""
    full_x, full_y = _full_batches(1, world_size)[0]
    x, y = _slice((full_x, full_y), rank)
    reference = _model("mlp", seed=0)
    nn.functional.mse_loss(reference(full_x), full_y).backward()
    ddp = DistributedDataParallel(_model("mlp", seed=0), bucket_cap_mb=0.0003)
    with ddp.no_sync():
        output = ddp(x)
    nn.functional.mse_loss(output, y).backward()
    synced = _max_difference(ddp.gradients(), {n: p.grad for n, p in reference.named_parameters()})
    communicated = ddp.communication_per_step()
    ddp.module.zero_grad()
    output = ddp(x)
    with ddp.no_sync():
        nn.functional.mse_loss(output, y).backward()
    local = ddp.module.first.weight.grad.clone()
    everyone = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(everyone, local)
    return {"forward_in_no_sync": (synced, communicated, ddp.predicted_communication()),
            "backward_in_no_sync": (ddp.communication_per_step(), torch.equal(everyone[0], everyone[1]))}


@pytest.fixture(scope="module")
def reports() -> dict[int, list[dict]]:
    return {world_size: launch(_every_case, nprocs=world_size, timeout=120, rank_output="none")
            for world_size in (2, 3)}


# --------------------------------------------------------------------------------------------------------
# Same result as one process on the whole batch, and as torch's DDP


@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("kind", KINDS)
def test_ddp_training_equals_single_process_training_on_the_concatenated_batch(reports, world_size, kind):
    for rank, report in enumerate(reports[world_size]):
        for cap in BUCKET_CAPS:
            for overlap in (True, False):
                difference = report["vs_single"][kind, cap, overlap]
                assert difference <= ATOL, (f"{kind}, bucket_cap_mb={cap}, overlap={overlap}, rank {rank}/"
                                            f"{world_size}: parameters differ from single-process by "
                                            f"{difference:.2e}")


@pytest.mark.parametrize("world_size", (2, 3))
def test_the_comparison_rejects_training_on_one_ranks_slice_only(reports, world_size):
    for kind in KINDS:
        assert reports[world_size][0]["vs_single"][kind, "local only (control)"] > 100 * ATOL


@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("kind", KINDS)
def test_ddp_training_equals_torch_ddp_with_the_same_bucket_size(reports, world_size, kind):
    for rank, report in enumerate(reports[world_size]):
        for cap in BUCKET_CAPS:
            for overlap in (True, False):
                difference = report["vs_torch"][kind, cap, overlap]
                assert difference <= ATOL, (f"{kind}, bucket_cap_mb={cap}, overlap={overlap}, rank {rank}: "
                                            f"parameters differ from torch DDP by {difference:.2e}")


def test_every_rank_ends_with_bit_identical_parameters(reports):
    for world_size, per_rank in reports.items():
        for case, state in per_rank[0]["states"].items():
            for rank, report in enumerate(per_rank[1:], start=1):
                assert all(torch.equal(state[name], report["states"][case][name]) for name in state), \
                    f"{case}: rank {rank} of {world_size} drifted from rank 0"


# --------------------------------------------------------------------------------------------------------
# Buckets


def test_buckets_are_filled_last_parameter_first_within_the_cap(reports):
    report = reports[2][0]
    names = [name for name, _ in MLP().named_parameters()]
    sizes = {name: p.numel() * 4 for name, p in MLP().named_parameters()}
    for cap in BUCKET_CAPS:
        buckets = report["buckets"]["mlp", cap]
        assert [name for bucket in buckets for name, _ in bucket] == names[::-1]
        assert all(nbytes == sizes[name] for bucket in buckets for name, nbytes in bucket)
        for bucket in buckets:
            assert len(bucket) == 1 or sum(nbytes for _, nbytes in bucket) <= cap * 1024 * 1024, (cap, bucket)
        assert report["predicted"]["mlp", cap] == {"all_reduce": sum(sizes.values())}
        for overlap in (True, False):
            assert report["measured"]["mlp", cap, overlap] == report["predicted"]["mlp", cap], (cap, overlap)
    assert len(report["buckets"]["mlp", 0.0]) == len(names)
    assert len(report["buckets"]["mlp", 25.0]) == 1
    assert [[name for name, _ in bucket] for bucket in report["buckets"]["mlp", 0.0003]] == [
        ["third.bias", "third.weight", "second.bias"], ["second.weight", "first.bias"], ["first.weight"]]


def test_tied_weights_are_bucketed_once_and_frozen_parameters_not_at_all(reports):
    tied = [name for bucket in reports[2][0]["buckets"]["tied", 0.0] for name, _ in bucket]
    assert tied == ["decoder.bias", "hidden.bias", "hidden.weight", "encoder.bias", "encoder.weight"]
    frozen = [name for bucket in reports[2][0]["buckets"]["frozen", 0.0] for name, _ in bucket]
    assert frozen == ["third.bias", "third.weight", "second.bias", "second.weight"]


def test_assign_buckets_splits_on_dtype_and_gives_oversized_tensors_their_own_bucket():
    parameters = [("a", torch.zeros(10)), ("b", torch.zeros(10)), ("c", torch.zeros(100)),
                  ("d", torch.zeros(10, dtype=torch.float64)), ("e", torch.zeros(5, dtype=torch.float64))]
    assert assign_buckets(parameters, bucket_cap_bytes=120) == [[4, 3], [2], [1, 0]]
    assert assign_buckets(parameters, bucket_cap_bytes=119) == [[4], [3], [2], [1, 0]]
    assert assign_buckets(parameters, bucket_cap_bytes=0) == [[4], [3], [2], [1], [0]]
    assert assign_buckets(parameters, bucket_cap_bytes=10**9) == [[4, 3], [2, 1, 0]]


# --------------------------------------------------------------------------------------------------------
# Broadcast at construction, BatchNorm buffers


@pytest.mark.parametrize("world_size", (2, 3))
def test_construction_overwrites_every_ranks_parameters_and_buffers_with_rank_0s(reports, world_size):
    rank_0_before = reports[world_size][0]["batchnorm_before_wrapping"]
    for rank, report in enumerate(reports[world_size]):
        after = report["batchnorm_after_wrapping"]
        assert _max_difference(after, rank_0_before) == 0.0, f"rank {rank} kept its own initial values"
        if rank > 0:
            assert _max_difference(report["batchnorm_before_wrapping"], rank_0_before) > 0.1  # they differed
    assert torch.all(reports[world_size][-1]["batchnorm_after_wrapping"]["norm.running_mean"] == 1.0)


@pytest.mark.parametrize("world_size", (2, 3))
def test_batchnorm_model_matches_torch_ddp_parameters_and_running_statistics(reports, world_size):
    for rank, report in enumerate(reports[world_size]):
        assert report["batchnorm_vs_torch"] <= ATOL, f"rank {rank}: {report['batchnorm_vs_torch']:.2e}"


def test_buffer_broadcasts_are_counted_once_per_step_beside_the_gradient_all_reduce(reports):
    measured, predicted = reports[2][0]["batchnorm_communication"]
    gradients = (6 * 8 + 8 + 8 + 8 + 8 * 6 + 6) * 4  # first, norm (weight, bias), second
    buffers = (8 + 8) * 4 + 8  # running mean and variance (float32), num_batches_tracked (int64)
    assert predicted == {"all_reduce": gradients, "broadcast": buffers}
    assert measured == predicted


# --------------------------------------------------------------------------------------------------------
# no_sync, finish_gradient_synchronization, unused parameters


@pytest.mark.parametrize("world_size", (2, 3))
def test_no_sync_accumulation_over_micro_batches_equals_one_large_batch(reports, world_size):
    for rank, report in enumerate(reports[world_size]):
        assert report["no_sync_vs_single"] <= ATOL, f"rank {rank}: {report['no_sync_vs_single']:.2e}"
        assert report["no_sync_vs_torch"] <= ATOL, f"rank {rank}: {report['no_sync_vs_torch']:.2e}"
        assert report["grads_differ_after_no_sync"] and all(report["grads_differ_after_no_sync"]), \
            "gradients were equal across ranks after a no_sync backward: something communicated"
        measured, predicted = report["no_sync_communication"]
        assert measured == predicted, "three micro-batches, one synchronised: one all-reduce of the gradients"


@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("cap", PIPELINE_CAPS)
def test_m_forwards_then_m_unsynchronised_backwards_then_reduce_gradients_equals_one_process(reports,
                                                                                             world_size, cap):
    for rank, report in enumerate(reports[world_size]):
        found = report["pipeline"][cap]
        assert found["gradients"] <= ATOL, f"rank {rank}: gradients differ by {found['gradients']:.2e}"
        assert found["parameters"] <= ATOL, f"rank {rank}: parameters differ by {found['parameters']:.2e}"
        assert found["silent_during_backward"] == [{}, {}], "a backward pass with sync off communicated"
        assert found["one_reduction_counted"] == [True, True]
    buckets = {cap: reports[world_size][0]["pipeline"][cap]["buckets"] for cap in PIPELINE_CAPS}
    assert buckets[0.0] > buckets[0.002] > buckets[25.0] == 1, buckets


@pytest.mark.parametrize("world_size", (2, 3))
def test_clip_grad_norm_equals_torch_clip_grad_norm_on_one_process_with_the_whole_batch(reports, world_size):
    assert min(reports[world_size][0]["pipeline_norms"]) > 2 * MAX_NORM  # the clipping changed the gradients
    for rank, report in enumerate(reports[world_size]):
        for cap in PIPELINE_CAPS:
            assert report["pipeline"][cap]["norm"] <= ATOL, (rank, cap, report["pipeline"][cap]["norm"])


@pytest.mark.parametrize("world_size", (2, 3))
def test_gradient_sync_is_decided_when_backward_runs_not_in_the_forward(reports, world_size):
    for rank, report in enumerate(reports[world_size]):
        synced, communicated, predicted = report["forward_in_no_sync"]
        assert synced <= ATOL and communicated == predicted, (rank, synced, communicated)
        communicated, equal_across_ranks = report["backward_in_no_sync"]
        assert communicated == {} and not equal_across_ranks, (rank, communicated)


@pytest.mark.parametrize("world_size", (2, 3))
def test_finish_gradient_synchronization_is_idempotent_and_issues_no_stray_collective(reports, world_size):
    for rank, report in enumerate(reports[world_size]):
        assert report["finish_leaves_grads_unchanged"], f"rank {rank}: a second call changed the gradients"
        assert report["probe_after_finish"] == sum(range(world_size)), f"rank {rank}: collectives out of step"
        assert report["grads_equal_on_every_rank"]


@pytest.mark.parametrize("world_size", (2, 3))
def test_a_parameter_unused_on_some_ranks_gets_the_same_mean_as_torch_find_unused_parameters(reports,
                                                                                            world_size):
    for rank, report in enumerate(reports[world_size]):
        ours, theirs = report["unused_grads"]["ours"], report["unused_grads"]["torch"]
        for name in ("main.weight", "main.bias", "branch.weight", "branch.bias"):
            assert torch.allclose(ours[name], theirs[name], atol=ATOL), (rank, name)
        assert theirs["spare.weight"] is None  # torch leaves a parameter no rank used without a gradient
        assert torch.equal(ours["spare.weight"], torch.zeros(6, 6))  # ours: zeros (documented)
        expected_unused = {"spare.weight", "spare.bias"}
        if rank > 0:
            expected_unused |= {"branch.weight", "branch.bias"}
        assert set(report["unused_parameters"]) == expected_unused


# --------------------------------------------------------------------------------------------------------
# Overlap is visible in the trace


def test_overlap_launches_bucket_all_reduces_during_backward_and_no_overlap_after_it(reports):
    for rank, report in enumerate(reports[2]):
        with_overlap, without = report["overlap_trace"][True], report["overlap_trace"][False]
        for found in (with_overlap, without):
            assert found["comm"] == found["buckets"] == 16 and found["compute"] >= 1, found
        assert with_overlap["first_comm_start"] < with_overlap["last_compute_end"], (rank, with_overlap)
        assert with_overlap["compute"] > 1  # the backward computation is split by the launches
        assert without["first_comm_start"] >= without["last_compute_end"], f"rank {rank}: {without}"


# --------------------------------------------------------------------------------------------------------
# Checkpoints, groups, and arguments


def test_state_dict_has_the_modules_keys_without_a_prefix_and_round_trips(reports):
    report = reports[2][0]
    assert report["state_dict_keys"] == report["module_keys"]
    assert report["loads_into_plain_model"] == 0.0 and report["loads_from_plain_model"] == 0.0
    assert report["same_parameter_objects"] and report["module_is_wrapped"]
    assert report["full_state_dict_is_the_modules"]


def test_ddp_on_a_subgroup_broadcasts_from_the_groups_first_rank_and_averages_within_it(reports):
    for rank, report in enumerate(reports[3]):
        assert report["subgroup_vs_single"] <= ATOL, f"rank {rank}: {report['subgroup_vs_single']:.2e}"


@pytest.mark.parametrize("world_size", (2, 3))
def test_different_models_on_different_ranks_raise_on_every_rank_instead_of_hanging(reports, world_size):
    for report in reports[world_size]:
        assert f"ranks [{world_size - 1}]" in report["different_models"], report["different_models"]


def test_bad_arguments_raise_naming_the_value_before_any_communication():
    # No process group exists in this (the test) process: argument errors must come first.
    with pytest.raises(ValueError, match="-1"):
        DistributedDataParallel(MLP(), bucket_cap_mb=-1)
    with pytest.raises(ValueError, match="nan"):
        DistributedDataParallel(MLP(), bucket_cap_mb=float("nan"))
    with pytest.raises(TypeError, match="'25'"):
        DistributedDataParallel(MLP(), bucket_cap_mb="25")
    with pytest.raises(TypeError, match="Sequential|list"):
        DistributedDataParallel([nn.Linear(2, 2)])
    with pytest.raises(TypeError, match="overlap.*'yes'"):
        DistributedDataParallel(MLP(), overlap="yes")
    with pytest.raises(TypeError, match="launch.*complete"):
        DistributedDataParallel(MLP(), compression=object())


def test_no_process_group_is_a_clear_error_pointing_at_launch():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="labkit.launch"):
        DistributedDataParallel(MLP())
