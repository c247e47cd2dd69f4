"""Pipeline stages (``labkit.parallel.pipeline.stage``) against the whole model with gradient accumulation.

TinyGPT "100k" (untied) is cut into stages that run by hand in GPipe order (every forward with its send and
receive, then every backward) over ``m = 2`` micro-batches: on 2 ranks with 2 stages and, interleaved, 4 stages
(rank r holds r and r + 2); on 4 ranks with 4 stages, and as the pp dimension of ``Mesh(dp=2, pp=2)``, whose pp
groups [0, 2] and [1, 3] make the neighbours global ranks two apart.  Each rank builds the whole model from the
same seed, runs it on the same micro-batches with the loss scaled by ``1 / m``, and returns both; the losses and
every gradient, matched by name, agree within rtol 1e-5, and the comparison is shown to reject gradients that
lack the ``1 / m``.  Splitting and building errors are checked without a process group.
"""

from __future__ import annotations

import pytest
import torch

from labkit.launch import launch
from labkit.mesh import Mesh
from labkit.models import GPTConfig, TinyGPT
from labkit.parallel.pipeline.stage import PipelineStage, build_stage, split_stages

SEED, MICRO_BATCH, SEQ, M = 11, 2, 16, 2
CONFIG = GPTConfig.preset("100k", tie_weights=False)


def _microbatches() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, CONFIG.vocab_size, (M * MICRO_BATCH, SEQ + 1), generator=generator)
    ids, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return list(ids.split(MICRO_BATCH)), list(targets.split(MICRO_BATCH))


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The whole model on one process: gradient accumulation of loss / m over the same micro-batches."""
    model = TinyGPT(CONFIG, SEED)
    losses = []
    for ids, targets in zip(*_microbatches(), strict=True):
        _, loss = model(ids, targets)
        (loss / M).backward()
        losses.append(loss.item())
    return losses, {name: parameter.grad for name, parameter in model.named_parameters()}


def _gpipe_by_hand(group, num_stages: int) -> dict:
    """This rank's stages (global indices rank, rank + p, ...) through GPipe: all forwards, then all backwards."""
    pp_group = group.group("pp") if isinstance(group, Mesh) else group
    p, here = torch.distributed.get_world_size(pp_group), torch.distributed.get_rank(pp_group)
    stages = [PipelineStage(build_stage(CONFIG, SEED, stage, num_stages), stage, num_stages, group,
                            micro_batch_size=MICRO_BATCH, seq_len=SEQ, num_microbatches=M)
              for stage in range(here, num_stages, p)]
    ids, targets = _microbatches()
    losses, received = {}, []
    for microbatch in range(M):
        for stage in stages:
            if stage.is_first:
                inputs = ids[microbatch]
            else:
                inputs = stage.recv_activation(microbatch)
                received.append((tuple(inputs.shape), inputs.requires_grad))
            out = stage.forward(microbatch, inputs, targets[microbatch] if stage.is_last else None)
            if stage.is_last:
                losses[microbatch] = out.item()
            else:
                stage.send_activation(microbatch, out)
    held = [stage.pending_microbatches for stage in stages]
    for microbatch in range(M):
        for stage in reversed(stages):
            grad_input = stage.backward(microbatch, None if stage.is_last else stage.recv_gradient(microbatch))
            if not stage.is_first:
                stage.send_gradient(microbatch, grad_input)
    for stage in stages:
        stage.wait_sends()
    return {"losses": losses, "received": received, "held": held,
            "neighbours": {stage.stage: (stage.prev_rank, stage.next_rank) for stage in stages},
            "grads": {name: parameter.grad for stage in stages
                      for name, parameter in stage.module.named_parameters()}}


def _errors_on_ranks() -> dict[str, str]:
    errors = {}
    rank = torch.distributed.get_rank()
    module = build_stage(CONFIG, SEED, rank, 2)

    def catch(name, make):
        try:
            make()
        except ValueError as error:
            errors[name] = str(error)

    make = dict(micro_batch_size=MICRO_BATCH, seq_len=SEQ, num_microbatches=M)
    catch("wrong_rank", lambda: PipelineStage(module, 1 - rank, 2, **make))
    stage = PipelineStage(module, rank, 2, **make)
    if rank == 0:
        catch("wrong_shape", lambda: stage.send_activation(0, torch.zeros(MICRO_BATCH, SEQ + 1, CONFIG.n_embd)))
        catch("no_targets_here", lambda: stage.forward(0, _microbatches()[0][0], _microbatches()[1][0]))
    return errors


def _on_two_ranks() -> dict:
    reference = _reference()
    return {"reference": reference, "errors": _errors_on_ranks(),
            "p2": _gpipe_by_hand(None, 2), "p2v2": _gpipe_by_hand(None, 4)}


def _on_four_ranks() -> dict:
    reference = _reference()
    return {"reference": reference, "p4": _gpipe_by_hand(None, 4), "mesh": _gpipe_by_hand(Mesh(dp=2, pp=2), 2)}


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    return {2: launch(_on_two_ranks, nprocs=2, timeout=60, rank_output="none"),
            4: launch(_on_four_ranks, nprocs=4, timeout=60, rank_output="none")}


def _check_against_reference(per_rank: list[dict], case: str, ranks: list[int], scale: float = 1.0) -> None:
    """The ranks of one pipeline together hold every parameter once, with the reference's loss and gradients."""
    reference_losses, reference_grads = per_rank[ranks[0]]["reference"]
    grads, losses = {}, {}
    for rank in ranks:
        found = per_rank[rank][case]
        assert not grads.keys() & found["grads"].keys(), f"{case}: a parameter is held by two stages"
        grads.update(found["grads"])
        losses.update(found["losses"])
    assert sorted(grads) == sorted(reference_grads), f"{case}: the stages' names are not the whole model's"
    assert losses == pytest.approx(dict(enumerate(reference_losses)), rel=1e-5), case
    for name, grad in grads.items():
        torch.testing.assert_close(grad * scale, reference_grads[name], rtol=1e-5, atol=1e-8,
                                   msg=lambda text, name=name: f"{case}, {name}: {text}")


@pytest.mark.parametrize(("world_size", "case", "pipelines"), [
    (2, "p2", [[0, 1]]), (2, "p2v2", [[0, 1]]), (4, "p4", [[0, 1, 2, 3]]), (4, "mesh", [[0, 2], [1, 3]])])
def test_stages_in_gpipe_order_match_the_whole_model_with_gradient_accumulation(runs, world_size, case,
                                                                                  pipelines):
    for ranks in pipelines:
        _check_against_reference(runs[world_size], case, ranks)


def test_the_comparison_rejects_gradients_without_the_one_over_m_scaling(runs):
    with pytest.raises(AssertionError):
        _check_against_reference(runs[2], "p2", [0, 1], scale=M)


def test_neighbours_are_global_ranks_of_the_pp_group_and_stage_s_lives_on_rank_s_mod_p(runs):
    assert runs[2][0]["p2v2"]["neighbours"] == {0: (None, 1), 2: (1, 1)}
    assert runs[2][1]["p2v2"]["neighbours"] == {1: (0, 0), 3: (0, None)}
    assert runs[4][0]["mesh"]["neighbours"] == {0: (None, 2)}
    assert runs[4][3]["mesh"]["neighbours"] == {1: (1, None)}
    assert runs[4][2]["p4"]["neighbours"] == {2: (1, 3)}


def test_received_activations_have_the_agreed_shape_and_require_grad(runs):
    expected = (MICRO_BATCH, SEQ, CONFIG.n_embd)
    received = [entry for per_rank in runs[2] + runs[4] for case in ("p2", "p2v2", "p4", "mesh")
                if case in per_rank for entry in per_rank[case]["received"]]
    assert received and set(received) == {(expected, True)}
    assert runs[2][0]["p2"]["held"] == [[0, 1]], "GPipe holds every micro-batch until its backward"


def test_stage_errors_name_the_rule(runs):
    errors = runs[2][0]["errors"]
    assert "stage 1 lives on pp-rank 1 (loop placement, p=2), but this is pp-rank 0" in errors["wrong_rank"]
    assert "(2, 17, 48)" in errors["wrong_shape"] and "(2, 16, 48)" in errors["wrong_shape"]
    assert "targets belong to the last stage" in errors["no_targets_here"]


def test_split_stages_gives_contiguous_equal_ranges_and_names_the_numbers_when_it_cannot():
    assert split_stages(CONFIG, 2) == [range(0, 2), range(2, 4)]
    assert split_stages(CONFIG, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError, match=r"n_layer=4 is not divisible by num_stages=3"):
        split_stages(CONFIG, 3)
    with pytest.raises(ValueError, match="num_stages must be an integer >= 1"):
        split_stages(CONFIG, 0)


def test_build_stage_holds_its_pieces_with_the_whole_models_names_and_values():
    whole = dict(TinyGPT(CONFIG, SEED).named_parameters())
    first, last = build_stage(CONFIG, SEED, 0, 2), build_stage(CONFIG, SEED, 1, 2)
    assert first.block_indices == (0, 1) and first.lm_head is None and first.token_embedding is not None
    assert last.block_indices == (2, 3) and last.lm_head is not None and last.token_embedding is None
    for stage in (first, last):
        for name, parameter in stage.named_parameters():
            assert torch.equal(parameter, whole[name]), name
    assert build_stage(GPTConfig.preset("100k"), SEED, 0, 1).block_indices == (0, 1, 2, 3)  # one stage may tie


def test_build_stage_refuses_tied_weights_and_bad_stage_indices():
    with pytest.raises(ValueError, match="tie_weights=False"):
        build_stage(GPTConfig.preset("100k"), SEED, 0, 2)
    with pytest.raises(ValueError, match=r"global stage index in \[0, 2\)"):
        build_stage(CONFIG, SEED, 2, 2)


class _HeadUsedByHand(torch.nn.Module):
    """One whole stage whose head's weight is used without calling the head (``F.linear(x, head.weight)``)."""

    def __init__(self):
        super().__init__()
        self.embedding, self.head = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8)

    def forward(self, ids, targets):
        logits = torch.nn.functional.linear(self.embedding(ids), self.head.weight, self.head.bias)
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _split_forward_of_a_hand_used_weight() -> str:
    stage = PipelineStage(_HeadUsedByHand(), 0, 1, None, micro_batch_size=2, seq_len=3, num_microbatches=1,
                          hidden_size=4)
    ids = torch.zeros(2, 3, dtype=torch.long)
    stage.forward(0, ids, ids)  # a whole backward does not need the layers' outputs
    stage.backward(0)
    try:
        stage.forward(0, ids, ids, split_backward=True)
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_split_backward_refuses_weights_used_outside_their_layer():
    """W finds a weight's gradient from its layer's output, seen by a forward hook: a weight used by hand would
    get none, silently (tensor parallelism's query/key/value once did), so the first split forward refuses it."""
    message = launch(_split_forward_of_a_hand_used_weight, nprocs=1)[0]
    assert "used without their layer's forward" in message and "head.weight" in message
