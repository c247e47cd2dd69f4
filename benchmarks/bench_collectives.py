"""labkit's ring all-reduce beside gloo's own all_reduce and the parameter-server all-reduce.

    python benchmarks/bench_collectives.py [--quick] [--ranks 2 4] [--segment-bytes N]

For 2 and 4 ranks and messages from 4 KiB to 64 MiB it prints the bus bandwidth (GB/s, NCCL-tests'
convention, see ``labkit.bus_bandwidth``) of each all-reduce, measured in one launched job, and the
ring's bus bandwidth predicted by the alpha-beta model of one ring step fitted on the spot (the model leaves
out the time spent adding and any overlap between steps).  As in NCCL-tests a timed batch is several back-to-back
calls after a barrier; the three algorithms take turns batch by batch (ring, gloo, naive, ring, ...) so a burst
of load from elsewhere on the machine hits all of them alike; a batch's time is the slowest rank's, and the
table shows the median over batches.

The physical ceiling is memory bandwidth: over loopback TCP every byte is copied into the kernel and out again,
and a reduction reads two arrays and writes one, so the memcpy line printed first bounds every number below.

The target (labkit's ring >= 0.8x gloo at 16 MiB and above) is reported as PASS/FAIL lines; the script always
exits 0, because it reports and does not gate.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from labkit import collectives, measure
from labkit.costmodel.collectives import bus_bandwidth, ring_all_reduce_cost
from labkit.launch import launch

TARGET_RATIO = 0.8
TARGET_FROM_BYTES = 16 << 20


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


def run_on_each_rank(sizes: list[int], quick: bool, segment_bytes: int | None) -> dict:
    """Time every algorithm at every size (the same numbers on every rank); fit the alpha-beta model of one
    ring step."""
    algorithms = {
        "ring": lambda tensor: collectives.ring_all_reduce(tensor, segment_bytes=segment_bytes),
        "gloo": lambda tensor: dist.all_reduce(tensor),
        "naive": lambda tensor: collectives.naive_all_reduce(tensor),
    }
    link = measure.measure_alpha_beta(iterations=5 if quick else 10, pattern="ring")
    return {"times": measure.time_collectives(algorithms, sizes, batches=3 if quick else 7), "link": link}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few sizes, fewer iterations")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes to run (default 2 4)")
    parser.add_argument("--segment-bytes", type=int, default=None,
                        help="pipelining segment of labkit's ring (default: chosen per message size)")
    args = parser.parse_args()
    sizes = [4 << 10, 1 << 20, 16 << 20, 64 << 20] if args.quick else [(4 << 10) << (2 * k) for k in range(8)]

    print(f"memcpy, 1 thread, 64 MiB: {memcpy_bandwidth() / 1e9:.2f} GB/s (the ceiling; loopback TCP copies twice)")
    print(f"segment_bytes={args.segment_bytes or 'automatic'}; bus bandwidth in GB/s (NCCL-tests busbw): median "
          "over batches of back-to-back calls, each timed on its slowest rank\n")
    header = f"{'ranks':>5} {'size':>9} {'ring':>7} {'gloo':>7} {'naive':>7} {'ring/gloo':>9} {'model':>7}"
    print(header)
    print("-" * len(header))
    verdicts = []
    for world_size in args.ranks:
        results = launch(run_on_each_rank, sizes, args.quick, args.segment_bytes, nprocs=world_size,
                         timeout=600, rank_output="none")
        link = results[0]["link"]
        for index, nbytes in enumerate(sizes):
            busbw = {name: bus_bandwidth(nbytes, results[0]["times"][name][index], world_size) / 1e9
                     for name in ("ring", "gloo", "naive")}
            predicted = ring_all_reduce_cost(nbytes, world_size, link).time_s
            model = bus_bandwidth(nbytes, predicted, world_size, "all_reduce") / 1e9
            ratio = busbw["ring"] / busbw["gloo"]
            print(f"{world_size:>5} {_size(nbytes):>9} {busbw['ring']:>7.3f} {busbw['gloo']:>7.3f} "
                  f"{busbw['naive']:>7.3f} {ratio:>9.2f} {model:>7.3f}")
            if nbytes >= TARGET_FROM_BYTES:
                verdicts.append((world_size, nbytes, ratio))
        print(f"{'':>5} alpha-beta fit of one ring step on {world_size} ranks: alpha = {link.alpha_s * 1e6:.1f} us, "
              f"1/beta = {link.bandwidth_bytes_per_s / 1e9:.2f} GB/s")
    print()
    for world_size, nbytes, ratio in verdicts:
        verdict = "PASS" if ratio >= TARGET_RATIO else "FAIL"
        print(f"{verdict}: {world_size} ranks, {_size(nbytes)}: ring/gloo = {ratio:.2f} (target >= {TARGET_RATIO})")


def _size(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


if __name__ == "__main__":
    main()
