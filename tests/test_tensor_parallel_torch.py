"""labkit's tensor parallelism against PyTorch's own: ``torch.distributed.tensor.parallel.parallelize_module``.

The same ``TinyGPT`` (preset ``100k``, untied: torch's TP cannot tie an embedding and a head it parallelises
separately; dropout 0) is split over 2 and over 4 gloo ranks twice, by :func:`labkit.parallel.tensor.
parallelize_tensor` and by ``parallelize_module`` with ``labkit.parallel.tensor.torch_plan`` (Megatron's, as torchtitan writes it), on
the same ``Mesh(tp=world)`` (torch's side gets ``mesh.device_mesh["tp"]``).  Both train two SGD steps on one
batch beside the dense single-process model, without and with sequence parallelism, in fp32; each step's loss,
each parameter's *whole* gradient (torch's ``DTensor.full_tensor()``, labkit's shards all-gathered along the
dimension ``TensorParallel.split_parameters()`` names: ``full_gradients()``) and the weights after the steps must agree within 1e-5.
SGD rather than Adam: Adam's first update is ``lr * sign(g)``, which would turn the rounding noise of a
near-zero gradient into a difference of ``2 lr``.

torch's plan:

- vocabulary: ``token_embedding`` ``RowwiseParallel(input_layouts=Replicate())`` (rows of the table; the
  partial lookups all-reduced, or reduce-scattered to ``Shard(1)`` with sequence parallelism); ``lm_head``
  ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)`` and the cross-entropy under
  ``loss_parallel()``, so the logits are never gathered (labkit's vocabulary-parallel cross-entropy);
- each block: query, key, value and ``mlp.fc`` ``ColwiseParallel()``, ``attn.proj`` and ``mlp.proj``
  ``RowwiseParallel()``.  TinyGPT's attention views ``[batch, time, -1, head_dim]``, so local outputs
  (``use_local_output=True``) run this rank's heads with the code unchanged;
- sequence parallelism: the norms ``SequenceParallel()``, ``attn`` and ``mlp`` ``PrepareModuleInput`` from
  ``Shard(1)`` to ``Replicate()`` (the all-gather), the row-parallel outputs ``Shard(1)`` (the
  reduce-scatter), the head's input ``Shard(1)``.  The learned position embedding is added to the token
  embedding inside ``TinyGPT.embed``, on this rank's sequence shard: ``position_embedding`` gets
  ``PrepareModuleOutput(Replicate() -> Shard(0))``, so each rank adds its own positions (labkit's choice too).
  Its table stays a plain tensor; its gradient comes back whole because the backward of that redistribution
  all-gathers the shards' gradients.  The norms' gradients stay ``Partial`` DTensors (``full_tensor()`` and
  the optimizer sum them), where labkit all-reduces them at the end of backward.

Each checker is also shown to reject a wrong answer: labkit with sequence parallelism, its end-of-backward
all-reduce of the replicated parameters' gradients skipped (``no_sync``), differs from torch's by far more than
the tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from labkit.launch import launch
from labkit.mesh import Mesh
from labkit.models import GPTConfig, TinyGPT
from labkit.parallel.tensor import parallelize_tensor
from labkit.parallel.tensor.torch_plan import torch_plan

WORLD_SIZES = (2, 4)
TOLERANCE = 1e-5
STEPS = 2
LR = 0.1
BATCH, TIME = 2, 32  # 32 tokens: 8 per rank at tp=4


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective: Partial gradients summed, shards gathered); a tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _largest_difference(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    assert ours.keys() == theirs.keys()
    return max((ours[name] - theirs[name]).abs().max().item() for name in ours)


def _every_case() -> dict:
    """On each rank: the dense model, torch's TP and labkit's TP (without and with sequence parallelism), two SGD
    steps each on the same batch; the losses and the largest differences of gradients and weights."""
    world_size = dist.get_world_size()
    mesh = Mesh(tp=world_size)
    config = GPTConfig.preset("100k", tie_weights=False, dropout=0.0)
    generator = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, config.vocab_size, (BATCH, TIME), generator=generator) for _ in range(2))

    dense = TinyGPT(config, seed=0)  # built here, in the rank: forking after the parent ran torch ops can hang
    optimizer = torch.optim.SGD(dense.parameters(), lr=LR)
    dense_run = {"losses": [], "gradients": []}
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = dense(x, y)[1]
        loss.backward()
        dense_run["losses"].append(loss.item())
        dense_run["gradients"].append({name: p.grad.clone() for name, p in dense.named_parameters()})
        optimizer.step()
    dense_weights = dict(dense.state_dict())

    report: dict = {"dense losses": dense_run["losses"]}
    for sequence_parallel in (False, True):
        theirs = parallelize_module(TinyGPT(config, seed=0), mesh.device_mesh["tp"],
                                    torch_plan(config, sequence_parallel))
        ours = parallelize_tensor(TinyGPT(config, seed=0), mesh, sequence_parallel=sequence_parallel)
        optimizers = (torch.optim.SGD(theirs.parameters(), lr=LR), ours.make_optimizer(torch.optim.SGD, lr=LR))
        case = {"torch losses": [], "labkit losses": [], "labkit vs torch": [], "torch vs dense": [],
                "labkit vs dense": []}
        for step in range(STEPS):
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            with loss_parallel():  # the cross-entropy of Shard(-1) logits, and its backward
                loss = theirs(x, y)[1]
                loss.backward()
            case["torch losses"].append(_full(loss).item())
            torch_grads = {name: _full(p.grad) for name, p in theirs.named_parameters()}
            loss = ours(x, y)[1]
            loss.backward()
            case["labkit losses"].append(loss.item())
            labkit_grads = ours.full_gradients()
            case["labkit vs torch"].append(_largest_difference(labkit_grads, torch_grads))
            case["torch vs dense"].append(_largest_difference(torch_grads, dense_run["gradients"][step]))
            case["labkit vs dense"].append(_largest_difference(labkit_grads, dense_run["gradients"][step]))
            for opt in optimizers:
                opt.step()
        torch_weights = {name: _full(tensor) for name, tensor in theirs.state_dict().items()}
        labkit_weights = ours.full_state_dict()
        case["weights labkit vs torch"] = _largest_difference(labkit_weights, torch_weights)
        case["weights labkit vs dense"] = _largest_difference(labkit_weights, dense_weights)
        case["parameters compared"] = len(torch_grads)
        if sequence_parallel:  # the wrong answer: replicated gradients left as this rank's tokens' share
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            with ours.no_sync():
                ours(x, y)[1].backward()
            with loss_parallel():
                theirs(x, y)[1].backward()
            case["no_sync labkit vs torch"] = _largest_difference(
                ours.full_gradients(), {name: _full(p.grad) for name, p in theirs.named_parameters()})
        report[sequence_parallel] = case
    return report


@pytest.fixture(scope="module")
def reports() -> dict[int, list[dict]]:
    """Each rank's report, at tp = 2 and 4: one launch per world size runs every case."""
    return {world_size: launch(_every_case, nprocs=world_size, timeout=120, rank_output="none")
            for world_size in WORLD_SIZES}


@pytest.mark.parametrize("sequence_parallel", (False, True), ids=("tp", "tp+sp"))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_losses_equal_torch_parallelize_module_and_the_dense_model(reports, world_size, sequence_parallel):
    for report in reports[world_size]:
        case = report[sequence_parallel]
        for ours, theirs, dense in zip(case["labkit losses"], case["torch losses"], report["dense losses"],
                                       strict=True):
            assert ours == pytest.approx(theirs, abs=TOLERANCE)
            assert ours == pytest.approx(dense, abs=TOLERANCE)
            assert theirs == pytest.approx(dense, abs=TOLERANCE)
        assert case["labkit losses"][1] < case["labkit losses"][0]  # the SGD step did something


@pytest.mark.parametrize("sequence_parallel", (False, True), ids=("tp", "tp+sp"))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_whole_gradients_equal_torch_parallelize_module_at_every_step(reports, world_size, sequence_parallel):
    for report in reports[world_size]:
        case = report[sequence_parallel]
        assert case["parameters compared"] == 4 * 16 + 5  # every parameter of the untied model, by name
        for key in ("labkit vs torch", "torch vs dense", "labkit vs dense"):
            assert max(case[key]) <= TOLERANCE, (key, case[key])


@pytest.mark.parametrize("sequence_parallel", (False, True), ids=("tp", "tp+sp"))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_weights_after_sgd_steps_equal_torch_parallelize_module(reports, world_size, sequence_parallel):
    for report in reports[world_size]:
        case = report[sequence_parallel]
        assert case["weights labkit vs torch"] <= TOLERANCE
        assert case["weights labkit vs dense"] <= TOLERANCE


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_gradient_check_rejects_sequence_parallelism_without_the_replicated_all_reduce(reports, world_size):
    for report in reports[world_size]:
        assert report[True]["no_sync labkit vs torch"] > 1000 * TOLERANCE
