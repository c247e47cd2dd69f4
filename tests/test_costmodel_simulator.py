"""Lesson 11's event-driven step simulator (labkit.costmodel.simulator) and this machine's calibration
(labkit.costmodel.calibration): the pipeline closed forms exactly, the terms the closed forms cannot give
(queued sends, bucket overlap, FSDP's prefetch, processor sharing), the scaling curves, bad input."""

from __future__ import annotations

import dataclasses
import json

import pytest

from labkit.costmodel.calibration import Calibration, average, load, save
from labkit.costmodel.collectives import LinkModel, ring_all_reduce_cost
from labkit.costmodel.compute import GPUS, model_flops_per_step
from labkit.costmodel.shapes import TransformerShape, num_parameters
from labkit.costmodel.simulator import PARTS, effective_cores, scaling, simulate_step, straggle_factor
from labkit.costmodel.step import Hardware, Layout, closed_form_makespan, predict_step, stage_times

FREE = LinkModel(0.0, 0.0)
GPT3 = TransformerShape.preset("gpt3-175b")
H100 = Hardware(0.5 * GPUS["H100 80GB"].peak_bf16_flops, LinkModel(5e-6, 1 / 450e9), LinkModel(1e-5, 1 / 50e9))


def _close(a: float, b: float) -> bool:
    return a == pytest.approx(b, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(("schedule", "p", "m", "v"), [
    ("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 8, 8, 1), ("1f1b", 2, 16, 1), ("interleaved", 4, 8, 2),
    ("interleaved", 4, 16, 3), ("interleaved", 2, 4, 4), ("zb-h1", 4, 8, 1), ("zb-h1", 6, 12, 1)])
@pytest.mark.parametrize("tp", [1, 4])
def test_uniform_stages_and_free_sends_give_the_closed_forms_exactly(schedule, p, m, v, tp):
    shape = TransformerShape(48, 1024, 16, 512, 32000)
    layout = Layout(2, tp, p, micro_batch=1, schedule=schedule, virtual_stages=v)
    if schedule == "zb-h1" and tp > 1:
        tp = 1  # ZB-H1's closed form splits the whole backward in halves; the simulator puts TP in I alone
        layout = dataclasses.replace(layout, tp=1)
    hardware = Hardware(1e13, FREE, FREE)
    step = simulate_step(shape, layout, 2 * m, hardware)
    _, v_, forward, backward, tp_forward, tp_backward = stage_times(shape, layout, 2 * m, hardware)
    expected = closed_form_makespan(schedule, p, m, forward + tp_forward, backward + tp_backward, v_)
    assert _close(step.step_s, expected) and _close(step.pipeline_s, expected)
    assert _close(step.parts["compute"], m * (forward + backward))
    assert _close(step.parts["bubble"], expected - m * (forward + backward + tp_forward + tp_backward))
    assert step.parts["pp send"] == step.parts["dp"] == step.parts["zero"] == 0
    assert _close(sum(step.parts.values()), step.step_s) and set(step.parts) == set(PARTS)
    assert step.events == (3 if schedule == "zb-h1" else 2) * m * v * p  # every pass of every stage, once


def test_the_simulated_step_agrees_with_the_closed_form_model_where_it_should():
    """Compute, TP and the bubble are the same in both, for the uniform stages the simulator runs (the step
    model's balanced pipeline: ``head_on_last_stage=False``, every rank sending ``b s h``); sends, DP and ZeRO
    differ by what the events add."""
    for layout in (Layout(64, 8, 8, zero=1), Layout(8, 8, 16, schedule="interleaved", virtual_stages=2),
                   Layout(32, 8, 4, schedule="zb-h1"), Layout(16, 8, 8, zero=3, schedule="gpipe")):
        simulated = simulate_step(GPT3, layout, 1536, H100)
        predicted = predict_step(GPT3, layout, 1536, H100, head_on_last_stage=False, sequence_parallel=False)
        assert _close(simulated.parts["compute"], predicted.compute_s)
        assert _close(simulated.parts["tp"], predicted.tp_s)
        assert simulated.step_s == pytest.approx(predicted.step_s, rel=0.1), layout.label()
        assert _close(sum(simulated.parts.values()), simulated.step_s)


def test_sends_on_one_link_queue_and_count_as_pp_send():
    shape = TransformerShape(8, 1024, 16, 512, 32000)
    slow = Hardware(1e13, LinkModel(0.0, 1e-7), LinkModel(0.0, 1e-7), gpus_per_node=1)
    layout = Layout(1, 1, 4, micro_batch=1)
    step = simulate_step(shape, layout, 8, slow)
    assert step.parts["pp send"] > 0 and step.step_s > predict_step(shape, layout, 8, Hardware(1e13, FREE, FREE)).step_s
    # a send far longer than a pass: the link is the bottleneck, sends queue one after another on it
    send = 1 * 512 * 1024 * 2 * 1e-7
    forward = stage_times(shape, layout, 8, slow)[2]
    assert send > forward
    assert step.pipeline_s >= 8 * send


def test_buckets_overlap_the_last_backward():
    shape = TransformerShape(8, 2048, 16, 1024, 32000)
    hardware = Hardware(1e14, LinkModel(1e-5, 1 / 20e9), LinkModel(1e-5, 1 / 20e9), gpus_per_node=1)
    layout = Layout(8, 1, 1, micro_batch=1)
    overlapped = simulate_step(shape, layout, 8, hardware, overlap_dp=True)
    after = simulate_step(shape, layout, 8, hardware, overlap_dp=False)
    local = num_parameters(shape) * 2
    whole = ring_all_reduce_cost(local - local % 4, 8, hardware.inter_node).time_s
    assert after.parts["dp"] >= whole * 0.99  # buckets pay alpha each: at least the one all-reduce
    assert overlapped.parts["dp"] < after.parts["dp"] - 0.5 * stage_times(shape, layout, 8, hardware)[3]
    one_bucket = [simulate_step(shape, layout, 8, hardware, overlap_dp=overlap, bucket_bytes=1e12).parts["dp"]
                  for overlap in (True, False)]
    assert one_bucket[0] == pytest.approx(one_bucket[1], rel=1e-9) == pytest.approx(whole, rel=1e-9)  # waits for all


def test_fsdp_prefetch_hides_gathers_behind_long_passes():
    shape = TransformerShape(8, 2048, 16, 1024, 32000)
    link = LinkModel(1e-5, 1 / 20e9)
    layout = Layout(8, 1, 1, zero=3, micro_batch=1)
    slow_compute = simulate_step(shape, layout, 64, Hardware(1e12, link, link, gpus_per_node=1))
    fast_compute = simulate_step(shape, layout, 64, Hardware(1e15, link, link, gpus_per_node=1))
    assert slow_compute.parts["zero"] / slow_compute.step_s < 0.05 < fast_compute.parts["zero"] / fast_compute.step_s


def test_processor_sharing_slows_compute_by_the_ranks_per_core():
    shape = TransformerShape(4, 256, 4, 128, 64)
    alone = Hardware(1e10, FREE, FREE, gpus_per_node=64)
    for d, cores in ((8, 2), (4, 2), (2, 4), (16, 4)):
        layout = Layout(d, 1, 1, micro_batch=1)
        shared = simulate_step(shape, layout, d, dataclasses.replace(alone, cores=cores))
        own = simulate_step(shape, layout, d, alone)
        assert _close(shared.step_s, own.step_s * max(1, d / cores))
    # a pipeline on 2 cores: 4 stages, 2 ranks each (tp=2): while stage 0 fills the pipeline it has the CPU to
    # itself, so the bubble costs less than on 4 devices, and the compute share more
    layout = Layout(1, 2, 4, micro_batch=1)
    shared = simulate_step(shape, layout, 8, dataclasses.replace(alone, cores=2))
    own = simulate_step(shape, layout, 8, alone)
    assert own.step_s < shared.step_s < 4 * own.step_s
    assert shared.parts["bubble"] / shared.step_s < own.parts["bubble"] / own.step_s


def test_a_measured_throughput_curve_replaces_the_ideal_cores():
    """8 ranks on 2 cores may get less than 2 cores' worth (they evict each other's caches): a calibration
    measures the curve, and the simulator interpolates it."""
    assert effective_cores(2, 8) == 2 and effective_cores(2, 1) == 1
    curve = (1.0, 1.8, 1.7, 1.6)
    assert effective_cores(curve, 1) == 1.0 and effective_cores(curve, 2.5) == pytest.approx(1.75)
    assert effective_cores(curve, 8) == 1.6
    shape = TransformerShape(4, 256, 4, 128, 64)
    layout = Layout(4, 1, 1, micro_batch=1)
    alone = Hardware(1e10, FREE, FREE, gpus_per_node=64)
    measured = simulate_step(shape, layout, 4, dataclasses.replace(alone, cores=curve))
    assert _close(measured.step_s, simulate_step(shape, layout, 4, alone).step_s * 4 / 1.6)


def test_a_group_waits_for_its_slowest_rank_where_ranks_share_cores():
    """Time slices are not shared fairly over short times: a TP group waits after each pass for its slowest rank
    (straggle[t - 1] - 1 times the pass), the replicas before their reduction (that of the step so far); only
    where ranks share cores, and one rank never waits for itself."""
    assert straggle_factor((1.0, 1.2, 1.3), 1) == 1.0 and straggle_factor((1.0, 1.2, 1.3), 2) == 1.2
    assert straggle_factor((1.0, 1.2, 1.3), 8) == 1.3 and straggle_factor((), 4) == 1.0
    shape = TransformerShape(4, 256, 4, 128, 64)
    link = LinkModel(1e-4, 1e-9)
    alone = Hardware(1e10, link, link, gpus_per_node=64, cores=8)
    slow = dataclasses.replace(alone, straggle=(1.0, 1.5, 1.5, 1.5))
    tensor = Layout(1, 2, 1, micro_batch=1)  # one pass each way, each followed by its all-reduces
    even, uneven = simulate_step(shape, tensor, 4, alone), simulate_step(shape, tensor, 4, slow)
    assert _close(uneven.parts["compute"], even.parts["compute"])
    assert _close(uneven.parts["tp"] - even.parts["tp"], 0.5 * even.parts["compute"])
    assert any(what.startswith("tp wait") for _, _, what in uneven.timeline[0])
    data = Layout(2, 1, 1, micro_batch=1)  # the replicas wait before their all-reduce for the slowest one
    even, uneven = simulate_step(shape, data, 4, alone, overlap_dp=False), simulate_step(
        shape, data, 4, slow, overlap_dp=False)
    assert _close(uneven.parts["dp"] - even.parts["dp"], 0.5 * even.parts["compute"])
    one = Layout(1, 1, 1, micro_batch=1)
    assert _close(simulate_step(shape, one, 4, slow).step_s, simulate_step(shape, one, 4, alone).step_s)
    on_gpus = dataclasses.replace(slow, cores=None)  # each rank on its own device: no sharing, no straggler
    assert _close(simulate_step(shape, tensor, 4, on_gpus).step_s,
                  simulate_step(shape, tensor, 4, dataclasses.replace(alone, cores=None)).step_s)


def test_optimizer_and_zero_gathers_follow_the_reduction():
    shape = TransformerShape(8, 1024, 16, 512, 32000)
    hardware = Hardware(1e13, LinkModel(1e-5, 1e-10), LinkModel(1e-5, 1e-10), gpus_per_node=1)
    plain = simulate_step(shape, Layout(4, 1, 1), 4, hardware, optimizer_s=0.1)
    sharded = simulate_step(shape, Layout(4, 1, 1, zero=1), 4, hardware, optimizer_s=0.1)
    assert _close(plain.parts["optimizer"], 0.1) and _close(sharded.parts["optimizer"], 0.025)
    assert sharded.parts["zero"] > 0 == plain.parts["zero"]
    labels = [what for _, _, what in sharded.timeline[0]]
    assert labels.index("optimizer") < labels.index("zero all-gather")


def test_strong_and_weak_scaling_curves():
    """Strong scaling (fixed batch): MFU falls as the GPUs grow, the pipeline's bubble and the DP reduction
    taking a larger share — the shape of the Megatron-LM README's 175B strong scaling (about 47% at 96 H100s to
    42% at 4608).  Weak scaling (batch per replica fixed): MFU stays put while tokens/s grow with the GPUs."""
    peak = GPUS["H100 80GB"].peak_bf16_flops

    def megatron(gpus: int, batch: int) -> Layout:
        return Layout(gpus // 96, 8, 12, micro_batch=1, schedule="interleaved", virtual_stages=4)

    strong = scaling(GPT3, H100, peak, [96, 384, 1152, 4608], 1152, megatron)
    mfus = [point.mfu for point in strong]
    assert mfus == sorted(mfus, reverse=True) and mfus[0] - mfus[-1] > 0.02
    assert [point.step.parts["bubble"] / point.step.step_s for point in strong] == sorted(
        point.step.parts["bubble"] / point.step.step_s for point in strong)
    weak = scaling(GPT3, H100, peak, [96, 384, 1536], lambda gpus: 12 * gpus // 96 * 8, megatron)
    assert max(point.mfu for point in weak) - min(point.mfu for point in weak) < 0.02
    assert weak[-1].tokens_per_s > 10 * weak[0].tokens_per_s
    flops = model_flops_per_step(GPT3, 1152)
    assert strong[0].mfu == pytest.approx(flops / strong[0].step.step_s / 96 / peak)
    with pytest.raises(ValueError, match="not 96"):
        scaling(GPT3, H100, peak, [96], 1152, lambda gpus, batch: Layout(1, 8, 8))


def test_bad_input_is_refused_before_simulating():
    with pytest.raises(ValueError, match="schedule must be one of"):
        simulate_step(GPT3, Layout(1, 8, 8, schedule="looping"), 64, H100)
    with pytest.raises(ValueError, match="do not divide the 96 layers"):
        simulate_step(GPT3, Layout(1, 8, 7), 64, H100)
    with pytest.raises(ValueError, match="global batch 10"):
        simulate_step(GPT3, Layout(4, 8, 8), 10, H100)
    with pytest.raises(ValueError, match="bucket_bytes"):
        simulate_step(GPT3, Layout(4, 8, 8), 64, H100, bucket_bytes=0)


def test_a_calibration_round_trips_and_refuses_nonsense(tmp_path, monkeypatch):
    calibration = Calibration(60e9, 1.5e-4, 6e-4, 4e-9, 6e-9, 2, 8, "laptop", 2e-3, 5e-9,
                              (1.0, 1.9, 1.9, 1.8, 1.8, 1.8, 1.7, 1.7), (1.0, 1.1, 1.15, 1.2, 1.2, 1.2, 1.25, 1.3))
    path = save(calibration, tmp_path / "calibration.json")
    assert load(path) == calibration
    assert calibration.hardware().cores == calibration.throughput
    assert calibration.hardware().straggle == calibration.straggle and "slowest of 8" in calibration.describe()
    assert calibration.hardware().intra_node == LinkModel(2e-3, 5e-9)
    plain = Calibration(60e9, 1.5e-4, 6e-4, 4e-9, 6e-9, 2, 8)
    assert plain.hardware().cores == 2 and plain.loaded_link == plain.link
    step = calibration.simulate(TransformerShape(4, 144, 4, 128, 32), Layout(2, 2, 2, micro_batch=4), 32)
    assert step.parts["optimizer"] > 0 and step.parts["tp"] > 0
    monkeypatch.setenv("LABKIT_CALIBRATION", str(tmp_path / "elsewhere.json"))
    assert load() is None
    save(calibration)
    assert load() == calibration
    hardware = plain.hardware()
    assert hardware.cores == 2 and hardware.flops == 60e9 and hardware.intra_node == hardware.inter_node
    assert "GFLOP/s" in calibration.describe()
    (tmp_path / "broken.json").write_text(json.dumps({"flops": 1}))
    with pytest.raises(ValueError, match="broken.json is not a labkit calibration"):
        load(tmp_path / "broken.json")
    with pytest.raises(ValueError, match="flops > 0"):
        Calibration(0, 0, 0, 0, 0, 2, 8)


def test_calibrations_around_a_run_average_to_the_window_it_ran_in():
    """Measured before and after a run on a machine whose speed drifts: each time constant's mean, the FLOP rate's
    harmonic mean (a time per FLOP), the curves point by point, the machine's own facts kept."""
    before = Calibration(40e9, 2e-4, 6e-4, 4e-9, 8e-9, 2, 8, "laptop", 2e-3, 5e-9, (1.0, 1.9), (1.0, 1.1), 1e-4)
    after = Calibration(60e9, 4e-4, 8e-4, 2e-9, 12e-9, 2, 8, "laptop", 4e-3, 3e-9, (1.0, 1.7), (1.0, 1.3), 3e-4)
    both = average([before, after])
    assert both.flops == pytest.approx(48e9) and both.layer_overhead_s == pytest.approx(3e-4)
    assert both.pass_overhead_s == pytest.approx(2e-4) and both.loaded_alpha_s == pytest.approx(3e-3)
    assert both.throughput == pytest.approx((1.0, 1.8)) and both.straggle == pytest.approx((1.0, 1.2))
    assert (both.cores, both.ranks, both.machine) == (2, 8, "laptop")
    assert average([before]) == before
    with pytest.raises(ValueError, match="at least one"):
        average([])
