"""What a built site must hold, read from its files: every link resolves, every picture is there, nothing is fetched.

:func:`problems` reads each page of a built folder and lists, in words, every internal link whose page or anchor
is missing, every image or script or style sheet the folder lacks (or holds empty), every resource a page would
fetch from another host, every picture an explorer's controls can show that is not there, and every lesson the
landing page does not link.  ``python -m labkit.site`` runs it
after a build; ``tests/test_site_browser.py`` runs it beside the checks only a browser can make (console errors,
pictures decoded, controls that change them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

NAVIGATION = ("next", "prev", "index", "search", "top", "canonical")  # <link rel=...> a page links, not loads
FETCHED = {("img", "src"), ("script", "src"), ("link", "href"), ("source", "src"), ("iframe", "src")}


@dataclass
class Page:
    """One HTML file: the ids it defines, its links, and the resources it loads."""

    ids: set[str] = field(default_factory=set)
    links: list[str] = field(default_factory=list)
    resources: list[tuple[str, str]] = field(default_factory=list)  # (tag, url)
    explorers: list[dict] = field(default_factory=list)  # each explorer's data (labkit/site/lessons.py)


class _Reader(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.page = Page()
        self.in_explorer_data = False

    def handle_data(self, data: str) -> None:
        if self.in_explorer_data:
            self.page.explorers.append(json.loads(data))

    def handle_endtag(self, tag: str) -> None:
        self.in_explorer_data = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {name: value or "" for name, value in attrs}
        self.in_explorer_data = tag == "script" and "lk-explorer-data" in values.get("class", "").split()
        for name in ("id", "name") if tag == "a" else ("id",):
            if values.get(name):
                self.page.ids.add(values[name])
        if tag == "a" and "href" in values or tag == "link" and values.get("rel") in NAVIGATION:
            self.page.links.append(values["href"])
        for fetched_tag, attribute in FETCHED:
            if tag == fetched_tag and values.get(attribute):
                if tag == "link" and values.get("rel") not in ("stylesheet", "icon", "preload", "shortcut icon"):
                    continue
                self.page.resources.append((tag, values[attribute]))


def read_page(path: Path) -> Page:
    reader = _Reader()
    reader.feed(path.read_text(encoding="utf-8"))
    return reader.page


def _external(url: str) -> bool:
    parts = urlsplit(url)
    return bool(parts.scheme in ("http", "https") or parts.netloc)


def problems(site: Path, lesson_pages: list[str] | None = None) -> list[str]:
    """Everything wrong with the built ``site``, in words (empty when nothing is); ``lesson_pages``: the pages
    (``"07_pipeline_parallel.html"``) the landing page must link."""
    site = Path(site)
    pages = {path.resolve(): read_page(path) for path in sorted(site.rglob("*.html"))}
    found = []
    for path, page in pages.items():
        name = path.relative_to(site.resolve())
        for tag, url in page.resources:
            if _external(url):
                found.append(f"{name}: <{tag}> fetches {url} from another host")
                continue
            target = (path.parent / unquote(urlsplit(url).path)).resolve()
            if not target.is_file() or target.stat().st_size == 0:
                found.append(f"{name}: <{tag}> {url}: {'empty' if target.is_file() else 'no such file'}")
        for data in page.explorers:  # every picture an explorer's controls can show
            for frame in data["frames"]:
                picture = path.parent / "_explorers" / f"{frame['picture']}.png"
                if not picture.is_file() or picture.stat().st_size == 0:
                    found.append(f"{name}: an explorer's picture _explorers/{frame['picture']}.png is missing")
        for url in page.links:
            parts = urlsplit(url)
            if _external(url) or parts.scheme in ("mailto", "javascript"):
                continue
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path.resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                found.append(f"{name}: link {url}: no such page")
            elif parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else read_page(target).ids
                if unquote(parts.fragment) not in ids:
                    found.append(f"{name}: link {url}: no anchor #{parts.fragment} in {target.name}")
    index = site / "index.html"
    if not index.is_file():
        found.append("no index.html")
    elif lesson_pages:
        linked = {urlsplit(url).path for url in pages[index.resolve()].links}
        found += [f"index.html does not link the lesson {page}" for page in lesson_pages if page not in linked]
    return found
