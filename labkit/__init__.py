"""labkit — distributed deep-learning training, built from scratch and checked against PyTorch.

Start with ``labkit.launch.launch`` (run a function on N ranks) and ``labkit.dist`` (who am I, where are my
tensors).  Each technique lives in a module named after it, or a folder when it needs more than one file
(the same file name meaning the same thing in every folder: README's Layout), written to be read top to bottom.
"""

from labkit import dist, launch

__version__ = "0.1.0"
__all__ = ["dist", "launch", "__version__"]
