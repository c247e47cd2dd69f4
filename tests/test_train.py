"""python -m labkit.train: single, ddp with forked ranks, ddp under torchrun, checkpoints, bad flags."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from labkit import train
from labkit.launch import launch
from tests.conftest import REPO


def test_single_process_training_reduces_the_loss(capsys):
    assert train.main(["--model", "tiny-mlp", "--steps", "40", "--log-every", "20"]) == 0
    out = capsys.readouterr().out
    assert "single on 1 rank(s)" in out and "step    40/40" in out
    result = train.train(train.TrainConfig(model="tiny-mlp", steps=40, log_every=40))
    assert result["losses"][-1] < 0.5 * result["losses"][0]


def test_ddp_on_forked_ranks_keeps_replicas_identical_and_rank_zero_saves_once(tmp_path, capsys):
    checkpoint = tmp_path / "run" / "final.pt"
    code = train.main(["--strategy", "ddp", "--nprocs", "3", "--model", "tiny-mlp", "--steps", "10",
                       "--log-every", "5", "--checkpoint", str(checkpoint)])
    out = capsys.readouterr().out
    assert code == 0
    assert "ddp on 3 rank(s) (gloo, cpu)" in out and "replicas identical: yes" in out
    assert "per rank:" in out  # every rank's loss is gathered to rank 0
    assert out.count("checkpoint saved") == 1
    state = torch.load(checkpoint, weights_only=False)
    assert state["step"] == 10 and state["config"]["strategy"] == "ddp"
    assert not any(name.startswith("module.") for name in state["model"])  # the unwrapped model's keys
    assert not list(tmp_path.glob("run/*.partial"))


def test_every_strategy_trains_the_same_model_through_the_same_loop(capsys):
    """ddp, zero1, zero2 and fsdp are the same mathematics: same data, same weights after a few steps (and the
    same as each replica's checksum); only the bytes they move and hold differ."""
    results = {}
    for strategy in ("ddp", "zero1", "zero2", "fsdp"):
        config = train.TrainConfig(strategy=strategy, model="tiny-gpt", steps=4, log_every=2, clip_grad_norm=0.5)
        results[strategy] = launch(train.train, config, nprocs=2, timeout=120, rank_output="none")
    checksums = {strategy: [r["checksum"] for r in ranks] for strategy, ranks in results.items()}
    reference = checksums["ddp"][0]
    for strategy, values in checksums.items():
        assert all(abs(value - reference) < 1e-3 for value in values), (strategy, values, reference)
    losses = {strategy: ranks[0]["losses"] for strategy, ranks in results.items()}
    for strategy in losses:
        assert losses[strategy] == pytest.approx(losses["ddp"], abs=1e-4), strategy
    communication = {strategy: ranks[0]["communication"] for strategy, ranks in results.items()}
    assert set(communication["ddp"]) == {"all_reduce"} and set(communication["zero1"]) == {"all_reduce", "broadcast"}
    assert set(communication["zero2"]) == set(communication["fsdp"]) == {"reduce_scatter", "all_gather"}
    states = {strategy: ranks[0]["memory"]["optimizer_states"] for strategy, ranks in results.items()}
    assert states["zero1"] < states["ddp"] and states["zero2"] < states["ddp"] and states["fsdp"] < states["ddp"]


def test_tiny_gpt_trains_toward_the_entropy_floor(capsys):
    assert train.main(["--strategy", "ddp", "--nprocs", "2", "--steps", "30", "--log-every", "30"]) == 0
    out = capsys.readouterr().out
    assert "loss floor 1.249 nats" in out and "above the floor" in out


def test_under_torchrun_the_trainer_runs_in_place_on_each_rank(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "labkit.train", "--strategy", "ddp", "--model", "tiny-mlp", "--steps", "6", "--log-every", "3",
               "--checkpoint", str(tmp_path / "c.pt")]
    completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.count("ddp on 2 rank(s)") == 1  # rank 0 prints, rank 1 does not
    assert "replicas identical: yes" in completed.stdout
    assert (tmp_path / "c.pt").is_file()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--strategy", "fsdp9"], "--strategy must be one of"),
        (["--model", "resnet"], "--model must be one of"),
        (["--preset", "7b"], "unknown preset"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--lr", "-1"], "--lr must be positive"),
        (["--bucket-cap-mb", "-2"], "--bucket-cap-mb must be >= 0"),
        (["--nprocs", "0"], "--nprocs must be >= 1"),
    ],
)
def test_bad_flags_exit_with_a_message_before_any_process_starts(flags, message, capsys):
    assert train.main(flags) == 2
    assert message in capsys.readouterr().err
