"""The 3D step model's terms (labkit.costmodel.step, .stages, .timeline): uneven stages, interleaving with any v,
the data-parallel reduction in buckets on the schedule's timeline, NCCL's latencies, a NIC per GPU, the slowdown
of compute beside hidden communication, and the planner's lower bound."""

from __future__ import annotations

import dataclasses
import random

import pytest

from labkit.costmodel import hardware as constants
from labkit.costmodel.collectives import LinkModel, ring_reduce_scatter_cost
from labkit.costmodel.compute import GPUS, head_flops, layer_flops, mfu, model_flops_per_step
from labkit.costmodel.hardware import link_of
from labkit.costmodel.planner import Cluster, candidates
from labkit.costmodel.shapes import TransformerShape, num_parameters
from labkit.costmodel.stages import chunk_parameters, rank_parameters
from labkit.costmodel.step import Hardware, Layout, lower_bound, place_schedule, predict_step
from labkit.parallel.pipeline import catalog
from labkit.parallel.pipeline.simulate import simulate

FREE = LinkModel(0.0, 1e-30)
GPT2, GPT3, LLAMA70 = (TransformerShape.preset(name) for name in ("gpt2", "gpt3-175b", "llama-2-70b"))
H100 = GPUS["H100 80GB"]


def _free(flops: float = 1e14) -> Hardware:
    return Hardware(flops, FREE, FREE)


# --------------------------------------------------------------------------------------------------------
# Uneven stages: the embedding on the first, the output layer on the last


def test_the_output_layer_makes_the_last_stage_the_slowest_and_1f1b_waits_for_it():
    """GPT-2 (vocabulary 50,257: the output layer is 4.5 layers' FLOPs) on 4 stages of 3 layers: the last stage
    computes 3 layers and the logits, and with free sends 1F1B's makespan is the last stage's m passes plus the
    others' one pass each (the fill and the drain): ``m (F_L + B_L) + sum_{r < p-1} (F_r + B_r)``."""
    layout, m = Layout(1, 1, 4), 16
    step = predict_step(GPT2, layout, m, _free())
    layer, head = layer_flops(GPT2, 1) / 1e14, head_flops(GPT2, 1) / 1e14
    assert head / layer == pytest.approx(4.46, abs=0.01)
    last, other = 3 * (3 * layer) + 3 * head, 3 * (3 * layer)
    assert step.forward_s + step.backward_s == pytest.approx(last, rel=1e-12)
    assert step.compute_s == pytest.approx(m * last, rel=1e-12)
    assert step.step_s == pytest.approx(m * last + 3 * other, rel=1e-12)
    balanced = predict_step(GPT2, layout, m, _free(), head_on_last_stage=False)
    assert balanced.step_s == pytest.approx(model_flops_per_step(GPT2, m) / 4 / 1e14 * (m + 3) / m, rel=1e-12)
    assert step.step_s / balanced.step_s == pytest.approx(1.64, abs=0.01)  # lesson 07's uneven-stage pitfall
    assert predict_step(GPT2, Layout(1, 1, 1), m, _free()).step_s == pytest.approx(
        model_flops_per_step(GPT2, m) / 1e14, rel=1e-12)  # one stage: nothing to be uneven


def test_each_rank_holds_its_layers_and_the_first_and_last_their_embeddings():
    """Llama-2 70B (untied) on 4 stages: the first holds the token embedding, the last the output layer and the
    final norm; GPT-2 (tied) keeps a copy of the embedding on the last stage when there are several (as
    Megatron-LM does), so its ranks hold the model plus one embedding."""
    counts = rank_parameters(LLAMA70, Layout(1, 1, 4))
    layer = (num_parameters(LLAMA70) - 2 * 32000 * 8192 - 8192) / 80
    assert counts[1] == counts[2] == 20 * layer
    assert counts[0] == 20 * layer + 32000 * 8192 and counts[3] == 20 * layer + 32000 * 8192 + 8192
    assert sum(counts) == num_parameters(LLAMA70)
    assert sum(rank_parameters(GPT2, Layout(1, 1, 4))) == num_parameters(GPT2) + 50257 * 768
    assert sum(rank_parameters(GPT2, Layout(1, 1, 1))) == num_parameters(GPT2)
    # Llama 3's balanced pipeline: the first chunk only the embedding, the last only the output layer
    chunks = chunk_parameters(LLAMA70, Layout(1, 1, 4, schedule="interleaved", virtual_stages=5), (0,) + (4,) * 18
                              + (8, 0))
    assert chunks[0] == 32000 * 8192 and chunks[-1] == 32000 * 8192 + 8192 and chunks[-2] == 8 * layer


# --------------------------------------------------------------------------------------------------------
# Interleaving with any v


@pytest.mark.parametrize("v", [2, 3, 4, 6, 12])
def test_interleaving_shrinks_the_balanced_bubble_v_fold(v):
    layout = Layout(1, 1, 8, schedule="interleaved", virtual_stages=v)
    step = predict_step(GPT3, layout, 32, _free(1e15), head_on_last_stage=False)
    whole = step.forward_s + step.backward_s
    assert step.bubble_s == pytest.approx(7 * whole / v, rel=1e-9)


def test_the_step_model_places_the_catalogs_orders_as_the_pipeline_simulator_does():
    """labkit.costmodel.step places each rank's order from the schedules' one definition (catalog.ORDERS, the
    orders the tables are built from), through the engine that simulate uses: every pass's start and end equal,
    with uneven chunks and sends."""
    generator = random.Random(0)
    for schedule, p, m, v in (("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 8, 3, 1), ("zb-h1", 6, 12, 1),
                              ("zb-h1", 5, 3, 1), ("interleaved", 4, 16, 4), ("interleaved", 2, 4, 3),
                              ("interleaved-zb", 3, 6, 2), ("zb-v", 3, 7, 2), ("dualpipev", 3, 8, 2)):
        table = catalog.SCHEDULES[schedule](p, m, v)
        assert catalog.ORDERS[schedule](p, m, v).orders() == table.orders()
        stages = table.stages
        forward = [generator.random() for _ in range(stages)]
        backward = [2 * generator.random() for _ in range(stages)]
        for send in (0.0, 0.05):
            simulated = simulate(table, forward, backward, send_s=send)
            placed = place_schedule(schedule, p, m, v, forward, backward, send)
            events = {action: (start, end) for row in simulated.events for start, end, action in row}
            assert all(events[a] == pytest.approx(placed.span(i), abs=1e-12)
                       for i, a in enumerate(placed.compiled.actions))
            assert placed.makespan == pytest.approx(simulated.total, abs=1e-12)


def test_the_reduction_is_never_all_hidden_and_its_latency_grows_with_the_group():
    """On a cluster (planner.Cluster: Megatron's buckets of max(40M, 1M x d) elements, NCCL's latencies, the
    slowdown of hidden communication), the last bucket leaves after the last backward, so the reduction is never
    all hidden, however long the backward; and FSDP's MFU falls as replicas are added at a fixed batch per
    replica, from 31.4 % on one node to 18.0 % on 128 (ZeRO-3 gathers, each a ring of d hops)."""
    cluster = Cluster(H100, 64)
    step = predict_step(LLAMA70, Layout(8, 8, 1, zero=2, recompute=True), 64, cluster.hardware())
    elements = num_parameters(LLAMA70) / 8
    bucket = max(40_000_000, 8_000_000)
    last = ring_reduce_scatter_cost(2 * bucket, 8, cluster.hardware().inter_node, element_size=2).time_s
    assert step.backward_s > ring_reduce_scatter_cost(int(2 * elements), 8, cluster.hardware().inter_node,
                                                      element_size=2).time_s  # long enough to hide it all
    assert step.dp_s >= last  # the last bucket at least
    ideal = predict_step(LLAMA70, Layout(8, 8, 1, zero=2, recompute=True), 64,
                         dataclasses.replace(cluster.hardware(), dp_bucket_elements=None, overlap_slowdown=0.0))
    assert ideal.dp_s == 0  # the ideal stream hides it all: the old model's 0.000 s
    mfus = []
    for d in (1, 2, 4, 8, 16, 32, 64, 128):
        layout = Layout(d, 8, 1, zero=3, recompute=True)
        hardware = Cluster(H100, 8 * d).hardware()
        step = predict_step(LLAMA70, layout, 8 * d, hardware, gradient_bytes=4, overlap_gather=True)
        mfus.append(mfu(model_flops_per_step(LLAMA70, 8 * d), step.step_s, 8 * d, H100.peak_bf16_flops))
    assert mfus == sorted(mfus, reverse=True)
    assert round(100 * mfus[0], 1) == 31.4 and round(100 * mfus[-1], 1) == 18.0


def test_nccl_latency_is_a_call_and_a_ring_step_each_hop():
    """hardware.py's constants are NCCL 2.30.7's (tuning.cc, ring, Simple protocol): 8.4 us a call, 3.4 us a
    step over NVLink, 14 us over the network; a TP all-reduce pays the call once, its 2 (t - 1) steps each."""
    assert (constants.NCCL_CALL_LATENCY_S, constants.NVLINK_LATENCY_S, constants.INFINIBAND_LATENCY_S) == (
        8.4e-6, 3.4e-6, 14e-6)
    empty = TransformerShape(12, 8, 8, 4, 8)  # tiny messages
    cluster = Cluster(H100, 8, 0.5)
    step = predict_step(empty, Layout(1, 8, 1), 1, cluster.hardware())
    one = (2 * 7 * 3.4e-6 + 8.4e-6) + 2 * 7 / 8 * (4 * 8 * 2) / H100.nvlink_bandwidth
    assert step.tp_s == pytest.approx(empty.num_layers * 4 * one, rel=1e-9)


def test_a_group_across_dgx_nodes_drives_a_nic_per_member():
    """Rails: the DP group of t = 1 (all 8 GPUs of each node) runs at 8 NICs' bandwidth (400 GB/s; at most
    NVLink's 450); of t = 4, at 2; of t = 8, at one GPU's; a group inside a node, on NVLink."""
    hardware = Cluster(H100, 384, 0.5).hardware()
    assert link_of(hardware, 1, 48).bandwidth_bytes_per_s == pytest.approx(8 * H100.network_bandwidth)
    assert link_of(hardware, 4, 48).bandwidth_bytes_per_s == pytest.approx(2 * H100.network_bandwidth)
    assert link_of(hardware, 8, 48).bandwidth_bytes_per_s == pytest.approx(H100.network_bandwidth)
    assert link_of(hardware, 1, 8) == hardware.intra_node
    assert link_of(dataclasses.replace(hardware, rails=False), 1, 48) == hardware.inter_node
    assert link_of(hardware, 3, 48) == hardware.inter_node  # 3 does not divide a node: one member's NIC


def test_overlapped_tp_costs_what_outlasts_the_compute_and_the_slowdown():
    layout = Layout(1, 8, 1)
    hardware = Cluster(H100, 8, 0.5).hardware()
    plain = predict_step(GPT3, layout, 8, hardware)
    hidden = predict_step(GPT3, layout, 8, hardware, overlap_tp=True)
    assert hidden.compute_s == pytest.approx(plain.compute_s, rel=1e-12) and plain.tp_s < plain.compute_s / 2
    assert hidden.tp_s == pytest.approx(constants.OVERLAP_SLOWDOWN * plain.tp_s, rel=1e-9)


def test_the_planners_lower_bound_never_exceeds_the_step():
    generator = random.Random(1)
    for shape, gpus, batch in ((GPT3, 512, 1536), (LLAMA70, 64, 1024), (TransformerShape.preset("gpt2-xl"), 16,
                                                                         256)):
        hardware = Cluster(H100, gpus, 0.53).hardware()
        for layout in generator.sample(candidates(shape, gpus, batch), 25):
            for options in ({}, {"overlap_tp": True, "overlap_gather": True, "gradient_bytes": 4},
                            {"overlap_dp": False}):
                step = predict_step(shape, layout, batch, hardware, **options)
                assert lower_bound(shape, layout, batch, hardware, **options) <= step.step_s * (1 + 1e-12)
                assert step.bubble_s >= -1e-9 * step.step_s


def test_uneven_stage_layers_must_add_up():
    with pytest.raises(ValueError, match="stage_layers must give each of the 4 chunks its layers"):
        predict_step(GPT2, Layout(1, 1, 4), 8, _free(), stage_layers=(3, 3, 3))
    with pytest.raises(ValueError, match="12 in all"):
        predict_step(GPT2, Layout(1, 1, 4), 8, _free(), stage_layers=(3, 3, 3, 4))
    step = predict_step(GPT2, Layout(1, 1, 4), 8, _free(), stage_layers=(4, 4, 3, 1))
    assert step.forward_s == pytest.approx(max(4 * layer_flops(GPT2, 1), layer_flops(GPT2, 1) + head_flops(GPT2, 1))
                                           / 1e14, rel=1e-12)
