"""Compare a notebook's fresh outputs with its stored ones as nbval does (tests/test_browser.py's Run All).

nbval's rules, kept the same so that both passes hold a notebook to one standard: a code cell tagged
``nbval-ignore-output`` or ``nbval-skip`` is not compared; streams of one name are joined (carriage returns and
backspaces applied); every output field and every MIME type of ``data`` is compared, after the sanitising
regexes of ``notebooks/sanitize.cfg``, except those nbval skips (images, widget views, metadata, tracebacks,
execution counts).  nbval's own helpers do the joining and read the patterns.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from tests.conftest import REPO

SKIP = {"metadata", "traceback", "prompt_number", "output_type", "name", "execution_count",
        "application/vnd.jupyter.widget-view+json", "image/png", "image/jpeg"}
UNCHECKED_TAGS = {"nbval-ignore-output", "nbval-skip"}


def sanitize_patterns(path: Path = REPO / "notebooks" / "sanitize.cfg") -> list[tuple[str, str]]:
    from nbval.plugin import get_sanitize_patterns

    return get_sanitize_patterns(path.read_text())


def _text(value: Any) -> Any:
    return "".join(value) if isinstance(value, list) else value


def comparable(outputs: list[dict], patterns: list[tuple[str, str]]) -> dict[str, list[Any]]:
    """``{field or MIME type: [sanitised value, ...]}`` of ``outputs`` (nbformat dicts), in order."""
    import nbformat
    from nbval.plugin import coalesce_streams, transform_streams_for_comparison

    def sanitize(value: Any) -> Any:
        value = _text(value)
        if isinstance(value, str):
            for regex, replace in patterns:
                value = re.sub(regex, replace, value)
        return value

    nodes = [nbformat.from_dict({key: _text(value) if key == "text" else value for key, value in output.items()})
             for output in outputs]
    found: dict[str, list[Any]] = defaultdict(list)
    for output in transform_streams_for_comparison(coalesce_streams(nodes)):
        for key, value in output.items():
            if key == "data":
                for mime, content in value.items():
                    if mime not in SKIP:
                        found[mime].append(sanitize(content))
            elif key not in SKIP:
                found[key].append(sanitize(value))
    return dict(found)


def output_differences(stored: list[dict], fresh: list[list[dict]], describe: Any) -> list[str]:
    """For each compared code cell of ``stored`` (a notebook's cells, as nbformat dicts) whose outputs differ
    from ``fresh[i]`` (the outputs the same cell gave now): a line naming the cell (``describe(i)``) and the
    first difference."""
    patterns, problems = sanitize_patterns(), []
    for index, (cell, outputs) in enumerate(zip(stored, fresh, strict=True)):
        if cell["cell_type"] != "code" or UNCHECKED_TAGS & set(cell.get("metadata", {}).get("tags", [])):
            continue
        want, got = comparable(cell.get("outputs", []), patterns), comparable(outputs, patterns)
        if want == got:
            continue
        if set(want) != set(got):
            difference = f"output fields {sorted(got)}, where the notebook stores {sorted(want)}"
        else:
            key = next(key for key in want if want[key] != got[key])
            difference = f"{key}: {_first_difference(got[key], want[key])}"
        problems.append(f"{describe(index)}: outputs differ from the stored ones: {difference}")
    return problems


def _first_difference(got: list[Any], want: list[Any]) -> str:
    if len(got) != len(want):
        return f"{len(got)} output(s), where the notebook stores {len(want)}"
    for mine, theirs in zip(got, want, strict=True):
        if mine != theirs:
            mine_lines, their_lines = str(mine).splitlines(), str(theirs).splitlines()
            for number, (a, b) in enumerate(zip(mine_lines, their_lines, strict=False)):
                if a != b:
                    return f"line {number + 1} is {a!r}, where the notebook stores {b!r}"
            return f"{len(mine_lines)} line(s), where the notebook stores {len(their_lines)}"
    return "?"
