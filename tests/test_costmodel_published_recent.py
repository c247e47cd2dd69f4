"""The 2022-2025 published runs (labkit.costmodel.published_recent), checked as data: each row builds, its model
has the size printed, and the numbers each source prints agree with one another.  Nothing here predicts a step:
the sets were recorded before the step model was held to them.

Sources (the module docstring has the commits and what is inferred): torchtitan's benchmark pages
(benchmarks/llama3_h100_202412_torchtitan.md; docs/performance.md at 3faaa1a0), Korthikanti et al. 2022 (arXiv
2205.05198, Tables 3 and 5; Megatron-LM README at 2e90a342f5), Smith et al. 2022 (MT-NLG, arXiv 2201.11990),
BigScience's tr11-176B-ml README and chronicles, and the DeepSeek-V3 Technical Report (arXiv 2412.19437).
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from labkit.costmodel.compute import GPUS
from labkit.costmodel.published import NARAYANAN_2021, PublishedRun
from labkit.costmodel.published_recent import (
    BLOOM_176B,
    DEEPSEEK_V3,
    KORTHIKANTI_2022,
    KORTHIKANTI_ROWS,
    LLAMA_SHAPES,
    MTNLG_530B,
    MTNLG_TIME_RESOLUTION_S,
    RECENT_RUNS,
    TIME_RESOLUTION_S,
    TORCHTITAN_2024_12_MFU_RANGE,
    TORCHTITAN_A100,
    TORCHTITAN_A100_ROWS,
    TORCHTITAN_CP,
    TORCHTITAN_H100,
    flops_per_token,
)
from labkit.costmodel.shapes import TransformerShape, layer_parameters, num_parameters

ALL_ROWS = RECENT_RUNS + TORCHTITAN_CP


def _ids(runs):
    return [run.name for run in runs]


def test_each_set_holds_the_rows_its_rule_takes():
    """Every bf16 row of torchtitan's tables (4 + 1 on H100s, 8 on A100s), every cell of Korthikanti et al.'s
    Table 5 (4 sizes x 2 columns), MT-NLG's three points, BLOOM's one line; Table 2's 4 float8 rows apart."""
    sizes = [len(s) for s in (TORCHTITAN_H100, TORCHTITAN_A100, KORTHIKANTI_2022, MTNLG_530B, BLOOM_176B)]
    assert sizes == [5, 8, 8, 3, 1] and len(RECENT_RUNS) == 25 and len(TORCHTITAN_CP) == 4
    assert len({run.name for run in ALL_ROWS}) == len(ALL_ROWS)
    assert not any(run.float8 for run in RECENT_RUNS) and all(run.float8 for run in TORCHTITAN_CP)


@pytest.mark.parametrize("run", ALL_ROWS, ids=_ids(ALL_ROWS))
def test_each_row_builds_its_shape_and_layout(run):
    assert run.tp * run.cp * run.pp * run.dp == run.gpus and run.global_batch % (run.dp * run.micro_batch) == 0
    assert run.gpu in GPUS and run.tflops_per_gpu > 0 and run.tflops_resolution > 0
    assert run.layout().gpus == run.gpus and num_parameters(run.shape()) > 0
    assert run.stage_layers is None or sum(run.stage_layers) == run.num_layers


def test_a_recompute_mode_that_contradicts_recompute_is_refused():
    run = KORTHIKANTI_2022[1]
    with pytest.raises(ValueError, match="recompute_mode"):
        dataclasses.replace(run, recompute=True)  # "selective" is not full recomputation
    with pytest.raises(ValueError, match="recompute_mode"):
        dataclasses.replace(run, recompute_mode="selective block")


# --------------------------------------------------------------------------------------------------------
# Model sizes

SHAPES = {run.parameters + " " + run.architecture + str(run.vocab_size): run for run in ALL_ROWS}


@pytest.mark.parametrize("run", SHAPES.values(), ids=list(SHAPES))
def test_parameter_counts_give_the_printed_model_sizes(run):
    """Rounded or cut to the digits printed ("1T": 1,008.0B), the count of the shape as built is the size printed;
    Llama 2 70B alone is named above its count (Meta's "70B", 68.98B built, as labkit's preset counts it)."""
    if run.vocab_size == 32000 and run.num_layers == 80:
        assert num_parameters(run.shape()) == num_parameters(TransformerShape.preset("llama-2-70b")) == 68976648192
        return
    scale = 1000 if run.parameters.endswith("T") else 1  # billions in a printed unit
    units = num_parameters(run.shape()) / 1e9 / scale
    assert float(run.parameters[:-1]) in (round(units), math.floor(units))


def test_llama_shapes_are_labkits_presets_and_the_megatron_shapes_narayanans():
    """The Llama 3 rows build exactly labkit's presets (Dubey et al. 2024, Table 3); the 530B and 1T GPTs of
    Korthikanti et al. and MT-NLG are Narayanan et al. 2021's 529.6B and 1008.0B rows' shapes."""
    for name, preset in (("Llama 3 8B", "llama-3-8b"), ("Llama 3 405B", "llama-3-405b")):
        run = next(run for run in ALL_ROWS if run.num_layers == LLAMA_SHAPES[name][0] and run.seq_len == 8192)
        assert num_parameters(run.shape()) == num_parameters(TransformerShape.preset(preset))
    for row, size in ((KORTHIKANTI_2022[4], "529.6B"), (KORTHIKANTI_2022[6], "1008.0B"), (MTNLG_530B[0], "529.6B")):
        narayanan = next(run for run in NARAYANAN_2021 if run.parameters == size)
        assert num_parameters(row.shape()) == num_parameters(narayanan.shape())


def test_bloom_counts_as_its_readme_does():
    """tr11-176B-ml's README: one layer ``12 h^2 + 13 h`` = 2,466,437,120 parameters, the embedding 250,880 x
    14,336 = 3,596,615,680; ALiBi, so no position table (one would add 2,048 x 14,336)."""
    run = BLOOM_176B[0]
    assert layer_parameters(run.shape()) == 2_466_437_120 and run.vocab_size * run.hidden_size == 3_596_615_680
    with_table = dataclasses.replace(run, learned_positions=True)
    assert num_parameters(with_table.shape()) - num_parameters(run.shape()) == 2048 * 14336


# --------------------------------------------------------------------------------------------------------
# Throughput against utilisation, where both are printed


def _torchtitan_flops_per_token(run: PublishedRun, embedding: bool) -> float:
    """torchtitan's ``6 N + 12 l h s`` (``get_num_flop_per_token``); ``N`` with the input embedding (April 2024)
    or without (from August 2024)."""
    shape = run.shape()
    params = num_parameters(shape) - (0 if embedding else shape.vocab_size * shape.hidden_size)
    return 6 * params + 12 * shape.num_layers * shape.hidden_size * shape.seq_len


@pytest.mark.parametrize("run", TORCHTITAN_A100, ids=_ids(TORCHTITAN_A100))
def test_torchtitan_a100_mfu_is_its_count_and_labkits_plus_the_embedding(run):
    """docs/performance.md (A100 tables): the printed MFU is WPS x (6 N + 12 l h s) over 312 TFLOP/s with every
    parameter in N, within the last digit of both; labkit's count is that less the input embedding's 6 V h
    (and the norms', under 0.01 %)."""
    peak, wps = GPUS[run.gpu].peak_bf16_flops, run.tokens_per_s_per_gpu
    theirs = _torchtitan_flops_per_token(run, embedding=True)
    assert abs(wps * theirs / peak - run.mfu) <= 0.0005 + 0.5 * theirs / peak
    assert flops_per_token(run) == pytest.approx(theirs - 6 * run.vocab_size * run.hidden_size, rel=1e-4)
    assert run.model_mfu == pytest.approx(wps * flops_per_token(run) / peak, rel=1e-12) and run.model_mfu < run.mfu


def test_torchtitan_405b_mfu_is_labkits_count():
    """docs/performance.md at 3faaa1a0: 109 WPS and 29.0 % for the 405B on 128 H100s; by August 2024 torchtitan
    left the embedding out, which is labkit's count: 28.94 %, within the WPS's last digit."""
    run = TORCHTITAN_H100[4]
    peak = GPUS[run.gpu].peak_bf16_flops
    assert flops_per_token(run) == pytest.approx(_torchtitan_flops_per_token(run, embedding=False), rel=1e-4)
    assert abs(run.model_mfu - run.mfu) <= 0.0005 + 0.5 * flops_per_token(run) / peak


def test_torchtitan_h100_bf16_rows_span_the_printed_33_to_39_percent():
    """benchmarks/llama3_h100_202412_torchtitan.md: the 1D 8B runs "achieve 33% to 39% MFU" (its count, labkit's
    since August 2024): the four bf16 rows' lowest and highest, rounded, are those two."""
    mfus = [run.model_mfu for run in TORCHTITAN_H100[:4]]
    assert (round(min(mfus), 2), round(max(mfus), 2)) == TORCHTITAN_2024_12_MFU_RANGE


def test_torchtitan_rows_take_the_printed_tokens_per_second():
    for run in TORCHTITAN_H100 + TORCHTITAN_A100 + TORCHTITAN_CP:
        tokens = run.tokens_per_step / run.implied_step_s() / run.gpus
        assert tokens == pytest.approx(run.tokens_per_s_per_gpu, rel=1e-9)


def test_torchtitan_context_parallel_rows_hold_the_tokens_of_a_step_fixed():
    """Table 2: local batch 1 on each of 8 GPUs' FSDP ranks; FSDP x CP = 8 and 262,144 tokens a step in each row."""
    assert {run.tokens_per_step for run in TORCHTITAN_CP} == {262144}
    assert all(run.dp * run.cp == run.gpus == 8 and run.global_batch == run.dp for run in TORCHTITAN_CP)


@pytest.mark.parametrize("row", KORTHIKANTI_ROWS, ids=[row[0] for row in KORTHIKANTI_ROWS])
def test_korthikanti_columns_agree_with_one_another(row):
    """Table 5: the printed MFU is the model FLOPs over the printed time (within its 0.005 s and the MFU's 0.05
    points), the HFU is the MFU with the attention's recomputed ``s / 6h`` added (``1 + s/3h`` for ``1 + s/6h``),
    and the throughput increase is the ratio of the two times, within their rounding."""
    size, _, hidden, layers, _, _, _, _, full_s, present_s, increase, mfu, hfu = row
    full, selective = (run for run in KORTHIKANTI_2022 if run.parameters == size)
    assert selective.mfu == mfu / 100 and full.mfu is None and selective.step_s == present_s
    assert abs(selective.model_mfu - mfu / 100) <= 0.0005 + selective.model_mfu * TIME_RESOLUTION_S / present_s
    assert selective.implied_step_s() == pytest.approx(present_s, rel=1e-9)
    s, v = 2048, 51200
    ratio = (1 + s / (3 * hidden) + v / (12 * layers * hidden)) / (1 + s / (6 * hidden) + v / (12 * layers * hidden))
    assert abs(mfu * ratio - hfu) <= 0.1
    low = (full_s - TIME_RESOLUTION_S) / (present_s + TIME_RESOLUTION_S) - 1
    high = (full_s + TIME_RESOLUTION_S) / (present_s - TIME_RESOLUTION_S) - 1
    assert low - 0.0005 <= increase / 100 <= high + 0.0005


def test_korthikanti_selective_rows_gain_what_full_recomputation_costs():
    """Full recomputation reruns each layer's forward, a quarter more work: its rows' MFU is 76-78 % of the
    selective rows' (sequence parallelism and the attention's own recomputation make up the rest)."""
    for full, selective in zip(KORTHIKANTI_2022[::2], KORTHIKANTI_2022[1::2], strict=True):
        assert full.recompute and not selective.recompute and selective.sequence_parallel
        assert 0.75 < full.model_mfu / selective.model_mfu < 0.78


@pytest.mark.parametrize("run", MTNLG_530B + BLOOM_176B, ids=_ids(MTNLG_530B + BLOOM_176B))
def test_printed_tflops_are_megatrons_hardware_count_over_the_printed_time(run):
    """MT-NLG (60.1, 50.2, 44.4 s; 126, 121, 113 TFLOP/s) and BLOOM (105.22 s, 149.02): Megatron's ``96 B s l h^2
    (1 + s/6h + V/16lh)`` over the GPUs and the time gives the TFLOP/s printed, within both numbers' last digit
    (MT-NLG's 121 barely: 120.42 computed from 50.2 s, 120.54 from 50.15 s)."""
    resolution = MTNLG_TIME_RESOLUTION_S if run in MTNLG_530B else 0.005
    computed = run.counted_flops() / (run.step_s * run.gpus) / 1e12
    assert abs(computed - run.tflops_per_gpu) <= run.tflops_resolution + computed * resolution / run.step_s
    three_passes = run.model_flops() / (run.step_s * run.gpus) / 1e12  # without recomputation: far off
    assert abs(three_passes - run.tflops_per_gpu) > 25


# --------------------------------------------------------------------------------------------------------
# DeepSeek-V3 and the new GPU presets


def test_deepseek_v3_costs_add_up():
    """Report, section 1 and Table 1: 180K GPU hours per trillion tokens x 14.8T = 2,664K; + 119K + 5K = 2,788K;
    x $2 = $5.576M; 180K hours on 2,048 GPUs is 3.66 days ("3.7 days"); NVLink's 160 GB/s is 3.2 x IB's 50."""
    d = DEEPSEEK_V3
    assert d.gpu_hours_per_trillion_tokens * d.pretraining_tokens / 1e12 == pytest.approx(d.pretraining_gpu_hours)
    assert d.pretraining_gpu_hours + d.context_extension_gpu_hours + d.post_training_gpu_hours == d.total_gpu_hours
    assert d.total_gpu_hours * d.dollars_per_gpu_hour == pytest.approx(d.total_dollars)
    assert round(d.gpu_hours_per_trillion_tokens / (d.gpus * 24), 1) == d.days_per_trillion_tokens
    assert d.nvlink_bytes_per_s / d.infiniband_bytes_per_s == pytest.approx(d.experts_per_node)
    assert d.tokens_per_gpu_second() * d.gpus * d.days_per_trillion_tokens * 86400 == pytest.approx(1e12, rel=0.02)


def test_deepseek_v3_layout_divides_its_gpus_and_experts():
    """16 stages x 128 data-parallel ranks = 2,048 GPUs; 64-way EP over 8 nodes of 8 folds over the 128; 256
    experts split 4 a GPU; the 8 routed experts of a token fit 4 nodes x 3.2; both batches split over dp."""
    d, shape = DEEPSEEK_V3, DEEPSEEK_V3.shape()
    assert d.pp * d.dp * d.tp == d.gpus and d.dp % d.ep == 0 and d.ep == d.ep_nodes * d.gpus_per_node
    assert shape.num_experts % d.ep == 0 and shape.top_k <= d.max_nodes_per_token * d.experts_per_node
    assert d.max_nodes_per_token < d.ep_nodes and d.global_batch % d.dp == 0 == d.ramp_start_batch % d.dp
    assert (int(num_parameters(shape) / 1e9), int(num_parameters(shape, active=True) / 1e9)) == (671, 37)
    assert d.seq_len == shape.seq_len and d.gpu in GPUS


def test_new_gpu_presets_name_their_links_and_sources():
    """H800: the H100's peak with NVLink cut to 200 GB/s each way, above DeepSeek's measured 160; the HBM2e H100
    priced as the SXM; BLOOM's nodes with 4 Omni-Path links of 100 Gb/s over 8 GPUs."""
    h100, h800 = GPUS["H100 80GB"], GPUS["H800 80GB"]
    assert h800.peak_bf16_flops == h100.peak_bf16_flops and h800.nvlink_bandwidth < h100.nvlink_bandwidth
    assert DEEPSEEK_V3.nvlink_bytes_per_s < h800.nvlink_bandwidth
    assert h800.network_bandwidth == DEEPSEEK_V3.infiniband_bytes_per_s
    assert GPUS["A100 80GB (Omni-Path)"].network_bandwidth == 4 * 100e9 / 8 / 8
    for name in ("H800 80GB", "H100 96GB HBM2e", "A100 80GB (Omni-Path)"):
        gpu = GPUS[name]
        assert gpu.name == name and gpu.nvlink_bandwidth > gpu.network_bandwidth > 0 and gpu.source


def test_torchtitan_a100_rows_are_the_tables():
    for run, (model, size, batch, checkpointing, wps, mfu) in zip(TORCHTITAN_A100, TORCHTITAN_A100_ROWS, strict=True):
        assert run.name.startswith(model) and run.parameters == size and run.micro_batch == batch
        assert run.global_batch == 64 * batch and run.recompute_mode == checkpointing and run.mfu == mfu / 100
        assert run.tokens_per_s_per_gpu == wps and run.recompute == (checkpointing == "full")
