"""Figures (plots.py: data in, matplotlib Figure out) and ipywidgets explorers (widgets.py) for the notebooks."""
