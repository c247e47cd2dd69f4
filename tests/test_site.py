"""The web edition's parts, without building it (tests/test_site_browser.py builds it and opens every page):
which cells are explorers and that each has a drawing, how claims are marked, the boxes a page adds, the grid of
an explorer's pictures, the checker of a built folder, and a lesson found with no list to edit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ipywidgets
import nbformat
import pytest

from labkit.site import build, check, explorers, lessons

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def _explorer_cells() -> list[tuple[str, str]]:
    found = []
    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "code" and not cell.outputs and (call := explorers.explorer_call(cell.source)):
                found.append((path.name[:2], call))
    return found


def test_every_explorer_of_every_lesson_has_a_drawing_and_every_drawing_a_lesson():
    cells = _explorer_cells()
    assert len(cells) >= 18
    missing = [f"lesson {lesson}'s {call}" for lesson, call in cells if explorers.find(lesson, call) is None]
    assert not missing, (f"add an Explorer(lesson, call, make, steps) to labkit/site/explorers.py for {missing}: "
                         "the site has no picture of them")
    stale = [entry.key for entry in explorers.EXPLORERS if (entry.lesson, entry.call) not in cells]
    assert not stale, f"labkit/site/explorers.py draws explorers no lesson shows: {stale}"


@pytest.mark.parametrize(("source", "call"), [
    ("widgets.alpha_beta_explorer(links, world_size=8)", "alpha_beta_explorer"),
    ("from x import layout_explorer\n\nlayout_explorer()", "layout_explorer"),
    ("explorer = widgets.memory_explorer()", None),  # an assignment shows nothing
    ("display(experts_plots.plot_explorer(8, 2))\nprint(1)", None),
    ("plots.plot_ring_step(states)", None),
    ("%matplotlib inline\nlayout_explorer()", None),  # not Python: never guessed at
])
def test_an_explorer_cell_is_one_whose_last_expression_calls_an_explorer(source, call):
    assert explorers.explorer_call(source) == call


def test_an_explorer_steps_one_to_three_controls_and_few_pictures():
    with pytest.raises(ValueError, match="at most 48 pictures"):
        explorers.Explorer("99", "big_explorer", dict, {"a": range(7), "b": range(7)})
    with pytest.raises(ValueError, match="no values to step for 'a'"):
        explorers.Explorer("99", "empty_explorer", dict, {"a": ()})


def _toy_explorer(clamp: bool = False) -> ipywidgets.VBox:
    """Two sliders, a fixed dropdown, a picture of their values and a summary; ``clamp``: moving ``a`` to 2 also
    moves the fixed dropdown, as a badly chosen grid would."""
    a = ipywidgets.IntSlider(value=1, min=0, max=3, description="a")
    b = ipywidgets.Dropdown(options=[("ten", 10), ("twenty", 20)], value=20, description="b")
    fixed = ipywidgets.Dropdown(options=["x", "y"], value="x", description="fixed")
    picture, summary = ipywidgets.Image(format="png"), ipywidgets.HTML()

    def redraw(_change=None) -> None:
        if clamp and a.value == 2:
            fixed.value = "y"
        picture.value = f"{a.value},{b.value},{fixed.value}".encode()
        summary.value = f"<b>a={a.value}</b>"

    for control in (a, b, fixed):
        control.observe(redraw, names="value")
    redraw()
    return ipywidgets.VBox([ipywidgets.HBox([a, b, fixed]), summary, picture])


def test_the_frames_are_the_widgets_own_pictures_in_row_major_order_and_the_rest_stays_fixed():
    entry = explorers.Explorer("99", "toy_explorer", _toy_explorer, {"a": (0, 1, 3), "b": (10, 20)})
    drawn = explorers.draw_frames(entry)
    shown = [drawn.pictures[frame["picture"]].decode() for frame in drawn.frames]
    assert shown == ["0,10,x", "0,20,x", "1,10,x", "1,20,x", "3,10,x", "3,20,x"]
    assert [frame["shown"] for frame in drawn.frames][:2] == [["0", "ten"], ["0", "twenty"]]
    assert drawn.frames[4]["summary"] == "<b>a=3</b>"
    assert [(c.description, c.kind, c.labels, c.opening) for c in drawn.controls] == [
        ("a", "range", ["0", "1", "3"], 1), ("b", "select", ["ten", "twenty"], 1)]
    assert drawn.fixed == [("fixed", "x")]
    html = lessons.explorer_html(entry, drawn, "toy_explorer")
    data = json.loads(html.split('class="lk-explorer-data">')[1].split("</script>")[0])
    assert data["opening"] == 3 and f'src="_explorers/{drawn.frames[3]["picture"]}.png"' in html  # a=1, b=20
    assert "Fixed here" in html and "fixed = x" in html
    with pytest.raises(ValueError, match=r"moved \['fixed'\]"):
        explorers.draw_frames(explorers.Explorer("99", "toy_explorer", lambda: _toy_explorer(clamp=True),
                                                 {"a": (0, 1, 2)}))
    with pytest.raises(ValueError, match=r"'a' opens at 1 in the notebook, which is not among the values stepped"):
        explorers.draw_frames(explorers.Explorer("99", "toy_explorer", _toy_explorer, {"a": (0, 2)}))
    with pytest.raises(ValueError, match="no control described \\['c'\\]"):
        explorers.draw_frames(explorers.Explorer("99", "toy_explorer", _toy_explorer, {"c": (1,)}))


def test_claim_lines_are_marked_measured_or_computed_and_measured_numbers_underlined():
    text = ("plain line <b>\n"
            "✓ the replicas are bit-identical\n"
            "✓ no schedule beats the floor: measured ~61.1 ms, within 0.9x to 4x of ~50.4 ms\n"
            "✗ 4 workers: expected 0.78x to 1.9x, measured ~2.1x\n"
            "\x1b[31mred\x1b[0m done")
    html = lessons.stream_html(text)
    lines = html.removeprefix('<pre class="lk-stream lk-stdout">').removesuffix("</span></pre>").split("</span><span")
    assert lines[0] == '<span class="lk-line">plain line &lt;b&gt;'
    assert len(lines) == 5
    assert 'class="lk-line lk-claim lk-computed lk-holds"' in lines[1] and "lk-measured-value" not in lines[1]
    assert 'class="lk-line lk-claim lk-measured lk-holds"' in lines[2] and lines[2].count("lk-measured-value") == 2
    assert 'class="lk-line lk-claim lk-measured lk-missed"' in lines[3]
    assert lines[4] == ' class="lk-line">red done'
    pieces = [nbformat.v4.new_output("stream", name="stdout", text="a\n"),
              nbformat.v4.new_output("stream", name="stdout", text="b\n"),
              nbformat.v4.new_output("stream", name="stderr", text="c\n")]
    assert [(o.name, o.text) for o in lessons.merged_streams(pieces)] == [("stdout", "a\nb\n"), ("stderr", "c\n")]


@pytest.mark.parametrize(("line", "kind"), [
    ("✓ labkit DDP, 3 ranks: equal to single-process training: differs by ~3.0e-08 (within 1e-06)", "computed"),
    ("✓ DeepSeek-V3's active parameters: differs by ~8.52e+08 (within 0.025 relative)", "computed"),
    ("✓ the simulator gives the closed form: differs by ~0.0e+00 (within 1e-12)", "computed"),
    ("✓ 12 slots: every sample once, samples 0 and 1 twice", "computed"),
    ("✓ no schedule beats the floor: measured ~61.1 ms, within 0.9x to 4x of ~50.4 ms", "measured"),
    ("✓ a launch costs well under 2 s: ~0.10 s, ~0.11 s, ~0.26 s", "measured"),
    ("✓ both: differs by ~1e-07 (within 1e-06), in ~3.2 ms", "measured"),
])
def test_a_claim_is_measured_by_its_measured_numbers_not_by_a_rounding_difference(line, kind):
    assert lessons.claim_kind(line) == kind


def test_the_exercises_checks_are_tagged_as_such_not_as_claims():
    text = "✗ shard_bounds is not written yet: complete it in exercises/00_setup.py\n✓ a check passed"
    html = lessons.stream_html(text, graded=True)
    assert html.count('class="lk-line lk-exercise"') == 2 and "lk-claim lk-" not in html


def _fake_course(tmp_path: Path, numbers: tuple[str, ...], rows: tuple[str, ...]) -> tuple[Path, Path]:
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    for number in numbers:
        notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(f"# {number} · A lesson\n\nwords"),
                                                   nbformat.v4.new_code_cell('grading.check("setup")')])
        nbformat.write(notebook, notebooks / f"{number}_lesson.ipynb")
    readme = tmp_path / "README.md"
    readme.write_text("## The course\n\n| notebook | lesson | status |\n| --- | --- | --- |\n" +
                      "".join(f"| `{number}_lesson.ipynb` | lesson {number}, taught | ready |\n" for number in rows))
    return notebooks, readme


def test_a_lesson_added_to_notebooks_is_on_the_site_with_no_list_to_edit(tmp_path):
    notebooks, readme = _fake_course(tmp_path, ("00", "16"), ("00", "16"))
    course = lessons.read_lessons(notebooks, readme)
    assert [(lesson.number, lesson.page, lesson.teaches) for lesson in course] == [
        ("00", "00_lesson", "lesson 00, taught"), ("16", "16_lesson", "lesson 16, taught")]
    landing = build.landing_page(course, {})
    assert "### [16 · A lesson](16_lesson.ipynb)" in landing and "\n16_lesson\n```" in landing


def test_a_lesson_missing_from_the_readmes_course_map_is_an_error_naming_the_row_to_add(tmp_path):
    notebooks, readme = _fake_course(tmp_path, ("00", "16"), ("00",))
    with pytest.raises(ValueError, match=r"16_lesson.ipynb is not in the course map.*'\| `16_lesson.ipynb` \|"):
        lessons.read_lessons(notebooks, readme)


def test_the_readme_course_map_names_every_lesson_the_site_builds():
    course = lessons.read_lessons(NOTEBOOKS, ROOT / "README.md")
    assert [lesson.path.name for lesson in course] == sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    assert all(lesson.run_seconds > 1 and lesson.stored_on.startswith("20") for lesson in course)


def test_a_page_adds_the_run_box_after_the_title_and_the_exercise_before_its_grading_cell():
    lesson = next(item for item in lessons.read_lessons(NOTEBOOKS, ROOT / "README.md") if item.number == "03")
    page, missing = lessons.page_notebook(lesson, {}, ROOT / "exercises", "https://example.org/labkit.git")
    assert missing == ["03_batch_size_and_lr.ipynb: lr_schedule_explorer"]  # no frames were given
    assert page.cells[1].source.startswith(":::{admonition} Run this lesson")
    assert "git clone https://example.org/labkit.git labkit" in page.cells[1].source
    graded = next(i for i, cell in enumerate(page.cells) if 'grading.check("lr_scaling")' in cell.source)
    assert page.cells[graded - 1].source.startswith("::::{admonition} The exercise: Scaling the learning rate")
    box = page.cells[graded - 1].source
    assert "exercises/03_lr_scaling.py" in box and "Exercise 03 —" not in box.split("<details")[0]  # said once
    assert "````python\n" + (ROOT / "exercises" / "03_lr_scaling.py").read_text().rstrip() + "\n````" in box
    assert page.cells[0].source == "# " + lesson.title  # the box to run it right under the title
    streams = [output for cell in page.cells if cell.cell_type == "code" for output in cell.outputs
               if output.output_type == "stream"]
    assert not streams  # every printed line went through stream_html


def _site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    (site / "_explorers").mkdir(parents=True)
    (site / "_explorers" / "abc.png").write_bytes(b"\x89PNG")
    (site / "style.css").write_text("p {}")
    data = json.dumps({"frames": [{"picture": "abc"}]})
    (site / "index.html").write_text('<link rel="stylesheet" href="style.css"><a href="01_a.html#part">1</a>'
                                     '<a href="https://example.org/paper">cited</a>')
    (site / "01_a.html").write_text(f'<h2 id="part">x</h2><img src="_explorers/abc.png"><a href="#part">here</a>'
                                    f'<script type="application/json" class="lk-explorer-data">{data}</script>')
    return site


def test_the_checker_passes_a_whole_site_and_names_each_thing_broken_in_it(tmp_path):
    site = _site(tmp_path)
    assert check.problems(site, ["01_a.html"]) == []
    (site / "01_a.html").write_text((site / "01_a.html").read_text().replace('"abc"', '"gone"')
                                    .replace('href="#part"', 'href="#nowhere"') +
                                    '<script src="https://cdn.example.org/x.js"></script><img src="empty.png">')
    (site / "empty.png").write_bytes(b"")
    (site / "index.html").write_text((site / "index.html").read_text() + '<a href="02_b.html">2</a>')
    assert check.problems(site, ["01_a.html", "03_c.html"]) == [
        "01_a.html: <script> fetches https://cdn.example.org/x.js from another host",
        "01_a.html: <img> empty.png: empty",
        "01_a.html: an explorer's picture _explorers/gone.png is missing",
        "01_a.html: link #nowhere: no anchor #nowhere in 01_a.html",
        "index.html: link 02_b.html: no such page",
        "index.html does not link the lesson 03_c.html",
    ]


def test_the_site_command_refuses_a_bad_worker_count_before_building():
    result = subprocess.run([sys.executable, "-m", "labkit.site", "--workers", "0", "--out", "/nonexistent/x"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--workers must be at least 1, got 0" in result.stderr
    with pytest.raises(ValueError, match="workers must be at least 1, got 0"):
        build.build("/nonexistent/x", workers=0)


def test_the_build_never_replaces_a_folder_it_did_not_write(tmp_path):
    (tmp_path / "notes.txt").write_text("a student's work")
    with pytest.raises(ValueError, match="holds files no site build wrote"):
        build.build(tmp_path, workers=1)
    with pytest.raises(ValueError, match="is a file, not a folder"):
        build.build(tmp_path / "notes.txt", workers=1)
    assert (tmp_path / "notes.txt").read_text() == "a student's work"


def test_the_pages_workflow_builds_the_site_as_make_site_does_and_publishes_that_folder():
    workflow = (ROOT / ".github" / "workflows" / "site.yml").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert "SITE ?= build/site" in makefile and "run: make site" in workflow
    assert "path: build/site" in workflow and "actions/upload-pages-artifact" in workflow
    assert "actions/deploy-pages" in workflow and "pages: write" in workflow and "id-token: write" in workflow
    assert "branches: [main]" in workflow
