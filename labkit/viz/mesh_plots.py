"""Plots of lesson 10 (3D parallelism): where the ranks of a ``(pp, dp, tp)`` mesh sit, and what each holds.

Two questions decide a 3D layout.  **Which links does each group use?**  ``torchrun`` numbers the ranks node by
node, ``gpus_per_node`` consecutive ranks to a node, and labkit's :class:`~labkit.mesh.Mesh` puts global rank
``r = (i_pp * dp + i_dp) * tp + i_tp`` (Megatron-LM's order: tp innermost, pp outermost).  A group whose ranks
share a node talks over NVLink (hundreds of GB/s per GPU); one that spans nodes waits on InfiniBand, several
times slower.  :func:`group_links` works that out for every dimension and :func:`plot_mesh` draws it.  **Does
it fit?**  :func:`memory_choices` prices layouts of one model on one GPU count with the analytical model of
``labkit.costmodel.memory``, and :func:`plot_memory_choices` stacks the bytes against the device's memory.
:func:`plot_layout` puts the two in one picture (the lesson's explorer), and :func:`plot_step_parts` draws a traced
3D step per rank (``labkit.parallel.parallelize.step_breakdown``) beside a model of it.

The conventions are ``labkit.viz.plots``': data in, ``matplotlib.figure.Figure`` out, nothing run, no process
group.  Memory is drawn in GiB (2^30 bytes); device memory is quoted as vendors quote it, in GB (1e9 bytes),
so an "80 GB" GPU is a line at 74.5 GiB.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import numpy
from matplotlib import patches as matplotlib_patches
from matplotlib import path as matplotlib_path
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from labkit.costmodel.memory import TransformerShape, activation_bytes, memory_per_rank, num_parameters
from labkit.mesh import _check_degrees, mesh_coordinates, mesh_groups

# BERT-large as Devlin et al. 2019 ("BERT: Pre-training of Deep Bidirectional Transformers for Language
# Understanding", section 3, "Model Architecture") give it: L = 24 layers, H = 1024, A = 16 heads, 340M
# parameters; 512-token sequences (section A.2) and the 30,522-token WordPiece vocabulary of the released
# models.  Built here as our decoder-style shape (learned positions, tied output embedding, a 4H GELU MLP):
# BERT's extra pieces (segment embeddings, pooler, the masked-LM head's transform) are not counted.
BERT_LARGE = TransformerShape(num_layers=24, hidden_size=1024, num_heads=16, seq_len=512, vocab_size=30522)

DIM_COLORS = {"tp": "#0072B2", "dp": "#009E73", "pp": "#D55E00"}  # Okabe & Ito: blue, bluish green, vermillion
DIM_NAMES = {"tp": "TP", "dp": "DP", "pp": "PP"}
DIM_LETTERS = {"tp": "t", "dp": "d", "pp": "p"}
OUTLINE_PADS = {"tp": 0.035, "dp": 0.075, "pp": 0.115}  # nested, so a rank in all three groups shows all three
LINK_BENDS = {"tp": 0.0, "dp": 0.3, "pp": -0.3}  # how far each dimension's links bow out, in data units
LINKS = {"intra-node": "inside a node (NVLink)", "inter-node": "across nodes (InfiniBand)"}
MEMORY_PARTS = {"weights": ("weights", "#4C72B0"), "gradients": ("gradients", "#DD8452"),
                "optimizer_states": ("optimizer states", "#55A868"), "activations": ("activations", "#8172B3")}
GIB = 2**30

# The drawing of plot_mesh, in data units; one unit is INCHES_PER_UNIT on the page, whatever the world size,
# so 64 ranks get a bigger figure rather than smaller boxes.
BOX_WIDTH, BOX_HEIGHT, SLOT_PITCH_X, SLOT_PITCH_Y = 1.0, 0.72, 1.18, 0.98
NODE_PAD, NODE_LABEL, NODE_GAP, LINK_ROOM = 0.22, 0.34, 0.45, 0.35  # LINK_ROOM: above and below, for links
SLOTS_PER_ROW, SLOT_COLUMNS_PER_FIGURE = 8, 16
INCHES_PER_UNIT, RANK_FONTSIZE, MIN_PAGE_WIDTH = 0.72, 6.5, 8.5  # inches, points, inches


def _check_gpus_per_node(gpus_per_node: object) -> int:
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be an integer >= 1, got {gpus_per_node!r}")
    return gpus_per_node


def group_links(dp: int, tp: int, pp: int, gpus_per_node: int = 8) -> dict[str, str]:
    """For ``"tp"``, ``"dp"`` and ``"pp"``: ``"intra-node"`` when every group of that dimension lies inside one
    node of ``gpus_per_node`` consecutive ranks, ``"inter-node"`` when at least one group spans nodes (a
    collective runs at the speed of its slowest link, and a step waits for its slowest group).

    A dimension of degree 1 has one-rank groups, trivially inside a node.  With 8 GPUs a node, tp ``<= 8``
    keeps TP on NVLink (when 8 is a multiple of tp), while pp is the first dimension pushed across nodes.
    """
    degrees = _check_degrees(dp, tp, pp)
    _check_gpus_per_node(gpus_per_node)
    world_size = degrees["dp"] * degrees["tp"] * degrees["pp"]
    groups = mesh_groups(world_size, dp=dp, tp=tp, pp=pp)
    return {dim: "intra-node" if all(len({rank // gpus_per_node for rank in group}) == 1 for group in groups[dim])
            else "inter-node" for dim in ("tp", "dp", "pp")}


def _link_label(dim: str, degree: int, link: str, group: list[int] | None, gpus_per_node: int) -> str:
    """The legend's line for one dimension: which link its groups use, and the highlighted rank's group."""
    name = f"{DIM_NAMES[dim]} ({DIM_LETTERS[dim]} = {degree})"
    if degree == 1:
        return f"{name}: one rank per group, nothing sent"
    text = f"{name}: {LINKS[link]}"
    if group is not None:
        text += f"; this group: ranks {_ranks_text(group)}"
        if link == "inter-node" and len({rank // gpus_per_node for rank in group}) == 1:
            text += " (inside one node, but other groups span nodes)"
    return text


def _ranks_text(group: list[int]) -> str:
    return str(group) if len(group) <= 10 else f"[{group[0]}, {group[1]}, …, {group[-1]}] ({len(group)} ranks)"


def plot_mesh(dp: int, tp: int, pp: int, gpus_per_node: int = 8, highlight_rank: int | None = 0) -> Figure:
    """The ``dp * tp * pp`` ranks as boxes inside their nodes, and the three groups of ``highlight_rank``.

    Each box is a GPU, labelled with its global rank and its ``(pp, dp, tp)`` coordinates; a rounded frame
    holds each node's ``gpus_per_node`` consecutive ranks (dashed slots: GPUs of the last node no rank uses).
    The TP, DP and PP groups of ``highlight_rank`` are outlined in their colours and joined by links (PP's are
    arrows, stage to stage, since the pipeline only sends point to point; TP's and DP's all-reduces join every
    member).  The legend says, for each dimension, whether its groups stay inside a node or cross nodes, from
    :func:`group_links`.  ``highlight_rank=None`` draws the layout alone.
    """
    degrees = _check_degrees(dp, tp, pp)
    _check_gpus_per_node(gpus_per_node)
    world_size = dp * tp * pp
    if highlight_rank is not None and (isinstance(highlight_rank, bool) or not isinstance(highlight_rank, int)
                                       or not 0 <= highlight_rank < world_size):
        raise ValueError(f"highlight_rank must be None or a rank in 0..{world_size - 1}, got {highlight_rank!r}")
    coordinates = mesh_coordinates(world_size, dp=dp, tp=tp, pp=pp)
    links = group_links(dp, tp, pp, gpus_per_node)
    num_nodes = math.ceil(world_size / gpus_per_node)
    slot_columns = min(gpus_per_node, SLOTS_PER_ROW)
    slot_rows = math.ceil(gpus_per_node / slot_columns)
    node_columns = max(1, min(num_nodes, SLOT_COLUMNS_PER_FIGURE // slot_columns))
    node_rows = math.ceil(num_nodes / node_columns)
    node_width = slot_columns * SLOT_PITCH_X - (SLOT_PITCH_X - BOX_WIDTH) + 2 * NODE_PAD
    node_height = slot_rows * SLOT_PITCH_Y - (SLOT_PITCH_Y - BOX_HEIGHT) + 2 * NODE_PAD + NODE_LABEL
    width = node_columns * node_width + (node_columns - 1) * NODE_GAP
    height = node_rows * node_height + (node_rows - 1) * NODE_GAP
    drawn_height = height + 2 * LINK_ROOM

    def centre(slot: int) -> tuple[float, float]:
        """Where GPU ``slot`` (= global rank, for used slots) sits: nodes left to right, then down."""
        node, local = divmod(slot, gpus_per_node)
        left = (node % node_columns) * (node_width + NODE_GAP) + NODE_PAD
        top = height - (node // node_columns) * (node_height + NODE_GAP) - NODE_PAD - NODE_LABEL
        return (left + (local % slot_columns) * SLOT_PITCH_X + BOX_WIDTH / 2,
                top - (local // slot_columns) * SLOT_PITCH_Y - BOX_HEIGHT / 2)

    legend_lines = 4
    margin_top, margin_bottom, margin_side = 0.75, 0.35 + 0.2 * legend_lines, 0.2
    page_width = max(width * INCHES_PER_UNIT + 2 * margin_side, MIN_PAGE_WIDTH)
    page_height = drawn_height * INCHES_PER_UNIT + margin_top + margin_bottom
    figure = Figure(figsize=(page_width, page_height))
    axis = figure.add_axes(((1 - width * INCHES_PER_UNIT / page_width) / 2, margin_bottom / page_height,
                            width * INCHES_PER_UNIT / page_width, drawn_height * INCHES_PER_UNIT / page_height))
    axis.set_xlim(0, width)
    axis.set_ylim(-LINK_ROOM, height + LINK_ROOM)
    axis.set_axis_off()

    for node in range(num_nodes):
        left = (node % node_columns) * (node_width + NODE_GAP)
        bottom = height - (node // node_columns) * (node_height + NODE_GAP) - node_height
        axis.add_patch(matplotlib_patches.FancyBboxPatch(
            (left, bottom), node_width, node_height, boxstyle="round,pad=0,rounding_size=0.15",
            facecolor="#F4F4F4", edgecolor="#555555", linewidth=1.0, zorder=0, gid=f"node {node}"))
        used = min(gpus_per_node, world_size - node * gpus_per_node)
        axis.text(left + NODE_PAD, bottom + node_height - NODE_LABEL / 2 - 0.04,
                  f"node {node}" + (f" ({used} of {gpus_per_node} GPUs used)" if used < gpus_per_node else ""),
                  ha="left", va="center", fontsize=8, fontweight="bold", color="#333333")
    for slot in range(num_nodes * gpus_per_node):
        x, y = centre(slot)
        corner = (x - BOX_WIDTH / 2, y - BOX_HEIGHT / 2)
        if slot >= world_size:
            axis.add_patch(matplotlib_patches.Rectangle(corner, BOX_WIDTH, BOX_HEIGHT, facecolor="none",
                                                        edgecolor="#AAAAAA", linestyle="--", linewidth=0.7,
                                                        zorder=2, gid="unused GPU"))
            continue
        coords = coordinates[slot]
        axis.add_patch(matplotlib_patches.Rectangle(
            corner, BOX_WIDTH, BOX_HEIGHT, facecolor="white", edgecolor="black",
            linewidth=1.6 if slot == highlight_rank else 0.7, zorder=2, gid=f"rank {slot}"))
        axis.text(x, y, f"rank {slot}\n({coords['pp']}, {coords['dp']}, {coords['tp']})", ha="center",
                  va="center", fontsize=RANK_FONTSIZE, linespacing=1.3, zorder=4, gid=f"rank {slot} label",
                  bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none"},
                  fontweight="bold" if slot == highlight_rank else "normal")

    groups = mesh_groups(world_size, dp=dp, tp=tp, pp=pp)
    highlighted: dict[str, list[int] | None] = {dim: None for dim in ("tp", "dp", "pp")}
    if highlight_rank is not None:
        for dim in ("tp", "dp", "pp"):
            group = next(group for group in groups[dim] if highlight_rank in group)
            highlighted[dim] = group
            if len(group) > 1:
                _draw_group(axis, dim, [centre(rank) for rank in group])
    handles = [Line2D([], [], color=DIM_COLORS[dim], linewidth=2.2, marker=">" if dim == "pp" else None,
                      label=_link_label(dim, degrees[dim], links[dim], highlighted[dim], gpus_per_node))
               for dim in ("tp", "dp", "pp")]
    figure.legend(handles=handles, loc="lower left", bbox_to_anchor=(margin_side / page_width, 0.02),
                  fontsize=8, frameon=False,
                  title=None if highlight_rank is None else f"the groups of rank {highlight_rank}, "
                                                            "and the links each dimension's groups use",
                  title_fontsize=8, alignment="left")
    figure.suptitle(f"{world_size} ranks as dp = {dp}, tp = {tp}, pp = {pp} on {num_nodes} node"
                    f"{'s' if num_nodes > 1 else ''} of {gpus_per_node} GPUs\n"
                    "each box: the global rank and its (pp, dp, tp) coordinates, "
                    "rank = (i_pp · dp + i_dp) · tp + i_tp", fontsize=9,
                    y=1 - 0.08 / page_height, va="top")
    return figure


def _draw_group(axis, dim: str, centres: list[tuple[float, float]]) -> None:
    """Outline each member's box in the dimension's colour and link consecutive members (PP: arrows, in stage
    order).  A link bows out (DP's one way, PP's the other), far enough to clear the boxes between two
    members of one row; it runs over the boxes it crosses, under their labels."""
    color, pad = DIM_COLORS[dim], OUTLINE_PADS[dim]
    for x, y in centres:
        axis.add_patch(matplotlib_patches.Rectangle((x - BOX_WIDTH / 2 - pad, y - BOX_HEIGHT / 2 - pad),
                                                    BOX_WIDTH + 2 * pad, BOX_HEIGHT + 2 * pad, facecolor="none",
                                                    edgecolor=color, linewidth=1.8, zorder=3,
                                                    gid=f"{dim} group"))
    half_width, half_height = BOX_WIDTH / 2 + pad, BOX_HEIGHT / 2 + pad
    for start, end in itertools.pairwise(centres):
        dx, dy = end[0] - start[0], end[1] - start[1]
        distance = math.hypot(dx, dy)
        bulge = LINK_BENDS[dim]
        if abs(dy) < 1e-9 and distance > SLOT_PITCH_X * 1.01:  # over the boxes between, in the gap above/below
            # The curve leaves the outlines' top (or bottom) edges and peaks 0.2 beyond the boxes' edges.
            bulge = math.copysign(BOX_HEIGHT / 2 + 0.2 - half_height / 2, bulge or 1.0)
        # The chord's normal, turned to point up (or right, for a vertical chord): a positive bulge bows up.
        normal_x, normal_y = -dy / distance, dx / distance
        if normal_y < 0 or (normal_y == 0 and normal_x < 0):
            normal_x, normal_y = -normal_x, -normal_y
        # A quadratic Bezier's peak lies halfway to its control point, off the chord's midpoint.
        control = ((start[0] + end[0]) / 2 + 2 * bulge * normal_x, (start[1] + end[1]) / 2 + 2 * bulge * normal_y)
        path = matplotlib_path.Path([_edge_point(start, control, half_width, half_height), control,
                                     _edge_point(end, control, half_width, half_height)],
                                    [matplotlib_path.Path.MOVETO, matplotlib_path.Path.CURVE3,
                                     matplotlib_path.Path.CURVE3])
        axis.add_patch(matplotlib_patches.FancyArrowPatch(
            path=path, arrowstyle="-|>" if dim == "pp" else "-", mutation_scale=14, color=color, linewidth=1.8,
            alpha=0.9, zorder=3, clip_on=False, gid=f"{dim} link"))


def _edge_point(centre: tuple[float, float], towards: tuple[float, float], half_width: float,
                half_height: float) -> tuple[float, float]:
    """Where the straight line from ``centre`` to ``towards`` leaves the box of that half-size around
    ``centre``: a link starts and ends at the outlines, along the curve's tangent, so PP's arrowheads show."""
    dx, dy = towards[0] - centre[0], towards[1] - centre[1]
    scale = min(half_width / abs(dx) if dx else math.inf, half_height / abs(dy) if dy else math.inf)
    return centre[0] + scale * dx, centre[1] + scale * dy


def memory_choices(shape: TransformerShape, num_gpus: int, choices: Sequence[Sequence[int]],
                   micro_batch: int = 1, precision: str = "mixed") -> list[dict]:
    """The bytes per GPU of each ``(dp, tp, pp, zero_stage)`` layout of ``shape`` on ``num_gpus`` GPUs.

    Model states come from :func:`~labkit.costmodel.memory.memory_per_rank` (Adam, ``num_parameters(shape)``
    parameters split evenly over ``tp * pp`` ranks, ZeRO partitioning over the ``dp`` replicas).  Activations
    are those of the *first pipeline stage*, the rank that holds the most, under these assumptions:

    - **1F1B** (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
      Megatron-LM", section 2.2.1) with at least ``p`` micro-batches in flight: the first of ``p`` stages
      holds ``p`` micro-batches of its ``ceil(L / p)`` layers before its first backward pass, so about one
      micro-batch of the *whole* model, pipelining or not (GPipe would hold all ``m``; later stages hold fewer);
    - **sequence parallelism with tensor parallelism** (Korthikanti et al. 2022, "Reducing Activation
      Recomputation in Large Transformer Models"): every layer's activations divided by ``t``.  Without it the
      ``10 s b h`` bytes of each layer's norm and dropout region stay whole on every TP rank;
    - no activation checkpointing, dropout on, the attention matrix stored (the memory module's defaults);
      the embedding's and the loss's activations left out, as there.

    So ``activations = p * activation_bytes(shape, micro_batch, layers=ceil(L / p), tp_degree=t,
    sequence_parallel=True)``, which is ``activation_bytes(shape, micro_batch) / t`` when ``p`` divides ``L``.

    Each row: ``{"dp", "tp", "pp", "zero", "weights", "gradients", "optimizer_states", "activations",
    "total", "label"}``, bytes as floats, ``label`` like ``"dp=8 tp=1 pp=1 ZeRO-0"``.  A choice whose
    ``dp * tp * pp`` is not ``num_gpus``, a ``tp`` that does not divide the heads, or a ``pp`` above the
    number of layers raises ``ValueError`` naming the choice.
    """
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(f"num_gpus must be an integer >= 1, got {num_gpus!r}")
    if not choices:
        raise ValueError("choices is empty: give (dp, tp, pp, zero_stage) tuples to compare")
    parameters = num_parameters(shape)
    rows = []
    for choice in choices:
        if isinstance(choice, (str, bytes)) or not isinstance(choice, Sequence) or len(choice) != 4:
            raise ValueError(f"a choice is a (dp, tp, pp, zero_stage) tuple, got {choice!r}")
        dp, tp, pp, zero = choice
        try:
            _check_degrees(dp, tp, pp)
        except ValueError as error:
            raise ValueError(f"choice {tuple(choice)!r}: {error}") from None
        if dp * tp * pp != num_gpus:
            raise ValueError(f"choice {tuple(choice)!r} (dp={dp}, tp={tp}, pp={pp}, ZeRO-{zero}): dp * tp * pp = "
                             f"{dp * tp * pp}, but num_gpus is {num_gpus}")
        if pp > shape.num_layers:
            raise ValueError(f"choice {tuple(choice)!r}: pp={pp} stages for {shape.num_layers} layers "
                             "leaves some stage without a layer")
        try:
            stage_layers = math.ceil(shape.num_layers / pp)
            activations = pp * activation_bytes(shape, micro_batch, precision=precision, tp_degree=tp,
                                                sequence_parallel=True, layers=stage_layers)
            memory = memory_per_rank(parameters, precision=precision, zero_stage=zero, dp_degree=dp,
                                     tp_degree=tp, pp_degree=pp, activation_bytes=activations)
        except ValueError as error:
            raise ValueError(f"choice {tuple(choice)!r}: {error}") from None
        rows.append({"dp": dp, "tp": tp, "pp": pp, "zero": zero, **memory,
                     "label": f"dp={dp} tp={tp} pp={pp} ZeRO-{zero}"})
    return rows


def plot_memory_choices(rows: Sequence[Mapping], device_memory_bytes: float | None = None,
                        title: str = "Memory per GPU, by layout") -> Figure:
    """One horizontal bar per row of :func:`memory_choices` (first row on top), stacked in GiB: weights,
    gradients, optimizer states, activations; each bar's total written at its end.  With
    ``device_memory_bytes`` (e.g. ``compute.GPUS["A100 80GB"].memory_bytes``, 80e9), a vertical line at the
    device's memory, and the totals that exceed it marked "does not fit"."""
    if not rows:
        raise ValueError("rows is empty: give memory_choices' rows to draw")
    needed = {"label", "total", *MEMORY_PARTS}
    for row in rows:
        missing = needed - set(row)
        if missing:
            raise ValueError(f"a row needs {sorted(needed)}; {sorted(missing)} missing from {dict(row)!r}")
    if device_memory_bytes is not None and (isinstance(device_memory_bytes, bool)
                                            or not isinstance(device_memory_bytes, (int, float))
                                            or not 0 < device_memory_bytes < math.inf):
        raise ValueError(f"device_memory_bytes must be None or a positive number of bytes, "
                         f"got {device_memory_bytes!r}")
    figure = Figure(figsize=(11, 1.8 + 0.45 * len(rows)))
    axis = figure.subplots()
    positions = list(range(len(rows)))
    left = [0.0] * len(rows)
    for key, (name, color) in MEMORY_PARTS.items():
        values = [row[key] / GIB for row in rows]
        axis.barh(positions, values, left=left, height=0.62, color=color, edgecolor="white", linewidth=0.5,
                  label=name)
        left = [start + value for start, value in zip(left, values, strict=True)]
    device_gib = None if device_memory_bytes is None else device_memory_bytes / GIB
    for position, row in zip(positions, rows, strict=True):
        total = row["total"] / GIB
        over = device_gib is not None and total > device_gib
        axis.text(total, position, f" {total:.1f} GiB" + (" (does not fit)" if over else ""), va="center",
                  fontsize=8, color="#B00000" if over else "black", fontweight="bold" if over else "normal",
                  bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 0.6})  # over the line
    right = max(row["total"] for row in rows) / GIB
    if device_gib is not None:
        axis.axvline(device_gib, color="black", linestyle="--", linewidth=1.3, gid="device memory",
                     label=f"device memory: {device_memory_bytes / 1e9:g} GB = {device_gib:.1f} GiB")
        axis.text(device_gib, 1.0, f"{device_memory_bytes / 1e9:g} GB", ha="center", va="bottom", fontsize=8,
                  transform=axis.get_xaxis_transform())  # above the plot, clear of the first bar's total
        right = max(right, device_gib)
    axis.set_xlim(0, 1.3 * right)
    axis.set_yticks(positions, [row["label"] for row in rows], fontsize=8)
    axis.invert_yaxis()
    axis.set_xlabel("memory per GPU (GiB)")
    axis.set_title(title, fontsize=10)
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    return figure


def plot_layout(dp: int, tp: int, pp: int, rows: Sequence[Mapping], gpus_per_node: int = 8,
                highlight_rank: int | None = 0, device_memory_bytes: float | None = None,
                title: str = "Memory per GPU, by layout", dpi: int = 90) -> Figure:
    """:func:`plot_mesh` above :func:`plot_memory_choices`, in one figure (lesson 10's explorer shows one
    image): both are drawn at ``dpi`` and placed pixel for pixel, so save the result at the same ``dpi``."""
    pictures = []
    for part in (plot_mesh(dp, tp, pp, gpus_per_node, highlight_rank),
                 plot_memory_choices(rows, device_memory_bytes, title)):
        part.set_dpi(dpi)
        canvas = FigureCanvasAgg(part)
        canvas.draw()
        pictures.append(numpy.asarray(canvas.buffer_rgba()))
    width, height = max(p.shape[1] for p in pictures), sum(p.shape[0] for p in pictures)
    figure = Figure(figsize=(width / dpi, height / dpi), dpi=dpi, facecolor="white")
    top = height
    for picture in pictures:
        top -= picture.shape[0]
        figure.figimage(picture, xo=(width - picture.shape[1]) // 2, yo=top, origin="upper", gid="part")
    return figure


# step_breakdown's parts (labkit.parallel.parallelize), and a model's: the simulator times an action with the
# tensor-parallel all-reduces inside it, as the trace does, so its "F and B" is compute + TP communication.
STEP_PARTS = {"compute": "#4C72B0", "tp communication": "#DD8452", "F and B": "#7F95BF", "bubble": "#CCB974",
              "dp reduction": "#55A868", "optimizer": "#8172B3", "other": "#B0B0B0"}


def plot_step_parts(parts: Mapping[int, Mapping[str, float]], labels: Mapping[int, str] | None = None,
                    model: Mapping[int, Mapping[str, float]] | None = None,
                    title: str = "Where each rank's step went") -> Figure:
    """One bar per rank (first rank on top) of ``{rank: {part: seconds}}``, e.g. ``step_breakdown``'s, stacked
    in ms in :data:`STEP_PARTS`' order (a ``"step"`` entry, the total, is not drawn); ``labels`` name the ranks.
    With ``model`` (the same form, e.g. a simulator's ``"F and B"`` and ``"bubble"`` for the rank's stage), a
    thinner hatched bar under each rank's, for the model's parts."""
    if not parts:
        raise ValueError("parts is empty: give {rank: {part: seconds}}, e.g. step_breakdown(spans)")
    for name, table in (("parts", parts), ("model", model or {})):
        for rank, seconds in table.items():
            unknown = set(seconds) - set(STEP_PARTS) - {"step"}
            if unknown or any(value < 0 for value in seconds.values()):
                raise ValueError(f"{name}[{rank}] must map parts of {list(STEP_PARTS)} to seconds >= 0, "
                                 f"got {dict(seconds)!r}")
    ranks = sorted(parts)
    figure = Figure(figsize=(11, 1.4 + (0.55 if model else 0.4) * len(ranks)))
    axis = figure.subplots()
    shown: set[str] = set()
    for position, rank in enumerate(ranks):
        for table, offset, height, hatch in ((parts, 0.0, 0.5, ""), (model or {}, 0.42, 0.3, "//")):
            left = 0.0
            for part, color in STEP_PARTS.items():
                value = 1e3 * table.get(rank, {}).get(part, 0.0)
                if value > 0:
                    axis.barh(position + offset, value, left=left, height=height, color=color, hatch=hatch,
                              edgecolor="white", linewidth=0.5, label=None if part in shown else part)
                    shown.add(part)
                    left += value
    axis.set_yticks(range(len(ranks)), [labels[rank] if labels else f"rank {rank}" for rank in ranks], fontsize=8)
    axis.invert_yaxis()
    axis.set_xlabel("time in the step (ms)")
    axis.set_title(title + ("\n(hatched, under each rank: the model)" if model else ""), fontsize=10)
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    return figure
