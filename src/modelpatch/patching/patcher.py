"""``Patcher``: a scoped bundle of class replacements and weight-conversion adjustments (seed 002)."""

from __future__ import annotations

import contextvars
import re
import sys
import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from torch import nn

from ..errors import PatchRegistryError
from . import registry
from .mapping import PatchMapping, as_patch_mapping
from .scope import patch_scope

if TYPE_CHECKING:
    from ..conversion.transforms import WeightTransform


class _Entry:
    """One ``with patcher:``: its patch scope and the frame that entered it."""

    __slots__ = ("context", "frame")

    def __init__(self, context, frame):
        self.context = context
        self.frame = frame


def _as_list(value: object) -> list:
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return [value]
    return list(value)


class Patcher:
    """Class replacements plus weight-conversion adjustments, active only where it is entered.

    Use it as ``with patcher:`` around manual construction, or pass it to :func:`modelpatch.from_pretrained` /
    :func:`modelpatch.from_config`. Its mapping wins over the global registry, which it never modifies; the scope
    is local to the entering thread or asyncio task. Leaving it from another thread or context (a generator holding
    ``with patcher:`` closed elsewhere) ends that entry everywhere, without raising.

    Args:
        class_mapping: ``{original class name or regex pattern: replacement nn.Module subclass}``, validated like
            :func:`modelpatch.register_patch_mapping`.
        filtered_weight_conversion_patterns: Regex (or list of them); any conversion of the model type whose source
            or target pattern matches one is dropped from the load (e.g. ``".gate_up_proj"`` when experts are
            restructured).
        extra_weight_conversions: ``WeightConverter`` / ``WeightRenaming`` (or a list; modelpatch's or transformers'
            own, translated here), tried before the model type's own conversions.
    """

    def __init__(
        self,
        class_mapping: Mapping[str, type[nn.Module]] | None = None,
        filtered_weight_conversion_patterns: str | Iterable[str] | None = None,
        extra_weight_conversions: WeightTransform | Iterable[WeightTransform] | None = None,
    ):
        from ..conversion.registry import as_transforms
        from ..conversion.transforms import compile_user_pattern

        self._mapping: PatchMapping = as_patch_mapping(class_mapping)
        self._filters: tuple[re.Pattern[str], ...] = tuple(
            compile_user_pattern(p, "filtered_weight_conversion_patterns", PatchRegistryError)
            for p in _as_list(filtered_weight_conversion_patterns)
        )
        # transformers' own transforms enter modelpatch here: translated once, and refused by name when they cannot be.
        extra = as_transforms(_as_list(extra_weight_conversions), "extra_weight_conversions")
        self._extra: tuple[WeightTransform, ...] = tuple(extra)
        # Open entries of every context, oldest first, and those of the current context.
        self._lock = threading.Lock()
        self._open: list[_Entry] = []
        self._entered: contextvars.ContextVar[tuple[_Entry, ...]] = contextvars.ContextVar(
            f"patcher_{id(self)}", default=()
        )

    @property
    def class_mapping(self) -> dict[str, type[nn.Module]]:
        """A copy of the class mapping."""
        return dict(self._mapping.entries)

    @property
    def filtered_weight_conversion_patterns(self) -> list[str]:
        return [p.pattern for p in self._filters]

    @property
    def extra_weight_conversions(self) -> list[WeightTransform]:
        return list(self._extra)

    @property
    def mapping(self) -> PatchMapping:
        return self._mapping

    def filters_out(self, transform: WeightTransform) -> bool:
        """Whether a conversion of the model type is dropped by ``filtered_weight_conversion_patterns``."""
        return transform.filtered_by(self._filters)

    def adjust_conversions(self, conversions: Iterable[WeightTransform]) -> list[WeightTransform]:
        """``extra_weight_conversions`` first, then ``conversions`` minus the filtered ones."""
        return [*self._extra, *(t for t in conversions if not self.filters_out(t))]

    def __enter__(self) -> Patcher:
        # The frame running the ``with`` statement identifies this entry when it is left: a generator holding
        # ``with patcher:`` may be closed by another thread, whose context knows nothing of the entry.
        entry = _Entry(patch_scope(self._mapping, registry.snapshot()), sys._getframe(1))
        entry.context.__enter__()
        with self._lock:
            self._open.append(entry)
        self._entered.set((*self._entered.get(), entry))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        entry = self._entry_to_exit(sys._getframe(1))
        entry.context.__exit__(exc_type, exc, tb)

    def _entry_to_exit(self, frame) -> _Entry:
        """The open entry this exit ends, removed from the open ones.

        The latest entry made by the same frame (a ``with`` statement enters and exits from one frame, wherever the
        exit runs); else the latest entry of this context (``ExitStack`` enters and exits from frames of its own);
        else the latest entry of any context.
        """
        here = self._entered.get()
        with self._lock:
            if not self._open:
                raise RuntimeError(f"{self!r} is exited more often than it was entered.")
            entry = next((e for e in reversed(self._open) if e.frame is frame), None)
            if entry is None:
                entry = next((e for e in reversed(here) if any(e is o for o in self._open)), self._open[-1])
            self._open = [e for e in self._open if e is not entry]
        # Entries another context already ended stay in this context's stack until here.
        self._entered.set(tuple(e for e in here if e is not entry and any(e is o for o in self._open)))
        return entry

    def __repr__(self) -> str:
        return (
            f"Patcher(class_mapping={self.class_mapping!r}, "
            f"filtered_weight_conversion_patterns={self.filtered_weight_conversion_patterns!r}, "
            f"extra_weight_conversions={self.extra_weight_conversions!r})"
        )
