"""labkit.costmodel.memory's analytical model: the ZeRO paper's Figure 1 exactly, 1/N_d scaling stage by stage, tensor
and pipeline degrees dividing model states; published parameter counts; Korthikanti et al.'s activation
formula; and TinyGPT's predicted activations equal to what the ActivationMeter measures, byte for byte."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from labkit.costmodel.memory import (
    activation_bytes,
    korthikanti_layer_activation_bytes,
    layer_activation_bytes,
    memory_per_rank,
    tinygpt_activation_bytes,
)
from labkit.costmodel.shapes import TransformerShape, num_parameters
from labkit.measure import ActivationMeter, measure_cuda_memory, measure_training_step
from labkit.models import GPTConfig, TinyGPT
from labkit.recompute import checkpoint_blocks

STATES = ("weights", "gradients", "optimizer_states")


def test_zero_paper_figure_1_is_reproduced_exactly():
    # 7.5B parameters, N_d = 64, mixed-precision Adam (K = 12), GB = 1e9 bytes.
    totals = [memory_per_rank(7.5e9, "mixed", "adam", zero_stage=stage, dp_degree=64)["total"]
              for stage in range(4)]
    assert totals == [120e9, 31.40625e9, 16.640625e9, 1.875e9]
    assert [round(total / 1e9, 1) for total in totals] == [120.0, 31.4, 16.6, 1.9]  # as the figure rounds
    stage_1 = memory_per_rank(7.5e9, zero_stage=1, dp_degree=64)
    assert stage_1 == {"weights": 15e9, "gradients": 15e9, "optimizer_states": 1.40625e9, "activations": 0.0,
                       "total": 31.40625e9}


@pytest.mark.parametrize("precision,optimizer", [("mixed", "adam"), ("fp32", "adam"), ("fp32", "momentum")])
def test_each_zero_stage_divides_exactly_its_partitioned_states_by_the_data_parallel_degree(precision,
                                                                                           optimizer):
    partitioned = {0: (), 1: ("optimizer_states",), 2: ("optimizer_states", "gradients"), 3: STATES}
    for stage, names in partitioned.items():
        single = memory_per_rank(1e9, precision, optimizer, zero_stage=stage, dp_degree=1)
        for dp_degree in (2, 8, 64):
            sharded = memory_per_rank(1e9, precision, optimizer, zero_stage=stage, dp_degree=dp_degree)
            for name in STATES:
                expected = single[name] / dp_degree if name in names else single[name]
                assert sharded[name] == pytest.approx(expected, rel=1e-12), (stage, dp_degree, name)
    assert memory_per_rank(1e9, precision, optimizer, zero_stage=0, dp_degree=64) == \
        memory_per_rank(1e9, precision, optimizer)  # plain data parallelism replicates everything


def test_tensor_and_pipeline_degrees_divide_model_states_and_leave_activations_as_given():
    whole = memory_per_rank(7e9, zero_stage=1, dp_degree=4, activation_bytes=3e9)
    split = memory_per_rank(7e9, zero_stage=1, dp_degree=4, tp_degree=2, pp_degree=4, activation_bytes=3e9)
    for name in STATES:
        assert split[name] == pytest.approx(whole[name] / 8, rel=1e-12)
    assert split["activations"] == whole["activations"] == 3e9
    assert split["total"] == pytest.approx(sum(whole[name] for name in STATES) / 8 + 3e9, rel=1e-12)


def test_zero_2_and_fsdp_hold_whole_gradients_while_a_step_accumulates_them():
    """Lesson 10's defect: under gradient accumulation (a pipeline's m > 1) ZeRO-2 and FSDP partition gradients
    only when the step's one reduce-scatter runs (labkit.parallel.parallelize, ZeroDataParallel and FSDP with
    sync off; Megatron's distributed optimizer), so each rank holds them whole through the schedule: ZeRO-2
    saves nothing on gradients over ZeRO-1, FSDP only its weights and optimizer states."""
    one, two, three = (memory_per_rank(7.5e9, zero_stage=stage, dp_degree=64, accumulating=True)
                       for stage in (1, 2, 3))
    assert one == two and two["gradients"] == 15e9 and three["gradients"] == 15e9
    assert three["weights"] == 15e9 / 64 and three["total"] == 15e9 + (15e9 + 90e9) / 64
    assert memory_per_rank(7.5e9, zero_stage=2, dp_degree=64)["gradients"] == 15e9 / 64  # one micro-batch
    whole = memory_per_rank(7.5e9, zero_stage=1, dp_degree=64, accumulating=True, gradient_bytes=4)
    assert whole["gradients"] == 30e9  # fp32 accumulation (Megatron's main_grad, Llama 3)


def test_the_peak_counts_lesson_04s_fp32_gradient_copy():
    """Lesson 04 measures 20 bytes per parameter at a mixed-precision step's peak: the 16 between steps and the
    optimizer's fp32 copy of the gradients, partitioned with the optimizer from ZeRO-1 on; gradients kept in fp32
    need no copy (18 bytes)."""
    assert memory_per_rank(1e9, peak=True)["total"] == 20e9
    assert memory_per_rank(1e9, peak=True, gradient_bytes=4)["total"] == 18e9
    assert memory_per_rank(1e9, "fp32", peak=True)["total"] == 16e9
    sharded = memory_per_rank(1e9, zero_stage=1, dp_degree=4, peak=True)
    assert sharded["gradients"] == 2e9 + 4e9 / 4 and sharded["total"] == 2e9 + 3e9 + 12e9 / 4


def test_the_planner_counts_the_fullest_gpu_and_keeps_a_margin():
    """rank_memory.layout_memory: the first pipeline rank holds the embedding and p micro-batches in flight, the last
    the output layer and one micro-batch's logits (bf16 and fp32); the fuller one is reported.  plan() keeps
    10 % of the device free (Cluster.memory_margin)."""
    from labkit.costmodel.compute import GPUS
    from labkit.costmodel.planner import Cluster, plan
    from labkit.costmodel.rank_memory import held_microbatches, layout_memory
    from labkit.costmodel.stages import rank_parameters
    from labkit.costmodel.step import Layout

    shape = TransformerShape.preset("llama-2-70b")
    layout = Layout(dp=2, tp=8, pp=4, zero=2)
    memory = layout_memory(shape, layout, 64)
    first = rank_parameters(shape, layout)[0] / 8
    options = {"tp_degree": 8, "sequence_parallel": True, "flash_attention": True}
    activations = 4 * activation_bytes(shape, 1, layers=20, **options)
    assert memory["activations"] == pytest.approx(activations, rel=1e-12)
    assert memory["weights"] == 2 * first and memory["gradients"] == (2 + 4 / 2) * first  # whole: m = 32
    assert [held_microbatches(layout, 32, rank) for rank in range(4)] == [4, 3, 2, 1]
    interleaved = dataclasses.replace(layout, schedule="interleaved", virtual_stages=5)
    assert held_microbatches(interleaved, 32, 0) == (4 * 4 + 2 * 3 + 1) / 5  # Megatron's warm-up
    cluster = Cluster(GPUS["H100 80GB"], 8, 0.5)
    assert cluster.usable_bytes == 72e9
    result = plan(TransformerShape.preset("gpt2-xl"), cluster, 64, top=3)
    assert all(candidate.memory["total"] <= 72e9 for candidate in result.candidates)
    assert result.usable_bytes == 72e9


@pytest.mark.parametrize("arguments,named", [
    ({"num_parameters": -1}, "num_parameters"), ({"num_parameters": float("nan")}, "num_parameters"),
    ({"zero_stage": 4}, "zero_stage"), ({"zero_stage": True}, "zero_stage"), ({"dp_degree": 0}, "dp_degree"),
    ({"tp_degree": 1.5}, "tp_degree"), ({"pp_degree": -2}, "pp_degree"),
    ({"activation_bytes": -1.0}, "activation_bytes"), ({"precision": "fp8"}, "precision"),
    ({"optimizer": "lamb"}, "optimizer"),
])
def test_memory_per_rank_rejects_bad_input_naming_the_value(arguments, named):
    with pytest.raises(ValueError, match=named):
        memory_per_rank(**({"num_parameters": 1e9} | arguments))


@pytest.mark.parametrize("name,published,tolerance", [
    ("gpt2", 124_439_808, 0.0), ("gpt2-xl", 1_557_611_200, 0.0), ("llama-2-7b", 6_738_415_616, 0.0),
    ("llama-2-70b", 68_976_648_192, 0.0),  # the released checkpoints' exact counts
    ("gpt3-175b", 175.0e9, 0.005),  # the paper's rounded "175.0B": we count 174.60e9, -0.23 %
])
def test_preset_parameter_counts_match_the_published_counts(name, published, tolerance):
    assert num_parameters(TransformerShape.preset(name)) == pytest.approx(published, rel=tolerance, abs=0)


def test_llama_specifics_matter_to_the_parameter_count():
    llama = TransformerShape.preset("llama-2-70b")
    assert num_parameters(llama) < num_parameters(dataclasses.replace(llama, num_kv_heads=64))  # GQA saves
    assert num_parameters(dataclasses.replace(llama, mlp="gelu")) < num_parameters(llama)  # SwiGLU: three


@pytest.mark.parametrize("config", [GPTConfig.preset("100k"),
                                    GPTConfig.preset("1m", bias=False, tie_weights=False)])
def test_num_parameters_of_a_tinygpt_shape_equals_the_model_count(config):
    assert num_parameters(TransformerShape.from_gpt_config(config)) == TinyGPT(config).num_parameters()


@pytest.mark.parametrize("name", ["gpt2", "gpt2-xl", "gpt3-175b"])
@pytest.mark.parametrize("tp_degree,sequence_parallel", [(1, False), (4, False), (4, True)])
def test_gpt_style_layer_activations_equal_korthikanti_formula(name, tp_degree, sequence_parallel):
    shape = TransformerShape.preset(name)
    if shape.num_heads % tp_degree:
        tp_degree = 1  # gpt2-xl's 25 heads do not split four ways
    s, h, a = shape.seq_len, shape.hidden_size, shape.num_heads
    predicted = layer_activation_bytes(shape, 2, tp_degree=tp_degree, sequence_parallel=sequence_parallel)
    paper = korthikanti_layer_activation_bytes(s, 2, h, a, tp_degree, sequence_parallel)
    assert predicted == pytest.approx(paper)
    if tp_degree == 1:
        assert predicted == pytest.approx(s * 2 * h * (34 + 5 * a * s / h))
        fp32 = layer_activation_bytes(shape, 2, precision="fp32")
        assert fp32 == pytest.approx(s * 2 * h * (66 + 9 * a * s / h))
        assert layer_activation_bytes(shape, 2, dropout=False, flash_attention=True) == \
            pytest.approx(s * 2 * h * 32 + 4 * a * s * 2)  # no s^2 term: 16 values per s b h, log-sum-exp


def test_swiglu_and_grouped_query_attention_move_the_34_coefficient_as_documented():
    llama = TransformerShape.preset("llama-2-70b")  # 64 heads, 8 key-value heads, ffn 28672 = 3.5 h
    s, h, f = llama.seq_len, llama.hidden_size, llama.ffn_hidden_size
    predicted = layer_activation_bytes(llama, 1, dropout=False, flash_attention=True)
    # 16-bit values: norms' and projections' inputs 4, Q and output-projection input 2, K and V 1/8 each,
    # SwiGLU 4 f / h, and the flash log-sum-exp.
    assert predicted == 2 * s * h * (4 + 2 + 2 * 8 / 64) + 2 * 4 * s * f + 4 * 64 * s
    assert predicted / (2 * s * h) > 16  # more than a 4h GELU MLP's 16 values per s b h


def test_full_checkpointing_keeps_one_input_per_layer_plus_one_layer():
    shape = TransformerShape.preset("gpt3-175b")
    s, h, layers = shape.seq_len, shape.hidden_size, shape.num_layers
    per_layer = layer_activation_bytes(shape, 1)
    assert activation_bytes(shape, 1) == pytest.approx(layers * per_layer)
    assert activation_bytes(shape, 1, checkpointing=True) == pytest.approx(layers * 2 * s * h + per_layer)
    assert activation_bytes(shape, 1, checkpointing=True) < activation_bytes(shape, 1) / 30
    split = activation_bytes(shape, 1, checkpointing=True, tp_degree=8, sequence_parallel=True)
    assert split == pytest.approx(activation_bytes(shape, 1, checkpointing=True) / 8)
    assert activation_bytes(shape, 1, layers=12) == pytest.approx(12 * per_layer)  # e.g. one of 8 stages


# (preset, batch, seq_len, dropout, training, checkpointed blocks, with targets)
TINYGPT_CASES = [
    ("100k", 2, 64, 0.0, True, 0, True),  # CPU flash attention: log-sum-exp only
    ("100k", 2, 64, 0.1, True, 0, True),  # dropout: math path, attention matrix and float masks stored
    ("100k", 2, 64, 0.1, False, 0, True),  # eval mode: no dropout, flash again
    ("100k", 3, 40, 0.1, True, 3, False),  # three of four blocks checkpointed, no loss
    ("1m", 3, 128, 0.0, True, 2, True),
]


@pytest.mark.parametrize("name,batch_size,seq_len,dropout,training,checkpointed,with_loss", TINYGPT_CASES)
def test_tinygpt_activation_prediction_equals_the_activation_meter(name, batch_size, seq_len, dropout,
                                                                   training, checkpointed, with_loss):
    config = GPTConfig.preset(name, dropout=dropout)
    model = TinyGPT(config).train(training)
    checkpoint_blocks(model.blocks, checkpointed)
    generator = torch.Generator().manual_seed(0)
    idx, targets = (torch.randint(0, 32, (batch_size, seq_len), generator=generator) for _ in range(2))
    with ActivationMeter(exclude=model.parameters()) as meter:
        model(idx, targets if with_loss else None)
    # Tolerance: none.  The model itemises every tensor autograd saves.
    predicted = tinygpt_activation_bytes(config, batch_size, seq_len, checkpointed, training, with_loss)
    assert meter.bytes == predicted


def test_tinygpt_prediction_follows_the_attention_path_and_checkpointing():
    config = GPTConfig.preset("100k")
    flash = tinygpt_activation_bytes(config, 2)
    math_path = tinygpt_activation_bytes(dataclasses.replace(config, dropout=0.1), 2)
    s, b, a, h = 64, 2, 4, 48
    # Dropout adds the s^2 matrices (12 a s^2 b, less the flash log-sum-exp) and 4-byte masks (2 a block, 1).
    assert math_path - flash == 4 * (12 * a * s * s * b - 4 * a * s * b + 2 * 4 * s * b * h) + 4 * s * b * h
    savings = [tinygpt_activation_bytes(config, 2, checkpointed=count) for count in range(config.n_layer + 1)]
    assert all(later < earlier for earlier, later in itertools.pairwise(savings))


def test_measured_training_step_sits_beside_memory_per_rank():
    config = GPTConfig.preset("100k")
    model = TinyGPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    idx, targets = (torch.randint(0, 32, (2, 64), generator=generator) for _ in range(2))
    measured = measure_training_step(model, optimizer, lambda: model(idx, targets)[1])
    predicted = memory_per_rank(model.num_parameters(), "fp32", "adam",
                                activation_bytes=tinygpt_activation_bytes(config, 2))
    assert {name: measured[name] for name in (*STATES, "activations")} == \
        {name: predicted[name] for name in (*STATES, "activations")}
    assert measured["total"] == predicted["total"] + measured["optimizer_other"]  # Adam's step counters


@pytest.mark.parametrize("call,named", [
    (lambda: TransformerShape.preset("gpt-4"), "gpt-4"),
    (lambda: TransformerShape(12, 768, 5, 1024, 50257), "num_heads=5"),
    (lambda: TransformerShape(12, 768, 12, 1024, 50257, mlp="relu"), "mlp"),
    (lambda: layer_activation_bytes(TransformerShape.preset("gpt2"), 0), "micro_batch"),
    (lambda: layer_activation_bytes(TransformerShape.preset("llama-2-70b"), 1, tp_degree=16), "tp_degree=16"),
    (lambda: activation_bytes(TransformerShape.preset("gpt2"), 1, precision="fp16"), "precision"),
    (lambda: tinygpt_activation_bytes(GPTConfig.preset("100k"), 1, seq_len=65), "seq_len=65"),
    (lambda: tinygpt_activation_bytes(GPTConfig.preset("100k"), 1, checkpointed=5), "checkpointed"),
])
def test_activation_models_reject_bad_input_naming_the_value(call, named):
    with pytest.raises(ValueError, match=named):
        call()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_measure_cuda_memory_returns_none_without_cuda_and_does_not_call():
    calls = []
    assert measure_cuda_memory(lambda: calls.append(1)) is None and calls == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_measure_cuda_memory_sees_a_tensor_that_fn_returns():
    assert measure_cuda_memory(lambda: None, device="cpu") is None
    counts = measure_cuda_memory(lambda: torch.empty(1 << 20, dtype=torch.float32, device="cuda"))
    assert counts is not None and counts["retained"] >= 4 << 20 and counts["peak"] >= counts["after"]
