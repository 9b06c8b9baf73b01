"""Operations between a ``Conv3d`` kernel and the ``Linear`` weight that does its work on flattened patches (a
patch embedding)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

from ...errors import ConversionError
from .base import PerSlotOperation, require_tensor_slots


@dataclass(frozen=True)
class Conv3dToLinear(PerSlotOperation):
    """Flatten a Conv3d kernel ``[out, C, T, H, W]`` into a Linear weight ``[out, C*T*H*W]`` (C, T, H, W order)."""

    moves_entries: ClassVar[bool] = True

    kernel_shape: tuple[int, ...] | None = None

    def bind(self, shapes, num_targets):
        for shape in require_tensor_slots(shapes, self):
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
class LinearToConv3d(PerSlotOperation):
    """Reshape a Linear weight ``[out, C*T*H*W]`` back into a Conv3d kernel ``[out, C, T, H, W]``."""

    moves_entries: ClassVar[bool] = True

    kernel_shape: tuple[int, ...] = ()

    def bind(self, shapes, num_targets):
        for shape in require_tensor_slots(shapes, self):
            if len(shape) != 2 or len(self.kernel_shape) != 4 or shape[1] != math.prod(self.kernel_shape):
                raise ConversionError(
                    f"{self!r}: cannot reshape a weight of shape {shape} into kernel {self.kernel_shape}."
                )
        return self, [self._shape(s) for s in shapes]

    def _shape(self, shape):
        return (shape[0], *self.kernel_shape)

    def _tensor(self, tensor):
        return tensor.reshape(tensor.shape[0], *self.kernel_shape)

    def reverse(self):
        return Conv3dToLinear(kernel_shape=self.kernel_shape)
