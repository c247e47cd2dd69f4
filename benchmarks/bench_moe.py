"""Lesson 14, measured: labkit's MoE layer against dense compute, and expert parallelism against one process.

    python benchmarks/bench_moe.py [--quick]

1. **The layer** (one process, one thread, fp32, forward and backward of 4,096 tokens of width 256, 8 experts of
   width 1,024, top-2): ``labkit.parallel.experts.MoE`` (route, permute, each expert on its rows, put back)
   against a dense MLP doing the same active FLOPs (one MLP of width ``k f`` on every token: what the experts
   compute, with no routing) and against ``moe_reference`` (every expert on every token, ``E / k`` times the
   FLOPs: what a layer that does not dispatch would pay).  Target: labkit's layer within 1.6x of the dense MLP of
   the same active FLOPs (the router, the permutation and the experts' separate matrix products cost that much at
   most), and faster than computing every expert.
2. **Expert parallelism** (gloo ranks, one thread each): the same 4,096 tokens split over ``ep`` = 2 and 4 ranks,
   each rank's experts on its rows after the all-to-alls (:func:`labkit.parallel.experts.timing.moe_run`); the
   slowest rank's median against the one-process layer.  On 2 cores the ranks share the cores: the ratio says what
   the all-to-alls and the counts' exchange cost here, not what a cluster sees (the cost model's business).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from labkit.launch import launch
from labkit.parallel.experts import MoE, moe_reference
from labkit.parallel.experts.timing import moe_run

TOKENS, HIDDEN, EXPERTS, TOP_K, WIDTH = 4096, 256, 8, 2, 1024
DENSE_TARGET = 1.6


def _seconds(forward, x: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up, dropped
        inputs = x.clone().requires_grad_()
        start = time.perf_counter()
        forward(inputs).sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def layer_table(repeats: int) -> tuple[bool, float]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layer = MoE(HIDDEN, EXPERTS, TOP_K, expert_hidden=WIDTH)
    dense = nn.Sequential(nn.Linear(HIDDEN, TOP_K * WIDTH), nn.GELU(), nn.Linear(TOP_K * WIDTH, HIDDEN))
    x = torch.randn(TOKENS, HIDDEN)
    rows = {"labkit MoE (dispatch)": _seconds(layer, x, repeats),
            "dense MLP, same active FLOPs": _seconds(dense, x, repeats),
            "every expert on every token": _seconds(lambda t: moe_reference(layer, t), x, repeats)}
    moe = rows["labkit MoE (dispatch)"]
    print(f"1. one MoE layer, {TOKENS} tokens x {HIDDEN}, {EXPERTS} experts of {WIDTH}, top-{TOP_K}, fp32, fwd + bwd, "
          "one thread")
    print(f"{'':>30} {'ms':>8} {'labkit / this':>14}")
    for name, seconds in rows.items():
        print(f"{name:>30} {1e3 * seconds:>8.1f} {moe / seconds:>14.2f}")
    met = moe <= DENSE_TARGET * rows["dense MLP, same active FLOPs"] and moe < rows["every expert on every token"]
    print(("PASS" if met else "FAIL") + f": labkit's layer within {DENSE_TARGET:g}x of the dense MLP of the same active "
          "FLOPs, and faster than every expert on every token")
    return met, moe


def ep_table(alone: float, repeats: int) -> None:
    print(f"\n2. expert parallelism: the {TOKENS} tokens split over ep ranks (gloo, one thread each), slowest rank's "
          f"median fwd + bwd; one process: {1e3 * alone:.1f} ms")
    print(f"{'ep':>3} {'ms':>8} {'vs one process':>15} {'KiB sent a rank':>16} {'experts ms (max/min rank)':>26}")
    for ep in (2, 4):
        ranks = launch(moe_run, nprocs=ep, rank_output="none", n_experts=EXPERTS, top_k=TOP_K, hidden=HIDDEN,
                       expert_hidden=WIDTH, tokens=TOKENS // ep, repeats=repeats)
        slowest = max(r["seconds"] for r in ranks)
        sent = sum(n for _, kind, n in ranks[0]["log"]) / 1024
        experts = [r["expert_seconds"] for r in ranks]
        print(f"{ep:>3} {1e3 * slowest:>8.1f} {slowest / alone:>15.2f} {sent:>16.0f} "
              f"{1e3 * max(experts):>12.1f} / {1e3 * min(experts):.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    met, alone = layer_table(repeats=3 if args.quick else 7)
    ep_table(alone, repeats=2 if args.quick else 5)
    raise SystemExit(0 if met else 1)


if __name__ == "__main__":
    main()
