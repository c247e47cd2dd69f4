"""The parallelisms, each a module named after it or, when it needs more than one file, a folder (``model.py`` the
technique applied to a model, ``state.py`` its full state for checkpoints, ``timing.py`` measured on launched
ranks, ``simulate.py`` modelled time), all keeping the contract of ``labkit.parallel.base``."""
