"""Tensor and sequence parallelism (``labkit.parallel.tensor``) against the dense single-process model.

One launch per TP degree (1, 2, 4) runs every case on every rank: with and without sequence parallelism, with
and without dropout, a tied and an untied head, a vocabulary that 4 does not divide (30, padded to 32).  Each
rank builds the dense twin from the same seed and compares, within 1e-5 (fp32): the loss, every gradient
(gathered), the weights after 3 AdamW steps, global-norm clipping, ``m`` forwards then ``m`` backwards with sync
off and one ``reduce_gradients()``; the communication log against ``labkit.costmodel.tensor_parallel`` call by
call; the memory per rank against the models.  With dropout the dense twin draws the masks the ranks drew: the
same default generator for replicated activations, and for split ones (attention's heads; with sequence
parallelism everything between the halves) each rank's own generator on that rank's slice (:func:`_replay`).
"""

from __future__ import annotations

import types
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit.launch import RankFailed, launch
from labkit.models import GPTConfig, TinyGPT
from labkit.parallel.tensor.ops import ParallelRNG

ATOL, SEED, BATCH, SEQ, STEPS, MICRO = 1e-5, 123, 2, 16, 3, 2
# Adam's first steps move every weight by about lr whatever the size of its gradient, so a gradient that is zero
# but for rounding (the key biases': softmax ignores a shift shared by all keys) moves by up to lr * |g| / eps on
# rounding alone; eps = 1e-6 keeps that under 1e-6 in fp32.
ADAMW = {"lr": 1e-3, "eps": 1e-6}
CONFIG = GPTConfig.preset("100k", vocab_size=30)  # 4 heads, 48 wide, tied; 30 = 4 * 8 - 2: padded over 4 ranks


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(700 + step)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1].clone(), tokens[:, 1:].clone()


class _ChunkDropout(nn.Dropout):
    """Dropout of a sequence-parallel activation, replayed whole: chunk ``r`` of the sequence with rank ``r``'s
    generator."""

    def __init__(self, p: float, rngs: list[ParallelRNG]):
        super().__init__(p)
        self.rngs = rngs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = []
        for rng, chunk in zip(self.rngs, x.chunk(len(self.rngs), dim=1), strict=True):
            with rng.fork():
                out.append(F.dropout(chunk.contiguous(), self.p, self.training))
        return torch.cat(out, dim=1)


def _replay_attention(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Dense attention whose head group ``r`` draws its dropout from rank ``r``'s generator, as rank ``r`` does."""
    batch, time, _ = x.shape
    q, k, v = (p(x).view(batch, time, -1, self.head_dim).transpose(1, 2) for p in (self.query, self.key, self.value))
    groups = []
    for rank, rng in enumerate(self.rngs):
        heads = slice(rank * q.shape[1] // len(self.rngs), (rank + 1) * q.shape[1] // len(self.rngs))
        with rng.fork():
            groups.append(F.scaled_dot_product_attention(q[:, heads], k[:, heads], v[:, heads], is_causal=True,
                                                         dropout_p=self.dropout if self.training else 0.0))
    attended = torch.cat(groups, dim=1).transpose(1, 2).reshape(batch, time, -1)
    return self.resid_dropout(self.proj(attended))


def _replay(config: GPTConfig, tp: int, sequence_parallel: bool) -> TinyGPT:
    """The dense twin of a TP model with dropout, drawing every mask the TP ranks draw (module docstring)."""
    model = TinyGPT(config, seed=1)
    rngs = [ParallelRNG(SEED, rank, torch.device("cpu")) for rank in range(tp)]
    for block in model.blocks:
        block.attn.rngs = rngs
        block.attn.forward = types.MethodType(_replay_attention, block.attn)
        if sequence_parallel:
            block.attn.resid_dropout = _ChunkDropout(config.dropout, rngs)
            block.mlp.dropout = _ChunkDropout(config.dropout, rngs)
    if sequence_parallel:
        model.dropout = _ChunkDropout(config.dropout, rngs)
    return model


def _difference(got: dict, want: dict) -> float:
    return max((got[name] - want[name]).abs().max().item() for name in want)


def _parity(config: GPTConfig, sequence_parallel: bool) -> dict[str, float]:
    """Loss, gradients, clipping and 3 AdamW steps of the TP model against its dense twin."""
    from labkit.parallel.tensor import parallelize_tensor

    tp = dist.get_world_size()
    dense = _replay(config, tp, sequence_parallel)
    model = parallelize_tensor(TinyGPT(config, seed=1), None, sequence_parallel=sequence_parallel, seed=SEED)
    result = {"start": _difference(model.full_state_dict(), dense.state_dict())}
    dense_optimizer = torch.optim.AdamW(dense.parameters(), **ADAMW)
    optimizer = model.make_optimizer(torch.optim.AdamW, **ADAMW)
    for step in range(STEPS):
        idx, targets = _batch(step)
        torch.manual_seed(step)
        dense_loss = dense(idx, targets)[1]
        dense_loss.backward()
        torch.manual_seed(step)
        loss = model(idx, targets)[1]
        loss.backward()
        result[f"loss {step}"] = abs(loss.item() - dense_loss.item())
        want = {name: p.grad for name, p in dense.named_parameters()}
        result[f"gradients {step}"] = _difference(model.full_gradients(), want)
        if step == 1:  # clipping: the norm over every rank's shards, and the clipped gradients
            dense_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.05)
            result["clip norm"] = abs(model.clip_grad_norm_(0.05).item() - dense_norm.item())
            result["clipped gradients"] = _difference(model.full_gradients(),
                                                      {n: p.grad for n, p in dense.named_parameters()})
        dense_optimizer.step()
        optimizer.step()
        dense_optimizer.zero_grad()
        optimizer.zero_grad()
    result["weights"] = _difference(model.full_state_dict(), dense.state_dict())
    return result


def _accumulation(sequence_parallel: bool) -> dict[str, float]:
    """``MICRO`` forwards, then ``MICRO`` backwards with sync off, then one ``reduce_gradients()``: the dense
    gradient of the summed losses, and the communication of the whole step, call by call."""
    from labkit.parallel.tensor import parallelize_tensor

    dense = TinyGPT(CONFIG, seed=1)
    model = parallelize_tensor(TinyGPT(CONFIG, seed=1), None, sequence_parallel=sequence_parallel)
    batches = [_batch(10 + micro) for micro in range(MICRO)]
    for idx, targets in batches:
        dense(idx, targets)[1].backward()
    with model.no_sync():
        losses = [model(idx, targets)[1] for idx, targets in batches]
        for loss in losses:
            loss.backward()
    model.reduce_gradients()
    difference = _difference(model.full_gradients(), {n: p.grad for n, p in dense.named_parameters()})
    # Two more backward passes with sync on and no zero_grad between: each adds its whole gradient once.
    for idx, targets in batches[:2]:
        dense(idx, targets)[1].backward()
        model(idx, targets)[1].backward()
    difference = max(difference, _difference(model.full_gradients(),
                                             {n: p.grad for n, p in dense.named_parameters()}))
    dense.zero_grad()
    model.zero_grad()
    with model.no_sync():
        losses = [model(idx, targets)[1] for idx, targets in batches]
        for loss in losses:
            loss.backward()
    model.reduce_gradients()
    return {"gradients": difference, "log": model.communication_log(), "predicted": model.predicted_collectives(),
            "per step": model.communication_per_step(), "predicted per step": model.predicted_communication()}


def _memory(sequence_parallel: bool, dropout: float) -> dict[str, int]:
    from labkit.costmodel.memory import tinygpt_activation_bytes
    from labkit.measure import ActivationMeter
    from labkit.parallel.tensor import parallelize_tensor

    torch.manual_seed(0)
    config = GPTConfig.preset("100k", vocab_size=30, dropout=dropout)
    dense = TinyGPT(config, seed=1)
    model = parallelize_tensor(TinyGPT(config, seed=1), None, sequence_parallel=sequence_parallel)
    idx, targets = _batch(0)
    with ActivationMeter(exclude=model.parameters()) as meter:
        model(idx, targets)
    tp = dist.get_world_size()
    split = model.split_parameters()
    dense_numel = {name: p.numel() for name, p in dense.named_parameters()}
    padded = {"token_embedding.weight": -(-config.vocab_size // tp) * tp * config.n_embd}
    expected_weights = 4 * sum(padded.get(name, numel) // tp if name in split else numel
                               for name, numel in dense_numel.items())
    return {"activations": meter.bytes, "predicted activations": tinygpt_activation_bytes(
                config, BATCH, SEQ, tp_degree=tp, sequence_parallel=sequence_parallel),
            "weights": model.memory_breakdown()["weights"], "predicted weights": expected_weights}


def _dropout_masks() -> dict[str, bool]:
    """Replicated activations drop the same elements on every rank; split ones draw from different generators."""
    from labkit.parallel.tensor import parallelize_tensor
    from labkit.parallel.tensor.ops import RegionDropout

    torch.manual_seed(5)
    config = GPTConfig.preset("100k", vocab_size=30, dropout=0.5)
    model = parallelize_tensor(TinyGPT(config, seed=1), None)
    ones = torch.ones(BATCH, SEQ, config.n_embd)
    replicated = model.module.dropout(ones)  # the embedding's dropout: every rank holds the activation whole
    split = RegionDropout(0.5, model.rng)(ones)  # a split region's dropout: this rank's generator
    everyone = [torch.empty_like(replicated) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, replicated)
    splits = [torch.empty_like(split) for _ in range(dist.get_world_size())]
    dist.all_gather(splits, split)
    return {"replicated equal": all(torch.equal(mask, everyone[0]) for mask in everyone),
            "split differ": all(not torch.equal(splits[0], mask) for mask in splits[1:])}


def _all_cases() -> dict:
    torch.manual_seed(0)  # the same default generator on every rank (dropout of replicated activations)
    untied = GPTConfig.preset("100k", vocab_size=30, tie_weights=False)
    results = {}
    for sequence_parallel in (False, True):
        for dropout in (0.0, 0.1):
            config = GPTConfig.preset("100k", vocab_size=30, dropout=dropout)
            results[("parity", sequence_parallel, dropout)] = _parity(config, sequence_parallel)
            results[("memory", sequence_parallel, dropout)] = _memory(sequence_parallel, dropout)
        results[("untied", sequence_parallel)] = _parity(untied, sequence_parallel)
        results[("accumulation", sequence_parallel)] = _accumulation(sequence_parallel)
    if dist.get_world_size() > 1:
        results["dropout"] = _dropout_masks()
    return results


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda tp: f"tp{tp}")
def results(request) -> tuple[int, list[dict]]:
    return request.param, launch(_all_cases, nprocs=request.param, timeout=180, rank_output="none")


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_loss_gradients_and_adamw_weights_equal_the_dense_model(results, sequence_parallel, dropout):
    tp, per_rank = results
    for rank, result in enumerate(per_rank):
        differences = result[("parity", sequence_parallel, dropout)]
        worst = {key: value for key, value in differences.items() if value > ATOL}
        assert not worst, f"TP={tp} rank {rank}: differs from the dense model by {worst}"
        if sequence_parallel:  # an untied head (its own vocabulary-split weight) too
            untied = {key: value for key, value in result[("untied", True)].items() if value > ATOL}
            assert not untied, f"TP={tp} rank {rank}, untied head: {untied}"


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_micro_batches_with_sync_off_then_one_reduction(results, sequence_parallel):
    tp, per_rank = results
    for rank, result in enumerate(per_rank):
        assert result[("accumulation", sequence_parallel)]["gradients"] < ATOL, f"TP={tp} rank {rank}"


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_communication_measured_equals_the_model_call_by_call(results, sequence_parallel):
    tp, per_rank = results
    accumulation = per_rank[0][("accumulation", sequence_parallel)]
    log, predicted = accumulation["log"], accumulation["predicted"]
    assert Counter(log) == Counter(predicted)
    assert accumulation["per step"] == accumulation["predicted per step"]
    if tp == 1:
        assert log == []
        return
    activation = BATCH * SEQ * CONFIG.n_embd * 4
    for index in range(CONFIG.n_layer):  # per layer and micro-batch: the textbook's count
        layer = Counter((c.phase, c.kind) for c in log if c.where.startswith(f"blocks.{index}."))
        assert all(c.nbytes == activation for c in log if c.where.startswith(f"blocks.{index}."))
        if sequence_parallel:
            assert layer == {("forward", "all_gather"): 2 * MICRO, ("forward", "reduce_scatter"): 2 * MICRO,
                             ("backward", "reduce_scatter"): 2 * MICRO, ("backward", "all_gather"): 4 * MICRO}
        else:
            assert layer == {("forward", "all_reduce"): 2 * MICRO, ("backward", "all_reduce"): 2 * MICRO}
    loss = [c for c in log if c.where == "loss"]
    assert len(loss) == 3 * MICRO and all(c.kind == "all_reduce" and c.phase == "forward" for c in loss)
    assert all(c.nbytes == BATCH * SEQ * 4 for c in loss)
    gradients = [c for c in log if c.where == "gradients"]
    assert len(gradients) == (1 if sequence_parallel else 0)  # once per step, after the micro-batches


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_memory_per_rank_equals_the_models(results, sequence_parallel, dropout):
    tp, per_rank = results
    for rank, result in enumerate(per_rank):
        memory = result[("memory", sequence_parallel, dropout)]
        assert memory["weights"] == memory["predicted weights"], f"TP={tp} rank {rank}"
        assert memory["activations"] == memory["predicted activations"], f"TP={tp} rank {rank}"


def test_sequence_parallelism_divides_the_activations(results):
    tp, per_rank = results
    without, with_sp = (per_rank[0][("memory", sp, 0.0)]["activations"] for sp in (False, True))
    assert with_sp <= without if tp == 1 else with_sp < without


def test_dropout_masks_replicated_alike_and_split_apart(results):
    tp, per_rank = results
    if tp == 1:
        pytest.skip("one rank: nothing to compare")
    for result in per_rank:
        assert result["dropout"] == {"replicated equal": True, "split differ": True}


# --------------------------------------------------------------------------------------------------------
# Bad input, before any collective


def _build(config: GPTConfig, sequence_parallel: bool = False, seq: int = SEQ, seed_by_rank: bool = False):
    from labkit.parallel.tensor import parallelize_tensor

    torch.manual_seed(dist.get_rank() if seed_by_rank else 0)
    model = parallelize_tensor(TinyGPT(config, seed=1), None, sequence_parallel=sequence_parallel)
    idx = torch.zeros(1, seq, dtype=torch.long)
    model(idx, idx)


@pytest.mark.parametrize("config, kwargs, message", [
    (GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=12), {}, "n_head=2 and n_embd=12"),
    (GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=3, n_embd=12), {"sequence_parallel": True,
                                                                              "seq": 10},
     "sequence length 10 must be divisible by 3"),
    (GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=3, n_embd=12, dropout=0.1), {"seed_by_rank": True},
     "different random state"),
], ids=["heads", "sequence", "dropout-seed"])
def test_bad_sizes_and_seeds_are_value_errors_naming_the_numbers(config, kwargs, message):
    with pytest.raises(RankFailed, match="ValueError") as failure:
        launch(_build, config, nprocs=3, timeout=60, rank_output="none", **kwargs)
    assert message in str(failure.value)


def _padded_vocabulary(divisible_by: int, tie_weights: bool) -> tuple:
    from labkit.parallel.tensor import parallelize_tensor

    torch.set_num_threads(1)
    config = GPTConfig.preset("100k", vocab_size=30, tie_weights=tie_weights)
    x, y = _batch(0)
    dense = TinyGPT(config, seed=1)
    dense_loss = dense(x, y)[1]
    dense_loss.backward()
    model = parallelize_tensor(TinyGPT(config, seed=1), None, vocab_divisible_by=divisible_by)
    logits, loss = model(x, y)
    loss.backward()
    table = model.module.token_embedding.weight
    real = max(0, min(table.shape[0], config.vocab_size - model.module.token_embedding.vocab_start))
    gradients = model.full_gradients()
    return (model.padded_vocab_size, logits.shape[-1], abs(loss.item() - dense_loss.item()),
            table[real:].abs().sum().item(), table.grad[real:].abs().sum().item(),
            max((gradients[name] - p.grad).abs().max().item() for name, p in dense.named_parameters()),
            {name: tuple(t.shape) for name, t in model.full_state_dict().items()} ==
            {name: tuple(t.shape) for name, t in dense.state_dict().items()})


@pytest.mark.parametrize("tie_weights", [True, False], ids=["tied", "untied"])
def test_megatrons_vocabulary_padding_keeps_the_dense_loss_and_gradients(tie_weights):
    # 30 over 2 ranks: labkit pads nothing (a multiple of 2); a multiple of 8 * 2 = 16 pads to 32, 16 rows a rank
    for padded, rows, loss_gap, padding, padding_gradient, gradient_gap, same_shapes in launch(
            _padded_vocabulary, 8, tie_weights, nprocs=2, timeout=60):
        assert (padded, rows) == (32, 16)
        assert loss_gap < ATOL and gradient_gap < ATOL and same_shapes
        assert padding == 0 and padding_gradient == 0  # zero rows that no gradient reaches
    assert {result[0] for result in launch(_padded_vocabulary, 1, tie_weights, nprocs=2, timeout=60)} == {30}


def test_grouped_query_attention_needs_t_to_divide_the_key_value_heads():
    from labkit.parallel.tensor.transformer import check_tensor_parallel_sizes

    check_tensor_parallel_sizes(8192, 64, 8, n_kv_head=8)  # Llama-2-70B at t = 8: whole key/value heads
    with pytest.raises(ValueError, match="8 key/value heads must be divisible by 16"):
        check_tensor_parallel_sizes(8192, 64, 16, n_kv_head=8)
    with pytest.raises(ValueError, match="n_head=4 and n_embd=144 must both be divisible by 3"):
        check_tensor_parallel_sizes(144, 4, 3)


def test_only_tinygpt_is_accepted():
    with pytest.raises(RankFailed, match="TypeError.*TinyGPT"):
        launch(_wrap_linear, nprocs=1, timeout=30, rank_output="none")


def _wrap_linear():
    from labkit.parallel.tensor import parallelize_tensor

    parallelize_tensor(nn.Linear(4, 4))


# --------------------------------------------------------------------------------------------------------
# The communication model alone


def test_the_model_counts_the_textbook_collectives():
    from labkit.costmodel import tensor_parallel as model
    from labkit.costmodel.collectives import LinkModel

    tensor_parallel_collectives, total_bytes = model.tensor_parallel_collectives, model.total_bytes
    config = GPTConfig.preset("1m")
    assert tensor_parallel_collectives(config, 2, 64, 1) == []
    activation = 2 * 64 * config.n_embd * 4
    plain = total_bytes(tensor_parallel_collectives(config, 2, 64, 4))
    # 4 per layer, 1 after the embedding, 1 before the head; the loss's 3 vectors of b s values
    assert plain == {"all_reduce": (4 * config.n_layer + 2) * activation + 3 * 2 * 64 * 4}
    sequence = tensor_parallel_collectives(config, 2, 64, 4, sequence_parallel=True)
    # An all-reduce is a reduce-scatter then an all-gather: the conjugates move the same bytes, and the
    # re-gathered inputs (one per half-layer and one for the head) come on top.
    scatter = sum(c.nbytes for c in sequence if c.kind == "reduce_scatter")
    gather = sum(c.nbytes for c in sequence if c.kind == "all_gather")
    assert scatter == (4 * config.n_layer + 2) * activation
    assert gather == scatter + (2 * config.n_layer + 1) * activation
    link = LinkModel(alpha_s=1e-5, beta_s_per_byte=1e-9)
    times = [model.tensor_parallel_step_time(config, 2, 64, t, 1.0, link) for t in (1, 2, 4)]
    assert [step.compute_s for step in times] == [1.0, 0.5, 0.25]
    assert times[0].communication_s == 0 < times[1].communication_s < times[2].communication_s


def test_the_step_model_keeps_what_does_not_split_slows_shared_cores_and_takes_measured_collectives():
    from labkit.costmodel import tensor_parallel as model
    from labkit.costmodel.collectives import LinkModel

    config = GPTConfig.preset("1m")
    calls = model.tensor_parallel_collectives(config, 4, 128, 2)
    measured = {4 * 128 * config.n_embd * 4: 2e-3, 4 * 128 * 4: 1e-3}  # an activation's, and the loss's
    step = model.tensor_parallel_step_time(config, 4, 128, 2, 0.08, whole_s=0.02, slowdown=1.5,
                                           collective_s=lambda call: measured[call.nbytes])
    assert step.compute_s == pytest.approx((0.02 + 0.06 / 2) * 1.5) and step.whole_s == pytest.approx(0.03)
    assert step.collectives == len(calls) == 21 and step.communication_s == pytest.approx(18 * 2e-3 + 3 * 1e-3)
    assert step.step_s == pytest.approx(step.compute_s + step.communication_s)
    # without whole_s and slowdown the model is the GPU one: the step divided by t, the ring over the link
    link = LinkModel(alpha_s=1e-5, beta_s_per_byte=1e-9)
    plain = model.tensor_parallel_step_time(config, 4, 128, 2, 0.08, link)
    assert plain.compute_s == 0.04 and plain.whole_s == 0
    assert model.tensor_parallel_step_time(config, 4, 128, 1, 0.08, whole_s=0.02).step_s == pytest.approx(0.08)
    for kwargs, message in (({"whole_s": 0.09}, "whole_s"), ({"slowdown": 0.0}, "slowdown"), ({}, "link")):
        with pytest.raises(ValueError, match=message):
            model.tensor_parallel_step_time(config, 4, 128, 2, 0.08, **kwargs)
