"""labkit.parallel.ddp against single-process training and torch's DistributedDataParallel, on 2 and 3 gloo ranks.

Launching ranks is the slow part, so every case for one world size runs inside one launch (``_every_case``)
and the tests read its report.  Models are tiny and float32; "equal" means ``torch.allclose(atol=1e-6)``
after several SGD steps (the sums are taken in a different order than in one process, so bit-equality is not
expected).  A control case (each rank training on its own slice, without DDP) is checked to *miss* that
tolerance, so the comparison can fail.  Against torch's DDP on 2 ranks, with the same
``gradient_as_bucket_view``, the parameters must be equal bit for bit: a sum of two numbers has one order, and
dividing by 2 is exact.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from labkit import trace
from labkit.launch import launch
from labkit.measure import model_state_bytes
from labkit.models import GPTConfig, TinyGPT
from labkit.parallel.compression import FP16Compression, PowerSGDCompression, TopKCompression
from labkit.parallel.ddp import DistributedDataParallel, assign_buckets

ATOL = 1e-6
STEPS = 3
LR = 0.1
PER_RANK_BATCH = 4
KINDS = ("mlp", "tied", "frozen")
# 0: one bucket per parameter; 0.0003 MiB (314 bytes): the MLP's six tensors in three buckets;
# 25: one bucket for everything.
BUCKET_CAPS = (0.0, 0.0003, 25.0)
VIEWS = (True, False)  # gradient_as_bucket_view
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


def _train(model: nn.Module, batches: list[Batch], set_to_none: bool = True) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in batches:
        optimizer.zero_grad(set_to_none=set_to_none)
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
            torch_ddp = {}
            for view in VIEWS:
                torch_ddp[view] = nn.parallel.DistributedDataParallel(_model(kind, seed=rank), bucket_cap_mb=cap,
                                                                      gradient_as_bucket_view=view)
                _train(torch_ddp[view], mine)
            for overlap in (True, False):
                for view in VIEWS:
                    ddp = DistributedDataParallel(_model(kind, seed=rank), bucket_cap_mb=cap, overlap=overlap,
                                                  gradient_as_bucket_view=view)
                    _train(ddp, mine)
                    case = kind, cap, overlap, view
                    report["vs_single"][case] = _max_difference(_state(ddp), _state(reference))
                    report["vs_torch"][case] = _max_difference(_state(ddp), _state(torch_ddp[view].module))
                    report["states"][case] = _state(ddp)
                    report["measured"][case] = ddp.communication_per_step()
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
    report.update(_bucket_view_case(rank, world_size))
    report.update(_compression_case(mine))
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


NO_SYNC_MODES = ((True, True), (True, False), (False, True))  # (gradient_as_bucket_view, zero_grad set_to_none)


def _no_sync_case(rank: int, world_size: int) -> dict:
    """Three optimizer steps, each accumulating 3 micro-batches (the first 2 under no_sync), for each mode of
    NO_SYNC_MODES: with views and ``zero_grad(set_to_none=False)`` the micro-batches accumulate into the
    buckets themselves from the second step on."""
    micro_batches, steps = 3, 3
    batches = _full_batches(steps * micro_batches, world_size)
    reference = _model("mlp", seed=0)
    _train(reference, [tuple(torch.cat(parts) for parts in zip(*batches[i:i + micro_batches], strict=True))
                       for i in range(0, len(batches), micro_batches)])
    found = {}
    for view, set_to_none in NO_SYNC_MODES:
        results, grads_differ_after_no_sync, accumulated_in_bucket = {}, [], []
        for name in ("ours", "torch"):
            if name == "ours":
                model = DistributedDataParallel(_model("mlp", seed=rank), bucket_cap_mb=0.0003,
                                                gradient_as_bucket_view=view)
            else:
                model = nn.parallel.DistributedDataParallel(_model("mlp", seed=rank), bucket_cap_mb=0.0003,
                                                            gradient_as_bucket_view=view)
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
            for start in range(0, len(batches), micro_batches):
                optimizer.zero_grad(set_to_none=set_to_none)
                for index in range(start, start + micro_batches):
                    x, y = _slice(batches[index], rank)
                    if index < start + micro_batches - 1:
                        with model.no_sync():
                            (nn.functional.mse_loss(model(x), y) / micro_batches).backward()
                        if name == "ours":  # nothing was averaged: the ranks' gradients still differ
                            local = model.module.first.weight.grad
                            accumulated_in_bucket.append(_in_a_bucket(model, local))
                            everyone = [torch.empty_like(local) for _ in range(world_size)]
                            dist.all_gather(everyone, local.clone())
                            grads_differ_after_no_sync.append(not torch.equal(everyone[0], everyone[1]))
                    else:
                        (nn.functional.mse_loss(model(x), y) / micro_batches).backward()
                optimizer.step()
            results[name] = _state(model.module)
            if name == "ours":
                communication = (model.communication_per_step(), model.predicted_communication())
        found[view, set_to_none] = {
            "vs_single": _max_difference(results["ours"], _state(reference)),
            "vs_torch": _max_difference(results["ours"], results["torch"]),
            "grads_differ_after_no_sync": grads_differ_after_no_sync, "communication": communication,
            "accumulated_in_bucket": accumulated_in_bucket}
    return {"no_sync": found}


def _in_a_bucket(ddp: DistributedDataParallel, tensor: torch.Tensor | None) -> bool:
    """Whether ``tensor`` shares its storage with one of ``ddp``'s bucket buffers."""
    buckets = {bucket.buffer.untyped_storage().data_ptr() for bucket in ddp._buckets}
    return tensor is not None and tensor.untyped_storage().data_ptr() in buckets


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
    for name in ("ours", "ours (copies)", "torch"):
        torch.manual_seed(0)
        model = Branchy()
        if name.startswith("ours"):
            wrapped = DistributedDataParallel(model, bucket_cap_mb=0.0, gradient_as_bucket_view=name == "ours")
        else:
            wrapped = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0,
                                                          find_unused_parameters=True)
        wrapped(x, use_branch=rank == 0).square().mean().backward()
        grads[name] = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        if name == "ours":
            unused = wrapped.unused_parameters
            grads["ours in buckets"] = {n: _in_a_bucket(wrapped, p.grad) for n, p in model.named_parameters()}
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
    for cap, view in [(cap, view) for cap in PIPELINE_CAPS for view in VIEWS]:
        ddp = DistributedDataParallel(TinyGPT(GPT, seed=rank), bucket_cap_mb=cap, gradient_as_bucket_view=view)
        optimizer = _gpt_optimizer(ddp.module)
        gradient_error, norm_error, silent, counted, in_buckets = 0.0, 0.0, [], [], []
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
            in_buckets.append(all(_in_a_bucket(ddp, p.grad) for p in ddp.module.parameters()))
            gradient_error = max(gradient_error, _max_difference(ddp.gradients(), gradients))
            norm_error = max(norm_error, abs(ddp.clip_grad_norm_(MAX_NORM).item() - norm.item()))
            optimizer.step()
        found[cap, view] = {"gradients": gradient_error, "norm": norm_error, "buckets": len(ddp.buckets),
                            "parameters": _max_difference(_state(ddp), _state(reference)),
                            "silent_during_backward": silent, "one_reduction_counted": counted,
                            "gradients_in_buckets": in_buckets}
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


def _gradient_offsets(ddp: DistributedDataParallel) -> dict[str, tuple[int, int]]:
    """``{name: (bucket, byte offset)}`` where each parameter's gradient lies in the buckets (``ddp.buckets``)."""
    where = {}
    for index, bucket in enumerate(ddp.buckets):
        offset = 0
        for name, nbytes in bucket:
            where[name] = (index, offset)
            offset += nbytes
    return where


def _gradient_places(ddp: DistributedDataParallel) -> dict[str, tuple[int, int] | None]:
    """``{name: (bucket, byte offset)}`` of each trainable parameter's ``.grad``; None when it is not in a bucket."""
    starts = {bucket.buffer.untyped_storage().data_ptr(): index for index, bucket in enumerate(ddp._buckets)}
    places = {}
    for name, p in ddp.module.named_parameters():
        if p.requires_grad:
            storage = None if p.grad is None else p.grad.untyped_storage().data_ptr()
            places[name] = (starts[storage], p.grad.data_ptr() - storage) if storage in starts else None
    return places


def _bucket_view_case(rank: int, world_size: int) -> dict:
    """TinyGPT (tied embeddings) with a frozen layer norm: where the gradients live, what memory_breakdown()
    counts, and a zero_grad(set_to_none=True) step against one process."""
    batches = _gpt_batches(3, world_size * 2)
    found = {}
    for view in VIEWS:
        model = TinyGPT(GPT, seed=0)
        model.final_norm.requires_grad_(False)
        reference = TinyGPT(GPT, seed=0)
        reference.final_norm.requires_grad_(False)
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.002, gradient_as_bucket_view=view)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        case: dict = {"expected_places": _gradient_offsets(ddp), "places": [], "same_storages": [],
                      "gradient_error": 0.0, "memory": [], "model_state_gradients": []}
        storages = None
        for x, y in batches:
            for wrapped, opt, inputs in ((ddp, optimizer, (x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])),
                                         (reference, reference_optimizer, (x, y))):
                opt.zero_grad(set_to_none=True)
                wrapped(*inputs)[1].backward()
            now = [p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None]
            case["same_storages"].append(storages is None or now == storages)
            storages = now
            case["places"].append(_gradient_places(ddp))
            case["gradient_error"] = max(case["gradient_error"], _max_difference(
                {n: g for n, g in ddp.gradients().items() if g is not None},
                {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}))
            optimizer.step()
            reference_optimizer.step()
            case["memory"].append(ddp.memory_breakdown(optimizer))
            case["model_state_gradients"].append(model_state_bytes(model, optimizer)["gradients"])
        case["trainable_bytes"] = sum(4 * p.numel() for p in model.parameters() if p.requires_grad)
        case["parameters"] = _max_difference(_state(ddp), _state(reference))
        found[view] = case
    return {"bucket_view": found}


def _compression_case(mine: list) -> dict:
    """Each compressor trains the same with .grad as views of the buckets and with copies (bit for bit)."""
    found = {}
    for name, compression in (("fp16", FP16Compression), ("topk", lambda: TopKCompression(0.25)),
                              ("powersgd", lambda: PowerSGDCompression(rank=1))):
        states, in_buckets = {}, {}
        for view in VIEWS:
            ddp = DistributedDataParallel(_model("mlp", seed=0), bucket_cap_mb=0.0003, compression=compression(),
                                          gradient_as_bucket_view=view)
            _train(ddp, mine)
            states[view] = _state(ddp)
            in_buckets[view] = all(_in_a_bucket(ddp, p.grad) for p in ddp.module.parameters())
        found[name] = {"difference": _max_difference(states[True], states[False]), "in_buckets": in_buckets,
                       "moved": _max_difference(states[True], _state(_model("mlp", seed=0)))}
    return {"compression": found}


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
                for view in VIEWS:
                    difference = report["vs_single"][kind, cap, overlap, view]
                    assert difference <= ATOL, (f"{kind}, bucket_cap_mb={cap}, overlap={overlap}, view={view}, "
                                                f"rank {rank}/{world_size}: parameters differ from single-process "
                                                f"by {difference:.2e}")


@pytest.mark.parametrize("world_size", (2, 3))
def test_the_comparison_rejects_training_on_one_ranks_slice_only(reports, world_size):
    for kind in KINDS:
        assert reports[world_size][0]["vs_single"][kind, "local only (control)"] > 100 * ATOL


@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("kind", KINDS)
def test_ddp_training_equals_torch_ddp_with_the_same_bucket_size_and_gradient_as_bucket_view(reports,
                                                                                             world_size, kind):
    tolerance = 0.0 if world_size == 2 else ATOL  # two ranks: one order of summation, an exact division
    for rank, report in enumerate(reports[world_size]):
        for cap in BUCKET_CAPS:
            for overlap in (True, False):
                for view in VIEWS:
                    difference = report["vs_torch"][kind, cap, overlap, view]
                    assert difference <= tolerance, (f"{kind}, bucket_cap_mb={cap}, overlap={overlap}, "
                                                     f"view={view}, rank {rank}: parameters differ from torch "
                                                     f"DDP by {difference:.2e}")


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
            for view in VIEWS:
                assert report["measured"]["mlp", cap, overlap, view] == report["predicted"]["mlp", cap], (cap,
                                                                                                        overlap)
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
@pytest.mark.parametrize("view, set_to_none", NO_SYNC_MODES)
def test_no_sync_accumulation_over_micro_batches_equals_one_large_batch(reports, world_size, view, set_to_none):
    for rank, report in enumerate(reports[world_size]):
        found = report["no_sync"][view, set_to_none]
        assert found["vs_single"] <= ATOL, f"rank {rank}: {found['vs_single']:.2e}"
        assert found["vs_torch"] <= (0.0 if world_size == 2 else ATOL), f"rank {rank}: {found['vs_torch']:.2e}"
        assert found["grads_differ_after_no_sync"] and all(found["grads_differ_after_no_sync"]), \
            "gradients were equal across ranks after a no_sync backward: something communicated"
        measured, predicted = found["communication"]
        assert measured == predicted, "three micro-batches, one synchronised: one all-reduce of the gradients"
        # set_to_none=False keeps the views: from the second step on, no_sync accumulates in the bucket itself
        expected = [view and not set_to_none and index >= 2 for index in range(len(found["accumulated_in_bucket"]))]
        assert found["accumulated_in_bucket"] == expected, found["accumulated_in_bucket"]


@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("cap", PIPELINE_CAPS)
@pytest.mark.parametrize("view", VIEWS)
def test_m_forwards_then_m_unsynchronised_backwards_then_reduce_gradients_equals_one_process(reports,
                                                                                             world_size, cap, view):
    for rank, report in enumerate(reports[world_size]):
        found = report["pipeline"][cap, view]
        assert found["gradients"] <= ATOL, f"rank {rank}: gradients differ by {found['gradients']:.2e}"
        assert found["parameters"] <= ATOL, f"rank {rank}: parameters differ by {found['parameters']:.2e}"
        assert found["silent_during_backward"] == [{}, {}], "a backward pass with sync off communicated"
        assert found["one_reduction_counted"] == [True, True]
        assert found["gradients_in_buckets"] == [view, view], "reduce_gradients() left .grad outside the buckets"
    buckets = {cap: reports[world_size][0]["pipeline"][cap, view]["buckets"] for cap in PIPELINE_CAPS}
    assert buckets[0.0] > buckets[0.002] > buckets[25.0] == 1, buckets


@pytest.mark.parametrize("world_size", (2, 3))
def test_clip_grad_norm_equals_torch_clip_grad_norm_on_one_process_with_the_whole_batch(reports, world_size):
    assert min(reports[world_size][0]["pipeline_norms"]) > 2 * MAX_NORM  # the clipping changed the gradients
    for rank, report in enumerate(reports[world_size]):
        for case, found in report["pipeline"].items():
            assert found["norm"] <= ATOL, (rank, case, found["norm"])


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
        theirs = report["unused_grads"]["torch"]
        for ours in (report["unused_grads"]["ours"], report["unused_grads"]["ours (copies)"]):
            for name in ("main.weight", "main.bias", "branch.weight", "branch.bias"):
                assert torch.allclose(ours[name], theirs[name], atol=ATOL), (rank, name)
            assert torch.equal(ours["spare.weight"], torch.zeros(6, 6))  # ours: zeros (documented)
        assert theirs["spare.weight"] is None  # torch leaves a parameter no rank used without a gradient
        assert all(report["unused_grads"]["ours in buckets"].values()), "an unused parameter's .grad is no view"
        expected_unused = {"spare.weight", "spare.bias"}
        if rank > 0:
            expected_unused |= {"branch.weight", "branch.bias"}
        assert set(report["unused_parameters"]) == expected_unused


# --------------------------------------------------------------------------------------------------------
# Gradients as views of the buckets


@pytest.mark.parametrize("world_size", (2, 3))
def test_each_grad_is_a_view_at_its_place_in_its_bucket_and_copies_are_not(reports, world_size):
    for rank, report in enumerate(reports[world_size]):
        views, copies = report["bucket_view"][True], report["bucket_view"][False]
        expected = views["expected_places"]
        assert len(set(index for index, _ in expected.values())) > 1 and "final_norm.weight" not in expected
        for places in views["places"]:
            assert places == expected, f"rank {rank}: {places} != {expected}"
        for places in copies["places"]:  # the check rejects gradients that are not the bucket
            assert set(places.values()) == {None}, places


@pytest.mark.parametrize("world_size", (2, 3))
def test_zero_grad_set_to_none_then_backward_puts_the_right_gradient_back_into_the_same_buckets(reports,
                                                                                                world_size):
    for rank, report in enumerate(reports[world_size]):
        for view in VIEWS:
            case = report["bucket_view"][view]
            assert case["gradient_error"] <= ATOL and case["parameters"] <= ATOL, (rank, view, case)
        views = report["bucket_view"][True]
        assert views["same_storages"] == [True, True, True], "a step moved the gradients to new storage"


@pytest.mark.parametrize("world_size", (2, 3))
def test_memory_breakdown_counts_one_gradient_sized_buffer_with_views_and_two_with_copies(reports, world_size):
    for report in reports[world_size]:
        views, copies = report["bucket_view"][True], report["bucket_view"][False]
        psi = views["trainable_bytes"]
        for memory in views["memory"]:
            assert memory["gradients"] == psi, memory
        for memory in copies["memory"]:
            assert memory["gradients"] == 2 * psi, memory  # the .grad and the buckets beside them
        for a, b in zip(views["memory"], copies["memory"], strict=True):
            assert {k: v for k, v in a.items() if k != "gradients"} == {k: v for k, v in b.items()
                                                                        if k != "gradients"}
        # model_state_bytes sees only the .grad: a bucket's views counted once, as the whole bucket
        assert views["model_state_gradients"] == copies["model_state_gradients"] == [psi] * 3


@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("name", ("fp16", "topk", "powersgd"))
def test_compression_trains_the_same_with_gradients_as_views_and_as_copies(reports, world_size, name):
    for rank, report in enumerate(reports[world_size]):
        found = report["compression"][name]
        assert found["moved"] > 100 * ATOL  # the training changed the weights
        assert found["difference"] == 0.0, (rank, name, found)
        assert found["in_buckets"] == {True: True, False: False}, found


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
    with pytest.raises(TypeError, match="gradient_as_bucket_view.*1"):
        DistributedDataParallel(MLP(), gradient_as_bucket_view=1)
    with pytest.raises(TypeError, match="launch.*complete"):
        DistributedDataParallel(MLP(), compression=object())


def test_no_process_group_is_a_clear_error_pointing_at_launch():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="labkit.launch"):
        DistributedDataParallel(MLP())
