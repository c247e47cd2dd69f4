"""Where a traced 3D step's time went, per rank: the parts lesson 10 and ``bench_3d`` show (:func:`step_breakdown`)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from labkit import trace

PARTS = ("compute", "tp communication", "bubble", "dp reduction", "optimizer", "other")
_ACTION = re.compile(r"\d+[FBIW]\d+")  # a pipeline action's span: stage, kind, micro-batch (e.g. 1B3)
_TP_COLLECTIVES = ("all_reduce ", "all_gather ", "reduce_scatter ")  # tensor parallelism's f and g


def step_breakdown(spans: Sequence[trace.Span]) -> dict[int, dict[str, float]]:
    """Per rank, the seconds of one traced step (``labkit.train --trace``, or :func:`labkit.trace.gather` around
    :meth:`Parallel3D.forward_backward` and the optimizer step), split into :data:`PARTS`:

    - ``compute``: the pipeline's F/B/I/W actions, less the tensor-parallel collectives inside them;
    - ``tp communication``: those collectives (``f`` and ``g``, all-reduces, on the critical path);
    - ``bubble``: the waits for a neighbouring stage's activation or gradient;
    - ``dp reduction``: the data-parallel reduction after the schedule, or, overlapped with the last backward
      (one stage per rank), the wait for it that DDP records at that backward's end; ``optimizer``: its step;
    - ``other``: the rest of the step (from the rank's first span to its last): sends, Python, gathers.
    """
    by_rank: dict[int, list[trace.Span]] = {}
    for span in spans:
        by_rank.setdefault(span.rank, []).append(span)
    result = {}
    for rank, mine in sorted(by_rank.items()):
        actions = [s for s in mine if s.kind == "compute" and _ACTION.fullmatch(s.name)]

        def within(span: trace.Span, actions: list[trace.Span] = actions) -> bool:
            return any(a.start_s <= span.start_s and span.end_s <= a.end_s for a in actions)

        inside = [s for s in mine if s.kind == "comm" and s.name.startswith(_TP_COLLECTIVES) and within(s)]
        # DP's wait at the end of an overlapped last backward (DDP records it) sits inside that action too
        waits = [s for s in mine if s.kind == "idle" and s.name == "wait for gradients" and within(s)]
        parts = {"compute": sum(a.seconds for a in actions) - sum(s.seconds for s in inside + waits),
                 "tp communication": sum(s.seconds for s in inside),
                 "bubble": sum(s.seconds for s in mine if s.kind == "bubble"),
                 "dp reduction": sum(s.seconds for s in mine if s.kind == "comm" and s.name.startswith("dp "))
                 + sum(s.seconds for s in waits),
                 "optimizer": sum(s.seconds for s in mine if s.kind == "compute" and s.name == "optimizer step")}
        step = max(s.end_s for s in mine) - min(s.start_s for s in mine)
        parts["other"] = max(0.0, step - sum(parts.values()))
        parts["step"] = step
        result[rank] = parts
    return result
