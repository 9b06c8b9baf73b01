"""What every conversion operation is: the slots it takes, the base class with its hooks, and the shape and
argument checks operations share (this package's own helpers, not re-exported)."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from ...errors import ConversionError

Shape = tuple[int, ...]
# A slot is None where a converter's optional source pattern found no tensor in the group.
ShapeSlot = Shape | list[Shape] | None
Slot = torch.Tensor | list[torch.Tensor] | None
DtypeSlot = torch.dtype | None
KeySlot = str | tuple[str, ...] | None


def norm_dim(dim: int, rank: int, op: ConversionOperation) -> int:
    if not -rank <= dim < rank:
        raise ConversionError(f"{op!r}: dim {dim} is out of range for a tensor of rank {rank}.")
    return dim % rank


def common_dtype(dtypes: list[DtypeSlot], owner: str) -> torch.dtype:
    """The one dtype of the present slots; ``owner`` names who needs it in the error."""
    present = {d for d in dtypes if d is not None}
    if len(present) != 1:
        raise ConversionError(f"{owner}: the tensors have different dtypes {sorted(map(str, present))}.")
    return present.pop()


def require_tensor_slots(shapes: list[ShapeSlot], op: ConversionOperation) -> list[Shape]:
    if any(isinstance(s, list) for s in shapes):
        raise ConversionError(
            f"{op!r} needs one tensor per slot; apply MergeModulelist to indexed ('*') patterns first."
        )
    if any(s is None for s in shapes):
        raise ConversionError(f"{op!r} cannot take absent (optional) slots.")
    return list(shapes)  # type: ignore[arg-type]


def one_tensor(shapes: list[ShapeSlot], dim: int, op: ConversionOperation) -> tuple[Shape, int]:
    """The shape of the one tensor an operation takes, and ``dim`` normalised for it."""
    tensors = require_tensor_slots(shapes, op)
    if len(tensors) != 1:
        raise ConversionError(f"{op!r} takes exactly one tensor, got {len(tensors)}.")
    (shape,) = tensors
    return shape, norm_dim(dim, len(shape), op)


def check_int(owner: str, name: str, value: object, minimum: int) -> None:
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


def check_ints(owner: str, name: str, value: object, minimum: int) -> None:
    """:func:`check_int` for a non-empty tuple of ints (a tuple, not a list: operations are hashed).

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


def check_type(owner: str, name: str, value: object, expected: type) -> None:
    """Refuse, naming ``owner``'s argument ``name`` and its value, a value that is not an ``expected``."""
    if not isinstance(value, expected):
        raise TypeError(f"{owner}: {name} must be a {expected.__name__}, got {value!r} ({type(value).__name__}).")


class LayoutPick(enum.Enum):
    """What a bound operation that tells a checkpoint tensor's layout by its shape found
    (:meth:`ConversionOperation.layout_pick`)."""

    CONVERTS = "another layout than the model's, converted"
    AS_IS = "the model's layout, read as it is"
    UNDECIDED = "either layout: both have the tensor's shape"


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

    def layout_pick(self) -> LayoutPick | None:
        """For a bound operation that converts a tensor only when the checkpoint holds it in another layout than the
        model's, telling which by the tensor's shape (transformers' check-dims ``Transpose``): what the shape told,
        :attr:`LayoutPick.UNDECIDED` where both layouts have that shape. None (the default) for every other
        operation."""
        return None

    def picking(self, pick: LayoutPick) -> ConversionOperation:
        """This bound operation, whose :meth:`layout_pick` is undecided, with the layout decided by other evidence
        (``CONVERTS`` or ``AS_IS``: what the checkpoint's other tensors showed). Only asked of operations that
        report a pick."""
        raise NotImplementedError(f"{self!r} picks no layout.")


class PerSlotOperation(ConversionOperation):
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


def text_config_count(config: Any, attribute: str, what: str, op: object) -> int:
    """The positive integer ``attribute`` of the model's text config (the config itself when it has no text part),
    which ``op`` reads as ``what``."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text_config, attribute, None)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConversionError(f"{op!r} reads {what} from the config's {attribute!r}, which is {value!r}.")
    return value
