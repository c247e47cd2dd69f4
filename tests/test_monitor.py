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
