"""Lesson 06's additions: the per-rank and per-layer cost model of tensor parallelism, what its CPU step model is
fed (``labkit.parallel.tensor.timing``), its plots and its explorer."""

from __future__ import annotations

import time

import ipywidgets
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from labkit.costmodel import compute
from labkit.costmodel import tensor_parallel as tp_model
from labkit.costmodel.collectives import LinkModel, ring_all_reduce_cost
from labkit.launch import launch
from labkit.models import Block, GPTConfig, TinyGPT
from labkit.viz import tensor_plots, widgets
from tests.conftest import check_every_control_redraws, explorer_controls

NVLINK, INFINIBAND = LinkModel(5e-6, 1 / 450e9), LinkModel(8e-6, 1 / 50e9)
PEAK = compute.GPUS["H100 80GB"].peak_bf16_flops


# ---------------------------------------------------------------------------------------------------------
# The cost model


def _held_by_a_rank(config: GPTConfig) -> tuple[int, int]:
    from labkit.mesh import Mesh
    from labkit.parallel.tensor import parallelize_tensor

    torch.set_num_threads(1)
    model = parallelize_tensor(TinyGPT(config, seed=0), Mesh(tp=torch.distributed.get_world_size()))
    split = model.split_parameters()
    held = dict(model.module.named_parameters())  # a tied weight once
    return (sum(p.numel() for name, p in held.items() if name in split),
            sum(p.numel() for name, p in held.items() if name not in split))


@pytest.mark.parametrize(("overrides", "world_size"), [({}, 2), ({"vocab_size": 30, "tie_weights": False}, 4),
                                                       ({"bias": False, "vocab_size": 30}, 4)])
def test_parameters_per_rank_counts_what_a_tensor_parallel_rank_holds(overrides, world_size):
    config = GPTConfig.preset("100k", **overrides)
    held = tp_model.parameters_per_rank(config, world_size)
    for split, whole in launch(_held_by_a_rank, config, nprocs=world_size):
        assert (split, whole) == (held["split"], held["replicated"])
    dense = TinyGPT(config).num_parameters()
    if config.vocab_size % world_size:  # the padding rows are held too: more than the dense split over t
        assert held["split"] * world_size > dense - held["replicated"]
    else:
        assert held["split"] * world_size == dense - held["replicated"]


def test_layer_training_flops_match_torchs_count_of_a_block_forward_and_backward():
    config = GPTConfig(n_embd=64, n_head=4, block_size=32)
    block, x = Block(config), torch.randn(2, 32, 64, requires_grad=True)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:  # attention as matrix products
        block(x).sum().backward()
    assert counter.get_total_flops() == tp_model.layer_training_flops(2, 32, 64)
    assert tp_model.layer_training_flops(2, 32, 64) != 3 * 24 * 2 * 32 * 64**2  # the s^2 term counts
    with pytest.raises(ValueError, match="seq_len"):
        tp_model.layer_training_flops(1, 0, 64)


def test_layer_time_is_compute_over_t_beside_four_ring_all_reduces_that_do_not_shrink():
    b, s, h = 1, 4096, 8192
    single = tp_model.tensor_parallel_layer_time(b, s, h, 1, PEAK, NVLINK)
    assert single.communication_s == 0 and single.collectives == 0 and single.communication_fraction == 0
    previous = single
    for t in (2, 4, 8, 64):
        layer = tp_model.tensor_parallel_layer_time(b, s, h, t, PEAK, NVLINK)
        assert layer.compute_s == pytest.approx(single.compute_s / t)
        all_reduce = ring_all_reduce_cost(b * s * h * 2, t, NVLINK, element_size=2).time_s
        assert layer.collectives == 4 and layer.communication_s == pytest.approx(4 * all_reduce)
        assert layer.communication_s > previous.communication_s  # more ranks, more ring steps: never less
        slow = tp_model.tensor_parallel_layer_time(b, s, h, t, PEAK, INFINIBAND)
        assert slow.communication_fraction > layer.communication_fraction
        previous = layer
    parallel = tp_model.tensor_parallel_layer_time(b, s, h, 8, PEAK, NVLINK, sequence_parallel=True)
    assert parallel.collectives == 10  # per half: all-gather, reduce-scatter forward; three backward
    with pytest.raises(ValueError, match="peak_flops"):
        tp_model.tensor_parallel_layer_time(b, s, h, 8, 0.0, NVLINK)


def test_t_must_divide_the_heads_the_hidden_size_and_under_gqa_the_key_value_heads():
    assert tp_model.valid_tp_degrees(8192, 64) == [1, 2, 4, 8, 16, 32, 64]
    assert tp_model.valid_tp_degrees(8192, 64, kv_heads=8) == [1, 2, 4, 8]  # Llama-2-70B: 8 key/value heads
    assert tp_model.valid_tp_degrees(12288, 96, limit=8) == [1, 2, 3, 4, 6, 8]
    assert "n_head=64 and n_embd=8192 must both be divisible by 52" in tp_model.tensor_parallel_size_problem(
        8192, 64, 52)
    assert "8 key/value heads must be divisible by 16" in tp_model.tensor_parallel_size_problem(8192, 64, 16, 8)
    assert "cannot be shared evenly" in tp_model.tensor_parallel_size_problem(1280, 10, 2, 8)
    assert tp_model.tensor_parallel_size_problem(8192, 64, 8, 8) is None
    with pytest.raises(ValueError, match="kv_heads"):
        tp_model.tensor_parallel_size_problem(8192, 64, 8, 0)


def test_vocabulary_padding_labkits_rule_and_megatrons():
    from labkit.parallel.tensor.layers import MEGATRON_VOCAB_DIVISIBLE_BY, padded_size

    assert MEGATRON_VOCAB_DIVISIBLE_BY == 128
    # GPT-2's 50,257 and Llama 2's 32,000 tokens at t = 8: a multiple of 8, or (Megatron-LM) of 128 * 8 = 1024
    assert [padded_size(50_257, 8), padded_size(32_000, 8)] == [50_264, 32_000]
    assert [padded_size(50_257, 8, 128), padded_size(32_000, 8, 128)] == [51_200, 32_768]
    assert padded_size(50_257, 1, 128) == 50_304  # Megatron's GPT-2 without tensor parallelism
    with pytest.raises(ValueError, match="divisible_by"):
        padded_size(30, 2, 0)
    config = GPTConfig.preset("100k", vocab_size=30)
    megatron = tp_model.parameters_per_rank(config, 2, vocab_divisible_by=8)  # 30 -> 32: 2 padding rows
    assert megatron["split"] - tp_model.parameters_per_rank(config, 2)["split"] == config.n_embd


# ---------------------------------------------------------------------------------------------------------
# labkit.parallel.tensor.timing: what the lesson's CPU step model is fed (no assert on a measured time)


def test_split_kernels_time_the_products_attention_and_gelu_only(monkeypatch):
    import types

    import torch.nn.functional as F

    from labkit.parallel.tensor import timing

    assert all(map(timing.is_split_kernel, ("aten::mm", "addmm", "aten::bmm.default", "aten::gelu_backward",
                                            "aten::_scaled_dot_product_flash_attention_for_cpu_backward")))
    assert not any(map(timing.is_split_kernel, ("aten::native_layer_norm", "aten::add", "aten::embedding",
                                                "aten::_softmax", "aten::mul")))
    # A known workload under a clock that moves one second each time it is read: the two reads around a split
    # kernel count 1 s, a kernel outside the split is not read around and counts nothing.
    ticks = iter(range(1_000))
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(thread_time=lambda: float(next(ticks))))
    a, b, x = torch.randn(4, 8), torch.randn(8, 4), torch.randn(2, 4, 4)
    with timing.SplitKernels() as kernels:
        torch.mm(a, b)  # split: 4 of these
        torch.addmm(torch.zeros(4, 4), a, b)
        torch.bmm(x, x)
        F.gelu(a)
        F.layer_norm(a, (8,))  # whole on every rank: 4 of these
        F.softmax(a, dim=-1)
        a + a
        F.embedding(torch.tensor([0, 1]), a)
    assert (kernels.calls, kernels.split_s) == (4, 4.0)


def test_split_kernels_find_every_split_kernel_of_a_block_in_its_real_time():
    from labkit.parallel.tensor.timing import SplitKernels

    torch.manual_seed(0)
    block, x = Block(GPTConfig(n_embd=32, n_head=2, block_size=16)), torch.randn(2, 16, 32)
    start = time.thread_time()
    with SplitKernels() as kernels:
        block(x).sum().backward()
    # forward: query, key, value, proj, fc, proj (6 products), attention, GeLU; backward: two products per
    # weight gradient and input gradient of each, attention's, GeLU's
    assert kernels.calls >= 6 + 2 + 6 * 2 + 2
    assert isinstance(kernels.split_s, float) and 0 < kernels.split_s <= time.thread_time() - start


def _machine_costs(message_bytes):
    from labkit.parallel.tensor.timing import shared_machine_costs

    torch.set_num_threads(1)
    return shared_machine_costs(message_bytes, repeats=2, rounds=1, burst=(16, 16, 16))


@pytest.mark.parametrize("nprocs", [1, 2])
def test_shared_machine_costs_give_every_rank_the_slowdown_and_a_cost_per_size(nprocs):
    results = launch(_machine_costs, (4096, 64), nprocs=nprocs, timeout=60)
    assert all(result == results[0] for result in results)  # every rank gets the same answer
    costs = results[0]
    assert set(costs) == {"slowdown", "collective_s"}
    assert isinstance(costs["slowdown"], float) and costs["slowdown"] > 0
    assert list(costs["collective_s"]) == [4096, 64]
    assert all(isinstance(seconds, float) and seconds >= 0 for seconds in costs["collective_s"].values())


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"message_bytes": ()}, r"message_bytes .*got \(\)"), ({"message_bytes": (2,)}, r"got \(2,\)"),
    ({"message_bytes": (4096, 6)}, r"got \(4096, 6\)"), ({"repeats": 0}, "repeats .*got 0"),
    ({"rounds": 1.5}, "rounds .*got 1.5"), ({"burst": (16, 0, 16)}, r"burst .*got \(16, 0, 16\)")])
def test_shared_machine_costs_refuse_bad_input_naming_it(kwargs, named):
    from labkit.parallel.tensor.timing import shared_machine_costs

    # refused before it looks for a process group: no ranks needed
    with pytest.raises(ValueError, match=named):
        shared_machine_costs(**{"message_bytes": (64,)} | kwargs)


# ---------------------------------------------------------------------------------------------------------
# The plots


def _rank_strips(axis) -> list:
    return [patch for patch in axis.patches if patch.get_facecolor()[:3] != (1.0, 1.0, 1.0)]


@pytest.mark.parametrize("tp_degree", [1, 2, 4])
def test_split_picture_cuts_a_by_columns_and_b_by_rows_with_f_and_g_around_them(tp_degree):
    figure = tensor_plots.plot_tensor_parallel_split(tp_degree)
    column, row, flow = figure.axes
    a_strips, b_strips = _rank_strips(column), _rank_strips(row)
    assert len(a_strips) == len(b_strips) == tp_degree
    assert len({strip.get_height() for strip in a_strips}) == 1 and len({strip.get_y() for strip in a_strips}) == 1
    assert len({strip.get_width() for strip in b_strips}) == 1 and len({strip.get_x() for strip in b_strips}) == 1
    if tp_degree > 1:  # side by side (columns) in A, stacked (rows) in B
        assert len({strip.get_x() for strip in a_strips}) == tp_degree
        assert len({strip.get_y() for strip in b_strips}) == tp_degree
    texts = [text.get_text() for text in flow.texts]
    assert sum(text.startswith("f\n") for text in texts) == 1 and sum(text.startswith("g\n") for text in texts) == 1
    assert "backward:\nall-reduce" in next(text for text in texts if text.startswith("f\n"))
    assert sum("partial sum" in text for text in texts) == tp_degree
    with pytest.raises(ValueError, match="tp_degree"):
        tensor_plots.plot_tensor_parallel_split(0)


def test_communication_bars_have_the_measured_heights_and_the_models_ticks():
    measured = {"t = 2": {"all_reduce": 2 * 2**20}, "t = 2, SP": {"all_gather": 3 * 2**20, "reduce_scatter": 2**20}}
    predicted = {"t = 2": {"all_reduce": 2 * 2**20}, "t = 2, SP": {"all_gather": 3 * 2**20, "reduce_scatter": 2**20}}
    figure = tensor_plots.plot_communication_bytes(measured, predicted)
    axis = figure.axes[0]
    heights = sorted(bar.get_height() for bar in axis.patches)
    assert heights == [0, 0, 0, 1, 2, 3]  # three kinds for each of two configurations, in MiB
    ticks = sorted(line.get_ydata()[0] for line in axis.lines)
    assert ticks == [1, 2, 3] and "MiB" in axis.get_ylabel()
    labels = [text.get_text() for text in axis.get_legend().get_texts()]
    assert sorted(labels) == ["all-gather", "all-reduce", "model", "reduce-scatter"]


def test_run_plot_puts_memory_and_step_time_against_the_degree_with_units():
    figure = tensor_plots.plot_tensor_parallel_run([1, 2, 4], {"activations": [4 * 2**20, 3 * 2**20, 2 * 2**20]},
                                                   {"activations": [4 * 2**20, 3 * 2**20, 2 * 2**20]},
                                                   [0.05, 0.06, 0.1], [0.05, 0.03, 0.02])
    memory_axis, time_axis = figure.axes
    assert list(memory_axis.lines[0].get_ydata()) == [4, 3, 2] and "MiB" in memory_axis.get_ylabel()
    assert list(time_axis.lines[0].get_ydata()) == pytest.approx([50, 60, 100]) and "ms" in time_axis.get_ylabel()
    assert len(tensor_plots.plot_tensor_parallel_run([1, 2], {"weights": [2.0, 1.0]}).axes) == 1


def test_layer_time_plot_marks_the_node_and_gives_each_links_share():
    degrees = [1, 2, 4, 8, 16]
    compute_s = [16e-3 / t for t in degrees]
    communication = {"fast": [0.0, 1e-3, 2e-3, 3e-3, 9e-3], "slow": [0.0, 8e-3, 9e-3, 9e-3, 9e-3]}
    figure = tensor_plots.plot_layer_time(degrees, compute_s, communication, 8, "fast", node_size=8)
    curves, bars = figure.axes
    assert any(list(line.get_xdata()) == [8, 8] for line in curves.lines)  # the node's edge
    shares = sorted(text.get_text().strip() for text in bars.texts)
    assert shares == ["60% communicating", "82% communicating"]  # 3 / (2 + 3) and 9 / (2 + 9)
    assert "ms" in curves.get_ylabel() and "ms" in bars.get_xlabel()
    small = tensor_plots.plot_layer_time([1, 2, 4], compute_s[:3], {"fast": communication["fast"][:3]}, 2, "fast",
                                         node_size=8)
    assert not any(list(line.get_xdata()) == [8, 8] for line in small.axes[0].lines)  # no edge beyond the degrees
    # the time axis reads in numbers, several of them, not a lone "10^2"
    figure.canvas.draw()
    inside = [(tick, label.get_text()) for tick, label in zip(curves.get_yticks(), curves.get_yticklabels(), strict=True)
              if curves.get_ylim()[0] <= tick <= curves.get_ylim()[1]]
    assert len(inside) >= 3 and all(text and "10^" not in text and "$" not in text for _, text in inside)
    with pytest.raises(ValueError, match="chosen_link"):
        tensor_plots.plot_layer_time(degrees, compute_s, communication, 8, "pigeon")
    with pytest.raises(ValueError, match="chosen_degree"):
        tensor_plots.plot_layer_time(degrees, compute_s, communication, 3, "fast")


# ---------------------------------------------------------------------------------------------------------
# The explorer


def _to_the_other_end(control) -> None:
    if isinstance(control, ipywidgets.Dropdown):
        control.value = next(option for option in control.options if option != control.value)
    else:
        control.value = control.max if control.value != control.max else control.min


def test_tensor_parallel_explorer_redraws_on_release_for_every_control():
    # 7: tests/test_browser.py's count for 06_tensor_parallel
    check_every_control_redraws(widgets.tensor_parallel_explorer(), 7, _to_the_other_end)


def _controls(explorer) -> dict:
    return {control.description: control for control in explorer_controls(explorer)}


def test_tensor_parallel_explorer_refuses_a_degree_that_does_not_split_whole_heads():
    explorer = widgets.tensor_parallel_explorer(hidden_size=8192, tp_degree=8)
    controls, summary = _controls(explorer), explorer.children[1]
    controls["TP degree t"].value = 52  # 64 heads of 128: 52 divides neither them nor 8192
    assert controls["TP degree t"].value == 64
    assert "t = 52 refused" in summary.value and "n_head=64 and n_embd=8192" in summary.value
    assert "t may be 1, 2, 4, 8, 16, 32, 64" in summary.value
    controls["TP degree t"].value = 32
    assert "refused" not in summary.value  # said once, at the degree it moved to
    controls["key/value heads"].value = next(label for label, kv in widgets.KV_HEADS.items() if kv == 8)
    assert controls["TP degree t"].value == 8  # Llama-2-70B's 8 key/value heads: t at most 8
    assert "t = 32 refused" in summary.value and "8 key/value heads must be divisible by 32" in summary.value
    controls["hidden h"].value = 1280  # 10 heads: not in groups of 8
    assert "cannot be shared evenly" in summary.value and "t may be 1, 2, 5, 10" in summary.value
    refused_gqa = explorer.children[2].value  # the figure says so too (its title): it differs from multi-head's
    controls["key/value heads"].value = next(label for label, kv in widgets.KV_HEADS.items() if kv is None)
    assert explorer.children[2].value != refused_gqa


def test_tensor_parallel_explorer_draws_only_the_valid_degrees():
    explorer = widgets.tensor_parallel_explorer(hidden_size=12288, tp_degree=8)
    degrees = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48]  # 96 heads of 128
    assert f"t may be {', '.join(map(str, degrees))}" in explorer.children[1].value
    explorer = widgets.tensor_parallel_explorer(hidden_size=8192, tp_degree=16, kv_heads=8)
    assert _controls(explorer)["TP degree t"].value == 8 and "t = 16 refused" in explorer.children[1].value


def test_tensor_parallel_explorer_says_when_the_group_leaves_the_node():
    explorer = widgets.tensor_parallel_explorer(tp_degree=8)
    summary = explorer.children[1]
    degree = next(control for control in explorer_controls(explorer) if control.description == "TP degree t")
    assert "over NVLink 4:" in summary.value and "crosses" not in summary.value
    degree.value = 16
    assert "the ring crosses InfiniBand NDR" in summary.value
    degree.value = 1
    assert "no communication" in summary.value
