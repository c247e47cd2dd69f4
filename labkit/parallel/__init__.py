"""The parallelisms, one module each, all keeping the contract of ``labkit.parallel.base``."""
