"""Build the web edition: every stored lesson as a page, a landing page with the course map, one folder to open.

``make site`` (``python -m labkit.site``) writes ``build/site/``; open ``build/site/index.html`` in a browser,
or serve the folder (``make site-serve``).  The steps:

1. :func:`labkit.site.lessons.read_lessons` finds the lessons in ``notebooks/`` and what the README's course map
   says each teaches;
2. :func:`labkit.site.explorers.draw_all` draws each explorer's grid of pictures, over the machine's cores;
3. each notebook is written, with its boxes, claims and explorers, beside a generated ``index.md``, and Sphinx
   (MyST-NB, Furo; ``labkit/site/sphinx/conf.py``) turns them into HTML without executing a cell, every warning
   an error (a broken reference fails the build);
4. the explorers' pictures are written beside the pages.  Math is MathML, written by the build: nothing is fetched
   from a network when a page opens, and the folder works from ``file://`` as well as from GitHub Pages.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from labkit.site import explorers, lessons

SPHINX_CONF = Path(__file__).resolve().parent / "sphinx"


@dataclass
class Built:
    """What a build made, for its report and for the tests."""

    out: Path
    seconds: float
    lessons: list[lessons.Lesson]
    pictures: int
    frames: int
    missing_explorers: list[str] = field(default_factory=list)

    @property
    def megabytes(self) -> float:
        return sum(path.stat().st_size for path in self.out.rglob("*") if path.is_file()) / 1e6

    def describe(self) -> str:
        pages = len(list(self.out.glob("*.html")))
        text = (f"built {self.out} in {self.seconds:.0f} s: {pages} pages ({len(self.lessons)} lessons), "
                f"{self.frames} explorer settings in {self.pictures} pictures, {self.megabytes:.1f} MB")
        if self.missing_explorers:
            text += "\nexplorers with no drawing (add them to labkit/site/explorers.py): " + \
                ", ".join(self.missing_explorers)
        return text


def repository_url(root: Path | None = None) -> str:
    """The clone URL the run boxes print: ``LABKIT_REPOSITORY_URL``, else GitHub Actions' repository, else the
    clone's ``origin`` when it is a URL another machine can reach; else none (the boxes then say so)."""
    if os.environ.get("LABKIT_REPOSITORY_URL"):
        return os.environ["LABKIT_REPOSITORY_URL"]
    if os.environ.get("GITHUB_REPOSITORY"):
        return f"{os.environ.get('GITHUB_SERVER_URL', 'https://github.com')}/{os.environ['GITHUB_REPOSITORY']}"
    try:
        origin = subprocess.run(["git", "-C", str(root or course_root()), "remote", "get-url", "origin"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return origin if origin.startswith(("https://", "git@", "ssh://")) else ""


def course_root() -> Path:
    """The repository around the installed package (``make site`` runs from an editable install)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "notebooks").is_dir() or not (root / "README.md").is_file():
        raise FileNotFoundError(f"no notebooks/ and README.md in {root}: build the site from a clone of labkit")
    return root


def build(out: Path | str, *, root: Path | None = None, workers: int | None = None, repository: str | None = None,
          progress: Callable[[str], None] = print) -> Built:
    """Build the site into ``out`` (replaced); ``workers`` processes draw the explorers (default: every core)."""
    start = time.perf_counter()
    root = course_root() if root is None else Path(root)
    out = Path(out).resolve()
    workers = (os.cpu_count() or 1) if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    _check_replaceable(out)
    repository = repository_url(root) if repository is None else repository
    course = lessons.read_lessons(root / "notebooks", root / "README.md")
    numbers = {lesson.number for lesson in course}
    wanted = [entry for entry in explorers.EXPLORERS if entry.lesson in numbers]
    progress(f"{len(course)} lessons; drawing {len(wanted)} explorers over {workers} process(es) ...")
    frames = {}
    for drawn in explorers.draw_all(wanted, workers):
        frames[drawn.key] = drawn
        progress(f"  {drawn.key}: {len(drawn.frames)} settings ({time.perf_counter() - start:.0f} s)")
    with tempfile.TemporaryDirectory(prefix="labkit-site-") as scratch:
        source = Path(scratch) / "source"
        source.mkdir()
        missing = []
        for lesson in course:
            notebook, absent = lessons.page_notebook(lesson, frames, root / "exercises", repository)
            missing += absent
            nbformat.write(notebook, source / f"{lesson.page}.ipynb")
        if (root / "notebooks" / "images").is_dir():
            shutil.copytree(root / "notebooks" / "images", source / "images")
        (source / "index.md").write_text(landing_page(course, frames, repository))
        progress(f"Sphinx: {len(course) + 1} pages ...")
        _sphinx(source, Path(scratch) / "doctrees", out)
    pictures = out / "_explorers"
    pictures.mkdir(exist_ok=True)
    for drawn in frames.values():
        for digest, png in drawn.pictures.items():
            (pictures / f"{digest}.png").write_bytes(png)
    return Built(out, time.perf_counter() - start, course, len(list(pictures.glob("*.png"))),
                 sum(drawn.settings for drawn in frames.values()), missing)


def _check_replaceable(out: Path) -> None:
    """``out`` is replaced by the build: refuse a file, or a folder with files in it that no build wrote."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"out {str(out)!r} is a file, not a folder for the site")
    if out.is_dir() and any(out.iterdir()) and not (out / ".buildinfo").is_file():
        raise ValueError(f"out {str(out)!r} holds files no site build wrote (no .buildinfo): the build replaces its "
                         "folder, so give a new or empty one")


def _sphinx(source: Path, doctrees: Path, out: Path) -> None:
    from sphinx.cmd.build import build_main

    if out.exists():
        shutil.rmtree(out)
    status = build_main(["-b", "html", "-q", "-W", "--keep-going", "-c", str(SPHINX_CONF), "-d", str(doctrees),
                         str(source), str(out)])
    if status:
        raise RuntimeError(f"Sphinx failed (exit status {status}): its warnings are above")


# ---------------------------------------------------------------------------------------------------------------
# The landing page


def landing_page(course: list[lessons.Lesson], frames: dict[str, explorers.Frames], repository: str = "") -> str:
    """``index.md``: what the course is, how to run it and read it, the course map, which explorers are live."""
    parts = [INTRO.format(clone=lessons.clone_command(repository))]
    for lesson in course:
        exercise = (", ".join(f"`exercises/{lessons.grading.EXERCISES[topic][0]}`" for topic in lesson.exercises)
                    or "none")
        parts.append(f"### [{lesson.title}]({lesson.page}.ipynb)\n\n{lesson.teaches}\n\n"
                     f'<p class="lk-lesson-facts">about {lesson.reading_minutes} min of reading · the notebook ran '
                     f"in {lessons.duration(lesson.run_seconds)} on the reference machine · exercise: "
                     f"{_inline(exercise)}</p>\n")
    parts.append(EXPLORERS_INTRO)
    pages = {lesson.number: lesson for lesson in course}
    for entry in explorers.EXPLORERS:
        if entry.lesson in pages and entry.key in frames:
            drawn = frames[entry.key]
            stepped = ", ".join(control.description for control in drawn.controls)
            others = ", ".join([name for name, _ in drawn.fixed] + ([entry.notebook_only] if entry.notebook_only
                                                                     else [])) or "none"
            anchor = f"{pages[entry.lesson].page}.html#explorer-{entry.key}"  # an id in the page's raw HTML
            parts.append(f'| <a href="{anchor}">{entry.lesson}</a> | '
                         f"`{entry.call}` | {stepped} ({drawn.settings} settings) | {others} |")
    parts.append("\n```{toctree}\n:hidden:\n:maxdepth: 1\n\n" +
                 "\n".join(lesson.page for lesson in course) + "\n```\n")
    return "\n".join(parts)


def _inline(markdown_code: str) -> str:
    """Backticks to ``<code>`` (the facts line is HTML, where markdown is not read)."""
    import re

    return re.sub(r"`([^`]+)`", r"<code>\1</code>", markdown_code)


INTRO = """# labkit: learn distributed training by building it

Every technique used to train large models (collectives, data parallelism, ZeRO and FSDP, tensor, pipeline,
context and expert parallelism, 3D layouts and their planning, checkpoints, monitoring) built from scratch on
`torch.distributed`, checked against PyTorch's own implementation, and taught one notebook at a time. This is the
web edition: every lesson as it ran, with its outputs, figures and checks. Nothing on these pages runs; the
notebooks do, on any laptop's CPU with several processes.

## Run the course on your machine

```bash
{clone}
make lab    # creates .venv, installs labkit and JupyterLab, prints the URL to open (no GPU needed)
```

Start with lesson 00; the lessons build on each other in order. Each ends with an exercise in `exercises/`,
graded by the notebook's last cells or by `labkit grade`.

## How to read a page

- **Outputs are stored, not re-run.** Each page shows its notebook exactly as it was executed when its outputs were
  stored, and as the project's tests check it on every change: run again on two kinds of CPU kernels, every
  output must come out the same, but for the numbers marked `~`.
- **Claims are marked.** A line starting with ✓ is something the lesson checked as it ran. Tagged *computed*, it
  comes from a model, a count, a simulation or a comparison with PyTorch, and is the same on every machine (a
  rounding difference it prints, `differs by ~3.0e-08`, is marked `~` as it varies with the CPU, within the
  tolerance stated). Tagged *measured*, it holds a number marked `~` (dotted underline), measured on the machine
  that stored the lesson, and held to a band or a condition that the line or the lesson states: on your machine
  that number will differ, and the claim still holds.
- **The exercise's checks** are tagged *exercise*: they graded the file as it is given, unfinished.
- **Explorers step through pictures.** Each explorer shows the pictures the lesson's own code drew for a small
  grid of its settings when this site was built; the box says which controls move here and what stays fixed.
  Every control moves in the notebook.
- **The exercise** is stated before its grading cell, with the file you complete.

## The lessons
"""

EXPLORERS_INTRO = """
## The explorers on these pages

Live on the page: the controls listed, over the settings drawn when the site was built. Every other control of
the explorer needs the notebook (it opens there at the value the page keeps fixed).

| lesson | explorer | live on the page | needs the notebook |
| --- | --- | --- | --- |"""
