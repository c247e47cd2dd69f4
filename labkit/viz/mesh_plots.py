"""Plots of lesson 10 (3D parallelism): where the ranks of a ``(pp, dp, tp)`` mesh sit, and a traced step.

**Which links does each group use?**  ``torchrun`` numbers the ranks node by node, ``gpus_per_node``
consecutive ranks to a node, and labkit's :class:`~labkit.mesh.Mesh` puts global rank
``r = (i_pp * dp + i_dp) * tp + i_tp`` (Megatron-LM's order: tp innermost, pp outermost).  A group whose ranks
share a node talks over NVLink (hundreds of GB/s per GPU); one that spans nodes waits on InfiniBand, several
times slower.  :func:`group_links` works that out for every dimension and :func:`plot_mesh` draws it, legibly
up to 64 ranks: the drawing is scaled to fit a notebook's width (at most :data:`DRAWING_WIDTH` inches, so the
notebook shows it at full size) and never below :data:`MIN_INCHES_PER_UNIT`, where the rank labels, at
:data:`RANK_FONTSIZE` points, still fit their boxes; more nodes go to more rows.  :func:`plot_rank_parts` draws
a traced 3D step per rank (``labkit.parallel.parallelize.timing.step_breakdown``) beside a model of it.  Whether a
layout *fits* is :mod:`labkit.viz.mesh_memory`'s.

The conventions are ``labkit.viz.plots``': data in, ``matplotlib.figure.Figure`` out, nothing run, no process
group.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

from matplotlib import patches as matplotlib_patches
from matplotlib import path as matplotlib_path
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from labkit.degrees import check_degrees
from labkit.mesh import mesh_coordinates, mesh_groups

DIM_COLORS = {"tp": "#0072B2", "dp": "#009E73", "pp": "#D55E00"}  # Okabe & Ito: blue, bluish green, vermillion
DIM_NAMES = {"tp": "TP", "dp": "DP", "pp": "PP"}
DIM_LETTERS = {"tp": "t", "dp": "d", "pp": "p"}
OUTLINE_PADS = {"tp": 0.035, "dp": 0.075, "pp": 0.115}  # nested, so a rank in all three groups shows all three
LINK_BENDS = {"tp": 0.0, "dp": 0.3, "pp": -0.3}  # how far each dimension's links bow out, in data units
LINKS = {"intra-node": "inside a node (NVLink)", "inter-node": "across nodes (InfiniBand)"}
MEMORY_PARTS = {"weights": ("weights", "#4C72B0"), "gradients": ("gradients", "#DD8452"),
                "optimizer_states": ("optimizer states", "#55A868"), "activations": ("activations", "#8172B3")}
GIB = 2**30

# The drawing of plot_mesh, in data units.  A unit is at most MAX_INCHES_PER_UNIT on the page; a wide mesh is
# scaled down to DRAWING_WIDTH inches, which a notebook shows at full size, but never below MIN_INCHES_PER_UNIT,
# where a box (BOX_WIDTH units) still holds "rank 63" over "(3, 1, 7)" at RANK_FONTSIZE points: a row holds as many
# nodes as fit at that scale, and the rest go to more rows (tests/test_mesh_plots.py measures the labels).
BOX_WIDTH, BOX_HEIGHT, SLOT_PITCH_X, SLOT_PITCH_Y = 1.0, 0.72, 1.16, 0.98
NODE_PAD, NODE_LABEL, NODE_GAP, LINK_ROOM = 0.2, 0.34, 0.4, 0.35  # LINK_ROOM: above and below, for links
SLOTS_PER_ROW = 8  # a node of 16 GPUs (a DGX-2) is drawn as two rows of 8
DRAWING_WIDTH, MAX_INCHES_PER_UNIT, MIN_INCHES_PER_UNIT = 10.6, 0.72, 0.5  # inches
RANK_FONTSIZE, MIN_PAGE_WIDTH = 8, 8.5  # points, inches


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
    degrees = check_degrees(dp, tp, pp)
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
    degrees = check_degrees(dp, tp, pp)
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
    node_width = slot_columns * SLOT_PITCH_X - (SLOT_PITCH_X - BOX_WIDTH) + 2 * NODE_PAD
    node_height = slot_rows * SLOT_PITCH_Y - (SLOT_PITCH_Y - BOX_HEIGHT) + 2 * NODE_PAD + NODE_LABEL
    fitting = math.floor((DRAWING_WIDTH / MIN_INCHES_PER_UNIT + NODE_GAP) / (node_width + NODE_GAP))
    node_columns = max(1, min(num_nodes, fitting))  # as many nodes a row as fit at the smallest scale
    node_rows = math.ceil(num_nodes / node_columns)
    width = node_columns * node_width + (node_columns - 1) * NODE_GAP
    height = node_rows * node_height + (node_rows - 1) * NODE_GAP
    drawn_height = height + 2 * LINK_ROOM
    inches_per_unit = min(MAX_INCHES_PER_UNIT, DRAWING_WIDTH / width)

    def centre(slot: int) -> tuple[float, float]:
        """Where GPU ``slot`` (= global rank, for used slots) sits: nodes left to right, then down."""
        node, local = divmod(slot, gpus_per_node)
        left = (node % node_columns) * (node_width + NODE_GAP) + NODE_PAD
        top = height - (node // node_columns) * (node_height + NODE_GAP) - NODE_PAD - NODE_LABEL
        return (left + (local % slot_columns) * SLOT_PITCH_X + BOX_WIDTH / 2,
                top - (local // slot_columns) * SLOT_PITCH_Y - BOX_HEIGHT / 2)

    legend_lines = 4
    margin_top, margin_bottom, margin_side = 0.75, 0.35 + 0.2 * legend_lines, 0.2
    page_width = max(width * inches_per_unit + 2 * margin_side, MIN_PAGE_WIDTH)
    page_height = drawn_height * inches_per_unit + margin_top + margin_bottom
    figure = Figure(figsize=(page_width, page_height))
    axis = figure.add_axes(((1 - width * inches_per_unit / page_width) / 2, margin_bottom / page_height,
                            width * inches_per_unit / page_width, drawn_height * inches_per_unit / page_height))
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
    separator = "," if max(degrees.values()) > 10 else ", "  # two-digit coordinates: "(0,0,15)" fits its box
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
        axis.text(x, y, f"rank {slot}\n(" + separator.join(str(coords[dim]) for dim in ("pp", "dp", "tp")) + ")",
                  ha="center", va="center", fontsize=RANK_FONTSIZE, linespacing=1.3, zorder=4, gid=f"rank {slot} label",
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
                  fontsize=9, frameon=False,
                  title=None if highlight_rank is None else f"the groups of rank {highlight_rank}, "
                                                            "and the links each dimension's groups use",
                  title_fontsize=9, alignment="left")
    figure.suptitle(f"{world_size} ranks as dp = {dp}, tp = {tp}, pp = {pp} on {num_nodes} node"
                    f"{'s' if num_nodes > 1 else ''} of {gpus_per_node} GPUs\n"
                    "each box: the global rank and its (pp, dp, tp) coordinates, "
                    "rank = (i_pp · dp + i_dp) · tp + i_tp", fontsize=10,
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


# step_breakdown's parts (labkit.parallel.parallelize.timing), and a model's: the simulator times an action with the
# tensor-parallel all-reduces inside it, as the trace does, so its "F and B" is compute + TP communication, drawn
# in a colour of its own (not compute's) and named so in the legend (MODEL_NAMES).
STEP_PARTS = {"compute": "#4C72B0", "tp communication": "#DD8452", "F and B": "#DA8BC3", "bubble": "#CCB974",
              "dp reduction": "#55A868", "optimizer": "#8172B3", "other": "#B0B0B0"}
MODEL_NAMES = {"F and B": "model: F and B (compute and the TP all-reduces inside)"}


def plot_rank_parts(parts: Mapping[int, Mapping[str, float]], labels: Mapping[int, str] | None = None,
                    model: Mapping[int, Mapping[str, float]] | None = None,
                    title: str = "Where each rank's step went") -> Figure:
    """One bar per rank (first rank on top) of ``{rank: {part: seconds}}``, e.g. ``step_breakdown``'s, stacked
    in ms in :data:`STEP_PARTS`' order (a ``"step"`` entry, the total, is not drawn); ``labels`` name the ranks.
    With ``model`` (the same form, e.g. a simulator's ``"F and B"`` and ``"bubble"`` for the rank's stage), a
    thinner hatched bar under each rank's, for the model's parts, named "model: ..." in the legend."""
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
                name = part if not hatch else MODEL_NAMES.get(part, f"model: {part}")
                if value > 0:
                    axis.barh(position + offset, value, left=left, height=height, color=color, hatch=hatch,
                              edgecolor="white", linewidth=0.5, label=None if name in shown else name)
                    shown.add(name)
                    left += value
    axis.set_yticks(range(len(ranks)), [labels[rank] if labels else f"rank {rank}" for rank in ranks], fontsize=8)
    axis.invert_yaxis()
    axis.set_xlabel("time in the step (ms)")
    axis.set_title(title + ("\n(hatched, under each rank: the model)" if model else ""), fontsize=10)
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    return figure
