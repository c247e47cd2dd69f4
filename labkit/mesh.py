"""``Mesh(dp=, tp=, pp=, cp=)``: the ranks arranged in a grid, and one process group per dimension.

**3D parallelism** combines three ways of splitting the work.  *Tensor parallelism* (tp) splits every layer's
matrices over ``tp`` ranks; *pipeline parallelism* (pp) splits the layers into ``pp`` stages; *data
parallelism* (dp) runs ``dp`` replicas of that split model on different slices of the batch.  Every rank then
has three coordinates, and the ranks that differ in only one coordinate form that dimension's group: the
``tp`` ranks holding the pieces of the same layers, the ``pp`` stages of one replica, the ``dp`` replicas of
the same piece (which average their gradients).  ``dp * tp * pp`` must be the number of ranks.

**A fourth dimension, context parallelism** (cp; :mod:`labkit.parallel.context`) splits each sequence over
``cp`` ranks.  It sits **between dp and tp**, as torchtitan (``ParallelDims``: ``pp, dp, cp, tp``) and Megatron-Core
(``tp-cp-ep-dp-pp``, innermost first) order it: its ring or all-to-all runs inside every layer's attention, on the
critical path like TP's all-reduces, only once per attention rather than four times per layer, and its sends
overlap with attention's compute; so it takes the links just outside TP's (the rest of a node, or the nearest
nodes) and leaves the slower ones to DP, which reduces once per step, and to PP.  The ``cp`` ranks of one
sequence hold the same weights, like DP replicas, and their gradients are averaged with them: the data-parallel
wrapper runs over ``group("dp_cp")``, the ``dp * cp`` ranks that share this rank's pp and tp coordinates.
With ``cp = 1`` (the default) everything below reads as the 3-D grid; ``describe_layout`` then leaves the cp
column out.

**Expert parallelism is folded over dp x cp** (``ep``; :mod:`labkit.parallel.experts`), as torchtitan's
``dp2ep`` and Megatron-Core's expert groups do: it adds no ranks.  The ``dp * cp`` ranks that hold the same
attention weights hold the MoE layers' experts split ``ep`` ways: ``group("ep")`` is ``ep`` consecutive ranks of
a dp x cp group (the innermost ones, so cp's neighbours: the closest links go to the all-to-all), each holding
``E / ep`` experts, and ``group("edp")`` the ``dp * cp / ep`` ranks holding the same experts, which average the
experts' gradients as dp x cp averages the rest.  Attention is data-parallel, experts expert-parallel.

**The layout.**  Global rank ``r`` sits at ``(pp, dp, cp, tp)`` with
``r = ((pp * dp_size + dp) * cp_size + cp) * tp_size + tp``: the grid ``arange(world_size).view(pp, dp, cp,
tp)``, tp innermost and pp outermost.  On 8 ranks with
``dp = tp = pp = 2``::

    rank  pp  dp  tp          tp groups: [0, 1] [2, 3] [4, 5] [6, 7]
       0   0   0   0          dp groups: [0, 2] [1, 3] [4, 6] [5, 7]
       1   0   0   1          pp groups: [0, 4] [1, 5] [2, 6] [3, 7]
       2   0   1   0
       ...

The order follows from what each dimension sends.  **TP** all-reduces activations twice per layer in the
forward pass and twice in the backward pass, on the critical path, so it needs the fastest links: tp
innermost makes a TP group neighbouring ranks, which ``torchrun`` places on one node (NVLink; ``tp <= 8``
with 8 GPUs per node).  **DP** all-reduces (or reduce-scatters) the gradients once per step, overlapped with
the backward pass.  **PP** only passes one micro-batch's activations point to point across each stage
boundary: the lightest traffic, which tolerates the slower links between nodes, so pp outermost lets the
stages span nodes.  This is Megatron-LM's and torchtitan's order; picotron builds the same kind of grid from
``arange(world_size).view(dp, pp, tp)`` (tp innermost too, but dp outermost).

**Built on torch's DeviceMesh** (``init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp",
"tp"))``), so that torch's own tensor parallelism (``parallelize_module``) and ``torch.distributed.pipelining``
can run on the very same groups in the parity tests; ``device_mesh`` is that object.  Making the groups is a
collective: every rank of the default process group constructs the same ``Mesh``, in the same order.  Each
group costs a communicator per rank (under NCCL, its own buffers on the GPU).  The layout itself is pure
arithmetic (:func:`mesh_coordinates`, :func:`mesh_groups`, :func:`describe_layout`), available without any
process group, e.g. to draw it in a notebook.
"""

from __future__ import annotations

import torch.distributed as torch_dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from labkit.degrees import check_degrees, check_ep
from labkit.dist import backend, device, require_group

DIMS = ("pp", "dp", "cp", "tp")  # the grid's axes, outermost first
FLATTENED = {"dp_cp": ("dp", "cp")}  # groups over several dimensions at once: the data-parallel wrapper's
EXPERT_GROUPS = ("ep", "edp")  # expert parallelism, folded over dp x cp: the all-to-all's, the experts' replicas


def _check_world_size(world_size: int, degrees: dict[str, int]) -> None:
    product = degrees["dp"] * degrees["cp"] * degrees["tp"] * degrees["pp"]
    if product != world_size:
        dims = [dim for dim in ("dp", "cp", "tp", "pp") if dim != "cp" or degrees["cp"] > 1]
        raise ValueError(f"{' * '.join(dims)} must equal the number of ranks: "
                         f"{' * '.join(f'{dim}={degrees[dim]}' for dim in dims)} = {product}, but the world size "
                         f"is {world_size}")


def mesh_coordinates(world_size: int, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1) -> list[dict[str, int]]:
    """Every rank's coordinates, index = global rank: ``[{"pp": 0, "dp": 0, "cp": 0, "tp": 0}, ...]`` (no
    process group).

    Raises ``ValueError`` naming the sizes when ``dp * cp * tp * pp != world_size`` or a degree is not a positive
    integer.
    """
    degrees = check_degrees(dp, tp, pp, cp)
    _check_world_size(world_size, degrees)
    return [{"pp": rank // (dp * cp * tp), "dp": rank // (cp * tp) % dp, "cp": rank // tp % cp, "tp": rank % tp}
            for rank in range(world_size)]


def mesh_groups(world_size: int, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1,
                ep: int = 1) -> dict[str, list[list[int]]]:
    """Per dimension (and per flattened pair, :data:`FLATTENED`), every group's global ranks: the ranks whose
    other coordinates are equal; with ``ep > 1`` also ``"ep"`` and ``"edp"`` (:data:`EXPERT_GROUPS`)."""
    coordinates = mesh_coordinates(world_size, dp=dp, tp=tp, pp=pp, cp=cp)
    groups: dict[str, list[list[int]]] = {}
    for name, dims in [(dim, (dim,)) for dim in DIMS] + list(FLATTENED.items()):
        by_others: dict[tuple[int, ...], list[int]] = {}
        for rank, coords in enumerate(coordinates):
            by_others.setdefault(tuple(coords[other] for other in DIMS if other not in dims), []).append(rank)
        groups[name] = list(by_others.values())
    if check_ep(ep, dp, cp) > 1:  # consecutive ranks of each dp x cp group, and the strided replicas
        groups["ep"] = [ranks[i:i + ep] for ranks in groups["dp_cp"] for i in range(0, len(ranks), ep)]
        groups["edp"] = [ranks[i::ep] for ranks in groups["dp_cp"] for i in range(ep)]
    return groups


def describe_layout(dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1) -> str:
    """A table of every rank's coordinates, then each dimension's groups (no process group needed).  The cp
    column and groups appear when ``cp > 1``; with ``ep > 1`` an ep column (the rank's place in its ep group: it
    holds experts ``ep x E / ep ..``) and the ep and edp groups."""
    check_degrees(dp, tp, pp, cp)
    world_size = dp * cp * tp * pp
    coordinates = mesh_coordinates(world_size, dp=dp, tp=tp, pp=pp, cp=cp)
    groups = mesh_groups(world_size, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
    if ep > 1:  # not a grid axis: folded over dp x cp
        for group in groups["ep"]:
            for place, rank in enumerate(group):
                coordinates[rank] = {**coordinates[rank], "ep": place}
    shown = [dim for dim in DIMS if dim != "cp" or cp > 1] + (["ep"] if ep > 1 else [])
    lines = ["rank  " + "  ".join(f"{dim:>2}" for dim in shown)]
    lines += [f"{rank:>4}  " + "  ".join(f"{coords[dim]:>2}" for dim in shown)
              for rank, coords in enumerate(coordinates)]
    for dim in [*reversed([dim for dim in shown if dim in DIMS]), *(EXPERT_GROUPS if ep > 1 else ())]:
        lines.append(f"{dim} groups: " + " ".join(map(str, groups[dim])))
    return "\n".join(lines)


class Mesh:
    """The default process group's ranks as a ``(pp, dp, cp, tp)`` grid, with one process group per dimension.

    A collective: every rank constructs it with the same sizes.  ``dim`` is one of :data:`DIMS`, or for
    :meth:`group` and :meth:`ranks` also ``"dp_cp"`` (the data-parallel wrapper's group: the ``dp * cp`` ranks
    that hold the same weights).  Bad sizes raise ``ValueError`` before any group is made; without a process
    group, ``RuntimeError``.
    """

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1):
        degrees = check_degrees(dp, tp, pp, cp)
        check_ep(ep, dp, cp)
        require_group()
        _check_world_size(torch_dist.get_world_size(), degrees)
        self.dp, self.tp, self.pp, self.cp, self.ep = dp, tp, pp, cp, ep
        self.device_mesh: DeviceMesh = init_device_mesh(device().type, (pp, dp, cp, tp), mesh_dim_names=DIMS)
        # The flattened dp x cp groups, made by every rank in the same order (a collective, like the mesh's own).
        self._flattened: dict[str, torch_dist.ProcessGroup] = {}
        for name, groups in mesh_groups(torch_dist.get_world_size(), dp=dp, tp=tp, pp=pp, cp=cp, ep=ep).items():
            if name in FLATTENED or name in EXPERT_GROUPS:
                for ranks in groups:
                    group = self.group("dp") if name == "dp_cp" and cp == 1 else torch_dist.new_group(ranks)
                    if torch_dist.get_rank() in ranks:
                        self._flattened[name] = group

    def _check_dim(self, dim: object, flattened: bool = False) -> str:
        names = DIMS + ((*FLATTENED, *EXPERT_GROUPS) if flattened else ())
        if not isinstance(dim, str) or dim not in names:
            raise ValueError(f"dim must be one of {', '.join(repr(d) for d in names)}, got {dim!r}")
        return dim

    def group(self, dim: str) -> torch_dist.ProcessGroup:
        """The process group of the ranks that share this rank's other coordinates (``"dp_cp"``: all but dp's and
        cp's; ``"ep"``, ``"edp"``: see the module docstring; with ``ep = 1``, ``"edp"`` is ``"dp_cp"``)."""
        if self._check_dim(dim, flattened=True) in EXPERT_GROUPS and self.ep == 1:
            if dim == "ep":
                raise ValueError("this mesh has no expert parallelism (ep=1): there is no ep group")
            return self.group("dp_cp")
        if dim in FLATTENED or dim in EXPERT_GROUPS:
            return self._flattened[dim]
        return self.device_mesh.get_group(dim)

    def rank(self, dim: str) -> int:
        """This rank's coordinate along ``dim`` (its rank in ``group(dim)``)."""
        return self.device_mesh.get_local_rank(self._check_dim(dim))

    def size(self, dim: str) -> int:
        """The number of ranks along ``dim``."""
        return {"dp": self.dp, "cp": self.cp, "tp": self.tp, "pp": self.pp}[self._check_dim(dim)]

    def coords(self) -> dict[str, int]:
        """This rank's coordinates, e.g. ``{"pp": 0, "dp": 1, "cp": 0, "tp": 0}``."""
        return {dim: self.rank(dim) for dim in DIMS}

    def ranks(self, dim: str) -> list[int]:
        """The global ranks in this rank's group along ``dim``, in group-rank order."""
        return torch_dist.get_process_group_ranks(self.group(dim))

    def describe(self) -> str:
        """This rank's place, then the table of every rank's coordinates and the groups."""
        here = ", ".join(f"{dim}={index}" for dim, index in self.coords().items())
        return (f"{self!r} over {torch_dist.get_world_size()} ranks ({backend()}, {device().type}); "
                f"rank {torch_dist.get_rank()} is at {here}\n"
                + describe_layout(self.dp, self.tp, self.pp, self.cp, self.ep))

    def __repr__(self) -> str:
        return (f"Mesh(dp={self.dp}, tp={self.tp}, pp={self.pp}" + (f", cp={self.cp}" if self.cp > 1 else "")
                + (f", ep={self.ep}" if self.ep > 1 else "") + ")")
