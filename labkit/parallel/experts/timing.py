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

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

from labkit import trace
from labkit.claims import Band
from labkit.costmodel.experts import ep_messages
from labkit.parallel.experts.dispatch import ExpertParallelGroup
from labkit.parallel.experts.layer import MoE
from labkit.parallel.experts.model import apply_expert_parallel


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the block with one torch thread, then restore the count: two threads on a busy 2-core machine spin
    waiting for each other (lesson 14's three balancing runs took 570 s beside other work, against 15 s on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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
                top_k: int = 1, batch_size: int = 16, lr: float = 1e-2, seed: int = 0,
                z_loss_weight: float = 0.0) -> dict[str, Any]:
    """One process training a ``100k`` TinyGPT whose blocks are MoE layers (top-1 by default, Switch's router) on
    the course's Markov-chain text, with one of :data:`BALANCING`'s remedies.  Per step: the loss, the imbalance
    (the busiest expert's assignments over the mean, in the worst MoE layer), ``windowed`` (the same over the
    last ``window`` steps' assignments together) and ``z`` (the layers' mean router z-loss).  Over the last
    ``window`` steps: ``late`` (their assignments together), ``per_step`` (the mean of each step's imbalance: what
    an all-to-all waits for) and ``switches`` (the share of steps whose busiest expert differs from the step
    before's, over the layers).  The bias update runs after every optimizer step, from that step's load.
    One torch thread (:func:`one_thread`)."""
    if balancing not in BALANCING:
        raise ValueError(f"balancing must be one of {tuple(BALANCING)}, got {balancing!r}")
    with one_thread():
        return _balance(balancing, steps, window, n_experts, top_k, batch_size, lr, seed, z_loss_weight)


def _balance(balancing: str, steps: int, window: int, n_experts: int, top_k: int, batch_size: int, lr: float,
             seed: int, z_loss_weight: float) -> dict[str, Any]:
    from labkit.data import MarkovChain, batches
    from labkit.models import GPTConfig, TinyGPT
    from labkit.parallel.experts.layer import moe_layers
    from labkit.parallel.experts.model import balance_experts

    torch.manual_seed(seed)
    config = GPTConfig.preset("100k", n_experts=n_experts, top_k=top_k, z_loss_weight=z_loss_weight,
                              **BALANCING[balancing])
    model = TinyGPT(config, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    tokens = MarkovChain(seed=seed).sample(50_000, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    losses, history, z = [], [], []

    def worst(loads: torch.Tensor) -> float:  # [layers, experts]
        return float((loads.max(dim=1).values / loads.mean(dim=1)).max())

    for _ in range(steps):
        inputs, targets = batches(tokens, batch_size, config.block_size, generator)
        _, loss = model(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        history.append(torch.stack(balance_experts(model, config.bias_update_rate)).double())
        losses.append(loss.item())
        z.append(statistics.mean(layer.last["z_loss"] for layer in moe_layers(model)))
    last = torch.stack(history[-window:])  # [window, layers, experts]
    busiest = last.argmax(dim=-1)  # [window, layers]
    return {"loss": losses, "imbalance": [worst(loads) for loads in history],
            "windowed": [worst(sum(history[max(0, i - window + 1):i + 1])) for i in range(steps)],
            "late": worst(last.sum(dim=0)), "per_step": statistics.mean(worst(loads) for loads in last),
            "switches": float((busiest[1:] != busiest[:-1]).double().mean()), "z": z}


# How lesson 14 holds its two timings to their models, here so that tests/test_experts.py shows each band fails on
# the rivals it names.  CAPACITY_BAND: a capacity factor's time over the unlimited layer's against the model (the
# experts' share of what is dropped saved); at C = 0.5 the rivals, time in proportion to the rows (about 0.75x of
# the model) and drops that save nothing (about 1.5x), fall outside.  PADDING_BAND: the padded batch's time over the
# grouped GEMM's against the rows each computes; padding that cost nothing (1.0 over a ratio of about 1.75) outside.
CAPACITY_BAND = Band(0.8, 1.15, "the model's slack: the gathers and sums around the experts shrink with the rows "
                     "too; 6 runs on the reference machine (2 cores, a load of 9 to 12 beside it) gave 0.91x-1.07x of "
                     "the model at every factor, a CI run 0.85x at C = 0.5")
PADDING_BAND = Band(0.75, 1.4, "both are one product over the rows they compute; 7 runs on the reference machine "
                    "(2 cores, a load of 8 to 10 beside it) gave 0.83x-1.18x of the rows' ratio")


def capacity_run(factors: list[float | None], *, tokens: int = 4096, skew: float = 0.06, rounds: int = 9,
                 expert_hidden: int = 128, seed: int = 0) -> dict[str, Any]:
    """Lesson 14's capacity factors on one process, one thread: a layer of 8 experts (64 wide, ``expert_hidden``
    inside), top-2, its router biased by ``skew`` towards experts 0 and 1; the last factor is the reference (no
    limit).  Per factor: the share of choices dropped, the median forward and backward (``seconds``), and the
    median over the rounds of its time over the reference's in the same round (``ratios``).  Every factor is
    timed once a round, so that a machine growing busier slows them all alike, each timed pass after an untimed
    one of the same layer (the CPU time of the allocator's page faults otherwise depends on which layer ran before).

    The model: the experts' time grows with the rows they compute, the rest of the layer does not change, so a
    factor dropping a share ``d`` takes ``1 - d x share`` of the reference's time, ``share`` (``experts_share``)
    the experts alone on the reference's rows over the reference layer, forward and backward, in the same round."""
    from labkit.parallel.experts.permute import dispatch_order, run_experts

    with one_thread():
        layers, x = [], torch.randn(tokens, 64, generator=torch.Generator().manual_seed(seed + 5))
        for factor in factors:
            torch.manual_seed(seed)
            layer = MoE(64, 8, 2, expert_hidden=expert_hidden, capacity_factor=factor)
            with torch.no_grad():
                layer.router.bias[:2] += skew
            layer(x).sum().backward()  # a warm-up
            layers.append(layer)
        with torch.no_grad():
            ids = layers[-1].router(x).experts.reshape(-1)
        rows = x[dispatch_order(ids, 8, 1) // 2]
        counts = torch.bincount(ids, minlength=8).tolist()

        def experts() -> None:  # as in the layer: the tokens need no gradient, the experts' weights do
            run_experts(rows, counts, layers[-1].experts, 0).sum().backward()

        passes = [lambda layer=layer: layer(x).sum().backward() for layer in layers] + [experts]
        seconds: list[list[float]] = [[] for _ in passes]
        for _ in range(rounds):
            for index, one_pass in enumerate(passes):
                one_pass()  # untimed: the allocator holds this size's buffers again
                start = time.thread_time()
                one_pass()
                seconds[index].append(time.thread_time() - start)
    reference = seconds[len(layers) - 1]
    return {"dropped": [layer.last["dropped"] / (tokens * 2) for layer in layers],
            "seconds": [statistics.median(runs) for runs in seconds[:-1]],
            "ratios": [statistics.median(a / b for a, b in zip(runs, reference, strict=True)) for runs in seconds[:-1]],
            "experts_share": statistics.median(a / b for a, b in zip(seconds[-1], reference, strict=True)),
            "loads": counts}


def expert_forms_run(*, tokens: int = 4096, skew: float = 0.06, block: int = 128, rounds: int = 5,
                     seed: int = 0) -> dict[str, Any]:
    """The same layer's experts on the same routed rows in each of ``labkit.parallel.experts.grouped``'s forms,
    one thread: rows computed (padding included), the largest difference from the loop, the median forward and
    backward over ``rounds`` rounds (each form once a round, after an untimed pass of its own), and the median
    over the rounds of each form's time over the grouped GEMM's in the same round (``ratios``)."""
    from labkit.parallel.experts.grouped import FORMS, computed_rows, expert_forward
    from labkit.parallel.experts.permute import dispatch_order

    with one_thread():
        torch.manual_seed(seed)
        layer = MoE(64, 8, 2, expert_hidden=256)
        with torch.no_grad():
            layer.router.bias[:2] += skew
        x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(seed + 5))
        with torch.no_grad():
            ids = layer.router(x).experts.reshape(-1)
        rows = x[dispatch_order(ids, 8, 1) // 2]
        counts = torch.bincount(ids, minlength=8).tolist()
        dout = torch.randn(rows.shape, generator=torch.Generator().manual_seed(seed + 6))
        with torch.no_grad():
            reference = expert_forward(rows, counts, layer.experts, "loop")
        error, seconds = {}, {form: [] for form in FORMS}
        for _ in range(rounds):
            for form in FORMS:
                for timed in (False, True):  # an untimed pass first: the allocator holds this form's buffers
                    inputs = rows.clone().requires_grad_()
                    start = time.thread_time()
                    out = expert_forward(inputs, counts, layer.experts, form, block)
                    out.backward(dout)
                    if timed:
                        seconds[form].append(time.thread_time() - start)
                error[form] = float((out.detach() - reference).abs().max())
    return {"counts": counts, "rows": {form: computed_rows(counts, form, block) for form in FORMS},
            "error": error, "seconds": {form: statistics.median(runs) for form, runs in seconds.items()},
            "ratios": {form: statistics.median(a / b for a, b in zip(runs, seconds["grouped"], strict=True))
                       for form, runs in seconds.items()}}


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
