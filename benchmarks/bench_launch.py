"""Benchmark: how long it takes to start N ranks, rendezvous, all-reduce once and finish.

labkit.launch (fork, rank-0 store, results returned to the caller) against PyTorch's built-in
``torch.multiprocessing.start_processes`` doing the same work, with both of its start methods: "spawn"
(``mp.spawn``'s default: a fresh interpreter per rank that re-imports torch) and "fork".  Measured in the same
run, median of several repeats; the ratio is labkit / torch (below 1.0 = labkit is faster).

    python benchmarks/bench_launch.py [--quick]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

import torch
import torch.distributed as torch_dist
import torch.multiprocessing as torch_mp

from labkit.launch import launch


def _all_reduce_once() -> float:
    tensor = torch.ones(1)
    torch_dist.all_reduce(tensor)
    return tensor.item()


def _torch_rank(rank: int, world_size: int, port: int) -> None:
    torch.set_num_threads(1)
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    _all_reduce_once()
    torch_dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _time(function, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    repeats = 3 if args.quick else 7
    print(f"start N ranks + rendezvous + one all_reduce + exit; median of {repeats} (seconds)")
    header = f"{'ranks':>5}  {'labkit.launch':>13}  {'torch fork':>10}  {'torch spawn':>11}  {'vs fork':>7}  {'vs spawn':>8}"
    print(header)
    print("-" * len(header))
    for nprocs in (1, 2, 4):
        labkit_seconds = _time(lambda n=nprocs: launch(_all_reduce_once, nprocs=n, backend="gloo"), repeats)
        fork_seconds = _time(lambda n=nprocs: torch_mp.start_processes(
            _torch_rank, args=(n, _free_port()), nprocs=n, start_method="fork"), repeats)
        spawn_seconds = _time(lambda n=nprocs: torch_mp.start_processes(
            _torch_rank, args=(n, _free_port()), nprocs=n, start_method="spawn"), max(2, repeats // 2))
        print(f"{nprocs:>5}  {labkit_seconds:>13.3f}  {fork_seconds:>10.3f}  {spawn_seconds:>11.3f}  "
              f"{labkit_seconds / fork_seconds:>6.2f}x  {labkit_seconds / spawn_seconds:>7.2f}x")
    print("ratio = labkit / torch: below 1.0 means labkit starts faster.")


if __name__ == "__main__":
    main()
