"""Lesson 13, measured: labkit's blockwise attention against torch's fused kernel, and ring, all-gather and
Ulysses context parallelism against each other and against one process.

    python benchmarks/bench_cp.py [--quick]

1. **The kernel** (one process, one thread, fp32, causal, forward and backward): ``labkit.parallel.context.
   blockwise_attention`` against ``F.scaled_dot_product_attention`` (torch's fused CPU flash kernel), the median
   of several passes each, interleaved.  labkit's is Python loops over tiles, a teaching kernel: the ratio says
   what that costs (target: within 2.5x of torch at 2,048 tokens and more, where the tiles' matrix products
   dominate the loop's overhead).
2. **Context parallelism** at cp = 2 and 4 (gloo ranks, one thread each, zig-zag): one attention's forward and
   backward over 4 heads of 32 and a 4,096-token sequence, each strategy's slowest rank's median
   (:func:`labkit.parallel.context.timing.attention_run`), as a ratio to the ring's, and to one process running
   torch's fused kernel on the whole sequence.  On 2 cores the ranks share the cores: the ratios say what the
   extra messages and merges cost here, not what a cluster would see (the cost model's business, lesson 13).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from labkit.launch import launch
from labkit.parallel.context import blockwise_attention
from labkit.parallel.context.timing import attention_run

KERNEL_TARGET = 2.5


def _pass(kernel, q, k, v, grad) -> float:
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    began = time.perf_counter()
    torch.autograd.backward(kernel(*inputs), grad)
    return time.perf_counter() - began


def kernel_table(repeats: int) -> bool:
    torch.set_num_threads(1)
    print("1. blockwise attention (labkit) against scaled_dot_product_attention (torch), fp32, causal, fwd + bwd")
    print(f"{'tokens':>7} {'heads x d':>10} {'block':>6} {'labkit ms':>10} {'torch ms':>9} {'ratio':>6}")
    met = True
    kernels = {"labkit": None, "torch": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
    for seq_len, heads, dim, block in ((512, 8, 64, 128), (2048, 8, 64, 256), (4096, 8, 64, 512)):
        q, k, v, grad = (torch.randn(1, heads, seq_len, dim) for _ in range(4))
        kernels["labkit"] = lambda q, k, v, block=block: blockwise_attention(q, k, v, block_size=block)
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for _ in range(repeats + 1):  # the first pass of each is a warm-up, dropped
            for name, kernel in kernels.items():
                times[name].append(_pass(kernel, q, k, v, grad))
        labkit, torch_s = (statistics.median(times[name][1:]) for name in ("labkit", "torch"))
        ratio = labkit / torch_s
        print(f"{seq_len:>7} {f'{heads} x {dim}':>10} {block:>6} {1e3 * labkit:>10.1f} {1e3 * torch_s:>9.1f} {ratio:>6.2f}")
        if seq_len >= 2048:
            met &= ratio <= KERNEL_TARGET
    print(("PASS" if met else "FAIL") + f": labkit's kernel within {KERNEL_TARGET:g}x of torch's from 2,048 tokens on")
    return met


def one_process_seconds(seq_len: int, heads: int, dim: int, repeats: int) -> float:
    torch.set_num_threads(1)
    q, k, v, grad = (torch.randn(1, heads, seq_len, dim) for _ in range(4))
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    return statistics.median(_pass(sdpa, q, k, v, grad) for _ in range(repeats))


def strategy_table(seq_len: int, repeats: int) -> None:
    heads, dim = 4, 32
    alone = one_process_seconds(seq_len, heads, dim, repeats)
    print(f"\n2. context parallelism, {seq_len} tokens, {heads} heads of {dim}, zig-zag, fwd + bwd (slowest rank's "
          f"median); one process, torch's kernel, one thread: {1e3 * alone:.1f} ms")
    print(f"{'cp':>3} {'strategy':>11} {'ms':>8} {'vs ring':>8} {'vs one process':>15} {'MiB sent a rank':>16}")
    for cp in (2, 4):
        measured = {}
        for strategy in ("ring", "all_gather", "ulysses"):
            ranks = launch(attention_run, strategy, "zigzag", seq_len=seq_len, heads=heads, head_dim=dim,
                           block_size=256, repeats=repeats, nprocs=cp, rank_output="none")
            measured[strategy] = (max(r["seconds"] for r in ranks), ranks[0]["sent"])
        for strategy, (seconds, sent) in measured.items():
            print(f"{cp:>3} {strategy:>11} {1e3 * seconds:>8.1f} {seconds / measured['ring'][0]:>8.2f} "
                  f"{seconds / alone:>15.2f} {sent / 2**20:>16.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    met = kernel_table(repeats=3 if args.quick else 7)
    strategy_table(seq_len=4096, repeats=2 if args.quick else 5)
    raise SystemExit(0 if met else 1)


if __name__ == "__main__":
    main()
