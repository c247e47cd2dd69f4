"""The mixture-of-experts layer (``labkit.parallel.experts``) on one process: router, capacity, balancing, dispatch.

The layer is checked against its definition (:func:`moe_reference`: every expert on every token, weighted by the
gates) in fp64, outputs and every gradient, over softmax and sigmoid routers, k = 1, 2, 3, capacity on and off,
shared experts; the auxiliary loss's gradient against the loss written out; the dispatch's permutation against
its definition; the TinyGPT switch against the parameter count.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from labkit.models import GPTConfig, TinyGPT
from labkit.parallel.experts import (
    MoE,
    Router,
    aux_loss_scale,
    balance_experts,
    dispatch_order,
    drop_over_capacity,
    expert_capacity,
    inverse_permutation,
    moe_layers,
    moe_reference,
    route_to_experts,
    send_counts,
)

H = 6


def _layer(score: str = "softmax", k: int = 2, capacity: float | None = None, shared: int = 0, experts: int = 5,
           aux: float = 0.0, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    return MoE(H, experts, k, expert_hidden=7, score=score, capacity_factor=capacity, n_shared_experts=shared,
               aux_loss_weight=aux).double()


def _grads(layer: MoE, x: torch.Tensor, forward) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    layer.zero_grad()
    x = x.clone().requires_grad_()
    out = forward(layer, x)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
    return out.detach(), {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}, x.grad


CASES = list(itertools.product(("softmax", "sigmoid"), (1, 2, 3), (None, 0.5, 1.0), (0, 1)))


@pytest.mark.parametrize(("score", "k", "capacity", "shared"), CASES)
def test_the_layer_equals_every_expert_on_every_token_weighted_by_its_gate(score, k, capacity, shared):
    layer = _layer(score, k, capacity, shared)
    x = torch.randn(3, 8, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out, grads, dx = _grads(layer, x, lambda m, t: m(t))
    expected, expected_grads, expected_dx = _grads(layer, x, moe_reference)
    assert (out - expected).abs().max() < 1e-12
    assert (dx - expected_dx).abs().max() < 1e-12
    assert set(grads) >= set(expected_grads)
    for name, grad in grads.items():  # an expert no token reached: zero here, None in the reference
        assert (grad - expected_grads.get(name, torch.zeros_like(grad))).abs().max() < 1e-12, name
    assert layer.last["dropped"] == (0 if capacity is None else layer.last["dropped"])
    if capacity is not None:
        assert layer.last["capacity"] == math.ceil(capacity * 24 * k / 5)
        assert int(layer.last["received"].max()) <= layer.last["capacity"]
    assert int(layer.last["received"].sum()) + layer.last["dropped"] == 24 * k


def test_a_dropped_token_passes_on_the_residual_alone():
    layer = _layer(capacity=0.2, k=1)
    x = torch.randn(1, 20, H, dtype=torch.float64)
    routing = layer.router(x.reshape(-1, H))
    out = layer(x).reshape(-1, H)
    dropped = ~routing.kept[:, 0]
    assert dropped.any() and (out[dropped] == 0).all() and (out[~dropped] != 0).all()


def test_capacity_serves_every_first_choice_before_any_second():
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])  # expert 0: 3 first choices and a second
    kept = drop_over_capacity(experts, 3, capacity=2)
    assert kept.tolist() == [[True, True], [True, True], [False, False], [True, False]]  # expert 1: 3rd drops
    assert drop_over_capacity(experts, 3, None).all()
    assert expert_capacity(10, 2, 4, 1.0) == 5 and expert_capacity(10, 2, 4, 1.1) == 6
    assert expert_capacity(10, 2, 4, None) is None


def test_the_auxiliary_loss_is_one_when_uniform_and_e_when_collapsed():
    router = Router(H, 4, 1).double()
    routing = router(torch.randn(16, H, dtype=torch.float64))
    routing.experts = torch.arange(16).remainder(4).unsqueeze(1)  # f uniform
    routing.scores = torch.full((16, 4), 0.25, dtype=torch.float64)  # P uniform
    assert routing.aux_loss().item() == pytest.approx(1.0)
    routing.scores = torch.eye(4, dtype=torch.float64)[torch.arange(16) % 4]  # confident, still balanced
    assert routing.aux_loss().item() == pytest.approx(1.0)
    routing.experts = torch.zeros(16, 1, dtype=torch.long)  # collapsed onto expert 0
    routing.scores = torch.eye(4, dtype=torch.float64)[torch.zeros(16, dtype=torch.long)]
    assert routing.aux_loss().item() == pytest.approx(4.0)
    routing.scores = torch.full((16, 4), 2.0, dtype=torch.float64)  # sigmoid scores: normalised first
    assert routing.aux_loss().item() == pytest.approx(1.0)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_the_auxiliary_loss_gradient_is_that_of_the_loss_written_out(score):
    weight, scale = 0.3, 0.25
    layer = _layer(score, aux=weight)
    plain = _layer(score)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(2, 9, H, dtype=torch.float64)
    dout = torch.randn(2, 9, H, dtype=torch.float64)
    with aux_loss_scale(scale):
        (layer(x) * dout).sum().mul(scale).backward()
    out = plain(x)
    routing = plain.router(x.reshape(-1, H))
    ((out * dout).sum() + weight * routing.aux_loss()).mul(scale).backward()
    for (name, p), q in zip(layer.named_parameters(), plain.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-12, rtol=0), name
    assert layer.router.gate.weight.grad.abs().sum() > 0


def test_the_balancing_bias_moves_the_choice_not_the_weights():
    router = Router(H, 4, 2, score="sigmoid").double()
    tokens = torch.randn(32, H, dtype=torch.float64)
    before = router(tokens)
    with torch.no_grad():
        router.bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))  # experts 0 and 1 chosen by every token
    after = router(tokens)
    assert (after.experts.sort(dim=1).values == torch.tensor([0, 1])).all()
    scores = after.scores.gather(1, after.experts)
    assert torch.allclose(after.weights, scores / scores.sum(1, keepdim=True))  # unbiased scores
    assert not torch.equal(before.experts, after.experts)
    router.update_bias(torch.tensor([30, 10, 20, 20]), rate=0.5)  # mean 20: busy down, idle up, equal stays
    assert router.bias.tolist() == [9.5, 10.5, 0.0, 0.0]


def test_bias_balancing_evens_a_skewed_router_out():
    layer = _layer(k=1, experts=4)
    with torch.no_grad():
        layer.router.gate.weight[0] += 0.5  # expert 0 favoured
    x = torch.randn(1, 400, H, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    layer.train()
    first = None
    for _ in range(300):
        layer(x)
        load = balance_experts(layer, rate=0.01)[0]
        first = load if first is None else first
    assert first.max() / first.float().mean() > 1.5
    assert load.max() / load.float().mean() < 1.2, load


def test_dispatch_groups_by_destination_rank_stably_and_inverts():
    ids = torch.tensor([5, 0, 3, 7, 0, 2, 6, 3, 1])
    for ep in (1, 2, 4, 8):
        counts = send_counts(ids, 8, ep)
        assert counts.tolist() == [sum(1 for i in ids.tolist() if i // (8 // ep) == r) for r in range(ep)]
        order = dispatch_order(ids, 8, ep)
        assert ids[order].tolist() == sorted(ids.tolist())
        assert order.tolist() == sorted(range(len(ids)), key=lambda i: (ids[i].item(), i))
        inverse = inverse_permutation(order)
        assert torch.equal(ids[order][inverse], ids)
    assert send_counts(torch.tensor([[1, 1], [1, 1]]), 4, 2).tolist() == [4, 0]  # an empty rank


def test_route_to_experts_sums_each_tokens_kept_choices():
    torch.manual_seed(0)
    experts = torch.nn.ModuleList(torch.nn.Linear(H, H).double() for _ in range(3))
    tokens = torch.randn(4, H, dtype=torch.float64)
    ids = torch.tensor([[0, 2], [2, 2], [1, 0], [2, 1]])
    weights = torch.rand(4, 2, dtype=torch.float64)
    kept = torch.tensor([[True, True], [True, False], [False, True], [True, True]])
    out = route_to_experts(tokens, ids, weights, kept, experts)
    expected = torch.stack([sum(weights[t, j] * experts[int(ids[t, j])](tokens[t]) for j in range(2) if kept[t, j])
                            for t in range(4)])
    assert torch.allclose(out, expected, atol=1e-12)


def test_tinygpt_with_experts_counts_its_parameters_and_starts_alike():
    config = GPTConfig.preset("100k", n_experts=4, top_k=2, expert_hidden=64, n_shared_experts=1)
    model = TinyGPT(config, seed=3)
    h, f, e = 48, 64, 4
    dense = TinyGPT(GPTConfig.preset("100k"), seed=3).num_parameters()
    mlp = 8 * h * h + 5 * h
    moe = h * e + (e + 1) * (2 * h * f + f + h)
    assert model.num_parameters() == dense + config.n_layer * (moe - mlp)
    assert len(moe_layers(model)) == 4 and all((layer.router.bias == 0).all() for layer in moe_layers(model))
    again = TinyGPT(config, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True))
    assert "blocks.1.mlp.experts.3.proj.weight" in model.state_dict()
    _, loss = model(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    loss.backward()


@pytest.mark.parametrize(("overrides", "message"), [
    ({"n_experts": -1}, "n_experts must be an integer >= 0"),
    ({"n_experts": 4, "top_k": 5}, "top_k=5 experts per token cannot exceed n_experts=4"),
    ({"n_experts": 4, "router": "relu"}, "router score must be one of"),
    ({"n_experts": 4, "capacity_factor": 0}, "capacity_factor must be a finite number > 0"),
    ({"n_experts": 4, "capacity_factor": float("inf")}, "capacity_factor must be a finite number > 0"),  # overflowed
    ({"n_experts": 4, "aux_loss_weight": -0.1}, "aux_loss_weight must be a finite number >= 0"),
    ({"n_experts": 4, "aux_loss_weight": float("inf")}, "aux_loss_weight must be a finite number >= 0"),  # NaN loss
    ({"n_experts": 4, "bias_update_rate": float("inf")}, "bias_update_rate must be a finite number >= 0"),
    ({"n_experts": 4, "expert_hidden": 0}, "expert_hidden must be an integer >= 1"),
    ({"n_experts": 4, "n_shared_experts": -1}, "n_shared_experts must be an integer >= 0"),
])
def test_bad_moe_settings_are_refused_naming_the_value(overrides, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig.preset("100k", **overrides)


def test_both_remedies_balance_the_router_for_another_seed_too():
    """Lesson 14's balancing runs (seed 0 there), with seed 1: the busiest expert's share over the last 20 steps is
    lower with the auxiliary loss and with the bias than without balancing."""
    from labkit.parallel.experts.timing import BALANCING, balance_run

    late = {name: balance_run(name, seed=1)["late"] for name in BALANCING}
    assert late["auxiliary loss"] < late["no balancing"] and late["bias (DeepSeek-V3)"] < late["no balancing"], late
    with pytest.raises(ValueError, match="balancing must be one of"):
        balance_run("dropout")


def test_the_trainers_progress_line_says_what_the_moe_layers_dropped():
    from labkit.train.report import moe_summary, progress_line

    model = TinyGPT(GPTConfig.preset("100k", n_experts=4, top_k=2, capacity_factor=0.5), seed=0)
    assert moe_summary(model) == ""  # no forward yet
    ids = torch.randint(32, (2, 16), generator=torch.Generator().manual_seed(0))
    model(ids, ids)
    layers = moe_layers(model)
    dropped = sum(layer.last["dropped"] for layer in layers) / (4 * 32 * 2)
    summary = moe_summary(model)
    assert summary.startswith(f"MoE: {dropped:.1%} of the choices dropped, busiest expert ") and dropped >= 0.5
    assert f"| {summary} |" in progress_line(5, 0, 10, [2.0], None, 1.0, {}, summary)
    assert moe_summary(TinyGPT(GPTConfig.preset("100k"), seed=0)) == ""
