"""Lesson 11's analytical models: a transformer step's FLOPs (labkit.costmodel.compute) against Narayanan et al.
2021's closed forms, and the 3D step-time model (labkit.costmodel.step.predict_step)."""

from __future__ import annotations

import dataclasses

import pytest

from labkit.costmodel.compute import (
    GPUS,
    matmul_parameters_per_layer,
    mfu,
    model_flops_per_step,
    narayanan_flops,
    tokens_per_second,
)
from labkit.costmodel.shapes import TransformerShape, num_parameters


@pytest.mark.parametrize("name", ["gpt2", "gpt2-xl", "gpt3-175b"])
@pytest.mark.parametrize("recompute", [False, True])
def test_gpt_shapes_give_narayanans_closed_forms(name, recompute):
    shape = TransformerShape.preset(name)
    ours = model_flops_per_step(shape, 512, recompute=recompute)
    theirs = narayanan_flops(512, shape.seq_len, shape.num_layers, shape.hidden_size, shape.vocab_size, recompute)
    assert ours == pytest.approx(theirs, rel=1e-12)


def test_gpt3_175b_step_is_about_six_n_d_plus_attention():
    """The closed form's ``1 + s/6h`` is attention's share beyond the weights' 6 N D (GPT-3: s = 2048, h = 12288)."""
    shape = TransformerShape.preset("gpt3-175b")
    flops = model_flops_per_step(shape, 1536)
    six_n_d = 6 * num_parameters(shape) * 1536 * shape.seq_len
    assert 1.0 < flops / six_n_d < 1.05


def test_grouped_query_attention_and_swiglu_change_the_weights_multiplied():
    shape = TransformerShape.preset("llama-2-70b")
    h, f, kv = 8192, 28672, 8 * 128
    assert matmul_parameters_per_layer(shape) == 2 * h * h + 2 * h * kv + 3 * h * f
    full = dataclasses.replace(shape, num_kv_heads=shape.num_heads)
    assert model_flops_per_step(shape, 8) < model_flops_per_step(full, 8)


def test_mfu_and_tokens_per_second():
    shape = TransformerShape.preset("gpt3-175b")
    flops = model_flops_per_step(shape, 1536)
    # a step of 30 s on 1024 A100s
    assert mfu(flops, 30.0, 1024, GPUS["A100 80GB"].peak_bf16_flops) == pytest.approx(flops / 30 / 1024 / 312e12)
    assert tokens_per_second(1536, 2048, 30.0) == pytest.approx(1536 * 2048 / 30)
    with pytest.raises(ValueError, match="step_s, gpus and peak_flops_per_gpu must be positive"):
        mfu(flops, 0.0, 8, 1e12)
    with pytest.raises(ValueError, match="global_batch and seq_len must be >= 1"):
        model_flops_per_step(shape, 0)


def test_every_gpu_preset_names_its_links_and_source():
    for gpu in GPUS.values():
        assert gpu.nvlink_bandwidth > gpu.network_bandwidth > 0 and gpu.source


# --------------------------------------------------------------------------------------------------------
# The 3D step


def _hardware(alpha=0.0, intra=1e30, inter=1e30, flops=1e14, gpus_per_node=8):
    from labkit.costmodel.collectives import LinkModel
    from labkit.costmodel.step import Hardware

    return Hardware(flops, LinkModel(alpha, 1 / intra), LinkModel(alpha, 1 / inter), gpus_per_node)


def test_with_free_links_a_balanced_step_is_compute_plus_the_closed_form_bubble():
    """The balanced pipeline (the model's FLOPs spread evenly: exercise 11's) on free links: compute and the
    closed-form bubble, ``(p - 1) / (m + p - 1)`` of the step."""
    from labkit.costmodel.step import Layout, predict_step

    shape = TransformerShape.preset("gpt2")
    for p, m in ((1, 4), (2, 8), (4, 8), (4, 32)):
        layout = Layout(dp=2, tp=2, pp=p, micro_batch=2)
        step = predict_step(shape, layout, 2 * 2 * m, _hardware(), head_on_last_stage=False)
        assert step.microbatches == m
        assert max(step.tp_s, step.pp_send_s, step.dp_s, step.zero_s) < 1e-12
        ideal = model_flops_per_step(shape, 2 * 2 * m) / 2 / (2 * p) / 1e14  # one replica's share, per rank
        assert step.compute_s == pytest.approx(ideal, rel=1e-12)
        assert step.bubble_s / step.step_s == pytest.approx((p - 1) / (m + p - 1), rel=1e-9, abs=1e-12)


def test_tp_across_nodes_and_pipeline_sends_cost_what_their_links_say():
    from labkit.costmodel.step import Layout, predict_step

    shape = TransformerShape.preset("gpt2")
    slow = _hardware(alpha=1e-5, intra=300e9, inter=25e9, gpus_per_node=8)
    inside = predict_step(shape, Layout(dp=2, tp=8, pp=1), 16, slow)
    across = predict_step(shape, Layout(dp=1, tp=16, pp=1), 16, slow)  # 16 ranks: two nodes
    assert across.tp_s > 5 * inside.tp_s
    one_node = predict_step(shape, Layout(dp=1, tp=2, pp=4), 16, slow)  # 8 ranks, stages 2 apart
    two_nodes = predict_step(shape, Layout(dp=1, tp=4, pp=4), 16, slow)  # 16 ranks, stages 4 apart
    assert 0 < one_node.pp_send_s < two_nodes.pp_send_s


def test_zero_stages_add_their_gathers_and_dp_overlaps_the_last_backward():
    from labkit.costmodel.step import Layout, predict_step

    shape = TransformerShape.preset("gpt2")
    hardware = _hardware(alpha=1e-5, intra=300e9, inter=0.5e9, flops=1e13, gpus_per_node=4)  # dp across nodes
    steps = {zero: predict_step(shape, Layout(dp=8, tp=1, pp=1, zero=zero, micro_batch=4), 64, hardware)
             for zero in (0, 1, 2, 3)}
    assert steps[0].zero_s == 0 < steps[1].zero_s == steps[2].zero_s
    assert steps[3].zero_s >= 0 and steps[0].dp_s > 0
    hidden = predict_step(shape, Layout(dp=8, tp=1, pp=1, micro_batch=4), 64, hardware)
    exposed = predict_step(shape, Layout(dp=8, tp=1, pp=1, micro_batch=4), 64, hardware, overlap_dp=False)
    assert exposed.dp_s - hidden.dp_s == pytest.approx(min(exposed.dp_s, hidden.backward_s), rel=1e-9)


def test_a_step_refuses_what_does_not_divide():
    from labkit.costmodel.step import Layout, predict_step

    shape = TransformerShape.preset("gpt2")
    with pytest.raises(ValueError, match="must split into dp=4 replicas"):
        predict_step(shape, Layout(dp=4, tp=1, pp=1, micro_batch=3), 16, _hardware())
    with pytest.raises(ValueError, match="5 pipeline stages do not divide the 12 layers"):
        predict_step(shape, Layout(dp=1, tp=1, pp=5), 16, _hardware())
    with pytest.raises(ValueError, match="schedule must be one of"):
        predict_step(shape, Layout(dp=1, tp=1, pp=2, schedule="pipedream"), 16, _hardware())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_the_closed_form_makespan_is_the_simulators_for_uniform_stages(schedule):
    from labkit.costmodel.step import closed_form_makespan
    from labkit.parallel.pipeline import gpipe, interleaved_1f1b, one_f_one_b, simulate, zb_h1

    make = {"gpipe": lambda p, m: gpipe(p, m), "1f1b": one_f_one_b, "zb-h1": zb_h1,
            "interleaved": lambda p, m: interleaved_1f1b(p, m, 2)}[schedule]
    for p, m in ((2, 4), (4, 8), (4, 12), (8, 16)):
        v = 2 if schedule == "interleaved" else 1
        simulated = simulate(make(p, m), 1.0 / v, 2.0 / v).total
        assert closed_form_makespan(schedule, p, m, 1.0, 2.0, v) == pytest.approx(simulated, rel=1e-12)
        with_sends = simulate(make(p, m), 1.0 / v, 2.0 / v, send_s=0.05).total
        assert with_sends > simulated  # the bound holds: sends only add


# --------------------------------------------------------------------------------------------------------
# The planner


def test_the_plan_is_ranked_exactly_and_every_candidate_fits():
    from labkit.costmodel.planner import Cluster, plan
    from labkit.costmodel.step import predict_step

    shape, cluster = TransformerShape.preset("gpt2-xl"), Cluster(GPUS["A100 80GB"], 8, 0.5)
    result = plan(shape, cluster, 64, top=8)
    times = [candidate.step.step_s for candidate in result.candidates]
    assert len(times) == 8 and times == sorted(times)
    for candidate in result.candidates:
        assert candidate.memory["total"] <= GPUS["A100 80GB"].memory_bytes
        assert candidate.step == predict_step(shape, candidate.layout, 64, cluster.hardware(), dropout=True)
    # the top is exact: no candidate outside it is faster (every fitting one, simulated)
    everything = plan(shape, cluster, 64, top=10_000)
    assert [c.step.step_s for c in everything.candidates[:8]] == pytest.approx(times)
    assert result.fitting == everything.fitting == len(everything.candidates)


def test_a_model_that_fits_nowhere_gets_an_empty_plan_with_the_memory_it_would_need():
    from labkit.costmodel.planner import Cluster, plan

    result = plan(TransformerShape.preset("gpt3-175b"), Cluster(GPUS["V100 32GB"], 8), 64)
    assert result.candidates == [] and result.best is None and result.smallest_memory > 32e9
    assert "nothing fits: the least memory" in result.reason()
    nothing = plan(TransformerShape.preset("gpt2"), Cluster(GPUS["A100 80GB"], 7), 5)  # 7 ranks, 12 heads
    assert "no configuration divides" in nothing.reason() or nothing.candidates
    with pytest.raises(ValueError, match="num_gpus must be an integer >= 1"):
        Cluster(GPUS["A100 80GB"], 0)
    with pytest.raises(ValueError, match="global_batch must be an integer >= 1"):
        plan(TransformerShape.preset("gpt2"), Cluster(GPUS["A100 80GB"], 8), 0)


def test_one_replica_gets_one_zero_stage_and_interleaving_every_v_that_divides_a_stage():
    """At ``d = 1`` every ZeRO stage is the same layout: the planner lists it once (lesson 11 listed four near ties).
    Interleaving tries each ``v >= 2`` dividing a stage's layers: GPT-3's 96 layers on 8 stages, 2, 3, 4, 6 and
    12."""
    from labkit.costmodel.planner import candidates

    shape = TransformerShape.preset("gpt3-175b")
    found = candidates(shape, 64, 1536, micro_batches=(1,), recompute=(False,))
    assert {layout.zero for layout in found if layout.dp == 1} == {0}
    assert {layout.zero for layout in found if layout.dp == 8} == {0, 1, 3}  # m > 1: ZeRO-2 is ZeRO-1
    assert {layout.zero for layout in candidates(shape, 64, 8, micro_batches=(1,), recompute=(False,))
            if layout.dp == 8} == {0, 1, 2, 3}  # m = 1: ZeRO-2 holds a shard of the gradients
    assert sorted({layout.virtual_stages for layout in found if layout.schedule == "interleaved"
                   and (layout.tp, layout.pp) == (8, 8)}) == [2, 3, 4, 6, 12]
    assert [v for v in (2, 3, 4) if any(layout.virtual_stages == v for layout in candidates(
        shape, 64, 1536, virtual_stages=(2, 3)))] == [2, 3]


def test_labkit_plan_shows_the_communication_that_is_not_hidden(capsys):
    """``labkit plan --model llama-2-70b --gpus 64 --global-batch 1024`` printed 0.000 s in every communication
    column: the model hid all of it.  Now the DP reduction leaves its last bucket after the pipeline, and what
    it hides slows the compute beside it: its column and ZeRO's are not zero."""
    from labkit.cli import main

    assert main(["plan", "--model", "llama-2-70b", "--gpus", "64", "--global-batch", "1024", "--top", "3"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("dp=")]
    assert len(rows) == 3
    for row in rows:
        *_, tp, bubble, send, dp, zero = (float(value) for value in row[-6:])
        assert int(row[0].removeprefix("dp=")) > 1 and dp > 0 and zero > 0 and tp > 0


def test_labkit_plan_prints_the_ranked_table_or_why_nothing_fits(capsys):
    from labkit.cli import main

    assert main(["plan", "--model", "gpt2-xl", "--gpus", "8", "--global-batch", "64", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "configurations fit" in out and out.count("dp=") == 3 and "bubble" in out
    assert main(["plan", "--model", "gpt3-175b", "--gpu", "V100 32GB", "--gpus", "8", "--global-batch", "64"]) == 1
    assert "nothing fits: the least memory" in capsys.readouterr().out
    assert main(["plan", "--gpu", "TPU"]) == 2
    assert "--gpu 'TPU' is unknown" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--model", "gpt2", "--gpus", "8", "--cp", "3"], "--cp 3: no layout can use it: 3 does not divide the 8 GPUs, and "
     "does not cut the sequence's 1024 tokens into 6 equal zig-zag chunks (two a cp rank)"),
    (["--model", "gpt2", "--gpus", "6", "--cp", "3,6"], "--cp 3,6: no layout can use it: 3 does not cut the "
     "sequence's 1024 tokens into 6 equal zig-zag chunks (two a cp rank); 6 does not cut"),
    (["--model", "mixtral-8x7b", "--gpus", "8", "--ep", "3"], "--ep 3: no layout can use it: 3 does not divide the 8 "
     "experts, and does not divide dp x cp (a divisor of 8)"),
    (["--model", "mixtral-8x7b", "--gpus", "12", "--ep", "16"], "--ep 16: no layout can use it: 16 does not divide "
     "the 8 experts, and does not divide dp x cp (a divisor of 12)"),
])
def test_labkit_plan_names_the_cp_or_ep_degree_no_layout_can_use_and_why(flags, message, capsys):
    """``--cp 3`` and ``--ep 3`` said "no configuration divides this model, batch and number of GPUs" and named
    neither the flag nor the reason."""
    from labkit.cli import main

    assert main(["plan", "--global-batch", "12", *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"labkit plan: {message}")
    assert main(["plan", "--model", "gpt2", "--gpus", "8", "--global-batch", "8", "--cp", "1,3", "--top", "1"]) == 0


def test_labkit_plan_says_a_sequence_length_cp_cannot_split_is_why_nothing_fits(capsys):
    """At 1,048,575 tokens (one short of 2^20) nothing fits without context parallelism, and no cp cuts the odd
    length into 2 cp zig-zag chunks: the plan blamed memory alone, where the trainer would pad the sequence and
    (test_costmodel_context) 2^20 tokens fit with cp."""
    from labkit.cli import main
    from labkit.costmodel.planner import Cluster, plan

    argv = ["plan", "--model", "llama-3-8b", "--gpu", "H100 80GB", "--gpus", "64", "--global-batch", "4",
            "--seq-len", "1048575", "--top", "2"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert ("nothing fits: the least memory any of the 294 configurations needs is 131.8 GB per GPU, 72.0 GB usable; "
            "context parallelism, which would spread each sequence's activations, cannot split this sequence length: "
            "no cp tried cuts it into 2 cp equal zig-zag chunks (labkit.train pads a sequence to 1048576 tokens, a "
            "length to plan instead)") in out
    assert out.endswith("--seq-len 1048575 is that length: try --seq-len 1048576\n")
    assert main([*argv, "--cp", "2"]) == 2  # asked for a cp that cannot cut it: refused, naming it
    assert "--cp 2: no layout can use it: 2 does not cut the sequence's 1048575 tokens" in capsys.readouterr().err
    # memory alone: the reason stays what it was (a length that cp cuts, or cp not asked for)
    shape = dataclasses.replace(TransformerShape.preset("gpt3-175b"), seq_len=2047)
    alone = plan(shape, Cluster(GPUS["V100 32GB"], 8), 64, context_parallel=(1,))
    assert alone.padded_seq_len is None and alone.reason().endswith("GB usable")


def test_under_accumulation_zero_2_prices_and_holds_what_zero_1_does():
    """With ``m > 1`` ZeRO-2 holds whole gradients through the schedule and, like ZeRO-1, reduce-scatters them and
    gathers the weights (ZeRO, section 7.2.1): the same step and memory, so the planner lists it once."""
    from labkit.costmodel.compute import GPUS
    from labkit.costmodel.planner import Cluster
    from labkit.costmodel.rank_memory import layout_memory
    from labkit.costmodel.step import Layout, predict_step

    shape = TransformerShape.preset("gpt3-175b")
    hardware = Cluster(GPUS["H100 80GB"], 512, 0.53).hardware()
    one, two = (Layout(16, 4, 8, zero, 1, schedule="interleaved", virtual_stages=12) for zero in (1, 2))
    assert predict_step(shape, one, 1536, hardware, gradient_bytes=4) == dataclasses.replace(
        predict_step(shape, two, 1536, hardware, gradient_bytes=4), layout=one)
    assert layout_memory(shape, one, 1536, gradient_bytes=4) == layout_memory(shape, two, 1536, gradient_bytes=4)
    assert layout_memory(shape, dataclasses.replace(two, dp=64, pp=2, virtual_stages=1, schedule="1f1b"), 64,
                         gradient_bytes=4)["gradients"] < layout_memory(
        shape, dataclasses.replace(one, dp=64, pp=2, virtual_stages=1, schedule="1f1b"), 64,
        gradient_bytes=4)["gradients"]
