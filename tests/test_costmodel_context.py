"""Context parallelism in the cost model: the Playbook's 8B memory figure, the step model's cp term, the
planner at 131,072 tokens, and Llama 3's long-context row predicted beside its published MFU.

The Playbook's numbers are the figure's own data ("Memory Usage for 8B Model", section Context Parallelism of
the Ultra-Scale Playbook, Tazi et al. 2025), read from ``docs/fragments/cp_8Bmemoryusage.html`` of the mirror
``lzx1413/ultra-scale-book`` (commit d267202): GiB per GPU, batch 1, at 1k, 4k, 16k, 64k and 128k tokens.
"""

from __future__ import annotations

import dataclasses

import pytest

from labkit.costmodel import context
from labkit.costmodel.collectives import LinkModel
from labkit.costmodel.compute import GPUS
from labkit.costmodel.memory import activation_bytes
from labkit.costmodel.planner import Cluster, plan
from labkit.costmodel.rank_memory import layout_memory
from labkit.costmodel.published import LLAMA3_405B
from labkit.costmodel.shapes import TransformerShape
from labkit.costmodel.simulator import simulate_step
from labkit.costmodel.step import Hardware, Layout, predict_step
from labkit.costmodel.validation import EFFICIENCY, FIT_SET, predict

PLAYBOOK_8B = {  # (tp, cp): (parameters, gradients, optimizer states, activations at each length), GiB
    (1, 1): (14.957, 14.957, 59.828, (4.25, 17, 68, 272, 544)),
    (2, 1): (7.479, 7.479, 29.914, (2.75, 11, 44, 176, 352)),
    (2, 4): (7.479, 7.479, 29.914, (0.6875, 2.75, 11, 44, 88)),
}
LENGTHS = (1024, 4096, 16384, 65536, 131072)
LLAMA_8B = TransformerShape.preset("llama-3-8b")


def test_the_memory_model_reproduces_every_bar_of_the_playbooks_8b_figure():
    for (tp, cp), (weights, gradients, optimizer, activations) in PLAYBOOK_8B.items():
        for seq_len, expected in zip(LENGTHS, activations, strict=True):
            ours = context.playbook_memory(LLAMA_8B, seq_len, tp, cp)
            assert ours["activations"] == pytest.approx(expected, rel=1e-9), (tp, cp, seq_len)
            # labkit counts the norms' weights too (266k of 8.03B): 3e-5 relative
            assert ours["parameters"] == pytest.approx(weights, rel=1e-4)
            assert ours["gradients"] == pytest.approx(gradients, rel=1e-4)
            assert ours["optimizer_states"] == pytest.approx(optimizer, rel=1e-4)
    # what the figure shows: at 128k nothing fits an 80 GB H100 but TP 2 x CP 4 comes within 2x of it
    assert context.playbook_memory(LLAMA_8B, 131072, 2, 4)["total"] < context.playbook_memory(LLAMA_8B, 131072, 2)[
        "total"] / 2.9


HARDWARE = Hardware(flops=4e14, intra_node=LinkModel(5e-6, 1 / 400e9), inter_node=LinkModel(1e-5, 1 / 25e9))


def test_the_ring_hides_its_sends_behind_attention_and_all_gather_and_ulysses_do_not():
    shape = dataclasses.replace(LLAMA_8B, seq_len=131072)
    link = HARDWARE.intra_node
    for strategy in ("ring", "all_gather", "ulysses"):
        assert context.cp_layer_seconds(shape, Layout(1, 1, 1, cp=1, cp_strategy=strategy), HARDWARE, link) == (0, 0)
    ring = context.cp_layer_seconds(shape, Layout(1, 1, 1, cp=8), HARDWARE, link)
    assert ring == (0.0, 0.0)  # a block's attention outlasts its transfer at 128k: all hidden (no slowdown here)
    short = dataclasses.replace(LLAMA_8B, seq_len=1024)
    exposed = context.cp_layer_seconds(short, Layout(1, 1, 1, cp=8), HARDWARE, HARDWARE.inter_node)
    assert exposed[0] > 0 and exposed[1] == pytest.approx(2 * exposed[0])
    gathered = context.cp_layer_seconds(shape, Layout(1, 1, 1, cp=8, cp_strategy="all_gather"), HARDWARE, link)
    ulysses = context.cp_layer_seconds(shape, Layout(1, 1, 1, cp=8, cp_strategy="ulysses"), HARDWARE, link)
    assert gathered[0] > 0 and gathered[1] > gathered[0] and ulysses[0] > 0


def test_cp_divides_each_ranks_compute_and_activations_and_shards_zero_over_dp_times_cp():
    shape = dataclasses.replace(LLAMA_8B, seq_len=32768)
    alone = predict_step(shape, Layout(8, 1, 1), 64, HARDWARE)
    split = predict_step(shape, Layout(4, 1, 1, cp=2), 64, HARDWARE)
    assert split.microbatches == 2 * alone.microbatches  # dp = 4 replicas, not 8: twice the micro-batches
    # per micro-batch a cp rank computes half of what a whole-sequence rank does; it has twice the micro-batches
    assert split.forward_s - split.cp_s / (2 * split.microbatches) == pytest.approx(alone.forward_s / 2, rel=1e-9)
    assert "cp" in split.parts() and "cp" not in alone.parts()
    whole = layout_memory(shape, Layout(8, 1, 1, zero=1), 64)
    halved = layout_memory(shape, Layout(4, 1, 1, zero=1, cp=2), 64)
    half_shape = dataclasses.replace(shape, seq_len=16384)
    assert halved["activations"] > activation_bytes(half_shape, 1, flash_attention=True, dropout=True)
    assert halved["optimizer_states"] == pytest.approx(whole["optimizer_states"])  # ZeRO-1 over 4 x 2 = 8
    with pytest.raises(ValueError, match="zig-zag chunks do not divide"):
        predict_step(dataclasses.replace(shape, seq_len=1000), Layout(4, 1, 1, cp=16), 64, HARDWARE)
    with pytest.raises(ValueError, match="cp=2 is priced by"):
        simulate_step(shape, Layout(4, 1, 1, cp=2), 64, HARDWARE)


def test_the_planner_turns_to_cp_when_nothing_else_fits_or_divides():
    options = {"gradient_bytes": 4, "dropout": False}
    # Llama 3 8B at 1M tokens on 64 H100s: every layout without CP needs more than 72 GB a GPU
    shape = dataclasses.replace(LLAMA_8B, seq_len=1 << 20)
    cluster = Cluster(GPUS["H100 80GB"], 64, EFFICIENCY)
    without = plan(shape, cluster, 4, top=3, context_parallel=(1,), **options)
    assert without.candidates == [] and "nothing fits" in without.reason() and without.considered > 0
    found = plan(shape, cluster, 4, top=3, **options)
    assert found.candidates and all(candidate.layout.cp > 1 for candidate in found.candidates)
    assert all(candidate.memory["total"] <= cluster.usable_bytes for candidate in found.candidates)
    # Llama 3 405B's 131k stage (Table 4): 128 sequences on 16,384 GPUs; TP stops at a node's 8, and 126 layers
    # allow 2 pipeline stages of a power-of-two cluster, so without CP no layout even divides the batch
    shape = dataclasses.replace(TransformerShape.preset("llama-3-405b"), seq_len=131072)
    cluster = Cluster(GPUS["H100 80GB"], 16384, EFFICIENCY)
    without = plan(shape, cluster, 128, top=3, context_parallel=(1,), **options)
    assert without.considered == 0 and "no configuration divides" in without.reason()
    found = plan(shape, cluster, 128, top=3, **options)
    assert found.candidates and all(candidate.layout.cp >= 8 for candidate in found.candidates)


def test_llama3_131k_row_is_predicted_closer_than_the_constant_baseline():
    """Table 4's CP = 16 row (38 % MFU published): the step model at the published layout, not fitted to it,
    against the simplest rival, the fit set's mean MFU."""
    row = LLAMA3_405B[2]
    step, predicted = predict(row)
    constant = sum(run.model_mfu for run in FIT_SET) / len(FIT_SET)
    assert abs(predicted - row.model_mfu) < abs(constant - row.model_mfu)
    assert step.cp_s > 0 and step.layout.cp_strategy == "all_gather"
    # the same tokens per GPU as the 8k row on 16,384 GPUs: about the same memory per GPU
    assert row.memory()["total"] == pytest.approx(LLAMA3_405B[1].memory()["total"], rel=0.05)


def test_labkit_plan_takes_a_sequence_length_and_cp_degrees(capsys):
    from labkit.cli import main

    argv = ["plan", "--model", "llama-3-8b", "--gpu", "H100 80GB", "--gpus", "64", "--global-batch", "4",
            "--seq-len", str(1 << 20), "--top", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "x 1048576 tokens" in out and " cp=" in out and "context parallelism's K/V exchange" in out
    assert main([*argv, "--cp", "1"]) == 1 and "nothing fits" in capsys.readouterr().out
    assert main([*argv, "--cp", "2,x"]) == 2 and "--cp must be degrees >= 1" in capsys.readouterr().err
