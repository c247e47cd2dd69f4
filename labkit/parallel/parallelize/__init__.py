"""3D parallelism: pipeline, tensor, context, expert and data parallelism applied to one TinyGPT over a Mesh.

- ``model``: :func:`parallelize` (the order torchtitan applies them in), :class:`Parallel3D` (the wrapper
  contract over all of them), :func:`check_3d` (every degree and option checked before a process starts);
- ``state``: the full state for checkpoints — the dense model gathered over ep, tp and pp, and cut back on load;
- ``timing``: layouts measured on launched ranks (:func:`~labkit.parallel.parallelize.timing.time_layouts`) and
  a traced step split into its parts (:func:`~labkit.parallel.parallelize.timing.step_breakdown`).
"""

from labkit.parallel.parallelize.model import DP_WRAPPERS, ZERO_STAGES, Parallel3D, check_3d, parallelize

__all__ = ["DP_WRAPPERS", "ZERO_STAGES", "Parallel3D", "check_3d", "parallelize"]
