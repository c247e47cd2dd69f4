"""One MoE layer's forward and backward under expert parallelism, measured on every rank: what lesson 14 and
``benchmarks/bench_moe.py`` show (run it on ``ep`` ranks with :func:`labkit.launch.launch`).

Every rank builds the same layer (one seed), keeps its ``E / ep`` experts and routes its own ``tokens`` random
tokens, with one thread (``torch.set_num_threads(1)``: ranks sharing a laptop's cores otherwise time each other's
threads).  ``skew`` adds that much to the router's balancing bias of the first quarter of the experts (with ``ep = 4``, the
first rank's), so that the router prefers them (the gates keep their unbiased scores): ``0`` routes as the random gate does, a few units sends most
choices to one rank.  :func:`moe_run` returns this rank's median time of a forward and backward, its experts' time
and rows, the bytes it sent (the group's log) beside the cost model's for its splits, the largest difference of
its output and input gradient from one process running the whole layer on its tokens, and with ``traced`` the
spans of one more pass on a common clock (:func:`labkit.trace.gather`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from labkit import trace
from labkit.costmodel.experts import ep_messages
from labkit.parallel.experts.dispatch import ExpertParallelGroup
from labkit.parallel.experts.layer import MoE
from labkit.parallel.experts.model import apply_expert_parallel


def moe_run(n_experts: int = 8, top_k: int = 2, *, hidden: int = 64, expert_hidden: int = 256, tokens: int = 1024,
            capacity_factor: float | None = None, skew: float = 0.0, repeats: int = 3, traced: bool = False,
            seed: int = 0) -> dict[str, Any]:
    """This rank's measurements of ``repeats`` forward and backward passes (after one warm-up); see the module
    docstring.  A collective: every rank of the default group calls it with the same arguments."""
    torch.set_num_threads(1)
    ep = ExpertParallelGroup(None)
    torch.manual_seed(seed)
    reference = MoE(hidden, n_experts, top_k, expert_hidden=expert_hidden, capacity_factor=capacity_factor)
    with torch.no_grad():
        reference.router.bias[:max(1, n_experts // max(ep.size, 4))] += skew
    layer = MoE(hidden, n_experts, top_k, expert_hidden=expert_hidden, capacity_factor=capacity_factor)
    layer.load_state_dict(reference.state_dict())
    apply_expert_parallel(layer, ep)
    generator = torch.Generator().manual_seed(seed + 1 + ep.rank)
    x, dout = (torch.randn(tokens, hidden, generator=generator) for _ in range(2))

    def one_pass(module: MoE) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = x.clone().requires_grad_()
        out = module(inputs)
        torch.autograd.backward(out, dout)
        return out.detach(), inputs.grad

    found, expected = one_pass(layer), one_pass(reference)  # the warm-up, and one process on this rank's tokens
    error = max(float((a - b).abs().max()) for a, b in zip(found, expected, strict=True))
    seconds, expert_seconds = [], []
    for _ in range(repeats):
        torch.distributed.barrier()
        ep.clear()
        start = time.perf_counter()
        one_pass(layer)
        seconds.append(time.perf_counter() - start)
        expert_seconds += ep.expert_seconds
    send, receive = ep.splits[-1] if ep.splits else ([tokens * top_k], [tokens * top_k])
    row_bytes = hidden * x.element_size()
    result = {"rank": ep.rank, "seconds": statistics.median(seconds),
              "expert_seconds": statistics.median(expert_seconds) if expert_seconds else 0.0,
              "rows": sum(receive), "send": send, "receive": receive, "error": error,
              "dropped": layer.last["dropped"], "log": list(ep.log),
              "predicted": ep_messages(send, receive, ep.rank, row_bytes) if ep.size > 1 else []}
    if traced:
        trace.enable()
        one_pass(layer)
        result["spans"] = trace.gather()
        trace.disable()
    return result


# The remedies lesson 14 compares: Switch's top-1 softmax router alone and with its auxiliary loss, and DeepSeek-V3's
# sigmoid router with its bias update (gamma 0.01: DeepSeek-V3 used 0.001 over far more steps).
BALANCING = {"no balancing": {}, "auxiliary loss": {"aux_loss_weight": 0.01},
             "bias (DeepSeek-V3)": {"bias_update_rate": 0.01, "router": "sigmoid"}}


def balance_run(balancing: str = "no balancing", *, steps: int = 60, window: int = 20, n_experts: int = 8,
                top_k: int = 1, batch_size: int = 16, lr: float = 1e-2, seed: int = 0) -> dict[str, Any]:
    """One process training a ``100k`` TinyGPT whose blocks are MoE layers (top-1 by default, Switch's router) on
    the course's Markov-chain text, with one of :data:`BALANCING`'s remedies: per step, the loss and the imbalance
    (the busiest expert's assignments over the mean, in the worst MoE layer); ``late``: the same over the last
    ``window`` steps' assignments together (less sampling noise than one batch's).  The bias update runs after
    every optimizer step, from that step's load."""
    from labkit.data import MarkovChain, batches
    from labkit.models import GPTConfig, TinyGPT
    from labkit.parallel.experts.model import balance_experts

    if balancing not in BALANCING:
        raise ValueError(f"balancing must be one of {tuple(BALANCING)}, got {balancing!r}")
    torch.manual_seed(seed)
    config = GPTConfig.preset("100k", n_experts=n_experts, top_k=top_k, **BALANCING[balancing])
    model = TinyGPT(config, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    tokens = MarkovChain(seed=seed).sample(50_000, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    losses, imbalance, late = [], [], None

    def worst(loads: torch.Tensor) -> float:  # [layers, experts]
        return float((loads.max(dim=1).values / loads.mean(dim=1)).max())

    for step in range(steps):
        inputs, targets = batches(tokens, batch_size, config.block_size, generator)
        _, loss = model(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loads = torch.stack(balance_experts(model, config.bias_update_rate)).double()
        imbalance.append(worst(loads))
        losses.append(loss.item())
        if step >= steps - window:
            late = loads if late is None else late + loads
    return {"loss": losses, "imbalance": imbalance, "late": worst(late)}


def uniform_dispatch(tokens: int = 64, hidden: int = 64, n_experts: int = 8) -> list[tuple[str, str, int]]:
    """This rank's all-to-alls (the counts' left out) for routing chosen by hand to be uniform: token ``t``'s two
    choices ``2t, 2t + 1`` mod ``E``, through linear experts, forward and backward."""
    from labkit.parallel.experts.permute import route_to_experts

    ep = ExpertParallelGroup(None)
    mine = ep.experts(n_experts)
    experts = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) if e in mine else None for e in range(n_experts))
    x = torch.randn(tokens, hidden, requires_grad=True)
    ids = torch.arange(2 * tokens).remainder(n_experts).view(tokens, 2)
    out = route_to_experts(x, ids, torch.ones(tokens, 2), torch.ones(tokens, 2, dtype=torch.bool), experts, ep)
    out.sum().backward()
    return [entry for entry in ep.log if entry[1] != "counts"]
