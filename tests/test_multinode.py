"""A multi-node rehearsal on one machine: two ``torchrun`` "nodes" of 2 ranks each, met by c10d rendezvous on
127.0.0.1, run the 3D trainer; the mesh keeps every tensor-parallel group inside one node; a node that dies makes
the other exit with an error, and no process is left behind.

The command lines are those of two real nodes, with ``127.0.0.1`` standing for the first node's address.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, is_alive, live_descendants

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _node_command(port: int, trainer: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=labkit-rehearsal",
            "--max-restarts=0", "-m", "labkit.train", *trainer]


def _start_nodes(port: int, trainer: list[str]) -> list[subprocess.Popen]:
    """Node 0 first: once its agent hosts the rendezvous store on the port (c10d: the first agent to bind it),
    node 1, so that which node hosts the store is known."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = []
    for node in range(2):
        nodes.append(subprocess.Popen([*_node_command(port, trainer)[:3], f"--node_rank={node}",
                                       *_node_command(port, trainer)[3:]], cwd=REPO, env=environment, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True))
        deadline = time.monotonic() + 60
        while node == 0 and not _listening(port):
            assert time.monotonic() < deadline and nodes[0].poll() is None, "node 0 never hosted the store"
            time.sleep(0.2)
    return nodes


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _finish(nodes: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    try:
        outputs = [node.communicate(timeout=timeout) for node in nodes]
        return [(node.returncode, *output) for node, output in zip(nodes, outputs, strict=True)]
    finally:
        for node in nodes:
            _kill_session(node)


def _kill_session(node: subprocess.Popen) -> None:
    """SIGKILL the node: its torchrun agent's session and every process under it (torchrun starts each rank in
    a session of its own, so killing the agent's session alone would leave its ranks running)."""
    for pid in [node.pid, *live_descendants(node.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


HEADER = re.compile(r"# rank (\d+) of (\d+) \(pp=(\d+), dp=(\d+), (?:cp=\d+, )?tp=(\d+)\) on node (\d+) .*local rank (\d+)")


def _placement(log_dir: Path) -> dict[int, dict[str, int]]:
    placed = {}
    for path in log_dir.glob("rank-*.log"):
        match = HEADER.match(path.read_text().splitlines()[0])
        rank, _, pp, dp, tp, node, local = map(int, match.groups())
        placed[rank] = {"pp": pp, "dp": dp, "tp": tp, "node": node, "local_rank": local}
    return placed


@pytest.mark.parametrize(("dp", "tp", "pp"), [(2, 2, 1), (1, 2, 2)])
def test_two_torchrun_nodes_train_with_every_tp_group_inside_one_node(dp, tp, pp, tmp_path):
    trainer = ["--dp", str(dp), "--tp", str(tp), "--pp", str(pp), "--steps", "4", "--log-every", "2",
               "--batch-size", "4", "--log-dir", str(tmp_path)]
    results = _finish(_start_nodes(_free_port(), trainer), timeout=240)
    for code, _, err in results:
        assert code == 0, err[-3000:]
    assert sum("replicas identical: yes" in out for _, out, _ in results) == 1  # global rank 0 reports
    placed = _placement(tmp_path)
    assert sorted(placed) == [0, 1, 2, 3]
    for rank, where in placed.items():
        assert where["node"] == rank // 2 and where["local_rank"] == rank % 2  # torchrun: node-major ranks
    tp_groups: dict[tuple[int, int], set[int]] = {}
    for where in placed.values():
        tp_groups.setdefault((where["pp"], where["dp"]), set()).add(where["node"])
    assert len(tp_groups) == dp * pp and all(len(nodes) == 1 for nodes in tp_groups.values()), tp_groups
    if pp > 1:  # the pipeline's stages are on different nodes: its sends cross the inter-node link
        assert {where["node"] for where in placed.values() if where["pp"] == 1} == {1}


# The node that dies, and what the survivor's agent reports: a worker node takes its ranks with it (the survivor's
# ranks fail in their next collective: ChildFailedError); the node that hosts the c10d rendezvous store takes the
# store too (the survivor's agent loses it: DistNetworkError).
DEATHS = {"a worker node": (1, "ChildFailedError"), "the node hosting the rendezvous": (0, "DistNetworkError")}


@pytest.mark.parametrize("death", DEATHS)
def test_a_node_that_dies_makes_the_other_exit_with_an_error_and_leaves_nothing_behind(death, tmp_path):
    dead, error = DEATHS[death]
    survivor = 1 - dead
    trainer = ["--dp", "2", "--tp", "2", "--steps", "100000", "--log-every", "1000", "--batch-size", "4",
               "--log-dir", str(tmp_path)]
    nodes = _start_nodes(_free_port(), trainer)
    try:
        deadline = time.monotonic() + 180
        while not all(len(path.read_text().splitlines()) > 2 for path in tmp_path.glob("rank-*.log")) \
                or len(list(tmp_path.glob("rank-*.log"))) < 4:
            assert time.monotonic() < deadline, "the two nodes did not start training"
            assert all(node.poll() is None for node in nodes), [node.communicate() for node in nodes]
            time.sleep(0.5)
        everyone = [nodes[0].pid, *live_descendants(nodes[0].pid), nodes[1].pid, *live_descendants(nodes[1].pid)]
        assert len(everyone) >= 6, everyone  # two agents and four ranks
        died = time.monotonic()
        _kill_session(nodes[dead])  # the whole node: its agent and its two ranks
        _, err = nodes[survivor].communicate(timeout=180)
        assert nodes[survivor].returncode != 0
        assert error in err, err[-3000:]
        print(f"\n{death} died: node {survivor} exited {time.monotonic() - died:.1f} s later with code "
              f"{nodes[survivor].returncode}: {[line for line in err.splitlines() if error in line][-1:]}")
        nodes[dead].wait(timeout=30)
        time.sleep(1.0)
        assert [pid for pid in everyone if is_alive(pid)] == [], "processes left behind"
    finally:
        for node in nodes:
            _kill_session(node)
            node.wait(timeout=30)
