"""The cost model of mixtures of experts (``labkit.costmodel.experts`` and the MoE fields of ``TransformerShape``):
published parameter counts, each rank's parameters under expert parallelism against what ``parallelize`` holds,
the all-to-all's bytes and time, the step and memory terms, and ``labkit plan`` on the two presets."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from labkit.cli import main
from labkit.costmodel.collectives import LinkModel
from labkit.costmodel.compute import GPUS, model_flops_per_step
from labkit.costmodel.experts import (
    busiest_rank_share,
    ep_all_to_all_s,
    ep_messages,
    ep_uniform_bytes,
    expected_max_normal,
)
from labkit.costmodel.planner import Cluster, candidates
from labkit.costmodel.rank_memory import layout_memory
from labkit.costmodel.shapes import TransformerShape, expert_parameters, mla_parameters, num_parameters
from labkit.costmodel.stages import Layout, rank_expert_parameters, rank_parameters
from labkit.costmodel.step import predict_step
from labkit.launch import launch
from labkit.mesh import Mesh
from labkit.models import GPTConfig, TinyGPT
from labkit.parallel.parallelize import parallelize


def test_the_presets_have_their_published_sizes():
    mixtral, deepseek = TransformerShape.preset("mixtral-8x7b"), TransformerShape.preset("deepseek-v3")
    assert round(num_parameters(mixtral) / 1e9, 1) == 46.7  # Mistral AI: 46.7B total, 12.9B per token
    assert round(num_parameters(mixtral, active=True) / 1e9, 1) == 12.9
    assert round(num_parameters(deepseek) / 1e9) == 671  # DeepSeek-V3: 671B total, 37B activated
    assert int(num_parameters(deepseek, active=True) / 1e9) == 37
    # MLA, written out for DeepSeek-V3's sizes (q rank 1536, kv rank 512, heads of 128 + 64 rotary, values 128)
    queries = 7168 * 1536 + 1536 + 1536 * 128 * 192
    keys_values = 7168 * (512 + 64) + 512 + 512 * 128 * 256
    assert mla_parameters(7168, 128, 1536, 512, 128, 64, 128) == queries + keys_values + 128 * 128 * 7168
    assert expert_parameters(deepseek) == 58 * 256 * 3 * 7168 * 2048
    dense = TransformerShape.preset("llama-3-8b")
    assert expert_parameters(dense) == 0 and num_parameters(dense, active=True) == num_parameters(dense)


def test_an_moe_step_counts_the_active_weights_only():
    mixtral = TransformerShape.preset("mixtral-8x7b")
    dense_twin = dataclasses.replace(mixtral, num_experts=0)  # one expert's width as the MLP: k = 1 of 1
    step, twin = model_flops_per_step(mixtral, 1), model_flops_per_step(dense_twin, 1)
    mlp = 3 * 4096 * 14336 * 2 * 4096 * 3 * 32  # one more expert's matrices, every token, 3 passes, 32 layers
    router = 4096 * 8 * 2 * 4096 * 3 * 32
    assert step - twin == pytest.approx(mlp + router, rel=1e-12)


def _held(layout: tuple[int, int, int], config: GPTConfig) -> int:
    dp, pp, ep = layout
    model = parallelize(TinyGPT(config, seed=0), Mesh(dp=dp, pp=pp, ep=ep), micro_batch_size=1, seq_len=8,
                        microbatches=2 if pp > 1 else 1)
    return sum(p.numel() for p in model.module.parameters())


@pytest.mark.parametrize("layout", [(4, 1, 2), (4, 1, 4), (2, 2, 2)])
def test_each_rank_holds_the_parameters_the_model_gives_it(layout):
    dp, pp, ep = layout
    config = GPTConfig.preset("100k", tie_weights=False, n_experts=4, top_k=2, expert_hidden=32, n_shared_experts=1)
    shape = TransformerShape.from_gpt_config(config)
    assert num_parameters(shape) == TinyGPT(config).num_parameters()
    held = launch(_held, layout, config, nprocs=dp * pp, timeout=120, rank_output="none")
    model = Layout(dp=dp, tp=1, pp=pp, ep=ep)
    predicted = [dense - experts + experts / ep for dense, experts in
                 zip(rank_parameters(shape, model), rank_expert_parameters(shape, model), strict=True)]
    assert held == [predicted[rank // dp] for rank in range(dp * pp)]


def test_the_all_to_all_bytes_and_time():
    assert ep_uniform_bytes(1024, 2, 4096, 2, 8) == 1024 * 2 * 4096 * 2 * 7 / 8
    messages = ep_messages([3, 5, 0], [4, 4, 1], rank=1, row_bytes=10)
    assert messages == [("forward", "dispatch", 30), ("forward", "combine", 50),
                        ("backward", "dcombine", 30), ("backward", "ddispatch", 50)]
    shape = TransformerShape.preset("mixtral-8x7b")
    link = LinkModel(1e-5, 1e-10)
    layout = Layout(dp=8, tp=2, pp=1, ep=4, micro_batch=2)
    tokens = 2 * 4096 / 2
    expected = 3 * 1e-5 + tokens * 2 * 4096 * 2 * 3 / 4 * 1e-10 + 5e-6
    assert ep_all_to_all_s(shape, layout, link, 5e-6) == pytest.approx(expected)
    assert ep_all_to_all_s(shape, dataclasses.replace(layout, ep=1), link) == 0.0


def test_the_busiest_rank_of_a_uniform_router():
    assert expected_max_normal(1) == pytest.approx(0.0, abs=1e-12)
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-9)  # E[max of two] = 1/sqrt(pi)
    assert expected_max_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), rel=1e-9)
    generator = torch.Generator().manual_seed(1)
    for ep in (4, 16):
        shares = []
        for _ in range(500):
            counts = torch.bincount(torch.randint(ep, (4096,), generator=generator), minlength=ep).double()
            shares.append(float(counts.max() / counts.mean()))
        assert busiest_rank_share(4096, ep) == pytest.approx(sum(shares) / len(shares), rel=0.01)
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        expected_max_normal(0)


def test_expert_parallelism_in_the_step_and_memory_models():
    shape = TransformerShape.preset("mixtral-8x7b")
    hardware = Cluster(GPUS["H100 80GB"], 64).hardware()
    alone, split = (predict_step(shape, Layout(dp=64, tp=1, pp=1, zero=1, ep=ep), 256, hardware) for ep in (1, 8))
    assert "ep" not in alone.parts() and split.parts()["ep"] > 0
    assert split.compute_s == pytest.approx(alone.compute_s)  # the same FLOPs, only moved
    assert split.dp_s < alone.dp_s  # experts reduced over 8 replicas instead of 64
    mixed = {ep: layout_memory(shape, Layout(dp=64, tp=1, pp=1, zero=1, ep=ep), 256) for ep in (1, 8)}
    experts = expert_parameters(shape)
    weights = (mixed[1]["weights"] - mixed[8]["weights"]) / 2  # 2 bytes a bf16 weight
    assert weights == pytest.approx(experts * (1 - 1 / 8))
    assert {layout.ep for layout in candidates(shape, 64, 256, schedules=("1f1b",))} == {1, 2, 4, 8}
    assert {layout.ep for layout in candidates(TransformerShape.preset("llama-3-8b"), 64, 256)} == {1}
    with pytest.raises(ValueError, match="ep=4 must divide dp x cp = 2"):
        predict_step(shape, Layout(dp=2, tp=1, pp=1, ep=4), 256, hardware)


def test_labkit_plan_handles_the_moe_presets(capsys):
    assert main(["plan", "--model", "mixtral-8x7b", "--gpu", "H100 80GB", "--gpus", "64", "--global-batch",
                 "256", "--top", "3", "--ep", "1,8"]) == 0
    out = capsys.readouterr().out
    assert "46.7B parameters, 12.9B active" in out and " ep=8 " in out and "all-to-alls" in out
    assert main(["plan", "--model", "llama-3-8b", "--ep", "2"]) == 2
    assert "--ep splits a mixture of experts' experts: llama-3-8b is dense" in capsys.readouterr().err
