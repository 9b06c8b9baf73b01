"""Operations between per-expert tensors and the tensors that hold them: module lists stacked and unstacked
(``MergeModulelist``, ``SplitModulelist``), groups of experts fused and split (``FuseExpertGroups``,
``SplitExpertGroups``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ...errors import ConversionError
from .base import ConversionOperation, ShapeSlot, norm_dim, require_tensor_slots


@dataclass(frozen=True)
class _ModulelistOperation(ConversionOperation):
    """Between a list of per-index tensors (experts ``0..n-1``) and one tensor holding them along ``dim``; ``count``
    is the number of entries, learnt when bound (so that the reverse checks it)."""

    moves_entries: ClassVar[bool] = True

    dim: int = 0
    count: int | None = None


@dataclass(frozen=True)
class MergeModulelist(_ModulelistOperation):
    """Stack each slot's list of per-index tensors (experts ``0..n-1``) into one tensor along a new ``dim``."""

    def bind(self, shapes, num_targets):
        out = []
        counts = set()
        for slot in shapes:
            if not isinstance(slot, list):
                raise ConversionError(f"{self!r} needs indexed ('*') source patterns.")
            if not slot or any(s != slot[0] for s in slot):
                raise ConversionError(f"{self!r}: cannot stack tensors of shapes {slot}.")
            dim = norm_dim(self.dim, len(slot[0]) + 1, self)
            counts.add(len(slot))
            shape = list(slot[0])
            shape.insert(dim, len(slot))
            out.append(tuple(shape))
        if len(counts) > 1:
            raise ConversionError(f"{self!r}: the source patterns have different numbers of entries {sorted(counts)}.")
        return replace(self, count=counts.pop() if counts else 0), out

    def apply(self, slots):
        return [torch.stack(slot, dim=self.dim) for slot in slots]

    def reverse(self):
        return SplitModulelist(dim=self.dim, count=self.count)


@dataclass(frozen=True)
class SplitModulelist(_ModulelistOperation):
    """Unstack each slot along ``dim`` into a list of tensors (one per index)."""

    def bind(self, shapes, num_targets):
        out = []
        for shape in require_tensor_slots(shapes, self):
            dim = norm_dim(self.dim, len(shape), self)
            if self.count is not None and shape[dim] != self.count:
                raise ConversionError(
                    f"{self!r}: expected {self.count} entries along dim {self.dim}, shape is {shape}."
                )
            out.append([shape[:dim] + shape[dim + 1 :]] * shape[dim])
        return replace(self, count=len(out[0]) if out else 0), out

    def apply(self, slots):
        return [list(torch.unbind(slot, dim=self.dim)) for slot in slots]

    def reverse(self):
        return MergeModulelist(dim=self.dim, count=self.count)


@dataclass(frozen=True)
class _ExpertGroups(ConversionOperation):
    """What :class:`FuseExpertGroups` and its reverse :class:`SplitExpertGroups` share: experts stacked along
    ``stack_dim``, the parts concatenated along ``concat_dim``, and the ``group_sizes`` and ``part_sizes`` a bind
    records."""

    moves_entries: ClassVar[bool] = True

    stack_dim: int = 0
    concat_dim: int = 1
    group_sizes: tuple[int, ...] | None = None
    part_sizes: tuple[int, ...] | None = None


@dataclass(frozen=True)
class FuseExpertGroups(_ExpertGroups):
    """Split every indexed slot (one list of experts per source) into one group per target, then give each target the
    concatenation along ``concat_dim`` of its group of every source, each stacked along ``stack_dim``.

    transformers' ``ErnieFuseAndSplitTextVisionExperts``: Ernie 4.5 VL checkpoints list text experts then vision
    experts; ``gate``/``up`` per expert become ``text_moe.experts.gate_up_proj`` and ``vision_moe...``. Groups have
    ``ceil(experts / targets)`` experts (the last fewer), as in transformers. Bound: the group sizes and each source's
    size along ``concat_dim``, which the exact reverse (:class:`SplitExpertGroups`) splits back into.
    """

    def bind(self, shapes, num_targets):
        if not shapes or any(not isinstance(slot, list) or not slot for slot in shapes):
            raise ConversionError(f"{self!r} needs indexed ('*') source patterns.")
        counts = {len(slot) for slot in shapes}
        if len(counts) > 1:
            raise ConversionError(f"{self!r}: the source patterns have different numbers of entries {sorted(counts)}.")
        experts = counts.pop()
        size = math.ceil(experts / max(num_targets, 1))
        groups = tuple(len(range(experts)[i * size : (i + 1) * size]) for i in range(num_targets))
        if not groups or 0 in groups or (self.group_sizes is not None and groups != self.group_sizes):
            raise ConversionError(
                f"{self!r}: {experts} experts do not split into {num_targets} groups {self.group_sizes or ''}."
            )
        rank = len(shapes[0][0]) + 1
        stack, concat = norm_dim(self.stack_dim, rank, self), norm_dim(self.concat_dim, rank, self)
        if stack == concat:
            raise ConversionError(f"{self!r}: stack_dim and concat_dim must differ.")
        parts = []
        for slot in shapes:
            if any(s != slot[0] for s in slot) or len(slot[0]) + 1 != rank:
                raise ConversionError(f"{self!r}: cannot stack tensors of shapes {slot}.")
            parts.append(list(slot[0]))
            parts[-1].insert(stack, 0)
        for part in parts:
            if any(a != b for i, (a, b) in enumerate(zip(part, parts[0], strict=True)) if i not in (stack, concat)):
                raise ConversionError(f"{self!r}: cannot concatenate the experts of shapes {[s[0] for s in shapes]}.")
        part_sizes = tuple(part[concat] for part in parts)
        outputs = []
        for group in groups:
            out = list(parts[0])
            out[stack], out[concat] = group, sum(part_sizes)
            outputs.append(tuple(out))
        return replace(self, group_sizes=groups, part_sizes=part_sizes), outputs

    def apply(self, slots):
        outputs, start = [], 0
        for group in self.group_sizes:  # type: ignore[union-attr]
            stacked = [torch.stack(slot[start : start + group], dim=self.stack_dim) for slot in slots]
            outputs.append(torch.cat(stacked, dim=self.concat_dim))
            start += group
        return outputs

    def reverse(self):
        return SplitExpertGroups(self.stack_dim, self.concat_dim, self.group_sizes, self.part_sizes)


@dataclass(frozen=True)
class SplitExpertGroups(_ExpertGroups):
    """The reverse of :class:`FuseExpertGroups` (transformers' ``ErnieSplitAndDecoupleTextVisionExperts``): every
    tensor is split along ``concat_dim`` into one part per output pattern (``part_sizes``, equal when unbound) and
    unstacked along ``stack_dim``; output ``j`` lists part ``j``'s experts of every tensor in order."""

    def bind(self, shapes, num_targets):
        shapes = require_tensor_slots(shapes, self)
        if not shapes:
            raise ConversionError(f"{self!r} got no tensors.")
        rank = len(shapes[0])
        stack, concat = norm_dim(self.stack_dim, rank, self), norm_dim(self.concat_dim, rank, self)
        if stack == concat or any(len(s) != rank for s in shapes):
            raise ConversionError(f"{self!r}: cannot split shapes {shapes}.")
        part_sizes = self.part_sizes
        if part_sizes is None:
            if num_targets < 1 or shapes[0][concat] % num_targets:
                raise ConversionError(
                    f"{self!r}: dim {self.concat_dim} of {shapes[0]} does not split into {num_targets} equal parts."
                )
            part_sizes = (shapes[0][concat] // num_targets,) * num_targets
        groups = tuple(s[stack] for s in shapes)
        if self.group_sizes is not None and groups != self.group_sizes:
            raise ConversionError(f"{self!r}: the tensors hold {groups} experts, not {self.group_sizes}.")
        outputs: list[ShapeSlot] = []
        for size in part_sizes:
            entries = []
            for shape in shapes:
                if shape[concat] != sum(part_sizes) or any(
                    a != b for i, (a, b) in enumerate(zip(shape, shapes[0], strict=True)) if i != stack
                ):
                    raise ConversionError(f"{self!r}: cannot split shapes {shapes} into parts {part_sizes}.")
                entry = list(shape)
                entry[concat] = size
                del entry[stack]
                entries += [tuple(entry)] * shape[stack]
            outputs.append(entries)
        return replace(self, group_sizes=groups, part_sizes=tuple(part_sizes)), outputs

    def apply(self, slots):
        outputs: list[list[torch.Tensor]] = [[] for _ in self.part_sizes]  # type: ignore[union-attr]
        for tensor in slots:
            for position, part in enumerate(torch.split(tensor, list(self.part_sizes), dim=self.concat_dim)):  # type: ignore[arg-type]
                outputs[position].extend(torch.unbind(part, dim=self.stack_dim))
        return outputs

    def reverse(self):
        return FuseExpertGroups(self.stack_dim, self.concat_dim, self.group_sizes, self.part_sizes)
