"""Expert parallelism on 2, 4 and 8 gloo ranks against one process.

The layer: every rank routes its own tokens (uneven counts), the experts live on ``ep`` ranks, and each rank's
output and input gradient equal one process running the whole layer on that rank's tokens; each expert's
gradient, the sum over every rank's tokens; the router's, the rank's own (fp64, 1e-12), with dropped tokens and
without.  Every all-to-all's bytes equal ``labkit.costmodel.experts`` for the splits the router made, and under
uniform routing ``T k h b (ep - 1) / ep``; traced, the experts' backward sits between the combine's gradient and
the dispatch's (lesson 14's timeline).  Then TinyGPT with MoE blocks through ``parallelize`` (ep folded over
dp and cp, with tp and pp, every schedule) against one process, and ``labkit.train --ep``.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

from labkit import trace
from labkit.costmodel.experts import ep_messages, ep_uniform_bytes
from labkit.degrees import check_ep
from labkit.launch import launch
from labkit.mesh import Mesh, mesh_groups
from labkit.models import GPTConfig, TinyGPT
from labkit.parallel.experts import (
    ExpertParallelGroup,
    MoE,
    apply_expert_parallel,
    aux_loss_scale,
    route_to_experts,
)
from labkit.parallel.parallelize import check_3d, parallelize
from labkit.train.config import parse_arguments

H, E, K = 6, 8, 2


def _layer(capacity: float | None) -> MoE:
    torch.manual_seed(0)
    return MoE(H, E, K, expert_hidden=5, capacity_factor=capacity, n_shared_experts=1, aux_loss_weight=0.1).double()


def _layer_cases() -> list[dict]:
    size, me = dist.get_world_size(), dist.get_rank()
    results = []
    for capacity in (None, 1.0):
        reference = _layer(capacity)
        layer = _layer(capacity)
        ep = ExpertParallelGroup(None)
        apply_expert_parallel(layer, ep)
        generator = torch.Generator().manual_seed(1)
        xs = [torch.randn(3 + rank, 4, H, dtype=torch.float64, generator=generator) for rank in range(size)]
        douts = [torch.randn(x.shape, dtype=torch.float64, generator=generator) for x in xs]
        x = xs[me].clone().requires_grad_()
        out = layer(x)
        (out * douts[me]).sum().backward()
        errors, experts_sum = [], {}
        for rank in range(size):  # one process: the whole layer on each rank's tokens in turn
            reference.zero_grad()
            x_ref = xs[rank].clone().requires_grad_()
            out_ref = reference(x_ref)
            (out_ref * douts[rank]).sum().backward()
            for name, p in reference.named_parameters():
                if ".experts." in f".{name}" or name.startswith("experts."):
                    experts_sum[name] = experts_sum.get(name, 0) + (p.grad if p.grad is not None else 0)
            if rank == me:
                errors += [(out_ref - out).abs().max().item(), (x_ref.grad - x.grad).abs().max().item()]
                own = {name: p.grad.clone() for name, p in reference.named_parameters() if p.grad is not None}
        for name, p in layer.named_parameters():
            expected = experts_sum[name] if name.startswith("experts.") else own[name]
            errors.append((p.grad - expected).abs().max().item())
        predicted = [m for send, receive in ep.splits for m in ep_messages(send, receive, me, H * 8)]
        results.append({"capacity": capacity, "error": max(errors), "dropped": layer.last["dropped"],
                        "log": [m for m in ep.log if m[1] != "counts"], "predicted": predicted,
                        "counts": [m for m in ep.log if m[1] == "counts"],
                        "held": [i for i, e in enumerate(layer.experts) if e is not None]})
    results.append(_uniform_and_empty(size, me))
    results.append(_traced())
    return results


def _traced() -> dict:
    """One traced forward and backward: this rank's spans, (name, start, end), in the order they ended."""
    layer = _layer(None)
    apply_expert_parallel(layer, ExpertParallelGroup(None))
    trace.enable()
    layer(torch.randn(2, 5, H, dtype=torch.float64, requires_grad=True)).sum().backward()
    spans = [(span.name, span.start_s, span.end_s) for span in trace.spans()]
    trace.disable()
    return {"spans": spans}


def _uniform_and_empty(size: int, me: int) -> dict:
    """Routing chosen by hand: uniform (token t's choices t k, t k + 1, ... mod E), then everything to expert 0
    (ranks but the first receive nothing, experts but the first compute nothing)."""
    torch.manual_seed(0)
    experts = torch.nn.ModuleList(torch.nn.Linear(H, H) for _ in range(E))
    ep = ExpertParallelGroup(None)
    for index in range(E):
        if index not in ep.experts(E):
            experts[index] = None
    tokens = torch.randn(16, H, requires_grad=True)
    ids = torch.arange(16 * K).remainder(E).view(16, K)
    weights, kept = torch.ones(16, K), torch.ones(16, K, dtype=torch.bool)
    route_to_experts(tokens, ids, weights, kept, experts, ep).sum().backward()
    uniform = list(ep.log)
    ep.clear()
    out = route_to_experts(tokens, torch.zeros(16, K, dtype=torch.long), weights, kept, experts, ep)
    out.sum().backward()
    return {"uniform": uniform, "collapsed": list(ep.log), "splits": ep.splits}


@pytest.mark.parametrize("ep", [2, 4])
def test_the_expert_parallel_layer_equals_one_process_and_sends_what_the_model_says(ep):
    per_rank = launch(_layer_cases, nprocs=ep, timeout=120, rank_output="none")
    dropped = 0
    for rank, results in enumerate(per_rank):
        assert results[0]["held"] == list(range(rank * E // ep, (rank + 1) * E // ep))
        for case in results[:2]:
            assert case["error"] < 1e-12, (rank, case["capacity"], case["error"])
            assert Counter(case["log"]) == Counter(case["predicted"]), (rank, case["capacity"])
            assert case["counts"] == [("forward", "counts", (E - E // ep) * 8)]
        dropped += results[1]["dropped"]
        assert results[0]["dropped"] == 0
        uniform = ep_uniform_bytes(16, K, H, 4, ep)
        assert sorted(results[2]["uniform"]) == sorted(
            [("forward", "counts", (E - E // ep) * 8), ("forward", "dispatch", uniform),
             ("forward", "combine", uniform), ("backward", "dcombine", uniform), ("backward", "ddispatch", uniform)])
        spans = {name: (start, end) for name, start, end in results[3]["spans"]}
        experts = f"experts {rank * E // ep}-{(rank + 1) * E // ep - 1}"
        assert spans[f"{experts} backward"][0] >= spans[f"{experts}"][1], spans  # the backward after the forward
        assert spans["ep all-to-all dcombine"][1] <= spans[f"{experts} backward"][0], spans
        assert spans[f"{experts} backward"][1] <= spans["ep all-to-all ddispatch"][0], spans
        send, receive = results[2]["splits"][0]
        assert send == [16 * K if r == 0 else 0 for r in range(ep)]
        assert receive == ([16 * K] * ep if rank == 0 else [0] * ep)
    assert dropped > 0  # the capacity case did drop


GPT = dict(tie_weights=False, n_experts=4, top_k=2, expert_hidden=32, n_shared_experts=1)
STEPS, SEQUENCES, MICRO, LR, SEQ_LEN = 2, 4, 2, 0.3, 32
# (dp, tp, pp, cp, ep, schedule, capacity factor, aux loss weight)
LAYOUTS_EP = {
    2: [(2, 1, 1, 1, 2, "1f1b", None, 0.0), (2, 1, 1, 1, 2, "1f1b", 1.0, 0.01)],
    4: [(4, 1, 1, 1, 4, "1f1b", 1.0, 0.01), (4, 1, 1, 1, 2, "1f1b", 1.25, 0.01), (2, 2, 1, 1, 2, "1f1b", 1.25, 0.01),
        (2, 1, 2, 1, 2, "zb-h1", 1.0, 0.01), (2, 1, 1, 2, 2, "1f1b", None, 0.0)],
    8: [(2, 1, 2, 2, 4, "gpipe", None, 0.0), (2, 2, 2, 1, 2, "interleaved", None, 0.01),
        (4, 1, 2, 1, 4, "1f1b", 1.0, 0.01)],
}


def _config(capacity: float | None, aux: float) -> GPTConfig:
    return GPTConfig.preset("100k", capacity_factor=capacity, aux_loss_weight=aux, **GPT)


def _batch(step: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(32, (dp * SEQUENCES, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1000 + step))
    rows = ids[dp_rank * SEQUENCES:(dp_rank + 1) * SEQUENCES]
    return rows[:, :-1], rows[:, 1:]


def _one_process(config: GPTConfig, dp: int) -> tuple[list[float], dict]:
    """One process, routing each data-parallel rank's micro-batches apart, as the ranks do (the capacity and the
    auxiliary loss are per forward pass): the mean of their losses, the gradient of that mean."""
    model = TinyGPT(config, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        total = 0.0
        for rank in range(dp):
            inputs, targets = _batch(step, rank, dp)
            for micro in range(MICRO):
                rows = slice(micro * SEQUENCES // MICRO, (micro + 1) * SEQUENCES // MICRO)
                with aux_loss_scale(1 / (dp * MICRO)):
                    _, loss = model(inputs[rows], targets[rows])
                (loss / (dp * MICRO)).backward()
                total += loss.item() / (dp * MICRO)
        optimizer.step()
        losses.append(total)
    return losses, model.state_dict()


def _train_ep(layouts: list[tuple]) -> list[dict]:
    out = []
    for dp, tp, pp, cp, ep, schedule, capacity, aux in layouts:
        torch.manual_seed(0)
        mesh = Mesh(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
        model = parallelize(TinyGPT(_config(capacity, aux), seed=0), mesh, schedule=schedule, microbatches=MICRO,
                            micro_batch_size=SEQUENCES // MICRO, seq_len=SEQ_LEN)
        optimizer = model.make_optimizer(torch.optim.SGD, lr=LR, momentum=0.9)
        losses = []
        for step in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            losses.append(model.forward_backward(*_batch(step, mesh.rank("dp"), dp)).item())
            optimizer.step()
        norm = model.clip_grad_norm_(1e9).item()
        full = model.full_state_dict()
        out.append({"losses": losses, "full": full if dist.get_rank() == 0 else None, "norm": norm,
                    "communication": model.communication_per_step(), "predicted": model.predicted_communication()})
    return out


@pytest.mark.parametrize("world_size", sorted(LAYOUTS_EP))
def test_tinygpt_with_experts_over_ep_trains_as_one_process_and_sends_what_it_predicts(world_size):
    per_rank = launch(_train_ep, LAYOUTS_EP[world_size], nprocs=world_size, timeout=400, rank_output="none")
    for index, layout in enumerate(LAYOUTS_EP[world_size]):
        dp, capacity, aux = layout[0], layout[6], layout[7]
        config = _config(capacity, aux)
        losses, state = _one_process(config, dp)
        mean = [sum(rank[index]["losses"][step] for rank in per_rank) / world_size for step in range(STEPS)]
        assert mean == pytest.approx(losses, abs=1e-5, rel=0), layout
        full = per_rank[0][index]["full"]
        assert list(full) == list(state), layout  # every expert gathered, in the dense model's order
        worst = max((full[name] - state[name]).abs().max().item() for name in state)
        assert worst < 1e-6, (layout, worst)
        norms = [rank[index]["norm"] for rank in per_rank]
        assert max(norms) - min(norms) < 1e-5 * max(norms), (layout, norms)
        for rank in per_rank:
            assert rank[index]["communication"] == rank[index]["predicted"], layout
            assert rank[index]["communication"]["ep dispatch"] > 0, layout


def test_the_gradient_norm_counts_each_expert_once():
    """The global gradient norm of an EP model equals one process's, though each expert lives on one rank of an ep
    group and on every rank of its edp group."""
    config = _config(None, 0.0)
    per_rank = launch(_norm_ep, config, nprocs=4, timeout=120, rank_output="none")
    model = TinyGPT(config, seed=0)
    for rank in range(2):
        inputs, targets = _batch(0, rank, 2)
        _, loss = model(inputs, targets)
        (loss / 2).backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()
    assert all(norm == pytest.approx(expected, rel=1e-5) for norm in per_rank)


def _norm_ep(config: GPTConfig) -> float:
    mesh = Mesh(dp=2, cp=1, tp=2, ep=2)
    model = parallelize(TinyGPT(config, seed=0), mesh, micro_batch_size=SEQUENCES, seq_len=SEQ_LEN)
    model.make_optimizer(torch.optim.SGD, lr=LR)
    model.forward_backward(*_batch(0, mesh.rank("dp"), 2))
    return model.clip_grad_norm_(1e9).item()


def test_the_mesh_folds_ep_over_dp_and_cp():
    groups = mesh_groups(8, dp=2, cp=2, tp=2, ep=2)
    assert groups["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups["ep"] == [[0, 2], [4, 6], [1, 3], [5, 7]]  # consecutive in dp x cp: cp's neighbours
    assert groups["edp"] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert "ep" not in mesh_groups(8, dp=2, cp=2, tp=2)
    with pytest.raises(ValueError, match="ep=3 must divide dp \\* cp = 2 \\* 2 = 4"):
        check_ep(3, 2, 2)
    with pytest.raises(ValueError, match="ep=2 needs MoE blocks to split"):
        check_3d(GPTConfig.preset("100k"), 2, 1, 1, ep=2)
    with pytest.raises(ValueError, match="n_experts=6 does not divide by ep=4"):
        check_3d(GPTConfig.preset("100k", n_experts=6), 4, 1, 1, ep=4)
    with pytest.raises(ValueError, match="expert parallelism is built here with DDP only"):
        check_3d(GPTConfig.preset("100k", n_experts=4), 2, 1, 1, ep=2, zero=1)


def test_the_trainer_with_ep_trains_as_with_the_experts_replicated():
    """--ep 2 on 2 data-parallel ranks: the same losses as the same MoE model with every expert on every rank;
    bad MoE flags are refused before any process starts."""
    from labkit.train import TrainConfig
    from tests.test_parallelize import _train

    flags = dict(dp=2, tp=1, pp=1, steps=3, batch_size=4, log_every=100, experts=4, top_k=2, capacity_factor=1.0,
                 aux_loss_weight=0.01, bias_update_rate=0.001)
    split = launch(_train, [TrainConfig(ep=2, **flags)], nprocs=2, timeout=300, rank_output="none")
    whole = launch(_train, [TrainConfig(**flags)], nprocs=2, timeout=300, rank_output="none")
    for rank in range(2):
        assert split[rank][0]["losses"] == pytest.approx(whole[rank][0]["losses"], abs=1e-5, rel=0), rank
    assert any(kind.startswith("ep ") for kind in split[0][0]["communication"])
    with pytest.raises(ValueError, match="ep=2 needs MoE blocks to split"):
        parse_arguments(["--ep", "2", "--nprocs", "2"])
    with pytest.raises(ValueError, match="give --experts E too"):
        parse_arguments(["--top-k", "1"])
    with pytest.raises(ValueError, match="ep=3 must divide"):
        parse_arguments(["--ep", "3", "--experts", "6", "--nprocs", "4"])
    with pytest.raises(ValueError, match="top_k=9 experts per token cannot exceed n_experts=8"):
        parse_arguments(["--experts", "8", "--top-k", "9"])
