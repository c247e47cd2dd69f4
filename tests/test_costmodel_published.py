"""Lesson 11's models held to published large-scale runs (labkit.costmodel.published).

Sources: NVIDIA's Megatron-LM README, "Performance Benchmarking" (commit f2e5db402c, 2024-07-15, Megatron-Core
r0.8.0: the H100 model table, the weak- and strong-scaling figures, https://github.com/NVIDIA/Megatron-LM), and
the Llama Team's "The Llama 3 Herd of Models" (Dubey et al., 2024, arXiv 2407.21783, Tables 3 and 4).
Run with ``pytest -s`` to see each row's published and predicted numbers side by side.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from labkit.costmodel.collectives import LinkModel
from labkit.costmodel.compute import GPUS, mfu, model_flops_per_step
from labkit.costmodel.memory import num_parameters
from labkit.costmodel.planner import Cluster, candidates, plan
from labkit.costmodel.published import (
    EFFICIENCY,
    FIGURE_READING_ERROR,
    LLAMA3_405B,
    LLAMA3_TRAINING_FLOPS,
    LLAMA3_TRAINING_TOKENS,
    MEGATRON_STRONG_SCALING,
    MEGATRON_WEAK_SCALING,
    RUNS,
    megatron_flops_per_step,
    predict,
    squared_error,
    strong_scaling_run,
)
from labkit.costmodel.step import Layout, predict_step

H100_PEAK = GPUS["H100 80GB"].peak_bf16_flops
MODELLED = [run for run in RUNS if run.modelled]
SHAPES = MEGATRON_WEAK_SCALING + LLAMA3_405B[:1]  # every published shape once


def _ids(runs):
    return [run.name.split(" (")[0] for run in runs]


# --------------------------------------------------------------------------------------------------------
# The tables themselves


def _printed_size(label: str) -> tuple[float, int]:
    """ "1.7B" -> (1.7, 1 decimal); "462B" -> (462.0, 0)."""
    digits = label.removesuffix("B")
    return float(digits), len(digits.partition(".")[2])


@pytest.mark.parametrize("run", SHAPES, ids=_ids(SHAPES))
def test_parameter_counts_give_the_published_model_sizes(run):
    """Megatron-LM README's model table (column "Model size") and Llama 3's "405B" (Table 3's shape): the count
    of the shape as built, rounded or cut to the digits printed, is the size printed.  Both conventions occur:
    Megatron's 32B, 119B and 462B are rounded up from 31.51, 118.50 and 461.54 billion, its 1.7B is cut from
    1.754 and Llama 3's 405B from 405.85 (vocabulary 128,256; 405.85 with Table 3's 128,000 too)."""
    billions = num_parameters(run.shape()) / 1e9
    printed, decimals = _printed_size(run.parameters)
    rounded = round(billions, decimals)
    cut = math.floor(billions * 10 ** decimals) / 10 ** decimals
    print(f"{run.name}: {billions:.3f}B counted, {run.parameters} printed")
    assert printed in (rounded, cut)


def test_only_an_untied_output_layer_gives_megatrons_sizes():
    """Megatron-LM README's model table: with the output layer tied to the embedding, 7.1B and 16B come out as
    6.6B and 15.3B; the untied reading is the one the table supports (the check above rejects the tied one)."""
    for run in MEGATRON_WEAK_SCALING[1:3]:
        tied = dataclasses.replace(run.shape(), tied_embeddings=True)
        printed, decimals = _printed_size(run.parameters)
        billions = num_parameters(tied) / 1e9
        assert printed not in (round(billions, decimals), math.floor(billions * 10 ** decimals) / 10 ** decimals)


def test_llama3_tokens_per_batch_are_16m_in_every_row():
    """Llama 3 Table 4: DP x batch size/DP x sequence length is the "16M" tokens per batch (2^24) in each row,
    the context-parallel row included once its DP is 8 (the PDF's 4 would make it 8M)."""
    for run in LLAMA3_405B:
        assert run.dp * (run.global_batch // run.dp) * run.seq_len == run.tokens_per_step == 2 ** 24


# --------------------------------------------------------------------------------------------------------
# Model FLOPs: the published TFLOP/s, MFU and labkit's count agree


@pytest.mark.parametrize("run", SHAPES, ids=_ids(SHAPES))
def test_labkit_counts_the_model_flops_as_megatron_does(run):
    """Megatron-LM's ``num_floating_point_operations`` (megatron/training/training.py at commit f2e5db402c), the
    count behind the README's TFLOP/s, is labkit's ``model_flops_per_step`` for the table's GPT shapes and for
    Llama's (grouped-query attention, SwiGLU): the published TFLOP/s are in labkit's units."""
    shape = run.shape()
    assert model_flops_per_step(shape, run.global_batch) == pytest.approx(
        megatron_flops_per_step(shape, run.global_batch), rel=1e-12)


def _agrees(run, peak: float) -> bool:
    """Whether the printed TFLOP/s (to its resolution) over ``peak`` can round to the printed whole-percent MFU."""
    low = (run.tflops_per_gpu - run.tflops_resolution) * 1e12 / peak
    high = (run.tflops_per_gpu + run.tflops_resolution) * 1e12 / peak
    return low < run.mfu + 0.005 and high >= run.mfu - 0.005


@pytest.mark.parametrize("run", RUNS, ids=_ids(RUNS))
def test_published_tflops_and_mfu_agree_at_the_h100_peak_and_imply_the_step(run):
    """Megatron-LM README's model table and Llama 3 Table 4: MFU is TFLOP/s per GPU over the H100's 989 TFLOP/s
    (bf16, dense) within the rounding of both; and the step the TFLOP/s imply, with labkit's FLOPs, gives back
    the published MFU through ``labkit.costmodel.compute.mfu``."""
    assert _agrees(run, H100_PEAK)
    step_s = run.implied_step_s()
    assert mfu(run.model_flops(), step_s, run.gpus, H100_PEAK) == pytest.approx(
        run.tflops_per_gpu * 1e12 / H100_PEAK, rel=1e-12)
    assert abs(run.tflops_per_gpu * 1e12 / H100_PEAK - run.mfu) <= 0.005 + run.tflops_resolution * 1e12 / H100_PEAK
    print(f"{run.name}: implied step {step_s:.2f} s, {run.tokens_per_step / step_s / run.gpus:,.0f} tokens/s per GPU")


def test_the_mfu_check_rejects_a_wrong_peak():
    """Megatron-LM README's model table: at a round 1,000 TFLOP/s four rows no longer agree (119B: 420.5 ->
    42.05 %, printed 43 %; 177B: 43.28 %, 44 %; 314B: 47.44 %, 48 %; 462B: 45.99 %, 47 %): the table divides by
    989."""
    disagreeing = [run.parameters for run in MEGATRON_WEAK_SCALING if not _agrees(run, 1000e12)]
    assert disagreeing == ["119B", "177B", "314B", "462B"]


def test_megatron_aggregate_is_the_per_gpu_throughput_times_the_gpus():
    """Megatron-LM README's model table: "Aggregate petaFLOP/s" is TFLOP/s per GPU x GPUs, to the rounding of
    both (0.05 PFLOP/s, and 0.05 TFLOP/s on each GPU)."""
    for run in MEGATRON_WEAK_SCALING:
        assert abs(run.tflops_per_gpu * run.gpus / 1e3 - run.aggregate_pflops) <= 0.05 + 0.05 * run.gpus / 1e3


def test_llama3_training_compute_is_six_n_d_and_labkit_adds_attention():
    """Llama 3 section 1: 405B parameters on 15.6T tokens "using 3.8 x 10^25 FLOPs" is 6 N D (3.80e25); labkit's
    count at 8K tokens adds attention's ``12 L s h`` per token (the causal mask not exploited): 8 % more."""
    run = LLAMA3_405B[0]
    six_n_d = 6 * num_parameters(run.shape()) * LLAMA3_TRAINING_TOKENS
    assert round(six_n_d / 1e25, 1) == LLAMA3_TRAINING_FLOPS / 1e25
    per_token = run.model_flops() / run.tokens_per_step
    assert 1.05 < per_token * LLAMA3_TRAINING_TOKENS / six_n_d < 1.10


# --------------------------------------------------------------------------------------------------------
# Predicted beside published, with one calibration constant

# What labkit's step model reaches with EFFICIENCY at the layouts of labkit.costmodel.published, each run modelled
# as it was run (flash attention, fp32 gradient reduction, the weights' gather overlapped): every row within 9
# points of the published MFU, not the 5 aimed for.  Two rows miss 5, both predicted too low: 16B (-8.5) and 32B
# (-8.9).  The test below checks the cause the module docstring names.
MFU_ERROR_BOUND = 0.09
WITHIN_5_POINTS = 9


def _tp_hidden(run):
    """``run``'s predicted MFU with its node's links free: for these layouts (TP inside a node, the DP and PP
    groups across nodes) that hides the TP all-reduces entirely, the most ``--tp-comm-overlap`` could."""
    hardware = run.cluster(EFFICIENCY).hardware()
    step = predict_step(run.pipeline_shape(), run.layout(), run.global_batch,
                        dataclasses.replace(hardware, intra_node=LinkModel(0.0, 0.0)), **run.step_options())
    return mfu(run.model_flops(), step.step_s, run.gpus, H100_PEAK)


def test_predicted_mfu_of_each_published_layout_beside_the_published():
    """Megatron-LM README's model table and Llama 3 Table 4 (rows without context parallelism): ``predict_step``
    at each published layout, run as the sources say (``PublishedRun.step_options``), on H100s running their
    matrices at EFFICIENCY of peak (the least-squares value over these eleven rows, to 0.001) predicts an MFU
    within MFU_ERROR_BOUND of the published one, 5 points or less for WITHIN_5_POINTS of the eleven.

    The rows that miss by more than 5 points are predicted too slow, by communication labkit leaves exposed:
    TP all-reduces, which Megatron-LM overlaps (``--tp-comm-overlap``), and the DP reduce-scatter of fp32
    gradients and gather of weights, of which only one micro-batch's backward and forward hide any (four per
    replica there): together a third or more of their predicted step.  With the TP all-reduces hidden entirely
    each gains 3 points or more."""
    predictions = {run.name: predict(run) for run in MODELLED}
    print(f"\nefficiency {EFFICIENCY}: {'run':<28} {'published':>9} {'predicted':>9} {'error':>6}   "
          "share of the predicted step: compute tp bubble pp-send dp zero")
    for run in MODELLED:
        step, predicted = predictions[run.name]
        shares = " ".join(f"{seconds / step.step_s:.2f}" for seconds in step.parts().values())
        print(f"{'':>17}{run.name:<28} {run.mfu:>9.1%} {predicted:>9.1%} {100 * (predicted - run.mfu):>+6.1f}   "
              f"{shares}")
    errors = {run.name: predictions[run.name][1] - run.mfu for run in MODELLED}
    assert max(abs(error) for error in errors.values()) <= MFU_ERROR_BOUND
    assert sum(abs(error) <= 0.05 for error in errors.values()) == WITHIN_5_POINTS
    assert math.sqrt(sum(error ** 2 for error in errors.values()) / len(errors)) < 0.05
    for run in MODELLED:
        step, predicted = predictions[run.name]
        if abs(errors[run.name]) > 0.05:
            assert errors[run.name] < 0 and step.tp_s + step.dp_s + step.zero_s >= step.step_s / 3, run.name
            hidden = _tp_hidden(run)
            print(f"  {run.name}: with the TP all-reduces hidden, {hidden:.1%} ({100 * (hidden - run.mfu):+.1f})")
            assert hidden - predicted >= 0.03, run.name
    # the constant is the least-squares one (the error is unimodal in it): its neighbours do worse
    here = squared_error(EFFICIENCY, MODELLED)
    assert here <= squared_error(EFFICIENCY - 0.001, MODELLED) and here <= squared_error(EFFICIENCY + 0.001, MODELLED)


def test_the_runs_are_modelled_as_the_sources_say_they_were_run():
    """Megatron-LM (``arguments.py``, Transformer Engine's attention at commit f2e5db402c) and Llama 3 (section
    3.3.2): flash attention, gradients reduced in fp32, ZeRO-2's traffic with the weights' gather overlapped;
    dropout in Megatron's defaults only.  The step model gets them: for the 16B, fp32 gradients cost 7 points
    of predicted MFU (47.8 % with bf16) and the overlapped gather gains 2.5 (38.0 % exposed); so does the memory
    model: with the attention matrices stored, the Llama layout as run would need 386 GB per GPU."""
    for run in MODELLED:
        assert run.plan_options() == {"flash_attention": True, "dropout": run.architecture == "gpt",
                                      "gradient_bytes": 4, "overlap_gather": True}
    run = MEGATRON_WEAK_SCALING[2]
    as_run = predict(run)[0].step_s
    assert predict(dataclasses.replace(run, gradient_bytes=2))[0].step_s < as_run
    assert predict(dataclasses.replace(run, overlap_gather=False))[0].step_s > as_run
    llama = LLAMA3_405B[0]
    assert llama.memory()["total"] < dataclasses.replace(llama, flash_attention=False).memory()["total"] / 4


def test_a_context_parallel_row_has_no_layout():
    """Llama 3 Table 4's 131,072-token row uses CP = 16, which labkit's step model does not express."""
    long_context = LLAMA3_405B[2]
    assert not long_context.modelled and long_context.cp == 16
    with pytest.raises(ValueError, match=r"context parallelism \(cp=16\) is not modelled"):
        long_context.layout()


# --------------------------------------------------------------------------------------------------------
# The planner, given each published model, GPU count and batch

# The full search (4 micro-batch sizes, 4 schedules, 4 ZeRO stages, recomputation or not) simulates thousands of
# schedules at these GPU counts and takes minutes on two cores; the published runs use one-sequence micro-batches
# and the 1F1B or interleaved schedule, and shard optimizer states, so the planner searches that neighbourhood.
CHOICES = {"micro_batches": (1,), "schedules": ("1f1b", "interleaved"), "zero_stages": (1, 2),
           "recompute": (False, True)}
# Virtual stages per rank the planner tries, with each row's own (one layer per virtual stage: 23 for the 119B's
# 4 stages and 7 for the 462B's 16 divide nothing else), so that it can interleave the published PP as assumed.
VIRTUAL_STAGES = (2, 3, 4, 6, 8)

# What the planner does with each row, planning as the run was run (PublishedRun.plan_options), by its own
# numbers: "beats": its best has other degrees and is faster than the fastest completion of the published TP and
# PP that fits; "match": it proposes the published TP and PP; "published does not fit": no completion fits.
# With flash attention every published TP and PP has a completion that fits (the Llama rows' with
# recomputation), and in every row the planner finds other degrees a little faster (1-17 %).
PLANNER_OUTCOME = {"1.7B": "beats", "7.1B": "beats", "16B": "beats", "32B": "beats", "70B": "beats",
                   "119B": "beats", "177B": "beats", "314B": "beats", "462B": "beats",
                   "405B, 8192 GPUs, seq 8192": "beats", "405B, 16384 GPUs, seq 8192": "beats"}
# The published layouts as run (no recomputation) that labkit's memory model says need more than 80 GB per GPU:
# the Llama rows, 94 GB (the module docstring says why).
AS_RUN_DOES_NOT_FIT = {"405B, 8192 GPUs, seq 8192", "405B, 16384 GPUs, seq 8192"}


def _choices(run):
    return CHOICES | {"virtual_stages": tuple(sorted({*VIRTUAL_STAGES, run.virtual_stages}))}


def _fastest_with_the_published_degrees(run, cluster):
    """The planner's best completion (ZeRO stage, recomputation, schedule) of the published TP and PP: the
    fastest fitting candidate with those degrees, or None and the least memory per GPU any of them needs."""
    shape = run.pipeline_shape()
    same = [layout for layout in candidates(shape, run.gpus, run.global_batch, **_choices(run))
            if (layout.tp, layout.pp) == (run.tp, run.pp)]
    memory = {layout: run.memory(layout)["total"] for layout in same}
    fitting = [layout for layout in same if memory[layout] <= cluster.gpu.memory_bytes]
    steps = [predict_step(shape, layout, run.global_batch, cluster.hardware(), **run.step_options())
             for layout in fitting]
    return min(steps, key=lambda step: step.step_s, default=None), min(memory.values())


@pytest.mark.parametrize("run", MODELLED, ids=_ids(MODELLED))
def test_the_planner_matches_the_published_degrees_or_beats_them_by_its_own_numbers(run):
    """Megatron-LM README's model table and Llama 3 Table 4: ``plan`` for the published model, GPUs and batch,
    run as the sources say, proposes the published TP and PP, or something its own ``predict_step`` says is
    faster than every completion of them that fits (or none fits).  Printed: the terms that differ.  Where the
    published layout as run does not fit labkit's memory model, that layout is predicted faster than the
    planner's choice: the memory model, not the time model, keeps the planner from it.  Where it fits, it
    still fits with the fp32 gradients labkit's memory model does not count."""
    cluster = run.cluster(EFFICIENCY)
    result = plan(run.pipeline_shape(), cluster, run.global_batch, top=1, **run.plan_options(), **_choices(run))
    best = result.best
    assert best is not None, result.reason()
    published, least_memory = _fastest_with_the_published_degrees(run, cluster)
    print(f"\n{run.name}: published tp={run.tp} pp={run.pp}; planner {best.layout.label()}, "
          f"{best.step.step_s:.2f} s, MFU {best.mfu:.1%} ({result.reason()})")
    if (best.layout.tp, best.layout.pp) == (run.tp, run.pp):
        outcome = "match"
    elif published is None:
        outcome = "published does not fit"
        print(f"  every completion of tp={run.tp} pp={run.pp} needs {least_memory / 1e9:.0f} GB per GPU or more")
        assert least_memory > cluster.gpu.memory_bytes
    else:
        outcome = "beats"
        assert best.step.step_s <= published.step_s
        print(f"  the published degrees at best: {published.layout.label()}, {published.step_s:.2f} s; planner "
              "minus published (s): " + ", ".join(
                  f"{name} {mine - theirs:+.3f}" for (name, mine), theirs
                  in zip(best.step.parts().items(), published.parts().values(), strict=True) if mine != theirs))
    assert outcome == PLANNER_OUTCOME[run.name]
    as_run = run.layout()
    memory, uncounted = run.memory()["total"], run.uncounted_gradient_bytes()
    step = predict_step(run.pipeline_shape(), as_run, run.global_batch, cluster.hardware(), **run.step_options())
    print(f"  as run, {as_run.label()}: {step.step_s:.2f} s, {memory / 1e9:.0f} GB per GPU by labkit's memory "
          f"model, {uncounted / 1e9:.0f} GB more with whole fp32 gradients")
    assert (memory > cluster.gpu.memory_bytes) == (run.name in AS_RUN_DOES_NOT_FIT)
    if run.name in AS_RUN_DOES_NOT_FIT:
        assert step.step_s < best.step.step_s
    else:
        assert memory + uncounted <= cluster.gpu.memory_bytes


# --------------------------------------------------------------------------------------------------------
# Strong scaling (read off a figure)


def test_strong_scaling_readings_fall_from_47_to_42_percent_and_meet_the_table():
    """Megatron-LM README's strong-scaling figure (GPT 177B, 1,152 sequences, 96 to 4,608 H100s), read off the
    plot to about 1 %: MFU falls monotonically "from 47% to 42%", and the 2,304-GPU point is the model table's
    177B row (TP 8, PP 6, DP 48: 997.2 PFLOP/s)."""
    mfus = [point.mfu for point in MEGATRON_STRONG_SCALING]
    assert mfus == sorted(mfus, reverse=True)
    slack = 0.005 + FIGURE_READING_ERROR * 0.47
    assert abs(mfus[0] - 0.47) <= slack and abs(mfus[-1] - 0.42) <= slack
    point = next(point for point in MEGATRON_STRONG_SCALING if point.gpus == 2304)
    assert point.pflops == pytest.approx(MEGATRON_WEAK_SCALING[6].aggregate_pflops, rel=FIGURE_READING_ERROR)
    assert all(1152 % (point.gpus // 48) == 0 for point in MEGATRON_STRONG_SCALING)  # TP 8, PP 6 divides each


def test_predicted_strong_scaling_loses_mfu_as_the_gpus_grow():
    """Megatron-LM README's strong-scaling figure, at the inferred TP 8, PP 6: labkit predicts the MFU falling
    as GPUs are added at a fixed batch (fewer micro-batches per pipeline, a reduction over more replicas with
    less backward to hide behind), faster than measured (53.7 % to 40.6 %): within 7 points of each reading.
    (144 and 288 GPUs are left out for time: hundreds of micro-batches in 16 virtual stages to simulate, seconds
    each.)"""
    points = [point for point in MEGATRON_STRONG_SCALING if point.gpus == 96 or point.gpus >= 576]
    predicted = []
    for point in points:
        _, value = predict(strong_scaling_run(point))
        predicted.append(value)
        print(f"177B on {point.gpus} GPUs: read {point.mfu:.1%}, predicted {value:.1%}")
    assert predicted == sorted(predicted, reverse=True)
    assert predicted[0] - predicted[-1] > points[0].mfu - points[-1].mfu
    assert max(abs(value - point.mfu) for value, point in zip(predicted, points, strict=True)) < 0.07


# --------------------------------------------------------------------------------------------------------
# Bad input


def test_an_unknown_gpu_is_refused_by_name():
    run = dataclasses.replace(MEGATRON_WEAK_SCALING[0], gpu="H100 PCIe")
    with pytest.raises(ValueError, match=r"unknown GPU 'H100 PCIe'; choose one of"):
        run.cluster(EFFICIENCY)


def test_a_model_that_fits_nowhere_or_divides_nowhere_gets_an_empty_plan_and_the_reason():
    """Llama 3's 405B (Table 3) on one node of 8 H100s: 6.5 TB of model states cannot fit; on 11 GPUs no degree
    divides 128 heads, 126 layers and a batch of 16."""
    shape = LLAMA3_405B[0].shape()
    nowhere = plan(shape, Cluster(GPUS["H100 80GB"], 8, EFFICIENCY), 16, **CHOICES)
    assert nowhere.candidates == [] and nowhere.smallest_memory > 80e9
    assert nowhere.reason().startswith("nothing fits: the least memory")
    undivided = plan(shape, Cluster(GPUS["H100 80GB"], 11, EFFICIENCY), 16, **CHOICES)
    assert undivided.candidates == [] and "no configuration divides" in undivided.reason()


def test_degrees_that_do_not_divide_are_refused_naming_the_value():
    """Llama 3 Table 4's last row as the paper prints it (DP = 4) does not add up to 16,384 GPUs; a global batch
    that does not split over the replicas, and 16 stages for 126 layers (why the Llama rows predict on 128
    slots), are refused too."""
    long_context = LLAMA3_405B[2]
    with pytest.raises(ValueError, match=r"dp=4 = 8192 GPUs, not gpus=16384"):
        dataclasses.replace(long_context, dp=4, global_batch=64)
    with pytest.raises(ValueError, match=r"global_batch=100 does not split into dp=48"):
        dataclasses.replace(MEGATRON_WEAK_SCALING[0], global_batch=100)
    run = LLAMA3_405B[0]
    with pytest.raises(ValueError, match="16 pipeline stages do not divide the 126 layers"):
        predict_step(run.shape(), Layout(64, 8, 16), run.global_batch, run.cluster(EFFICIENCY).hardware())
    with pytest.raises(ValueError, match=r"tp must be an integer >= 1, got 0"):
        dataclasses.replace(run, tp=0)


def test_every_run_names_its_source():
    runs = RUNS + tuple(strong_scaling_run(point) for point in MEGATRON_STRONG_SCALING)
    assert all(run.source.startswith(("NVIDIA, Megatron-LM README", "Llama Team, AI @ Meta")) for run in runs)
    assert all("images/strong_scaling.png" in strong_scaling_run(point).source for point in MEGATRON_STRONG_SCALING)
