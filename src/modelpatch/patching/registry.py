"""The process-wide patch registry (seed vocabulary: ``register_patch_mapping`` and friends).

The registry only records what should be replaced; nothing is replaced until a scope is entered
(:func:`modelpatch.apply_patches`, a :class:`modelpatch.Patcher`, or a modelpatch load). Every change is validated
first and then published as a new immutable :class:`PatchMapping`, so a failing call leaves the registry exactly as it
was and a scope that already took a snapshot never sees a half-applied change.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping

from torch import nn

from ..errors import PatchRegistryError
from .mapping import PatchMapping

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_current = PatchMapping()


def snapshot() -> PatchMapping:
    """The registry's current contents as an immutable mapping."""
    return _current


def register_patch_mapping(mapping: Mapping[str, type[nn.Module]], overwrite: bool = False) -> None:
    """Register class replacements, applied whenever a patch scope or a modelpatch load builds a model.

    Args:
        mapping: ``{original class name or regex pattern: replacement nn.Module subclass}``. A class is replaced by
            the key naming it exactly if there is one, else by the first key, in registration order, that
            ``re.search`` finds in its name (so ``"Attention"`` replaces ``LlamaAttention``).
        overwrite: Replace keys that are already registered instead of raising.

    Raises:
        TypeError: A replacement is not an ``nn.Module`` subclass.
        PatchRegistryError: A key does not compile as a regular expression, or is already registered and
            ``overwrite`` is False.
            The registry is unchanged when anything is raised.
    """
    global _current
    if not isinstance(mapping, Mapping):
        raise TypeError(f"mapping must be a dict of class name or pattern -> nn.Module subclass, got {mapping!r}.")
    additions = PatchMapping.from_items(mapping.items())
    with _lock:
        existing = dict(_current.entries)
        clashes = sorted(key for key in additions.entries if key in existing)
        if clashes and not overwrite:
            raise PatchRegistryError(
                f"Patch mapping already has {', '.join(map(repr, clashes))}; pass overwrite=True to replace."
            )
        existing.update(additions.entries)
        _current = PatchMapping.from_items(existing.items())
    logger.debug("Registered patches for %s", ", ".join(additions.entries))


def unregister_patch_mapping(keys: Iterable[str] | str) -> None:
    """Remove registered keys, given exactly as they were registered.

    Raises:
        PatchRegistryError: A key is not registered (the registry is left unchanged).
    """
    global _current
    keys = [keys] if isinstance(keys, str) else list(keys)
    with _lock:
        unknown = sorted(key for key in keys if key not in _current.entries)
        if unknown:
            raise PatchRegistryError(f"Cannot unregister {', '.join(map(repr, unknown))}: not in the patch mapping.")
        _current = PatchMapping.from_items((k, v) for k, v in _current.entries.items() if k not in set(keys))


def clear_patch_mapping() -> None:
    """Remove every registered patch."""
    global _current
    with _lock:
        _current = PatchMapping()


def get_patch_mapping() -> dict[str, type[nn.Module]]:
    """A copy of the registered ``{class name or pattern: replacement}`` in registration order."""
    return dict(_current.entries)
