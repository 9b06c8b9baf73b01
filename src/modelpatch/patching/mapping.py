"""An immutable, validated class-patch mapping: exact class names and regular-expression patterns.

A key that is a Python identifier (``"LlamaAttention"``) is an exact class name; any other key is a regular
expression matched with ``re.search`` (``".*SelfAttention$"``). An exact name beats every pattern; patterns are tried
in the order they were given.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from torch import nn

from ..errors import PatchRegistryError


def is_exact_key(key: str) -> bool:
    """Whether ``key`` names one class exactly (a Python identifier) rather than being a regex pattern."""
    return key.isidentifier()


def validate_replacement(key: str, replacement: object) -> type[nn.Module]:
    """Check that ``replacement`` is an ``nn.Module`` subclass; raise ``TypeError`` naming it and its key otherwise."""
    if not isinstance(replacement, type) or not issubclass(replacement, nn.Module):
        raise TypeError(
            f"Replacement for {key!r} must be a subclass of torch.nn.Module, got {replacement!r} "
            f"(of type {type(replacement).__name__})."
        )
    return replacement


def compile_pattern(key: str) -> re.Pattern[str]:
    """Compile a pattern key, raising :class:`PatchRegistryError` naming it when it is not a valid regex."""
    try:
        return re.compile(key)
    except re.error as exc:
        raise PatchRegistryError(f"Invalid regular expression {key!r} in patch mapping: {exc}.") from None


@dataclass(frozen=True)
class PatchMapping:
    """A validated snapshot of ``{class name or pattern: replacement class}``.

    Instances are immutable, so a scope can hold one while the global registry keeps changing.
    """

    entries: Mapping[str, type[nn.Module]] = field(default_factory=lambda: MappingProxyType({}))
    _exact: Mapping[str, type[nn.Module]] = field(default_factory=dict, repr=False, compare=False)
    _patterns: tuple[tuple[re.Pattern[str], type[nn.Module]], ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def from_items(cls, items: Iterable[tuple[str, object]]) -> PatchMapping:
        """Validate every item and build the mapping; nothing is built if any item is invalid."""
        entries: dict[str, type[nn.Module]] = {}
        exact: dict[str, type[nn.Module]] = {}
        patterns: list[tuple[re.Pattern[str], type[nn.Module]]] = []
        for key, replacement in items:
            if not isinstance(key, str) or not key:
                raise PatchRegistryError(f"Patch mapping keys must be non-empty strings, got {key!r}.")
            replacement = validate_replacement(key, replacement)
            entries[key] = replacement
            if is_exact_key(key):
                exact[key] = replacement
            else:
                patterns.append((compile_pattern(key), replacement))
        return cls(MappingProxyType(entries), exact, tuple(patterns))

    def __len__(self) -> int:
        return len(self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def lookup(self, class_name: str) -> type[nn.Module] | None:
        """The replacement for ``class_name``: the exact entry if any, else the first pattern that matches."""
        replacement = self._exact.get(class_name)
        if replacement is not None:
            return replacement
        for pattern, replacement in self._patterns:
            if pattern.search(class_name):
                return replacement
        return None

    def replacements(self) -> frozenset[type[nn.Module]]:
        """Every replacement class of this mapping."""
        return frozenset(self.entries.values())


def as_patch_mapping(mapping: Mapping[str, object] | PatchMapping | None) -> PatchMapping:
    """Validate a user-supplied dict (or pass a :class:`PatchMapping` through)."""
    if mapping is None:
        return PatchMapping()
    if isinstance(mapping, PatchMapping):
        return mapping
    if not isinstance(mapping, Mapping):
        raise TypeError(f"A patch mapping must be a dict of class name or pattern -> nn.Module subclass, got {mapping!r}.")
    return PatchMapping.from_items(mapping.items())
