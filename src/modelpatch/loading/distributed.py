"""What the sharded load, the collective save and DCP in the original layout share about DTensor models: whether a
model is sharded, its class under FSDP2's wrapper, and which rows of a tensor this rank holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor


@dataclass(frozen=True)
class Rows:
    """The rows ``start:stop`` (of dim 0) of a tensor that this rank holds; ``writes``: whether this rank is the one
    that writes them in a save (of a replicated tensor, only the first rank of each replicating mesh dimension)."""

    start: int
    stop: int
    writes: bool

    def window(self, offset: int, size: int) -> tuple[int, int] | None:
        """The rows of a part lying at ``offset:offset + size`` that this rank holds, relative to the part."""
        start, stop = max(self.start, offset), min(self.stop, offset + size)
        return (start - offset, stop - offset) if start < stop else None


def is_fully_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds ``DTensor`` parameters (FSDP2's ``fully_shard``, or a model sharded by hand)."""
    return any(isinstance(parameter, DTensor) for parameter in model.parameters())


def model_class(model: nn.Module) -> type:
    """The class of ``model`` as built: ``fully_shard`` swaps a module's class for a subclass of ``FSDPModule``."""
    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))


def current_rank() -> int:
    """This process's rank in the default process group (0 outside ``torch.distributed``)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def local_rows(tensor: torch.Tensor) -> Rows | None:
    """This rank's rows of ``tensor`` when its local part is one block of whole rows: a ``DTensor`` sharded on dim 0
    (FSDP2's ``Shard(0)``) or replicated, or a plain tensor (every rank holds it whole; rank 0 writes it). None when
    it is not (a shard along another dim, as tensor parallelism's rowwise one, or a 0-d tensor)."""
    if tensor.ndim == 0:
        return None
    if not isinstance(tensor, DTensor):
        return Rows(0, tensor.shape[0], current_rank() == 0)
    if not all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in tensor.placements):
        return None
    # DCP's own description of a DTensor's local part: one chunk (offsets and sizes in the full tensor).
    chunks = tensor.__create_chunk_list__()
    if len(chunks) != 1:
        return None
    (chunk,) = chunks
    if any(chunk.offsets[1:]) or tuple(chunk.sizes[1:]) != tuple(tensor.shape[1:]):
        return None
    coordinate: Sequence[int] = tensor.device_mesh.get_coordinate() or ()
    writes = all(
        index == 0 for index, placement in zip(coordinate, tensor.placements, strict=True) if placement.is_replicate()
    )
    start = chunk.offsets[0]
    return Rows(start, start + chunk.sizes[0], writes)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's part of ``tensor`` (its local shard for a ``DTensor``)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard_of(target: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` (the whole value of ``target``), as ``target`` holds it: its rows where the
    target is row-sharded, else DTensor's own split of ``full`` along ``target``'s placements (no communication:
    every rank holds ``full``)."""
    rows = local_rows(target)
    if rows is not None:
        return full[rows.start : rows.stop] if isinstance(target, DTensor) else full
    if not isinstance(target, DTensor):
        return full
    return distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()


def part_offsets(sizes: Sequence[int]) -> list[int]:
    """Where each of parts of ``sizes`` starts in their concatenation."""
    offsets, start = [], 0
    for size in sizes:
        offsets.append(start)
        start += size
    return offsets
