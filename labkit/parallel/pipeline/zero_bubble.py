"""The pipeline schedules of 2024-25, as tables equal to torch's own: ZB-V, interleaved zero bubble, DualPipeV
(lesson 15).

All three split the backward as ZB-H1 does (:mod:`.schedule`): ``I``, the input gradient the previous stage waits
for, and ``W``, the weight gradient nothing waits for, moved into what would be idle time.  Two of them put two
stages on each rank in a **V** (``placement="v"``): rank ``r`` holds stage ``r`` on the way down and stage
``2p - 1 - r`` on the way back, so the last stage lives on rank 0, which runs the first; the third interleaves
``v`` chunks round-robin like interleaved 1F1B.  Each generator reproduces the order of the torch class it names
(``torch.distributed.pipelining.schedules``), action for action on every rank
(``tests/test_pipeline_zero_bubble.py`` compares them on a grid of ``p`` and ``m``).

=============================  ==========================================  =========================================
schedule                       order on rank ``r``                         bubble fraction at F = I = W (a stage's)
=============================  ==========================================  =========================================
:func:`zb_v`                   warm up on the first stage, then ``F I W``  ``(p-1) / (6m+p-1)`` for ``m >= 2p-1``;
(``ScheduleZBVZeroBubble``)    on each stage in turn                       no idle time inside a rank's own span
:func:`interleaved_zb`         interleaved 1F1B with ``I`` for ``B``, a    ``(p-1) / (3vm+p-1)``
(``ScheduleInterleaved-        warm-up one forward shorter a hop, each
ZeroBubble``)                  ``W`` deferred ``r`` backwards
:func:`dualpipe_v`             forward of one micro-batch paired with the  ``(p-1) / (3m+p-1)``, pairs run one pass
(``ScheduleDualPipeV``)        backward of another, two stages in a V      after the other
=============================  ==========================================  =========================================

:func:`closed_form_idle` gives the published forms of the idle time with F, B and W apart (the simulator is exact;
``tests/test_pipeline_zero_bubble.py`` compares them).

**DualPipeV's pairs.**  In its steady state each rank runs the forward of one micro-batch on one of its stages
*together with* the backward of another on its other stage: ``F&B``, one overlapped unit (``Schedule.pairs``).
The two share nothing, so one's communication (the pipeline's sends, and in a mixture of experts the
all-to-alls of its dispatch and combine, lesson 14) can run while the other computes: DeepSeek-V3 (sections
3.2.1-3.2.2) cuts each chunk into attention, dispatch, MLP and combine, interleaves the two, and gives
communication streaming multiprocessors of its own.  Without that, a pair
takes ``F + B``, which is how torch's runtime (and labkit's) runs it: one after the other, once both inputs are
in hand.  :func:`~.simulate.simulate`'s ``overlap`` says how much of the shorter one is hidden.

DualPipe proper (two pipelines in opposite directions, every rank holding the parameters of two stages, ``2x``
a stage's) is not built here: DualPipeV is its "cut-in-half" form (Sea AI Lab), the same bubble on half the
devices, and the one torch ships.
"""

from __future__ import annotations

from labkit.parallel.pipeline.schedule import Action, Schedule, check_positive, with_time_slots


def zb_v(p: int, m: int) -> Schedule:
    """ZB-V (Qi et al., arXiv:2401.10241, section 6): two stages per rank placed in a V, rank ``r`` holding stage ``r`` on the
    way down and stage ``2p - 1 - r`` on the way back, so the last stage's output returns to rank 0, which started
    the batch; backward split into ``I`` and ``W``.  Rank ``r`` warms up with ``2(p - r) - 1`` forwards of its
    first stage, then ``r`` pairs (second stage, first stage), then ``p - r`` triples ``F I W`` on its second stage;
    in the steady state each round runs ``F I W`` on the first stage then on the second; the cool-down takes ``r``
    pairs of ``I`` (first, second), ``p - r`` pairs ``I W`` on the first stage, and the ``W`` still owed.  With
    ``F = I = W`` for a stage (half a rank's layers) and ``m >= 2p - 1`` only the ``p - 1`` slots of the ramp stay
    idle, against ``6m`` of work a rank: ``(p - 1) / (6m + p - 1)``, half ZB-H1's idle time for the same layers;
    its peak activations, Qi et al. report, are 1F1B's.  The order is torch's ``ScheduleZBVZeroBubble``'s, action
    for action (``tests/test_pipeline_zero_bubble.py``).  Qi et al. (arXiv:2401.10241, section 6) count
    idle time only inside each rank's span, from its first pass to its last (steps repeat back to back): there ZB-V
    has none at ``F = I = W``."""
    return with_time_slots(zb_v_orders(p, m))


def zb_v_orders(p: int, m: int) -> Schedule:
    """:func:`zb_v`'s orders."""
    check_positive(p=p, m=m)
    orders = []
    for rank in range(p):
        down, up = rank, 2 * p - 1 - rank
        planned = max(2 * p - 1, m)  # the warm-up assumes this many; the extras are dropped below
        order: list[Action] = []
        f0 = f1 = b0 = b1 = 0  # forwards and input gradients run so far, of the first (0) and second (1) stage
        for _ in range(2 * (p - rank) - 1):
            order.append(Action(down, "F", f0))
            f0 += 1
        for _ in range(rank):
            order += [Action(up, "F", f1), Action(down, "F", f0)]
            f1, f0 = f1 + 1, f0 + 1
        for _ in range(p - rank):
            order += [Action(up, "F", f1), Action(up, "I", b1), Action(up, "W", b1)]
            f1, b1 = f1 + 1, b1 + 1
        while f1 < f0 or f0 < planned:
            if f0 < planned:
                order.append(Action(down, "F", f0))
                f0 += 1
            order += [Action(down, "I", b0), Action(down, "W", b0), Action(up, "F", f1), Action(up, "I", b1),
                      Action(up, "W", b1)]
            b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
        w0, w1 = b0, b1
        for _ in range(rank):
            order += [Action(down, "I", b0), Action(up, "I", b1)]
            b0, b1 = b0 + 1, b1 + 1
        for _ in range(p - rank):
            order += [Action(down, "I", b0), Action(down, "W", w0)]
            b0, w0 = b0 + 1, w0 + 1
        order += [Action(up, "W", k) for k in range(w1, b1)] + [Action(down, "W", k) for k in range(w0, b0)]
        orders.append([action for action in order if action.microbatch < m])
    return Schedule(p, m, 2, "ZB-V", orders, "v")




def interleaved_zb(p: int, m: int, v: int) -> Schedule:
    """Interleaved zero bubble (torch's ``ScheduleInterleavedZeroBubble``, which its docstring calls the ZB1P
    schedule, on ``v`` chunks per rank, stages ``r, r + p, ...``): interleaved 1F1B whose backwards are ``I``, with rank
    ``r``'s ``W`` of each backward run ``r`` backwards later, and the rest at the end.

    Micro-batches go through a chunk in rounds of ``m // max(1, m // p)``, which must divide ``m`` (torch's rule;
    ``ValueError`` otherwise).  Rank ``r`` warms up with ``(v - 1)`` rounds plus ``p - 1 - r`` forwards: one
    per hop where interleaved 1F1B has two."""
    return with_time_slots(interleaved_zb_orders(p, m, v))


def interleaved_zb_orders(p: int, m: int, v: int) -> Schedule:
    """:func:`interleaved_zb`'s orders."""
    check_positive(p=p, m=m, v=v)
    rounds = max(1, m // p)
    per_round = m // rounds
    if m % rounds:
        raise ValueError(f"interleaved zero bubble runs micro-batches in {rounds} rounds of m // {rounds} = "
                         f"{per_round}, so m must be a multiple of {rounds}: got m={m} on p={p} (torch's rule)")
    return Schedule(p, m, v, "Interleaved ZB", [_interleaved_zb_order(rank, p, m, v, per_round) for rank in range(p)])


def _interleaved_zb_order(rank: int, p: int, m: int, v: int, per_round: int) -> list[Action]:
    """:func:`interleaved_zb`'s order on ``rank``."""
    warmup = min((v - 1) * per_round + (p - 1 - rank), m * v)
    count = {kind: [0] * (p * v) for kind in "FIW"}  # the next micro-batch of each kind, per stage

    def run(kind: str, stage: int) -> Action:
        count[kind][stage] += 1
        return Action(stage, kind, count[kind][stage] - 1)

    def forward_stage(k: int) -> int:  # the k-th forward of the rank: chunk (k // per_round) % v
        return ((k // per_round) % v) * p + rank

    def backward_stage(k: int) -> int:  # backwards visit the chunks in reverse, from the end of the warm-up
        return (v - 1 - ((k - warmup) // per_round) % v) * p + rank

    order = [run("F", forward_stage(k)) for k in range(warmup)]
    backwards: list[int] = []  # the stage of each I so far: W follows them in the same order
    for k in range(warmup, warmup + m * v):
        if k < m * v:
            order.append(run("F", forward_stage(k)))
        order.append(run("I", backward_stage(k)))
        backwards.append(backward_stage(k))
        if k - warmup >= rank:  # W of the backward run `rank` backwards ago
            order.append(run("W", backwards[sum(count["W"])]))
    while sum(count["W"]) < len(backwards):
        order.append(run("W", backwards[sum(count["W"])]))
    return order


def dualpipe_v(p: int, m: int) -> Schedule:
    """DualPipeV (DeepSeek-AI 2024, DualPipe's "cut-in-half" form; torch's ``ScheduleDualPipeV``): two stages per
    rank in a V, ``m >= 2p`` micro-batches.  Rank ``r`` (stages ``r`` and ``2p - 1 - r``, called 0 and 1 here):

    1. ``2(p - r - 1)`` forwards of stage 0; 2. ``r + 1`` pairs of forwards (0, 1); 3. ``p - r - 1`` times
       ``I1 W F1`` (zero bubble: a pending ``W`` fills the slot);
    4. the main loop, ``m - 2p + r + 1`` times: ``F0&B1`` then ``F1&B0``, each an overlapped pair (the last
       rank's first ``F0``, ``B1`` stay apart, to shorten the bubble);
    5. ``p - r - 1`` times ``B1`` then ``F1&B0``; 6. ``r + 1`` times ``B1 B0``, switching to ``I`` (split)
       halfway; 7. ``p - r - 1`` times ``W B0`` (or ``W I0``); 8. the ``W`` still owed.

    ``B`` here is a full backward (its ``W`` included), ``I``'s ``W`` runs from a queue, oldest first."""
    return with_time_slots(dualpipe_v_orders(p, m))


def dualpipe_v_orders(p: int, m: int) -> Schedule:
    """:func:`dualpipe_v`'s orders and overlapped pairs."""
    check_positive(p=p, m=m)
    if m < 2 * p:
        raise ValueError(f"DualPipeV needs at least as many micro-batches as stages: m >= 2p = {2 * p}, got m={m}")
    orders, pairs = [], set()
    for rank in range(p):
        order, paired = _dualpipe_v_order(rank, p, m)
        orders.append(order)
        pairs |= paired
    return Schedule(p, m, 2, "DualPipeV", orders, "v", frozenset(pairs))


def _dualpipe_v_order(rank: int, p: int, m: int) -> tuple[list[Action], set[tuple[Action, Action]]]:
    """:func:`dualpipe_v`'s order on ``rank``, and its overlapped pairs."""
    pairs: set[tuple[Action, Action]] = set()
    down, up = rank, 2 * p - 1 - rank
    forwards = {down: 0, up: 0}
    backwards = {down: 0, up: 0}
    queue: list[Action] = []  # I's whose W is owed
    order: list[Action] = []

    def forward(stage: int) -> Action:
        forwards[stage] += 1
        return Action(stage, "F", forwards[stage] - 1)

    def backward(stage: int, kind: str = "B") -> Action:
        backwards[stage] += 1
        action = Action(stage, kind, backwards[stage] - 1)
        if kind == "I":
            queue.append(Action(stage, "W", action.microbatch))
        return action

    def pending_weight() -> list[Action]:
        return [queue.pop(0)] if queue else []

    def pair(forward_stage: int, backward_stage: int) -> list[Action]:
        unit = (forward(forward_stage), backward(backward_stage))
        pairs.add(unit)
        return list(unit)

    order += [forward(down) for _ in range(2 * (p - rank - 1))]
    for _ in range(rank + 1):
        order += [forward(down), forward(up)]
    for _ in range(p - rank - 1):
        order += [backward(up, "I"), *pending_weight(), forward(up)]
    for i in range(m - 2 * p + rank + 1):
        order += [forward(down), backward(up)] if i == 0 and rank == p - 1 else pair(down, up)
        order += pair(up, down)
    for _ in range(p - rank - 1):
        order += [backward(up), *pair(up, down)]
    split = False
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        order.append(backward(up, "I" if split else "B"))
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        order.append(backward(down, "I" if split else "B"))
    for _ in range(p - rank - 1):
        order += [*pending_weight(), backward(down, "I" if split else "B")]
    for _ in range(rank + 1):
        order += pending_weight()
    return order, pairs


def closed_form_idle(name: str, p: int, forward_s: float, backward_s: float, weight_s: float | None = None,
                     pair_s: float | None = None) -> float:
    """Idle time per rank by a published form, from one stage's (chunk's) ``F``, ``B`` (= ``I + W``) and ``W``
    (``B / 2`` by default): ``(p - 1)(F + B)`` for GPipe, 1F1B and interleaved 1F1B (Narayanan et al. 2021: a
    chunk's F and B are ``1/v`` of a stage's); ZB1P's ``(p - 1)(F + B - 2W)`` (the DualPipe README's table; Qi et
    al.'s ZB-H1 ``(p - 1)(T_F + T_B - T_W)``, their ``T_B`` being ``I``) for ZB-H1, and applied by labkit with a
    chunk's durations to interleaved ZB and ZB-V, for which no source gives one (Qi et al. count ZB-V's bubble
    inside each rank's span, where it is 0); ``(PP/2 - 1)(F&B + B - 3W)`` with ``PP = 2p`` stages for DualPipeV
    (the DualPipe README), ``F&B`` the time of an overlapped pair (``pair_s``; ``F + B`` when run one after the
    other).  :func:`~.simulate.simulate` gives the exact idle time of the table; the two meet at ``F = I = W``
    (``tests/test_pipeline_zero_bubble.py``) and part elsewhere."""
    w = backward_s / 2 if weight_s is None else weight_s
    forms = {"GPipe": forward_s + backward_s, "1F1B": forward_s + backward_s,
             "Interleaved 1F1B": forward_s + backward_s,
             "ZB-H1": forward_s + backward_s - 2 * w, "Interleaved ZB": forward_s + backward_s - 2 * w,
             "ZB-V": forward_s + backward_s - 2 * w,
             "DualPipeV": (forward_s + backward_s if pair_s is None else pair_s) + backward_s - 3 * w}
    if name not in forms:
        raise ValueError(f"no closed form for {name!r}: one of {tuple(forms)}")
    return (p - 1) * forms[name]
