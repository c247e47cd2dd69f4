"""Lesson 10's figures: the mesh in its nodes, the links each group uses, the memory of 3D layouts, and the
explorer that shows them (no process group)."""

from __future__ import annotations

import itertools
import math

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from labkit.costmodel.memory import activation_bytes, memory_per_rank
from labkit.costmodel.shapes import TransformerShape, num_parameters
from labkit.mesh import mesh_coordinates, mesh_groups
from labkit.viz import mesh_memory, mesh_plots
from labkit.viz.mesh_memory import (
    GIB,
    LLAMA_2_70B,
    LLAMA_2_ACTIVATIONS,
    LLAMA_2_GLOBAL_BATCH,
    largest_micro_batch,
    memory_choices,
    plot_memory_choices,
)
from labkit.viz.mesh_plots import group_links, plot_mesh

# A small GPT-style shape (16 heads, 24 layers) for hand-checked memory cases: fast, and every degree divides it.
SMALL = TransformerShape(num_layers=24, hidden_size=1024, num_heads=16, seq_len=512, vocab_size=30522)

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
        if dim not in ("tp", "dp", "pp"):  # the picture draws 3D's three dimensions
            continue
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


def _label_extents(figure: Figure):
    """Each rank label's text extent and its box's, in pixels, after drawing."""
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    for text in figure.axes[0].texts:
        if str(text.get_gid()).endswith(" label"):
            box = _patches(figure, text.get_gid().removesuffix(" label"))[0].get_window_extent(renderer)
            yield text, text.get_window_extent(renderer), box


@pytest.mark.parametrize("gpus_per_node", [8, 4, 16, 1])
@pytest.mark.parametrize(("dp", "tp", "pp"), [(2, 8, 4), (4, 2, 8), (2, 4, 4), (1, 16, 4)])
def test_32_and_64_ranks_stay_legible_at_a_notebooks_width(dp, tp, pp, gpus_per_node):
    """The issue: at 32-64 GPUs the mesh grew to 15 inches and a notebook shrank it, its 6.5-point labels to ~4.
    Now the figure is at most 11 inches wide (a notebook shows it at full size), every rank label is at least
    8 points and fits inside its box, and no two labels overlap: more nodes go to more rows instead."""
    figure = plot_mesh(dp, tp, pp, gpus_per_node=gpus_per_node, highlight_rank=dp * tp * pp - 1)
    assert figure.get_figwidth() <= 11.0 + 1e-9  # DRAWING_WIDTH and the margins
    extents = []
    for text, extent, box in _label_extents(figure):
        assert text.get_fontsize() >= 8
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1 and box.y0 <= extent.y0 and extent.y1 <= box.y1, \
            f"{text.get_text()!r} overflows its box"
        extents.append(extent)
    assert len(extents) == dp * tp * pp
    for a, b in itertools.combinations(extents, 2):
        assert not a.overlaps(b)
    for text in (*figure.legends[0].get_texts(), figure.legends[0].get_title()):
        assert text.get_fontsize() >= 9


def test_a_small_mesh_keeps_its_scale_and_a_large_one_shrinks_only_to_the_floor():
    small, large = plot_mesh(2, 2, 2, gpus_per_node=8), plot_mesh(2, 8, 4, gpus_per_node=8)
    sizes = []
    for figure in (small, large):
        _, _, box = next(_label_extents(figure))
        sizes.append(box.width / figure.dpi)  # inches
    assert sizes[0] == pytest.approx(mesh_plots.BOX_WIDTH * mesh_plots.MAX_INCHES_PER_UNIT)
    assert mesh_plots.BOX_WIDTH * mesh_plots.MIN_INCHES_PER_UNIT <= sizes[1] < sizes[0]
    assert large.get_figheight() > small.get_figheight()


# ---------------------------------------------------------------------------------------------------------
# memory_choices, largest_micro_batch and plot_memory_choices


def test_llama_2_70b_is_the_published_shape_and_needs_model_parallelism():
    # Touvron et al. 2023: 80 layers, h = 8192, 64 heads over 8 key/value heads, 4096-token context, 4M-token
    # batches (1024 sequences); 68.98B parameters as built.  One sequence's activations exceed an 80 GB GPU.
    assert (LLAMA_2_70B.num_layers, LLAMA_2_70B.hidden_size, LLAMA_2_70B.num_heads, LLAMA_2_70B.num_kv_heads,
            LLAMA_2_70B.seq_len) == (80, 8192, 64, 8, 4096)
    assert num_parameters(LLAMA_2_70B) == 68_976_648_192 and LLAMA_2_GLOBAL_BATCH * 4096 == 4 * 2**20
    assert activation_bytes(LLAMA_2_70B, 1, **LLAMA_2_ACTIVATIONS) > 80e9
    assert 16 * num_parameters(LLAMA_2_70B) > 80e9 * 8  # model states: more than a node of 80 GB GPUs


def test_memory_choices_equal_memory_per_rank_for_a_hand_case():
    (row,) = memory_choices(SMALL, 8, [(2, 2, 2, 1)], micro_batch=4)
    s, b, h, a, layers, t = 512, 4, 1024, 16, 24, 2
    # Korthikanti et al.: s b h (34 + 5 a s / h) bytes a layer at 16 bits, all of it split over t with sequence
    # parallelism; the first 1F1B stage holds p micro-batches of L / p layers, i.e. L layers' worth.
    activations = layers * s * b * h * (34 + 5 * a * s / h) / t
    expected = memory_per_rank(num_parameters(SMALL), precision="mixed", zero_stage=1, dp_degree=2,
                               tp_degree=2, pp_degree=2, activation_bytes=activations, accumulating=True)
    assert {key: row[key] for key in expected} == pytest.approx(expected)
    assert row["weights"] == pytest.approx(2 * num_parameters(SMALL) / 4)  # 16-bit, over t p = 4
    assert row["optimizer_states"] == pytest.approx(12 * num_parameters(SMALL) / 4 / 2)  # ZeRO-1, dp = 2
    assert (row["dp"], row["tp"], row["pp"], row["zero"], row["label"]) == (2, 2, 2, 1, "dp=2 tp=2 pp=2 ZeRO-1")
    assert row["microbatches"] is None and row["accumulating"]  # a pipeline runs m >= p micro-batches


def test_zero2_and_zero3_hold_whole_gradients_while_accumulating_and_shard_them_only_at_one_micro_batch():
    """The issue: ZeRO-2 under accumulation holds whole gradients during the schedule (parallelize.py reduces
    once, after the last micro-batch), but the explorer counted them sharded."""
    zero1, zero2, zero3 = memory_choices(LLAMA_2_70B, 64, [(8, 8, 1, 1), (8, 8, 1, 2), (8, 8, 1, 3)],
                                         global_batch=1024, **LLAMA_2_ACTIVATIONS)
    assert zero2["microbatches"] == 128 and zero2["accumulating"]
    assert zero2["gradients"] == zero1["gradients"] == zero3["gradients"] == 2 * num_parameters(LLAMA_2_70B) / 8
    assert zero2["total"] == zero1["total"] and zero3["weights"] == zero1["weights"] / 8
    one_step = memory_choices(LLAMA_2_70B, 64, [(64, 1, 1, 1), (64, 1, 1, 2)], micro_batch=16, global_batch=1024,
                              **LLAMA_2_ACTIVATIONS)  # 1024 / (64 * 16) = 1 micro-batch: nothing accumulates
    assert [row["microbatches"] for row in one_step] == [1, 1] and not one_step[1]["accumulating"]
    assert one_step[1]["gradients"] == pytest.approx(one_step[0]["gradients"] / 64)


def test_zero3_shards_weights_and_optimizer_states_by_dp_and_leaves_activations():
    plain, zero1, zero3 = memory_choices(SMALL, 8, [(8, 1, 1, 0), (8, 1, 1, 1), (8, 1, 1, 3)])
    for key in ("weights", "gradients", "optimizer_states"):  # no pipeline, no global batch: no accumulation
        assert zero3[key] == pytest.approx(plain[key] / 8)
    assert zero1["weights"] == plain["weights"] and zero1["optimizer_states"] == pytest.approx(
        plain["optimizer_states"] / 8)
    assert plain["activations"] == zero3["activations"] > 0
    assert plain["label"] == "dp=8 tp=1 pp=1 ZeRO-0"


def test_tensor_parallelism_alone_divides_its_regions_and_sequence_parallelism_the_rest():
    """The issue: "TP divides activations only with SP" contradicted lesson 06: t alone divides the split
    regions (24/t + 5as/(ht)); SP divides the 10 sbh left."""
    full, with_sp, without = (memory_choices(SMALL, 8, [choice], sequence_parallel=sp)[0]["activations"]
                              for choice, sp in (((8, 1, 1, 0), True), ((1, 8, 1, 0), True), ((1, 8, 1, 0), False)))
    assert with_sp == pytest.approx(full / 8)
    s, b, h, a, layers = 512, 1, 1024, 16, 24
    assert without == pytest.approx(layers * s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8)))
    assert full / 8 < without < full


def test_activations_are_the_first_1f1b_stages_holding_min_p_m_micro_batches():
    full, tensor, pipeline = memory_choices(SMALL, 8, [(8, 1, 1, 0), (1, 8, 1, 0), (1, 1, 8, 0)])
    assert tensor["activations"] == pytest.approx(full["activations"] / 8)
    assert pipeline["activations"] == pytest.approx(full["activations"])  # 8 micro-batches of 3 layers
    # 10 layers on 4 stages: the first holds 3 layers, 4 micro-batches of them: 12 layers' worth.
    shape = TransformerShape(num_layers=10, hidden_size=256, num_heads=4, seq_len=128, vocab_size=1000)
    (one,), (four,) = memory_choices(shape, 1, [(1, 1, 1, 0)]), memory_choices(shape, 4, [(1, 1, 4, 0)])
    assert four["activations"] == pytest.approx(one["activations"] * 12 / 10)
    # With only m = 2 micro-batches, the first stage of 4 holds 2 of them, not 4.
    (two,) = memory_choices(shape, 4, [(1, 1, 4, 0)], micro_batch=1, global_batch=2)
    assert two["microbatches"] == 2 and two["activations"] == pytest.approx(four["activations"] / 2)


def test_full_recomputation_keeps_each_held_micro_batchs_layer_inputs_and_rebuilds_one_layer():
    """Review of lesson 10: "without TP nothing fits" held only without recomputation (LLaMA, section 2.4, used
    checkpointing): each layer keeps its input (s b h 16-bit values, split by sequence parallelism), and one
    layer's activations are rebuilt at a time."""
    s, b, h, t, p, layers = 512, 2, 1024, 2, 4, 24 // 4
    (plain,), (recomputed,) = (memory_choices(SMALL, 8, [(1, t, p, 0)], micro_batch=b, recompute=recompute)
                               for recompute in (False, True))
    one_layer = plain["activations"] / (p * layers)  # p micro-batches of L / p layers held, without recomputation
    assert recomputed["activations"] == pytest.approx(p * layers * s * b * h * 2 / t + one_layer)
    assert recomputed["label"] == "dp=1 tp=2 pp=4 ZeRO-0, recompute" and plain["label"] == "dp=1 tp=2 pp=4 ZeRO-0"
    assert {key: recomputed[key] for key in ("weights", "gradients", "optimizer_states")} == \
        {key: plain[key] for key in ("weights", "gradients", "optimizer_states")}
    # Llama 2 70B: without TP, no recomputation: one sequence's 80 layers exceed an 80 GB GPU; with it, ~6 GiB.
    (whole,), (kept,) = (memory_choices(LLAMA_2_70B, 64, [(64, 1, 1, 3)], global_batch=1024, recompute=recompute,
                                        **LLAMA_2_ACTIVATIONS) for recompute in (False, True))
    assert whole["activations"] > 80e9 > 10 * kept["activations"]


def test_reducing_every_micro_batch_shards_zero2_and_fsdp_gradients_while_accumulating():
    """FSDP's default (and DeepSpeed's ZeRO-2 without a pipeline) reduce-scatters after every micro-batch: the
    gradients stay sharded, at m reduce-scatters a step; ZeRO-0 and ZeRO-1 are unchanged."""
    choices = [(8, 8, 1, 1), (8, 8, 1, 2), (8, 8, 1, 3)]
    once = memory_choices(LLAMA_2_70B, 64, choices, global_batch=1024, **LLAMA_2_ACTIVATIONS)
    each = memory_choices(LLAMA_2_70B, 64, choices, global_batch=1024, reduce_each_micro_batch=True,
                          **LLAMA_2_ACTIVATIONS)
    assert each[0] == once[0]  # ZeRO-1 keeps whole gradients either way
    for before, after in zip(once[1:], each[1:], strict=True):
        assert after["accumulating"] and after["gradients"] == pytest.approx(before["gradients"] / 8)
        assert after["label"] == before["label"] + ", RS/micro-batch"
    fp32 = memory_choices(LLAMA_2_70B, 64, choices[:1], global_batch=1024, gradient_bytes=4, **LLAMA_2_ACTIVATIONS)
    assert fp32[0]["gradients"] == pytest.approx(2 * once[0]["gradients"])  # Megatron-LM's fp32 main_grad


@pytest.mark.parametrize(("choice", "message"), [
    ((4, 2, 2, 0), r"choice \(4, 2, 2, 0\).*dp \* tp \* pp = 16, but num_gpus is 8"),
    ((8, 1, 1, 4), r"choice \(8, 1, 1, 4\).*zero_stage"),
    ((0, 8, 1, 0), r"choice \(0, 8, 1, 0\).*dp must be"),
    ((1, 1, 1), r"\(dp, tp, pp, zero_stage\) tuple, got \(1, 1, 1\)"),
])
def test_memory_choices_rejects_a_bad_choice_naming_it(choice, message):
    with pytest.raises(ValueError, match=message):
        memory_choices(SMALL, 8, [(8, 1, 1, 0), choice])


def test_memory_choices_rejects_what_cannot_be_split():
    with pytest.raises(ValueError, match=r"choice \(1, 3, 1, 0\).*tp_degree=3 must divide num_heads=16"):
        memory_choices(SMALL, 3, [(1, 3, 1, 0)])
    with pytest.raises(ValueError, match=r"choice \(4, 16, 1, 1\).*num_kv_heads=8"):  # GQA: t divides the kv heads
        memory_choices(LLAMA_2_70B, 64, [(4, 16, 1, 1)])
    with pytest.raises(ValueError, match=r"choice \(1, 1, 32, 0\).*pp=32 stages for 24 layers"):
        memory_choices(SMALL, 32, [(1, 1, 32, 0)])
    with pytest.raises(ValueError, match=r"global batch of 100 sequences does not split into dp=8"):
        memory_choices(SMALL, 8, [(8, 1, 1, 0)], micro_batch=2, global_batch=100)
    for bad in ({"num_gpus": 0}, {"micro_batch": 0}, {"global_batch": 0}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be"):
            memory_choices(SMALL, **{"num_gpus": 1, **bad}, choices=[(1, 1, 1, 0)])


def test_the_largest_micro_batch_fits_divides_the_replicas_share_and_never_exceeds_it():
    """The issue: "largest b that fits: 269" stood above the global batch of 256."""
    for choice in [(1, 8, 1, 0), (8, 1, 1, 3), (2, 2, 2, 1)]:
        global_batch, device = 256, 32e9
        b = largest_micro_batch(SMALL, 8, choice, device, global_batch)
        share = global_batch // choice[0]
        assert 1 <= b <= share and share % b == 0
        (fits,) = memory_choices(SMALL, 8, [choice], micro_batch=b, global_batch=global_batch)
        assert fits["total"] <= device
        larger = [c for c in range(b + 1, share + 1) if share % c == 0]
        if larger:  # the next divisor does not fit
            (over,) = memory_choices(SMALL, 8, [choice], micro_batch=larger[0], global_batch=global_batch)
            assert over["total"] > device
    # Room for far more than the replica's share: bounded by it (t = 8 on an 8 GB budget with 8 sequences)
    assert largest_micro_batch(SMALL, 8, (1, 8, 1, 0), 1e15, 8) == 8
    assert largest_micro_batch(LLAMA_2_70B, 64, (64, 1, 1, 3), 80e9, 1024, **LLAMA_2_ACTIVATIONS) == 0
    with pytest.raises(ValueError, match="does not split over dp=3"):
        largest_micro_batch(SMALL, 24, (3, 8, 1, 0), 80e9, 256)


def test_the_v100_trains_in_fp16_and_the_others_in_bf16():
    """The issue: bf16 on a V100.  Its tensor cores have no bf16; the explorer says fp16 there."""
    assert mesh_memory.half_precision("V100 32GB") == "fp16"
    assert {mesh_memory.half_precision(name) for name in ("A100 80GB", "H100 80GB", "H200 141GB")} == {"bf16"}


ROWS_CHOICES = [(8, 1, 1, 0), (8, 1, 1, 3), (2, 2, 2, 1), (1, 8, 1, 0)]


def test_plot_memory_choices_draws_one_stacked_bar_per_row_and_the_device_line():
    rows = memory_choices(SMALL, 8, ROWS_CHOICES, micro_batch=8)
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
    assert all(any(text.startswith(f" {row['total'] / GIB:,.1f} GiB") for text in texts) for row in rows)
    assert [label.get_text() for label in axis.get_yticklabels()] == [row["label"] for row in rows]
    assert axis.get_xlabel() == "memory per GPU (GiB)"


def test_plot_memory_choices_marks_what_does_not_fit_and_cuts_what_is_far_off_scale():
    rows = memory_choices(SMALL, 8, ROWS_CHOICES, micro_batch=8)
    device = 4 * GIB  # between the smallest and the largest total
    over = [row["total"] > device for row in rows]
    assert any(over) and not all(over)
    texts = [text.get_text() for text in plot_memory_choices(rows, device).axes[0].texts if "GiB" in text.get_text()]
    assert ["does not fit" in text for text in texts] == over
    assert not [line for line in plot_memory_choices(rows).axes[0].lines if line.get_gid() == "device memory"]
    # Llama 2 70B as pure data parallelism: 1.1 TB, cut at four times the 80 GB line, its total still on the axis
    llama = memory_choices(LLAMA_2_70B, 64, [(64, 1, 1, 0), (2, 8, 4, 1)], global_batch=1024, **LLAMA_2_ACTIVATIONS)
    figure = plot_memory_choices(llama, 80e9)
    axis = figure.axes[0]
    assert axis.get_xlim()[1] == pytest.approx(4 * 80e9 / GIB)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    frame = axis.get_window_extent(canvas.get_renderer())
    for text in axis.texts:
        if "GiB" in text.get_text():
            extent = text.get_window_extent(canvas.get_renderer())
            assert frame.x0 <= extent.x0 and extent.x1 <= frame.x1 + 1, text.get_text()
    assert any("(off scale)" in text.get_text() for text in axis.texts)


def test_plot_memory_choices_rejects_bad_input():
    rows = memory_choices(SMALL, 8, ROWS_CHOICES)
    with pytest.raises(ValueError, match="rows is empty"):
        plot_memory_choices([])
    with pytest.raises(ValueError, match=r"\['activations'\] missing"):
        plot_memory_choices([{key: value for key, value in rows[0].items() if key != "activations"}])
    with pytest.raises(ValueError, match="device_memory_bytes.*got -1"):
        plot_memory_choices(rows, device_memory_bytes=-1)


# ---------------------------------------------------------------------------------------------------------
# plot_layout and plot_rank_parts


def _pixels(figure: Figure, dpi: int = 90):
    import numpy

    figure.set_dpi(dpi)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return numpy.asarray(canvas.buffer_rgba())


def test_plot_layout_stacks_the_mesh_above_the_memory_bars_pixel_for_pixel():
    import numpy

    rows = memory_choices(SMALL, 32, [(4, 4, 2, 1), (32, 1, 1, 1)], micro_batch=8)
    figure = mesh_memory.plot_layout(4, 4, 2, rows, gpus_per_node=8, highlight_rank=5, device_memory_bytes=32e9)
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
    rows = memory_choices(SMALL, 8, [(2, 2, 2, 1)])
    with pytest.raises(ValueError, match="highlight_rank"):
        mesh_memory.plot_layout(2, 2, 2, rows, highlight_rank=8)
    with pytest.raises(ValueError, match="rows is empty"):
        mesh_memory.plot_layout(2, 2, 2, [])
    with pytest.raises(ValueError, match="figures is empty"):
        mesh_memory.stack_figures([])


PARTS = {0: {"compute": 0.010, "tp communication": 0.004, "bubble": 0.003, "dp reduction": 0.002,
             "optimizer": 0.001, "other": 0.0005, "step": 0.0205},
         1: {"compute": 0.012, "tp communication": 0.002, "bubble": 0.0, "dp reduction": 0.003, "optimizer": 0.001,
             "other": 0.0, "step": 0.018}}


def _bars(figure: Figure) -> list:
    return [bar for container in figure.axes[0].containers for bar in container]


def test_plot_rank_parts_stacks_each_ranks_parts_in_milliseconds_and_the_model_under_it():
    model = {0: {"F and B": 0.014, "bubble": 0.004}, 1: {"F and B": 0.014, "bubble": 0.004}}
    figure = mesh_plots.plot_rank_parts(PARTS, {0: "rank 0 (0, 0, 0)", 1: "rank 1 (1, 0, 0)"}, model)
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
    assert len(legend) == len(set(legend)) and {"compute", "bubble", "model: bubble"} <= set(legend)
    assert mesh_plots.MODEL_NAMES["F and B"] in legend  # the model's F and B hold its TP all-reduces: said so
    colors = {container.get_label(): container[0].get_facecolor() for container in axis.containers}
    assert len({colors["compute"], colors[mesh_plots.MODEL_NAMES["F and B"]], colors["tp communication"]}) == 3


def test_plot_rank_parts_rejects_unknown_parts_and_negative_times():
    with pytest.raises(ValueError, match="parts is empty"):
        mesh_plots.plot_rank_parts({})
    with pytest.raises(ValueError, match=r"parts\[0\].*'lunch'"):
        mesh_plots.plot_rank_parts({0: {"lunch": 1.0}})
    with pytest.raises(ValueError, match=r"model\[1\]"):
        mesh_plots.plot_rank_parts(PARTS, model={1: {"bubble": -0.1}})


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


def _explorer(monkeypatch):
    """The explorer, its controls by description, and the titles and captions its figures were drawn with."""
    import ipywidgets

    from labkit.viz import mesh_widgets
    from tests.conftest import explorer_controls

    drawn = {"titles": [], "captions": []}
    plot, caption = mesh_memory.plot_memory_choices, mesh_widgets._caption

    def plot_spy(rows, device, title=""):
        drawn["titles"].append(title)
        return plot(rows, device, title)

    def caption_spy(text, **options):
        drawn["captions"].append(text)
        return caption(text, **options)

    monkeypatch.setattr(mesh_widgets.mesh_memory, "plot_memory_choices", plot_spy)
    monkeypatch.setattr(mesh_widgets, "_caption", caption_spy)
    explorer = mesh_widgets.layout_explorer()
    controls = {control.description: control for control in explorer_controls(explorer)}
    summary = next(child for child in explorer.children if isinstance(child, ipywidgets.HTML))
    return controls, summary, drawn


def test_the_explorer_prices_llama_on_the_device_in_its_own_16_bit_format(monkeypatch):
    controls, summary, drawn = _explorer(monkeypatch)
    assert "bf16" in drawn["titles"][-1] and "Llama 2 70B" in drawn["titles"][-1]
    assert "d = 2, t = 8, p = 4, ZeRO-1" in summary.value and "m = 512" in summary.value
    controls["device"].value = "V100 32GB"
    assert "fp16" in drawn["titles"][-1] and "bf16" not in drawn["titles"][-1]
    assert "V100 32GB (fp16)" in drawn["captions"][-1]  # the caption line above the mesh
    controls["ZeRO stage"].value = 2
    assert "whole gradients" in summary.value  # 512 micro-batches accumulate
    assert "with full recomputation" in summary.value and "all-gathers" not in summary.value
    controls["ZeRO stage"].value = 3  # FSDP's gathers: before every micro-batch's forward and backward
    assert "1024 all-gathers a step" in summary.value
    assert "TP intra-node; DP inter-node; PP inter-node" in summary.value
    controls["tensor parallel t"].value, controls["pipeline stages p"].value = 1, 1  # no TP or PP group to name
    controls["micro-batch b"].value = 16  # 1024 / (64 x 16): one micro-batch a replica
    assert "m = 1 micro-batch of 16" in summary.value and summary.value.endswith("; DP inter-node.</small>")


def test_the_explorer_draws_the_layout_with_and_without_recomputation_beside_data_parallelism(monkeypatch):
    from labkit.viz import mesh_widgets

    drawn = []
    plot = mesh_memory.plot_memory_choices

    def plot_spy(rows, device, title=""):
        drawn.append([row["label"] for row in rows])
        return plot(rows, device, title)

    monkeypatch.setattr(mesh_widgets.mesh_memory, "plot_memory_choices", plot_spy)
    mesh_widgets.layout_explorer()
    assert drawn[-1] == ["dp=2 tp=8 pp=4 ZeRO-1", "dp=2 tp=8 pp=4 ZeRO-1, recompute", "dp=64 tp=1 pp=1 ZeRO-1"]
    mesh_widgets.layout_explorer(tp=1, pp=1)  # the layout is data parallelism alone: no third bar
    assert drawn[-1] == ["dp=64 tp=1 pp=1 ZeRO-1", "dp=64 tp=1 pp=1 ZeRO-1, recompute"]


def test_the_explorer_refuses_what_it_cannot_price_and_says_which_rank_it_shows(monkeypatch):
    controls, summary, drawn = _explorer(monkeypatch)
    controls["tensor parallel t"].value = 16  # Llama 2's 8 key/value heads cannot be split 16 ways
    assert "cannot price" in summary.value and "num_kv_heads=8" in drawn["captions"][-1]
    controls["GPUs N"].value = 8  # t p = 64 > 8
    assert "more than the 8 GPUs" in summary.value
    controls["tensor parallel t"].value, controls["pipeline stages p"].value = 8, 1
    assert "cannot price" not in summary.value
    controls["highlighted rank"].value = 50
    assert "highlighted rank 50, above N - 1: rank 7, the last, is shown" in drawn["captions"][-1]


def test_the_explorers_sliders_have_room_for_their_track():
    from labkit.viz.mesh_widgets import SLIDER_TRACK, layout_explorer
    from tests.conftest import explorer_controls

    for control in explorer_controls(layout_explorer()):
        if "IntSlider" in type(control).__name__:
            description = int(control.style.description_width.removesuffix("ch"))
            assert control.layout.width == f"{description + SLIDER_TRACK}ch"


def test_a_measured_pipelines_rows_are_labelled_with_the_ranks_they_ran_on():
    """Review of lesson 10: the measured pipeline of a 2x2x2 run (stage 0 on rank 0, stage 1 on rank 4) was
    labelled "rank 0 / rank 1"."""
    from labkit.parallel.pipeline import one_f_one_b, simulate
    from labkit.viz import pipeline_plots

    simulated = simulate(one_f_one_b(2, 4), 1e-3, 2e-3)
    figure = pipeline_plots.plot_timelines([simulated, simulated], time_unit="s", ranks=[None, [0, 4]])
    ticks = [[label.get_text() for label in axis.get_yticklabels()] for axis in figure.axes]
    assert ticks == [["rank 1\nstage 1", "rank 0\nstage 0"], ["rank 4\nstage 1", "rank 0\nstage 0"]]
    for bad in ([[0, 4]], [None, [0, 4, 8]]):
        with pytest.raises(ValueError, match="one rank per row"):
            pipeline_plots.plot_timelines([simulated, simulated], ranks=bad)
