"""labkit.monitor: every rank's scalars in TensorBoard, read back; the divergence alarm's rule, silent on healthy
ranks and naming the rank that left, for every reason it knows."""

from __future__ import annotations

import math
import random

import pytest

from labkit import monitor

NAN = math.nan


def healthy_losses(ranks: int, steps: int, seed: int, offset: float = 0.0, from_step: int = 0,
                   noise: float = 0.03) -> list[list[float]]:
    """A falling loss seen by ``ranks`` ranks on their own batches (Gaussian batch noise); the last rank
    ``offset`` higher from ``from_step`` on."""
    rng = random.Random(seed)
    return [[3.0 * 0.99 ** step + rng.gauss(0, noise) + (offset if rank == ranks - 1 and step >= from_step else 0)
             for rank in range(ranks)] for step in range(steps)]


def judged(alarm: monitor.DivergenceAlarm, losses: list[list[float]], grad_norms=None, fingerprints=None):
    found = []
    for step, row in enumerate(losses, start=1):
        count = len(row)
        found += alarm.judge(step, list(range(count)), row, grad_norms or [1.0] * count,
                             fingerprints or [NAN] * count)
    return found


@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
def test_the_loss_band_stays_silent_on_healthy_ranks(ranks):
    silent = [not judged(monitor.DivergenceAlarm(), healthy_losses(ranks, 300, seed)) for seed in range(40)]
    assert all(silent), f"false alarms in {silent.count(False)} of 40 healthy runs of 300 checks"


@pytest.mark.parametrize("ranks", [3, 4, 8])
def test_the_loss_band_names_the_rank_that_departs_and_the_step(ranks):
    for seed in range(10):
        found = judged(monitor.DivergenceAlarm(), healthy_losses(ranks, 120, seed, offset=0.1, from_step=10))
        assert [(alarm.kind, alarm.ranks) for alarm in found] == [("loss", (ranks - 1,))], found
        assert 32 <= found[0].step <= 40 and f"step {found[0].step}: rank {ranks - 1}: loss departs" in found[0].message


def test_with_two_ranks_the_loss_band_names_both():
    found = judged(monitor.DivergenceAlarm(), healthy_losses(2, 80, 0, offset=0.1))
    assert [(alarm.kind, alarm.ranks) for alarm in found] == [("loss", (0, 1))]


def test_a_rank_whose_loss_is_not_finite_is_named_at_once():
    losses = healthy_losses(4, 3, 0)
    losses[1][2] = NAN
    found = judged(monitor.DivergenceAlarm(), losses)
    assert [(alarm.step, alarm.kind, alarm.ranks) for alarm in found] == [(2, "loss", (2,))]
    assert "not finite" in found[0].message


def test_two_ranks_with_the_same_loss_to_the_bit_read_the_same_batches():
    losses = healthy_losses(4, 10, 0)
    for row in losses[4:]:
        row[3] = row[1]
    found = judged(monitor.DivergenceAlarm(repeats=2), losses)
    assert [(alarm.step, alarm.kind, alarm.ranks) for alarm in found] == [(6, "same_batches", (1, 3))]


def test_gradient_norms_and_fingerprints_must_agree_to_the_bit_and_the_minority_is_named():
    alarm = monitor.DivergenceAlarm()
    losses = healthy_losses(4, 3, 0)
    assert judged(alarm, losses[:1], grad_norms=[2.5] * 4, fingerprints=[7.0] * 4) == []
    found = alarm.judge(2, [0, 1, 2, 3], losses[1], [2.5, 2.5, 2.5 + 1e-12, 2.5], [7.0, 7.5, 7.0, 7.0])
    assert [(alarm.kind, alarm.ranks) for alarm in found] == [("grad_norm", (2,)), ("parameters", (1,))]
    assert alarm.judge(3, [0, 1, 2, 3], losses[2], [2.5, 2.5, 2.6, 2.5], [7.0, 7.5, 7.0, 7.0]) == []  # once
    two = monitor.DivergenceAlarm().judge(1, [4, 6], [1.0, 1.1], [2.0, 2.0], [7.0, 8.0])
    assert [(alarm.kind, alarm.ranks) for alarm in two] == [("parameters", (4, 6))]
    assert "disagree" in two[0].message
    assert monitor.DivergenceAlarm().judge(1, [0, 1], [1.0, 1.1], [2.0, 2.0], [7.0, NAN]) == []  # sharded: no test


@pytest.mark.parametrize("keyword, value", [("every", 0), ("window", 1), ("window", 100), ("history", 0),
                                            ("z", 0.0), ("repeats", True), ("every", 1.5)])
def test_bad_settings_are_value_errors_naming_the_value(keyword, value):
    with pytest.raises(ValueError, match=keyword):
        monitor.DivergenceAlarm(**{keyword: value})


def test_every_ranks_scalars_are_read_back_from_tensorboards_event_files(tmp_path):
    for rank in range(3):
        log = monitor.RankLog(tmp_path, rank=rank)
        for step in range(1, 6):
            log.scalars(step, {"loss": 3.0 - 0.1 * step + rank, "lr": 1e-3, "step_ms": 10.0 + rank})
        log.alarm(monitor.Alarm(4, "loss", (rank,), f"step 4: rank {rank}: test"))
        log.close()
    found = monitor.read_scalars(tmp_path)
    assert sorted(found) == [0, 1, 2]
    for rank in range(3):
        assert [step for step, _ in found[rank]["loss"]] == [1, 2, 3, 4, 5]
        assert found[rank]["loss"][0][1] == pytest.approx(2.9 + rank)
        assert found[rank]["alarm/loss"] == [(4, 1.0)]
    with pytest.raises(ValueError, match="loss_"):
        monitor.RankLog(tmp_path / "x", rank=0).scalars(1, {"loss_": 1.0})


# --------------------------------------------------------------------------------------------------------
# The loss test's three steps, the straggler's rule, the summary and the flight recorder's report


def test_the_loss_rule_in_three_steps_is_the_alarms_own():
    """deviations, loss_band and departed, played as the alarm plays them (the last 64 checks, judged from the
    32nd), name the rank and the step the alarm names."""
    from collections import deque

    losses = healthy_losses(4, 80, 3, offset=0.1, from_step=10)
    first = judged(monitor.DivergenceAlarm(), losses)[0]
    kept, named = deque(maxlen=64), None
    for step, row in enumerate(losses, start=1):
        kept.append(monitor.deviations(row))
        band = monitor.loss_band(kept, 16, 5.0) if len(kept) >= 32 else None
        if named is None and band is not None and monitor.departed(kept, 16, band[1]):
            named = (step, monitor.departed(kept, 16, band[1]))
    assert named == (first.step, first.ranks) == (named[0], (3,))
    assert monitor.deviations([1.0, 2.0, 4.0]) == [-2.0, -0.5, 2.5]  # each against the mean of the others
    assert monitor.loss_band([[0.5, -0.5]] * 10, 16, 5.0) is None  # nothing changes: no band
    assert monitor.departed([[0.3, -0.3]] * 16, 16, 0.1) == (0, 1)  # two ranks: both
    assert monitor.departed([[0.5, -0.5 / 3, -0.5 / 3, -0.5 / 3]] * 16, 16, 0.5) == ()  # at the limit: inside
    with pytest.raises(ValueError, match="at least two ranks"):
        monitor.deviations([1.0])
    with pytest.raises(ValueError, match="at least two checks"):
        monitor.loss_band([[0.1, -0.1]], 16, 5.0)
    with pytest.raises(ValueError, match="at least one check of at least two ranks"):
        monitor.departed([], 16, 0.1)
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds, got 0"):
        monitor.watched_group(timeout_s=0)


def test_a_rank_slower_at_every_check_is_a_straggler_and_one_slow_once_is_not():
    rows = [[10.0, 11.0, 30.0, 9.0]] * 8
    assert monitor.stragglers(rows, 1.5) == (2,)
    assert monitor.stragglers(rows[:7] + [[10.0, 11.0, 12.0, 9.0]], 1.5) == ()
    alarm, found = monitor.DivergenceAlarm(straggler_checks=8), []
    for step in range(1, 12):
        found += alarm.judge(step, [0, 1, 2, 3], [1.0, 1.1, 1.2, 1.3], [2.0] * 4, [NAN] * 4,
                             [0.010, 0.011, 0.030 if step > 2 else 0.010, 0.009])
    assert [(a.step, a.kind, a.ranks) for a in found] == [(10, "straggler", (2,))]
    assert found[0].message.startswith("step 10: rank 2: a straggler, every other rank waits for it (its own work 2.86x")
    two = monitor.DivergenceAlarm(straggler_checks=2)
    assert not [a for step in (1, 2, 3) for a in two.judge(step, [0, 1], [1.0, 1.1], [2.0] * 2, [NAN] * 2,
                                                             [0.01, 0.05])]  # two ranks: no median to beat
    with pytest.raises(ValueError, match="straggler_ratio"):
        monitor.DivergenceAlarm(straggler_ratio=1.0)


def test_the_summary_keeps_each_tags_minimum_mean_maximum_and_the_rank_of_the_maximum():
    summary = monitor.summarize({0: {"loss": 2.0, "step_ms": 30.0}, 1: {"loss": 2.4, "step_ms": 31.0},
                                 2: {"loss": 1.9, "step_ms": 30.5}})
    assert summary["min"] == {"loss": 1.9, "step_ms": 30.0} and summary["max"] == {"loss": 2.4, "step_ms": 31.0}
    assert summary["mean"]["loss"] == pytest.approx(2.1) and summary["rank_of_max"] == {"loss": 1, "step_ms": 1}
    broken = monitor.summarize({0: {"loss": 2.0}, 1: {"loss": NAN}})
    assert all(math.isnan(broken[name]["loss"]) for name in ("min", "mean", "max"))  # a NaN is not averaged away


def _records(calls: dict[int, list[str]], group: str = "1") -> dict[int, dict]:
    return {rank: {"entries": [{"process_group": (group, "undefined"), "collective_seq_id": seq, "is_p2p": False,
                                "profiling_name": op} for seq, op in enumerate(ops, start=1)]}
            for rank, ops in calls.items()}


def test_the_hang_report_names_the_first_collective_a_rank_never_called_or_called_as_another():
    reduce, broadcast = "gloo:all_reduce", "gloo:broadcast"
    found = monitor.hang_report(_records({0: [reduce] * 5, 1: [reduce] * 5, 2: [reduce] * 4, 3: [reduce] * 5}))
    assert (found.group, found.seq, found.absent) == ("1", 5, (2,))
    assert found.message == ("collective #5 of process group 1: ranks 0, 1, 3 called it (gloo:all_reduce) and wait; "
                             "rank 2 never did")
    mismatch = monitor.hang_report(_records({0: [reduce, reduce], 1: [reduce, broadcast]}))
    assert (mismatch.seq, mismatch.absent, mismatch.ops) == (2, (), {0: reduce, 1: broadcast})
    assert monitor.hang_report(_records({0: [reduce] * 3, 1: [reduce] * 3})) is None


def _skips_one_all_reduce() -> tuple[bool, dict]:
    import torch
    import torch.distributed as torch_dist

    group = monitor.watched_group(timeout_s=1.0)
    tensor = torch.ones(2)
    try:
        for step in range(3):
            if not (torch_dist.get_rank() == 1 and step == 1):
                torch_dist.all_reduce(tensor, group=group)
        failed = False
    except RuntimeError:
        failed = True
    return failed, monitor.flight_record()


def test_torchs_flight_recorder_on_a_hung_gloo_group_names_the_missing_rank():
    from labkit.launch import launch

    results = launch(_skips_one_all_reduce, nprocs=3, rank_output="none", timeout=60)
    assert [failed for failed, _ in results] == [True, False, True]
    found = monitor.hang_report({rank: record for rank, (_, record) in enumerate(results)})
    assert (found.seq, found.absent, set(found.ops.values())) == (3, (1,), {"gloo:all_reduce"})


def test_faults_corrupt_only_their_batch_and_a_cpu_has_no_peak():
    import torch

    inputs, targets = torch.zeros(4, 3), torch.arange(4)
    assert torch.equal(monitor.corrupt("data", 1, inputs, targets)[1], torch.tensor([3, 0, 1, 2]))
    poisoned, _ = monitor.corrupt("nan", monitor.NAN_STEP, inputs, targets)
    assert math.isinf(poisoned[0, 0]) and inputs.isfinite().all()  # a copy: the loader's tensor is untouched
    assert monitor.corrupt("nan", monitor.NAN_STEP + 1, inputs, targets)[0] is inputs
    with pytest.raises(ValueError, match="tiny-mlp"):
        monitor.corrupt("nan", monitor.NAN_STEP, torch.zeros(2, 3, dtype=torch.long), targets)
    assert monitor.gpu_peak_flops(torch.device("cpu")) is None


def test_on_a_gpu_the_trainers_step_logs_peak_and_reserved_memory_and_mfu_against_the_gpus_peak(monkeypatch, tmp_path):
    """No GPU here: the GPU's answers are stood in for (an H100 by name, its allocator's two numbers), and the step's
    scalars read back from TensorBoard's files."""
    import torch

    from labkit.costmodel.hardware import GPUS
    from labkit.monitor import training

    monkeypatch.setattr(training.dist, "device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 4 * 2**30)
    watch = monitor.TrainingMonitor(tmp_path, alarm_every=0, group=None, replicated=True)
    assert watch.peak == GPUS["H100 80GB"].peak_bf16_flops
    watch.record(1, torch.nn.Linear(2, 2), loss=1.0, lr=1e-3, grad_norm=0.5, step_s=0.5, busy_s=0.4,
                 data_wait_s=0.01, comm_bytes=0, tokens=1024, flops=1e14)
    watch.close()
    scalars = monitor.read_scalars(tmp_path)[0]
    assert set(scalars) == set(monitor.TAGS) | set(monitor.GPU_TAGS)
    assert scalars["memory_reserved_bytes"] == [(1, 4 * 2**30)] and scalars["peak_memory_bytes"] == [(1, 3 * 2**30)]
    assert scalars["mfu"][0][1] == pytest.approx(1e14 / 0.5 / 989e12, rel=1e-6)
    assert scalars["tflops"][0][1] == pytest.approx(200.0) and scalars["busy_ms"][0][1] == pytest.approx(400.0)
