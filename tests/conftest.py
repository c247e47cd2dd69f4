"""Shared test fixtures.  Every test is checked to leave no child process behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def live_descendants(pid: int | None = None) -> set[int]:
    """Every process below ``pid`` (default: this one), read from /proc (Linux)."""
    pid = os.getpid() if pid is None else pid
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        current = frontier.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    frontier.append(child)
    return found


def is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(autouse=True)
def no_processes_left_behind():
    """Fail any test after which a child process of the test run is still alive."""
    if not Path("/proc/self/task").is_dir():
        yield
        return
    before = live_descendants()
    yield
    deadline = time.monotonic() + 10.0
    leftover = {pid for pid in live_descendants() - before if is_alive(pid)}
    while leftover and time.monotonic() < deadline:
        time.sleep(0.1)
        leftover = {pid for pid in live_descendants() - before if is_alive(pid)}
    assert not leftover, f"processes left behind by this test: {sorted(leftover)}"
