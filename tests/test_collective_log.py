"""The collective-sequence check: recording, comparing, and launch's errors that name where the ranks disagree."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
from torch.distributed import distributed_c10d as c10d

from labkit import launch
from labkit.launch import compare as collective_check
from labkit.launch import record as collective_log
from labkit.launch.compare import CollectiveMismatch, first_disagreement
from labkit.launch.record import Entry, read_log, record_collectives

HERE = Path(__file__)


def _line(marker: str) -> str:
    """``tests/test_collective_log.py:N`` (relative to the working directory, as reports show it), N being the
    line of this file that ends with ``# marker``."""
    lines = HERE.read_text().splitlines()
    number = next(index + 1 for index, line in enumerate(lines) if line.endswith(f"# {marker}"))
    return f"{os.path.relpath(HERE)}:{number}"


# ---------------------------------------------------------------------------------------------------------
# Functions the ranks run


def _rank_zero_skips_an_all_reduce():
    tensor = torch.ones(4)
    if torch_dist.get_rank() != 0:
        torch_dist.all_reduce(tensor)  # skipped
    torch_dist.barrier()  # rank 0 waits here


def _rank_zero_skips_a_last_all_reduce():
    if torch_dist.get_rank() != 0:
        torch_dist.all_reduce(torch.ones(4))  # last


def _opposite_orders():
    tensor = torch.ones(4)
    if torch_dist.get_rank() == 0:
        torch_dist.all_reduce(tensor)  # all_reduce first
        torch_dist.broadcast(tensor, src=0)
    else:
        torch_dist.broadcast(tensor, src=0)  # broadcast first
        torch_dist.all_reduce(tensor)


def _mismatched_shapes():
    torch_dist.all_reduce(torch.ones(4 + torch_dist.get_rank()))  # mismatched shapes


def _raise_before_an_all_reduce():
    if torch_dist.get_rank() == 1:
        raise ValueError("boom")
    torch_dist.all_reduce(torch.ones(2))


def _a_correct_program(log_dir):
    rank = torch_dist.get_rank()
    pairs = [torch_dist.new_group([0, 1]), torch_dist.new_group([2, 3])]
    mine, original = pairs[rank // 2], torch_dist.all_reduce
    with record_collectives(log_dir / f"{rank}.jsonl"):
        tensor = torch.ones(4)
        torch_dist.all_reduce(tensor)
        torch_dist.broadcast(tensor, src=3)
        for _ in range(1 + rank // 2):  # the two pairs call different numbers of collectives on their groups
            torch_dist.all_reduce(tensor, group=mine)
        objects = [None] * 4
        torch_dist.all_gather_object(objects, {"rank": rank})
        gathered = [torch.zeros(4) for _ in range(4)] if rank == 0 else None
        torch_dist.gather(tensor, gathered, dst=0)  # only the root passes a gather_list
        peer = rank ^ 1
        if rank % 2 == 0:
            torch_dist.send(tensor, peer)
        else:
            torch_dist.recv(tensor, peer)
        operation = torch_dist.isend if rank % 2 == 0 else torch_dist.irecv
        for work in torch_dist.batch_isend_irecv([torch_dist.P2POp(operation, torch.zeros(2, 2), peer)]):
            work.wait()
        compared = collective_check.check_collectives(timeout_s=10)
    return compared, torch_dist.all_reduce is original


def _check_on_demand(log_dir):
    rank, peer = torch_dist.get_rank(), 1 - torch_dist.get_rank()
    with record_collectives(log_dir / f"{rank}.jsonl"):
        torch_dist.all_reduce(torch.ones(3))
        agreed = collective_check.check_collectives(timeout_s=10)
        # Messages with the wrong tags: neither blocks (isend/irecv), and the check says so without hanging.
        posted = torch_dist.isend(torch.ones(3), peer, tag=1) if rank == 0 else \
            torch_dist.irecv(torch.zeros(3), peer, tag=2)
        try:
            collective_check.check_collectives(timeout_s=10)
        except CollectiveMismatch as error:
            mismatch = (str(error), error.disagreement.kind, error.absent_ranks)
        # Mend: post the other halves, so that every message is delivered before the ranks leave.
        mended = torch_dist.isend(torch.ones(3), peer, tag=2) if rank == 0 else \
            torch_dist.irecv(torch.zeros(3), peer, tag=1)
        posted.wait()
        mended.wait()
        absent = None
        if rank == 1:  # rank 0 never comes to this check
            try:
                collective_check.check_collectives(timeout_s=2)
            except CollectiveMismatch as error:
                absent = error.absent_ranks
    return agreed, mismatch, absent


# ---------------------------------------------------------------------------------------------------------
# launch's errors name the first disagreement


def test_a_collective_only_some_ranks_call_is_named_in_the_timeout():
    with pytest.raises(launch.CollectiveTimeout) as caught:
        launch.launch(_rank_zero_skips_an_all_reduce, nprocs=3, timeout=5.0, check_collectives=True)
    message = str(caught.value)
    assert message.startswith("ranks disagree at collective #1 on group [0, 1, 2]:")
    assert f"rank 0: barrier() at {_line('rank 0 waits here')}" in message
    assert f"ranks 1, 2: all_reduce(tensor=float32[4]) at {_line('skipped')}" in message
    assert message.index("ranks disagree") < message.index("was here")  # the report before the stacks
    found = caught.value.disagreement
    assert (found.kind, found.group_ranks, found.seq) == ("collective", (0, 1, 2), 0)
    assert [found.calls[rank].op for rank in range(3)] == ["barrier", "all_reduce", "all_reduce"]


def test_a_rank_that_never_calls_a_collective_the_others_call_is_named():
    with pytest.raises(launch.CollectiveTimeout) as caught:
        launch.launch(_rank_zero_skips_a_last_all_reduce, nprocs=3, timeout=5.0, check_collectives=True)
    assert str(caught.value).startswith(
        f"rank 0 never called collective #1 on group [0, 1, 2], which ranks 1, 2 called: all_reduce(tensor="
        f"float32[4]) at {_line('last')} in _rank_zero_skips_a_last_all_reduce")
    assert caught.value.disagreement.calls[0] is None


def test_collectives_called_in_different_orders_are_named_with_their_lines():
    with pytest.raises(launch.CollectiveTimeout) as caught:
        launch.launch(_opposite_orders, nprocs=2, timeout=5.0, check_collectives=True)
    message = str(caught.value)
    assert message.startswith("ranks disagree at collective #1 on group [0, 1]:")
    assert f"rank 0: all_reduce(tensor=float32[4]) at {_line('all_reduce first')}" in message
    assert f"rank 1: broadcast(tensor=float32[4], src=0) at {_line('broadcast first')}" in message


@pytest.mark.parametrize("nprocs", [2, 3])  # gloo aborts with two ranks, hangs with three (rank 0 even returns)
def test_mismatched_shapes_are_named_with_their_ranks_whatever_gloo_does(nprocs):
    with pytest.raises(launch.LaunchError) as caught:
        launch.launch(_mismatched_shapes, nprocs=nprocs, timeout=5.0, check_collectives=True)
    message = str(caught.value)
    assert message.startswith(f"ranks disagree at collective #1 on group {list(range(nprocs))}:")
    for rank in range(nprocs):
        assert f"rank {rank}: all_reduce(tensor=float32[{4 + rank}]) at {_line('mismatched shapes')}" in message


def test_a_rank_that_raised_is_not_reported_for_the_collectives_it_then_missed():
    with pytest.raises(launch.RankFailed) as caught:
        launch.launch(_raise_before_an_all_reduce, nprocs=2, timeout=10.0, check_collectives=True)
    assert caught.value.rank == 1 and caught.value.disagreement is None
    assert str(caught.value).startswith("rank 1 failed")


def test_without_check_collectives_the_error_is_as_before():
    with pytest.raises(launch.CollectiveTimeout) as caught:
        launch.launch(_opposite_orders, nprocs=2, timeout=3.0, check_collectives=False)
    assert caught.value.disagreement is None and str(caught.value).startswith("rank(s) [0, 1] did not finish")


# ---------------------------------------------------------------------------------------------------------
# Recording


def test_a_correct_program_records_the_same_sequences_on_every_rank(tmp_path):
    results = launch.launch(_a_correct_program, tmp_path, nprocs=4, timeout=60.0)
    logs = {rank: read_log(tmp_path / f"{rank}.jsonl") for rank in range(4)}
    assert first_disagreement(logs) is None
    assert all(compared == len(logs[rank]) and undone for rank, (compared, undone) in enumerate(results))
    world = {rank: [(e.seq, e.op, e.tensors if e.op != "gather" else e.tensors["tensor"], e.peer)
                    for e in entries if e.ranks == (0, 1, 2, 3) and e.op not in ("send", "recv", "isend", "irecv")]
             for rank, entries in logs.items()}
    assert world[0] == world[1] == world[2] == world[3]
    assert [op for _, op, _, _ in world[0]] == ["all_reduce", "broadcast", "all_gather_object", "gather"]
    assert [seq for seq, *_ in world[0]] == [0, 1, 2, 3]  # numbered per group: the pair collectives do not count
    pair_calls = {rank: [(e.seq, e.op) for e in entries if len(e.ranks) == 2] for rank, entries in logs.items()}
    assert pair_calls[0] == pair_calls[1] == [(0, "all_reduce")]
    assert pair_calls[2] == pair_calls[3] == [(0, "all_reduce"), (1, "all_reduce")]
    messages = {rank: [(e.op, e.peer, e.seq, e.tensors["tensor"]) for e in entries if e.tag is not None]
                for rank, entries in logs.items()}
    assert messages[0] == [("send", 1, 0, "float32[4]"), ("isend", 1, 1, "float32[2, 2]")]
    assert messages[1] == [("recv", 0, 0, "float32[4]"), ("irecv", 0, 1, "float32[2, 2]")]
    assert all(entry.where.startswith(f"{HERE}:") and entry.function == "_a_correct_program" and entry.user is None
               for entries in logs.values() for entry in entries)


def test_recording_is_undone_after_the_block_even_when_it_raises(tmp_path):
    originals = {name: getattr(torch_dist, name) for name in collective_log.RECORDED}
    with pytest.raises(KeyError), record_collectives(tmp_path / "log.jsonl"):
        assert torch_dist.all_reduce is not originals["all_reduce"]
        assert c10d.all_reduce is torch_dist.all_reduce  # code that calls either module is recorded
        assert torch_dist.isend == originals["isend"]  # so that P2POp accepts it
        raise KeyError("leave the block")
    assert {name: getattr(torch_dist, name) for name in collective_log.RECORDED} == originals
    assert all(getattr(c10d, name) is original for name, original in originals.items())


def test_recorded_ranks_compute_the_same_results():
    assert launch.launch(_sum_twice, nprocs=2, check_collectives=True) == launch.launch(_sum_twice, nprocs=2)
    assert launch.launch(_sum_twice, nprocs=2, check_collectives=True) == [[4.0] * 4] * 2


def _sum_twice():
    tensor = torch.ones(4)
    torch_dist.all_reduce(tensor)
    work = torch_dist.all_reduce(tensor, async_op=True)  # async collectives return their Work through the wrapper
    work.wait()
    return tensor.tolist()


# ---------------------------------------------------------------------------------------------------------
# The on-demand check


def test_check_collectives_passes_on_agreement_and_raises_on_a_mismatch_without_hanging(tmp_path):
    results = launch.launch(_check_on_demand, tmp_path, nprocs=2, timeout=30.0, check_collectives=True)
    for agreed, (message, kind, absent), _ in results:
        assert agreed == 1 and kind == "point-to-point" and absent == []
        assert message.startswith("ranks 0 and 1 disagree on point-to-point message #1 from rank 0 to rank 1 "
                                  "(tag 1)")
        assert "rank 1 receives: nothing" in message
    assert results[1][2] == [0]  # rank 0 never reached the last check: named, after timeout_s, not a hang


def test_check_collectives_without_recording_is_a_clear_error():
    with pytest.raises(RuntimeError, match="needs recording"):
        collective_check.check_collectives()


# ---------------------------------------------------------------------------------------------------------
# first_disagreement on hand-made logs (no processes)


def _entry(rank, seq, op="all_reduce", shape="float32[4]", ranks=(0, 1, 2, 3), peer=None, tag=None, index=None,
           tensors=None, line=12):
    return Entry(rank=rank, index=seq if index is None else index, group=",".join(map(str, ranks)), ranks=ranks,
                 seq=seq, op=op, tensors=tensors if tensors is not None else {"tensor": shape}, peer=peer, tag=tag,
                 where=f"/somewhere/foo.py:{line}", function="step")


def _logs(*per_rank):
    return dict(enumerate(per_rank))


def test_identical_sequences_agree():
    logs = {rank: [_entry(rank, 0), _entry(rank, 1, "broadcast", peer=0)] for rank in range(4)}
    assert first_disagreement(logs) is None


def test_a_rank_whose_sequence_ended_early_is_named_with_the_call_it_missed():
    logs = {rank: [_entry(rank, seq, line=10 + seq) for seq in range(3 if rank == 1 else 4)] for rank in range(4)}
    found = first_disagreement(logs)
    assert found.seq == 3 and found.calls[1] is None and found.calls[0].op == "all_reduce"
    assert found.message.splitlines()[0] == ("rank 1 never called collective #4 on group [0, 1, 2, 3], which ranks "
                                             "0, 2, 3 called: all_reduce(tensor=float32[4]) at foo.py:13 in step")
    assert "rank 1: no collective #4 (its last on this group: #3, all_reduce" in found.message
    assert first_disagreement(logs, failed=[1]) is None  # a rank that raised stops calling: not a disagreement


def test_other_shapes_dtypes_roots_or_ops_disagree():
    for rank_one in (_entry(1, 0, shape="float32[5]"), _entry(1, 0, shape="float16[4]"),
                     _entry(1, 0, "reduce_scatter_tensor")):
        found = first_disagreement({0: [_entry(0, 0, ranks=(0, 1))], 1: [_with_ranks(rank_one, (0, 1))]})
        assert found is not None and found.kind == "collective"
    roots = {rank: [_entry(rank, 0, "broadcast", ranks=(0, 1), peer=rank)] for rank in range(2)}
    assert "src=0" in first_disagreement(roots).message and "src=1" in first_disagreement(roots).message


def _with_ranks(entry: Entry, ranks: tuple[int, ...]) -> Entry:
    return Entry(**{**entry.__dict__, "ranks": ranks, "group": ",".join(map(str, ranks))})


def test_what_only_the_root_holds_and_uneven_all_to_all_splits_are_not_compared():
    gather = {rank: [_entry(rank, 0, "gather", ranks=(0, 1), peer=0,
                            tensors={"tensor": "float32[2]", **({"gather_list": ["float32[2]"] * 2} if rank == 0
                                                                 else {})})] for rank in range(2)}
    assert first_disagreement(gather) is None
    uneven = {rank: [_entry(rank, 0, "all_to_all_single", ranks=(0, 1),
                            tensors={"output": f"float32[{3 + rank}]", "input": "float32[4]"})] for rank in range(2)}
    assert first_disagreement(uneven) is None
    uneven[1] = [_entry(1, 0, "all_to_all_single", ranks=(0, 1), tensors={"output": "int64[4]", "input": "int64[4]"})]
    assert first_disagreement(uneven) is not None


def test_groups_are_compared_apart_and_the_earliest_disagreement_is_reported():
    pair_a, pair_b = (0, 1), (2, 3)
    logs = {rank: [_entry(rank, seq, ranks=pair_a if rank < 2 else pair_b, index=seq) for seq in range(1 + rank // 2)]
            for rank in range(4)}
    assert first_disagreement(logs) is None  # pair B calls more collectives than pair A: fine
    logs[3] = [logs[3][0], _entry(3, 1, shape="float32[5]", ranks=pair_b, index=1)]
    found = first_disagreement(logs)
    assert found.group_ranks == pair_b and found.seq == 1
    logs[1] = [_entry(1, 0, "barrier", ranks=pair_a, index=0, tensors={})]
    assert first_disagreement(logs).group_ranks == pair_a  # at index 0 in some log: earlier than pair B's
    assert first_disagreement({0: logs[0], 1: logs[1], 2: logs[2]}).group_ranks == pair_a  # B lacks rank 3: skipped


def test_point_to_point_messages_are_matched_in_order_per_channel():
    def send(seq, shape="float32[4]", tag=0):
        return _entry(0, seq, "send", shape, ranks=(0, 1), peer=1, tag=tag)

    def receive(seq, shape="float32[4]", tag=0, peer=0):
        return _entry(1, seq, "irecv", shape, ranks=(0, 1), peer=peer, tag=tag)

    assert first_disagreement(_logs([send(0), send(1)], [receive(0), receive(1, "float32[2, 2]")])) is None
    found = first_disagreement(_logs([send(0), send(1, "float32[5]")], [receive(0), receive(1)]))
    assert found.kind == "point-to-point" and found.seq == 1 and "float32[5]" in found.message
    found = first_disagreement(_logs([send(0), send(1)], [receive(0)]))
    assert "rank 1 receives: nothing" in found.message
    assert first_disagreement(_logs([send(0), send(1)], [receive(0)]), failed=[1]) is None
    assert first_disagreement(_logs([send(0, tag=1)], [receive(0, tag=2)])) is not None
    any_source = _entry(1, None, "recv", ranks=(0, 1), peer=None, tag=0)
    assert first_disagreement(_logs([send(0), send(1)], [receive(0), any_source])) is None  # cannot be matched


def test_logs_round_trip_through_json_lines_and_a_cut_line_is_ignored(tmp_path):
    path = tmp_path / "log.jsonl"
    entries = [_entry(0, 0), _entry(0, 1, "broadcast", peer=2)]
    text = "".join(json.dumps(entry.__dict__) + "\n" for entry in entries)
    path.write_text(text + text[:40])
    assert read_log(path) == entries
    assert read_log(tmp_path / "missing.jsonl") == []
