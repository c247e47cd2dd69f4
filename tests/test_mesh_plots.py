"""Lesson 10's figures: the mesh in its nodes, the links each group uses, and the memory of 3D layouts (no
process group)."""

from __future__ import annotations

import math

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from labkit.costmodel.memory import TransformerShape, memory_per_rank, num_parameters
from labkit.mesh import mesh_coordinates, mesh_groups
from labkit.viz import mesh_plots
from labkit.viz.mesh_plots import BERT_LARGE, GIB, group_links, memory_choices, plot_memory_choices, plot_mesh

LAYOUTS = [(2, 2, 2), (1, 8, 1), (4, 2, 8)]
NODE_SIZES = [8, 4]
NAMES = {"tp": "TP", "dp": "DP", "pp": "PP"}


def _patches(figure: Figure, gid: str) -> list:
    return [patch for patch in figure.axes[0].patches if patch.get_gid() == gid]


def _centre(patch) -> tuple[float, float]:
    box = patch.get_bbox()
    return (round((box.x0 + box.x1) / 2, 6), round((box.y0 + box.y1) / 2, 6))


def _legend_lines(figure: Figure) -> dict[str, str]:
    texts = [text.get_text() for text in figure.legends[0].get_texts()]
    return {dim: next(text for text in texts if text.startswith(name + " ")) for dim, name in NAMES.items()}


# ---------------------------------------------------------------------------------------------------------
# plot_mesh and group_links


@pytest.mark.parametrize("gpus_per_node", NODE_SIZES)
@pytest.mark.parametrize(("dp", "tp", "pp"), LAYOUTS)
def test_plot_mesh_draws_every_rank_with_its_coordinates_inside_its_node(dp, tp, pp, gpus_per_node):
    figure = plot_mesh(dp, tp, pp, gpus_per_node=gpus_per_node)
    assert isinstance(figure, Figure)
    world_size = dp * tp * pp
    nodes = [_patches(figure, f"node {node}") for node in range(math.ceil(world_size / gpus_per_node))]
    assert all(len(node) == 1 for node in nodes)
    assert not _patches(figure, f"node {len(nodes)}")
    labels = {text.get_gid(): text.get_text() for text in figure.axes[0].texts}
    for rank, coords in enumerate(mesh_coordinates(world_size, dp=dp, tp=tp, pp=pp)):
        (box,) = _patches(figure, f"rank {rank}")
        frame = nodes[rank // gpus_per_node][0].get_bbox()
        x, y = _centre(box)
        assert frame.x0 < x < frame.x1 and frame.y0 < y < frame.y1, f"rank {rank} is outside node {rank // 8}"
        assert labels[f"rank {rank} label"] == f"rank {rank}\n({coords['pp']}, {coords['dp']}, {coords['tp']})"
    assert len(_patches(figure, "unused GPU")) == len(nodes) * gpus_per_node - world_size


@pytest.mark.parametrize("gpus_per_node", NODE_SIZES)
@pytest.mark.parametrize(("dp", "tp", "pp"), LAYOUTS + [(2, 8, 4), (1, 16, 1), (1, 3, 4)])
def test_plot_mesh_legend_says_the_link_group_links_computes(dp, tp, pp, gpus_per_node):
    links = group_links(dp, tp, pp, gpus_per_node)
    lines = _legend_lines(plot_mesh(dp, tp, pp, gpus_per_node=gpus_per_node))
    for dim, degree in (("tp", tp), ("dp", dp), ("pp", pp)):
        if degree == 1:
            assert "nothing sent" in lines[dim]
        elif links[dim] == "intra-node":
            assert "inside a node (NVLink)" in lines[dim] and "across nodes" not in lines[dim]
        else:
            assert "across nodes (InfiniBand)" in lines[dim] and "NVLink" not in lines[dim]


def test_plot_mesh_legend_flags_a_group_inside_a_node_when_others_of_its_dimension_span_two():
    # tp = 3 on nodes of 4: TP group [0, 1, 2] is inside node 0, [3, 4, 5] spans nodes 0 and 1.
    lines = _legend_lines(plot_mesh(1, 3, 4, gpus_per_node=4, highlight_rank=0))
    assert "across nodes" in lines["tp"] and "ranks [0, 1, 2] (inside one node, but other groups" in lines["tp"]
    lines = _legend_lines(plot_mesh(1, 3, 4, gpus_per_node=4, highlight_rank=3))
    assert "ranks [3, 4, 5]" in lines["tp"] and "inside one node" not in lines["tp"]


@pytest.mark.parametrize(("dp", "tp", "pp", "gpus_per_node", "rank"), [(4, 2, 8, 8, 5), (4, 2, 8, 4, 37),
                                                                        (2, 2, 2, 8, 0), (1, 8, 1, 4, 6)])
def test_plot_mesh_outlines_and_links_exactly_the_highlighted_ranks_groups(dp, tp, pp, gpus_per_node, rank):
    figure = plot_mesh(dp, tp, pp, gpus_per_node=gpus_per_node, highlight_rank=rank)
    centres = {_centre(_patches(figure, f"rank {other}")[0]): other for other in range(dp * tp * pp)}
    for dim, groups in mesh_groups(dp * tp * pp, dp=dp, tp=tp, pp=pp).items():
        (group,) = [group for group in groups if rank in group]
        outlined = sorted(centres[_centre(patch)] for patch in _patches(figure, f"{dim} group"))
        assert outlined == (sorted(group) if len(group) > 1 else [])
        assert len(_patches(figure, f"{dim} link")) == max(len(group) - 1, 0)
    (box,) = _patches(figure, f"rank {rank}")
    assert box.get_linewidth() > _patches(figure, f"rank {(rank + 1) % (dp * tp * pp)}")[0].get_linewidth()


def test_plot_mesh_without_a_highlight_draws_no_group():
    figure = plot_mesh(2, 2, 2, highlight_rank=None)
    assert not [patch for patch in figure.axes[0].patches if str(patch.get_gid()).endswith(("group", "link"))]
    assert "inside a node" in _legend_lines(figure)["tp"]


def test_group_links_keeps_tp_inside_a_node_and_pushes_pp_across_nodes():
    # dp=2, tp=8, pp=4 on 64 GPUs, 8 a node: a TP group is one whole node; DP pairs ranks 8 apart (two
    # nodes), and PP's stages are 16 ranks apart.
    assert group_links(2, 8, 4, gpus_per_node=8) == {"tp": "intra-node", "dp": "inter-node", "pp": "inter-node"}
    assert group_links(1, 16, 1, gpus_per_node=8)["tp"] == "inter-node"  # tp = 16 > 8 GPUs a node
    assert group_links(2, 2, 2, gpus_per_node=8) == {"tp": "intra-node", "dp": "intra-node", "pp": "intra-node"}
    assert group_links(2, 2, 2, gpus_per_node=4) == {"tp": "intra-node", "dp": "intra-node", "pp": "inter-node"}
    # tp = 3 does not divide 4: every other TP group straddles two nodes, which is enough to say inter-node.
    assert group_links(1, 3, 4, gpus_per_node=4)["tp"] == "inter-node"
    assert group_links(1, 3, 4, gpus_per_node=12)["tp"] == "intra-node"


@pytest.mark.parametrize(("degrees", "bad"), [((0, 1, 1), "got 0"), ((1, -2, 1), "got -2"),
                                              ((1, 1, 1.5), "got 1.5"), ((True, 1, 1), "got True"),
                                              ((1, "2", 1), "got '2'")])
def test_bad_degrees_raise_value_error_naming_the_value(degrees, bad):
    with pytest.raises(ValueError, match=bad):
        plot_mesh(*degrees)
    with pytest.raises(ValueError, match=bad):
        group_links(*degrees, gpus_per_node=8)


def test_plot_mesh_rejects_a_bad_node_size_or_highlighted_rank():
    with pytest.raises(ValueError, match="gpus_per_node.*got 0"):
        plot_mesh(2, 2, 2, gpus_per_node=0)
    with pytest.raises(ValueError, match="gpus_per_node.*got 0"):
        group_links(2, 2, 2, gpus_per_node=0)
    with pytest.raises(ValueError, match=r"highlight_rank.*0\.\.7, got 8"):
        plot_mesh(2, 2, 2, highlight_rank=8)
    with pytest.raises(ValueError, match="highlight_rank.*got -1"):
        plot_mesh(2, 2, 2, highlight_rank=-1)


@pytest.mark.parametrize("gpus_per_node", [8, 4, 1])
def test_64_ranks_render_legibly_in_a_bigger_figure_not_smaller_boxes(gpus_per_node):
    small = plot_mesh(2, 2, 2, gpus_per_node=gpus_per_node)
    large = plot_mesh(4, 2, 8, gpus_per_node=gpus_per_node, highlight_rank=37)
    sizes = []
    for figure in (small, large):
        canvas = FigureCanvasAgg(figure)
        canvas.draw()
        renderer = canvas.get_renderer()
        for text in figure.axes[0].texts:
            if str(text.get_gid()).endswith(" label"):
                assert text.get_fontsize() >= 6
                box = _patches(figure, text.get_gid().removesuffix(" label"))[0].get_window_extent(renderer)
                extent = text.get_window_extent(renderer)
                assert box.x0 <= extent.x0 and extent.x1 <= box.x1 and box.y0 <= extent.y0 and extent.y1 <= box.y1, \
                    f"{text.get_text()!r} overflows its box"
        (box,) = _patches(figure, "rank 0")
        sizes.append(box.get_window_extent(renderer).width / figure.dpi)
    assert sizes[0] == pytest.approx(sizes[1])  # the same box, in inches
    assert (large.get_figwidth() * large.get_figheight()) > 2 * (small.get_figwidth() * small.get_figheight())


# ---------------------------------------------------------------------------------------------------------
# memory_choices and plot_memory_choices


def test_bert_large_has_about_340m_parameters():
    # Devlin et al. quote 340M.  BERT_LARGE is built as our decoder-style shape, which leaves out BERT's
    # segment embeddings, pooler and masked-LM transform (about 2M together) and so counts ~334M: within 10 %.
    parameters = num_parameters(BERT_LARGE)
    assert 3.3e8 <= parameters <= 3.4e8
    assert parameters == pytest.approx(340e6, rel=0.10)


def test_memory_choices_equal_memory_per_rank_for_a_hand_case():
    (row,) = memory_choices(BERT_LARGE, 8, [(2, 2, 2, 1)], micro_batch=4)
    s, b, h, a, layers, t = 512, 4, 1024, 16, 24, 2
    # Korthikanti et al.: s b h (34 + 5 a s / h) bytes a layer at 16 bits, all of it split over t with sequence
    # parallelism; the first 1F1B stage holds p micro-batches of L / p layers, i.e. L layers' worth.
    activations = layers * s * b * h * (34 + 5 * a * s / h) / t
    expected = memory_per_rank(num_parameters(BERT_LARGE), precision="mixed", zero_stage=1, dp_degree=2,
                               tp_degree=2, pp_degree=2, activation_bytes=activations)
    assert {key: row[key] for key in expected} == pytest.approx(expected)
    assert row["weights"] == pytest.approx(2 * num_parameters(BERT_LARGE) / 4)  # 16-bit, over t p = 4
    assert row["optimizer_states"] == pytest.approx(12 * num_parameters(BERT_LARGE) / 4 / 2)  # ZeRO-1, dp = 2
    assert (row["dp"], row["tp"], row["pp"], row["zero"], row["label"]) == (2, 2, 2, 1, "dp=2 tp=2 pp=2 ZeRO-1")


def test_zero3_shards_weights_gradients_and_optimizer_states_by_dp_and_leaves_activations():
    plain, zero1, zero3 = memory_choices(BERT_LARGE, 8, [(8, 1, 1, 0), (8, 1, 1, 1), (8, 1, 1, 3)])
    for key in ("weights", "gradients", "optimizer_states"):
        assert zero3[key] == pytest.approx(plain[key] / 8)
    assert zero1["weights"] == plain["weights"] and zero1["optimizer_states"] == pytest.approx(
        plain["optimizer_states"] / 8)
    assert plain["activations"] == zero3["activations"] > 0
    assert plain["label"] == "dp=8 tp=1 pp=1 ZeRO-0"


def test_activations_are_the_first_1f1b_stages_divided_by_tp():
    full, tensor, pipeline = memory_choices(BERT_LARGE, 8, [(8, 1, 1, 0), (1, 8, 1, 0), (1, 1, 8, 0)])
    assert tensor["activations"] == pytest.approx(full["activations"] / 8)
    assert pipeline["activations"] == pytest.approx(full["activations"])  # 8 micro-batches of 3 layers
    # 10 layers on 4 stages: the first holds 3 layers, 4 micro-batches of them: 12 layers' worth.
    shape = TransformerShape(num_layers=10, hidden_size=256, num_heads=4, seq_len=128, vocab_size=1000)
    (one,), (four,) = memory_choices(shape, 1, [(1, 1, 1, 0)]), memory_choices(shape, 4, [(1, 1, 4, 0)])
    assert four["activations"] == pytest.approx(one["activations"] * 12 / 10)


@pytest.mark.parametrize(("choice", "message"), [
    ((4, 2, 2, 0), r"choice \(4, 2, 2, 0\).*dp \* tp \* pp = 16, but num_gpus is 8"),
    ((8, 1, 1, 4), r"choice \(8, 1, 1, 4\).*zero_stage"),
    ((0, 8, 1, 0), r"choice \(0, 8, 1, 0\).*dp must be"),
    ((1, 1, 1), r"\(dp, tp, pp, zero_stage\) tuple, got \(1, 1, 1\)"),
])
def test_memory_choices_rejects_a_bad_choice_naming_it(choice, message):
    with pytest.raises(ValueError, match=message):
        memory_choices(BERT_LARGE, 8, [(8, 1, 1, 0), choice])


def test_memory_choices_rejects_a_tp_that_does_not_divide_the_heads_or_a_pp_above_the_layers():
    with pytest.raises(ValueError, match=r"choice \(1, 3, 1, 0\).*tp_degree=3 must divide num_heads=16"):
        memory_choices(BERT_LARGE, 3, [(1, 3, 1, 0)])
    with pytest.raises(ValueError, match=r"choice \(1, 1, 32, 0\).*pp=32 stages for 24 layers"):
        memory_choices(BERT_LARGE, 32, [(1, 1, 32, 0)])
    with pytest.raises(ValueError, match="num_gpus"):
        memory_choices(BERT_LARGE, 0, [(1, 1, 1, 0)])


ROWS_CHOICES = [(8, 1, 1, 0), (8, 1, 1, 3), (2, 2, 2, 1), (1, 8, 1, 0)]


def test_plot_memory_choices_draws_one_stacked_bar_per_row_and_the_device_line():
    rows = memory_choices(BERT_LARGE, 8, ROWS_CHOICES, micro_batch=8)
    figure = plot_memory_choices(rows, device_memory_bytes=80e9)
    axis = figure.axes[0]
    assert len(axis.containers) == 4  # weights, gradients, optimizer states, activations
    left = [0.0] * len(rows)
    for container, key in zip(axis.containers, mesh_plots.MEMORY_PARTS, strict=True):
        assert len(container) == len(rows)
        assert len({bar.get_y() for bar in container}) == len(rows)
        for index, (bar, row) in enumerate(zip(container, rows, strict=True)):
            assert bar.get_width() == pytest.approx(row[key] / GIB)
            assert bar.get_x() == pytest.approx(left[index])
            left[index] += bar.get_width()
    assert left == pytest.approx([row["total"] / GIB for row in rows])
    (line,) = [line for line in axis.lines if line.get_gid() == "device memory"]
    assert line.get_xdata()[0] == pytest.approx(80e9 / GIB)
    assert "80 GB = 74.5 GiB" in line.get_label()
    texts = [text.get_text() for text in axis.texts]
    assert all(f" {row['total'] / GIB:.1f} GiB" in texts for row in rows)
    assert [label.get_text() for label in axis.get_yticklabels()] == [row["label"] for row in rows]
    assert axis.get_xlabel() == "memory per GPU (GiB)"


def test_plot_memory_choices_marks_what_does_not_fit_and_draws_no_line_without_a_device():
    rows = memory_choices(BERT_LARGE, 8, ROWS_CHOICES, micro_batch=8)
    device = 4 * GIB  # between the smallest and the largest total
    over = [row["total"] > device for row in rows]
    assert any(over) and not all(over)
    texts = [text.get_text() for text in plot_memory_choices(rows, device).axes[0].texts if "GiB" in text.get_text()]
    assert ["does not fit" in text for text in texts] == over
    assert not [line for line in plot_memory_choices(rows).axes[0].lines if line.get_gid() == "device memory"]


def test_plot_memory_choices_rejects_bad_input():
    rows = memory_choices(BERT_LARGE, 8, ROWS_CHOICES)
    with pytest.raises(ValueError, match="rows is empty"):
        plot_memory_choices([])
    with pytest.raises(ValueError, match=r"\['activations'\] missing"):
        plot_memory_choices([{key: value for key, value in rows[0].items() if key != "activations"}])
    with pytest.raises(ValueError, match="device_memory_bytes.*got -1"):
        plot_memory_choices(rows, device_memory_bytes=-1)


# ---------------------------------------------------------------------------------------------------------
# plot_layout and plot_step_parts


def _pixels(figure: Figure, dpi: int = 90):
    import numpy

    figure.set_dpi(dpi)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return numpy.asarray(canvas.buffer_rgba())


def test_plot_layout_stacks_the_mesh_above_the_memory_bars_pixel_for_pixel():
    import numpy

    rows = memory_choices(BERT_LARGE, 32, [(4, 4, 2, 1), (32, 1, 1, 1)], micro_batch=8)
    figure = mesh_plots.plot_layout(4, 4, 2, rows, gpus_per_node=8, highlight_rank=5, device_memory_bytes=32e9)
    mesh, memory = _pixels(plot_mesh(4, 4, 2, 8, 5)), _pixels(plot_memory_choices(rows, 32e9))
    whole = _pixels(figure)
    assert whole.shape[0] == mesh.shape[0] + memory.shape[0]
    assert whole.shape[1] == max(mesh.shape[1], memory.shape[1])
    left = (whole.shape[1] - mesh.shape[1]) // 2
    assert numpy.array_equal(whole[:mesh.shape[0], left:left + mesh.shape[1]], mesh)
    left = (whole.shape[1] - memory.shape[1]) // 2
    assert numpy.array_equal(whole[mesh.shape[0]:, left:left + memory.shape[1]], memory)
    assert len([image for image in figure.images if image.get_gid() == "part"]) == 2


def test_plot_layout_refuses_what_its_parts_refuse():
    rows = memory_choices(BERT_LARGE, 8, [(2, 2, 2, 1)])
    with pytest.raises(ValueError, match="highlight_rank"):
        mesh_plots.plot_layout(2, 2, 2, rows, highlight_rank=8)
    with pytest.raises(ValueError, match="rows is empty"):
        mesh_plots.plot_layout(2, 2, 2, [])


PARTS = {0: {"compute": 0.010, "tp communication": 0.004, "bubble": 0.003, "dp reduction": 0.002,
             "optimizer": 0.001, "other": 0.0005, "step": 0.0205},
         1: {"compute": 0.012, "tp communication": 0.002, "bubble": 0.0, "dp reduction": 0.003, "optimizer": 0.001,
             "other": 0.0, "step": 0.018}}


def _bars(figure: Figure) -> list:
    return [bar for container in figure.axes[0].containers for bar in container]


def test_plot_step_parts_stacks_each_ranks_parts_in_milliseconds_and_the_model_under_it():
    model = {0: {"F and B": 0.014, "bubble": 0.004}, 1: {"F and B": 0.014, "bubble": 0.004}}
    figure = mesh_plots.plot_step_parts(PARTS, {0: "rank 0 (0, 0, 0)", 1: "rank 1 (1, 0, 0)"}, model)
    axis = figure.axes[0]
    bars = _bars(figure)
    for rank, position in ((0, 0), (1, 1)):
        measured = sorted((bar for bar in bars if abs(bar.get_y() + bar.get_height() / 2 - position) < 1e-9),
                          key=lambda bar: bar.get_x())
        expected = [1e3 * PARTS[rank][part] for part in mesh_plots.STEP_PARTS if PARTS[rank].get(part, 0) > 0]
        assert [bar.get_width() for bar in measured] == pytest.approx(expected)
        assert measured[-1].get_x() + measured[-1].get_width() == pytest.approx(1e3 * PARTS[rank]["step"])
        under = [bar for bar in bars if abs(bar.get_y() + bar.get_height() / 2 - position - 0.42) < 1e-9]
        assert sorted(bar.get_width() for bar in under) == pytest.approx([4.0, 14.0])
        assert all(bar.get_hatch() == "//" for bar in under)
    assert [label.get_text() for label in axis.get_yticklabels()] == ["rank 0 (0, 0, 0)", "rank 1 (1, 0, 0)"]
    assert axis.get_xlabel() == "time in the step (ms)"
    legend = [text.get_text() for text in axis.get_legend().get_texts()]
    assert len(legend) == len(set(legend)) and {"compute", "bubble", "F and B"} <= set(legend)


def test_plot_step_parts_rejects_unknown_parts_and_negative_times():
    with pytest.raises(ValueError, match="parts is empty"):
        mesh_plots.plot_step_parts({})
    with pytest.raises(ValueError, match=r"parts\[0\].*'lunch'"):
        mesh_plots.plot_step_parts({0: {"lunch": 1.0}})
    with pytest.raises(ValueError, match=r"model\[1\]"):
        mesh_plots.plot_step_parts(PARTS, model={1: {"bubble": -0.1}})


def test_the_layout_explorer_redraws_on_release_for_every_control():
    import ipywidgets

    from labkit.viz.mesh_widgets import layout_explorer
    from tests.conftest import check_every_control_redraws

    def move(control) -> None:
        if isinstance(control, ipywidgets.Dropdown):
            control.value = next(option for option in control.options if option != control.value)
        else:
            control.value = control.value + 1 if control.value < control.max else control.value - 1

    # 8 controls: GPUs, t, p, ZeRO, micro-batch, GPUs per node, device, highlighted rank (tests/test_browser.py)
    check_every_control_redraws(layout_explorer(), 8, move)
