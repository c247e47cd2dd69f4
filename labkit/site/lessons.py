"""A stored lesson, made into a page: the notebook as it was executed and checked, with what a reader needs around it.

Nothing is executed.  The outputs are the ones ``notebooks/store.py`` stored and nbval checks on two CPUs'
kernels; :func:`page_notebook` only adds to them:

- **a box to run the lesson** after its title: how long it reads and how long its notebook ran when its outputs
  were stored (from the cells' own execution times), and the commands that open it in JupyterLab;
- **claims marked as such**: a line a lesson's claim printed (``✓``/``✗``, :mod:`labkit.claims`) is set apart,
  as *measured* when it holds a number marked ``~`` (measured when the notebook was stored, held to the band the
  line states: on another machine it differs within that band) or as *computed* (the same on every machine);
- **each explorer**, which stores no output (a widget needs its kernel), as the pictures of
  :mod:`labkit.site.explorers` and the controls that step through them;
- **the exercise's statement**, before the cell that grades it: the docstring of ``exercises/NN_topic.py`` and
  the file a learner completes.

:func:`read_lessons` finds every ``notebooks/NN_*.ipynb`` by its name: a lesson added there is on the site with
no list to edit.  What it teaches comes from the README's course map, the one place that says it; a lesson
missing there is an error naming the row to add.
"""

from __future__ import annotations

import ast
import copy
import datetime
import html
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat

from labkit import claims, grading
from labkit.site import explorers

WORDS_A_MINUTE = 200  # reading speed for the "reading" estimate: prose only, code and outputs aside
MEASURED = re.compile(r"~([-+]?\d[\d,]*(\.\d+)?(e[-+]?\d+)?|inf|nan)")  # labkit.claims' mark of a measured number
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass
class Lesson:
    """One notebook of the course, and what the site says about it."""

    path: Path
    number: str  # "07"
    title: str  # the notebook's first heading, "07 · Pipeline parallelism: ..."
    teaches: str  # the README course map's row (markdown)
    reading_minutes: int
    run_seconds: float  # the stored outputs' execution, summed over cells
    stored_on: str  # the date of the last cell's execution, "2026-12-03"
    exercises: list[str] = field(default_factory=list)  # grading topics, in the order the notebook grades them

    @property
    def page(self) -> str:
        return self.path.stem  # the page's name: the notebook's, so links between notebooks still resolve


def course_map(readme: Path) -> dict[str, str]:
    """The README's table ``| `NN_name.ipynb` | what it teaches | status |``: notebook -> what it teaches."""
    rows = {}
    for line in readme.read_text().splitlines():
        match = re.match(r"\|\s*`(\d\d_\w+\.ipynb)`\s*\|(.*)\|[^|]*\|\s*$", line)
        if match:
            rows[match.group(1)] = match.group(2).strip()
    return rows


def run_seconds(notebook: nbformat.NotebookNode) -> tuple[float, str]:
    """The seconds the stored execution took, the sum of every code cell's (input to reply), and its date."""
    total, last = 0.0, ""
    for cell in notebook.cells:
        timing = cell.get("metadata", {}).get("execution", {})
        start, end = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
        if start and end:
            total += (_time(end) - _time(start)).total_seconds()
            last = max(last, end)
    return total, last[:10]


def _time(stamp: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def graded_topics(notebook: nbformat.NotebookNode) -> list[str]:
    """The exercises a notebook grades: the topics of its ``grading.check("topic")`` calls, in order."""
    found = []
    for cell in notebook.cells:
        if cell.cell_type == "code":
            for topic in re.findall(r"grading\.check\(\s*[\"'](\w+)[\"']", cell.source):
                if topic not in found:
                    found.append(topic)
    return found


def read_lessons(notebooks: Path, readme: Path) -> list[Lesson]:
    """Every lesson in ``notebooks`` (``NN_*.ipynb``, in course order).  Raises ``ValueError`` naming a notebook
    the README's course map lacks, or one whose first cell is not its title."""
    rows = course_map(readme)
    lessons = []
    for path in sorted(notebooks.glob("[0-9][0-9]_*.ipynb")):
        if path.name not in rows:
            raise ValueError(f"{path.name} is not in the course map of {readme.name}: add a row "
                             f"'| `{path.name}` | what it teaches | ready |' to its table under '## The course'")
        notebook = nbformat.read(path, as_version=4)
        first = notebook.cells[0].source if notebook.cells else ""
        if not first.startswith("# "):
            raise ValueError(f"{path.name}: its first cell must be its title ('# NN · ...'), found {first[:40]!r}")
        prose = " ".join(cell.source for cell in notebook.cells if cell.cell_type == "markdown")
        seconds, stored_on = run_seconds(notebook)
        lessons.append(Lesson(path, path.name[:2], first.splitlines()[0][2:].strip(), rows[path.name],
                              max(1, round(len(prose.split()) / WORDS_A_MINUTE)), seconds, stored_on,
                              graded_topics(notebook)))
    return lessons


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


# ---------------------------------------------------------------------------------------------------------------
# Outputs


ROUNDING = re.compile(r"differs by ~\S+ \(within [^)]*\)")  # labkit.claims.close(): a computed claim's rounding
GRADING = re.compile(r"grading\.(check|trying)\(")  # a cell whose ✓/✗ lines grade the exercise, not claims


def claim_kind(line: str) -> str:
    """``"measured"`` when the claim holds a number measured as the lesson ran (marked ``~``), else
    ``"computed"``.  The difference that :func:`labkit.claims.close` prints (``differs by ~3.0e-08 (within
    1e-06)``) is marked too, as it varies with a CPU's rounding, but the claim is computed."""
    return "measured" if MEASURED.search(ROUNDING.sub("", line)) else "computed"


def _mark(escaped: str, kind: str) -> str:
    title = ("measured when this lesson was stored; another run differs" if kind == "measured" else
             "a rounding difference: it varies with the CPU's kernels, within the tolerance stated")
    return MEASURED.sub(lambda match: f'<span class="lk-measured-value" title="{title}">{match.group(0)}</span>',
                        escaped)


def stream_html(text: str, name: str = "stdout", graded: bool = False) -> str:
    """A stream output as HTML, a block per line: every claim line set apart as measured or computed, every
    measured number marked.  ``graded``: the cell grades the exercise, so its ✓/✗ lines are the checks' verdicts
    on the untouched stub, set apart as such, not claims."""
    lines = []
    for line in ANSI.sub("", text).rstrip("\n").split("\n"):
        escaped = html.escape(line)
        if line.startswith((claims.PASS, claims.MISS)) and graded:
            lines.append(f'<span class="lk-line lk-exercise" title="the exercise\'s checks, on the file as given">'
                         f'<span class="lk-claim-kind">exercise</span>{escaped}</span>')
        elif line.startswith((claims.PASS, claims.MISS)):
            kind = claim_kind(line)
            verdict = "holds" if line.startswith(claims.PASS) else "missed"
            lines.append(f'<span class="lk-line lk-claim lk-{kind} lk-{verdict}" title="a {kind} claim">'
                         f'<span class="lk-claim-kind">{kind}</span>{_mark(escaped, kind)}</span>')
        else:
            lines.append(f'<span class="lk-line">{_mark(escaped, "measured")}</span>')
    return f'<pre class="lk-stream lk-{name}">' + "".join(lines) + "</pre>"


def merged_streams(outputs: list) -> list:
    """Consecutive stream outputs of one name as one (a cell's prints arrive in many pieces)."""
    merged: list = []
    for output in outputs:
        if (output.output_type == "stream" and merged and merged[-1].output_type == "stream"
                and merged[-1].name == output.name):
            merged[-1] = nbformat.v4.new_output("stream", name=output.name, text=merged[-1].text + output.text)
        else:
            merged.append(output)
    return merged


def _html_output(markup: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_output("display_data", data={"text/html": markup})


def explorer_html(entry: explorers.Explorer | None, frames: explorers.Frames | None, call: str) -> str:
    """The page's explorer: the opening picture and summary, the data for ``explorer.js`` to step through the
    others, and a line saying what is live here and what needs the notebook."""
    if entry is None or frames is None:
        return (f'<div class="lk-explorer lk-explorer-missing"><p><b>Explorer <code>{html.escape(call)}</code>: '
                "open the notebook to use it.</b> The site has no drawing of it yet (labkit/site/explorers.py).</p>"
                "</div>")
    shape = [len(control.labels) for control in frames.controls]
    opening = 0
    for control, size in zip(frames.controls, shape, strict=True):
        opening = opening * size + control.opening
    first = frames.frames[opening]
    stepped = ", ".join(f"<i>{html.escape(control.description)}</i>" for control in frames.controls)
    fixed = "; ".join(f"{html.escape(name)} = {html.escape(value)}" for name, value in frames.fixed)
    inputs = f" Inputs: {html.escape(entry.inputs)}." if entry.inputs else ""
    only = f" Only in the notebook: {html.escape(entry.notebook_only)}." if entry.notebook_only else ""
    note = (f"<b>Live on this page:</b> {frames.settings} settings of {stepped}, drawn by the lesson's own "
            f"code when this site was built.{inputs} " +
            (f"Fixed here (every control moves in the notebook): {fixed}." if fixed else "") + only)
    data = {"controls": [control.__dict__ for control in frames.controls], "opening": opening,
            "frames": frames.frames}
    return (f'<div class="lk-explorer" id="explorer-{frames.key}" data-key="{frames.key}">'
            f'<p class="lk-explorer-note">{note}</p><div class="lk-explorer-controls"></div>'
            f'<div class="lk-explorer-summary">{first["summary"]}</div>'
            f'<a class="lk-picture-link" href="_explorers/{first["picture"]}.png" target="_blank">'
            f'<img class="lk-explorer-picture" src="_explorers/{first["picture"]}.png" '
            f'alt="{html.escape(entry.call)}: {html.escape(", ".join(first["shown"]))}"></a>'
            f'<script type="application/json" class="lk-explorer-data">{_script_json(data)}</script></div>')


def _script_json(data: Any) -> str:
    return json.dumps(data).replace("</", "<\\/")  # never closes the script element early


# ---------------------------------------------------------------------------------------------------------------
# The boxes around the notebook


def clone_command(repository: str) -> str:
    """The first of the two commands that run the course: a clone of ``repository`` (a placeholder if unknown)."""
    return f"git clone {repository or '<the URL of the labkit repository>'} labkit && cd labkit"


def run_box(lesson: Lesson, repository: str) -> str:
    clone = clone_command(repository)
    return (f":::{{admonition}} Run this lesson\n:class: tip\n\n"
            f"About {lesson.reading_minutes} min of reading. Its notebook ran in {duration(lesson.run_seconds)} "
            f"when these outputs were stored ({lesson.stored_on}, on the course's 2-core reference machine, no "
            f"GPU). To run it yourself:\n\n```bash\n{clone}\nmake lab    # installs .venv, starts JupyterLab and prints its "
            f"URL: open {lesson.path.name}\n```\n\nWhat you see below is that run, executed and checked, not re-run "
            f"for this page: [how to read it](index.md#how-to-read-a-page).\n:::\n")


def exercise_box(topic: str, exercises_folder: Path) -> str:
    """The exercise's statement (its file's docstring, less the first line: the box's title says it) and the file
    itself, folded, as a learner gets it."""
    file_name, _, title = grading.EXERCISES[topic]
    source = (exercises_folder / file_name).read_text()
    statement = (ast.get_docstring(ast.parse(source)) or "").partition("\n")[2].strip()
    statement = re.sub(r"::\n", ":\n", statement)  # reStructuredText's literal block: markdown's indented one
    fence = "`" * max(4, 1 + max((len(run) for run in re.findall(r"`+", source)), default=0))
    return (f"::::{{admonition}} The exercise: {title}\n:class: note\n\n{statement}\n\n"
            f'<details class="lk-exercise-file"><summary>The file you complete: <code>exercises/{file_name}</code>'
            f"</summary>\n\n{fence}python\n{source.rstrip()}\n{fence}\n\n</details>\n\n"
            f"In the notebook, the cell below grades it (or `labkit grade`); the output stored here is the untouched "
            f"file's.\n::::\n")


def page_notebook(lesson: Lesson, frames: dict[str, explorers.Frames], exercises_folder: Path,
                  repository: str = "") -> tuple[nbformat.NotebookNode, list[str]]:
    """The lesson's notebook as its page shows it, and the explorer calls that have no drawing (warnings)."""
    notebook = copy.deepcopy(nbformat.read(lesson.path, as_version=4))
    cells, missing, pending = [], [], list(lesson.exercises)
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type == "code":
            call = explorers.explorer_call(cell.source)
            if call and not cell.outputs:
                entry = explorers.find(lesson.number, call)
                if entry is None or entry.key not in frames:
                    missing.append(f"{lesson.path.name}: {call}")
                cell.outputs = [_html_output(explorer_html(entry, frames.get(entry.key) if entry else None, call))]
            grades = bool(GRADING.search(cell.source))
            cell.outputs = [_html_output(stream_html(output.text, output.name, grades))
                            if output.output_type == "stream" else output for output in merged_streams(cell.outputs)]
            graded = [topic for topic in pending if re.search(rf"grading\.check\(\s*[\"']{topic}[\"']", cell.source)]
            for topic in graded:
                cells.append(nbformat.v4.new_markdown_cell(exercise_box(topic, exercises_folder)))
                pending.remove(topic)
        if index == 0:  # the title, the box to run the lesson, then the rest of the first cell
            title, _, rest = cell.source.partition("\n")
            cells += [nbformat.v4.new_markdown_cell(title), nbformat.v4.new_markdown_cell(run_box(lesson, repository))]
            cell.source = rest.lstrip("\n")
        cells.append(cell)
    notebook.cells = cells
    notebook.metadata.pop("widgets", None)
    return notebook, missing
