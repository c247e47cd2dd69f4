"""The pipeline runtime (``labkit.parallel.pipeline.runtime``) against gradient accumulation and against torch.

One launch per pipeline size (p = 2 and 4) runs, on TinyGPT "100k" with 8 blocks (untied), every schedule:
GPipe, 1F1B, ZB-H1 (split backward) and interleaved 1F1B with v = 2, through labkit's runtime, then GPipe, 1F1B
and interleaved 1F1B through ``torch.distributed.pipelining`` on the same stages.  Every rank also computes the
whole model with gradient accumulation over the same m micro-batches (loss / m).  The losses and every gradient
agree within rtol 1e-5 with both references; the measured timeline runs each rank's actions in the schedule's
order, and the activations it measured held at peak are the simulator's.  Stages that wait instead of compute
hold every schedule's measured bubble to its closed form at p = 4; a stage that dies fails the launch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from labkit import trace
from labkit.launch import RankFailed, launch
from labkit.models import GPTConfig, TinyGPT
from labkit.parallel.pipeline import (
    PipelineStage,
    Schedule,
    TimedStage,
    build_pipeline,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    run_schedule,
    simulate,
    timed_pipeline,
    zb_h1,
)
from labkit.parallel.pipeline.torch_reference import torch_pipeline, torch_step

CONFIG = GPTConfig.preset("100k", n_layer=8, tie_weights=False)
SEED, MICRO_BATCH, SEQ = 3, 2, 16
RTOL = 1e-5


def _batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, CONFIG.vocab_size, (m * MICRO_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(5))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _reference(m: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, losses = TinyGPT(CONFIG, SEED), []
    for ids, targets in zip(*(t.chunk(m) for t in _batch(m)), strict=True):
        loss = model(ids, targets)[1]
        (loss / m).backward()
        losses.append(loss.item())
    return losses, {name: parameter.grad for name, parameter in model.named_parameters()}


def _worst(modules, reference: dict[str, torch.Tensor]) -> float:
    """The largest gradient difference, relative to the reference gradient's own largest entry."""
    return max(((parameter.grad - reference[name]).abs().max() / reference[name].abs().max()).item()
               for module in modules for name, parameter in module.named_parameters())


def _schedules(p: int, m: int) -> list[Schedule]:
    return [gpipe(p, m), one_f_one_b(p, m), zb_h1(p, m), interleaved_1f1b(p, m, 2)]


def _errors(p: int, m: int) -> dict[str, str]:
    """What run_schedule refuses, before any message is sent (a correct step runs afterwards)."""
    ids, targets = _batch(m)
    schedule = one_f_one_b(p, m)
    stages = build_pipeline(CONFIG, SEED, schedule, micro_batch_size=MICRO_BATCH, seq_len=SEQ)
    cases = {
        "wrong stages": lambda: run_schedule(interleaved_1f1b(p, m, 2), stages, ids, targets),
        "wrong m": lambda: run_schedule(one_f_one_b(p, 2 * m), stages, ids, targets),
        "wrong p": lambda: run_schedule(one_f_one_b(p + 1, m), stages, ids, targets),
        "short batch": lambda: run_schedule(schedule, stages, ids[:-1], targets[:-1]),
        "broken table": lambda: run_schedule(Schedule(p, m, 1, "B first", [row[::-1] for row in schedule.orders()]),
                                             stages, ids, targets),
        "not a schedule": lambda: run_schedule("1F1B", stages, ids, targets),
    }
    found = {}
    for name, case in cases.items():
        try:
            case()
            found[name] = "no error"
        except (ValueError, TypeError) as error:
            found[name] = f"{type(error).__name__}: {error}"
    run_schedule(schedule, stages, ids, targets)  # nothing stray is left in flight
    return found


def _everything(m: int) -> dict:
    torch.set_num_threads(1)
    p = dist.get_world_size()
    ids, targets = _batch(m)
    reference_losses, reference = _reference(m)
    out: dict = {"labkit": {}, "torch": {}}
    for schedule in _schedules(p, m):
        stages = build_pipeline(CONFIG, SEED, schedule, micro_batch_size=MICRO_BATCH, seq_len=SEQ)
        run = run_schedule(schedule, stages, ids, targets)
        out["labkit"][schedule.name] = {
            "grad": _worst([stage.module for stage in stages], reference),
            "loss": None if run.losses is None else max(abs(a - b) for a, b in zip(run.losses, reference_losses, strict=True)),
            "orders": [[action for _, _, action in row] for row in run.timeline.events] == schedule.orders(),
            "peak": run.timeline.peak_activations, "simulated peak": simulate(schedule).peak_activations,
            "held after": [stage.pending_microbatches + stage.pending_weights for stage in stages]}
        if schedule.name != "ZB-H1":
            theirs, modules = torch_pipeline(CONFIG, SEED, schedule.name, p, m, schedule.v)
            losses = torch_step(theirs, modules, ids, targets)
            out["torch"][schedule.name] = {
                "grad vs torch": max(((a.grad - b.grad).abs().max() / b.grad.abs().max()).item()
                                     for stage, module in zip(stages, modules, strict=True)
                                     for a, b in zip(stage.module.parameters(), module.parameters(), strict=True)),
                "loss vs torch": None if losses is None else max(abs(a - b) for a, b in zip(losses, run.losses, strict=True))}
    # The comparison can fail: gradients of the summed loss (no 1 / m) are off by a factor m.
    stages = build_pipeline(CONFIG, SEED, one_f_one_b(p, m), micro_batch_size=MICRO_BATCH, seq_len=SEQ)
    run_schedule(one_f_one_b(p, m), stages, ids, targets, timeline=False)
    for stage in stages:
        for parameter in stage.module.parameters():
            parameter.grad *= m
    out["unscaled"] = _worst([stage.module for stage in stages], reference)
    out["errors"] = _errors(p, m)
    trace.enable()
    run_schedule(one_f_one_b(p, m), stages, ids, targets, timeline=False)
    out["spans"] = [(span.name, span.kind) for span in trace.spans()]
    trace.disable()
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"p={p}")
def runs(request):
    return request.param, launch(_everything, 4, nprocs=request.param, timeout=120, rank_output="none")


def test_every_schedule_equals_gradient_accumulation(runs):
    p, results = runs
    for rank, result in enumerate(results):
        for name, found in result["labkit"].items():
            assert found["grad"] <= RTOL, f"p={p} rank {rank} {name}: gradients differ by {found['grad']:.2e}"
            if rank == p - 1:
                assert found["loss"] <= RTOL * 4, (name, found["loss"])
            else:
                assert found["loss"] is None
            assert found["orders"], f"{name}: rank {rank} ran its actions out of the schedule's order"
            assert found["held after"] == [[]] * len(found["held after"]), "a micro-batch was left held"
        assert result["unscaled"] > 0.5, "the comparison must reject gradients without the 1 / m"


def test_measured_peak_activations_are_the_simulators(runs):
    p, results = runs
    for name, found in results[0]["labkit"].items():
        assert found["peak"] == found["simulated peak"], name
    assert results[0]["labkit"]["GPipe"]["peak"] == [4] * p
    assert results[0]["labkit"]["1F1B"]["peak"] == [min(p - stage, 4) for stage in range(p)]


def test_torch_pipelining_gives_the_same_losses_and_gradients(runs):
    p, results = runs
    for rank, result in enumerate(results):
        assert set(result["torch"]) == {"GPipe", "1F1B", "Interleaved 1F1B"}
        for name, found in result["torch"].items():
            assert found["grad vs torch"] <= RTOL, (p, rank, name, found)
            if rank == p - 1:
                assert found["loss vs torch"] <= RTOL * 4, (name, found)


def test_bad_input_is_refused_before_any_message(runs):
    p, results = runs
    errors = results[0]["errors"]
    assert "runs stages [0, 2" in errors["wrong stages"] or f"runs stages [0, {p}" in errors["wrong stages"]
    assert "m=" in errors["wrong m"] and errors["wrong m"].startswith("ValueError")
    assert f"p={p + 1}" in errors["wrong p"]
    assert "(m * micro_batch_size, seq_len)" in errors["short batch"] or errors["short batch"] == "no error"
    assert "B first" in errors["broken table"] and errors["broken table"].startswith("ValueError")
    assert errors["not a schedule"].startswith("TypeError")
    assert "(m * micro_batch_size, seq_len)" in results[0]["errors"]["short batch"]  # rank 0 holds the ids


def test_trace_has_one_compute_span_per_action_and_bubbles(runs):
    p, results = runs
    for rank, result in enumerate(results):
        compute = [name for name, kind in result["spans"] if kind == "compute"]
        assert compute == [str(action) for action in one_f_one_b(p, 4).orders()[rank]]
    assert any(kind == "bubble" for _, kind in results[-1]["spans"]), "the last stage waits for its first input"


def _timed(m: int, forward_s: float, repeats: int = 2) -> dict:
    """Each schedule's measured bubble, the least of ``repeats`` runs (a late wake-up of one rank can only add
    idle time, never remove it), beside the formula's."""
    p = dist.get_world_size()
    out = {}
    for schedule in _schedules(p, m):
        v = schedule.v
        stages = timed_pipeline(schedule, forward_s / v, 2 * forward_s / v, forward_s / v)
        ids = torch.zeros(m * 1, 4, dtype=torch.long)
        measured = min(run_schedule(schedule, stages, ids, ids).timeline.bubble_fraction for _ in range(repeats))
        formula = simulate(schedule, forward_s / v, 2 * forward_s / v, forward_s / v)
        out[schedule.name] = (measured, formula.bubble_fraction)
    return out


@pytest.mark.timing
def test_timed_stages_hold_every_schedules_bubble_to_its_formula():
    # F = 50 ms: long enough for a machine busy with other tests to add only a point or two of overhead.
    found = launch(_timed, 4, 0.05, nprocs=4, timeout=120, rank_output="none")[0]
    for name, (measured, formula) in found.items():
        assert abs(measured - formula) <= 0.05, f"{name}: measured {measured:.3f}, formula {formula:.3f}"
    assert found["ZB-H1"][0] < found["1F1B"][0] - 0.05, "ZB-H1 fills the cool-down that 1F1B leaves idle"


def test_timed_stage_refuses_impossible_durations():
    with pytest.raises(ValueError, match="weight_s=0.3 must not exceed backward_s=0.2"):
        TimedStage(0.1, 0.2, 0.3)
    with pytest.raises(ValueError, match="forward_s must be a number of seconds >= 0"):
        TimedStage(-1, 0.2)


def _dies(m: int) -> None:
    schedule = one_f_one_b(dist.get_world_size(), m)
    stages = build_pipeline(CONFIG, SEED, schedule, micro_batch_size=MICRO_BATCH, seq_len=SEQ)
    if dist.get_rank() == 1:
        def broken(*args):
            raise RuntimeError("stage 1 ran out of memory")
        stages[0].module.forward = broken
    run_schedule(schedule, stages, *_batch(m))


def test_a_stage_that_dies_fails_the_launch_instead_of_hanging():
    with pytest.raises(RankFailed, match="stage 1 ran out of memory"):
        launch(_dies, 4, nprocs=2, timeout=60, rank_output="none")


def _split_errors() -> list[str]:
    stage = build_pipeline(CONFIG, SEED, one_f_one_b(1, 2), micro_batch_size=MICRO_BATCH, seq_len=SEQ)[0]
    ids, targets = (t.chunk(2) for t in _batch(2))
    found = []
    stage.forward(0, ids[0], targets[0])
    for call in (lambda: stage.backward_input(0), lambda: stage.backward_weight(1)):
        try:
            call()
        except ValueError as error:
            found.append(str(error))
    return found


def test_a_split_backward_needs_a_split_forward_and_an_input_gradient_first():
    found = launch(_split_errors, nprocs=1, rank_output="none")[0]
    assert "without split_backward=True" in found[0]
    assert "no input gradient (I) of micro-batch 1" in found[1]
    assert PipelineStage  # the class the errors come from
