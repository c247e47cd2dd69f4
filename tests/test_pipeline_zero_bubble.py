"""The schedules of 2024-25 (``labkit.parallel.pipeline.zero_bubble``): ZB-V, interleaved zero bubble, DualPipeV.

Each table equals torch's own class's per-rank order, action for action (an overlapped ``F&B`` of DualPipeV read as
its two sub-actions), on a grid of p and m, and passes the validator.  Under the simulator each bubble is held to
its paper's closed form where that form is exact, and each rank's peak of activations to what the papers report.
On real ranks the runtime runs them on TinyGPT stages (V placement included) with the losses and gradients of one
process with gradient accumulation and of torch's runtime, and on stages that wait instead of compute with the
simulator's bubble.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from labkit.launch import launch
from labkit.parallel.pipeline import (
    Action,
    PipelineStage,
    Schedule,
    build_pipeline,
    dualpipe_v,
    interleaved_zb,
    one_f_one_b,
    run_schedule,
    simulate,
    stage_rank,
    timed_pipeline,
    validate,
    zb_h1,
    zb_v,
)
from labkit.parallel.pipeline.torch_reference import torch_orders, torch_pairs, torch_pipeline, torch_step
from tests.test_pipeline_runtime import CONFIG, MICRO_BATCH, SEED, SEQ, _batch, _reference, _worst


def _ours(schedule: Schedule) -> list[list[str]]:
    return [[str(action) for action in order] for order in schedule.orders()]


def test_zb_v_is_torchs_zbv_action_for_action_and_valid():
    for p in range(1, 7):
        for m in sorted({1, p, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p, 8}):
            schedule = zb_v(p, m)
            validate(schedule)
            assert _ours(schedule) == torch_orders("ZB-V", p, m, 2), (p, m)
            assert [schedule.rank_of(s) for s in range(2 * p)] == [*range(p), *reversed(range(p))]
            if m >= 2 * p - 1:  # the ramp's p - 1 slots against 6m of work, half ZB-H1's bubble
                assert simulate(schedule).bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1)), (p, m)
    with pytest.raises(ValueError, match="'v' with v = 2 stages per rank"):
        Schedule(2, 2, 3, "bad", [[], []], "v")


def test_interleaved_zb_is_torchs_action_for_action_and_valid():
    compared = 0
    for p in range(1, 7):
        for v in (1, 2, 3):
            for m in sorted({1, 2, p, p + 1, 2 * p, 3 * p, 8}):
                if m % max(1, m // p):
                    with pytest.raises(ValueError, match=f"m must be a multiple of {max(1, m // p)}"):
                        interleaved_zb(p, m, v)
                    continue
                schedule = interleaved_zb(p, m, v)  # validated as it is placed
                assert _ours(schedule) == torch_orders("Interleaved ZB", p, m, v), (p, m, v)
                compared += 1
    assert compared > 100
    assert _ours(interleaved_zb(4, 8, 1)) == _ours(zb_h1(4, 8)), "on one chunk a rank it is ZB-H1"


def test_dualpipe_v_is_torchs_action_for_action_with_its_pairs():
    for p in range(1, 7):
        for m in sorted({2 * p, 2 * p + 1, 3 * p, 4 * p + 1, 10} - set(range(2 * p))):
            schedule = dualpipe_v(p, m)
            validate(schedule)
            assert _ours(schedule) == torch_orders("DualPipeV", p, m, 2), (p, m)
            assert {(str(f), str(b)) for f, b in schedule.pairs} == torch_pairs("DualPipeV", p, m), (p, m)
            for forward, backward in schedule.pairs:  # each pair: F of one stage, B of the rank's other stage
                assert forward.kind == "F" and backward.kind == "B" and forward.stage != backward.stage
                assert schedule.rank_of(forward.stage) == schedule.rank_of(backward.stage)
            steady = m - 2 * p + 1  # the main loop's iterations on rank 0: two pairs each, one more in step 5
            apart = p == 1  # the last rank runs its first F0 and B1 apart (rank 0 is the last when p = 1)
            assert sum(schedule.rank_of(f.stage) == 0 for f, _ in schedule.pairs) == 2 * steady + (p - 1) - apart
    with pytest.raises(ValueError, match="m >= 2p = 8, got m=7"):
        dualpipe_v(4, 7)


def test_a_pair_must_be_a_forward_then_a_backward_on_one_rank():
    good = dualpipe_v(2, 4)
    forward, backward = sorted(good.pairs, key=str)[0]
    with pytest.raises(ValueError, match="must be a forward and a backward run one after the other"):
        validate(Schedule(2, 4, 2, "swapped", good.orders(), "v", frozenset({(backward, forward)})))
    with pytest.raises(ValueError, match="must be a forward and a backward run one after the other"):
        validate(Schedule(2, 4, 2, "apart", good.orders(), "v", frozenset({(Action(0, "F", 0), Action(0, "B", 0))})))
    with pytest.raises(ValueError, match="names an action the schedule does not run"):
        validate(Schedule(2, 4, 2, "stray", good.orders(), "v", frozenset({(Action(0, "F", 9), Action(3, "B", 0))})))


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("f, i, w", [(1, 1, 1), (2, 2, 1), (1, 2, 1), (2, 3, 2), (3, 2, 1)])
def test_bubbles_against_the_papers_closed_forms(p, f, i, w):
    """Idle time per rank, F, I, W of one stage apart (B = I + W).  ZB1P's ``(p-1)(F+B-2W)`` (Qi et al. 2023)
    is exact for ZB-H1 and interleaved ZB at every ratio; ZB-V never exceeds it and meets it at F = I = W;
    DualPipe's ``(PP/2-1)(F&B+B-3W)``, PP = 2p stages, holds at F = I = W with the pair run one after the other
    (F&B = F + B), and moves either way elsewhere (the lesson shows by how much)."""
    b, m = i + w, 3 * p
    zb1p = (p - 1) * (f + b - 2 * w)
    assert simulate(zb_h1(p, m), f, b, w).idle / p == zb1p
    assert simulate(interleaved_zb(p, m, 2), f, b, w).idle / p == zb1p
    assert simulate(zb_v(p, m), f, b, w).idle / p <= zb1p
    dualpipe = simulate(dualpipe_v(p, m), f, b, w).idle / p
    if f == i == w:
        assert simulate(zb_v(p, m), f, b, w).idle / p == zb1p
        assert dualpipe == (p - 1) * ((f + b) + b - 3 * w)


def test_overlap_shortens_dualpipe_and_only_dualpipe():
    p, m = 4, 12
    apart, hidden = simulate(dualpipe_v(p, m), 1, 2, 1), simulate(dualpipe_v(p, m), 1, 2, 1, overlap=1)
    assert hidden.total < apart.total
    assert simulate(zb_v(p, m), 1, 2, 1, overlap=1).total == simulate(zb_v(p, m), 1, 2, 1).total
    assert hidden.busy == apart.busy - len(dualpipe_v(p, m).pairs) * 1  # each pair hides its forward (1)
    with pytest.raises(ValueError, match=r"overlap must be in \[0, 1\]"):
        simulate(dualpipe_v(p, m), overlap=1.5)


def test_activations_held_per_rank_are_the_papers():
    """Per rank, all its stages together, in micro-batches of one stage: 1F1B's rank 0 holds p (of p stages);
    ZB-V 2p of 2p half-size stages, the same memory (Qi et al.); DualPipeV PP + 1 = 2p + 1 (DualPipe's README)."""
    for p in (2, 3, 4):
        m = 4 * p
        assert simulate(one_f_one_b(p, m)).rank_peaks == [p - r for r in range(p)]
        assert simulate(zb_v(p, m)).rank_peaks == [2 * p] * p
        assert simulate(dualpipe_v(p, m)).rank_peaks == [2 * p + 1] * p
        assert simulate(interleaved_zb(p, m, 2)).rank_peaks == [2 * p - r for r in range(p)]


def test_exact_numbers_stay_exact_with_pairs():
    timeline = simulate(dualpipe_v(2, 4), Fraction(1, 3), Fraction(2, 3), Fraction(1, 3), overlap=Fraction(1, 2))
    assert isinstance(timeline.total, Fraction)


def _on_real_stages(m: int) -> dict:
    """Each new schedule through labkit's runtime and torch's on TinyGPT stages, beside gradient accumulation."""
    torch.set_num_threads(1)
    p = dist.get_world_size()
    ids, targets = _batch(m)
    reference_losses, reference = _reference(m)
    out = {}
    for schedule in (zb_v(p, m), interleaved_zb(p, m, 2), dualpipe_v(p, m)):
        stages = build_pipeline(CONFIG, SEED, schedule, micro_batch_size=MICRO_BATCH, seq_len=SEQ)
        run = run_schedule(schedule, stages, ids, targets)
        theirs, modules = torch_pipeline(CONFIG, SEED, schedule.name, p, m, schedule.v)
        torch_losses = torch_step(theirs, modules, ids, targets)
        out[schedule.name] = {
            "stages": [stage.stage for stage in stages],
            "grad": _worst([stage.module for stage in stages], reference),
            "torch grad": _worst(modules, reference),
            "loss": None if run.losses is None else max(abs(a - b) for a, b in zip(run.losses, reference_losses, strict=True)),
            "torch loss": None if torch_losses is None else max(abs(a - b) for a, b in zip(torch_losses, reference_losses, strict=True)),
            "orders": [[action for _, _, action in row] for row in run.timeline.events] == schedule.orders(),
            "peaks": (run.timeline.peak_activations, run.timeline.rank_peaks),
            "simulated peaks": (simulate(schedule).peak_activations, simulate(schedule).rank_peaks),
            "held after": [stage.pending_microbatches + stage.pending_weights for stage in stages]}
    return out


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8)], ids=["p=2", "p=4"])
def test_runtime_and_torch_equal_gradient_accumulation_on_tinygpt(p, m):
    results = launch(_on_real_stages, m, nprocs=p, timeout=180, rank_output="none")
    for rank, result in enumerate(results):
        for name, found in result.items():
            assert found["grad"] <= 1e-5 and found["torch grad"] <= 1e-5, (p, rank, name, found)
            if 2 * p - 1 in found["stages"]:  # the last stage's rank: 0 in a V, p - 1 interleaved
                assert found["loss"] <= 4e-5 and found["torch loss"] <= 4e-5, (name, found)
            else:
                assert found["loss"] is None and found["torch loss"] is None
            assert found["orders"], f"{name}: rank {rank} ran out of the schedule's order"
            assert found["peaks"] == found["simulated peaks"], (name, rank)
            assert found["held after"] == [[]] * len(found["stages"])
            if name != "Interleaved ZB":
                assert found["stages"] == [rank, 2 * p - 1 - rank], "the V placement"


def test_the_v_placement_is_checked():
    assert [stage_rank(s, 3, "v") for s in range(6)] == [0, 1, 2, 2, 1, 0]
    with pytest.raises(ValueError, match="placement must be one of"):
        stage_rank(0, 2, "w")
    found = launch(_placement_errors, nprocs=2, rank_output="none")[1]
    assert "num_stages must be 2p = 4, got 6" in found[0]
    assert "stage 3 lives on pp-rank 0 (v placement, p=2), but this is pp-rank 1" in found[1]
    assert "pp-rank 1 of ZB-V (p=2, v=2, v placement) runs stages [1, 2], but was given stages [1, 3]" in found[2]


def _placement_errors() -> list[str]:
    from labkit.parallel.pipeline.timed import TimedStage
    found = []
    stage = TimedStage(0, 0, first=True)
    for call in (lambda: PipelineStage(stage, 0, 6, micro_batch_size=1, seq_len=4, num_microbatches=2,
                                       placement="v"),
                 lambda: PipelineStage(stage, 3, 4, micro_batch_size=1, seq_len=4, num_microbatches=2,
                                       placement="v") if dist.get_rank() == 1 else None,
                 lambda: run_schedule(zb_v(2, 2), [  # the round-robin placement's stages: r and r + 2
                     PipelineStage(TimedStage(0, 0, first=stage == 0, last=stage == 3), stage, 4, micro_batch_size=1,
                                   seq_len=4, num_microbatches=2) for stage in (dist.get_rank(), dist.get_rank() + 2)])):
        try:
            call()
            found.append("no error")
        except ValueError as error:
            found.append(str(error))
    return found


def _timed(m: int, forward_s: float, repeats: int = 2) -> dict:
    """Each new schedule's measured bubble, the least of ``repeats`` runs, beside the simulator's (F = I = W per
    stage: ``forward_s``)."""
    p = dist.get_world_size()
    out = {}
    for schedule in (zb_v(p, m), interleaved_zb(p, m, 2), dualpipe_v(p, m)):
        stages = timed_pipeline(schedule, forward_s, 2 * forward_s, forward_s)
        ids = torch.zeros(m, 4, dtype=torch.long)
        measured = min(run_schedule(schedule, stages, ids, ids).timeline.bubble_fraction for _ in range(repeats))
        out[schedule.name] = (measured, simulate(schedule, forward_s, 2 * forward_s, forward_s).bubble_fraction)
    return out


@pytest.mark.timing
def test_timed_stages_hold_the_new_schedules_bubbles_to_the_simulator():
    found = launch(_timed, 8, 0.02, nprocs=4, timeout=180, rank_output="none")[0]
    for name, (measured, simulated) in found.items():
        assert abs(measured - simulated) <= 0.05, f"{name}: measured {measured:.3f}, simulator {simulated:.3f}"


# ---------------------------------------------------------------------------------------------------------
# The 3D trainer, the step model and the planner with the new schedules.

THREE_D = [(2, 2, 2, 1, "zb-v"), (2, 2, 2, 0, "interleaved-zb"), (2, 2, 2, 0, "dualpipev")]


def _three_d() -> list[list[float]]:
    from labkit.mesh import Mesh
    from labkit.models import TinyGPT
    from labkit.parallel.parallelize import parallelize
    from tests.test_parallelize import BATCH, LR, STEPS
    from tests.test_parallelize import CONFIG as SMALL
    from tests.test_parallelize import _batch as step_batch

    torch.set_num_threads(1)
    out = []
    for dp, tp, pp, zero, schedule in THREE_D:
        mesh = Mesh(dp=dp, tp=tp, pp=pp)
        model = parallelize(TinyGPT(SMALL, seed=0), mesh, zero=zero, schedule=schedule, microbatches=4,
                            micro_batch_size=BATCH // 4, seq_len=SMALL.block_size)
        optimizer = model.make_optimizer(torch.optim.SGD, lr=LR, momentum=0.9)
        losses = []
        for step in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            losses.append(model.forward_backward(*step_batch(step, mesh.rank("dp"), dp)).item())
            optimizer.step()
        out.append((losses, model.stage_indices, model.communication_per_step(), model.predicted_communication()))
    return out


def test_the_3d_trainer_runs_the_new_schedules_as_one_process_trains():
    from tests.test_parallelize import _one_process
    runs = launch(_three_d, nprocs=8, timeout=300, rank_output="none")
    expected, _ = _one_process(2)
    for index, layout in enumerate(THREE_D):
        mean = [sum(rank[index][0][step] for rank in runs) / len(runs) for step in range(len(expected))]
        assert mean == pytest.approx(expected, abs=1e-5, rel=0), layout
        for rank in runs:
            assert rank[index][2] == rank[index][3], (layout, "measured bytes are the predicted")
    assert {tuple(rank[0][1]) for rank in runs} == {(0, 3), (1, 2)}, "ZB-V: pp-rank r holds stages r, 2p - 1 - r"


def test_fsdp_and_short_batches_are_refused_before_any_process():
    from labkit.parallel.parallelize import check_3d
    from tests.test_parallelize import CONFIG as SMALL
    for schedule in ("zb-v", "dualpipev", "interleaved-zb"):
        with pytest.raises(ValueError, match=f"FSDP \\(zero=3\\) cannot run the {schedule} schedule"):
            check_3d(SMALL, 2, 1, 2, zero=3, schedule=schedule, microbatches=4)
    with pytest.raises(ValueError, match="DualPipeV needs at least as many micro-batches as stages: m >= 2p = 4"):
        check_3d(SMALL, 2, 1, 2, schedule="dualpipev", microbatches=2)
    assert check_3d(SMALL, 2, 1, 2, schedule="zb-v", microbatches=2).placement == "v"


@pytest.mark.parametrize("name", ["interleaved-zb", "zb-v", "dualpipev"])
def test_the_step_models_timeline_is_the_simulators(name):
    from labkit.costmodel.step import place_schedule
    from labkit.parallel.pipeline.catalog import SCHEDULES
    for p in (2, 3, 4):
        for m in (2 * p, 3 * p):
            forward = [1.0 + 0.1 * c for c in range(2 * p)]  # uneven chunks, and a send
            backward = [2.0 + 0.3 * c for c in range(2 * p)]
            simulated = simulate(SCHEDULES[name](p, m, 2), forward, backward, send_s=0.05)
            assert place_schedule(name, p, m, 2, forward, backward, 0.05).makespan == pytest.approx(simulated.total,
                                                                                     abs=1e-9)


def test_the_closed_form_bounds_the_simulator_and_is_exact_for_interleaved_zb():
    from labkit.costmodel.step import closed_form_makespan
    from labkit.parallel.pipeline.catalog import SCHEDULES
    for forward, backward in ((1, 2), (1, 1), (1, 4), (3, 2)):
        for p in (2, 3, 4):
            for m in (2 * p, 2 * p + 1, 4 * p):
                for name in ("interleaved-zb", "zb-v", "dualpipev"):
                    if name == "interleaved-zb" and m % max(1, m // p):
                        continue
                    simulated = simulate(SCHEDULES[name](p, m, 2), forward / 2, backward / 2).total
                    bound = closed_form_makespan(name, p, m, forward, backward, 2)
                    assert bound <= simulated + 1e-12, (name, forward, backward, p, m)
                    if name == "interleaved-zb":
                        assert bound == pytest.approx(simulated), (forward, backward, p, m)


def test_the_planners_activations_held_are_the_simulators():
    from labkit.costmodel.rank_memory import held_microbatches
    from labkit.costmodel.stages import Layout
    from labkit.parallel.pipeline.catalog import SCHEDULES
    for name, vs in (("interleaved-zb", (2, 3)), ("zb-v", (2,)), ("dualpipev", (2,))):
        for v in vs:
            for p in (2, 3, 4):
                for m in (1, 2, p + 1, 2 * p, 3 * p, 4 * p):
                    if (name == "interleaved-zb" and m % max(1, m // p)) or (name == "dualpipev" and m < 2 * p):
                        continue
                    peaks = simulate(SCHEDULES[name](p, m, v)).rank_peaks
                    layout = Layout(1, 1, p, schedule=name, virtual_stages=v)
                    assert [held_microbatches(layout, m, r) for r in range(p)] == [n / v for n in peaks], (name, p, m)


def test_the_planner_tries_the_new_schedules_when_asked():
    from labkit.costmodel import compute, planner, shapes
    shape = shapes.TransformerShape.preset("gpt3-175b")
    found = planner.candidates(shape, 64, 64, schedules=planner.ALL_SCHEDULES)
    names = {layout.schedule for layout in found}
    assert {"zb-v", "dualpipev", "interleaved-zb"} <= names
    assert all(layout.zero != 3 for layout in found if layout.schedule in ("zb-v", "dualpipev", "interleaved-zb"))
    assert all(64 // (layout.dp * layout.micro_batch) >= 2 * layout.pp for layout in found
               if layout.schedule == "dualpipev")
    assert "zb-v" not in {layout.schedule for layout in planner.candidates(shape, 64, 64)}, "on request only"
    with pytest.raises(ValueError, match="schedules must be among"):
        planner.candidates(shape, 64, 64, schedules=("zbv",))
    best = planner.plan(shape, planner.Cluster(compute.GPUS["A100 80GB"], 64, 0.5), 64, top=3,
                        schedules=("zb-v", "dualpipev")).candidates
    assert best and all(candidate.layout.schedule in ("zb-v", "dualpipev") for candidate in best)


def _lesson_15_band(name: str):
    """Lesson 15's band ``name`` (``claims.Band(low, high, ...)`` in its timed cell), as the notebook states it."""
    import ast
    import json

    from labkit import claims
    from tests.conftest import REPO

    cells = json.loads((REPO / "notebooks" / "15_zero_bubble_and_dualpipe.ipynb").read_text())["cells"]
    for cell in cells:
        if cell["cell_type"] != "code" or f"{name} = claims.Band(" not in "".join(cell["source"]):
            continue
        for node in ast.walk(ast.parse("".join(line for line in cell["source"] if not line.startswith("%")))):
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == name:
                low, high = (ast.literal_eval(argument) for argument in node.value.args[:2])
                keywords = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.value.keywords}
                return claims.Band(low, high, **keywords)
    raise AssertionError(f"lesson 15 states no {name}")


def test_lesson_15s_same_launch_contrast_rejects_the_same_table_twice():
    """The rival the lesson's contrast names: ZB-V's table where DualPipeV's (or ZB-H1's) ran, a difference of 0;
    and its bubble band alone would take DualPipeV's table for ZB-V's, which is why the contrast exists."""
    f, b, w = 0.015, 0.030, 0.015  # the lesson's timed stages: half a rank's layers (a ZB-H1 stage: twice)
    zero_v = simulate(zb_v(4, 8), f, b, w).bubble_fraction
    slower = {"DualPipeV": simulate(dualpipe_v(4, 8), f, b, w).bubble_fraction,
              "ZB-H1": simulate(zb_h1(4, 8), 2 * f, 2 * b, 2 * w).bubble_fraction}
    unpaired = Schedule(4, 8, 2, "DualPipeV, no pairs", dualpipe_v(4, 8).table, "v")
    contrast, bubble = _lesson_15_band("CONTRAST_BAND"), _lesson_15_band("NEW_BAND")
    for name, bubble_fraction in slower.items():
        expected = bubble_fraction - zero_v
        assert expected == pytest.approx(0.052, abs=0.001)
        assert contrast.contains(expected, expected)  # the tables as simulated
        assert not contrast.contains(0.0, expected), name  # the same table twice
        assert not contrast.contains(simulate(unpaired, f, b, w).bubble_fraction - zero_v, expected), name
        assert bubble.contains(bubble_fraction, zero_v), "ZB-V's band alone cannot tell them apart"
    one_f_one_b_bubble = simulate(one_f_one_b(4, 8), 2 * f, 2 * b).bubble_fraction
    assert not bubble.contains(one_f_one_b_bubble, zero_v) and not bubble.contains(0.0, zero_v)
