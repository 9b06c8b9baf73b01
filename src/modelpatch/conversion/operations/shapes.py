"""Operations that rearrange a tensor's entries without combining them: concatenations and splits (``Concatenate``,
``Chunk``, ``Split``), transposes, interleaves and rotary permutations, padding, row groups, copies (``Replicate``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ...errors import ConversionError
from .base import (
    ConversionOperation,
    LayoutPick,
    PerSlotOperation,
    Shape,
    check_ints,
    check_type,
    norm_dim,
    one_tensor,
    require_tensor_slots,
    text_config_count,
)


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
        return replace(self, parts=text_config_count(config, self.parts_attribute, "its number of parts", self))


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
        parts = list(shapes[0]) if indexed else require_tensor_slots(shapes, self)
        if not parts:
            raise ConversionError(f"{self!r} got no tensors.")
        rank = len(parts[0])
        dim = norm_dim(self.dim, rank, self)
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
        shape, dim = one_tensor(shapes, self.dim, self)
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
        return replace(self, sizes=tuple(s[norm_dim(self.dim, len(s), self)] for s in shapes))

    def bind(self, shapes, num_targets):
        if self.sizes is None:
            raise ConversionError(
                f"{self!r} splits into the sizes of the model's target parameters, "
                "and the model has none of some target."
            )
        return super().bind(shapes, num_targets)


@dataclass(frozen=True)
class Transpose(PerSlotOperation):
    """Swap two dimensions of every tensor.

    ``check_dims=True`` (transformers' option) transposes only when the tensor's shape differs from the model's
    target parameter (given by :meth:`for_targets`), so checkpoints in either layout load. Whether it did is recorded
    (``applied``) and the reverse does the same; with no target shape to compare (saving a model that was never
    loaded) it does nothing, which is what stock transformers' reverse does too. What the shapes told is recorded
    too (``told``, :meth:`layout_pick`): where the two swapped dims are equal, both layouts have the model's shape
    and the shape cannot tell (``UNDECIDED``); the operation then transposes nothing until the planner decides it
    from the checkpoint's other tensors (:meth:`picking`), or refuses the group (stock reads such a tensor as it is,
    transposed or not).
    """

    moves_entries: ClassVar[bool] = True

    dim0: int = 0
    dim1: int = 1
    check_dims: bool = False
    expected: Shape | None = None
    applied: bool | None = None
    told: LayoutPick | None = None

    def for_targets(self, shapes):
        if not self.check_dims or self.applied is not None or self.told is not None:
            return self
        if not shapes or not isinstance(shapes[0], tuple):
            return self
        return replace(self, expected=shapes[0])

    def bind(self, shapes, num_targets):
        if not self.check_dims:
            return super().bind(shapes, num_targets)
        bound = self
        if self.applied is None and self.told is None:
            first = shapes[0] if shapes else None
            applied, told = False, None  # nothing to compare with: as stock, no transpose
            if self.expected is not None and isinstance(first, tuple):
                applied = first != tuple(self.expected)
                square = self._shape(first) == first
                told = LayoutPick.CONVERTS if applied else LayoutPick.UNDECIDED if square else LayoutPick.AS_IS
            bound = replace(self, expected=None, applied=None if told is LayoutPick.UNDECIDED else applied, told=told)
        return bound, (PerSlotOperation.bind(bound, shapes, num_targets)[1] if bound.applied else list(shapes))

    def apply(self, slots):
        return super().apply(slots) if not self.check_dims or self.applied else slots

    def layout_pick(self):
        return self.told

    def picking(self, pick):
        if self.told is not LayoutPick.UNDECIDED or pick is LayoutPick.UNDECIDED:
            raise ConversionError(f"{self!r}: only an undecided layout is picked, and as CONVERTS or AS_IS.")
        return replace(self, applied=pick is LayoutPick.CONVERTS, told=pick)

    def _shape(self, shape):
        d0, d1 = norm_dim(self.dim0, len(shape), self), norm_dim(self.dim1, len(shape), self)
        out = list(shape)
        out[d0], out[d1] = out[d1], out[d0]
        return tuple(out)

    def _tensor(self, tensor):
        return tensor.transpose(self.dim0, self.dim1).contiguous()

    def reverse(self):
        return replace(self, dim0=self.dim1, dim1=self.dim0) if self.check_dims else self


@dataclass(frozen=True)
class Interleave(PerSlotOperation):
    """Interleave the two halves of ``dim`` (``[a0 a1 .. b0 b1 ..] -> [a0 b0 a1 b1 ..]`` when ``inverse``, the
    de-interleaving otherwise): transformers' ``Interleave`` for checkpoints that store ``gate``/``up`` rows
    alternating. A permutation, so its reverse (``inverse`` flipped) is exact."""

    moves_entries: ClassVar[bool] = True

    dim: int = 0
    inverse: bool = False

    def _shape(self, shape):
        dim = norm_dim(self.dim, len(shape), self)
        if shape[dim] % 2:
            raise ConversionError(f"{self!r}: dim {self.dim} of shape {shape} has an odd size.")
        return tuple(shape)

    def _tensor(self, tensor):
        dim = norm_dim(self.dim, tensor.dim(), self)
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
            size = text_config_count(config, self.size_attribute, "the size it keeps", self)
        if padded_size is None and self.padded_size_attribute is not None:
            padded_size = text_config_count(config, self.padded_size_attribute, "the padded size", self)
        return replace(self, size=size, padded_size=padded_size)

    def bind(self, shapes, num_targets):
        shape, dim = one_tensor(shapes, self.dim, self)
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
        check_ints(owner, "sizes", self.sizes, 1)
        check_ints(owner, "order", self.order, 0)
        check_type(owner, "inverse", self.inverse, bool)
        if sorted(self.order) != list(range(sum(self.sizes))):
            raise ConversionError(
                f"{owner}: order must be a permutation of range(sum(sizes)) = range({sum(self.sizes)}), got "
                f"{self.order!r}."
            )

    def bind(self, shapes, num_targets):
        tensors = require_tensor_slots(shapes, self)
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
class Replicate(ConversionOperation):
    """One tensor given, as a copy each, to every target: a fused layer's per-tensor quantization scale written to
    each of its parts (every part was quantized with it), or its per-input-column index. ``count`` is fixed when
    bound (the number of targets).

    Its reverse, :class:`Unreplicate`, gives back the one tensor only when every part holds the same values.
    """

    count: int | None = None

    def bind(self, shapes, num_targets):
        tensors = require_tensor_slots(shapes, self)
        if len(tensors) != 1:
            raise ConversionError(f"{self!r} takes exactly one tensor, got {len(tensors)}.")
        return replace(self, count=num_targets), [tensors[0]] * num_targets

    def apply(self, slots):
        return [slots[0].clone() for _ in range(self.count or 0)]

    def reverse(self):
        return Unreplicate()


@dataclass(frozen=True)
class Unreplicate(ConversionOperation):
    """Several tensors that must hold the same values, as the one tensor they are copies of (the reverse of
    :class:`Replicate`); parts that differ are a :class:`ConversionError`, as one tensor cannot hold them."""

    def bind(self, shapes, num_targets):
        parts = require_tensor_slots(shapes, self)
        if not parts or any(tuple(part) != tuple(parts[0]) for part in parts):
            raise ConversionError(f"{self!r}: the parts must have one shape, got {parts}.")
        return self, [parts[0]]

    def apply(self, slots):
        first = slots[0]
        if any(not torch.equal(first, other) for other in slots[1:]):
            raise ConversionError(f"{self!r}: the parts hold different values; one tensor cannot hold them all.")
        return [first]

    def reverse(self):
        return Replicate()
