"""labkit.launch: results, output, failure behaviour, ports, torchrun pass-through."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as torch_dist

from labkit import dist, launch
from tests.conftest import REPO, is_alive

# ---------------------------------------------------------------------------------------------------------
# Functions the ranks run (module level; launch forks, so cell-style local functions work too)


def _rank_facts():
    return {
        "rank": dist.rank(), "world_size": dist.world_size(), "local_rank": dist.local_rank(),
        "is_main": dist.is_main(), "backend": dist.backend(), "device": str(dist.device()),
        "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
        "master_addr": os.environ.get("MASTER_ADDR"),
    }


def _sum_of_ranks(offset, scale=1):
    tensor = torch.tensor([float(torch_dist.get_rank() + offset)])
    torch_dist.all_reduce(tensor)
    return tensor.item() * scale


def _fail_on(rank_to_fail, pid_dir):
    (pid_dir / f"{torch_dist.get_rank()}.pid").write_text(str(os.getpid()))
    torch_dist.barrier()  # every rank has written its pid before one of them fails
    if torch_dist.get_rank() == rank_to_fail:
        raise ValueError(f"boom on rank {rank_to_fail}")
    torch_dist.barrier()  # the healthy ranks would wait here for ever


def _die_hard(rank_to_die):
    if torch_dist.get_rank() == rank_to_die:
        os.kill(os.getpid(), signal.SIGKILL)
    torch_dist.barrier()


def _only_rank_zero_all_reduces(pid_dir):
    (pid_dir / f"{torch_dist.get_rank()}.pid").write_text(str(os.getpid()))
    if torch_dist.get_rank() == 0:
        torch_dist.all_reduce(torch.ones(3))
    return torch_dist.get_rank()


def _print_lines():
    rank = torch_dist.get_rank()
    print(f"hello from {rank}")
    print(f"second line {rank}", file=sys.stderr)
    return rank


def _return_unpicklable():
    return lambda: None


def _nested_launch():
    return launch.launch(_sum_of_ranks, 0, nprocs=99)


def _pids(pid_dir):
    return [int(path.read_text()) for path in sorted(pid_dir.glob("*.pid"))]


# ---------------------------------------------------------------------------------------------------------
# Results


@pytest.mark.parametrize("nprocs", [1, 2, 4])
def test_launch_returns_each_ranks_value_indexed_by_rank(nprocs):
    facts = launch.launch(_rank_facts, nprocs=nprocs)
    assert [f["rank"] for f in facts] == list(range(nprocs))
    assert all(f["world_size"] == nprocs and f["backend"] == "gloo" and f["device"] == "cpu" for f in facts)
    assert [f["local_rank"] for f in facts] == list(range(nprocs))
    assert [f["is_main"] for f in facts] == [True] + [False] * (nprocs - 1)
    assert all(f["master_addr"] == "127.0.0.1" for f in facts)


def test_launch_passes_positional_and_keyword_arguments():
    assert launch.launch(_sum_of_ranks, 10, nprocs=3, scale=2) == [2 * (30 + 3)] * 3


_THREADS = """
import os, torch
from labkit import launch
from tests.test_launch import _rank_facts
cores = len(os.sched_getaffinity(0))
for nprocs in (1, 2, 4):
    facts = launch.launch(_rank_facts, nprocs=nprocs)
    expected = max(1, cores // nprocs)
    assert {f["threads"] for f in facts} == {expected}, (nprocs, facts)
    assert {f["omp"] for f in facts} == {str(expected)}, (nprocs, facts)
a = torch.randn(1024, 1024)
(a @ a).sum()  # OpenMP's worker threads start here (on a machine with two cores or more)
facts = launch.launch(_matmul_threads_of_rank, nprocs=1, timeout=60)  # a rank forked now must not hang
assert facts == [cores], facts
(a @ a).sum()  # and this process still computes
print("ok")
"""


def _matmul_threads_of_rank():
    a = torch.randn(1024, 1024)
    (a @ a).sum()
    return torch.get_num_threads()


def test_each_rank_gets_its_share_of_the_cpu_threads_even_after_openmp_started_here():
    # In a fresh interpreter, whose OpenMP has not started yet; then once it has (launch releases its threads).
    script = _THREADS.replace("from tests.test_launch import _rank_facts",
                              "from tests.test_launch import _rank_facts, _matmul_threads_of_rank")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-2000:]


def test_a_function_defined_inside_a_function_works_without_pickling():
    base = torch.arange(3.0)

    def local_closure():  # not picklable: only fork can run it
        return base * torch_dist.get_rank()

    results = launch.launch(local_closure, nprocs=2)
    assert torch.equal(results[1], base)


def test_printed_lines_reach_the_caller_prefixed_with_the_rank(capsys):
    launch.launch(_print_lines, nprocs=2, rank_output="live")
    captured = capsys.readouterr()
    assert sorted(captured.out.splitlines()) == ["[rank 0] hello from 0", "[rank 1] hello from 1"]
    assert sorted(captured.err.splitlines()) == ["[rank 0] second line 0", "[rank 1] second line 1"]


def test_grouped_output_is_printed_in_rank_order(capsys):
    launch.launch(_print_lines, nprocs=3, rank_output="grouped")
    assert capsys.readouterr().out.splitlines() == [f"[rank {r}] hello from {r}" for r in range(3)]


def test_output_can_be_silenced(capsys):
    launch.launch(_print_lines, nprocs=2, rank_output="none")
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_nested_launch_runs_in_place_on_the_existing_ranks():
    # inside a rank, launch runs fn on this rank and all-gathers: every rank sees every rank's value
    assert launch.launch(_nested_launch, nprocs=2) == [[1.0, 1.0], [1.0, 1.0]]


# ---------------------------------------------------------------------------------------------------------
# Failures


def test_a_rank_that_raises_becomes_rank_failed_with_its_traceback(tmp_path):
    start = time.monotonic()
    with pytest.raises(launch.RankFailed) as caught:
        launch.launch(_fail_on, 2, tmp_path, nprocs=4, timeout=60.0)
    elapsed = time.monotonic() - start
    assert caught.value.rank == 2
    assert "ValueError: boom on rank 2" in caught.value.remote_traceback
    assert "_fail_on" in caught.value.remote_traceback  # the user's frame, not only the launcher's
    assert "rank 2 failed" in str(caught.value)
    assert elapsed < 10.0, f"the healthy ranks were not stopped promptly ({elapsed:.1f} s)"
    pids = _pids(tmp_path)
    assert len(pids) == 4 and sorted(pids) == sorted(caught.value.pids)
    assert not any(is_alive(pid) for pid in pids)


def test_a_rank_killed_by_a_signal_becomes_rank_failed():
    with pytest.raises(launch.RankFailed) as caught:
        launch.launch(_die_hard, 1, nprocs=3, timeout=60.0)
    assert caught.value.rank == 1
    assert "SIGKILL" in str(caught.value)
    assert not any(is_alive(pid) for pid in caught.value.pids)


def test_ranks_hanging_in_a_collective_become_collective_timeout(tmp_path):
    start = time.monotonic()
    with pytest.raises(launch.CollectiveTimeout) as caught:
        launch.launch(_only_rank_zero_all_reduces, tmp_path, nprocs=4, timeout=3.0)
    elapsed = time.monotonic() - start
    assert 3.0 <= elapsed < 10.0
    assert caught.value.stuck_ranks == [0]
    assert caught.value.finished_ranks == [1, 2, 3]
    assert "all_reduce" in caught.value.stacks[0]  # where rank 0 was stuck
    assert "_only_rank_zero_all_reduces" in str(caught.value)
    pids = _pids(tmp_path)
    assert len(pids) == 4 and not any(is_alive(pid) for pid in pids)


def test_an_unpicklable_return_value_is_reported_clearly():
    with pytest.raises(launch.RankFailed) as caught:
        launch.launch(_return_unpicklable, nprocs=2)
    assert "cannot be sent back" in caught.value.remote_traceback


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"nprocs": 0}, "nprocs"),
        ({"nprocs": -2}, "nprocs"),
        ({"nprocs": 2.5}, "nprocs"),
        ({"nprocs": True}, "nprocs"),
        ({"backend": "mpi-ish"}, "backend"),
        ({"backend": None}, "backend"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": -1.0}, "timeout"),
        ({"rank_output": "loud"}, "rank_output"),
    ],
)
def test_bad_arguments_raise_value_error_before_any_process_starts(kwargs, fragment):
    from tests.conftest import live_descendants

    before = live_descendants()
    with pytest.raises(ValueError, match=fragment):
        launch.launch(_rank_facts, **kwargs)
    assert live_descendants() == before


def test_a_non_callable_fn_is_a_value_error():
    with pytest.raises(ValueError, match="callable"):
        launch.launch("not a function", nprocs=2)


@pytest.mark.skipif(dist.gpus_available() >= 2, reason="this machine has GPUs for NCCL")
def test_nccl_without_enough_gpus_is_a_value_error():
    with pytest.raises(ValueError, match="nccl"):
        launch.launch(_rank_facts, nprocs=2, backend="nccl")


def test_auto_backend_is_gloo_without_a_gpu_per_rank():
    assert dist.resolve_backend("auto", dist.gpus_available() + 1) == "gloo"


# ---------------------------------------------------------------------------------------------------------
# Ports, processes, torchrun


def test_concurrent_launches_never_collide_on_ports():
    results: dict[int, object] = {}

    def worker(index):
        try:
            results[index] = [launch.launch(_sum_of_ranks, index, nprocs=2 + index % 3) for _ in range(3)]
        except Exception as error:  # reported below
            results[index] = error

    threads = [threading.Thread(target=worker, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for index in range(4):
        nprocs = 2 + index % 3
        expected = float(sum(range(nprocs)) + index * nprocs)
        assert results[index] == [[expected] * nprocs] * 3, f"launch {index}: {results[index]!r}"


def test_concurrent_launches_from_separate_processes_never_collide():
    script = textwrap.dedent("""
        import torch, torch.distributed as d
        from labkit import launch
        def f():
            t = torch.ones(1); d.all_reduce(t); return t.item()
        for _ in range(3):
            assert launch.launch(f, nprocs=3) == [3.0] * 3
        print("ok")
    """)
    processes = [subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outputs = [process.communicate(timeout=120) for process in processes]
    for process, (out, err) in zip(processes, outputs, strict=True):
        assert process.returncode == 0 and out.strip() == "ok", err


@pytest.mark.timing  # the serial pass: in the parallel one the caller twice outlived its 30 s bound after SIGINT
def test_interrupting_the_caller_stops_every_rank(tmp_path):
    # The caller restores Python's Ctrl-C handler: a child inherits an ignored SIGINT from its parent, and Python
    # then leaves it ignored (the test would hang for a reason of the test runner's, not of launch's).
    script = textwrap.dedent(f"""
        import os, signal, time, pathlib
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from labkit import launch
        def f():
            pathlib.Path({str(tmp_path)!r}, f"{{os.getpid()}}.pid").write_text(str(os.getpid()))
            time.sleep(60)
        try:
            launch.launch(f, nprocs=3, timeout=120)
        except KeyboardInterrupt:
            print("interrupted")
    """)
    process = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while len(list(tmp_path.glob("*.pid"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    try:
        out, _ = process.communicate(timeout=60)
    finally:
        process.kill()  # never leave the caller (and, through its parent-death signal, its ranks) behind
    assert "interrupted" in out
    pids = [int(path.read_text()) for path in tmp_path.glob("*.pid")]
    assert len(pids) == 3 and not any(is_alive(pid) for pid in pids)


def test_killing_the_caller_takes_the_ranks_with_it(tmp_path):
    script = textwrap.dedent(f"""
        import os, time, pathlib
        from labkit import launch
        def f():
            pathlib.Path({str(tmp_path)!r}, f"{{os.getpid()}}.pid").write_text(str(os.getpid()))
            time.sleep(60)
        launch.launch(f, nprocs=2, timeout=120)
    """)
    process = subprocess.Popen([sys.executable, "-c", script], cwd=REPO)
    deadline = time.monotonic() + 30
    while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    process.kill()  # SIGKILL: no chance to clean up; the kernel's parent-death signal must do it
    process.wait()
    pids = [int(path.read_text()) for path in tmp_path.glob("*.pid")]
    deadline = time.monotonic() + 10
    while any(is_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(pids) == 2 and not any(is_alive(pid) for pid in pids)


def test_under_torchrun_launch_runs_in_place_and_gathers_every_ranks_result(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as d
        from labkit import dist, launch
        def f():
            return (dist.rank(), dist.world_size(), dist.local_rank())
        results = launch.launch(f, nprocs=2)
        with open(f"{__file__}.{dist.rank()}.out", "w") as out:  # ranks share stdout: lines may interleave
            out.write(f"RESULT {dist.rank()} {results}")
    """))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert completed.returncode == 0, completed.stderr
    lines = [(tmp_path / f"job.py.{rank}.out").read_text() for rank in range(2)]
    assert lines == [f"RESULT {r} [(0, 2, 0), (1, 2, 1)]" for r in range(2)]
