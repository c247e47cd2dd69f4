"""The flat shards that ZeRO-2 and ZeRO-3/FSDP share (:class:`FlatShards`): ``fully_shard``'s cut of every tensor.

Every
tensor is cut along its first dimension into ``N`` chunks of ``ceil(rows / N)`` rows (``torch.chunk``; the last
chunks may be shorter or empty), so rank ``r``'s shard of a weight is an ordinary tensor of shape
``[rows_r, ...]`` that can be read, clipped and saved by name.  For one collective per group of tensors each
rank's chunks are laid end to end, each padded to the full chunk size: rank ``r``'s shard is one flat buffer of
``shard_numel`` elements and the flat buffer that ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` need
is the ``N`` shards in rank order.  Packing a gradient into that buffer and unpacking gathered parameters out of
it is one strided copy per tensor (FSDP2's "copy-in" and "copy-out").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class FlatShards:
    """Tensors of ``shapes`` cut along dim 0 over ``world_size`` ranks (``torch.chunk``), each rank's chunks
    padded and laid end to end: rank ``r``'s shard is flat elements ``[r * shard_numel, (r+1) * shard_numel)``
    of a buffer of ``padded_numel``; tensor ``i``'s chunk starts at ``offsets[i]`` within every shard."""

    shapes: list[torch.Size]
    world_size: int
    rank: int
    rows: list[int] = field(init=False)  # dim 0 (1 for a 0-d tensor)
    row_numel: list[int] = field(init=False)  # elements per row
    chunk_rows: list[int] = field(init=False)  # ceil(rows / world_size)
    offsets: list[int] = field(init=False)
    shard_numel: int = field(init=False)

    def __post_init__(self) -> None:
        self.shapes = [torch.Size(shape) for shape in self.shapes]
        self.rows = [shape[0] if len(shape) else 1 for shape in self.shapes]
        self.row_numel = [math.prod(shape[1:]) if len(shape) else 1 for shape in self.shapes]
        self.chunk_rows = [math.ceil(rows / self.world_size) for rows in self.rows]
        sizes = [c * r for c, r in zip(self.chunk_rows, self.row_numel, strict=True)]
        self.offsets = [sum(sizes[:index]) for index in range(len(sizes))]
        self.shard_numel = max(1, sum(sizes))

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def local_rows(self, index: int, rank: int | None = None) -> tuple[int, int]:
        """``(start, stop)``: the rows of tensor ``index`` that ``rank`` (default: this rank) holds."""
        rank = self.rank if rank is None else rank
        chunk = self.chunk_rows[index]
        return min(rank * chunk, self.rows[index]), min((rank + 1) * chunk, self.rows[index])

    def local_shape(self, index: int, rank: int | None = None) -> torch.Size:
        start, stop = self.local_rows(index, rank)
        shape = self.shapes[index]
        return torch.Size([stop - start, *shape[1:]]) if len(shape) else torch.Size([stop - start])

    def pieces_of(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's rows of each full tensor, as views (a 0-d tensor is seen as one row)."""
        pieces = []
        for index, tensor in enumerate(tensors):
            start, stop = self.local_rows(index)
            pieces.append(tensor.reshape(self.rows[index], *self.shapes[index][1:])[start:stop])
        return pieces

    def shard_views(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """Views into a flat shard buffer, each in its tensor's local shape (the padding left out)."""
        views = []
        for index, offset in enumerate(self.offsets):
            shape = self.local_shape(index)
            views.append(shard[offset:offset + shape.numel()].view(shape))
        return views

    def _blocks(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Tensor ``index``'s padded chunks in a full flat buffer: a ``[world_size, chunk_rows, row_numel]`` view."""
        begin = self.offsets[index]
        size = self.chunk_rows[index] * self.row_numel[index]
        return flat.view(self.world_size, self.shard_numel)[:, begin:begin + size].unflatten(
            1, (self.chunk_rows[index], self.row_numel[index]))

    def _pairs(self, flat: torch.Tensor, index: int, rows: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(slots, rows)`` pairs covering tensor ``index``: its padded chunks in the full flat buffer ``flat``
        beside its ``[rows, row_numel]`` view ``rows``; the whole chunks as one strided view each side, and the
        last, shorter chunk, if any.  (Flattening the chunks into rows instead would copy them: they are not
        evenly spaced in ``flat``.)"""
        chunk, total = self.chunk_rows[index], self.rows[index]
        whole = total // chunk if chunk else 0
        blocks = self._blocks(flat, index)
        pairs = [(blocks[:whole], rows[:whole * chunk].view(whole, chunk, self.row_numel[index]))]
        if whole * chunk < total:
            pairs.append((blocks[whole, :total - whole * chunk], rows[whole * chunk:]))
        return pairs

    def copy_in(self, index: int, tensor: torch.Tensor, flat: torch.Tensor) -> None:
        """Write the full tensor ``index`` into its chunks of the full flat buffer ``flat`` (converting the dtype)."""
        for slots, rows in self._pairs(flat, index, tensor.reshape(self.rows[index], self.row_numel[index])):
            slots.copy_(rows)

    def pack(self, tensors: list[torch.Tensor | None], out: torch.Tensor) -> torch.Tensor:
        """Write full ``tensors`` (``None``: zeros) into the full flat buffer ``out`` (converting the dtype)."""
        out.zero_()
        for index, tensor in enumerate(tensors):
            if tensor is not None:
                self.copy_in(index, tensor, out)
        return out

    def unpack(self, flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        """Copy the full flat buffer ``flat`` back into the full (contiguous) ``tensors``."""
        for index, tensor in enumerate(tensors):
            for slots, rows in self._pairs(flat, index, tensor.view(self.rows[index], self.row_numel[index])):
                rows.copy_(slots)

    def pack_shard(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """This rank's zero-padded shard of the full ``tensors``."""
        shard = tensors[0].new_zeros(self.shard_numel)
        for view, piece in zip(self.shard_views(shard), self.pieces_of(tensors), strict=True):
            view.copy_(piece)
        return shard


def add_shard_gradients(shard: torch.Tensor, pieces: list[torch.Tensor | None], shards: FlatShards) -> None:
    """Make the reduced ``shard`` the gradient of this rank's ``pieces`` (or add it to what they hold)."""
    for piece, gradient in zip(pieces, shards.shard_views(shard), strict=True):
        if piece is None:
            continue
        gradient = gradient.to(piece.dtype)
        if piece.grad is None:
            piece.grad = gradient  # a view of the shard: one buffer per bucket or unit
        else:
            piece.grad.add_(gradient)
