"""Every lesson as a learner meets it: JupyterLab in headless Chromium, one notebook after another.

For each notebook, in course order, on a copy (the repository's notebooks and their stored outputs are never
touched) served by one JupyterLab on 127.0.0.1 whose kernels run the untouched exercise stubs
(``LABKIT_SOLUTIONS`` unset):

- **before it runs** nothing shows an error: no "Error displaying widget", no "model not found", no widget
  view or error output stored (the copies are trusted, as a notebook the learner saved is, so that stored
  outputs render in full);
- **Run All** reaches the grading cell: every code cell has run (an execution count), the grading cell prints
  "Score:", and no cell shows an error; a failure names the cell, its first line and the error.  The kernels
  run PyTorch's portable kernels (``ATEN_CPU_CAPABILITY=default``) and every cell's outputs must equal the
  stored ones as nbval compares them (``tests/notebook_outputs.py``): this is `make test`'s portable pass,
  made in the learner's own mode (the untouched stubs, whose outputs are the stored ones);
- **every explorer control** (slider, dropdown, checkbox, multi-select, toggle) is moved as a hand would move it
  (a slider is dragged) and its explorer's figure must change; after sliders dragged in quick succession the
  figure must be the one a fresh draw of the same controls gives (the last state wins, nothing stale); no
  description or dropdown option is cut short, no slider track is too narrow to drag, no multi-select hides options;
- **the browser console** shows no error.

Screenshots (one per notebook, one per explorer, one on failure) are saved under ``$LABKIT_BROWSER_ARTIFACTS``
or the pytest temporary folder; the path is printed.  Needs Debian's ``chromium`` and ``pip install playwright``
(no browser is downloaded): without them the tests skip, except under CI (``CI=true``), where they fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from labkit import claims
from tests.conftest import LONG_LIVED, REPO, WITHOUT_EXERCISE, is_alive, live_descendants
from tests.notebook_outputs import output_differences

NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
# Controls per notebook, over all its explorers (labkit.viz.widgets): update when a lesson adds an explorer.
EXPECTED_CONTROLS = {"00_setup": 5, "01_collectives": 5, "02_data_parallel": 5, "03_batch_size_and_lr": 6,
                     "04_mixed_precision_and_memory": 2, "05_zero_and_fsdp": 8,
                     "06_tensor_parallel": 7, "07_pipeline_parallel": 7,
                     "08_async_parameter_server": 8, "09_pitfalls_and_checkpointing": 7, "10_3d_parallelism": 8,
                     "11_planning_a_training_run": 5, "12_monitoring_and_input_pipeline": 4,
                     "13_long_context": 7, "14_mixture_of_experts": 5, "15_zero_bubble_and_dualpipe": 8}
# The kernels run PyTorch's portable kernels, with oneDNN held to AVX2 (a CPU without the wide vector units has
# no AMX either; torch 2.14's bf16 attention otherwise packs for AMX, then refuses): nbval in `make test` checks
# the stored outputs with this CPU's own kernels, Run All here with the kernels any CPU has.
PORTABLE = {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2"}
SERVER_START_S = 180       # JupyterLab's first start on two busy cores
OPEN_S = 180               # the notebook page loaded, rendered, and its kernel idle
RUN_ALL_S = 900            # one notebook's Run All (a minute or less on an idle laptop)
REDRAW_S = 120             # one control moved until its figure changed and the kernel is idle again
UNCHANGED_S = 3            # the kernel idle this long after a move, the figure unchanged: the move did nothing
INSTALL = ("the browser tests need Debian's Chromium and Playwright for Python: `apt-get install chromium` and "
           "`.venv/bin/pip install playwright` (no browser download: the system's chromium is used)")

# Browser-side helpers, evaluated in the page: JupyterLab's application object is exposed (expose_app_in_browser).
JS_PANEL = """(name) => {
    const app = window.jupyterapp;
    if (!app) return false;
    for (const widget of app.shell.widgets('main')) {
        if (widget.context && widget.context.path.endsWith(name)) { window.labkitPanel = widget; break; }
    }
    const panel = window.labkitPanel;
    if (!panel || !panel.context.isReady || !panel.sessionContext.isReady) return false;
    const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
    return !!kernel && kernel.status === 'idle' && panel.content.widgets.length === panel.model.cells.length;
}"""
JS_OPEN = """(path) => {
    window.labkitPanel = undefined;
    window.jupyterapp.commands.execute('docmanager:open', {path, factory: 'Notebook'});
}"""
JS_CLOSE = """() => {  // every open document, closed without saving (Run All leaves a notebook modified)
    for (const widget of Array.from(window.jupyterapp.shell.widgets('main'))) {
        if (widget.context) widget.context.model.dirty = false;
        widget.dispose();
    }
    window.labkitPanel = undefined;
}"""
JS_IDLE = """() => {
    const kernel = window.labkitPanel.sessionContext.session.kernel;
    return kernel.status === 'idle' && !window.labkitPanel.content.widgets.some(cell => cell.model.type === 'code'
        && (cell.model.executionState === 'running' || (cell.promptNode && cell.promptNode.textContent.includes('*'))));
}"""
JS_STATUS = "() => window.labkitPanel.sessionContext.session.kernel.status"
JS_CELLS = """() => window.labkitPanel.content.widgets.map((cell, index) => {
    const outputs = cell.model.type === 'code'
        ? Array.from({length: cell.model.outputs.length}, (_, i) => cell.model.outputs.get(i).toJSON()) : [];
    return {index, type: cell.model.type, count: cell.model.type === 'code' ? cell.model.executionCount : null,
            source: cell.model.sharedModel.getSource(),
            errors: outputs.filter(o => o.output_type === 'error').map(o => `${o.ename}: ${o.evalue}`),
            widgets: outputs.filter(o => o.data && o.data['application/vnd.jupyter.widget-view+json']).length,
            outputs,
            text: (cell.node.querySelector('.jp-Cell-outputArea') || {innerText: ''}).innerText};
})"""
JS_RUN_ALL = """() => {
    window.labkitRunAll = undefined;
    window.jupyterapp.shell.activateById(window.labkitPanel.id);
    window.jupyterapp.commands.execute('notebook:run-all-cells').then(
        ok => { window.labkitRunAll = {ok}; }, error => { window.labkitRunAll = {error: String(error)}; });
}"""
JS_HASH = """async (img) => {  // the figure's bytes (a blob: URL, replaced at every redraw), hashed
    if (!img.src) return '';
    try {
        const bytes = new Uint8Array(await (await fetch(img.src)).arrayBuffer());
        let hash = 2166136261;
        for (const byte of bytes) { hash ^= byte; hash = Math.imul(hash, 16777619); }
        return `${bytes.length}:${hash >>> 0}`;
    } catch (error) { return ''; }  // revoked by a redraw between reading src and fetching it
}"""
JS_CUT = """(root) => {  // descriptions cut to "…", dropdowns narrower than their text, slider tracks too narrow to
                         // drag, multi-selects hiding options
    const cut = [];
    const context = document.createElement('canvas').getContext('2d');
    for (const label of root.querySelectorAll('.widget-label')) {
        if (label.offsetParent && label.scrollWidth > label.clientWidth + 1) cut.push(`label "${label.textContent}"`);
    }
    for (const select of root.querySelectorAll('.widget-dropdown select')) {  // its longest option must fit
        context.font = getComputedStyle(select).font;
        const texts = Array.from(select.options, option => option.text);
        const widths = texts.map(text => context.measureText(text).width);
        const widest = texts[widths.indexOf(Math.max(...widths))];
        const room = select.clientWidth - 24;  // the arrow and padding
        if (Math.max(...widths) > room) cut.push(`dropdown option "${widest}" (${select.clientWidth}px wide)`);
    }
    for (const track of root.querySelectorAll('.widget-hslider .slider-container')) {  // a track a hand can drag
        if (track.offsetParent && track.clientWidth < 150) {
            const label = track.closest('.widget-hslider').querySelector('.widget-label');
            cut.push(`slider track "${label ? label.textContent : ''}" (${track.clientWidth}px wide)`);
        }
    }
    for (const select of root.querySelectorAll('.widget-select-multiple select')) {
        if (select.scrollHeight > select.clientHeight + 1) cut.push(`multi-select showing part of its ${select.options.length} options`);
    }
    return cut;
}"""
CONTROLS = ".widget-hslider, .widget-dropdown, .widget-checkbox, .widget-select-multiple, .widget-toggle-buttons, " \
           ".widget-toggle-button"


def chromium_path() -> str | None:
    """The system's Chromium (Debian's package), or ``$LABKIT_CHROMIUM``."""
    if os.environ.get("LABKIT_CHROMIUM"):
        return shutil.which(os.environ["LABKIT_CHROMIUM"])
    return next((path for name in ("chromium", "chromium-browser") if (path := shutil.which(name))), None)


def require_browser():
    """Playwright's sync API and the Chromium to drive; skip (fail under CI) when either is missing."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    missing = [name for name, found in (("playwright", sync_playwright), ("chromium", chromium_path())) if not found]
    if missing:
        message = f"{', '.join(missing)} not installed: {INSTALL}"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return sync_playwright


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Lab:
    """One JupyterLab server over copies of the notebooks, its kernels in the exercises' mode."""

    def __init__(self, root: Path, artifacts: Path):
        self.root, self.artifacts = root, artifacts
        self.token = uuid.uuid4().hex
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        shutil.copytree(REPO / "notebooks", root / "notebooks", ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        settings = root / "settings"
        for plugin, values in {"notebook-extension/tracker": {"windowingMode": "none"},  # every cell in the DOM
                               "apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False}
                               }.items():
            path = settings / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        self.environment = environment = {key: value for key, value in os.environ.items()
                                          if key != "LABKIT_SOLUTIONS"}
        environment.update(JUPYTER_CONFIG_DIR=str(root / "config"), JUPYTER_RUNTIME_DIR=str(root / "runtime"),
                           JUPYTER_DATA_DIR=str(root / "data"), IPYTHONDIR=str(root / "ipython"),
                           LABKIT_STRICT_CLAIMS="1", **PORTABLE)  # a measured claim that misses fails the test
        self.trust(*(root / "notebooks").glob("*.ipynb"))
        command = [str(Path(sys.executable).parent / "jupyter"), "lab", "--no-browser", "--ip=127.0.0.1",
                   f"--port={self.port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
                   f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True",
                   f"--LabServerApp.user_settings_dir={settings}",
                   f"--LabServerApp.workspaces_dir={root / 'workspaces'}"]
        if os.geteuid() == 0:
            command.append("--allow-root")
        self.log_path = artifacts / "jupyterlab.log"
        self.log = self.log_path.open("w")
        self.process = subprocess.Popen(command, cwd=root, env=environment, stdout=self.log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + SERVER_START_S
        try:
            while not self.started():
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not start; its log: {self.log_path}")
                time.sleep(1.0)
        except BaseException:
            self.close()
            raise

    def started(self) -> bool:
        try:
            self.api("GET", "status")
            return True
        except OSError:  # urllib's errors included
            return False

    def trust(self, *notebooks: Path) -> None:
        """Trust ``notebooks`` as a learner's own saved notebook is: their stored outputs render in full, so a
        stored widget view shows what it shows a learner ("Error displaying widget"), not its text."""
        subprocess.run([str(Path(sys.executable).parent / "jupyter"), "trust", *map(str, notebooks)],
                       env=self.environment, check=True, capture_output=True, timeout=120)

    def api(self, method: str, path: str):
        request = urllib.request.Request(f"{self.url}/api/{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=60) as response:
            body = response.read()
        return json.loads(body) if body else None

    def shut_down_kernels(self) -> None:
        for session in self.api("GET", "sessions"):
            self.api("DELETE", f"sessions/{session['id']}")

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.shut_down_kernels()
            except OSError:
                pass
            self.process.send_signal(signal.SIGTERM)  # the server shuts its kernels down, then exits
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    require_browser()
    artifacts = Path(os.environ.get("LABKIT_BROWSER_ARTIFACTS") or tmp_path_factory.mktemp("browser-artifacts"))
    artifacts.mkdir(parents=True, exist_ok=True)
    print(f"\nbrowser test artefacts (screenshots, JupyterLab's log): {artifacts}")
    server = Lab(tmp_path_factory.mktemp("lab"), artifacts)
    yield server
    server.close()


@pytest.fixture(scope="module")
def browser_page(lab):
    """One headless Chromium and one page for the whole module (its helper processes end with it), as a learner
    keeps one JupyterLab tab open and opens one notebook after another in it; console errors kept."""
    sync_playwright = require_browser()
    started, before, browser_processes = time.monotonic(), live_descendants(), set()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), headless=True,
                                             args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.console_errors = []
            page.on("console", lambda message: message.type == "error" and page.console_errors.append(
                f"console: {message.text} ({message.location.get('url', '')})"))
            page.on("pageerror", lambda error: page.console_errors.append(f"page error: {error}"))
            page.set_default_timeout(60_000)
            print(f"Chromium started in {time.monotonic() - started:.1f} s")
            browser_processes = live_descendants() - before - set(lab_processes(lab))
            LONG_LIVED.update(browser_processes)
            yield page
        finally:
            browser.close()
    LONG_LIVED.difference_update(browser_processes)
    deadline = time.monotonic() + 10.0
    while any(is_alive(pid) for pid in browser_processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in browser_processes if is_alive(pid)], "Chromium's processes outlived the browser test"


@pytest.fixture
def page(lab, browser_page):
    """The module's page, its console errors cleared; afterwards the notebook is closed unsaved and every
    kernel shut down, so that the next notebook starts as a learner's does: one notebook, one fresh kernel."""
    browser_page.console_errors.clear()
    try:
        yield browser_page
    finally:
        try:
            browser_page.evaluate(JS_CLOSE)
        finally:
            lab.shut_down_kernels()


class Phases:
    """Wall time per phase of one notebook's test, printed in the log (where the browser test's time goes)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = time.monotonic() - start

    def __str__(self) -> str:
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.seconds.items())


def lab_processes(lab: Lab) -> set[int]:
    """The JupyterLab server and its kernels: not the browser's."""
    return {lab.process.pid} | live_descendants(lab.process.pid)


def describe(cell: dict) -> str:
    first = next((line for line in cell["source"].splitlines() if line.strip()), "")
    return f"cell {cell['index']} (In [{cell['count'] if cell['count'] is not None else ' '}]: {first[:70]!r})"


def errors_in(cells: list[dict]) -> list[str]:
    """Each error output as "cell N (In [k]: 'first line'): Name: message" (a long message: first and last line)."""
    found = []
    for cell in cells:
        for error in cell["errors"]:
            lines = [line for line in error.splitlines() if line.strip()]
            found.append(f"{describe(cell)}: {lines[0]}" + (f" ... {lines[-1].strip()}" if len(lines) > 1 else ""))
    return found


def first_failure_is_a_measured_miss(found: list[str]) -> bool:
    """Whether the first error of a Run All (``run_all``'s list) is a measured claim missing its band in strict
    mode: the cells after it that never ran, or failed for want of its variables, follow from it."""
    errors = [problem for problem in found if problem.startswith(("Run All: error in", "Run All: the command"))]
    return bool(errors) and claims.strict_miss(errors[0])


def widget_errors_in(page) -> list[str]:
    text = page.locator(".jp-NotebookPanel").first.inner_text()
    return [phrase for phrase in ("Error displaying widget", "model not found") if phrase in text]


def open_notebook(page, lab: Lab, path: str) -> list[str]:
    """Open ``path`` (relative to the server's root) in JupyterLab (loaded on a fresh workspace the first time,
    after that the page's own: File > Open), wait for its kernel; (a) what it shows before it runs."""
    if page.evaluate("() => !!window.jupyterapp"):  # JupyterLab is loaded in the page
        page.evaluate(JS_OPEN, path)
    else:
        page.goto(f"{lab.url}/lab/tree/{path}?reset&token={lab.token}", timeout=OPEN_S * 1000)
    page.wait_for_function(JS_PANEL, arg=path, timeout=OPEN_S * 1000, polling=250)
    cells = page.evaluate(JS_CELLS)
    if any(cell["widgets"] for cell in cells):  # only a stored widget view can fail to find its model, and it
        page.wait_for_timeout(2000)            # says so asynchronously
        cells = page.evaluate(JS_CELLS)
    problems = [f"before running: shows {phrase!r}" for phrase in widget_errors_in(page)]
    problems += [f"before running: stored widget view in {describe(cell)} (its model exists only in the kernel "
                 "that made it: notebooks/store.py strips such views)" for cell in cells if cell["widgets"]]
    return problems + [f"before running: stored error in {error}" for error in errors_in(cells)]


def run_all(page, graded: bool = True) -> tuple[list[dict], list[str]]:
    """(b) Run All, as the Run menu does; the cells afterwards, and what went wrong: an error output, a code
    cell that never ran, a grading cell without its score (``graded=False``: a lesson without an exercise,
    ``WITHOUT_EXERCISE``, where a grading cell is what went wrong)."""
    page.evaluate(JS_RUN_ALL)
    page.wait_for_function("() => window.labkitRunAll !== undefined", timeout=RUN_ALL_S * 1000, polling=1000)
    page.wait_for_function(JS_IDLE, timeout=REDRAW_S * 1000, polling=500)
    cells, result = page.evaluate(JS_CELLS), page.evaluate("() => window.labkitRunAll")
    code = [cell for cell in cells if cell["type"] == "code" and cell["source"].strip()]
    problems = [f"Run All: the command failed: {result['error']}"] if "error" in result else []
    problems += [f"Run All: error in {error}" for error in errors_in(cells)]
    problems += [f"Run All: {describe(cell)} never ran" for cell in code if cell["count"] is None]
    grading = [cell for cell in code if "grading.check(" in cell["source"]]
    if not graded:
        problems += [f"Run All: a grading {describe(cell)} in a lesson without an exercise" for cell in grading]
    elif not grading:
        problems.append("Run All: no grading cell (grading.check(...)) found")
    elif "Score:" not in grading[-1]["text"]:
        problems.append(f"Run All: the grading {describe(grading[-1])} shows no 'Score:'")
    return cells, problems + [f"after Run All: shows {phrase!r}" for phrase in widget_errors_in(page)]


def differs_from_stored(notebook: Path, cells: list[dict]) -> list[str]:
    """(b) Every checked cell's outputs after Run All equal the stored ones, as nbval compares them
    (``tests/notebook_outputs.py``): what a learner reads before running is what running gives, on any CPU."""
    import nbformat

    stored = nbformat.read(notebook, as_version=4)["cells"]
    return [f"Run All: {line}" for line in output_differences(stored, [cell["outputs"] for cell in cells],
                                                               lambda index: describe(cells[index]))]


def move(page, control) -> str:
    """Move one control as a hand would; return what was done."""
    classes = control.get_attribute("class") or ""
    text = control.inner_text().replace("\u200b", "").strip()
    name = text.splitlines()[0] if text else classes.split()[-1]
    if "widget-hslider" in classes:
        handle, track = control.locator(".noUi-handle").first, control.locator(".noUi-target, .slider").first
        box, hand = track.bounding_box(), handle.bounding_box()
        start_x, y = hand["x"] + hand["width"] / 2, hand["y"] + hand["height"] / 2
        left, right = box["x"] + 0.2 * box["width"], box["x"] + 0.8 * box["width"]
        target = left if abs(start_x - left) > abs(start_x - right) else right
        page.mouse.move(start_x, y)
        page.mouse.down()
        page.mouse.move(target, y, steps=6)  # with continuous_update=False the kernel hears only the release
        page.mouse.up()
        return f"dragged slider {name!r}"
    if "widget-select-multiple" in classes:
        select = control.locator("select")
        chosen = select.evaluate("s => Array.from(s.selectedOptions).map(o => o.text)")
        every = select.evaluate("s => Array.from(s.options).map(o => o.text)")
        new = chosen[:-1] if len(chosen) > 1 else chosen + [next(o for o in every if o not in chosen)]
        select.select_option(label=new)
        return f"multi-select {name!r}: {chosen} -> {new}"
    if "widget-dropdown" in classes:
        select = control.locator("select")
        index = select.evaluate("s => (s.selectedIndex + 1) % s.options.length")
        select.select_option(index=index)
        return f"dropdown {name!r} -> option {index}"
    if "widget-checkbox" in classes:
        control.locator("input[type=checkbox]").click()
        return f"checkbox {name!r}"
    if "widget-toggle-buttons" in classes:
        control.locator("button:not(.mod-active)").first.click()
        return f"toggle buttons {name!r}"
    control.click()  # a single toggle button
    return f"toggle {name!r}"


def new_figure(page, image, before: str) -> bool:
    """Wait until the figure differs from ``before`` (True), or the kernel has been idle for ``UNCHANGED_S``
    with the figure as it was (False); then wait for the kernel to be idle."""
    deadline, idle_since = time.monotonic() + REDRAW_S, time.monotonic()
    while image.evaluate(JS_HASH) in (before, "") and time.monotonic() < deadline:
        if page.evaluate(JS_STATUS) != "idle":
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since > UNCHANGED_S:
            break  # the kernel has had its time: the figure stays as it was
        page.wait_for_timeout(250)
    page.wait_for_function(JS_IDLE, timeout=REDRAW_S * 1000, polling=250)
    return image.evaluate(JS_HASH) not in (before, "")


def settled_figure(page, image, quiet_s: float = 0.5) -> str:
    """The figure once the kernel is idle and the picture has not changed for ``quiet_s``."""
    shown, since = image.evaluate(JS_HASH), time.monotonic()
    deadline = since + REDRAW_S
    while time.monotonic() < deadline and (time.monotonic() - since < quiet_s or page.evaluate(JS_STATUS) != "idle"):
        page.wait_for_timeout(250)
        now = image.evaluate(JS_HASH)
        if now != shown or page.evaluate(JS_STATUS) != "idle":
            shown, since = now, time.monotonic()
    return shown


def last_state_wins(page, output, image) -> str | None:
    """Drag up to two sliders one right after another (their redraws queue in the kernel), then compare the
    figure they leave with a fresh draw of the same controls (a dropdown moved away and back): a stale figure
    differs.  None when it does not, else what went wrong."""
    sliders, dropdown = output.locator(".widget-hslider"), output.locator(".widget-dropdown select").first
    if not sliders.count() or not dropdown.count():
        return None
    done = [move(page, sliders.nth(index)) for index in range(min(2, sliders.count()))]
    shown = settled_figure(page, image)
    chosen = dropdown.evaluate("s => s.selectedIndex")
    dropdown.select_option(index=(chosen + 1) % dropdown.evaluate("s => s.options.length"))
    new_figure(page, image, shown)
    away = image.evaluate(JS_HASH)
    dropdown.select_option(index=chosen)
    new_figure(page, image, away)
    if settled_figure(page, image) != shown:
        return f"after {', '.join(done)} in quick succession the figure was stale (a fresh draw differs)"
    return None


def move_every_control(page, cells: list[dict], shots: Path) -> tuple[list[str], list[str]]:
    """(c) In every explorer (an output holding a widget image), each control moved must change the figure,
    the last of quick moves must win, and no description or option may be cut short; what was moved, and
    what went wrong."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    moved, problems = [], []
    for number, cell in enumerate(cell for cell in cells if cell["widgets"]):
        output = page.locator(".jp-Notebook .jp-Cell").nth(cell["index"]).locator(".jp-OutputArea-output").filter(
            has=page.locator(".widget-image")).first
        try:
            output.wait_for(state="visible", timeout=REDRAW_S * 1000)
        except PlaywrightTimeout:
            problems.append(f"{describe(cell)}: no explorer figure shown")
            continue
        output.scroll_into_view_if_needed()
        image = output.locator("img.widget-image").first
        problems += [f"explorer in {describe(cell)}: cut short: {cut}" for cut in output.evaluate(JS_CUT)]
        for index in range(output.locator(CONTROLS).count()):
            before, started = image.evaluate(JS_HASH), time.monotonic()
            done = move(page, output.locator(CONTROLS).nth(index))
            if not new_figure(page, image, before):
                problems.append(f"explorer in {describe(cell)}: {done}, but its figure did not change")
            moved.append(f"{done} ({time.monotonic() - started:.1f} s)")
        stale = last_state_wins(page, output, image)
        problems += [f"explorer in {describe(cell)}: {stale}"] if stale else []
        output.screenshot(path=f"{shots}-explorer-{number}.png")
    return moved, problems


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_notebook_in_the_browser(lab, page, notebook):
    """Every check runs even when an earlier one failed (the explorers run before the exercise cells), and
    the failure lists all that was found."""
    shots = lab.artifacts / notebook.stem
    problems: list[str] = []
    phases = Phases()
    try:
        with phases("open"):
            problems += open_notebook(page, lab, f"notebooks/{notebook.name}")
        with phases("Run All"):
            cells, found = run_all(page, graded=notebook.stem not in WITHOUT_EXERCISE)
        if first_failure_is_a_measured_miss(found):  # one more Run All, in a fresh kernel, decides
            print(f"{notebook.name}: {found[0]}\n{notebook.name}: the first failure was a measured claim's miss: "
                  "Run All once more, in a fresh kernel (labkit.claims.strict_miss)")
            page.evaluate(JS_CLOSE)
            lab.shut_down_kernels()
            with phases("Run All again"):
                open_notebook(page, lab, f"notebooks/{notebook.name}")
                cells, found = run_all(page, graded=notebook.stem not in WITHOUT_EXERCISE)
        problems += found + differs_from_stored(notebook, cells)
        with phases("explorers"):
            moved, found = move_every_control(page, cells, shots)
        problems += found
        print(f"{notebook.name}: moved {len(moved)} controls: " + "; ".join(moved))
        if len(moved) != EXPECTED_CONTROLS[notebook.stem]:
            problems.append(f"explorers: {len(moved)} controls found, expected {EXPECTED_CONTROLS[notebook.stem]}")
        problems += page.console_errors  # (d)
        with phases("screenshot"):
            page.screenshot(path=f"{shots}.png")
        print(f"{notebook.name}: {phases}")
    except BaseException:
        page.screenshot(path=f"{shots}-failure.png")
        print(f"{notebook.name}: failure screenshot {shots}-failure.png; found before the failure: {problems}")
        raise
    if problems:
        page.screenshot(path=f"{shots}-failure.png")
    assert not problems, f"{notebook.name} (screenshots under {lab.artifacts}):\n" + "\n".join(problems)


def test_the_browser_checks_catch_what_a_learner_would_see_broken(lab, page):
    """The checkers reject a notebook that shows each fault: a stored widget view without its model, a stored
    error, a stored output that running does not give, a cell that raises (and so a grading cell never reached), an explorer whose figure ignores its
    slider, one whose figure lags behind its controls, a description cut short, and an error in the browser
    console."""
    import nbformat

    view = {"application/vnd.jupyter.widget-view+json": {"model_id": "0" * 32, "version_major": 2,
                                                          "version_minor": 0}, "text/plain": "VBox()"}
    cells = [nbformat.v4.new_code_cell("print('stored')", outputs=[nbformat.v4.new_output(
                 "display_data", data=view), nbformat.v4.new_output("error", ename="ValueError", evalue="stored",
                                                                    traceback=[])]),
             nbformat.v4.new_code_cell(
                 "import ipywidgets, IPython.display\n"
                 "from labkit.viz import plots, training_plots\n"
                 "slider = ipywidgets.IntSlider(description='a description far too long to show')\n"
                 "picture = ipywidgets.Image(value=plots.figure_to_png(training_plots.plot_zero_stages(2)))\n"
                 "IPython.display.display(IPython.display.Javascript(\"console.error('labkit: a console error')\"))\n"
                 "ipywidgets.VBox([slider, picture])"),
             nbformat.v4.new_code_cell(  # an explorer whose figure lags one change behind its controls
                 "from matplotlib.figure import Figure\n"
                 "ranks = ipywidgets.IntSlider(value=2, min=2, max=6, description='ranks')\n"
                 "choice = ipywidgets.Dropdown(options=['a', 'b'], description='choice')\n"
                 "lagging, states = ipywidgets.Image(), []\n"
                 "def draw(_change=None):\n"
                 "    states.append((ranks.value, choice.value))\n"
                 "    figure = Figure(figsize=(2, 1))\n"
                 "    figure.text(0.1, 0.5, str(states[-2] if len(states) > 1 else states[-1]))\n"
                 "    lagging.value = plots.figure_to_png(figure)\n"
                 "ranks.observe(draw, names='value')\n"
                 "choice.observe(draw, names='value')\n"
                 "draw()\n"
                 "ipywidgets.VBox([ranks, choice, lagging])"),
             nbformat.v4.new_code_cell("import torch\nprint(torch.backends.cpu.get_cpu_capability())", outputs=[
                 nbformat.v4.new_output("stream", name="stdout", text="DEFAULT\n")]),  # the portable kernels
             nbformat.v4.new_code_cell("print(1 + 1)", outputs=[nbformat.v4.new_output(
                 "stream", name="stdout", text="3\n")]),  # an output the notebook stores, and running does not give
             nbformat.v4.new_code_cell("1 / 0"),
             nbformat.v4.new_code_cell("from labkit import grading\ngrading.check('setup')")]
    (lab.root / "checks").mkdir(exist_ok=True)
    nbformat.write(nbformat.v4.new_notebook(cells=cells, metadata={"kernelspec": {
        "name": "python3", "display_name": "Python 3", "language": "python"}}), lab.root / "checks" / "broken.ipynb")
    lab.trust(lab.root / "checks" / "broken.ipynb")

    before = open_notebook(page, lab, "checks/broken.ipynb")
    cells, after = run_all(page)
    after += differs_from_stored(lab.root / "checks" / "broken.ipynb", cells)
    moved, explorers = move_every_control(page, cells, lab.artifacts / "checks-broken")
    found = "\n".join(before + after + explorers + page.console_errors)
    for expected in ("before running: shows 'Error displaying widget'", "before running: stored widget view in cell 0",
                     "before running: stored error in cell 0",
                     "ValueError: stored", "Run All: error in cell 5 (In [6]: '1 / 0'): ZeroDivisionError",
                     "Run All: cell 6 (In [ ]: 'from labkit import grading') never ran",
                     "Run All: cell 4 (In [5]: 'print(1 + 1)'): outputs differ from the stored ones: stdout: line 1 "
                     "is '2', where the notebook stores '3'",
                     "shows no 'Score:'", "cut short: label \"a description far too long to show\"",
                     "dragged slider 'a description far too long to show', but its figure did not change",
                     "in quick succession the figure was stale", "labkit: a console error"):
        assert expected in found, f"the checks missed {expected!r}; they found:\n{found}"
    assert "cell 3 (" not in found, found  # the kernels run PyTorch's portable kernels, as the cell stores
    assert len(moved) == 3


TENSORBOARD_S = 120  # TensorBoard's start and its first page on two busy cores


def test_tensorboard_overlays_every_ranks_run_of_a_short_training(browser_page, lab, tmp_path):
    """``labkit.train --tensorboard DIR`` on 4 ranks, then TensorBoard itself on DIR: its data API lists every
    rank's run, and its time-series page, in the browser, with smoothing 0 (TensorBoard's default, 0.6, flattens
    the per-step differences between ranks that the page is for), shows every run and the loss, step time and own
    work charts (screenshot kept: lesson 12's image is one)."""
    from labkit import train

    runs = tmp_path / "runs"
    assert train.main(["--strategy", "ddp", "--nprocs", "4", "--model", "tiny-mlp", "--steps", "48", "--log-every",
                       "48", "--tensorboard", str(runs)]) == 0
    port = free_port()
    log = (lab.artifacts / "tensorboard.log").open("w")
    server = subprocess.Popen([str(Path(sys.executable).parent / "tensorboard"), "--logdir", str(runs), "--host",
                               "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL)
    try:
        deadline, listed = time.monotonic() + TENSORBOARD_S, None
        while listed is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs", timeout=10) as response:
                    listed = json.loads(response.read())
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, f"TensorBoard did not start: {log.name}"
                time.sleep(0.5)
        assert sorted(listed) == ["rank-0", "rank-1", "rank-2", "rank-3"]
        browser_page.set_viewport_size({"width": 1400, "height": 1000})
        browser_page.goto(f"http://127.0.0.1:{port}/?smoothing=0&tagFilter=train%2F(loss%7Cstep_ms%7Cbusy_ms%7C"
                          "grad_norm)$#timeseries")  # TensorBoard's query parameters: the smoothing, the charts
        browser_page.wait_for_function("['rank-0', 'rank-3', '/loss', '/busy_ms', 'Smoothing\\n0\\n'].every("
                                       "text => document.body.innerText.includes(text))", timeout=TENSORBOARD_S * 1000)
        browser_page.wait_for_load_state("networkidle")
        browser_page.wait_for_timeout(3000)  # the charts draw their lines after their titles and legends
        shot = lab.artifacts / "tensorboard-timeseries.png"
        browser_page.screenshot(path=str(shot))
        print(f"TensorBoard's page with every rank's run, smoothing 0: {shot}")
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
