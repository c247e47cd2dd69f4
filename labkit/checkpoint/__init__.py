"""Checkpoints that resume a run exactly and survive a crash mid-save (lesson 09).

- ``state``: what a run needs to continue as if it had never stopped — :func:`save`, :func:`load`,
  :func:`check_compatible`, the full and sharded layouts, resharding on another number of ranks;
- ``files``: the files themselves — atomic writes, the manifest (sizes, SHA-256), checked reads, the newest
  finished checkpoint, this process's random number generators as plain values.
"""

from labkit.checkpoint.files import (
    FORMAT,
    MANIFEST,
    PARTIAL,
    CheckpointError,
    check_files,
    latest,
    read_file,
    read_manifest,
    remove_stale_partial_files,
    rng_state,
    serialise,
    set_rng_state,
    stale_partial_files,
    step_directory,
    write_atomically,
)
from labkit.checkpoint.state import (
    COMMON,
    LAYOUTS,
    STATE,
    Resumed,
    check_compatible,
    load,
    load_dcp_model,
    save,
    shard_file,
)

__all__ = ["COMMON", "FORMAT", "LAYOUTS", "MANIFEST", "PARTIAL", "STATE", "CheckpointError", "Resumed",
           "check_compatible", "check_files", "latest", "load", "load_dcp_model", "read_file", "read_manifest",
           "remove_stale_partial_files", "rng_state", "save", "serialise", "set_rng_state", "shard_file",
           "stale_partial_files", "step_directory", "write_atomically"]
