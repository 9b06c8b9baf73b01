"""Conversion operations: pure tensor transformations between checkpoint and runtime layouts.

A converter's tensors flow through its operations as a list of *slots*, one per source pattern. A slot is a tensor,
or a list of tensors when its pattern has a ``*`` index (one per expert, say).

Every operation is declared without sizes (``Concatenate(dim=0)``) and **bound** at plan time to the concrete input
shapes, read from checkpoint headers: binding validates the shapes, computes the output shapes and records what the
exact reverse needs (the part sizes of a concatenation, the count of a merge). ``bound.reverse()`` is then the exact
inverse, so a grouped-query ``q/k/v`` concatenation (sizes 128/64/64) splits back into 128/64/64, not equal chunks.

Two hooks fix what an operation reads from the model rather than from the checkpoint, before binding:
``configured(config)`` (a head count, a number of parts: the values transformers' ops read from the config at run
time) and ``for_targets(shapes)`` (the model's own parameter shapes of the converter's targets, for ``Split`` and a
``Transpose`` that only applies when the checkpoint's layout differs).

The package holds one kind of operation per module: :mod:`.base` (the interface, the slot types and the checks
operations share), :mod:`.shapes` (entries rearranged: concatenations, splits, transposes, padding),
:mod:`.experts` (per-expert tensors stacked and grouped), :mod:`.conv` (convolution kernels as linear weights),
:mod:`.quantized` (quantized checkpoint tensors) and :mod:`.chain` (chains of operations bound, reversed and run).
Every public name is importable from here.
"""

from .base import ConversionOperation, DtypeSlot, KeySlot, LayoutPick, Shape, ShapeSlot, Slot, common_dtype
from .chain import bind_operations, concatenates_rows, reverse_operations, run_operations
from .conv import Conv3dToLinear, LinearToConv3d
from .experts import FuseExpertGroups, MergeModulelist, SplitExpertGroups, SplitModulelist
from .quantized import ConcatenateShapeRows, Fp8BlockDequantize, SplitShapeRows, TorchAoTensor, WithoutCompanions
from .shapes import (
    Chunk,
    Concatenate,
    Interleave,
    MergeRowGroups,
    PermuteForRope,
    Replicate,
    Split,
    Transpose,
    Unpad,
    Unreplicate,
)

__all__ = [
    "Chunk",
    "ConcatenateShapeRows",
    "Concatenate",
    "Conv3dToLinear",
    "ConversionOperation",
    "DtypeSlot",
    "FuseExpertGroups",
    "Fp8BlockDequantize",
    "Interleave",
    "KeySlot",
    "LayoutPick",
    "LinearToConv3d",
    "MergeModulelist",
    "MergeRowGroups",
    "PermuteForRope",
    "Replicate",
    "Shape",
    "ShapeSlot",
    "Slot",
    "Split",
    "SplitShapeRows",
    "SplitExpertGroups",
    "SplitModulelist",
    "TorchAoTensor",
    "Transpose",
    "Unpad",
    "Unreplicate",
    "WithoutCompanions",
    "bind_operations",
    "common_dtype",
    "concatenates_rows",
    "reverse_operations",
    "run_operations",
]
