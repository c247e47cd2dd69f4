"""labkit.measure and labkit.recompute: measured model states equal the bytes-per-parameter model exactly (fp32 and mixed precision
with fp32 master weights), activations are measured through saved-tensor hooks, and checkpointing blocks
lowers them without changing a single gradient bit."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from labkit.costmodel.memory import bytes_per_parameter, predicted_model_state_bytes
from labkit.measure import ActivationMeter, model_state_bytes, storage_bytes
from labkit.models import GPTConfig, TinyGPT
from labkit.precision import DynamicLossScaler, MasterWeights
from labkit.recompute import checkpoint_blocks, checkpointed_blocks

CONFIG = GPTConfig.preset("100k")


def _batch(batch_size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (torch.randint(0, 32, (batch_size, 64), generator=generator),
            torch.randint(0, 32, (batch_size, 64), generator=generator))


def test_adam_costs_16_bytes_per_parameter_in_fp32_and_in_mixed_precision():
    assert bytes_per_parameter("fp32", "adam") == {"weights": 4, "gradients": 4, "optimizer_states": 8}
    assert bytes_per_parameter("mixed", "adam") == {"weights": 2, "gradients": 2, "optimizer_states": 12}
    assert sum(bytes_per_parameter("fp32", "sgd").values()) == 8
    assert sum(bytes_per_parameter("mixed", "momentum").values()) == 12
    assert predicted_model_state_bytes(10, "mixed")["optimizer_states"] == 120
    with pytest.raises(ValueError, match="precision"):
        bytes_per_parameter("fp8")
    with pytest.raises(ValueError, match="optimizer"):
        bytes_per_parameter("fp32", "lamb")


def test_storage_bytes_counts_a_tied_weight_and_views_once():
    model = TinyGPT(CONFIG)  # lm_head.weight is token_embedding.weight
    tensors = [model.lm_head.weight, model.token_embedding.weight, model.token_embedding.weight[:3].t()]
    assert storage_bytes(tensors) == model.token_embedding.weight.numel() * 4
    seen: set[int] = set()
    assert storage_bytes(tensors, seen) > 0 and storage_bytes(tensors, seen) == 0


def test_measured_model_states_of_tinygpt_with_adamw_equal_the_fp32_formula():
    model = TinyGPT(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(*_batch())[1].backward()
    optimizer.step()
    measured = model_state_bytes(model, optimizer)
    assert {key: measured[key] for key in ("weights", "gradients", "optimizer_states")} == \
        predicted_model_state_bytes(model.num_parameters(), "fp32", "adam")
    assert measured["optimizer_other"] == 4 * len(list(model.parameters()))  # one fp32 `step` per tensor


def test_measured_model_states_of_bf16_tinygpt_with_fp32_masters_equal_2_2_12():
    model = TinyGPT(CONFIG).to(torch.bfloat16)
    master = MasterWeights(model.parameters())
    optimizer = torch.optim.AdamW(master.parameters(), lr=1e-3)
    scaler = DynamicLossScaler()
    scaler.scale(model(*_batch())[1]).backward()
    assert master.step(optimizer, scaler)
    scaler.update()
    measured = model_state_bytes(model, optimizer)
    assert {key: measured[key] for key in ("weights", "gradients", "optimizer_states")} == \
        predicted_model_state_bytes(model.num_parameters(), "mixed", "adam")
    # During the step the fp32 gradients exist as well: 4 more bytes per parameter, counted as gradients.
    master.gradients_to_master()
    assert model_state_bytes(model, optimizer)["gradients"] == 6 * model.num_parameters()


def test_the_activation_meter_counts_saved_inputs_but_not_parameters():
    layer = nn.Linear(8, 4)
    x = torch.randn(16, 8, requires_grad=True)
    with ActivationMeter(exclude=layer.parameters()) as meter:
        out = torch.tanh(layer(x))  # linear saves x (and its weight); tanh saves its output
    assert meter.bytes == x.numel() * 4 + out.numel() * 4 and meter.count == 2
    out.sum().backward()  # the hooks hand the tensors back unchanged
    assert x.grad is not None


def test_bf16_autocast_saves_fewer_activation_bytes_than_fp32():
    measured = {}
    for dtype in (None, torch.bfloat16):
        model = TinyGPT(CONFIG)
        with ActivationMeter(exclude=model.parameters()) as meter, \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
            model(*_batch())
        measured[dtype] = meter.bytes
    assert measured[torch.bfloat16] < 0.8 * measured[None]


def test_checkpointing_more_blocks_saves_fewer_activations_and_gives_the_same_gradients():
    idx, targets = _batch()
    model = TinyGPT(CONFIG)
    reference_gradients, activation_bytes = None, []
    for count in range(CONFIG.n_layer + 1):
        model.zero_grad(set_to_none=True)
        checkpoint_blocks(model.blocks, count)
        assert checkpointed_blocks(model.blocks) == count
        with ActivationMeter(exclude=model.parameters()) as meter:
            loss = model(idx, targets)[1]
        loss.backward()
        activation_bytes.append(meter.bytes)
        gradients = [parameter.grad for parameter in model.parameters()]
        if reference_gradients is None:
            reference_gradients = gradients
        assert all(torch.equal(a, b) for a, b in zip(gradients, reference_gradients, strict=True)), count
    savings = [earlier - later for earlier, later in itertools.pairwise(activation_bytes)]
    assert all(saving > 0 for saving in savings) and len(set(savings)) == 1  # identical blocks: equal savings
    block_input = 2 * 64 * CONFIG.n_embd * 4
    assert activation_bytes[-1] > CONFIG.n_layer * block_input  # the checkpoints themselves are kept


def test_checkpoint_blocks_can_be_undone_and_rejects_a_bad_count():
    model = TinyGPT(CONFIG)
    names = list(model.state_dict())
    checkpoint_blocks(model.blocks, 2)
    assert list(model.state_dict()) == names
    checkpoint_blocks(model.blocks, 0)
    assert checkpointed_blocks(model.blocks) == 0
    with pytest.raises(ValueError, match="count"):
        checkpoint_blocks(model.blocks, CONFIG.n_layer + 1)
