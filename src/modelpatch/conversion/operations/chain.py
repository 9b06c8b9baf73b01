"""Chains of operations, as a converter runs them: bound to input shapes, reversed, applied to tensors."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...errors import ConversionError
from .base import ConversionOperation, ShapeSlot, Slot, norm_dim
from .experts import MergeModulelist
from .shapes import Concatenate


def bind_operations(
    operations: list[ConversionOperation], shapes: list[ShapeSlot], num_targets: int
) -> tuple[list[ConversionOperation], list[ShapeSlot]]:
    """Bind a chain of operations to input shapes; return the bound chain and the final shapes."""
    bound = []
    for op in operations:
        op, shapes = op.bind(shapes, num_targets)
        bound.append(op)
    return bound, shapes


def reverse_operations(bound: list[ConversionOperation]) -> list[ConversionOperation]:
    """The reverse chain of a bound chain (each operation reversed, last first)."""
    return [op.reverse() for op in reversed(bound)]


def run_operations(operations: list[ConversionOperation], slots: list[Slot]) -> list[Slot]:
    """Apply a bound chain to tensors.

    ``MergeModulelist`` followed by ``Concatenate`` (per-expert -> fused MoE weights) runs as one step that writes
    every expert straight into the output: no stacked temporaries, one copy instead of two.
    """
    position = 0
    while position < len(operations):
        op = operations[position]
        following = operations[position + 1] if position + 1 < len(operations) else None
        if isinstance(op, MergeModulelist) and isinstance(following, Concatenate) and _all_lists(slots):
            slots = _merge_and_concatenate(op, following, slots)  # type: ignore[arg-type]
            position += 2
        else:
            slots = op.apply(slots)
            position += 1
    return slots


def concatenates_rows(operations: Sequence[ConversionOperation], rank: int) -> bool:
    """Whether the chain only concatenates its tensors of rank ``rank`` along dim 0: the output's bytes (row-major) are
    then its inputs' bytes one after the other, and can be assembled without computing anything."""
    return (
        len(operations) == 1
        and isinstance(operations[0], Concatenate)
        and rank > 0
        and -rank <= operations[0].dim < rank
        and operations[0].dim % rank == 0
    )


def _all_lists(slots: list[Slot]) -> bool:
    return bool(slots) and all(isinstance(slot, list) and slot for slot in slots)


def _merge_and_concatenate(
    merge: MergeModulelist, concatenate: Concatenate, slots: list[list[torch.Tensor]]
) -> list[Slot]:
    """``concatenate.apply(merge.apply(slots))`` without the stacked intermediates."""
    first = slots[0][0]
    rank = first.dim() + 1
    merge_dim, cat_dim = norm_dim(merge.dim, rank, merge), norm_dim(concatenate.dim, rank, concatenate)
    stacked_shapes = []
    for slot in slots:
        shape = list(slot[0].shape)
        shape.insert(merge_dim, len(slot))
        stacked_shapes.append(shape)
    out_shape = list(stacked_shapes[0])
    out_shape[cat_dim] = sum(shape[cat_dim] for shape in stacked_shapes)
    out = torch.empty(out_shape, dtype=first.dtype, device=first.device)
    offset = 0
    for slot, shape in zip(slots, stacked_shapes, strict=True):
        region = out.narrow(cat_dim, offset, shape[cat_dim])
        if list(region.shape) != shape:
            raise ConversionError(
                f"{concatenate!r}: cannot concatenate stacked shapes {stacked_shapes} along dim {concatenate.dim}."
            )
        for index, tensor in enumerate(slot):
            target = region.select(merge_dim, index)
            if target.shape != tensor.shape or tensor.dtype != out.dtype:
                raise ConversionError(
                    f"{merge!r}: cannot stack {tensor.dtype} {tuple(tensor.shape)} into {tuple(target.shape)}."
                )
            target.copy_(tensor)
        offset += shape[cat_dim]
    return [out]
