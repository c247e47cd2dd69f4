"""labkit.train's monitoring: every rank's scalars in TensorBoard, and the divergence alarm silent on healthy runs
of every strategy and naming the rank (and the step) of each misconfiguration it is shown."""

from __future__ import annotations

import pytest

from labkit import monitor, train
from labkit.launch import launch


def trained(monkeypatch, fault: str | None = None, nprocs: int = 4, **settings) -> list[dict]:
    if fault is None:
        monkeypatch.delenv(monitor.FAULT_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(monitor.FAULT_VARIABLE, fault)  # the forked ranks inherit it
    config = train.TrainConfig(**{"strategy": "ddp", "model": "tiny-mlp", "steps": 4, "log_every": 100, **settings})
    config.validate()
    return launch(train.train, config, nprocs=nprocs, rank_output="none")


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_the_alarm_stays_silent_on_a_healthy_run_of_every_strategy(monkeypatch, strategy):
    results = trained(monkeypatch, strategy=strategy, steps=48)  # the loss band judges from check 32 on
    assert [result["alarms"] for result in results] == [[]] * 4


def test_the_alarm_stays_silent_on_a_healthy_3d_run(monkeypatch):
    results = trained(monkeypatch, strategy="single", model="tiny-gpt", dp=2, tp=1, pp=2, steps=3, batch_size=4)
    assert [result["alarms"] for result in results] == [[]] * 4


@pytest.mark.parametrize("fault, strategy, steps, expected", [
    ("seed:2", "ddp", 2, "step 1: rank 2: parameter fingerprint differs from the other ranks'"),
    ("lr:1", "ddp", 2, "step 1: rank 1: parameter fingerprint differs from the other ranks'"),
    ("shard:3", "ddp", 3, "step 2: ranks 0 and 3 report the same loss, to the bit, 2 checks running"),
    ("no-reduce", "ddp", 2, "step 1: the ranks disagree on the gradient norm"),
    ("data:1", "fsdp", 40, ": rank 1: loss departs from the other ranks' mean"),
])
def test_the_alarm_names_the_rank_and_the_step_of_each_misconfiguration(monkeypatch, fault, strategy, steps,
                                                                         expected):
    results = trained(monkeypatch, fault, strategy=strategy, steps=steps)
    alarms = results[0]["alarms"]
    assert alarms and expected in alarms[0], alarms
    assert all(result["alarms"] == alarms for result in results)  # every rank knows


def test_every_ranks_scalars_reach_tensorboard_and_the_alarm_prints_on_rank_zero(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(monitor.FAULT_VARIABLE, "seed:1")
    assert train.main(["--strategy", "ddp", "--nprocs", "2", "--model", "tiny-mlp", "--steps", "5",
                       "--log-every", "5", "--tensorboard", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("labkit.train: ALARM step 1: the ranks disagree on the parameter fingerprint") == 1, out
    scalars = monitor.read_scalars(tmp_path)
    assert sorted(scalars) == [0, 1]
    for rank in (0, 1):
        assert set(scalars[rank]) == {*monitor.TAGS, "alarm/parameters"}  # CPU: no GPU memory, no MFU
        for tag in monitor.TAGS:
            assert [step for step, _ in scalars[rank][tag]] == [1, 2, 3, 4, 5], tag
        assert all(value > 0 for _, value in scalars[rank]["comm_bytes"])
        flops = train.model_flops(train.TrainConfig(model="tiny-mlp"))  # per rank: the model FLOPs over the step
        for (_, tflops), (_, step_ms) in zip(scalars[rank]["tflops"], scalars[rank]["step_ms"], strict=True):
            assert tflops == pytest.approx(flops / (step_ms / 1e3) / 1e12, rel=1e-5)  # event files hold float32
    assert scalars[0]["loss"] != scalars[1]["loss"]  # two replicas apart: two curves


def test_a_nan_on_one_rank_is_named_where_it_starts_and_reaches_every_rank_a_step_later(monkeypatch):
    results = trained(monkeypatch, "nan:1", steps=5)
    finite = [[result["losses"][step] == result["losses"][step] for result in results] for step in range(5)]
    assert finite == [[True] * 4] * 2 + [[True, False, True, True]] + [[False] * 4] * 2
    assert [alarm.split(" (")[0] for alarm in results[0]["alarms"]] == [
        "step 3: rank 1: the loss is not finite", "step 4: rank 0, rank 1, rank 2, rank 3: the loss is not finite"]


def test_a_straggler_is_named_by_its_own_work_though_every_ranks_step_takes_as_long(monkeypatch, tmp_path):
    results = trained(monkeypatch, "slow:2", steps=12, tensorboard=str(tmp_path))
    assert results[0]["alarms"][0].startswith("step 8: rank 2: a straggler"), results[0]["alarms"]
    scalars = monitor.read_scalars(tmp_path)
    work = {rank: sum(value for _, value in scalars[rank]["busy_ms"][4:]) for rank in range(4)}
    wall = {rank: sum(value for _, value in scalars[rank]["step_ms"][4:]) for rank in range(4)}
    assert max(work, key=work.get) == 2 and work[2] > 3 * max(work[rank] for rank in (0, 1, 3))
    assert max(wall.values()) < 1.5 * min(wall.values())  # everybody waits for rank 2: the wall clock cannot tell


def test_the_summary_is_rank_zeros_three_runs_of_every_ranks_minimum_mean_and_maximum(monkeypatch, tmp_path):
    trained(monkeypatch, "slow:1", steps=6, tensorboard=str(tmp_path), tensorboard_ranks="summary")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["max", "mean", "min"]  # one writer, any world
    summary = monitor.read_scalars(tmp_path, runs="summary")
    assert set(summary["min"]) == set(monitor.TAGS) and set(summary["max"]) >= {f"rank_of_max/{tag}"
                                                                                 for tag in monitor.TAGS}
    for (_, low), (_, mean), (_, high) in zip(*(summary[name]["loss"] for name in ("min", "mean", "max")),
                                              strict=True):
        assert low <= mean <= high and low < high  # four batches, four losses
    assert {value for _, value in summary["max"]["rank_of_max/busy_ms"][2:]} == {1.0}  # the slow rank, by name


@pytest.mark.parametrize("flags, fault, message", [
    (["--alarm-every", "-1"], None, "--alarm-every must be an integer >= 0"),
    ([], "bogus:1", "LABKIT_TRAIN_FAULT='bogus:1': the kind must be one of"),
    ([], "seed", "give the rank, as seed:RANK"),
    ([], "no-reduce:1", "no-reduce applies to every rank"),
    (["--strategy", "single"], "seed:0", "needs a data-parallel --strategy"),
    (["--model", "tiny-gpt"], "nan:1", "nan writes an infinite feature: it needs --model tiny-mlp"),
    (["--tensorboard-ranks", "some"], None, "--tensorboard-ranks must be one of ('every', 'summary'), got 'some'"),
])
def test_bad_monitoring_settings_exit_with_a_message_before_any_process_starts(monkeypatch, capsys, flags, fault,
                                                                                message):
    if fault is not None:
        monkeypatch.setenv(monitor.FAULT_VARIABLE, fault)
    argv = ["--strategy", "ddp", "--model", "tiny-mlp", "--steps", "2", *flags]
    assert train.main(argv) == 2
    assert message in capsys.readouterr().err


def test_tensorboard_into_a_file_is_refused_naming_the_flag(tmp_path, capsys):
    target = tmp_path / "a-file"
    target.write_text("")
    assert train.main(["--model", "tiny-mlp", "--steps", "2", "--tensorboard", str(target)]) == 2
    assert "--tensorboard" in capsys.readouterr().err
