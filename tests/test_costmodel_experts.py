"""The cost model of mixtures of experts (``labkit.costmodel.experts`` and the MoE fields of ``TransformerShape``):
published parameter counts, each rank's parameters under expert parallelism against what ``parallelize`` holds,
the all-to-all's bytes and time, the step and memory terms, and ``labkit plan`` on the two presets."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from labkit.cli import main
from labkit.costmodel.collectives import LinkModel
from labkit.costmodel.compute import GPUS, model_flops_per_step
from labkit.costmodel.experts import (
    busiest_rank_share,
    distinct_nodes,
    ep_all_to_all_s,
    ep_messages,
    ep_node_bytes,
    ep_uniform_bytes,
    expected_max_normal,
)
from labkit.costmodel.hardware import link_of
from labkit.costmodel.planner import Cluster, candidates
from labkit.costmodel.rank_memory import layout_memory
from labkit.costmodel.shapes import TransformerShape, expert_parameters, mla_parameters, num_parameters
from labkit.costmodel.stages import Hardware, Layout, rank_expert_parameters, rank_parameters
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


def test_deepseek_v3s_active_count_includes_the_embedding_and_head_as_deepseek_counts_it():
    """DeepSeek's weight documentation (README_WEIGHTS.md): 36.7B activated, "including 0.9B for Embedding and 0.9B
    for the output Head" (the report's "37B").  labkit's count with both lies within 2.5% of it; the rival count
    without them (a scaling-law convention) lies further; a token's 8 routed and 1 shared experts are as wide as a
    dense layer's MLP."""
    shape = TransformerShape.preset("deepseek-v3")
    active, embedding = num_parameters(shape, active=True), shape.vocab_size * shape.hidden_size
    assert embedding == pytest.approx(0.93e9, rel=0.01)
    assert abs(active - 36.7e9) <= 0.025 * 36.7e9 < abs(active - 2 * embedding - 36.7e9)
    assert (shape.top_k + shape.shared_experts) * shape.expert_ffn_hidden_size == shape.ffn_hidden_size


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
    hardware = Hardware(1e15, LinkModel(1e-5, 1e-10), LinkModel(1e-4, 1e-9), 8, call_latency_s=5e-6)
    layout = Layout(dp=8, tp=2, pp=1, ep=4, micro_batch=2)  # 4 ranks 2 apart: 8 GPUs, one node
    tokens = 2 * 4096 / 2
    expected = 3 * 1e-5 + tokens * 2 * 4096 * 2 * 3 / 4 * 1e-10 + 5e-6
    assert ep_all_to_all_s(shape, layout, hardware) == pytest.approx(expected)
    assert ep_all_to_all_s(shape, dataclasses.replace(layout, ep=1), hardware) == 0.0


def test_a_cross_node_all_to_all_sends_through_each_gpus_own_adapter():
    """Lesson 14's Mixtral all-to-all at ep = 16 over two nodes of 8 H100s, by hand: each rank's 4,096 tokens x 2
    rows of 4,096 bf16 values, 64 MiB; 7/16 of it to the 7 other ranks of its node over NVLink (450 GB/s), 8/16 to
    the other node's 8 through its own adapter (50 GB/s), both at once.  The old model put all 15/16 on the rails
    link a ring all-reduce gets, 8 adapters' worth (400 GB/s): 0.38 ms, as lesson 14 printed."""
    mixtral, hardware = TransformerShape.preset("mixtral-8x7b"), Cluster(GPUS["H100 80GB"], 64).hardware()
    rows = 4096 * 2 * 4096 * 2
    on_node, off_node = rows * 7 / 16, rows * 8 / 16  # 28 MiB and 32 MiB
    assert ep_node_bytes(4096, 2, 4096, 2, 16, 8, 8) == (on_node, off_node)
    nvlink = 7 * 3.4e-6 + on_node / 450e9  # 23.8 us + 65.2 us
    network = 8 * 14e-6 + off_node / 50e9  # 112 us + 671.1 us
    assert off_node / 50e9 == pytest.approx(0.6711e-3, rel=1e-4)  # the bandwidth term: at least 0.67 ms
    new = ep_all_to_all_s(mixtral, Layout(dp=32, tp=1, pp=1, ep=16), hardware)
    assert new == pytest.approx(max(nvlink, network) + 8.4e-6) and new == pytest.approx(0.7915e-3, rel=1e-4)
    old_link = link_of(hardware, 1, 16)  # what the old model used: 8 adapters, 400 GB/s
    assert old_link.bandwidth_bytes_per_s == pytest.approx(400e9)
    old = 15 * 14e-6 + rows * 15 / 16 / 400e9 + 8.4e-6  # 210 us + 157.3 us + 8.4 us
    assert round(old * 1e3, 2) == 0.38 and rows * 15 / 16 / 400e9 == pytest.approx(0.1573e-3, rel=1e-3)
    assert new / old > 2.1
    # inside one node (ep = 8) nothing changes: every row over NVLink, 7 messages
    inside = ep_all_to_all_s(mixtral, Layout(dp=32, tp=1, pp=1, ep=8), hardware)
    assert inside == pytest.approx(7 * 3.4e-6 + rows * 7 / 8 / 450e9 + 8.4e-6)
    # ep = 16 ranks 4 apart (tp = 4) span 8 nodes, 2 on each: 1/16 over NVLink, 14/16 through the adapter
    spread = ep_all_to_all_s(mixtral, Layout(dp=16, tp=4, pp=1, ep=16), hardware)
    assert spread == pytest.approx(14 * 14e-6 + rows / 4 * 14 / 16 / 50e9 + 8.4e-6)


def _brute_force_nodes(nodes: int, per_node: int, top_k: int, limit: int | None = None) -> tuple[float, float]:
    """The mean of (nodes hit, nodes hit other than node 0) over every equally likely routing: each set of
    ``limit`` nodes (all of them without a limit), then each set of ``top_k`` distinct experts on those nodes."""
    used = nodes if limit is None else min(limit, nodes)
    hits = others = count = 0
    for chosen in itertools.combinations(range(nodes), used):
        pool = [expert for expert in range(nodes * per_node) if expert // per_node in chosen]
        for experts in itertools.combinations(pool, top_k):
            hit = {expert // per_node for expert in experts}
            hits, others, count = hits + len(hit), others + len(hit - {0}), count + 1
    return hits / count, others / count


@pytest.mark.parametrize("case", [(3, 2, 2, None), (4, 3, 3, None), (2, 4, 3, None), (4, 3, 3, 2), (5, 2, 4, 3),
                                  (6, 3, 4, 2), (3, 2, 2, 5)])
def test_distinct_nodes_is_the_brute_force_count(case):
    nodes, per_node, top_k, limit = case
    hits, others = _brute_force_nodes(nodes, per_node, top_k, limit)
    assert distinct_nodes(nodes, per_node, top_k, limit) == pytest.approx(hits, rel=1e-12)
    assert distinct_nodes(nodes, per_node, top_k, limit) * (nodes - 1) / nodes == pytest.approx(others, rel=1e-12)


def test_distinct_nodes_by_hand_and_its_with_replacement_limit():
    assert distinct_nodes(3, 2, 2) == pytest.approx(3 * (1 - 6 / 15))  # 1.8: C(4, 2) / C(6, 2) pairs miss a node
    assert 3 * (1 - (2 / 3) ** 2) == pytest.approx(1.667, abs=1e-3)  # with replacement: off for 2 experts a node
    assert distinct_nodes(8, 100_000, 8) == pytest.approx(8 * (1 - (7 / 8) ** 8), rel=1e-4)  # 5.25: x >> k
    assert distinct_nodes(8, 32, 8, 8) == distinct_nodes(8, 32, 8)  # a limit of all the nodes limits nothing
    # a limit of 2 nodes of 2 experts cannot hold 5: the token uses the 3 nodes that can
    assert distinct_nodes(6, 2, 5, 2) == distinct_nodes(6, 2, 5, 3) == pytest.approx(_brute_force_nodes(6, 2, 5, 3)[0])
    with pytest.raises(ValueError, match="do not fit"):
        distinct_nodes(2, 2, 5)


def test_node_limited_routing_crosses_the_network_once_per_node():
    """DeepSeek-V3 (max_nodes = 4) at ep = 64 over 8 nodes, by hand: 256 experts, 32 a node; a token's 8 experts
    among the 128 of its 4 nodes miss a given one of them with chance C(96, 8) / C(128, 8), so it uses 3.63 nodes,
    7/8 of them other nodes: 3.18 rows of 7,168 bf16 values cross the network a token instead of 8 x 56/64 = 7."""
    deepseek, hardware = TransformerShape.preset("deepseek-v3"), Cluster(GPUS["H100 80GB"], 64).hardware()
    assert deepseek.max_nodes == 4
    miss = math.prod((96 - i) / (128 - i) for i in range(8))
    other = 4 * (1 - miss) * 7 / 8
    assert miss == pytest.approx(0.0927, abs=1e-4) and other == pytest.approx(3.175, abs=1e-3)
    row, tokens = 7168 * 2, 4096
    direct = tokens * 8 * 7 / 64 * row  # rows for the 7 other GPUs of its node
    forwarded = tokens * 8 * 7 / 8 * 7 / 8 * row  # rows that arrived over the network, passed on over NVLink there
    assert ep_node_bytes(tokens, 8, 7168, 2, 64, 8, 256, 4) == (pytest.approx(direct + forwarded),
                                                               pytest.approx(tokens * other * row))
    layout = Layout(dp=64, tp=1, pp=1, ep=64)
    limited = ep_all_to_all_s(deepseek, layout, hardware)
    assert limited == pytest.approx(max(7 * 3.4e-6 + (direct + forwarded) / 450e9,
                                        7 * 14e-6 + tokens * other * row / 50e9) + 8.4e-6)
    plain = ep_all_to_all_s(dataclasses.replace(deepseek, max_nodes=None), layout, hardware)
    assert plain == pytest.approx(max(7 * 3.4e-6 + direct / 450e9, 56 * 14e-6 + tokens * 7 * row / 50e9) + 8.4e-6)
    assert plain / limited == pytest.approx(2.35, abs=0.01)  # 7 rows against 3.18 a token, 56 messages against 7
    with pytest.raises(ValueError, match="max_nodes must be an integer >= 1"):
        dataclasses.replace(deepseek, max_nodes=0)


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
