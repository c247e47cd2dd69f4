"""Lesson 14's plots and explorer: routing as a picture, the load on each expert and rank, the all-to-alls on the
trace, the capacity factor against dropped tokens, and an explorer of experts, top-k, capacity and skew.

The conventions are ``labkit.viz.plots``': ``matplotlib.figure.Figure`` rather than ``pyplot``, nothing run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import ipywidgets as widgets
import numpy as np
import torch
from matplotlib.figure import Figure

from labkit import trace
from labkit.costmodel.experts import ep_uniform_bytes
from labkit.viz.plots import RANK_COLORS, figure_to_png
from labkit.viz.widgets import ROW, connect

RUN_COLORS = {"no balancing": "#C44E52", "auxiliary loss": "#4C72B0", "bias (DeepSeek-V3)": "#55A868"}


def plot_routing(gates: torch.Tensor, experts: torch.Tensor, kept: torch.Tensor, capacity: int | None,
                 title: str = "") -> Figure:
    """Left: each token's gate on each expert (rows tokens, columns experts; 0 where not chosen), its first choice
    dotted, its dropped choices crossed.  Right: each expert's assignments, kept and dropped, against the
    capacity."""
    n_tokens, n_experts = gates.shape
    figure = Figure(figsize=(10, 0.16 * n_tokens + 1.6))
    left, right = figure.subplots(1, 2, gridspec_kw={"width_ratios": [1.1, 1]})
    image = left.imshow(gates.detach().numpy(), cmap="Blues", aspect="auto", vmin=0, vmax=1)
    figure.colorbar(image, ax=left, label="gate weight")
    left.scatter(experts[:, 0].numpy(), np.arange(n_tokens), marker=".", color="black", s=12, label="first choice")
    rows, choices = (~kept).nonzero(as_tuple=True)
    left.scatter(experts[rows, choices].numpy(), rows.numpy(), marker="x", color="#C44E52", s=30,
                 label="dropped (over capacity)")
    left.set_xlabel("expert")
    left.set_ylabel("token")
    left.set_xticks(range(n_experts))
    left.legend(loc="lower right", fontsize=7)
    left.set_title(title or "the router's choices", fontsize=9)
    assigned = torch.bincount(experts.reshape(-1), minlength=n_experts).numpy()
    received = torch.bincount(experts[kept], minlength=n_experts).numpy()
    right.bar(range(n_experts), received, color="#4C72B0", label="computed")
    right.bar(range(n_experts), assigned - received, bottom=received, color="#C44E52", label="dropped")
    if capacity is not None:
        right.axhline(capacity, color="black", linestyle="--", linewidth=1, label=f"capacity {capacity}")
    right.set_xlabel("expert")
    right.set_ylabel("assignments (tokens x choices)")
    right.set_xticks(range(n_experts))
    right.legend(fontsize=7)
    right.set_title("load per expert", fontsize=9)
    figure.tight_layout()
    return figure


def plot_balance(imbalance: Mapping[str, Sequence[float]], losses: Mapping[str, Sequence[float]]) -> Figure:
    """Per run, the busiest expert's share over the mean (1 = balanced) and the language-model loss, step by step."""
    figure = Figure(figsize=(10, 3.4))
    left, right = figure.subplots(1, 2)
    for name, values in imbalance.items():
        left.plot(range(1, len(values) + 1), values, color=RUN_COLORS.get(name), label=name)
        right.plot(range(1, len(losses[name]) + 1), losses[name], color=RUN_COLORS.get(name), label=name)
    left.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
    left.set_xlabel("step")
    left.set_ylabel("busiest expert / mean load")
    left.set_title("load imbalance, every MoE layer's worst", fontsize=9)
    right.set_xlabel("step")
    right.set_ylabel("loss (nats)")
    right.set_title("language-model loss (the auxiliary loss left out)", fontsize=9)
    for axis in (left, right):
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    return figure


def plot_ep_trace(spans: Sequence[trace.Span], title: str = "one MoE layer over 4 ranks") -> Figure:
    """One row per rank: its experts' forward compute and the all-to-alls (counts, dispatch, combine; forward then
    backward), in ms from the first span.  The backward computation runs in the gaps (autograd, not traced)."""
    ranks = sorted({span.rank for span in spans})
    start = min(span.start_s for span in spans)
    colors = {"counts": "#F0F0F0", "dispatch": "#8C8C8C", "combine": "#C8C8C8", "ddispatch": "#8C8C8C",
              "dcombine": "#C8C8C8"}
    figure = Figure(figsize=(10.5, 0.7 * len(ranks) + 1.4))
    axis = figure.subplots()
    for row, rank in enumerate(ranks):
        for span in (s for s in spans if s.rank == rank):
            if span.name.startswith("experts"):
                color, label = RANK_COLORS[rank % len(RANK_COLORS)], span.name.split()[-1]
            elif span.name.startswith("ep all-to-all"):
                kind = span.name.split()[-1]
                color, label = colors.get(kind, "#BBBBBB"), kind
            else:
                continue
            axis.broken_barh([(1e3 * (span.start_s - start), 1e3 * span.seconds)], (row - 0.3, 0.6),
                             facecolors=color, edgecolor="black", linewidth=0.3)
            if span.seconds > 0.02 * max(s.end_s - start for s in spans):
                axis.text(1e3 * (span.start_s - start + span.seconds / 2), row, label, ha="center", va="center",
                          fontsize=6)
    axis.set_yticks(range(len(ranks)), [f"rank {rank}" for rank in ranks])
    axis.set_ylim(len(ranks) - 0.5, -0.5)
    axis.set_xlabel("time (ms)")
    axis.set_title(title + "\ncoloured: each rank's experts (forward); grey: the all-to-alls, dark the dispatch "
                           "and its gradient, light the combine and its gradient", fontsize=9)
    axis.grid(True, axis="x", alpha=0.3)
    figure.tight_layout()
    return figure


def plot_rank_work(rows: Mapping[str, Sequence[int]], seconds: Mapping[str, Sequence[float]]) -> Figure:
    """Per routing (balanced, skewed): each rank's rows received by its experts, and its measured expert time."""
    figure = Figure(figsize=(10, 3.2))
    left, right = figure.subplots(1, 2)
    width = 0.8 / len(rows)
    for index, name in enumerate(rows):
        ranks = np.arange(len(rows[name]))
        left.bar(ranks + index * width, rows[name], width, label=name)
        right.bar(ranks + index * width, [1e3 * s for s in seconds[name]], width, label=name)
    left.set_ylabel("rows its experts computed")
    right.set_ylabel("CPU time in its experts (ms, forward)")
    for axis in (left, right):
        axis.set_xlabel("rank")
        axis.set_xticks(np.arange(len(next(iter(rows.values())))) + 0.4 - width / 2,
                        range(len(next(iter(rows.values())))))
        axis.legend(fontsize=7)
        axis.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    return figure


def plot_capacity(factors: Sequence[str], dropped: Sequence[float], seconds: Sequence[float]) -> Figure:
    """Per capacity factor: the share of assignments dropped, and the layer's measured forward + backward."""
    figure = Figure(figsize=(10, 3.2))
    left, right = figure.subplots(1, 2)
    left.bar(factors, [100 * d for d in dropped], color="#C44E52")
    left.set_ylabel("assignments dropped (%)")
    right.bar(factors, [1e3 * s for s in seconds], color="#4C72B0")
    right.set_ylabel("forward + backward (ms)")
    for axis in (left, right):
        axis.set_xlabel("capacity factor")
        axis.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    return figure


def expected_load(n_experts: int, zipf: float, top_k: int = 1) -> np.ndarray:
    """A router's share of the assignments per expert when expert ``i``'s popularity is ``1 / (i + 1)^zipf`` (0:
    uniform), normalised; a token chooses ``top_k`` distinct experts, so no expert takes more than ``1 / top_k``
    of them: shares above that are capped and the excess spread over the others in proportion (water-filling)."""
    share = 1.0 / np.arange(1, n_experts + 1) ** zipf
    share /= share.sum()
    cap = 1.0 / top_k
    for _ in range(n_experts):
        over = share > cap
        if not over.any():
            break
        excess = float((share[over] - cap).sum())
        share[over] = cap
        free = ~over & (share < cap)
        share[free] += excess * share[free] / share[free].sum()
    return share


def explorer_summary(n_experts: int, top_k: int, capacity_factor: float | None, zipf: float, ep: int,
                     tokens: int = 4096, hidden: int = 4096, ffn: int = 14336) -> dict[str, float]:
    """What :func:`moe_explorer` shows, computed: dropped share, parameters per layer total and active (SwiGLU
    experts of ``hidden x ffn``, Mixtral's), each rank's expert parameters, bytes of one all-to-all under
    uniform routing and the busiest rank's rows over the mean, after the drops (a sender drops before it sends)."""
    load = tokens * top_k * expected_load(n_experts, zipf, top_k)
    capacity = math.inf if capacity_factor is None else math.ceil(capacity_factor * tokens * top_k / n_experts)
    kept = np.minimum(load, capacity)
    dropped = float((load - kept).sum() / (tokens * top_k))
    expert = 3 * hidden * ffn
    per_rank = kept.reshape(ep, -1).sum(axis=1)
    return {"dropped": dropped, "total": n_experts * expert, "active": top_k * expert,
            "per_rank": n_experts // ep * expert, "a2a": ep_uniform_bytes(tokens, top_k, hidden, 2, ep),
            "busiest": float(per_rank.max() / per_rank.mean()), "capacity": capacity}


def plot_explorer(n_experts: int, top_k: int, capacity_factor: float | None, zipf: float, ep: int,
                  tokens: int = 4096) -> Figure:
    """Each expert's expected assignments under the skewed router (ranks coloured), the capacity, what drops."""
    load = tokens * top_k * expected_load(n_experts, zipf, top_k)
    summary = explorer_summary(n_experts, top_k, capacity_factor, zipf, ep, tokens)
    figure = Figure(figsize=(9.5, 3.4))
    axis = figure.subplots()
    local = n_experts // ep
    colors = [RANK_COLORS[(e // local) % len(RANK_COLORS)] for e in range(n_experts)]
    kept = np.minimum(load, summary["capacity"])
    for rank in range(ep):
        held = range(rank * local, (rank + 1) * local)
        axis.bar(held, kept[held.start:held.stop], color=colors[held.start], width=0.9, label=f"rank {rank}"
                 if ep <= 8 else None)
    axis.bar(range(n_experts), load - kept, bottom=kept, color="white", edgecolor="black", hatch="///", width=0.9,
             label="dropped")
    if math.isfinite(summary["capacity"]):
        axis.axhline(summary["capacity"], color="black", linestyle="--", linewidth=1,
                     label=f"capacity {summary['capacity']:.0f}")
    axis.set_xlabel(f"expert (colour: the rank holding it, ep = {ep})")
    axis.set_ylabel(f"assignments of {tokens:,} tokens x {top_k}")
    axis.set_title(f"{summary['dropped']:.1%} of the assignments dropped; the busiest rank receives "
                   f"{summary['busiest']:.2f}x the mean (after the drops)", fontsize=9)
    axis.legend(fontsize=7, ncol=2)
    axis.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    return figure


def moe_explorer(n_experts: int = 8, top_k: int = 2, capacity_factor: str = "1.25", zipf: float = 0.5,
                 ep: int = 4) -> widgets.VBox:
    """Choose the experts, top-k, the capacity factor, the router's skew (a Zipf exponent) and ep: each expert's
    load and what is dropped, the parameters total and active, each rank's share and one all-to-all's bytes (a
    Mixtral-sized layer: 4,096 tokens of 4,096 values in bf16, SwiGLU experts 14,336 wide)."""
    experts = widgets.Dropdown(options=[4, 8, 16, 32, 64], value=n_experts, description="experts")
    k = widgets.IntSlider(value=top_k, min=1, max=8, description="top-k")
    factor = widgets.Dropdown(options=["none", "0.5", "1.0", "1.25", "2.0"], value=capacity_factor,
                              description="capacity")
    bias = widgets.FloatSlider(value=zipf, min=0.0, max=2.0, step=0.1, description="skew (Zipf)")
    ranks = widgets.Dropdown(options=[1, 2, 4, 8], value=ep, description="ep")
    picture, summary = widgets.Image(format="png"), widgets.HTML()

    def redraw() -> None:
        e, top, r = experts.value, min(k.value, experts.value), ranks.value
        cf = None if factor.value == "none" else float(factor.value)
        picture.value = figure_to_png(plot_explorer(e, top, cf, bias.value, r))
        numbers = explorer_summary(e, top, cf, bias.value, r)
        summary.value = (f"<small>top-{top} of {e} experts: {numbers['total'] / 1e9:.2f}B expert parameters a "
                         f"layer, {numbers['active'] / 1e9:.2f}B of them per token ({top / e:.0%}); each of ep={r} "
                         f"ranks holds {numbers['per_rank'] / 1e9:.2f}B. One all-to-all sends "
                         f"{numbers['a2a'] / 2**20:.1f} MiB a rank under uniform routing (four a layer: dispatch, "
                         f"combine, and both again in backward); {numbers['dropped']:.1%} of the assignments "
                         f"are dropped.</small>")

    controls = (experts, k, factor, bias, ranks)
    connect(controls, redraw)
    return widgets.VBox([widgets.HBox(list(controls), layout=ROW), summary, picture])
