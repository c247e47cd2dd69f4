"""labkit.trace: spans are free when off, recorded when on, async collectives timed to completion, tagged with
mesh coordinates, gathered over any group (also one without rank 0), exported as a Chrome / Perfetto trace."""

from __future__ import annotations

import json
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


def test_bubble_is_a_kind_and_coordinates_tag_every_span():
    class FakeMesh:  # anything with coords(), as labkit.mesh.Mesh has
        def coords(self):
            return {"pp": 1, "dp": 0, "tp": 1}

    trace.enable(barrier=False, coords=FakeMesh())
    try:
        trace.add("wait for stage 0", "bubble", 0.0, 0.5)
        trace.set_coords({"pp": 2})
        trace.add("forward 0", "compute", 0.5, 1.0)
        trace.set_coords(None)
        trace.add("untagged", "compute", 1.0, 1.5)
        first, second, third = trace.spans()
        assert first.kind == "bubble" and first.coords == {"pp": 1, "dp": 0, "tp": 1}
        assert second.coords == {"pp": 2} and third.coords is None
        assert len({first, second, third}) == 3  # spans stay hashable with coordinates
        with pytest.raises(ValueError, match="coords"):
            trace.set_coords({"pp": -1})
    finally:
        trace.disable()
    trace.enable(barrier=False)  # a new recording starts untagged
    trace.add("x", "compute", 0.0, 1.0)
    assert trace.spans()[0].coords is None
    trace.disable()


def test_chrome_trace_has_one_complete_event_per_span_with_times_in_microseconds(tmp_path):
    spans = [trace.Span(0, "forward", "compute", 0.0, 0.25, {"pp": 0, "dp": 0, "tp": 0}),
             trace.Span(0, "all-reduce bucket 1", "comm", 0.1, 0.3, {"pp": 0, "dp": 0, "tp": 0}),
             trace.Span(0, "all-reduce bucket 0", "comm", 0.2, 0.4, {"pp": 0, "dp": 0, "tp": 0}),  # overlaps
             trace.Span(3, "bubble", "bubble", 0.0, 0.125, {"pp": 1, "dp": 0, "tp": 1}),
             trace.Span(3, "forward 0", "compute", 0.125, 0.5, {"pp": 1, "dp": 0, "tp": 1})]
    path = trace.write_chrome_trace(spans, tmp_path / "trace" / "step.json")
    loaded = json.loads(path.read_text())
    events = [event for event in loaded["traceEvents"] if event["ph"] == "X"]
    assert len(events) == len(spans)
    for span in spans:
        [event] = [e for e in events if e["name"] == span.name and e["pid"] == span.rank]
        assert event["ts"] == pytest.approx(span.start_s * 1e6) and event["dur"] == pytest.approx(span.seconds * 1e6)
        assert event["cat"] == span.kind and event["args"] == {"kind": span.kind, **span.coords}
    names = {e["pid"]: e["args"]["name"] for e in loaded["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0 (pp 0, dp 0, tp 0)", 3: "rank 3 (pp 1, dp 0, tp 1)"}
    # Overlapping spans of one kind go to different lanes; within a lane events never overlap.
    comm = [e for e in events if e["cat"] == "comm"]
    assert comm[0]["tid"] != comm[1]["tid"]
    lanes = {(e["pid"], e["tid"]): [] for e in events}
    for event in events:
        lanes[(event["pid"], event["tid"])].append((event["ts"], event["ts"] + event["dur"]))
    for intervals in lanes.values():
        intervals.sort()
        assert all(end <= start for (_, end), (start, _) in zip(intervals, intervals[1:], strict=False))
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in loaded["traceEvents"] if e["name"] == "thread_name"}
    assert sorted(threads.values()) == ["bubble", "comm", "comm 2", "compute", "compute"]


def _traced_in_a_subgroup():
    subgroup = torch_dist.new_group([1, 2])  # every rank takes part in creating it
    rank = torch_dist.get_rank()
    trace.enable(coords={"pp": 0, "dp": rank, "tp": 0})
    if rank == 0:
        return "not a member"
    with trace.span(f"work on {rank}"):
        time.sleep(0.005)
    return trace.gather(subgroup)


def test_gather_over_a_subgroup_without_rank_zero_returns_the_spans_on_its_first_rank():
    results = launch(_traced_in_a_subgroup, nprocs=3)
    assert results[0] == "not a member" and results[2] is None
    assert [(s.rank, s.name, s.coords["dp"]) for s in results[1]] == [(1, "work on 1", 1), (2, "work on 2", 2)]
