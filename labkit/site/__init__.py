"""The course on the web: a static HTML edition of every stored lesson (``make site``).

:mod:`labkit.site.build` builds it, :mod:`labkit.site.lessons` makes a stored notebook into a page, and
:mod:`labkit.site.explorers` draws each explorer's grid of pictures; ``labkit/site/sphinx/conf.py`` configures
Sphinx and ``labkit/site/static/`` holds the page's own style and script.
"""
