"""labkit.trace: spans are free when off, recorded when on, async collectives timed to completion."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as torch_dist

from labkit import trace
from labkit.launch import launch


def test_nothing_is_recorded_while_tracing_is_off():
    trace.disable()
    trace.clear()
    with trace.span("work"):
        pass
    trace.add("manual", "comm", 0.0, 1.0)
    assert trace.spans() == [] and not trace.is_enabled() and trace.now() == 0.0


def test_spans_measure_the_block_and_reject_unknown_kinds():
    trace.enable(barrier=False)
    try:
        with trace.span("sleep", kind="idle"):
            time.sleep(0.02)
        [recorded] = trace.spans()
        assert recorded.name == "sleep" and recorded.kind == "idle" and 0.015 < recorded.seconds < 0.5
        with pytest.raises(ValueError, match="kind"):
            trace.add("x", "thinking", 0.0, 1.0)
    finally:
        trace.disable()


def _traced_all_reduce():
    trace.enable()
    with trace.span("compute"):
        time.sleep(0.01)
    work = torch_dist.all_reduce(torch.ones(100_000), async_op=True)
    trace.record_async(work, "all-reduce")
    work.wait()
    return trace.gather()


def test_async_collectives_are_recorded_and_every_rank_is_gathered_on_rank_zero():
    results = launch(_traced_all_reduce, nprocs=3)
    assert results[1] is None and results[2] is None
    spans = results[0]
    assert [(s.rank, s.name) for s in spans] == [(r, n) for r in range(3) for n in ("compute", "all-reduce")]
    for rank in range(3):
        compute, comm = [s for s in spans if s.rank == rank]
        assert comm.kind == "comm" and comm.start_s >= compute.end_s and comm.end_s > comm.start_s
