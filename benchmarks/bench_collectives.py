"""labkit's ring all-reduce beside gloo's own all_reduce and the parameter-server all-reduce.

    python benchmarks/bench_collectives.py [--quick] [--ranks 2 4] [--segment-bytes N [N ...]]
    python benchmarks/bench_collectives.py --anatomy [--quick]

For 2 and 4 ranks and messages from 4 KiB to 64 MiB it prints the bus bandwidth (GB/s, NCCL-tests'
convention, see ``labkit.costmodel.collectives.bus_bandwidth``) of each all-reduce, measured in one launched job, and the
ring's bus bandwidth predicted by the alpha-beta model of one ring step fitted on the spot (the model leaves
out the time spent adding and any overlap between steps).  As in NCCL-tests a timed batch is several back-to-back
calls after a barrier; the algorithms take turns batch by batch (ring, gloo, naive, ring, ...) so a burst of
load from elsewhere on the machine hits all of them alike; a batch's time is the slowest rank's, and the table
shows the median over batches.  ``--segment-bytes`` adds the ring with those pipelining segments as further
columns, in the same rotation (the default segment is ``labkit.collectives.SEGMENT_BYTES``).

From 16 MiB up the table also shows each algorithm's CPU time per call, summed over every thread of every rank
(median over a few calls): with more ranks than cores the all-reduce is CPU-bound, so the CPU it burns sets
its speed, and CPU time moves much less than wall-clock time when another job loads the machine.

The physical ceiling is memory bandwidth: over loopback TCP every byte is copied into the kernel and out again,
and a reduction reads two arrays and writes one, so the memcpy line printed first bounds every number below.

``--anatomy`` takes 2 ranks and a 16 MiB all-reduce apart instead: the ring beside the two exchanges of
``n/2`` bytes it consists of (every rank sending and receiving at once), two one-way transfers of ``n``
(what the parameter server does), the add, the parameter server and gloo, all in one rotation, and the
alpha-beta model's figures for each; then the exchange and the one-way transfer at several sizes.  It is the
measurement behind the explanation of why, at N = 2, the ring does not beat the parameter server here.

The target (labkit's ring >= 0.8x gloo at 16 MiB and above) is reported as PASS/FAIL lines; the script exits 0
and ``labkit bench`` gates on them (exit 1 on a FAIL line unless ``--report-only``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from labkit import collectives, measure
from labkit.costmodel.collectives import LinkModel, bus_bandwidth, naive_all_reduce_cost, ring_all_reduce_cost
from labkit.launch import launch

TARGET_RATIO = 0.8
TARGET_FROM_BYTES = 16 << 20
CPU_CALLS = 5  # calls per algorithm and size whose CPU time is measured
ANATOMY_BYTES = 16 << 20
ANATOMY_SIZES = (1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20)


def memcpy_bandwidth(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Bytes/s of one thread copying a large tensor (``dst.copy_(src)``), the best case for moving data."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        source, destination = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
        destination.copy_(source)  # touch the pages once
        samples = []
        for _ in range(repeats):
            begin = time.perf_counter()
            destination.copy_(source)
            samples.append(time.perf_counter() - begin)
    finally:
        torch.set_num_threads(threads)
    return nbytes / statistics.median(samples)


def _ring_name(segment_bytes: int) -> str:
    return f"ring {_size(segment_bytes)} seg"


def cpu_per_call(algorithms: dict[str, Callable[[torch.Tensor], object]], nbytes: int, calls: int) -> dict[str, float]:
    """Seconds of CPU per call, every thread of every rank summed (median over ``calls``, taken in turns)."""
    tensor = torch.zeros(nbytes // 4)
    samples: dict[str, list[float]] = {name: [] for name in algorithms}
    for _ in range(calls):
        for name, run in algorithms.items():
            dist.barrier()
            begin = time.process_time()
            run(tensor)
            spent = torch.tensor([time.process_time() - begin], dtype=torch.float64)
            dist.all_reduce(spent)
            samples[name].append(float(spent))
    return {name: statistics.median(values) for name, values in samples.items()}


def run_on_each_rank(sizes: list[int], quick: bool, segment_bytes: list[int]) -> dict:
    """Time every algorithm at every size (the same numbers on every rank); their CPU time from 16 MiB up; fit
    the alpha-beta model of one ring step."""
    algorithms: dict[str, Callable[[torch.Tensor], object]] = {
        "ring": lambda tensor: collectives.ring_all_reduce(tensor),
        "gloo": lambda tensor: dist.all_reduce(tensor),
        "naive": lambda tensor: collectives.naive_all_reduce(tensor),
    }
    for nbytes in segment_bytes:
        algorithms[_ring_name(nbytes)] = lambda tensor, nbytes=nbytes: collectives.ring_all_reduce(
            tensor, segment_bytes=nbytes)
    link = measure.measure_alpha_beta(iterations=5 if quick else 10, pattern="ring")
    times = measure.time_collectives(algorithms, sizes, batches=3 if quick else 7)
    cpu = {nbytes: cpu_per_call(algorithms, nbytes, 3 if quick else CPU_CALLS)
           for nbytes in sizes if nbytes >= TARGET_FROM_BYTES}
    return {"times": times, "cpu": cpu, "link": link}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few sizes, fewer iterations")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes to run (default 2 4)")
    parser.add_argument("--segment-bytes", type=int, nargs="+", default=[],
                        help="also run the ring with these pipelining segments (bytes), as extra columns")
    parser.add_argument("--anatomy", action="store_true", help="take a 16 MiB all-reduce on 2 ranks apart instead")
    args = parser.parse_args()
    if args.anatomy:
        anatomy(args.quick)
        return
    sizes = [4 << 10, 1 << 20, 16 << 20, 64 << 20] if args.quick else [(4 << 10) << (2 * k) for k in range(8)]
    extra = [_ring_name(nbytes) for nbytes in args.segment_bytes]
    names = ["ring", "gloo", "naive", *extra]

    print(f"memcpy, 1 thread, 64 MiB: {memcpy_bandwidth() / 1e9:.2f} GB/s (the ceiling; loopback TCP copies twice)")
    print(f"ring segments: {_size(collectives.SEGMENT_BYTES)} (labkit.collectives.SEGMENT_BYTES); bus bandwidth in "
          "GB/s (NCCL-tests busbw): median over batches of back-to-back calls, each timed on its slowest rank; "
          "CPU ms: per call, all ranks and threads\n")
    header = (f"{'ranks':>5} {'size':>9} " + " ".join(f"{name:>{max(7, len(name))}}" for name in names)
              + f" {'ring/gloo':>9} {'model':>7}  CPU ms: " + " ".join(f"{name:>{max(7, len(name))}}" for name in names))
    print(header)
    print("-" * len(header))
    verdicts = []
    for world_size in args.ranks:
        results = launch(run_on_each_rank, sizes, args.quick, args.segment_bytes, nprocs=world_size,
                         timeout=900, rank_output="none")
        link = results[0]["link"]
        for index, nbytes in enumerate(sizes):
            busbw = {name: bus_bandwidth(nbytes, results[0]["times"][name][index], world_size) / 1e9
                     for name in names}
            predicted = ring_all_reduce_cost(nbytes, world_size, link).time_s
            model = bus_bandwidth(nbytes, predicted, world_size, "all_reduce") / 1e9
            ratio = busbw["ring"] / busbw["gloo"]
            cpu = results[0]["cpu"].get(nbytes)
            cpu_columns = " ".join(f"{1000 * cpu[name]:>{max(7, len(name))}.1f}" for name in names) if cpu else ""
            print(f"{world_size:>5} {_size(nbytes):>9} "
                  + " ".join(f"{busbw[name]:>{max(7, len(name))}.3f}" for name in names)
                  + f" {ratio:>9.2f} {model:>7.3f}  {'':8}{cpu_columns}")
            if nbytes >= TARGET_FROM_BYTES:
                verdicts.append((world_size, nbytes, {name: busbw[name] / busbw["gloo"] for name in names}))
        print(f"{'':>5} alpha-beta fit of one ring step on {world_size} ranks: alpha = {link.alpha_s * 1e6:.1f} us, "
              f"1/beta = {link.bandwidth_bytes_per_s / 1e9:.2f} GB/s")
    print()
    for world_size, nbytes, ratios in verdicts:
        verdict = "PASS" if ratios["ring"] >= TARGET_RATIO else "FAIL"
        others = "".join(f"; {name}/gloo = {ratios[name]:.2f}" for name in extra)
        print(f"{verdict}: {world_size} ranks, {_size(nbytes)}: ring/gloo = {ratios['ring']:.2f} "
              f"(target >= {TARGET_RATIO}){others}")


# --------------------------------------------------------------------------------------------------------
# --anatomy: the ring on 2 ranks, taken apart


def anatomy_on_each_rank(rounds: int) -> dict:
    """Every piece in turn, ``rounds`` times: wall-clock seconds (slowest rank) and CPU seconds (every thread of
    every rank); then the exchange and the one-way transfer alone at ``ANATOMY_SIZES``."""
    torch.set_num_threads(1)
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    numel = ANATOMY_BYTES // 4
    tensor, other = torch.zeros(numel), torch.zeros(numel)
    mine, theirs = (tensor[:numel // 2], tensor[numel // 2:]) if rank == 0 else (tensor[numel // 2:],
                                                                                 tensor[:numel // 2])

    def exchange(outgoing: torch.Tensor, incoming: torch.Tensor) -> None:  # one ring step at N = 2
        arriving = dist.irecv(incoming, peer)
        dist.isend(outgoing, peer).wait()
        arriving.wait()

    def one_way(data: torch.Tensor, sender: int) -> None:
        (dist.isend(data, peer) if rank == sender else dist.irecv(data, peer)).wait()

    pieces: dict[str, Callable[[], object]] = {
        "ring all-reduce": lambda: collectives.ring_all_reduce(tensor),
        "  its 2 exchanges of n/2 (no add)": lambda: (exchange(theirs, mine), exchange(mine, theirs)),
        "  its add of n/2": lambda: mine.add_(other[:numel // 2]),
        "parameter server": lambda: collectives.naive_all_reduce(tensor),
        "  2 one-way transfers of n": lambda: (one_way(tensor, 1), one_way(tensor, 0)),
        "gloo all_reduce": lambda: dist.all_reduce(tensor),
    }
    found: dict[str, list[tuple[float, float]]] = {name: [] for name in pieces}
    for run in pieces.values():  # warm-up
        run()
    for index in range(rounds):
        order = list(pieces.items())
        for name, run in order if index % 2 == 0 else order[::-1]:
            dist.barrier()
            cpu, begin = time.process_time(), time.perf_counter()
            run()
            wall = torch.tensor([time.perf_counter() - begin], dtype=torch.float64)
            spent = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            dist.all_reduce(spent)
            found[name].append((float(wall), float(spent)))
    by_size: dict[int, dict[str, float]] = {}
    for nbytes in ANATOMY_SIZES:
        outgoing, incoming = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
        samples: dict[str, list[float]] = {"exchange": [], "one-way": []}
        for _ in range(rounds + 1):
            for kind in samples:
                dist.barrier()
                begin = time.perf_counter()
                exchange(outgoing, incoming) if kind == "exchange" else one_way(outgoing, 0)
                wall = torch.tensor([time.perf_counter() - begin], dtype=torch.float64)
                dist.all_reduce(wall, op=dist.ReduceOp.MAX)
                samples[kind].append(float(wall))
        by_size[nbytes] = {kind: statistics.median(values[1:]) for kind, values in samples.items()}
    link = measure.measure_alpha_beta(iterations=10, pattern="ring")
    return {"pieces": found, "by_size": by_size, "link": link}


def anatomy(quick: bool) -> None:
    n = ANATOMY_BYTES
    result = launch(anatomy_on_each_rank, 10 if quick else 30, nprocs=2, timeout=900, rank_output="none")[0]
    link: LinkModel = result["link"]
    exchange_model = link.alpha_s + n / 2 * link.beta_s_per_byte
    models = {"ring all-reduce": ring_all_reduce_cost(n, 2, link).time_s,
              "  its 2 exchanges of n/2 (no add)": 2 * exchange_model,
              "parameter server": naive_all_reduce_cost(n, 2, link).time_s,
              "  2 one-way transfers of n": 2 * (link.alpha_s + n * link.beta_s_per_byte)}
    print(f"2 ranks, n = {_size(n)}; alpha-beta fit of one ring step (both ranks sending and receiving at once): "
          f"alpha = {link.alpha_s * 1e6:.0f} us, 1/beta = {link.bandwidth_bytes_per_s / 1e9:.2f} GB/s; ms = median "
          "of the slowest rank, CPU = every thread of both ranks\n")
    print(f"{'':<36} {'ms':>7} {'model ms':>9} {'CPU ms':>7} {'vs ring':>8}")
    ring = result["pieces"]["ring all-reduce"]
    for name, samples in result["pieces"].items():
        wall = statistics.median(sample[0] for sample in samples)
        cpu = statistics.median(sample[1] for sample in samples)
        paired = statistics.median(a[0] / b[0] for a, b in zip(samples, ring, strict=True))
        model = f"{1000 * models[name]:.2f}" if name in models else ""
        print(f"{name:<36} {1000 * wall:>7.2f} {model:>9} {1000 * cpu:>7.2f} {paired:>7.2f}x")
    print("\nvs ring: median over rounds of the ratio to the ring's time in the same round.  The model counts an "
          "exchange of m bytes\nas one message of m (a full-duplex link); the parameter server as two one-way "
          "messages of n.\n")
    print(f"{'message':>9} {'exchange ms':>12} {'GB/s':>6} {'one-way ms':>11} {'GB/s':>6} {'exchange/one-way':>17} "
          f"{'model ms':>9}")
    for nbytes, found in result["by_size"].items():
        print(f"{_size(nbytes):>9} {1000 * found['exchange']:>12.2f} {nbytes / found['exchange'] / 1e9:>6.2f} "
              f"{1000 * found['one-way']:>11.2f} {nbytes / found['one-way'] / 1e9:>6.2f} "
              f"{found['exchange'] / found['one-way']:>16.2f}x "
              f"{1000 * (link.alpha_s + nbytes * link.beta_s_per_byte):>9.2f}")


def _size(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


if __name__ == "__main__":
    main()
