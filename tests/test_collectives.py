"""labkit.collectives against torch.distributed's own collectives, on 1-4 gloo ranks.

Launching ranks is the slow part (fork, rendezvous), so every case for one world size runs inside one launch
(``_every_case_on_this_rank``) and the tests read its report.  Inputs are multiples of 1/4 in [-1, 1]: every
partial sum is exact in float32, float16 and bfloat16, so the order in which a ring adds cannot matter and
results must match torch *bit for bit* — a wrong chunk, a stale buffer or a missed segment all show.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist

from labkit.collectives import (
    broadcast,
    chunk_bounds,
    naive_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    tree_all_reduce,
)
from labkit.costmodel import collectives as costs
from labkit.costmodel.collectives import LinkModel, bus_bandwidth
from labkit.launch import launch
from labkit.measure import measure_alpha_beta

WORLD_SIZES = (1, 2, 3, 4)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SHAPES = ((), (0,), (1,), (7,), (3, 5), (1000,), (4097,))
# The default segments (one per chunk at these sizes), and a tiny one that cuts chunks into many
# pipelined segments — more than there are receive slots, so the slots are reused.
SEGMENT_BYTES = (None, 200)
RECORD_NUMELS = (0, 1, 5, 1001)  # byte-count checks: empty, fewer elements than ranks, uneven chunks
FUNCTIONS = ("ring_all_reduce", "naive_all_reduce", "tree_all_reduce", "ring_reduce_scatter", "ring_all_gather", "broadcast",
             "returns_its_input", "subgroup")


# --------------------------------------------------------------------------------------------------------
# What every rank runs


def _layouts(shape: tuple[int, ...]) -> list[str]:
    numel = math.prod(shape)
    return ["contiguous"] + (["strided"] if numel >= 2 else []) + (["transposed"] if len(shape) == 2 else [])


def _with_layout(values: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values, stored contiguously, as every other element of a longer buffer, or transposed."""
    if layout == "contiguous":
        return values.clone()
    if layout == "strided":
        storage = torch.full((2 * values.numel(),), -7.0, dtype=values.dtype)
        strided = storage[::2].view(values.shape)
        strided.copy_(values)
        return strided
    return values.t().contiguous().t()


def _values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """This rank's input (seed includes the rank): multiples of 1/4 in [-1, 1]."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=generator).to(dtype) / 4


def _mismatch(got: torch.Tensor, expected: torch.Tensor) -> str | None:
    """None when bit-identical, else the first difference."""
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return f"got {got.dtype} {tuple(got.shape)}, expected {expected.dtype} {tuple(expected.shape)}"
    if torch.equal(got, expected):
        return None
    flat_got, flat_expected = got.reshape(-1), expected.reshape(-1)
    differ = flat_got != flat_expected
    index = int(differ.nonzero()[0])
    return (f"first difference at flat index {index}: got {flat_got[index].item()}, expected "
            f"{flat_expected[index].item()} ({int(differ.sum())} of {got.numel()} elements differ)")


def _every_case_on_this_rank() -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    failures: dict[str, list[str]] = {name: [] for name in FUNCTIONS}
    cases = dict.fromkeys(FUNCTIONS, 0)
    caught_wrong_answers: list[bool] = []

    def check(name: str, case: str, got: torch.Tensor, expected: torch.Tensor) -> None:
        cases[name] += 1
        problem = _mismatch(got, expected)
        if problem:
            failures[name].append(f"rank {rank}, {case}: {problem}")

    for dtype in DTYPES:
        for shape_index, shape in enumerate(SHAPES):
            for layout in _layouts(shape):
                for op in ("sum", "avg"):
                    for segment_bytes in SEGMENT_BYTES:
                        case = f"{dtype} shape={shape} {layout} op={op} segment_bytes={segment_bytes}"
                        x = _values(shape, dtype, seed=100 * shape_index + rank)
                        torch_op = dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM
                        reference = x.clone()
                        dist.all_reduce(reference, op=torch_op)
                        numel = reference.numel()
                        start, stop = chunk_bounds(numel, world_size)[rank]

                        ours = _with_layout(x, layout)
                        strides = ours.stride()
                        returned = ring_all_reduce(ours, op=op, segment_bytes=segment_bytes)
                        check("ring_all_reduce", case, ours.contiguous(), reference)
                        cases["returns_its_input"] += 1
                        if returned is not ours or ours.stride() != strides:
                            failures["returns_its_input"].append(f"ring_all_reduce, {case}")

                        # The same comparison must catch a result that is one ulp off in one element.
                        if numel > 0:
                            wrong = reference.clone().view(-1)
                            wrong[numel // 2] = torch.nextafter(wrong[numel // 2], torch.tensor(2.0, dtype=dtype))
                            caught_wrong_answers.append(_mismatch(wrong.view(reference.shape), reference) is not None)

                        ours = _with_layout(x, layout)
                        naive_all_reduce(ours, op=op)
                        check("naive_all_reduce", case, ours.contiguous(), reference)

                        ours = _with_layout(x, layout)
                        tree_all_reduce(ours, op=op)
                        check("tree_all_reduce", case, ours.contiguous(), reference)

                        # Reduce-scatter: torch's reduce_scatter_tensor when chunks are equal, else the
                        # all-reduce result's chunk.
                        ours = _with_layout(x, layout)
                        chunk = ring_reduce_scatter(ours, op=op, segment_bytes=segment_bytes)
                        if numel > 0 and numel % world_size == 0:
                            expected_chunk = torch.empty(numel // world_size, dtype=dtype)
                            dist.reduce_scatter_tensor(expected_chunk, x.reshape(-1).clone(), op=torch_op)
                        else:
                            expected_chunk = reference.reshape(-1)[start:stop]
                        check("ring_reduce_scatter", case, chunk, expected_chunk)
                        cases["returns_its_input"] += 1
                        if layout == "contiguous" and numel > 0 and chunk.data_ptr() != ours.view(-1)[start:].data_ptr():
                            failures["returns_its_input"].append(f"ring_reduce_scatter (not a view), {case}")

                        if op == "avg":
                            continue  # all-gather and broadcast do not reduce: once per case is enough
                        # All-gather: only this rank's chunk is valid at the start (the rest is 99).
                        own = x.reshape(-1)[start:stop]
                        buffer = torch.full((numel,), 99.0, dtype=dtype)
                        buffer[start:stop] = own
                        buffer = _with_layout(buffer.view(shape), layout)
                        ring_all_gather(buffer, segment_bytes=segment_bytes)
                        if numel > 0 and numel % world_size == 0:
                            expected_gather = torch.empty(numel, dtype=dtype)
                            dist.all_gather_into_tensor(expected_gather, own.clone())
                        else:  # uneven chunks: each rank places its chunk in zeros, and a sum assembles them
                            expected_gather = torch.zeros(numel, dtype=dtype)
                            expected_gather[start:stop] = own
                            dist.all_reduce(expected_gather)
                        check("ring_all_gather", case, buffer.reshape(-1), expected_gather)

                        for src in range(world_size):
                            ours = _with_layout(x, layout)
                            broadcast(ours, src=src)
                            expected = x.clone()
                            dist.broadcast(expected, src=src)
                            check("broadcast", f"{case} src={src}", ours.contiguous(), expected)

    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):  # torch's op names work too
        x = _values((10,), torch.float32, seed=rank)
        reference = x.clone()
        dist.all_reduce(reference, op=op)
        for name, function in (("ring_all_reduce", ring_all_reduce), ("naive_all_reduce", naive_all_reduce),
                               ("tree_all_reduce", tree_all_reduce)):
            ours = function(x.clone(), op=op)
            check(name, f"op={op}", ours, reference)
        check("ring_reduce_scatter", f"op={op}", ring_reduce_scatter(x.clone(), op=op),
              reference[slice(*chunk_bounds(10, world_size)[rank])])

    if world_size >= 3:  # a subgroup of ranks 1..N-1: group ranks differ from global ranks
        members = list(range(1, world_size))
        group = dist.new_group(members)
        if rank in members:
            x = _values((101,), torch.float32, seed=rank)
            for name, function in (("ring_all_reduce", ring_all_reduce), ("naive_all_reduce", naive_all_reduce),
                                   ("tree_all_reduce", tree_all_reduce),
                                   ("broadcast", lambda tensor, group: broadcast(tensor, src=1, group=group))):
                reference = x.clone()
                if name == "broadcast":
                    dist.broadcast(reference, src=members[1], group=group)
                else:
                    dist.all_reduce(reference, group=group)
                check("subgroup", name, function(x.clone(), group=group), reference)

    return {"failures": failures, "cases": cases, "caught_wrong_answers": caught_wrong_answers,
            "bytes_sent": _bytes_sent_by_this_rank(), "records": _recorded_all_reduce(),
            "timed_record": _timed_record()}


def _bytes_sent_by_this_rank() -> dict[tuple[str, int, str], int]:
    """Bytes in this rank's send records, per (algorithm, numel, dtype)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    sent = {}
    for dtype in (torch.float32, torch.bfloat16):
        for numel in RECORD_NUMELS:
            runs = {
                "ring_all_reduce": lambda x, record: ring_all_reduce(x, record=record, segment_bytes=64),
                "ring_reduce_scatter": lambda x, record: ring_reduce_scatter(x, record=record, segment_bytes=64),
                "ring_all_gather": lambda x, record: ring_all_gather(x, record=record, segment_bytes=64),
                "naive_all_reduce": lambda x, record: naive_all_reduce(x, record=record),
                "tree_all_reduce": lambda x, record: tree_all_reduce(x, record=record),
                "broadcast from 0": lambda x, record: broadcast(x, src=0, record=record),
                f"broadcast from {world_size - 1}": lambda x, record: broadcast(x, src=world_size - 1, record=record),
            }
            for name, run in runs.items():
                record: list[dict] = []
                run(torch.ones(numel, dtype=dtype), record)
                assert all(entry["src"] == rank for entry in record), f"{name}: a record names another sender"
                sent[(name, numel, str(dtype))] = sum(entry["bytes"] for entry in record)
    return sent


def _recorded_all_reduce() -> list[dict]:
    record: list[dict] = []
    ring_all_reduce(torch.ones(12 * dist.get_world_size()), record=record)
    return record


def _timed_record() -> tuple[float, list[float], float]:
    """The send times of a ring all-reduce (3 segments per chunk), beside the times the call began and ended."""
    record: list[dict] = []
    begin = time.perf_counter()
    ring_all_reduce(torch.ones(12 * dist.get_world_size()), record=record, segment_bytes=16)
    return begin, [entry["time_s"] for entry in record], time.perf_counter()


@pytest.fixture(scope="module")
def reports() -> dict[int, list[dict]]:
    """One launch per world size, every case inside it; per world size, the list of per-rank reports."""
    return {world_size: launch(_every_case_on_this_rank, nprocs=world_size, timeout=120, rank_output="none")
            for world_size in WORLD_SIZES}


def _assert_no_failures(reports: dict[int, list[dict]], world_size: int, name: str, first_rank: int = 0) -> None:
    per_rank = reports[world_size][first_rank:]
    assert all(report["cases"][name] > 0 for report in per_rank), f"{name}: no cases ran on {world_size} ranks"
    problems = [problem for report in per_rank for problem in report["failures"][name]]
    shown = "\n".join(problems[:10])
    assert not problems, f"{name} differs from torch in {len(problems)} case(s) on {world_size} ranks:\n{shown}"


# --------------------------------------------------------------------------------------------------------
# Results match torch.distributed


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_all_reduce_matches_torch_for_every_dtype_shape_layout_and_op(reports, world_size):
    _assert_no_failures(reports, world_size, "ring_all_reduce")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_reduce_scatter_leaves_each_rank_its_reduced_chunk(reports, world_size):
    _assert_no_failures(reports, world_size, "ring_reduce_scatter")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_all_gather_fills_every_chunk_from_its_owner(reports, world_size):
    _assert_no_failures(reports, world_size, "ring_all_gather")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_tree_broadcast_matches_torch_from_every_root(reports, world_size):
    _assert_no_failures(reports, world_size, "broadcast")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_naive_all_reduce_matches_torch(reports, world_size):
    _assert_no_failures(reports, world_size, "naive_all_reduce")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_results_are_written_in_place_into_the_callers_tensor(reports, world_size):
    _assert_no_failures(reports, world_size, "returns_its_input")


@pytest.mark.parametrize("world_size", (3, 4))
def test_collectives_work_on_a_subgroup_whose_ranks_differ_from_global_ranks(reports, world_size):
    _assert_no_failures(reports, world_size, "subgroup", first_rank=1)  # rank 0 is not in the subgroup


def test_the_exact_comparison_catches_a_one_ulp_error(reports):
    caught = [flag for report in reports[2] for flag in report["caught_wrong_answers"]]
    assert caught and all(caught), "a result one ulp off went unnoticed: the comparisons above prove nothing"


# --------------------------------------------------------------------------------------------------------
# The cost model counts the bytes a real run sends


@pytest.mark.parametrize("world_size", (2, 3, 4))
@pytest.mark.parametrize("numel", RECORD_NUMELS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_cost_model_bytes_equal_bytes_actually_sent(reports, world_size, numel, dtype):
    element_size = torch.tensor([], dtype=dtype).element_size()
    nbytes = numel * element_size
    models = {
        "ring_all_reduce": costs.ring_all_reduce_cost(nbytes, world_size, element_size=element_size),
        "ring_reduce_scatter": costs.ring_reduce_scatter_cost(nbytes, world_size, element_size=element_size),
        "ring_all_gather": costs.ring_all_gather_cost(nbytes, world_size, element_size=element_size),
        "naive_all_reduce": costs.naive_all_reduce_cost(nbytes, world_size),
        "tree_all_reduce": costs.tree_all_reduce_cost(nbytes, world_size),
        "broadcast from 0": costs.tree_broadcast_cost(nbytes, world_size, src=0),
        f"broadcast from {world_size - 1}": costs.tree_broadcast_cost(nbytes, world_size, src=world_size - 1),
    }
    for name, model in models.items():
        measured = [report["bytes_sent"][(name, numel, str(dtype))] for report in reports[world_size]]
        assert measured == model.bytes_sent, (f"{name}, {numel} x {dtype} on {world_size} ranks: ranks sent "
                                              f"{measured} bytes, the cost model says {model.bytes_sent}")


@pytest.mark.parametrize("world_size", (2, 3, 4))
def test_records_follow_the_textbook_ring_schedule(reports, world_size):
    """Step s of reduce-scatter: rank r sends chunk r-s-1 to r+1; of all-gather: chunk r-s.  Once each."""
    for rank, report in enumerate(reports[world_size]):
        expected = [("reduce-scatter", step, (rank - step - 1) % world_size) for step in range(world_size - 1)]
        expected += [("all-gather", step, (rank - step) % world_size) for step in range(world_size - 1)]
        got = [(entry["phase"], entry["step"], entry["chunk"]) for entry in report["records"]]
        assert got == expected, f"rank {rank} of {world_size}: sent (phase, step, chunk) {got}, expected {expected}"
        assert {entry["dst"] for entry in report["records"]} == {(rank + 1) % world_size}
        assert all(entry["algorithm"] == "ring_all_reduce" and entry["bytes"] == 12 * 4
                   for entry in report["records"]), report["records"]


@pytest.mark.parametrize("world_size", (2, 3, 4))
def test_records_say_when_each_send_was_posted_within_the_call_in_order(reports, world_size):
    for rank, report in enumerate(reports[world_size]):
        begin, times, end = report["timed_record"]
        assert len(times) == 2 * (world_size - 1) * 3, (rank, len(times))
        assert begin <= times[0] and times[-1] <= end, (rank, begin, times, end)
        assert times == sorted(times), f"rank {rank}: send times out of order: {times}"


def test_cost_model_states_the_textbook_results():
    link = LinkModel(alpha_s=1e-5, beta_s_per_byte=1e-9)
    n = 1 << 20
    for world_size in (2, 4, 8):
        ring = costs.ring_all_reduce_cost(n, world_size, link)
        assert ring.bytes_sent == [2 * (world_size - 1) * n // world_size] * world_size
        assert ring.steps == 2 * (world_size - 1)
        assert ring.time_s == pytest.approx(2 * (world_size - 1) * link.alpha_s
                                            + 2 * (world_size - 1) / world_size * n * link.beta_s_per_byte)
        naive = costs.naive_all_reduce_cost(n, world_size, link)
        assert naive.bytes_sent == [(world_size - 1) * n] + [n] * (world_size - 1)
        assert naive.time_s == pytest.approx(2 * (world_size - 1) * (link.alpha_s + n * link.beta_s_per_byte))
        tree = costs.tree_broadcast_cost(n, world_size, link)
        assert tree.bytes_sent[0] == math.log2(world_size) * n
        assert sum(tree.bytes_sent) == (world_size - 1) * n  # every rank but the root receives one copy
        assert tree.time_s == pytest.approx(math.log2(world_size) * (link.alpha_s + n * link.beta_s_per_byte))
    # the ring's bandwidth term stays below 2 n beta while the parameter server's grows with N
    assert costs.ring_all_reduce_cost(n, 64, LinkModel(0.0, 1e-9)).time_s < 2 * n * 1e-9
    assert costs.naive_all_reduce_cost(n, 64, LinkModel(0.0, 1e-9)).time_s == pytest.approx(126 * n * 1e-9)


def test_an_all_to_all_sends_its_node_share_and_its_network_share_at_once():
    nvlink, network = LinkModel(3.4e-6, 1 / 450e9), LinkModel(14e-6, 1 / 50e9)
    n = 16 << 20  # a rank's 16 MiB input, 1 MiB for each of 16 ranks, 8 of them on its node
    one_link = costs.all_to_all_cost(n, 16, nvlink, element_size=2)
    assert one_link.bytes_sent == [15 << 20] * 16 and one_link.steps == 15  # its own MiB stays home
    assert one_link.time_s == pytest.approx(15 * (3.4e-6 + (1 << 20) / 450e9))
    two = costs.all_to_all_cost(n, 16, nvlink, element_size=2, local=8, inter=network)
    on_node, off_node = 7 * (3.4e-6 + (1 << 20) / 450e9), 8 * (14e-6 + (1 << 20) / 50e9)  # 30 us, 280 us
    assert two.time_s == pytest.approx(max(on_node, off_node)) and two.time_s == pytest.approx(279.8e-6, rel=1e-3)
    assert two.bytes_sent == one_link.bytes_sent  # the same bytes leave, on two links
    assert costs.all_to_all_seconds((7, 7 << 20), (0, 0.0), nvlink, network) == pytest.approx(on_node)
    assert costs.all_to_all_cost(n, 1, nvlink, element_size=2).time_s == 0.0


def test_bus_bandwidth_uses_the_nccl_tests_convention():
    assert bus_bandwidth(1e9, 1.0, 4, "all_reduce") == pytest.approx(1.5e9)  # algbw * 2 (N-1)/N
    assert bus_bandwidth(1e9, 1.0, 4, "all_gather") == pytest.approx(0.75e9)
    assert bus_bandwidth(1e9, 1.0, 4, "reduce_scatter") == pytest.approx(0.75e9)
    assert bus_bandwidth(1e9, 2.0, 4, "broadcast") == pytest.approx(0.5e9)
    with pytest.raises(ValueError, match="all-to-all"):
        bus_bandwidth(1e9, 1.0, 4, "all-to-all")


def test_chunk_bounds_gives_the_first_ranks_one_extra_element():
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert chunk_bounds(0, 3) == [(0, 0)] * 3


def _fits_on_each_rank() -> dict[str, LinkModel]:
    return {pattern: measure_alpha_beta(sizes=(8, 1 << 12, 1 << 16, 1 << 20), iterations=5, pattern=pattern)
            for pattern in ("ring", "ping-pong")}


def test_measure_alpha_beta_gives_every_rank_the_same_physical_fit():
    # Timing-based: only what holds on a busy machine too (the figures themselves belong to the benchmark).
    fits = launch(_fits_on_each_rank, nprocs=3, timeout=60, rank_output="none")
    for pattern in ("ring", "ping-pong"):
        assert fits[0][pattern] == fits[1][pattern] == fits[2][pattern], f"ranks disagree on the {pattern} fit"
        link = fits[0][pattern]
        assert math.isfinite(link.alpha_s) and link.alpha_s >= 0, f"{pattern}: latency {link.alpha_s!r}"
        assert math.isfinite(link.beta_s_per_byte) and link.beta_s_per_byte > 0, f"{pattern}: beta {link!r}"


def test_fit_alpha_beta_recovers_a_known_line_and_survives_noise():
    sizes = [8, 1 << 10, 1 << 14, 1 << 17, 1 << 20]
    exact = costs.fit_alpha_beta(sizes, [20e-6 + size * 1e-9 for size in sizes])
    assert exact.alpha_s == pytest.approx(20e-6, rel=1e-9) and exact.beta_s_per_byte == pytest.approx(1e-9, rel=1e-9)
    # a scheduler hiccup on the small messages tilts the line downwards: the fit must stay physical
    noisy = costs.fit_alpha_beta(sizes, [4e-3, 4e-3, 4e-3, 1e-3, 1.2e-3])
    assert noisy.alpha_s >= 0 and noisy.beta_s_per_byte > 0
    with pytest.raises(ValueError, match="positive"):
        costs.fit_alpha_beta([1, 2], [1e-3, 0.0])


# --------------------------------------------------------------------------------------------------------
# Bad input fails loudly


def test_a_non_tensor_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match=r"list.*\[1, 2, 3\]"):
        ring_all_reduce([1, 2, 3])
    with pytest.raises(TypeError, match="ndarray"):
        broadcast(torch.ones(3).numpy())


def test_an_unknown_op_is_an_error_naming_it():
    with pytest.raises(ValueError, match="'max'"):
        ring_all_reduce(torch.ones(3), op="max")
    with pytest.raises(ValueError, match="MAX"):
        ring_reduce_scatter(torch.ones(3), op=dist.ReduceOp.MAX)
    with pytest.raises(TypeError, match="int 3"):
        naive_all_reduce(torch.ones(3), op=3)
    with pytest.raises(TypeError, match="int64"):
        ring_all_reduce(torch.ones(3, dtype=torch.int64), op="avg")


def test_record_must_be_a_list():
    with pytest.raises(TypeError, match="record"):
        ring_all_gather(torch.ones(3), record="yes")


def test_calling_without_a_process_group_says_how_to_get_one():
    assert not dist.is_initialized()
    for function in (ring_all_reduce, ring_reduce_scatter, ring_all_gather, broadcast, naive_all_reduce):
        with pytest.raises(RuntimeError, match="labkit.launch.*init_process_group"):
            function(torch.ones(3))


def _bad_calls_inside_a_job() -> dict[str, str]:
    errors = {}
    for label, call in (("src", lambda: broadcast(torch.ones(3), src=2)),
                        ("segment_bytes", lambda: ring_all_reduce(torch.ones(3), segment_bytes=0))):
        try:
            call()
        except ValueError as error:
            errors[label] = str(error)
    return errors


def test_a_root_outside_the_group_or_a_zero_segment_is_a_value_error():
    errors = launch(_bad_calls_inside_a_job, nprocs=2, timeout=30, rank_output="none")[0]
    assert "src" in errors and "0..1" in errors["src"] and "2" in errors["src"], errors
    assert "segment_bytes" in errors and "0" in errors["segment_bytes"], errors


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_tree_all_reduce_matches_torch(reports, world_size):
    _assert_no_failures(reports, world_size, "tree_all_reduce")


def test_the_tree_beats_the_ring_for_small_messages_and_loses_for_large_ones():
    link = LinkModel(alpha_s=20e-6, beta_s_per_byte=1e-10)
    small, large = 1024, 256 << 20
    assert (costs.tree_all_reduce_cost(small, 64, link).time_s
            < costs.ring_all_reduce_cost(small, 64, link).time_s)
    assert (costs.tree_all_reduce_cost(large, 64, link).time_s
            > costs.ring_all_reduce_cost(large, 64, link).time_s)
    assert costs.tree_all_reduce_cost(small, 64, link).steps == 12  # 2 log2(64)
