"""Sphinx's configuration for the course's web edition (``make site``; labkit/site/build.py writes the sources).

Sphinx with MyST-NB reads the stored notebooks without executing them; Furo lays the pages out (a sidebar of
lessons that folds away on a phone, each page's table of contents, previous and next).  Nothing is fetched from a
network when a page opens: math is written as MathML when the site is built (``mathml.py``), which browsers
render without a script or a font, and MyST-NB's widget scripts (loaded from a CDN) are turned off.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

project = "labkit"
author = "the labkit authors"
copyright = "the labkit authors"
sys.path.insert(0, str(HERE))  # mathml.py, the math renderer beside this file

extensions = ["myst_nb", "sphinx.ext.githubpages", "mathml"]
html_math_renderer = "mathml"
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
nb_execution_mode = "off"  # the stored outputs are the checked ones
nb_ipywidgets_js = {}  # MyST-NB's widget scripts come from a CDN; the explorers use labkit's own (explorer.js)
nb_merge_streams = False
nb_render_markdown_format = "myst"
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "html_image"]
myst_heading_anchors = 3
myst_update_mathjax = False  # no MathJax: math is MathML (mathml.py)
suppress_warnings = ["mystnb.unknown_mime_type"]

html_theme = "furo"
html_title = "labkit: distributed training, built from scratch"
html_static_path = [str(HERE.parent / "static")]
html_css_files = ["labkit-site.css"]
html_favicon = str(HERE.parent / "static" / "favicon.svg")  # four ranks on a ring (a browser asks for one)
html_js_files = ["explorer.js"]
html_copy_source = False
html_show_sourcelink = False
html_last_updated_fmt = None
html_theme_options = {"navigation_with_keys": True}
