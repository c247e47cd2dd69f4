"""A parameter server from point-to-point messages (lesson 08).

- ``runtime``: :func:`run_parameter_server` on real ranks — synchronous, asynchronous, stale synchronous
  parallel, bounded delay and backup workers (:class:`Gate`), stragglers (:class:`Stragglers`), sharded servers;
- ``messages``: what travels (weights with their version, gradients with theirs) and the worker's loop;
- ``simulate``: the same gates driven by modelled compute times, no process group.
"""

from labkit.parallel.parameter_server.runtime import (
    MODES,
    STOP,
    Decision,
    Gate,
    ParameterServerRun,
    Received,
    ShardRecord,
    Stragglers,
    run_parameter_server,
)

__all__ = ["MODES", "STOP", "Decision", "Gate", "ParameterServerRun", "Received", "ShardRecord", "Stragglers",
           "run_parameter_server"]
