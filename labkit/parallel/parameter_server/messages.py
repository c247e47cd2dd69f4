"""The parameter server's messages (lesson 08): the worker's loop, the server's receiving end, and the message that
brings a shard server's results to server 0.  :mod:`labkit.parallel.parameter_server` holds the rule and the
server's loop; this module only moves tensors.

Group ranks ``0 .. k-1`` are the servers, ``k .. k+N-1`` the workers.  Each message is one flat tensor in the
weights' dtype (float32 for 16-bit weights): server ``i`` to a worker, ``[version]`` then shard ``i`` of the
weights (version ``STOP`` = -1: this server has spent its budget, the shard is final); a worker to server ``i``,
``[version pulled from server i, loss, step]`` then shard ``i`` of its gradient.  With one server the shard is the
whole vector.  Between a server and a worker messages alternate, one in flight at a time.

**Why every server finishes** (``k > 1``; with one server, the rule's own promise that some worker always
computes).  A server never waits on another server: a worker posts its receives from every server before it
waits on anything, so a server's send completes at once, and a server waits only in its inbox, for workers it
has released.  A worker waits until every server still serving it has answered, then sends its next gradient to
each of them.  A worker stopped by one server keeps training on that server's final shard for the others, so a
server stops workers only when *its* budget is spent, as one server does, and then holds none (it stops at once
every worker its rule still holds).  Could the servers hold workers in a circle for ever, each waiting for a
worker another holds?  In such a stand-still take the worker ``a`` whose last gradient was sent first, and any
server ``i`` holding it, at version ``v``, ``a`` having pulled version ``p``:

- a gradient applied on ``i`` no later than ``a``'s previous one was sent before ``a``'s last, so it is not its
  worker's last (``a``'s was sent first): every worker ``i`` waits for computes on a version after ``p``;
- sync and bounded_delay: each update since ``p`` was made while ``a`` computed on ``p``, so ``v - p <= tau``;
  applying now keeps every worker still computing (all on versions after ``p``) within ``tau``: the rule would
  have applied it;
- ssp: a server still serving holds a worker only while its clock is more than ``s`` ahead of the slowest's, and
  every server still serving a worker has received each gradient it sent, so the worker that sent the fewest is
  held by none; in a stand-still that worker would wait for nothing;
- backup: the ``N - b`` gradients of update ``v`` were all followed by newer ones from their workers (by the first
  point), computed on ``v``, which ``i`` holds: ``N - b`` of them make an update, so it would have applied them;
- async holds nothing.

So ``a`` (under ssp, the worker that sent the fewest) is held nowhere and is not waiting: there is no stand-still.  Every gradient a worker sends reaches every
server still serving it, so each server spends its budget as one server would, then stops each worker at its next
message; a worker returns when every server has stopped it.  Sync (and bounded_delay with ``tau = 0``) make the same
updates on every server, which therefore stop every worker in the same round, and no server sees a gradient past its
budget.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit.dist import global_rank

STOP = -1.0
SHARD_TAG = 1  # a shard server's results to server 0: never matched by a server's any-source receive (tag 0)


def load(flat: torch.Tensor, parameters: list[nn.Parameter]) -> None:
    """Copy ``flat`` into the parameters, each in its own dtype (``vector_to_parameters`` would make them views
    of ``flat``, in its dtype)."""
    with torch.no_grad():
        for parameter, chunk in zip(parameters, flat.split([p.numel() for p in parameters]), strict=True):
            parameter.copy_(chunk.view_as(parameter))


def work(model, parameters, flat, group, worker, bounds, batches, loss_fn, stragglers) -> int:
    """Worker ``worker`` (group rank ``k + worker``, ``k = len(bounds)`` servers; server ``i`` holds
    ``flat[bounds[i][0]:bounds[i][1]]``): train until every server has stopped it; the gradients it computed."""
    servers = [global_rank(group, i) for i in range(len(bounds))]
    inboxes = [torch.empty(1 + stop - start, dtype=flat.dtype, device=flat.device) for start, stop in bounds]
    serving = list(range(len(bounds)))
    pending = [dist.irecv(inboxes[i], src=servers[i], group=group) for i in serving]
    generator = stragglers.generator(worker)
    step = 0
    while True:
        for request in pending:
            request.wait()
        versions = {i: inboxes[i][0].item() for i in serving}
        for i in serving:  # a stopping server's shard is final: the others' gradients are computed on it
            flat[bounds[i][0]:bounds[i][1]].copy_(inboxes[i][1:])
        serving = [i for i in serving if versions[i] != STOP]
        if not serving:
            return step
        load(flat, parameters)
        model.zero_grad(set_to_none=True)
        x, y = batches(worker, step)
        loss = loss_fn(model, x, y)
        loss.backward()
        gradient = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(flat.dtype)
                              for p in parameters])
        delay = stragglers.delay(worker, generator)
        if delay > 0:
            time.sleep(delay)
        messages = [torch.cat([torch.tensor([versions[i], loss.item(), float(step)], dtype=flat.dtype,
                                            device=flat.device), gradient[bounds[i][0]:bounds[i][1]]])
                    for i in serving]
        sends = [dist.isend(message, dst=servers[i], group=group) for i, message in zip(serving, messages, strict=True)]
        pending = [dist.irecv(inboxes[i], src=servers[i], group=group) for i in serving]  # before any wait
        for request in sends:
            request.wait()
        step += 1


class Inbox:
    """A server's receiving end: the next gradient from whichever worker sends first.

    On gloo one receive from *any* source is posted at a time (gloo matches it with the first message to
    arrive) and waited for with a timeout; NCCL has no any-source receive, so there one receive per expected
    worker is posted and polled.  Each worker's last gradient stays in its own buffer until the server is done
    with it (a held gradient waits there to be applied).  ``ranks[w]`` is worker ``w``'s global rank, ``first``
    its group rank less ``w`` (the number of servers)."""

    def __init__(self, group: Any, ranks: list[int], first: int, size: int, like: torch.Tensor, timeout_s: float):
        self.group, self.ranks, self.first, self.timeout_s = group, ranks, first, timeout_s
        self.buffers = [torch.empty(size, dtype=like.dtype, device=like.device) for _ in ranks]
        self.any_source = dist.get_backend(group) == "gloo"
        self.scratch = torch.empty(size, dtype=like.dtype, device=like.device) if self.any_source else None
        self.expected: dict[int, Any] = {}  # worker -> its posted receive (None on gloo)

    def expect(self, worker: int) -> None:
        self.expected[worker] = None if self.any_source else dist.irecv(self.buffers[worker], src=self.ranks[worker],
                                                                        group=self.group)

    def next(self) -> int:
        """Block until a gradient arrives; the worker it came from (its buffer holds it)."""
        waiting = sorted(self.expected)
        problem = TimeoutError(f"the parameter server heard from no worker for {self.timeout_s} s; waiting for "
                               f"workers {waiting} (group ranks {[w + self.first for w in waiting]})")
        if self.any_source:
            work = dist.irecv(self.scratch, group=self.group)
            try:
                work.wait(timeout=timedelta(seconds=self.timeout_s))
            except RuntimeError as error:
                raise problem from error
            worker = work._source_rank() - self.first
            self.buffers[worker].copy_(self.scratch)
        else:
            deadline = time.perf_counter() + self.timeout_s
            while not (done := [w for w, work in self.expected.items() if work.is_completed()]):
                if time.perf_counter() > deadline:
                    raise problem
                time.sleep(1e-4)
            worker = done[0]
            self.expected[worker].wait()
        if worker not in self.expected:
            raise RuntimeError(f"worker {worker} sent a gradient the server did not expect")
        del self.expected[worker]
        return worker


def send_shard(group: Any, rows: list[tuple[float, ...]], update_times: list[float], shard: torch.Tensor) -> None:
    """A shard server's results to server 0, in three messages: their sizes, the records (one row of floats per
    gradient received) with the update times in float64, and the final shard in the weights' dtype."""
    server0 = global_rank(group, 0)
    table = torch.tensor([value for row in rows for value in row] + update_times, dtype=torch.float64)
    sizes = torch.tensor([len(rows), len(update_times)], dtype=torch.float64)
    for message in (sizes, table, shard):
        dist.send(message.to(shard.device), dst=server0, group=group, tag=SHARD_TAG)


def receive_shard(group: Any, server: int, width: int, shard: torch.Tensor) -> tuple[list[list[float]], list[float]]:
    """Server 0's end of :func:`send_shard` from group rank ``server``: fills ``shard``; the rows (``width``
    floats each) and the update times."""
    source, device = global_rank(group, server), shard.device
    sizes = torch.empty(2, dtype=torch.float64, device=device)
    dist.recv(sizes, src=source, group=group, tag=SHARD_TAG)
    count, updates = (int(value) for value in sizes.tolist())
    table = torch.empty(count * width + updates, dtype=torch.float64, device=device)
    dist.recv(table, src=source, group=group, tag=SHARD_TAG)
    dist.recv(shard, src=source, group=group, tag=SHARD_TAG)
    values = table.tolist()
    return [values[index:index + width] for index in range(0, count * width, width)], values[count * width:]
