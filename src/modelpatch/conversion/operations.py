"""Conversion operations: pure tensor transformations between checkpoint and runtime layouts.

A converter's tensors flow through its operations as a list of *slots*, one per source pattern. A slot is a tensor,
or a list of tensors when its pattern has a ``*`` index (one per expert, say).

Every operation is declared without sizes (``Concatenate(dim=0)``) and **bound** at plan time to the concrete input
shapes, read from checkpoint headers: binding validates the shapes, computes the output shapes and records what the
exact reverse needs (the part sizes of a concatenation, the count of a merge). ``bound.reverse()`` is then the exact
inverse, so a grouped-query ``q/k/v`` concatenation (sizes 128/64/64) splits back into 128/64/64, not equal chunks.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

import torch

from ..errors import ConversionError

Shape = tuple[int, ...]
ShapeSlot = Shape | list[Shape]
Slot = torch.Tensor | list[torch.Tensor]


def _norm_dim(dim: int, rank: int, op: ConversionOperation) -> int:
    if not -rank <= dim < rank:
        raise ConversionError(f"{op!r}: dim {dim} is out of range for a tensor of rank {rank}.")
    return dim % rank


def _require_tensor_slots(shapes: list[ShapeSlot], op: ConversionOperation) -> list[Shape]:
    if any(isinstance(s, list) for s in shapes):
        raise ConversionError(f"{op!r} needs one tensor per slot; apply MergeModulelist to indexed ('*') patterns first.")
    return list(shapes)  # type: ignore[arg-type]


class ConversionOperation(ABC):
    """Base class of conversion operations. Subclasses are frozen dataclasses."""

    @abstractmethod
    def bind(self, shapes: list[ShapeSlot], num_targets: int) -> tuple[ConversionOperation, list[ShapeSlot]]:
        """Validate ``shapes``; return the operation with its sizes fixed and the output shapes.

        ``num_targets`` is the number of target patterns of the converter (how many parts a split produces).
        """

    @abstractmethod
    def apply(self, slots: list[Slot]) -> list[Slot]:
        """Transform the slots. Only called on bound operations."""

    @abstractmethod
    def reverse(self) -> ConversionOperation:
        """The exact inverse of this bound operation (an unbound declaration when nothing needs recording)."""


class _PerSlotOperation(ConversionOperation):
    """An operation applied to every tensor independently (lists of tensors included)."""

    def bind(self, shapes, num_targets):
        return self, [[self._shape(s) for s in slot] if isinstance(slot, list) else self._shape(slot) for slot in shapes]

    def apply(self, slots):
        return [[self._tensor(t) for t in slot] if isinstance(slot, list) else self._tensor(slot) for slot in slots]

    @abstractmethod
    def _shape(self, shape: Shape) -> Shape: ...

    @abstractmethod
    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Concatenate(ConversionOperation):
    """Concatenate all slots along ``dim`` into one tensor (``q, k, v -> qkv``).

    ``sizes`` is recorded when bound. ``equal_parts=True`` declares that the parts always have the same size, which
    lets a model that was never loaded from a checkpoint be saved in the checkpoint layout.
    """

    dim: int = 0
    sizes: tuple[int, ...] | None = None
    equal_parts: bool = False

    def bind(self, shapes, num_targets):
        shapes = _require_tensor_slots(shapes, self)
        if not shapes:
            raise ConversionError(f"{self!r} got no tensors.")
        rank = len(shapes[0])
        dim = _norm_dim(self.dim, rank, self)
        for shape in shapes:
            if len(shape) != rank or any(a != b for i, (a, b) in enumerate(zip(shape, shapes[0])) if i != dim):
                raise ConversionError(f"{self!r}: cannot concatenate shapes {shapes} along dim {self.dim}.")
        sizes = tuple(s[dim] for s in shapes)
        if self.sizes is not None and self.sizes != sizes:
            raise ConversionError(f"{self!r}: the parts have sizes {sizes} along dim {self.dim}, not {self.sizes}.")
        out = list(shapes[0])
        out[dim] = sum(sizes)
        return replace(self, sizes=sizes), [tuple(out)]

    def apply(self, slots):
        return [torch.cat(slots, dim=self.dim)]  # type: ignore[arg-type]

    def reverse(self):
        if self.sizes is None and not self.equal_parts:
            raise ConversionError(
                f"{self!r} cannot be reversed: its part sizes were never recorded (no checkpoint was loaded through "
                "it). Declare Concatenate(..., equal_parts=True) or give sizes=..., or save in the runtime layout."
            )
        return Chunk(dim=self.dim, sizes=self.sizes, equal_parts=self.equal_parts)


@dataclass(frozen=True)
class Chunk(ConversionOperation):
    """Split one tensor along ``dim`` into one part per target (equal parts unless ``sizes`` are given)."""

    dim: int = 0
    sizes: tuple[int, ...] | None = None
    equal_parts: bool = False

    def bind(self, shapes, num_targets):
        shapes = _require_tensor_slots(shapes, self)
        if len(shapes) != 1:
            raise ConversionError(f"{self!r} splits exactly one tensor, got {len(shapes)}.")
        (shape,) = shapes
        dim = _norm_dim(self.dim, len(shape), self)
        sizes = self.sizes
        if sizes is None:
            if num_targets < 1 or shape[dim] % num_targets:
                raise ConversionError(f"{self!r}: dim {self.dim} of size {shape[dim]} does not split into {num_targets} equal parts.")
            sizes = (shape[dim] // num_targets,) * num_targets
        if sum(sizes) != shape[dim]:
            raise ConversionError(f"{self!r}: part sizes {sizes} do not add up to {shape[dim]} (shape {shape}).")
        parts = []
        for size in sizes:
            part = list(shape)
            part[dim] = size
            parts.append(tuple(part))
        return replace(self, sizes=tuple(sizes)), parts

    def apply(self, slots):
        return list(torch.split(slots[0], list(self.sizes), dim=self.dim))  # type: ignore[arg-type]

    def reverse(self):
        return Concatenate(dim=self.dim, sizes=self.sizes, equal_parts=self.sizes is None or self.equal_parts)


@dataclass(frozen=True)
class MergeModulelist(ConversionOperation):
    """Stack each slot's list of per-index tensors (experts ``0..n-1``) into one tensor along a new ``dim``."""

    dim: int = 0
    count: int | None = None

    def bind(self, shapes, num_targets):
        out = []
        counts = set()
        for slot in shapes:
            if not isinstance(slot, list):
                raise ConversionError(f"{self!r} needs indexed ('*') source patterns.")
            if not slot or any(s != slot[0] for s in slot):
                raise ConversionError(f"{self!r}: cannot stack tensors of shapes {slot}.")
            dim = _norm_dim(self.dim, len(slot[0]) + 1, self)
            counts.add(len(slot))
            shape = list(slot[0])
            shape.insert(dim, len(slot))
            out.append(tuple(shape))
        if len(counts) > 1:
            raise ConversionError(f"{self!r}: the source patterns have different numbers of entries {sorted(counts)}.")
        return replace(self, count=counts.pop() if counts else 0), out

    def apply(self, slots):
        return [torch.stack(slot, dim=self.dim) for slot in slots]  # type: ignore[arg-type]

    def reverse(self):
        return SplitModulelist(dim=self.dim, count=self.count)


@dataclass(frozen=True)
class SplitModulelist(ConversionOperation):
    """Unstack each slot along ``dim`` into a list of tensors (one per index)."""

    dim: int = 0
    count: int | None = None

    def bind(self, shapes, num_targets):
        out = []
        for shape in _require_tensor_slots(shapes, self):
            dim = _norm_dim(self.dim, len(shape), self)
            if self.count is not None and shape[dim] != self.count:
                raise ConversionError(f"{self!r}: expected {self.count} entries along dim {self.dim}, shape is {shape}.")
            out.append([shape[:dim] + shape[dim + 1 :]] * shape[dim])
        return replace(self, count=len(out[0]) if out else 0), out

    def apply(self, slots):
        return [list(torch.unbind(slot, dim=self.dim)) for slot in slots]  # type: ignore[arg-type]

    def reverse(self):
        return MergeModulelist(dim=self.dim, count=self.count)


@dataclass(frozen=True)
class Transpose(_PerSlotOperation):
    """Swap two dimensions of every tensor."""

    dim0: int = 0
    dim1: int = 1

    def _shape(self, shape):
        d0, d1 = _norm_dim(self.dim0, len(shape), self), _norm_dim(self.dim1, len(shape), self)
        out = list(shape)
        out[d0], out[d1] = out[d1], out[d0]
        return tuple(out)

    def _tensor(self, tensor):
        return tensor.transpose(self.dim0, self.dim1).contiguous()

    def reverse(self):
        return self


@dataclass(frozen=True)
class Conv3dToLinear(_PerSlotOperation):
    """Flatten a Conv3d kernel ``[out, C, T, H, W]`` into a Linear weight ``[out, C*T*H*W]`` (C, T, H, W order)."""

    kernel_shape: tuple[int, ...] | None = None

    def bind(self, shapes, num_targets):
        for shape in _require_tensor_slots(shapes, self):
            if len(shape) != 5:
                raise ConversionError(f"{self!r} needs a 5-D Conv3d kernel, got shape {shape}.")
            if self.kernel_shape is not None and tuple(shape[1:]) != self.kernel_shape:
                raise ConversionError(f"{self!r}: kernel shape {tuple(shape[1:])} differs from {self.kernel_shape}.")
        first = shapes[0]
        bound = replace(self, kernel_shape=tuple(first[1:]))
        return bound, [bound._shape(s) for s in shapes]

    def _shape(self, shape):
        return (shape[0], math.prod(shape[1:]))

    def _tensor(self, tensor):
        return tensor.reshape(tensor.shape[0], -1)

    def reverse(self):
        if self.kernel_shape is None:
            raise ConversionError("Conv3dToLinear cannot be reversed before it is bound to a kernel shape.")
        return LinearToConv3d(kernel_shape=self.kernel_shape)


@dataclass(frozen=True)
class LinearToConv3d(_PerSlotOperation):
    """Reshape a Linear weight ``[out, C*T*H*W]`` back into a Conv3d kernel ``[out, C, T, H, W]``."""

    kernel_shape: tuple[int, ...] = ()

    def bind(self, shapes, num_targets):
        for shape in _require_tensor_slots(shapes, self):
            if len(shape) != 2 or len(self.kernel_shape) != 4 or shape[1] != math.prod(self.kernel_shape):
                raise ConversionError(f"{self!r}: cannot reshape a weight of shape {shape} into kernel {self.kernel_shape}.")
        return self, [self._shape(s) for s in shapes]

    def _shape(self, shape):
        return (shape[0], *self.kernel_shape)

    def _tensor(self, tensor):
        return tensor.reshape(tensor.shape[0], *self.kernel_shape)

    def reverse(self):
        return Conv3dToLinear(kernel_shape=self.kernel_shape)


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
    """The inverse chain of a bound chain."""
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


def _all_lists(slots: list[Slot]) -> bool:
    return bool(slots) and all(isinstance(slot, list) and slot for slot in slots)


def _merge_and_concatenate(
    merge: MergeModulelist, concatenate: Concatenate, slots: list[list[torch.Tensor]]
) -> list[Slot]:
    """``concatenate.apply(merge.apply(slots))`` without the stacked intermediates."""
    first = slots[0][0]
    rank = first.dim() + 1
    merge_dim, cat_dim = _norm_dim(merge.dim, rank, merge), _norm_dim(concatenate.dim, rank, concatenate)
    stacked_shapes = []
    for slot in slots:
        shape = list(slot[0].shape)
        shape.insert(merge_dim, len(slot))
        stacked_shapes.append(shape)
    out_shape = list(stacked_shapes[0])
    out_shape[cat_dim] = sum(shape[cat_dim] for shape in stacked_shapes)
    out = torch.empty(out_shape, dtype=first.dtype, device=first.device)
    offset = 0
    for slot, shape in zip(slots, stacked_shapes):
        region = out.narrow(cat_dim, offset, shape[cat_dim])
        if list(region.shape) != shape:
            raise ConversionError(f"{concatenate!r}: cannot concatenate stacked shapes {stacked_shapes} along dim {concatenate.dim}.")
        for index, tensor in enumerate(slot):
            target = region.select(merge_dim, index)
            if target.shape != tensor.shape or tensor.dtype != out.dtype:
                raise ConversionError(f"{merge!r}: cannot stack {tensor.dtype} {tuple(tensor.shape)} into {tuple(target.shape)}.")
            target.copy_(tensor)
        offset += shape[cat_dim]
    return [out]
