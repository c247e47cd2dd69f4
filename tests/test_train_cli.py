"""The trainer and the ``labkit`` command as a new user meets them (issue 26): every figure they print is right, every
bad input is one line and an exit status before anything starts, a failure inside a rank is one line naming the
rank, a stop says where the last checkpoint is, and nothing is left behind."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labkit import checkpoint, cli, train
from labkit.train import report
from tests.conftest import REPO

TRAIN = [sys.executable, "-m", "labkit.train"]


def _run(*flags: str, timeout: float = 240, **environment: str) -> subprocess.CompletedProcess:
    """``python -m labkit.train FLAGS`` as a user runs it: what it prints, and its exit status."""
    return subprocess.run([*TRAIN, *flags], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **environment})


def _ms_per_step(text: str) -> list[float]:
    return [float(value) for value in re.findall(r"\| ([\d.]+) ms/step", text)]


# --------------------------------------------------------------------------------------------------------
# Figures


def test_progress_after_a_resume_times_only_the_steps_it_ran(tmp_path, capsys):
    """Resumed at step 30 of 33, the progress line divided the 3 steps' time by 33: 11 times too fast."""
    flags = ["--model", "tiny-mlp", "--log-every", "100", "--checkpoint-dir", str(tmp_path)]
    assert train.main([*flags, "--steps", "30"]) == 0
    capsys.readouterr()
    assert train.main([*flags, "--steps", "33", "--resume", "latest"]) == 0
    out = capsys.readouterr().out
    progress = _ms_per_step(out)[-1]
    final = float(re.search(r"; ([\d.]+) ms/step; replicas", out).group(1))
    # Two timings of 3 steps a few ms long each, taken around different work, beside other tests: a wide band,
    # which the bug (1/11) still leaves.  The division itself is checked exactly on the next lines.
    assert 0.2 < progress / final < 5, out
    line = report.progress_line(220, 200, 400, [2.0], None, 1.0, {})
    assert "step   220/400" in line and line.endswith("| 50.0 ms/step")  # 1 s over 20 steps


def test_a_loss_below_the_floor_is_called_noise_not_a_negative_distance_above_it():
    below = report.progress_line(10, 0, 20, [1.245, 1.245], 1.249, 1.0, {})
    assert "0.004 below the floor (one batch's noise)" in below and "-0.004" not in below
    assert "+0.051 above the floor" in report.progress_line(10, 0, 20, [1.3], 1.249, 1.0, {})


@pytest.mark.parametrize("flags", [["--strategy", "fsdp"], ["--strategy", "zero2"], ["--tp", "2"]])
def test_every_strategy_reports_the_whole_models_parameters(flags, capsys):
    """FSDP (and tensor parallelism) counted the parameters after sharding: half the model on 2 ranks."""
    assert train.main(["--steps", "1", *flags, "--nprocs", "2"]) == 0
    assert "tiny-gpt 117,792 parameters" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------------------
# Bad input: one line, exit status 2, nothing started


def _dead_pid() -> int:
    """The pid of a process that has exited."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--checkpoint-dir", "{file}", "--resume", "latest"], "--checkpoint-dir {file}: a file, not a directory"),
        (["--checkpoint-dir", "{file}/run"], "--checkpoint-dir {file}/run: cannot be made, {file} is a file"),
        (["--log-dir", "{file}"], "--log-dir {file}: a file, not a directory"),
        (["--trace", "{dir}"], "--trace {dir}: a directory; give the trace's file name"),
        (["--strategy", "ddp", "--schedule", "nonsense"], "--schedule must be one of gpipe, 1f1b, interleaved, zb-h1, "
                                                         "interleaved-zb, zb-v, dualpipev, got 'nonsense'"),
        (["--tp", "1", "--zero", "7"], "--zero must be one of (0, 1, 2, 3)"),
        (["--resume", "{dir}"], "--resume {dir}: {dir}/manifest.json: missing"),
    ],
)
def test_bad_files_and_values_are_one_line_before_anything_starts(flags, message, tmp_path, capsys):
    (tmp_path / "afile").write_text("not a directory")
    names = {"file": str(tmp_path / "afile"), "dir": str(tmp_path)}
    assert train.main([flag.format(**names) for flag in flags] + ["--steps", "2"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("labkit.train: ")
    assert message.format(**names) in err


@pytest.mark.parametrize(("flags", "message"), [
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),  # trained to NaN from step 2
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
    (["--lr", "-0.1"], "--lr must be a finite number > 0, got -0.1"),
    (["--clip-grad-norm", "inf"], "--clip-grad-norm must be a finite number > 0, got inf"),
    (["--clip-grad-norm", "0"], "--clip-grad-norm must be a finite number > 0, got 0.0"),
    (["--data-ms", "inf"], "--data-ms must be a finite number >= 0, got inf"),  # every sample forever
    (["--experts", "4", "--capacity-factor", "inf"], "capacity_factor must be a finite number > 0"),
    (["--experts", "4", "--aux-loss-weight", "inf"], "aux_loss_weight must be a finite number >= 0"),
])
def test_a_number_flag_that_is_not_finite_or_in_range_is_refused_before_anything_starts(flags, message, capsys):
    assert train.main([*flags, "--steps", "2"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and message in err


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_a_bucket_size_that_is_not_finite_and_non_negative_is_refused_before_the_ranks_start(value, capsys):
    """``--bucket-cap-mb nan`` passed the checks and failed inside both ranks (DistributedDataParallel's own)."""
    assert train.main(["--strategy", "ddp", "--bucket-cap-mb", value, "--steps", "2"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"labkit.train: --bucket-cap-mb must be a finite number >= 0, got {float(value)}\n"
    config, _ = train.parse_arguments(["--strategy", "ddp", "--bucket-cap-mb", "0"])  # 0: one all-reduce a tensor
    assert config.bucket_cap_mb == 0


def test_the_readme_expert_parallel_example_forks_as_many_ranks_as_its_degrees(monkeypatch):
    """README's ``--dp 4 --ep 4 --experts 8 ...`` was refused for a missing --nprocs: the degrees given say how
    many ranks (dp x cp x tp x pp; ep folded over dp x cp adds none).  --nprocs or torchrun's WORLD_SIZE that
    disagrees with them is refused, and so is a 3D run without --dp (dp is what the others leave of the ranks)."""
    line = next(line for line in (REPO / "README.md").read_text().splitlines() if " --dp 4 --ep 4 " in line)
    flags = line.split("-m labkit.train ")[1].split()
    config, nprocs = train.parse_arguments([*flags, "--steps", "2"])
    assert (nprocs, config.dp, config.ep, config.tp, config.pp, config.cp) == (4, 4, 4, 1, 1, 1)
    assert train.parse_arguments(["--dp", "2", "--cp", "2", "--steps", "2"])[1] == 4
    assert train.parse_arguments(["--dp", "2", "--tp", "2", "--pp", "2", "--steps", "2"])[1] == 8
    with pytest.raises(ValueError, match=r"4 \* 1 \* 1 = 4, but there are 2"):
        train.parse_arguments([*flags, "--nprocs", "2"])
    with pytest.raises(ValueError, match="a 3D run without --dp needs --nprocs N"):
        train.parse_arguments(["--tp", "2", "--ep", "2", "--experts", "4"])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")  # under torchrun the world is WORLD_SIZE
    with pytest.raises(ValueError, match=r"4 \* 1 \* 1 = 4, but there are 8"):
        train.parse_arguments(flags)


def test_a_sharded_checkpoint_missing_or_short_of_a_file_is_refused_before_the_ranks_start(tmp_path, capsys):
    """A lost shard was found by the rank that read it, after every rank had started: the manifest lists every
    file with its size, and one ``stat`` each finds it before."""
    flags = ["--model", "tiny-mlp", "--checkpoint-layout", "sharded", "--checkpoint-dir", str(tmp_path)]
    assert train.main([*flags, "--steps", "2"]) == 0
    capsys.readouterr()
    shard = checkpoint.step_directory(tmp_path, 2) / checkpoint.shard_file(0, 1)
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:100])
    assert train.main([*flags, "--steps", "3", "--resume", "latest"]) == 2
    assert (f"--resume latest: {shard}: truncated or overwritten: 100 bytes, the manifest says {size:,}"
            in capsys.readouterr().err)
    shard.unlink()
    assert train.main([*flags, "--steps", "3", "--resume", "latest"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"labkit.train: --resume latest: {shard}: missing (the manifest lists it, {size:,} bytes)\n"


@pytest.mark.skipif(os.access("/proc/sys", os.W_OK), reason="needs a folder this user cannot write")
def test_a_checkpoint_directory_that_cannot_be_written_is_refused_before_training(capsys):
    assert train.main(["--checkpoint-dir", "/proc/sys/labkit-run", "--steps", "2"]) == 2
    assert "--checkpoint-dir /proc/sys/labkit-run: /proc/sys is not writable" in capsys.readouterr().err


def test_a_disk_too_full_for_one_checkpoint_is_refused_before_training(tmp_path, monkeypatch, capsys):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1_000_000))
    assert train.main(["--checkpoint-dir", str(tmp_path / "run"), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    # 117,792 parameters x 12 bytes (fp32 weights and AdamW's two moments) = 1.3 MiB
    assert "its disk has 1.0 MiB free, and one checkpoint of this model takes about 1.3 MiB" in err
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_of_another_model_or_world_size_is_refused_before_training(tmp_path, capsys):
    """These used to fail inside every rank, as a 30-line double traceback."""
    assert train.main(["--strategy", "ddp", "--nprocs", "2", "--steps", "2", "--checkpoint-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    saved = checkpoint.step_directory(tmp_path, 2)
    for flags, message in [(["--nprocs", "2", "--preset", "1m"], "a different model shape: token_embedding.weight "
                                                                 "is (32, 48) in the checkpoint, (32, 144) here"),
                           (["--nprocs", "3"], "saved on 2 rank(s), loading on 3")]:
        assert train.main(["--strategy", "ddp", "--steps", "4", "--resume", str(saved), *flags]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and f"--resume {saved}: " in err and message in err


@pytest.mark.parametrize(("saved", "resumed"), [
    (["--strategy", "fsdp", "--checkpoint-layout", "sharded", "--nprocs", "2"],
     ["--strategy", "fsdp", "--checkpoint-layout", "sharded", "--nprocs", "3"]),  # resharded: allowed
    (["--pp", "2", "--zero", "3", "--nprocs", "2"], ["--pp", "2", "--zero", "3", "--nprocs", "2"]),  # untied head
])
def test_the_checks_before_a_resume_let_every_resumable_checkpoint_through(saved, resumed, tmp_path, capsys):
    """The shapes come from a model built on the meta device: they must match what every wrapper saves."""
    assert train.main([*saved, "--steps", "2", "--checkpoint-dir", str(tmp_path)]) == 0
    assert train.main([*resumed, "--steps", "3", "--checkpoint-dir", str(tmp_path), "--resume", "latest"]) == 0
    assert "at step 2" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------------------
# plan, bench, doctor


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpus", "0"], "--gpus must be an integer >= 1, got 0"),
        (["--global-batch", "0"], "--global-batch must be an integer >= 1, got 0"),
        (["--top", "0"], "--top must be an integer >= 1, got 0"),  # was an IndexError
        (["--efficiency", "1.5"], "--efficiency must be a fraction of the peak in (0, 1], got 1.5"),
        (["--gpu", "TPU"], "--gpu 'TPU' is unknown; choose one of A100 80GB"),
        (["--model", "gpt5"], "--model 'gpt5' is unknown; choose one of deepseek-v3, gpt2"),
    ],
)
def test_labkit_plan_names_the_flag_a_bad_value_came_from(flags, message, capsys):
    assert cli.main(["plan", *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("labkit plan: ") and message in err


def test_labkit_plan_explains_its_columns_and_keeps_a_memory_margin_with_one_row_per_layout(capsys):
    assert cli.main(["plan", "--model", "gpt2", "--gpus", "3", "--global-batch", "7", "--top", "20"]) == 0
    out = capsys.readouterr().out
    assert "plans fill at most 72 of 80 GB a GPU, keeping 10% for what the memory model does not count" in out
    rows = [line for line in out.splitlines() if line.startswith("dp=")]
    assert rows and all(row.startswith("dp=1 ") for row in rows)  # 3 GPUs, 7 sequences: no data parallelism
    layouts = [row.split("  ")[0].strip() for row in rows]
    assert len(set(layouts)) == len(layouts)  # at dp = 1 the ZeRO stages are one layout, listed once
    assert all(" ZeRO-0 " in layout for layout in layouts)
    for column, _meaning in cli.PLAN_COLUMNS:
        if column not in ("cp", "ep"):  # explained only when a plan uses them (test_costmodel_context/_experts.py)
            assert re.search(rf"^ *{re.escape(column)}  ", out, re.MULTILINE), column
    assert not re.search(r"^ *cp  ", out, re.MULTILINE) and not re.search(r"^ *ep  ", out, re.MULTILINE)
    assert "b: the micro-batch, in sequences" in out and "in seconds" in out and "in GB" in out


def _benchmarks(folder: Path, **scripts: str) -> Path:
    folder.mkdir()
    for name, body in scripts.items():
        (folder / f"bench_{name}.py").write_text(body)
    return folder


def test_labkit_bench_exits_non_zero_when_a_target_is_missed_unless_told_to_report_only(tmp_path, monkeypatch,
                                                                                           capsys):
    folder = _benchmarks(tmp_path / "benchmarks", met="print('PASS: ratio 0.9x (target <= 1.0)')",
                         missed="print('table')\nprint('   FAIL: labkit / torch = 1.4x (target <= 1.0)')",
                         crashed="raise SystemExit(3)")
    monkeypatch.setattr(cli, "_benchmarks_folder", lambda: folder)
    assert cli.main(["bench", "met"]) == 0
    assert "every target met (1 benchmark(s))" in capsys.readouterr().out
    assert cli.main(["bench", "met", "missed"]) == 1
    out = capsys.readouterr().out
    assert "1 target(s) missed:\n  missed: FAIL: labkit / torch = 1.4x (target <= 1.0)" in out
    assert cli.main(["bench", "--report-only", "met", "missed"]) == 0
    assert "(--report-only: not an error)" in capsys.readouterr().out
    assert cli.main(["bench", "--report-only", "crashed"]) == 1  # a benchmark that fails is never a report
    assert "crashed: exited with code 3" in capsys.readouterr().err


def test_every_benchmark_states_its_targets_as_the_pass_fail_lines_labkit_bench_reads():
    for script in sorted((REPO / "benchmarks").glob("bench_*.py")):
        text = script.read_text()
        if "TARGET" in text:
            assert re.search(r"['\"]PASS['\"] if", text) and re.search(r"['\"]FAIL['\"]", text), script.name


# --------------------------------------------------------------------------------------------------------
# Failures inside ranks, stops, leftovers


def test_an_error_inside_a_rank_reaches_the_user_as_one_line_naming_the_rank(tmp_path):
    run = str(tmp_path / "run")
    assert _run("--strategy", "ddp", "--nprocs", "2", "--model", "tiny-mlp", "--steps", "2",
                "--checkpoint-dir", run).returncode == 0
    state = checkpoint.step_directory(run, 2) / checkpoint.STATE
    corrupted = bytearray(state.read_bytes())
    corrupted[-100] ^= 1
    state.write_bytes(bytes(corrupted))
    flags = ("--strategy", "ddp", "--nprocs", "2", "--model", "tiny-mlp", "--steps", "4", "--checkpoint-dir", run,
             "--resume", "latest", "--log-dir", str(tmp_path / "logs"))
    failed = _run(*flags)
    assert failed.returncode == 1
    assert "Traceback" not in failed.stdout + failed.stderr
    lines = failed.stderr.splitlines()
    assert len(lines) == 1, failed.stderr
    assert re.match(r"labkit\.train: rank [01] failed: CheckpointError: .*state\.pt: corrupted: its SHA-256 differs",
                    lines[0])
    kept = Path(re.search(r"its traceback: (\S+)\)", lines[0]).group(1))
    assert kept.parent == tmp_path / "logs" and "Traceback (most recent call last)" in kept.read_text()
    shown = _run(*flags, "--traceback")  # the whole traceback on request, the one line last
    assert shown.returncode == 1 and "Traceback (most recent call last)" in shown.stderr
    assert shown.stderr.splitlines()[-1].startswith("labkit.train: rank ")


def test_a_killed_rank_is_one_line_and_names_the_checkpoint_to_resume_from(tmp_path):
    failed = _run("--strategy", "ddp", "--nprocs", "2", "--model", "tiny-mlp", "--steps", "12", "--checkpoint-dir",
                  str(tmp_path), "--save-every", "4", LABKIT_TRAIN_KILL="1:6")
    assert failed.returncode == 1
    assert failed.stderr.splitlines() == [
        f"labkit.train: rank 1 failed: the process was killed by SIGKILL before it could report (exit code -9) "
        f"(rank(s) 0 failed too); the last checkpoint is {checkpoint.step_directory(tmp_path, 4)} (--resume latest "
        "continues from it)"]


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds the ranks through /proc")
def test_sigterm_says_what_happened_and_where_the_last_checkpoint_is(tmp_path):
    run = str(tmp_path / "run")
    process = subprocess.Popen([*TRAIN, "--strategy", "ddp", "--nprocs", "2", "--model", "tiny-mlp", "--steps",
                                "1000000", "--log-every", "1000000", "--checkpoint-dir", run, "--save-every", "5"],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while checkpoint.latest(run) is None and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.2)
        assert checkpoint.latest(run) is not None
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGTERM
    line = err.splitlines()[-1]
    assert line.startswith(f"labkit.train: stopped by SIGTERM; every rank was stopped; the last checkpoint is {run}/"
                           "step-"), err
    newest = Path(line.split("the last checkpoint is ")[1].split(" ")[0])
    assert (newest / checkpoint.MANIFEST).is_file()
    deadline = time.monotonic() + 10
    while _processes_mentioning(run) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_mentioning(run) == []


def test_the_next_run_removes_what_a_killed_save_left_and_says_so(tmp_path, capsys):
    unfinished = tmp_path / "step-00000004"  # a save killed mid-write: a temporary file, no manifest
    unfinished.mkdir()
    here, dead = socket.gethostname(), _dead_pid()
    stale = [unfinished / f".state.pt.pid{dead}@{here}.partial", tmp_path / f".state.pt.{dead}.partial"]
    kept = [unfinished / f".state.pt.pid{os.getpid()}@{here}.partial",  # a writer still alive
            unfinished / f".state.pt.pid{dead}@another-host.partial"]  # on a machine whose processes we cannot see
    for file in stale + kept:
        file.write_bytes(b"x" * 2048)
    assert checkpoint.stale_partial_files(tmp_path) == sorted(stale)
    assert train.main(["--model", "tiny-mlp", "--steps", "2", "--checkpoint-dir", str(tmp_path), "--resume",
                       "latest"]) == 0
    out = capsys.readouterr().out
    for file in stale:
        assert not file.exists() and f"removed {file} (0.0 MiB), left by a save whose process was killed" in out
    assert all(file.exists() for file in kept)


def test_checkpoint_writes_name_their_writer_so_a_later_run_can_tell_a_dead_one(tmp_path, monkeypatch):
    seen = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda source, target: (seen.append(Path(source).name),
                                                               real_replace(source, target)))
    checkpoint.write_atomically(tmp_path / "state.pt", b"data")
    assert seen == [f".state.pt.pid{os.getpid()}@{socket.gethostname()}.partial"]
    assert checkpoint.PARTIAL.match(seen[0])


@pytest.mark.parametrize(("text", "expected"), [
    ('Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n    f()\n'
     "labkit.checkpoint.files.CheckpointError: run/step-2/state.pt: corrupted\n",
     "CheckpointError: run/step-2/state.pt: corrupted"),
    ("Traceback (most recent call last):\n  ...\nRuntimeError: Error(s) in loading state_dict:\n\tsize mismatch for w\n",
     "RuntimeError: Error(s) in loading state_dict:"),  # a message of several lines: its first
    ("Traceback (most recent call last):\n  ...\nAssertionError\n", "AssertionError"),
    ("the process was killed by SIGKILL before it could report (exit code -9)",
     "the process was killed by SIGKILL before it could report (exit code -9)"),
])
def test_a_failures_headline_is_its_exception_without_the_module_path(text, expected):

    assert report.headline(text) == expected


def test_stored_benchmark_reads_a_kept_output_and_names_a_missing_one(tmp_path, monkeypatch):
    """Lesson 12 prints bench_input's kept output; a benchmark with none is named, with how to make it."""
    lines = cli.stored_benchmark("bench_input")
    assert lines[0].startswith("# benchmarks/bench_input.py, run ") and any("false alarm" in line for line in lines)
    monkeypatch.setattr(cli, "_benchmarks_folder", lambda: tmp_path)
    with pytest.raises(FileNotFoundError, match="bench_nothing.*python benchmarks/bench_nothing.py"):
        cli.stored_benchmark("bench_nothing")
