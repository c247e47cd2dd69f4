"""``python -m labkit.site [--out build/site] [--workers N]``: build the course's web edition (``make site``)."""

from __future__ import annotations

import argparse
import sys

from labkit.site import check
from labkit.site.build import build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.site", description=__doc__)
    parser.add_argument("--out", default="build/site", help="the folder to write (replaced); default build/site")
    parser.add_argument("--workers", type=int, default=None, help="processes drawing the explorers (default: cores)")
    args = parser.parse_args(argv)
    if args.workers is not None and args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    built = build(args.out, workers=args.workers, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(built.describe())
    found = check.problems(built.out, [f"{lesson.page}.html" for lesson in built.lessons])
    for problem in found:
        print(f"problem: {problem}", file=sys.stderr)
    print(f"open it: {built.out / 'index.html'} (or `make site-serve`)")
    return 1 if found or built.missing_explorers else 0


if __name__ == "__main__":
    sys.exit(main())
