"""Math as MathML, written when the site is built: no script and no font to fetch when a page opens.

Every browser in use renders MathML (Chromium and Edge since 2023, Firefox and Safari long before), so a page
needs neither MathJax nor KaTeX.  ``latex2mathml`` converts each formula; one it cannot convert fails the
build with the formula named (Sphinx's warnings are errors in ``make site``).
"""

from __future__ import annotations

from docutils import nodes
from latex2mathml.converter import convert
from sphinx.util import logging

LOG = logging.getLogger(__name__)


def to_mathml(latex: str, display: str) -> str:
    """``latex`` as a ``<math>`` element (``display``: ``"inline"`` or ``"block"``)."""
    return convert(latex.strip(), display=display)


def _render(translator, node: nodes.Element, display: str) -> None:
    latex = node.astext()
    try:
        markup = to_mathml(latex, display)
    except Exception as error:  # latex2mathml raises its own exception types
        LOG.warning(f"math not converted to MathML ({type(error).__name__}: {error}): {latex!r}", location=node)
        markup = f'<code class="lk-math-source">{translator.encode(latex)}</code>'
    if display == "block":
        markup = f'<div class="math lk-math-block">{markup}</div>'
    translator.body.append(markup)
    raise nodes.SkipNode


def visit_inline(translator, node: nodes.Element) -> None:
    _render(translator, node, "inline")


def visit_block(translator, node: nodes.Element) -> None:
    _render(translator, node, "block")


def setup(app) -> dict:
    app.add_html_math_renderer("mathml", (visit_inline, None), (visit_block, None))
    return {"parallel_read_safe": True, "parallel_write_safe": True}
