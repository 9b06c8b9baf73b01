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
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch

from ..errors import ConversionError

Shape = tuple[int, ...]
# A slot is None where a converter's optional source pattern found no tensor in the group.
ShapeSlot = Shape | list[Shape] | None
Slot = torch.Tensor | list[torch.Tensor] | None
DtypeSlot = torch.dtype | None
KeySlot = str | tuple[str, ...] | None


def _norm_dim(dim: int, rank: int, op: ConversionOperation) -> int:
    if not -rank <= dim < rank:
        raise ConversionError(f"{op!r}: dim {dim} is out of range for a tensor of rank {rank}.")
    return dim % rank


def common_dtype(dtypes: list[DtypeSlot], owner: str) -> torch.dtype:
    """The one dtype of the present slots; ``owner`` names who needs it in the error."""
    present = {d for d in dtypes if d is not None}
    if len(present) != 1:
        raise ConversionError(f"{owner}: the tensors have different dtypes {sorted(map(str, present))}.")
    return present.pop()


def _require_tensor_slots(shapes: list[ShapeSlot], op: ConversionOperation) -> list[Shape]:
    if any(isinstance(s, list) for s in shapes):
        raise ConversionError(
            f"{op!r} needs one tensor per slot; apply MergeModulelist to indexed ('*') patterns first."
        )
    if any(s is None for s in shapes):
        raise ConversionError(f"{op!r} cannot take absent (optional) slots.")
    return list(shapes)  # type: ignore[arg-type]


def _one_tensor(shapes: list[ShapeSlot], dim: int, op: ConversionOperation) -> tuple[Shape, int]:
    """The shape of the one tensor an operation takes, and ``dim`` normalised for it."""
    tensors = _require_tensor_slots(shapes, op)
    if len(tensors) != 1:
        raise ConversionError(f"{op!r} takes exactly one tensor, got {len(tensors)}.")
    (shape,) = tensors
    return shape, _norm_dim(dim, len(shape), op)


def _check_int(owner: str, name: str, value: object, minimum: int) -> None:
    """Refuse, naming ``owner``'s argument ``name`` and its value, anything but an int of at least ``minimum``: a
    frozen operation keeps what it is given, and a wrong value would fail only when a checkpoint is converted.

    Raises:
        TypeError: not an int (a bool, a float, ...).
        ConversionError: below ``minimum`` (a ``ValueError``).
    """
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be an int, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ConversionError(f"{owner}: {name} must be at least {minimum}, got {value!r}.")


def _check_ints(owner: str, name: str, value: object, minimum: int) -> None:
    """:func:`_check_int` for a non-empty tuple of ints (a tuple, not a list: operations are hashed).

    Raises:
        TypeError: not a tuple, or an entry that is not an int.
        ConversionError: empty, or an entry below ``minimum``.
    """
    if not isinstance(value, tuple):
        raise TypeError(f"{owner}: {name} must be a tuple of ints, got {value!r} ({type(value).__name__}).")
    if not value:
        raise ConversionError(f"{owner}: {name} must not be empty.")
    for entry in value:
        if not isinstance(entry, int) or isinstance(entry, bool):
            raise TypeError(
                f"{owner}: {name} must be a tuple of ints, got {value!r} ({entry!r} is a {type(entry).__name__})."
            )
        if entry < minimum:
            raise ConversionError(f"{owner}: every entry of {name} must be at least {minimum}, got {value!r}.")


def _check_type(owner: str, name: str, value: object, expected: type) -> None:
    """Refuse, naming ``owner``'s argument ``name`` and its value, a value that is not an ``expected``."""
    if not isinstance(value, expected):
        raise TypeError(f"{owner}: {name} must be a {expected.__name__}, got {value!r} ({type(value).__name__}).")


class ConversionOperation(ABC):
    """Base class of conversion operations. Subclasses are frozen dataclasses."""

    # Whether every output entry is one input entry, moved, or a zero it adds (padding): no entry is combined with
    # another, scaled or repeated. Such an operation turns a weight's gradient into the gradient of the weight it
    # converts it to, exactly, so a restructuring in memory (modelpatch.fuse) carries ``.grad`` through it; through
    # any other it refuses to.
    moves_entries: ClassVar[bool] = False

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

    def for_sources(self, keys: list[KeySlot], dtypes: list[DtypeSlot]) -> ConversionOperation:
        """This operation specialised to one group's checkpoint tensors (their names and dtypes), before binding.

        Called on the first operation of a converter only, the one that reads checkpoint tensors. The default is the
        operation itself; one whose result depends on what the checkpoint stores beside a tensor (torchao's
        per-tensor metadata) picks it here.
        """
        return self

    def output_dtype(self, dtypes: list[DtypeSlot]) -> torch.dtype:
        """The dtype of this bound operation's outputs, given the dtype of each input slot (None: an absent slot).

        By default every present slot has the same dtype and the outputs keep it; operations that combine tensors of
        different dtypes (a quantized weight and its float32 scales) override this.
        """
        return common_dtype(dtypes, repr(self))

    def configured(self, config: Any) -> ConversionOperation:
        """This operation with the values it reads from the model's (root) config filled in; most read none."""
        return self

    def for_targets(self, shapes: Sequence[ShapeSlot | None]) -> ConversionOperation:
        """This operation told the model's shapes of the converter's targets (None where the model has no such key)."""
        return self


class _PerSlotOperation(ConversionOperation):
    """An operation applied to every tensor independently (lists of tensors included)."""

    def bind(self, shapes, num_targets):
        if any(slot is None for slot in shapes):
            raise ConversionError(f"{self!r} cannot take absent (optional) slots.")
        return self, [
            [self._shape(s) for s in slot] if isinstance(slot, list) else self._shape(slot) for slot in shapes
        ]

    def apply(self, slots):
        return [[self._tensor(t) for t in slot] if isinstance(slot, list) else self._tensor(slot) for slot in slots]

    @abstractmethod
    def _shape(self, shape: Shape) -> Shape: ...

    @abstractmethod
    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor: ...


def _text_config_count(config: Any, attribute: str, what: str, op: object) -> int:
    """The positive integer ``attribute`` of the model's text config (the config itself when it has no text part),
    which ``op`` reads as ``what``."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text_config, attribute, None)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConversionError(f"{op!r} reads {what} from the config's {attribute!r}, which is {value!r}.")
    return value


@dataclass(frozen=True)
class _Parts(ConversionOperation):
    """What :class:`Concatenate` and its reverse :class:`Chunk` share: the parts along ``dim`` (their ``sizes``, whether
    they are ``equal_parts``, whether they form one ``indexed`` slot of ``parts`` entries), and ``configured``, which
    reads that number of entries from the text config's ``parts_attribute`` (transformers' ``num_shards_attribute``)."""

    moves_entries: ClassVar[bool] = True

    dim: int = 0
    sizes: tuple[int, ...] | None = None
    equal_parts: bool = False
    indexed: bool = False
    parts: int | None = None
    parts_attribute: str | None = None

    def configured(self, config):
        if self.parts_attribute is None or self.parts is not None:
            return self
        return replace(self, parts=_text_config_count(config, self.parts_attribute, "its number of parts", self))


@dataclass(frozen=True)
class Concatenate(_Parts):
    """Concatenate all slots along ``dim`` into one tensor (``q, k, v -> qkv``), or the entries of a single indexed
    slot (``shard_0 .. shard_n -> one``).

    ``sizes`` and ``indexed`` (whether the parts were one indexed slot) are recorded when bound. ``equal_parts=True``
    declares that the parts always have the same size, which lets a model that was never loaded from a checkpoint be
    saved in the checkpoint layout; an indexed slot then splits back into ``parts`` entries (or as many as the text
    config's ``parts_attribute`` says).
    """

    def bind(self, shapes, num_targets):
        indexed = len(shapes) == 1 and isinstance(shapes[0], list)
        parts = list(shapes[0]) if indexed else _require_tensor_slots(shapes, self)
        if not parts:
            raise ConversionError(f"{self!r} got no tensors.")
        rank = len(parts[0])
        dim = _norm_dim(self.dim, rank, self)
        for shape in parts:
            if len(shape) != rank or any(
                a != b for i, (a, b) in enumerate(zip(shape, parts[0], strict=True)) if i != dim
            ):
                raise ConversionError(f"{self!r}: cannot concatenate shapes {parts} along dim {self.dim}.")
        sizes = tuple(s[dim] for s in parts)
        if self.sizes is not None and self.sizes != sizes:
            raise ConversionError(f"{self!r}: the parts have sizes {sizes} along dim {self.dim}, not {self.sizes}.")
        if indexed and self.parts is not None and len(parts) != self.parts:
            raise ConversionError(f"{self!r}: the indexed slot has {len(parts)} entries, not {self.parts}.")
        out = list(parts[0])
        out[dim] = sum(sizes)
        return replace(self, sizes=sizes, indexed=indexed), [tuple(out)]

    def apply(self, slots):
        return [torch.cat(slots[0] if self.indexed else slots, dim=self.dim)]

    def reverse(self):
        if self.sizes is None and not self.equal_parts:
            raise ConversionError(
                f"{self!r} cannot be reversed: its part sizes were never recorded (no checkpoint was loaded through "
                "it). Declare Concatenate(..., equal_parts=True) or give sizes=..., or save in the runtime layout."
            )
        return Chunk(
            dim=self.dim,
            sizes=self.sizes,
            equal_parts=self.equal_parts,
            indexed=self.indexed or self.parts_attribute is not None,
            parts=self.parts,
            parts_attribute=self.parts_attribute,
        )


@dataclass(frozen=True)
class Chunk(_Parts):
    """Split one tensor along ``dim`` into one part per target (equal parts unless ``sizes`` are given).

    ``indexed=True`` makes the parts one indexed slot (``one -> shard_0 .. shard_n``) of ``parts`` entries (or as
    many as the text config's ``parts_attribute`` says) instead of one slot per target.
    """

    def bind(self, shapes, num_targets):
        shape, dim = _one_tensor(shapes, self.dim, self)
        sizes = self.sizes
        if sizes is None:
            count = self.parts if self.indexed else num_targets
            if count is None:
                raise ConversionError(f"{self!r} splits into an indexed slot but is given no number of parts.")
            if count < 1 or shape[dim] % count:
                raise ConversionError(
                    f"{self!r}: dim {self.dim} of size {shape[dim]} does not split into {count} equal parts."
                )
            sizes = (shape[dim] // count,) * count
        if sum(sizes) != shape[dim]:
            raise ConversionError(f"{self!r}: part sizes {sizes} do not add up to {shape[dim]} (shape {shape}).")
        parts = []
        for size in sizes:
            part = list(shape)
            part[dim] = size
            parts.append(tuple(part))
        return replace(self, sizes=tuple(sizes)), [parts] if self.indexed else parts

    def apply(self, slots):
        parts = list(torch.split(slots[0], list(self.sizes), dim=self.dim))  # type: ignore[arg-type]
        return [parts] if self.indexed else parts

    def reverse(self):
        return Concatenate(
            dim=self.dim,
            sizes=self.sizes,
            equal_parts=self.sizes is None or self.equal_parts,
            indexed=self.indexed,
            parts=self.parts,
            parts_attribute=self.parts_attribute,
        )


@dataclass(frozen=True)
class Split(Chunk):
    """Split one tensor along ``dim`` into one part per target, each as large as the model's target parameter
    (transformers' ``Split``: ``att_proj -> q_proj, k_proj, v_proj`` of unequal sizes). The sizes come from
    :meth:`for_targets`; the exact reverse is the :class:`Concatenate` of those sizes."""

    def for_targets(self, shapes):
        if self.sizes is not None or not shapes or any(not isinstance(s, tuple) for s in shapes):
            return self
        return replace(self, sizes=tuple(s[_norm_dim(self.dim, len(s), self)] for s in shapes))

    def bind(self, shapes, num_targets):
        if self.sizes is None:
            raise ConversionError(
                f"{self!r} splits into the sizes of the model's target parameters, "
                "and the model has none of some target."
            )
        return super().bind(shapes, num_targets)


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
            dim = _norm_dim(self.dim, len(slot[0]) + 1, self)
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
        for shape in _require_tensor_slots(shapes, self):
            dim = _norm_dim(self.dim, len(shape), self)
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
class Transpose(_PerSlotOperation):
    """Swap two dimensions of every tensor.

    ``check_dims=True`` (transformers' option) transposes only when the tensor's shape differs from the model's
    target parameter (given by :meth:`for_targets`), so checkpoints in either layout load. Whether it did is recorded
    (``applied``) and the reverse does the same; with no target shape to compare (saving a model that was never
    loaded) it does nothing, which is what stock transformers' reverse does too.
    """

    moves_entries: ClassVar[bool] = True

    dim0: int = 0
    dim1: int = 1
    check_dims: bool = False
    expected: Shape | None = None
    applied: bool | None = None

    def for_targets(self, shapes):
        if not self.check_dims or self.applied is not None or not shapes or not isinstance(shapes[0], tuple):
            return self
        return replace(self, expected=shapes[0])

    def bind(self, shapes, num_targets):
        if not self.check_dims:
            return super().bind(shapes, num_targets)
        applied = self.applied
        if applied is None:
            first = shapes[0] if shapes else None
            applied = self.expected is not None and isinstance(first, tuple) and first != tuple(self.expected)
        bound = replace(self, expected=None, applied=applied)
        return bound, (_PerSlotOperation.bind(bound, shapes, num_targets)[1] if applied else list(shapes))

    def apply(self, slots):
        return super().apply(slots) if not self.check_dims or self.applied else slots

    def _shape(self, shape):
        d0, d1 = _norm_dim(self.dim0, len(shape), self), _norm_dim(self.dim1, len(shape), self)
        out = list(shape)
        out[d0], out[d1] = out[d1], out[d0]
        return tuple(out)

    def _tensor(self, tensor):
        return tensor.transpose(self.dim0, self.dim1).contiguous()

    def reverse(self):
        return replace(self, dim0=self.dim1, dim1=self.dim0) if self.check_dims else self


@dataclass(frozen=True)
class Interleave(_PerSlotOperation):
    """Interleave the two halves of ``dim`` (``[a0 a1 .. b0 b1 ..] -> [a0 b0 a1 b1 ..]`` when ``inverse``, the
    de-interleaving otherwise): transformers' ``Interleave`` for checkpoints that store ``gate``/``up`` rows
    alternating. A permutation, so its reverse (``inverse`` flipped) is exact."""

    moves_entries: ClassVar[bool] = True

    dim: int = 0
    inverse: bool = False

    def _shape(self, shape):
        dim = _norm_dim(self.dim, len(shape), self)
        if shape[dim] % 2:
            raise ConversionError(f"{self!r}: dim {self.dim} of shape {shape} has an odd size.")
        return tuple(shape)

    def _tensor(self, tensor):
        dim = _norm_dim(self.dim, tensor.dim(), self)
        shape = list(tensor.shape)
        halves = [2, shape[dim] // 2] if self.inverse else [shape[dim] // 2, 2]
        split = tensor.reshape(shape[:dim] + halves + shape[dim + 1 :])
        return split.transpose(dim, dim + 1).reshape(shape).contiguous()

    def reverse(self):
        return replace(self, inverse=not self.inverse)


@dataclass(frozen=True)
class PermuteForRope(ConversionOperation):
    """Permute the rows of each head between interleaved (complex) and split-half rotary layouts.

    Rows of each of ``num_heads`` heads go from ``[half, 2]`` to ``[2, half]`` order (the reverse with ``inverse``),
    for 1-D and 2-D tensors; other ranks pass unchanged, as in transformers. ``slots`` selects the slots it applies to
    (all when None: transformers' ``permute_layer_names``, resolved to positions). ``num_heads`` is read from the
    config's (or its ``subconfig_key`` sub-config's) ``num_attention_heads`` by :meth:`configured`.
    """

    moves_entries: ClassVar[bool] = True

    num_heads: int | None = None
    inverse: bool = False
    slots: tuple[int, ...] | None = None
    subconfig_key: str | None = None

    def configured(self, config):
        if self.num_heads is not None:
            return self
        sub = getattr(config, self.subconfig_key, config) if self.subconfig_key is not None else config
        return replace(self, num_heads=getattr(sub, "num_attention_heads", 1))

    def _selected(self, count: int) -> range | tuple[int, ...]:
        if self.slots is None:
            return range(count)
        if any(not 0 <= i < count for i in self.slots):
            raise ConversionError(f"{self!r}: slots {self.slots} out of range for {count} tensors.")
        return self.slots

    def bind(self, shapes, num_targets):
        if not self.num_heads:
            raise ConversionError(f"{self!r} needs the number of heads: configure it with the model's config first.")
        for position in self._selected(len(shapes)):
            shape = shapes[position]
            if isinstance(shape, list):
                raise ConversionError(f"{self!r} permutes single tensors, slot {position} is indexed.")
            if len(shape) in (1, 2) and shape[0] % (2 * self.num_heads):
                raise ConversionError(
                    f"{self!r}: {shape[0]} rows do not split into {self.num_heads} heads of row pairs."
                )
        return self, list(shapes)

    def apply(self, slots):
        out = list(slots)
        for position in self._selected(len(slots)):
            out[position] = self._permute(slots[position])
        return out

    def _permute(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() not in (1, 2):
            return tensor
        rows, heads = tensor.shape[0], int(self.num_heads or 1)  # bound: bind checked it is set
        half = rows // heads // 2
        pairs = (2, half) if self.inverse else (half, 2)
        trailing = tuple(tensor.shape[1:])
        return tensor.reshape(heads, *pairs, *trailing).transpose(1, 2).reshape(rows, *trailing).contiguous()

    def reverse(self):
        return replace(self, inverse=not self.inverse)


@dataclass(frozen=True)
class FuseExpertGroups(ConversionOperation):
    """Split every indexed slot (one list of experts per source) into one group per target, then give each target the
    concatenation along ``concat_dim`` of its group of every source, each stacked along ``stack_dim``.

    transformers' ``ErnieFuseAndSplitTextVisionExperts``: Ernie 4.5 VL checkpoints list text experts then vision
    experts; ``gate``/``up`` per expert become ``text_moe.experts.gate_up_proj`` and ``vision_moe...``. Groups have
    ``ceil(experts / targets)`` experts (the last fewer), as in transformers. Bound: the group sizes and each source's
    size along ``concat_dim``, which the exact reverse (:class:`SplitExpertGroups`) splits back into.
    """

    moves_entries: ClassVar[bool] = True

    stack_dim: int = 0
    concat_dim: int = 1
    group_sizes: tuple[int, ...] | None = None
    part_sizes: tuple[int, ...] | None = None

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
        stack, concat = _norm_dim(self.stack_dim, rank, self), _norm_dim(self.concat_dim, rank, self)
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
class SplitExpertGroups(ConversionOperation):
    """The reverse of :class:`FuseExpertGroups` (transformers' ``ErnieSplitAndDecoupleTextVisionExperts``): every
    tensor is split along ``concat_dim`` into one part per output pattern (``part_sizes``, equal when unbound) and
    unstacked along ``stack_dim``; output ``j`` lists part ``j``'s experts of every tensor in order."""

    moves_entries: ClassVar[bool] = True

    stack_dim: int = 0
    concat_dim: int = 1
    group_sizes: tuple[int, ...] | None = None
    part_sizes: tuple[int, ...] | None = None

    def bind(self, shapes, num_targets):
        shapes = _require_tensor_slots(shapes, self)
        if not shapes:
            raise ConversionError(f"{self!r} got no tensors.")
        rank = len(shapes[0])
        stack, concat = _norm_dim(self.stack_dim, rank, self), _norm_dim(self.concat_dim, rank, self)
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


@dataclass(frozen=True)
class Conv3dToLinear(_PerSlotOperation):
    """Flatten a Conv3d kernel ``[out, C, T, H, W]`` into a Linear weight ``[out, C*T*H*W]`` (C, T, H, W order)."""

    moves_entries: ClassVar[bool] = True

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

    moves_entries: ClassVar[bool] = True

    kernel_shape: tuple[int, ...] = ()

    def bind(self, shapes, num_targets):
        for shape in _require_tensor_slots(shapes, self):
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


@dataclass(frozen=True)
class Unpad(ConversionOperation):
    """Keep the first ``size`` entries along ``dim`` of one tensor, dropping the padding a checkpoint stores; with
    ``inverse``, append zeros up to ``padded_size`` entries (transformers' ``Inkling2UnpadVocab``: an unembedding
    stored padded to ``vocab_size`` rows, of which the first ``unpadded_vocab_size`` are the model's).

    ``size`` and ``padded_size`` are read from the text config's ``size_attribute`` / ``padded_size_attribute`` by
    :meth:`configured` when not given. A load records how many entries the checkpoint had, so its reverse pads back
    to that many. The padding comes back as zeros, as stock writes it: it was never part of the model.
    """

    moves_entries: ClassVar[bool] = True

    dim: int = 0
    size: int | None = None
    padded_size: int | None = None
    size_attribute: str | None = None
    padded_size_attribute: str | None = None
    inverse: bool = False

    def configured(self, config):
        size, padded_size = self.size, self.padded_size
        if size is None and self.size_attribute is not None:
            size = _text_config_count(config, self.size_attribute, "the size it keeps", self)
        if padded_size is None and self.padded_size_attribute is not None:
            padded_size = _text_config_count(config, self.padded_size_attribute, "the padded size", self)
        return replace(self, size=size, padded_size=padded_size)

    def bind(self, shapes, num_targets):
        shape, dim = _one_tensor(shapes, self.dim, self)
        out = list(shape)
        if self.inverse:
            if self.padded_size is None or self.padded_size < shape[dim]:
                raise ConversionError(f"{self!r} cannot pad dim {self.dim} of shape {shape} to {self.padded_size}.")
            bound, out[dim] = replace(self, size=shape[dim]), self.padded_size
        else:
            if self.size is None or self.size > shape[dim]:
                raise ConversionError(f"{self!r} cannot keep {self.size} entries of dim {self.dim} of shape {shape}.")
            bound, out[dim] = replace(self, padded_size=shape[dim]), self.size
        return bound, [tuple(out)]

    def apply(self, slots):
        (tensor,) = slots
        # Bound: bind checked that the size this direction needs is set.
        if not self.inverse:
            return [tensor.narrow(self.dim, 0, int(self.size or 0))]
        padding = list(tensor.shape)
        padding[self.dim] = int(self.padded_size or 0) - tensor.shape[self.dim]
        return [torch.cat([tensor, tensor.new_zeros(padding)], dim=self.dim)]

    def reverse(self):
        return replace(self, inverse=not self.inverse)


@dataclass(frozen=True)
class MergeRowGroups(ConversionOperation):
    """Merge tensors whose dim 0 holds, item after item (a layer, say), ``sizes[i]`` rows each into one tensor of shape
    ``(items, sum(sizes), *rest)``: each item's rows of every slot, one slot after another, reordered by ``order``
    (positions in that concatenation). With ``inverse``, the exact reverse: one such tensor -> one slot per size.

    transformers' ``Inkling2LoopMergeMessageQueries`` (5.24) is ``sizes=(2, 2), order=(0, 2, 3, 1)``: the ``[query,
    mlp]`` and ``[key, value]`` rows of each loop layer -> ``[query, key, value, mlp]``. A permutation of rows, so
    exact both ways.
    """

    moves_entries: ClassVar[bool] = True

    sizes: tuple[int, ...]
    order: tuple[int, ...]
    inverse: bool = False

    def __post_init__(self):
        owner = type(self).__name__
        _check_ints(owner, "sizes", self.sizes, 1)
        _check_ints(owner, "order", self.order, 0)
        _check_type(owner, "inverse", self.inverse, bool)
        if sorted(self.order) != list(range(sum(self.sizes))):
            raise ConversionError(
                f"{owner}: order must be a permutation of range(sum(sizes)) = range({sum(self.sizes)}), got "
                f"{self.order!r}."
            )

    def bind(self, shapes, num_targets):
        tensors = _require_tensor_slots(shapes, self)
        if self.inverse:
            if len(tensors) != 1 or len(tensors[0]) < 2 or tensors[0][1] != sum(self.sizes):
                raise ConversionError(f"{self!r} takes one tensor of shape (items, {sum(self.sizes)}, ...): {tensors}.")
            count, _, *rest = tensors[0]
            return self, [(count * size, *rest) for size in self.sizes]
        if len(tensors) != len(self.sizes):
            raise ConversionError(f"{self!r} takes {len(self.sizes)} tensors, got {len(tensors)}.")
        counts = {
            shape[0] // size if shape and shape[0] % size == 0 else None
            for shape, size in zip(tensors, self.sizes, strict=True)
        }
        rests = {tuple(shape[1:]) for shape in tensors}
        if None in counts or len(counts) != 1 or len(rests) != 1:
            raise ConversionError(f"{self!r}: shapes {tensors} do not hold the same number of row groups {self.sizes}.")
        return self, [(counts.pop(), sum(self.sizes), *rests.pop())]

    def apply(self, slots):
        if self.inverse:
            (tensor,) = slots
            back = tensor[:, [self.order.index(position) for position in range(len(self.order))]]
            return [part.flatten(0, 1).contiguous() for part in back.split(list(self.sizes), dim=1)]
        merged = torch.cat([t.unflatten(0, (-1, size)) for t, size in zip(slots, self.sizes, strict=True)], dim=1)
        return [merged[:, list(self.order)].contiguous()]

    def reverse(self):
        return replace(self, inverse=not self.inverse)


@dataclass(frozen=True)
class WithoutCompanions(ConversionOperation):
    """A weight a quantized format may store beside companion tensors (its scales), stored without them: passed
    through as it is. The slots are the weight, then ``companions`` optional ones. A group that has any companion is
    refused when it is bound, naming ``format``: dequantizing it is not something modelpatch does. With ``inverse``,
    the reverse: the tensor back as the weight, with no companions, as stock writes it.

    transformers' ``Inkling2LoopDequantizeExperts`` (5.24): a weight alone is passed through; NVFP4 / MXFP8 experts
    with their scales are refused by name.
    """

    moves_entries: ClassVar[bool] = True

    companions: int = 0
    format: str = "quantized"
    inverse: bool = False

    def __post_init__(self):
        owner = type(self).__name__
        _check_int(owner, "companions", self.companions, 0)
        _check_type(owner, "format", self.format, str)
        _check_type(owner, "inverse", self.inverse, bool)

    def bind(self, shapes, num_targets):
        if self.inverse:
            (shape,) = _require_tensor_slots(shapes, self)
            return self, [shape, *([None] * self.companions)]
        if len(shapes) != 1 + self.companions or shapes[0] is None:
            raise ConversionError(f"{self!r} takes a weight and {self.companions} optional companions: {shapes}.")
        if any(shape is not None for shape in shapes[1:]):
            raise ConversionError(
                f"{self!r}: the checkpoint stores {self.format} data beside the weight, which modelpatch does not "
                "dequantize. Load it with stock transformers and save it (dequantized), then load that."
            )
        return self, [shapes[0]]

    def output_dtype(self, dtypes):
        return common_dtype(dtypes[:1], repr(self))

    def apply(self, slots):
        return [slots[0], *([None] * self.companions)] if self.inverse else [slots[0]]

    def reverse(self):
        return replace(self, inverse=not self.inverse)


_FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)


def _scale_grid(shape: Shape) -> tuple[int, int]:
    """Blocks per (rows, columns) that a scale tensor of ``shape`` stands for: its last two dims, or one scale."""
    if len(shape) >= 2:
        return shape[-2], shape[-1]
    if math.prod(shape) == 1:
        return 1, 1
    raise ConversionError(f"a scale of shape {shape} is neither a block grid (2-D) nor one per-tensor scale.")


@dataclass(frozen=True)
class Fp8BlockDequantize(ConversionOperation):
    """Float8 weights and their block scales -> full-precision weights, as transformers' FP8 loader dequantizes them.

    The slots come in runs of ``1 + companions``: a float8 weight, its ``weight_scale_inv`` (one float32 scale per
    block of a ``[rows/blocks, cols/blocks]`` grid, or one for the tensor), then further companions
    (``activation_scale``) that a dequantized weight has no use for and that are dropped. The outputs are the weights:
    ``weight.float() * scale`` block by block, cast to ``dtype`` — the same arithmetic, in the same order, as
    transformers 5.23's ``Fp8Dequantize``, so the result is bitwise stock's. A run whose scale is absent is a weight the
    checkpoint did not quantize (a norm): it passes through (cast to ``dtype`` only when other weights of the group
    are dequantized, so that they can be stacked). ``uint8`` scales are MXFP8's power-of-two exponents.

    There is no exact reverse: the scales are not kept, and re-quantizing what was dequantized does not give them back.
    """

    dtype: torch.dtype = torch.bfloat16
    companions: int = 2
    scaled: bool | None = None

    def _runs(self, slots: list) -> list[tuple]:
        size = 1 + self.companions
        if not slots or len(slots) % size:
            raise ConversionError(f"{self!r} needs slots in runs of {size} (weight, scale, ...), got {len(slots)}.")
        return [tuple(slots[i : i + size]) for i in range(0, len(slots), size)]

    def bind(self, shapes, num_targets):
        out: list[ShapeSlot] = []
        scaled = set()
        for weight, scale, *_ in self._runs(shapes):
            if weight is None:
                raise ConversionError(f"{self!r}: a scale without its weight.")
            scaled.add(scale is not None)
            if scale is None:
                out.append(weight)
                continue
            # An indexed slot (one tensor per expert) pairs with an indexed slot of as many scales.
            weights, scales = (weight, scale) if isinstance(weight, list) else ([weight], [scale])
            if not isinstance(scale, type(weight)) or len(weights) != len(scales):
                raise ConversionError(f"{self!r}: weights {weight} and scales {scale} do not pair up.")
            for weight_shape, scale_shape in zip(weights, scales, strict=True):
                if len(weight_shape) < 2:
                    raise ConversionError(f"{self!r}: a block-scaled weight must be at least 2-D, got {weight_shape}.")
                grid = _scale_grid(scale_shape)
                if weight_shape[-2] % grid[0] or weight_shape[-1] % grid[1]:
                    raise ConversionError(
                        f"{self!r}: weight {weight_shape} does not divide into the scale grid {grid} (transformers "
                        "dequantizes only whole blocks)."
                    )
            out.append(weight)
        return replace(self, scaled=True in scaled), out

    def output_dtype(self, dtypes):
        runs = self._runs(dtypes)
        if any(scale is not None for _, scale, *_ in runs):
            for weight, scale, *_ in runs:
                if scale is not None and weight not in _FLOAT8_DTYPES:
                    raise ConversionError(
                        f"{self!r}: a scaled weight is {weight}, not float8 (packed FP4 weights are not supported)."
                    )
            return self.dtype
        return super().output_dtype([weight for weight, *_ in runs])

    def apply(self, slots):
        out: list[Slot] = []
        for weight, scale, *_ in self._runs(slots):
            if scale is None:
                out.append([self._cast(t) for t in weight] if isinstance(weight, list) else self._cast(weight))
            elif isinstance(weight, list):
                out.append([self._dequantize(w, s) for w, s in zip(weight, scale, strict=True)])
            else:
                out.append(self._dequantize(weight, scale))
        return out

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.dtype) if self.scaled and tensor.is_floating_point() else tensor

    def _dequantize(self, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        rows, cols = weight.shape[-2:]
        grid_rows, grid_cols = _scale_grid(tuple(scale.shape))
        scale = (scale.to(torch.float32) - 127.0).exp2() if scale.dtype == torch.uint8 else scale.to(torch.float32)
        blocks = weight.to(torch.float32).reshape(-1, grid_rows, rows // grid_rows, grid_cols, cols // grid_cols)
        scales = scale.reshape(-1, grid_rows, grid_cols).unsqueeze(-1).unsqueeze(2)
        return (blocks * scales).to(self.dtype).reshape(weight.shape)

    def reverse(self):
        raise ConversionError(
            f"{self!r} has no exact reverse: the float8 weights were dequantized at load and their block scales "
            "are not kept, so the checkpoint's float8 tensors cannot be written back. Save in the runtime layout "
            "(save_original_format=False) to write the dequantized weights."
        )


@dataclass(frozen=True)
class TorchAoTensor(ConversionOperation):
    """torchao's flattened tensor-subclass data -> the tensor subclass (an ``Int8Tensor`` weight, say).

    torchao saves a quantized ``<module>.weight`` as ``<module>._weight_qdata``, ``<module>._weight_scale``, ... plus a
    JSON entry per tensor in the safetensors metadata (its subclass, block size, dtype and which data it has).
    ``metadata`` is that mapping; :meth:`for_sources` picks the entry of each group's tensor and which slot holds which
    data, and torchao's own ``unflatten_tensor_state_dict`` rebuilds the subclass. Absent slots are data the tensor
    does not have (an ``Int8Tensor`` has no ``scale_and_zero``).

    No reverse: the flattened data alone is not the format, its metadata is part of it. A save writes torchao
    tensors with torchao's own serialisation (data and metadata together).
    """

    metadata: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    tensor_name: str | None = None
    data_names: tuple[str | None, ...] = ()
    dtypes: tuple[torch.dtype | None, ...] = ()
    result_dtype: torch.dtype | None = None

    def for_sources(self, keys, dtypes):
        first = keys[0]
        if not isinstance(first, str):
            raise ConversionError(f"{self!r} reads one tensor per slot, got {first!r}.")
        # torchao names the data of ``<module>.<param>`` ``<module>._<param>_<data>``; a param name may contain "_".
        module, _, flat = first.rpartition(".")
        splits = [i for i, char in enumerate(flat) if char == "_" and i > 1] if flat.startswith("_") else []
        tensor_name = next((name for i in splits if (name := f"{module}.{flat[1:i]}") in self.metadata), None)
        if tensor_name is None:
            raise ConversionError(f"{self!r}: the checkpoint's torchao metadata has no entry for {first!r}.")
        prefix = f"{module}._{tensor_name.rpartition('.')[2]}_"
        data_names = []
        for key in keys:
            if key is not None and (not isinstance(key, str) or not key.startswith(prefix)):
                raise ConversionError(f"{self!r}: {key!r} is not data of torchao tensor {tensor_name!r}.")
            data_names.append(None if key is None else key[len(prefix) :])
        return replace(self, tensor_name=tensor_name, data_names=tuple(data_names), dtypes=tuple(dtypes))

    def _specialised_name(self) -> str:
        if self.tensor_name is None:
            raise ConversionError(f"{self!r} is used before it is specialised to a group (for_sources).")
        return self.tensor_name

    def _entry(self) -> dict:
        entry = json.loads(self.metadata[self._specialised_name()])
        wanted = set(entry.get("_tensor_data_names") or ())
        present = {name for name in self.data_names if name is not None}
        if not wanted <= present:
            raise ConversionError(
                f"{self!r}: torchao tensor {self.tensor_name!r} needs data {sorted(wanted)}, the checkpoint has "
                f"{sorted(present)}."
            )
        return entry

    def bind(self, shapes, num_targets):
        entry = self._entry()
        # torchao builds the subclass from meta tensors of the stored shapes: the runtime shape and dtype, no data.
        entry["_data"].update(
            {
                name: torch.empty(shape, dtype=dtype, device="meta")
                for name, shape, dtype in zip(self.data_names, shapes, self.dtypes, strict=True)
                if name is not None
            }
        )
        from torchao.prototype.safetensors.safetensors_utils import object_from_dict

        try:
            tensor = object_from_dict(entry)
        except Exception as exc:  # torchao's constructors raise many types on inconsistent data
            raise ConversionError(f"{self!r}: torchao cannot build {self.tensor_name!r} from {shapes}: {exc}") from None
        return replace(self, result_dtype=tensor.dtype), [tuple(tensor.shape)]

    def output_dtype(self, dtypes):
        if self.result_dtype is None:
            raise ConversionError(f"{self!r}: the dtype of a torchao tensor is known once it is bound.")
        return self.result_dtype

    def apply(self, slots):
        from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

        tensor_name = self._specialised_name()
        module, _, param = tensor_name.rpartition(".")
        data = {
            f"{module}._{param}_{name}": t for name, t in zip(self.data_names, slots, strict=True) if name is not None
        }
        metadata = {tensor_name: self.metadata[tensor_name], "tensor_names": json.dumps([tensor_name])}
        tensors, leftover = unflatten_tensor_state_dict(data, metadata)
        if leftover or tensor_name not in tensors:
            raise ConversionError(f"{self!r}: torchao did not rebuild {tensor_name!r} (left {sorted(leftover)}).")
        return [tensors[tensor_name]]

    def reverse(self):
        raise ConversionError(
            f"{self!r} has no tensor-only reverse: torchao tensors are written by torchao's serialisation, data and "
            "metadata together (modelpatch.save_pretrained does this for a torchao model whose layout is unchanged)."
        )


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
