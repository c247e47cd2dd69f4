"""FLOPs of a transformer step (labkit.costmodel.compute, lesson 11) against Narayanan et al. 2021's closed forms."""

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
from labkit.costmodel.memory import TransformerShape, num_parameters


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
