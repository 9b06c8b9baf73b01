"""An immutable, validated class-patch mapping: class names and regular-expression patterns.

Keys resolve as transformers' own ``register_patch_mapping`` documents them: every key is first tried as an exact
class name; only when no key names the class exactly is every key tried, in the order given, as a regular expression
with ``re.search``. So ``"LlamaAttention"`` replaces ``LlamaAttention`` exactly, and ``"Attention"`` (no class has that
name) replaces every class whose name contains it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from torch import nn

from ..conversion.transforms import compile_user_pattern
from ..errors import PatchRegistryError


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
    return compile_user_pattern(key, "patch mapping key", PatchRegistryError)


@dataclass(frozen=True)
class PatchMapping:
    """A validated snapshot of ``{class name or pattern: replacement class}``.

    Instances are immutable, so a scope can hold one while the global registry keeps changing.
    """

    entries: Mapping[str, type[nn.Module]] = field(default_factory=lambda: MappingProxyType({}))
    _patterns: tuple[tuple[re.Pattern[str], str], ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def from_items(cls, items: Iterable[tuple[str, object]]) -> PatchMapping:
        """Validate every item and build the mapping; nothing is built if any item is invalid."""
        entries: dict[str, type[nn.Module]] = {}
        for key, replacement in items:
            if not isinstance(key, str) or not key:
                raise PatchRegistryError(f"Patch mapping keys must be non-empty strings, got {key!r}.")
            entries[key] = validate_replacement(key, replacement)
        patterns = tuple((compile_pattern(key), key) for key in entries)
        return cls(MappingProxyType(entries), patterns)

    def __len__(self) -> int:
        return len(self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def match(self, class_name: str) -> tuple[str, type[nn.Module]] | None:
        """``(key, replacement)`` for ``class_name``: the key naming it exactly, else the first key whose pattern
        ``re.search``-matches it; None when no key applies."""
        replacement = self.entries.get(class_name)
        if replacement is not None:
            return class_name, replacement
        for pattern, key in self._patterns:
            if pattern.search(class_name):
                return key, self.entries[key]
        return None

    def unmatched_keys(self, class_names: Iterable[str]) -> list[str]:
        """The keys, in order, that match none of ``class_names`` (neither exactly nor as a pattern)."""
        names = set(class_names)
        return [key for pattern, key in self._patterns if key not in names and not any(map(pattern.search, names))]

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
        raise TypeError(
            f"A patch mapping must be a dict of class name or pattern -> nn.Module subclass, got {mapping!r}."
        )
    return PatchMapping.from_items(mapping.items())
