"""Execute notebooks and store their outputs as a learner should first see them.

    .venv/bin/python notebooks/store.py                      # every notebook
    .venv/bin/python notebooks/store.py 03_batch_size_and_lr  # some of them

What is stored, and why:

- **The exercises' own mode.**  The notebooks run against ``exercises/`` (the untouched stubs), not
  ``solutions/``: a learner who opens a notebook reads "exercises from: exercises/", a try-it cell that says
  which function to write next, and the grading cell's ✗ hints with a score of 0, never somebody else's full
  marks.  Those cells are tagged ``nbval-ignore-output``; CI runs every notebook with ``LABKIT_SOLUTIONS=1``
  under nbval, where ``grading.check`` raises unless the reference solutions pass every check, so the
  solutions are still proved on every run.
- **No widget views.**  A widget's stored view needs its live model, which exists only while the kernel that
  made it runs: stored, it shows "Error displaying widget: model not found" until the cell is run again.  Such
  outputs (and the notebook's saved widget state) are dropped, so an explorer cell shows nothing until it runs.
  Those cells are tagged ``nbval-ignore-output`` too: their live output is a widget, not a figure to compare.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
IGNORE = "nbval-ignore-output"


def strip_widget_views(notebook: nbformat.NotebookNode) -> int:
    """Drop every output that is a widget view, tag its cell for nbval; return how many were dropped."""
    dropped = 0
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        kept = [output for output in cell.get("outputs", []) if WIDGET_VIEW not in output.get("data", {})]
        if len(kept) != len(cell.get("outputs", [])):
            dropped += len(cell.outputs) - len(kept)
            cell.outputs = kept
            tags = cell.metadata.setdefault("tags", [])
            if IGNORE not in tags:
                tags.append(IGNORE)
    notebook.metadata.pop("widgets", None)
    return dropped


def store(path: Path, timeout: int = 600) -> float:
    """Execute ``path`` in the exercises' mode, strip widget views, write it back; return the seconds taken."""
    notebook = nbformat.read(path, as_version=4)
    environment = {key: value for key, value in os.environ.items() if key != "LABKIT_SOLUTIONS"}
    environment["LABKIT_STRICT_CLAIMS"] = "1"  # what is stored holds every claim (labkit/claims.py)
    start = time.perf_counter()
    previous = dict(os.environ)
    os.environ.clear()
    os.environ.update(environment)  # the kernel inherits this process's environment
    try:
        NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(previous)
    seconds = time.perf_counter() - start
    strip_widget_views(notebook)
    nbformat.write(notebook, path)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebook names (default: all), e.g. 00_setup")
    args = parser.parse_args(argv)
    paths = [HERE / f"{name.removesuffix('.ipynb')}.ipynb" for name in args.names] or sorted(HERE.glob("*.ipynb"))
    for path in paths:
        if not path.is_file():
            print(f"store.py: no notebook {path}", file=sys.stderr)
            return 2
        print(f"{path.name}: executed and stored in {store(path):.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
