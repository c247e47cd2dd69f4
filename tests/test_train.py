"""python -m labkit.train: single, ddp with forked ranks, ddp under torchrun, checkpoints, bad flags."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from labkit import checkpoint, train
from labkit.launch import launch
from tests.conftest import REPO


def test_single_process_training_reduces_the_loss(capsys):
    assert train.main(["--model", "tiny-mlp", "--steps", "40", "--log-every", "20"]) == 0
    out = capsys.readouterr().out
    assert "single on 1 rank(s)" in out and "step    40/40" in out
    result = train.train(train.TrainConfig(model="tiny-mlp", steps=40, log_every=40))
    assert result["losses"][-1] < 0.5 * result["losses"][0]


def test_ddp_on_forked_ranks_keeps_replicas_identical_and_rank_zero_saves_once(tmp_path, capsys):
    code = train.main(["--strategy", "ddp", "--nprocs", "3", "--model", "tiny-mlp", "--steps", "10",
                       "--log-every", "5", "--checkpoint-dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert code == 0
    assert "ddp on 3 rank(s) (gloo, cpu)" in out and "replicas identical: yes" in out
    assert "per rank:" in out  # every rank's loss is gathered to rank 0
    assert out.count("checkpoint saved") == 1
    saved = checkpoint.latest(tmp_path / "run")
    state = checkpoint.read_file(saved, checkpoint.STATE)
    assert state["step"] == 10 and state["extra"]["config"]["strategy"] == "ddp" and len(state["ranks"]) == 3
    assert not any(name.startswith("module.") for name in state["model"])  # the unwrapped model's keys
    assert not list(tmp_path.glob("run/*/.*.partial"))


@pytest.mark.parametrize("strategy, layout", [("ddp", "full"), ("fsdp", "sharded")])
def test_a_run_resumed_from_a_checkpoint_continues_bit_for_bit(strategy, layout, tmp_path):
    straight = train.TrainConfig(strategy=strategy, steps=8, log_every=8)
    first = train.TrainConfig(strategy=strategy, steps=8, log_every=8, checkpoint_dir=str(tmp_path), save_every=4,
                              checkpoint_layout=layout)
    expected = launch(train.train, straight, nprocs=2, rank_output="none")
    launch(train.train, first, nprocs=2, rank_output="none")
    resumed = train.TrainConfig(strategy=strategy, steps=8, log_every=8,
                                resume=str(checkpoint.step_directory(tmp_path, 4)))
    again = launch(train.train, resumed, nprocs=2, rank_output="none")
    for rank in range(2):
        assert again[rank]["losses"] == expected[rank]["losses"][4:]
        assert again[rank]["checksum"] == expected[rank]["checksum"]


def test_resume_latest_starts_fresh_without_a_checkpoint_and_continues_from_the_newest(tmp_path, capsys):
    flags = ["--model", "tiny-mlp", "--steps", "6", "--log-every", "6", "--checkpoint-dir", str(tmp_path),
             "--save-every", "3", "--resume", "latest"]
    assert train.main(flags) == 0
    assert "no checkpoint in" in capsys.readouterr().out
    assert checkpoint.latest(tmp_path) == checkpoint.step_directory(tmp_path, 6)
    assert train.main([*flags[:3], "9", *flags[4:]]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "step-00000006 at step 6" in out and "step     9/9" in out
    assert train.main([*flags[:3], "9", *flags[4:]]) == 0
    assert "nothing to train" in capsys.readouterr().out


def test_torchrun_restarts_a_killed_rank_from_the_last_checkpoint_and_ends_where_an_unbroken_run_does(tmp_path):
    """Elastic: rank 1 is SIGKILLed at step 8 in the first attempt; torchrun restarts both ranks, which resume
    from step 6 (--resume latest) and finish with the uninterrupted run's final loss, to the printed digit."""
    def run(directory, kill):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                   "--max-restarts=2", "-m", "labkit.train", "--strategy", "ddp", "--model", "tiny-mlp", "--steps",
                   "12", "--log-every", "12", "--checkpoint-dir", str(directory), "--save-every", "3", "--resume",
                   "latest"]
        environment = {**os.environ, "OMP_NUM_THREADS": "1"}
        if kill:
            environment["LABKIT_TRAIN_KILL"] = "1:8"
        completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=environment)
        assert completed.returncode == 0, completed.stderr[-3000:]
        return completed.stdout

    unbroken, broken = run(tmp_path / "a", kill=False), run(tmp_path / "b", kill=True)
    assert "resumed from" not in unbroken and "step-00000006 at step 6" in broken
    # One restart is enough: the restarted ranks meet under a prefix of their own in torchrun's store, not at the
    # dead attempt's addresses (which used to fail the first restart now and then with "Connection refused").
    assert broken.count("resumed from") == 1, broken
    final = [line for line in (unbroken + "\n" + broken).splitlines() if line.startswith("done: final loss")]
    assert len(final) == 2 and final[0] == final[1].replace(final[1].split(";")[1], final[0].split(";")[1]), final


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
               "--checkpoint-dir", str(tmp_path / "c")]
    completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.count("ddp on 2 rank(s)") == 1  # rank 0 prints, rank 1 does not
    assert "replicas identical: yes" in completed.stdout
    assert checkpoint.latest(tmp_path / "c") is not None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--strategy", "fsdp9"], "--strategy must be one of"),
        (["--model", "resnet"], "--model must be one of"),
        (["--preset", "7b"], "unknown preset"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--lr", "-1"], "--lr must be a finite number > 0, got -1.0"),
        (["--bucket-cap-mb", "-2"], "--bucket-cap-mb must be a finite number >= 0, got -2.0"),
        (["--nprocs", "0"], "--nprocs must be >= 1"),
        (["--save-every", "5"], "--save-every must be >= 1 and needs --checkpoint-dir"),
        (["--resume", "latest"], "--resume latest needs --checkpoint-dir"),
        (["--checkpoint-layout", "zip"], "--checkpoint-layout must be one of"),
        (["--resume", "/no/such/dir"], "--resume /no/such/dir: no such checkpoint directory"),
    ],
)
def test_bad_flags_exit_with_a_message_before_any_process_starts(flags, message, capsys):
    assert train.main(flags) == 2
    assert message in capsys.readouterr().err
