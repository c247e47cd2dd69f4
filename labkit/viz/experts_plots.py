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
from matplotlib.patches import Patch

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
    # legends above the axes, beside the data rather than on it
    left.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=2, fontsize=8, frameon=False)
    left.set_title(title or "the router's choices", fontsize=9, pad=24)
    assigned = torch.bincount(experts.reshape(-1), minlength=n_experts).numpy()
    received = torch.bincount(experts[kept], minlength=n_experts).numpy()
    right.bar(range(n_experts), received, color="#4C72B0", label="computed")
    right.bar(range(n_experts), assigned - received, bottom=received, color="#C44E52", label="dropped")
    if capacity is not None:
        right.axhline(capacity, color="black", linestyle="--", linewidth=1, label=f"capacity {capacity}")
    right.set_xlabel("expert")
    right.set_ylabel("assignments (tokens x choices)")
    right.set_xticks(range(n_experts))
    right.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=3, fontsize=8, frameon=False)
    right.set_title("load per expert", fontsize=9, pad=24)
    figure.tight_layout()
    return figure


def plot_balance(imbalance: Mapping[str, Sequence[float]], windowed: Mapping[str, Sequence[float]],
                 losses: Mapping[str, Sequence[float]], floor: float | None = None, window: int = 20) -> Figure:
    """Per run, step by step: the busiest expert's load over the mean in each step's batch (thin) and in the last
    ``window`` steps' batches together (thick, dashed), ``floor`` the first for a router spreading the tokens
    uniformly at random; right, the language-model loss."""
    figure = Figure(figsize=(10, 4.3))
    left, right = figure.subplots(1, 2)
    for name, values in imbalance.items():
        color = RUN_COLORS.get(name)
        left.plot(range(1, len(values) + 1), values, color=color, linewidth=0.9, label=f"{name}: each step")
        left.plot(range(1, len(windowed[name]) + 1), windowed[name], color=color, linewidth=2.2, linestyle="--",
                  label=f"{name}: last {window} steps together")
        right.plot(range(1, len(losses[name]) + 1), losses[name], color=color, label=name)
    if floor is not None:
        left.axhline(floor, color="black", linewidth=1, linestyle=":", label=f"uniform random router: {floor:.2f}")
    left.set_xlabel("step")
    left.set_ylabel("busiest expert / mean load")
    left.set_title("load imbalance, the worst of the 4 MoE layers", fontsize=9)
    left.set_yscale("log")
    left.set_yticks([1, 1.5, 2, 3, 4, 6, 8], ["1", "1.5", "2", "3", "4", "6", "8"])
    right.set_xlabel("step")
    right.set_ylabel("loss (nats)")
    right.set_title("language-model loss (the auxiliary loss left out)", fontsize=9)
    for axis in (left, right):
        axis.grid(True, alpha=0.3)
    handles, labels = left.get_legend_handles_labels()  # below both panels: the colours are the runs in each
    figure.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0.17, 1, 1))
    return figure


def plot_z_loss(z: Mapping[str, Sequence[float]]) -> Figure:
    """Per run, the router z-loss (the mean over the MoE layers of ``mean_t logsumexp(logits)^2``), step by step."""
    figure = Figure(figsize=(6.5, 2.8))
    axis = figure.subplots()
    for name, values in z.items():
        axis.plot(range(1, len(values) + 1), values, label=name)
    axis.set_xlabel("step")
    axis.set_ylabel("router z-loss (nats squared)")
    axis.set_title("the router's log-partition, squared", fontsize=9)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    return figure


def plot_ep_trace(spans: Sequence[trace.Span], title: str = "one MoE layer over 4 ranks") -> Figure:
    """One row per rank: its experts' forward and backward compute and the all-to-alls (counts, dispatch, combine;
    forward then backward), in ms from the first span.  What is not drawn (the router, the permutation, the
    gradients of the gather and of the gates) runs in the gaps."""
    ranks = sorted({span.rank for span in spans})
    start = min(span.start_s for span in spans)
    end = max(span.end_s for span in spans)
    colors = {"counts": "#F0F0F0", "dispatch": "#8C8C8C", "combine": "#C8C8C8", "ddispatch": "#8C8C8C",
              "dcombine": "#C8C8C8"}
    figure = Figure(figsize=(10.5, 0.85 * len(ranks) + 2.3))
    axis = figure.subplots()
    for row, rank in enumerate(ranks):
        for span in (s for s in spans if s.rank == rank):
            hatch = None
            if span.name.startswith("experts"):
                backward = span.name.endswith("backward")
                color = RANK_COLORS[rank % len(RANK_COLORS)]
                label = span.name.split()[1] + (" bwd" if backward else " fwd")
                hatch = "///" if backward else None
            elif span.name.startswith("ep all-to-all"):
                label = span.name.split()[-1]
                color = colors.get(label, "#BBBBBB")
            else:
                continue
            axis.broken_barh([(1e3 * (span.start_s - start), 1e3 * span.seconds)], (row - 0.32, 0.64),
                             facecolors=color, edgecolor="black", linewidth=0.4, hatch=hatch,
                             alpha=0.6 if hatch else 1.0)
            if span.seconds > 0.011 * len(label) * (end - start):  # room for the label at this size
                axis.text(1e3 * (span.start_s - start + span.seconds / 2), row, label, ha="center", va="center",
                          fontsize=9)
    axis.set_yticks(range(len(ranks)), [f"rank {rank}" for rank in ranks])
    axis.set_ylim(len(ranks) - 0.5, -0.5)
    axis.set_xlabel("time (ms)")
    axis.set_title(title, fontsize=9)
    key = [Patch(facecolor=colors["counts"], edgecolor="black", label="counts"),
           Patch(facecolor=colors["dispatch"], edgecolor="black", label="dispatch; backward: ddispatch"),
           Patch(facecolor=colors["combine"], edgecolor="black", label="combine; backward: dcombine"),
           Patch(facecolor="white", edgecolor="black", label="a rank's experts, forward (its colour)"),
           Patch(facecolor="white", edgecolor="black", hatch="///", label="its experts' backward")]
    axis.legend(handles=key, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=8, frameon=False)
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


def plot_capacity(factors: Sequence[str], dropped: Sequence[float], relative: Sequence[float],
                  predicted: Sequence[float] | None = None) -> Figure:
    """Per capacity factor: the share of assignments dropped, and the layer's measured forward + backward over the
    unlimited layer's (``relative``) beside the model's (``predicted``)."""
    figure = Figure(figsize=(10, 3.3))
    left, right = figure.subplots(1, 2)
    left.bar(factors, [100 * d for d in dropped], color="#C44E52")
    left.set_ylabel("assignments dropped (%)")
    right.bar(factors, relative, color="#4C72B0", label="measured (CPU time, one thread)")
    if predicted is not None:
        right.scatter(factors, predicted, color="black", marker="_", s=900, linewidths=2, zorder=3,
                      label="model: 1 - (experts' share of the time) x (share dropped)")
        right.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0.0, 1.0), frameon=False, markerscale=0.35)
    right.set_ylabel("forward + backward / no limit's")
    for axis in (left, right):
        axis.set_xlabel("capacity factor")
        axis.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    return figure


def plot_expert_forms(rows: Mapping[str, int], seconds: Mapping[str, float], needed: int) -> Figure:
    """Per way of running the experts (labkit.parallel.experts.grouped): the rows computed, padding included,
    against the rows the router asked for, and the measured forward + backward."""
    figure = Figure(figsize=(10, 3.2))
    left, right = figure.subplots(1, 2)
    names = list(rows)
    left.bar(names, [rows[name] for name in names], color="#8172B2")
    left.axhline(needed, color="black", linestyle="--", linewidth=1, label=f"rows routed: {needed:,}")
    left.set_ylabel("rows computed (padding included)")
    left.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0.0, 1.0), frameon=False)
    right.bar(names, [1e3 * seconds[name] for name in names], color="#4C72B0")
    right.set_ylabel("forward + backward (ms, CPU time)")
    for axis in (left, right):
        axis.set_xlabel("how the experts run")
        axis.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    return figure


def plot_placement(loads: Sequence[Sequence[float]], placements: Sequence[Sequence[Sequence[int]]],
                   gpus_per_node: int) -> Figure:
    """Per layer: each GPU's load, stacked by the expert copies it holds (each labelled with its expert), beside
    the mean and the heaviest expert's whole load (what a GPU holding it without a copy elsewhere would carry)."""
    figure = Figure(figsize=(10, 3.4))
    axes = figure.subplots(1, len(placements), squeeze=False)[0]
    for layer, (axis, placement) in enumerate(zip(axes, placements, strict=True)):
        copies = [0] * len(loads[layer])
        for gpu in placement:
            for expert in gpu:
                copies[expert] += 1
        for index, gpu in enumerate(placement):
            bottom = 0.0
            for expert in gpu:
                share = loads[layer][expert] / copies[expert]
                axis.bar(index, share, bottom=bottom, color=RANK_COLORS[expert % len(RANK_COLORS)],
                         edgecolor="black", linewidth=0.5, hatch="//" if copies[expert] > 1 else None)
                if share > 0.06 * max(loads[layer]):  # a label that fits its segment
                    axis.text(index, bottom + share / 2, str(expert), ha="center", va="center", fontsize=8)
                bottom += share
        mean = sum(loads[layer]) / len(placement)
        axis.axhline(mean, color="black", linestyle=":", linewidth=1, label=f"mean {mean:.1f}")
        axis.axhline(max(loads[layer]), color="#C44E52", linestyle="--", linewidth=1,
                     label=f"heaviest expert {max(loads[layer]):.0f}")
        for boundary in range(gpus_per_node, len(placement), gpus_per_node):
            axis.axvline(boundary - 0.5, color="grey", linewidth=1)
        axis.set_xticks(range(len(placement)))
        axis.set_xlabel(f"GPU ({gpus_per_node} a node; hatched: an expert with copies)")
        axis.set_ylabel("tokens")
        axis.set_title(f"layer {layer}: each GPU's expert copies", fontsize=9)
        axis.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0.0, 1.06), ncol=2, frameon=False)
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
