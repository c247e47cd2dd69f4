"""labkit.mesh: the (pp, dp, tp) layout as pure arithmetic, and Mesh's groups on 1, 2, 4 and 8 gloo ranks.

Launching is the slow part, so every mesh for one world size is built inside one launch (``_every_case``) and
the tests read its report.  Each group is checked by what a collective over it does (an all-gather of the
global ranks, an all-reduce of them), not only by what the Mesh says about itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from labkit import mesh as mesh_module
from labkit.launch import launch
from labkit.mesh import DIMS, Mesh, describe_layout, mesh_coordinates, mesh_groups
from labkit.parallel.ddp import DistributedDataParallel
from tests.conftest import REPO

LAYOUTS = {  # world size -> (dp, tp, pp, cp) meshes built on it
    1: [(1, 1, 1, 1)],
    2: [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)],
    4: [(4, 1, 1, 1), (2, 2, 1, 1), (1, 2, 2, 1), (2, 1, 2, 1), (1, 1, 4, 1), (2, 1, 1, 2), (1, 2, 1, 2)],
    8: [(2, 2, 2, 1), (1, 4, 2, 1), (2, 4, 1, 1), (8, 1, 1, 1), (2, 1, 2, 2), (1, 2, 2, 2)],
}


# --------------------------------------------------------------------------------------------------------
# The layout, without any process group


def test_coordinates_are_the_grid_arange_world_view_pp_dp_cp_tp():
    for world_size, layouts in LAYOUTS.items():
        for dp, tp, pp, cp in layouts:
            grid = torch.arange(world_size).view(pp, dp, cp, tp)
            for rank, coords in enumerate(mesh_coordinates(world_size, dp=dp, tp=tp, pp=pp, cp=cp)):
                assert list(coords) == list(DIMS)
                assert grid[coords["pp"], coords["dp"], coords["cp"], coords["tp"]].item() == rank, (dp, tp, pp, rank)


def test_cp_sits_between_dp_and_tp_and_dp_cp_flattens_the_two():
    groups = mesh_groups(8, dp=2, tp=1, pp=2, cp=2)
    assert groups["cp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp_cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh_groups(8, tp=2, cp=4)["cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]  # tp stays innermost
    text = describe_layout(dp=2, pp=2, cp=2)
    assert text.splitlines()[0].split() == ["rank", "pp", "dp", "cp", "tp"] and "cp groups: [0, 1] [2, 3]" in text


def test_tp_groups_are_neighbouring_ranks_and_pp_groups_span_the_farthest():
    groups = mesh_groups(8, dp=2, tp=2, pp=2)
    assert groups == {"pp": [[0, 4], [1, 5], [2, 6], [3, 7]], "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                      "tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "cp": [[rank] for rank in range(8)],
                      "dp_cp": [[0, 2], [1, 3], [4, 6], [5, 7]]}
    for dp, tp, pp in [(2, 4, 2), (1, 8, 2), (4, 2, 2)]:
        for group in mesh_groups(dp * tp * pp, dp=dp, tp=tp, pp=pp)["tp"]:
            assert group == list(range(group[0], group[0] + tp))  # one node's worth of adjacent ranks


def test_every_rank_is_in_exactly_one_group_per_dimension():
    groups = mesh_groups(24, dp=2, tp=3, pp=4)
    for dim, size in (("dp", 2), ("tp", 3), ("pp", 4)):
        assert all(len(group) == size for group in groups[dim]), dim
        assert sorted(rank for group in groups[dim] for rank in group) == list(range(24)), dim


def test_describe_layout_gives_each_rank_its_place_in_its_ep_group():
    """Lesson 14's table: with ep > 1 an ep column, each rank's place in its ep group (it holds the experts from that
    place times E / ep), and the ep and edp groups, each listed once; with tp = 8 filling an 8-GPU node, every ep
    group has one rank a node."""
    lines = describe_layout(dp=4, tp=2, ep=2).splitlines()
    assert lines[0].split() == ["rank", "pp", "dp", "tp", "ep"]
    assert [int(line.split()[-1]) for line in lines[1:9]] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [line.split(":")[0] for line in lines[9:]] == ["tp groups", "dp groups", "pp groups", "ep groups",
                                                        "edp groups"]
    groups = mesh_groups(64, dp=8, tp=8, ep=8)["ep"]
    assert all(len({rank // 8 for rank in group}) == 8 for group in groups)
    assert "ep" not in describe_layout(dp=4, tp=2).splitlines()[0].split()


def test_describe_layout_shows_every_rank_and_every_group():
    text = describe_layout(dp=2, tp=2, pp=2)
    assert text.splitlines()[0].split() == ["rank", "pp", "dp", "tp"]
    assert text.splitlines()[6].split() == ["5", "1", "0", "1"]
    assert "tp groups: [0, 1] [2, 3] [4, 5] [6, 7]" in text and "pp groups: [0, 4] [1, 5]" in text


@pytest.mark.parametrize(("sizes", "message"), [
    ({"dp": 3}, r"dp=3 \* tp=1 \* pp=1 = 3, but the world size is 4"),
    ({"dp": 2, "cp": 3}, r"dp \* cp \* tp \* pp must equal .*dp=2 \* cp=3 \* tp=1 \* pp=1 = 6"),
    ({"dp": 2, "tp": 4}, r"= 8, but the world size is 4"),
    ({"dp": 0, "tp": 4}, "dp must be an integer >= 1.*got 0"),
    ({"tp": -2}, "tp must be .*got -2"),
    ({"pp": 2.0}, "pp must be .*got 2.0"),
    ({"dp": True}, "dp must be .*got True"),
    ({"tp": "2"}, "tp must be .*got '2'"),
])
def test_bad_sizes_raise_naming_them(sizes, message):
    with pytest.raises(ValueError, match=message):
        mesh_coordinates(4, **sizes)


def test_mesh_without_a_process_group_is_the_clear_error_of_require_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="labkit.launch"):
        Mesh(dp=1)
    with pytest.raises(ValueError, match="tp must be"):  # a bad size is reported first
        Mesh(tp=0)


# --------------------------------------------------------------------------------------------------------
# What every rank runs


def _probe(mesh: Mesh) -> dict:
    """What the Mesh says, and what collectives over its groups do."""
    rank = dist.get_rank()
    found = {"coords": mesh.coords(), "repr": repr(mesh)}
    for dim in (*DIMS, "dp_cp"):
        group = mesh.group(dim)
        everyone = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, torch.tensor([rank]), group=group)
        total = torch.tensor([rank])
        dist.all_reduce(total, group=group)
        found[dim] = {"rank": mesh.rank(dim) if dim in DIMS else None,
                      "size": mesh.size(dim) if dim in DIMS else None, "ranks": mesh.ranks(dim),
                      "gathered": [int(t) for t in everyone], "sum": int(total)}
    return found


def _bad_mesh_errors(world_size: int) -> dict:
    """Bad sizes and dimension names raise on every rank before any group is made."""
    made = []
    real = mesh_module.init_device_mesh
    mesh_module.init_device_mesh = lambda *args, **kwargs: made.append(args) or real(*args, **kwargs)
    errors = {}
    try:
        for sizes in ({"dp": world_size + 1}, {"dp": world_size, "pp": 2}, {"tp": 0}):
            try:
                Mesh(**sizes)
                errors[str(sizes)] = "no error"
            except ValueError as error:
                errors[str(sizes)] = str(error)
        errors["groups_made"] = len(made)
        mesh = Mesh(dp=world_size)
        errors["groups_made_by_a_good_mesh"] = len(made)
        for dim in ("xp", "DP", 0):
            try:
                mesh.group(dim)
                errors[repr(dim)] = "no error"
            except ValueError as error:
                errors[repr(dim)] = str(error)
    finally:
        mesh_module.init_device_mesh = real
    return errors


def _ddp_over_the_dp_dimension() -> dict:
    """Mesh(dp=2, tp=2) on 4 ranks: DDP over mesh.group("dp") averages within each DP group only."""
    mesh = Mesh(dp=2, tp=2)
    rank = dist.get_rank()
    found = {}
    for name, group in (("process group", mesh.group("dp")), ("device mesh", mesh.device_mesh["dp"])):
        torch.manual_seed(rank)  # every rank starts elsewhere: each group's first rank's weights must win
        model = nn.Linear(3, 2)
        initial = [p.detach().clone() for p in model.parameters()]
        ddp = DistributedDataParallel(model, group=group)
        ddp(torch.full((4, 3), float(rank))).square().mean().backward()
        local = nn.Linear(3, 2)  # the same weights, this rank's gradient alone
        local.load_state_dict(model.state_dict())
        local(torch.full((4, 3), float(rank))).square().mean().backward()
        found[name] = {"initial": initial, "after_broadcast": [p.detach().clone() for p in model.parameters()],
                       "mean": [p.grad.clone() for p in model.parameters()],
                       "local": [p.grad.clone() for p in local.parameters()], "dp_ranks": mesh.ranks("dp")}
    return found


def _probe_layouts(world_size: int) -> dict:
    return {"meshes": {sizes: _probe(Mesh(*sizes)) for sizes in LAYOUTS[world_size]}}


def _every_case(world_size: int) -> dict:
    report = {**_probe_layouts(world_size), "errors": _bad_mesh_errors(world_size)}
    report["describe"] = Mesh(*LAYOUTS[world_size][0]).describe()
    if world_size == 4:
        report["ddp"] = _ddp_over_the_dp_dimension()
    return report


@pytest.fixture(scope="module")
def reports() -> dict[int, list[dict]]:
    return {world_size: launch(_every_case, world_size, nprocs=world_size, timeout=120, rank_output="none")
            for world_size in LAYOUTS}


def _check_probes(per_rank: list[dict], world_size: int, layouts: list[tuple[int, int, int]]) -> None:
    for dp, tp, pp, cp in layouts:
        expected_coords = mesh_coordinates(world_size, dp=dp, tp=tp, pp=pp, cp=cp)
        expected_groups = mesh_groups(world_size, dp=dp, tp=tp, pp=pp, cp=cp)
        for rank, report in enumerate(per_rank):
            found = report["meshes"][dp, tp, pp, cp]
            where = f"Mesh(dp={dp}, tp={tp}, pp={pp}, cp={cp}), rank {rank}/{world_size}"
            assert found["coords"] == expected_coords[rank], where
            assert found["repr"] == f"Mesh(dp={dp}, tp={tp}, pp={pp}" + (f", cp={cp})" if cp > 1 else ")")
            for dim, size in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp), ("dp_cp", None)):
                (group,) = [group for group in expected_groups[dim] if rank in group]
                probe = found[dim]
                if size is not None:
                    assert probe["rank"] == expected_coords[rank][dim] == group.index(rank), (where, dim)
                    assert probe["size"] == size, (where, dim)
                assert probe["ranks"] == probe["gathered"] == group, (where, dim, probe)
                assert probe["sum"] == sum(group), (where, dim, probe)


# --------------------------------------------------------------------------------------------------------
# Groups on real ranks


@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_mesh_coordinates_and_groups_match_the_layout_and_collectives_over_them(reports, world_size):
    _check_probes(reports[world_size], world_size, LAYOUTS[world_size])


@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_bad_sizes_raise_on_every_rank_before_any_group_is_made(reports, world_size):
    for report in reports[world_size]:
        errors = report["errors"]
        assert f"= {world_size + 1}, but the world size is {world_size}" in errors[str({"dp": world_size + 1})]
        assert f"pp=2 = {2 * world_size}, but" in errors[str({"dp": world_size, "pp": 2})]
        assert "tp must be an integer >= 1" in errors[str({"tp": 0})]
        assert errors["groups_made"] == 0 and errors["groups_made_by_a_good_mesh"] == 1
        for dim in ("xp", "DP", 0):
            assert f"got {dim!r}" in errors[repr(dim)] and "'pp', 'dp', 'cp', 'tp'" in errors[repr(dim)]


def test_describe_names_this_rank_and_lists_every_rank(reports):
    text = reports[8][3]["describe"]
    assert text.startswith("Mesh(dp=2, tp=2, pp=2) over 8 ranks (gloo, cpu); rank 3 is at pp=0, dp=1, cp=0, tp=1\n")
    assert text.endswith(describe_layout(dp=2, tp=2, pp=2))


@pytest.mark.parametrize("group_kind", ["process group", "device mesh"])
def test_ddp_over_the_dp_dimension_averages_within_each_dp_group_only(reports, group_kind):
    per_rank = [report["ddp"][group_kind] for report in reports[4]]
    for rank, found in enumerate(per_rank):
        members = found["dp_ranks"]
        assert members == [rank % 2, rank % 2 + 2]  # Mesh(dp=2, tp=2): DP groups [0, 2] and [1, 3]
        first = per_rank[members[0]]["initial"]
        assert all(torch.equal(a, b) for a, b in zip(found["after_broadcast"], first, strict=True)), rank
        for index, mean in enumerate(found["mean"]):
            expected = sum(per_rank[member]["local"][index] for member in members) / len(members)
            assert torch.allclose(mean, expected, atol=1e-6), (rank, index)
            everyone = sum(report["local"][index] for report in per_rank) / 4
            assert not torch.allclose(mean, everyone, atol=1e-3)  # the average over all four would differ


# --------------------------------------------------------------------------------------------------------
# Under torchrun

TORCHRUN_SCRIPT = """
import json
from labkit import dist
from labkit.launch import launch
from tests.test_mesh import _probe_layouts
results = launch(_probe_layouts, 4, nprocs=4)
if dist.is_main():
    print("RESULT " + json.dumps([list(report["meshes"].items()) for report in results]))
"""


def test_under_torchrun_the_mesh_groups_are_the_same(tmp_path):
    script = tmp_path / "mesh_under_torchrun.py"
    script.write_text(TORCHRUN_SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(script)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180, env=environment)
    assert completed.returncode == 0, completed.stderr[-3000:]
    (line,) = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    per_rank = [{"meshes": {tuple(sizes): found for sizes, found in report}} for report in json.loads(line[7:])]
    _check_probes(per_rank, 4, LAYOUTS[4])
