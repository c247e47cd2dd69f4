"""labkit's memory model at 1,024 GPUs against PyTorch's own accounting on rank 0 of a fake world, term by term:
FSDP2 x tensor parallelism (dp=128 x tp=8) and DDP + ZeroRedundancyOptimizer (dp=1,024), every difference
computed from the shape and PyTorch's rules and what they leave held to 0 bytes."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as torch_dist

from labkit.costmodel.memory import memory_per_rank
from labkit.costmodel.shapes import TransformerShape, num_parameters
from labkit.fake_world import (
    Term,
    check_fsdp_tp,
    check_zero1,
    ddp_bucket_bytes,
    fake_world,
    fsdp_shard_elements,
    gpt_config,
    parameter_tensors,
    zero_redundancy_partition,
)
from labkit.models import TinyGPT
from labkit.parallel.flat_shards import FlatShards

# 42,046,464 parameters (41,061 a rank of 1,024); 96 positions leave FSDP2's shards of them padded at dp=128.
SHAPE = TransformerShape(2, 1024, 16, 96, 8192, bias=False, tied_embeddings=False)
# Biases (row-parallel ones replicated) and rows that do not divide: padding in most tensors.
UNEVEN = TransformerShape(2, 48, 4, 24, 100, bias=True, tied_embeddings=False)
DP, TP = 128, 8


@pytest.fixture(scope="module")
def fsdp():
    return check_fsdp_tp(SHAPE, DP, TP)


@pytest.fixture(scope="module")
def zero1():
    return check_zero1(SHAPE, DP * TP)


def terms(check, planner: bool = False) -> dict[str, Term]:
    return {term.name: term for term in (check.planner_terms if planner else check.terms)}


@pytest.mark.parametrize("shape", [SHAPE, UNEVEN], ids=["no-bias", "bias"])
def test_the_shape_is_the_model_pytorch_builds_tensor_by_tensor(shape):
    small = TransformerShape(shape.num_layers, 16, 4, shape.seq_len, 64, bias=shape.bias, tied_embeddings=False)
    built = [(name, tuple(p.shape)) for name, p in TinyGPT(gpt_config(small)).named_parameters()]
    assert built == [(name, size) for name, size, _ in parameter_tensors(small)]
    assert sum(math.prod(size) for _, size, _ in parameter_tensors(shape)) == num_parameters(shape)


def test_gpt_config_refuses_a_shape_tinygpt_cannot_build():
    with pytest.raises(ValueError, match="not one"):
        gpt_config(TransformerShape.preset("llama-2-7b"))
    with pytest.raises(ValueError, match="untied head"):
        gpt_config(dataclasses.replace(SHAPE, tied_embeddings=True))


def test_fake_world_poses_as_one_rank_and_always_destroys_its_group():
    with fake_world(1024, rank=5):
        assert (torch_dist.get_rank(), torch_dist.get_world_size()) == (5, 1024)
        with pytest.raises(RuntimeError, match="already initialised"):
            with fake_world(2):
                pass
    assert not torch_dist.is_initialized()
    with pytest.raises(KeyError), fake_world(8):
        raise KeyError("inside")
    assert not torch_dist.is_initialized()


def test_fsdp_tp_model_states_on_rank_0_of_1024_are_labkits_plus_whole_norms_padding_and_step_counters(fsdp):
    psi = num_parameters(SHAPE)
    held, share = fsdp_shard_elements(SHAPE, DP, TP)
    assert fsdp.layout.gpus == 1024 and psi % 1024 == 0
    assert fsdp.measured.parameters == fsdp.measured.gradients == 4 * held  # fp32 shards, fp32 gradients
    assert fsdp.measured.optimizer_states == 8 * held
    assert fsdp.measured.optimizer_steps == 4 * len(parameter_tensors(SHAPE))
    found = terms(fsdp)
    for name in ("parameters", "gradients", "optimizer states"):
        assert found[name].unexplained == 0, found[name]
    parts = found["parameters"].parts
    # 5 LayerNorms and the positions are whole on every TP rank: 7/8 of them over the even share
    assert parts["left whole by tensor parallelism"] == 4 * (5 * 1024 + 96 * 1024) * 7 / 1024
    # 96 position rows over 128 ranks: rank 0 holds a whole row, 1,024 values, for 0.75 of one
    assert parts["FSDP2's padding to ceil(rows / dp)"] == 4 * 1024 / 4


def test_pytorchs_trackers_agree_with_the_storages_counted(fsdp, zero1):
    tracked = fsdp.measured.tracker
    assert tracked["Sharded Param"] == fsdp.measured.parameters
    assert tracked["Sharded Grad"] == fsdp.measured.gradients
    assert tracked["OptState"] == fsdp.measured.optimizer_states + fsdp.measured.optimizer_steps
    assert zero1.measured.tracker["Parameter"] == zero1.measured.parameters
    assert zero1.measured.tracker["Optstate"] == zero1.measured.optimizer_states + zero1.measured.optimizer_steps
    # MemTracker files DDP's buckets, which the gradients are views into, as temporaries, not as gradients
    assert zero1.measured.tracker["Temp"] == zero1.measured.gradients and "Gradient" not in zero1.measured.tracker


def test_labkits_flat_shards_cut_each_tensor_as_fully_shard_does(fsdp):
    pieces = [[extent // TP if d == dim else extent for d, extent in enumerate(size)]
              for _, size, dim in parameter_tensors(SHAPE)]
    assert 4 * FlatShards(pieces, DP, 0).shard_numel == fsdp.measured.parameters


def test_the_layers_activations_are_activation_bytes_plus_the_layernorm_statistics(fsdp, zero1):
    for check, value_bytes in ((fsdp, 2), (zero1, 4)):
        term = terms(check)["activations (layers)"]
        assert term.unexplained == 0, term
        assert sum(term.parts.values()) == SHAPE.num_layers * 4 * SHAPE.seq_len * value_bytes


def test_the_planner_counts_20_bytes_a_parameter_where_fsdp2_holds_16(fsdp):
    even = num_parameters(SHAPE) / 1024
    found = terms(fsdp, planner=True)
    assert all(term.unexplained == 0 for term in found.values()), fsdp.table()
    planner = sum(found[name].labkit for name in ("parameters", "gradients", "optimizer states"))
    measured = sum(found[name].torch for name in ("parameters", "gradients", "optimizer states"))
    assert planner == 20 * even
    held, _ = fsdp_shard_elements(SHAPE, DP, TP)
    assert measured == 16 * held + fsdp.measured.optimizer_steps
    framework = [value for term in found.values() for name, value in term.parts.items()
                 if "master" in name or "fp32 gradients" in name]
    assert sum(framework) == -4 * even


def test_outside_the_layers_and_the_gathered_root_are_accounted_for(fsdp, zero1):
    for check in (fsdp, zero1):
        outside = terms(check, planner=True)["activations (outside)"]
        assert outside.unexplained == 0, check.table()
    gathered = terms(fsdp, planner=True)["gathered parameters"]
    assert gathered.labkit == 0 and gathered.unexplained == 0
    # the root's embedding and head (8192 / 8 rows each), 128 padded position rows and the final norm, in bf16
    assert gathered.torch == 2 * (2 * 1024 * 1024 + 128 * 1024 + 1024)


def test_zero1_holds_the_largest_tensors_adam_states_where_labkit_divides_them_over_1024(zero1):
    found = terms(zero1)
    psi = num_parameters(SHAPE)
    assert found["parameters"].torch == found["parameters"].labkit == 4 * psi and not found["parameters"].parts
    assert found["gradients"].torch == found["gradients"].labkit == 4 * psi and not found["gradients"].parts
    states = found["optimizer states"]
    assert states.unexplained == 0
    assert states.torch == 8 * 8192 * 1024 + 4  # the token embedding's exp_avg and exp_avg_sq, one step counter
    assert states.torch / states.labkit > 100
    assert all(term.unexplained == 0 for term in zero1.planner_terms), zero1.table()


def test_a_wrong_model_of_a_term_is_left_unexplained(fsdp, zero1):
    wrong = memory_per_rank(num_parameters(SHAPE), "fp32", "adam", zero_stage=3, dp_degree=DP)  # forgets tp
    right = terms(fsdp)["parameters"]
    assert dataclasses.replace(right, labkit=wrong["weights"]).unexplained != 0
    evenly = terms(zero1)["optimizer states"]
    assert dataclasses.replace(evenly, parts={}).unexplained == evenly.parts["whole tensors, largest first"] + 4


def test_an_uneven_model_with_biases_is_predicted_as_exactly():
    fsdp, zero1 = check_fsdp_tp(UNEVEN, dp=16, tp=2), check_zero1(UNEVEN, dp=16)
    for check in (fsdp, zero1):
        assert all(term.unexplained == 0 for term in check.terms + check.planner_terms), check.table()
    padding = terms(fsdp)["parameters"].parts["FSDP2's padding to ceil(rows / dp)"]
    assert padding > 0.1 * fsdp.measured.parameters


def test_zero_redundancy_partition_gives_whole_tensors_largest_first_to_the_least_loaded():
    assert zero_redundancy_partition([2, 3, 5, 3], 2) == [[5, 2], [3, 3]]
    assert zero_redundancy_partition([4, 9, 1], 5) == [[9], [4], [1], [], []]


def test_ddp_keeps_its_buckets_beside_the_gradients_unless_they_are_views_into_them():
    shape = TransformerShape(1, 64, 4, 16, 256, tied_embeddings=False)
    gradients = 4 * num_parameters(shape)
    assert ddp_bucket_bytes(shape, 1024) == (gradients, gradients)
    assert ddp_bucket_bytes(shape, 1024, gradient_as_bucket_view=True) == (gradients, 0)


def test_the_table_names_each_term_and_the_reasons(fsdp, zero1):
    table = fsdp.table()
    assert "rank 0 of 1024" in table and "FSDP2's padding" in table and "peak over the step" in table
    assert "whole tensors, largest first" in zero1.table()
    assert not torch_dist.is_initialized() and torch.get_default_dtype() == torch.float32
