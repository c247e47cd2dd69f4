"""Shared test fixtures.  Every test is checked to leave no child process behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Lessons without a graded exercise, and why: the notebook and browser tests expect no grading cell in them (and
# one in every other lesson).
WITHOUT_EXERCISE = {"15_zero_bubble_and_dualpipe": "the schedules of 2024-25 ask of a rank's order what 1F1B does, "
                                                   "which exercise 07 grades"}


def explorer_controls(widget) -> list:
    """Every value control (slider, dropdown, checkbox, multi-select) inside an explorer ``widget``, in order."""
    import ipywidgets

    if isinstance(widget, ipywidgets.Box):
        return [control for child in widget.children for control in explorer_controls(child)]
    return [widget] if isinstance(widget, ipywidgets.ValueWidget) and getattr(widget, "description", "") else []


def check_every_control_redraws(explorer, count: int, move) -> None:
    """Each of the explorer's ``count`` controls redraws on release only, shows its whole description, and
    changes the figure when ``move(control)`` moves it (``count``: tests/test_browser.py's for the notebook)."""
    import ipywidgets

    controls = explorer_controls(explorer)
    assert len(controls) == count
    picture = next(child for child in explorer.children if isinstance(child, ipywidgets.Image))
    for control in controls:
        if "continuous_update" in control.keys:
            assert control.continuous_update is False
        assert int(control.style.description_width.removesuffix("ch")) > len(control.description)
        before = bytes(picture.value)
        move(control)
        assert bytes(picture.value) != before, f"moving {control.description!r} left the figure as it was"


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


# Processes that outlive single tests by design (the browser test's one Chromium, whose helper processes come and
# go): their descendants are not counted against a test; the fixture that starts one checks they end with it.
LONG_LIVED: set[int] = set()


def _ancestors(pid: int) -> set[int]:
    found = set()
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        found.add(pid)
    return found


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
    leftover = {pid for pid in leftover if pid not in LONG_LIVED and not _ancestors(pid) & LONG_LIVED}
    assert not leftover, f"processes left behind by this test: {sorted(leftover)}"


# The longest files first (measured on 2 cores, in seconds): `make test` spreads whole files over its workers
# (pytest-xdist --dist loadfile --no-loadscope-reorder) in this order, so the longest start at once and the
# many short ones fill in around them.  The rest keep their order; the notebooks (nbval) come last.
LONGEST_FIRST = ["tests/test_browser.py", "tests/test_grading.py", "tests/test_checkpoint.py", "tests/test_launch.py",
                 "tests/test_train.py", "tests/test_tensor_parallel.py", "tests/test_costmodel_and_viz.py"]


# What asserts on measured time (a bubble, a straggler's delay, a staleness that follows from who finishes first)
# must not share the 2 cores with other tests: a run beside 8 busy ranks measures them.  These carry the `timing`
# marker, and `make test` runs them alone, after the rest has run in parallel: the browser test and every notebook
# under nbval (each notebook asserts what its live runs measured), and the unit tests marked in their files.
TIMING_FILES = ["tests/test_browser.py", "tests/test_site_browser.py"]


# Each test's measured duration (its set-up and call, in seconds) is kept in pytest's cache from run to run, so that `make
# check` can leave out what a previous run here measured as slow (`--skip-slower-than`).
DURATIONS = "labkit/durations"
_measured: dict[str, float] = {}


def pytest_addoption(parser):
    parser.addoption("--skip-slower-than", type=float, default=None, metavar="SECONDS",
                     help="deselect the tests a previous run here measured over SECONDS (make check)")


def pytest_runtest_logreport(report):
    if report.when in ("setup", "call") and report.passed:
        _measured[report.nodeid] = round(report.duration + (_measured.get(report.nodeid, 0.0)
                                                            if report.when == "call" else 0.0), 2)


def pytest_sessionfinish(session):
    cache = getattr(session.config, "cache", None)  # None under -p no:cacheprovider
    if _measured and cache is not None and not hasattr(session.config, "workerinput"):
        cache.set(DURATIONS, {**cache.get(DURATIONS, {}), **_measured})


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the marker added here counts
def pytest_collection_modifyitems(session, config, items):
    limit = config.getoption("--skip-slower-than")
    cache = getattr(config, "cache", None)
    if limit is not None and cache is not None:
        durations = cache.get(DURATIONS, {})
        slow = {item.nodeid for item in items if durations.get(item.nodeid, 0.0) > limit}
        if slow:
            config.hook.pytest_deselected(items=[item for item in items if item.nodeid in slow])
            items[:] = [item for item in items if item.nodeid not in slow]
    for item in items:
        path = item.nodeid.split("::")[0]
        if path in TIMING_FILES or path.endswith(".ipynb"):
            item.add_marker(pytest.mark.timing)

    def rank(item) -> tuple[int, int]:
        path = item.nodeid.split("::")[0]
        if path in LONGEST_FIRST:
            return (0, LONGEST_FIRST.index(path))
        return (2, 0) if path.endswith(".ipynb") else (1, 0)

    items.sort(key=rank)  # stable: within a file, and among the rest, collection order stays
