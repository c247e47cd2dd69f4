"""Analytical models: what the measurements are held to.  Pure arithmetic, no process groups.

- ``compute``: FLOPs, GPUs and their links, training time and MFU (lessons 00 and 11);
- ``collectives``: the alpha-beta cost of each collective, the all-to-all's on two links, and the bytes that
  leave a rank, the one way labkit's models of messages count them (lesson 01);
- ``step``: the time of a training step, with overlap (lesson 02), and of a 3D step, each term apart (lesson 11),
  from ``stages`` (each pipeline stage's compute and parameters), ``kernels`` (a layer's time on a GPU, kernel by
  kernel) and ``gradient_sync`` (the data-parallel terms on the schedule's timeline);
- ``memory``: bytes per rank under DP, ZeRO, TP and PP (lessons 04-06), ``rank_memory`` on the fullest GPU of a 3D
  layout; ``shapes``: transformers' parameters and activations;
- ``hardware``: the GPUs and links every lesson prices, and which link a group's messages take; ``planner``, ``published``, ``validation``: lesson 11's
  planner, the published runs it is held to, and the fit held out of sample;
- ``tensor_parallel``: every collective of a tensor-parallel step, and its time (lesson 06);
- ``stragglers``: what waiting for the slowest worker costs, and what asynchrony costs in staleness (lesson 08).
"""
