"""The process-wide patch registry (seed vocabulary: ``register_patch_mapping`` and friends).

The registry only records what should be replaced; nothing is replaced until a scope is entered
(:func:`modelpatch.apply_patches`, a :class:`modelpatch.Patcher`, or a modelpatch load). It is a
:class:`~modelpatch.registry.Registry`: every change is validated first and then published as a new immutable table,
so a failing call leaves the registry exactly as it was and a scope that already took a snapshot (a
:class:`PatchMapping`) never sees a half-applied change.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from torch import nn

from ..errors import PatchRegistryError
from ..registry import Registry
from .mapping import PatchMapping

logger = logging.getLogger(__name__)

patch_registry: Registry[str, type[nn.Module]] = Registry("patch", PatchRegistryError)
"""The registered ``{class name or pattern: replacement}`` (``patch_registry.scoped()`` restores it on exit)."""

# The PatchMapping of the registry's last snapshot: every load and scope reads it, the patterns compiled once.
_compiled: tuple[Mapping[str, type[nn.Module]], PatchMapping] = (patch_registry.snapshot(), PatchMapping())


def snapshot() -> PatchMapping:
    """The registry's current contents as an immutable, compiled mapping."""
    global _compiled
    entries, mapping = _compiled
    current = patch_registry.snapshot()
    if current is not entries:
        mapping = PatchMapping.from_items(current.items())  # valid: every entry was validated when registered
        _compiled = (current, mapping)
    return mapping


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
    if not isinstance(mapping, Mapping):
        raise TypeError(f"mapping must be a dict of class name or pattern -> nn.Module subclass, got {mapping!r}.")
    additions = PatchMapping.from_items(mapping.items())
    patch_registry.register(additions.entries, overwrite=overwrite)
    logger.debug("Registered patches for %s", ", ".join(additions.entries))


def unregister_patch_mapping(keys: Iterable[str] | str) -> None:
    """Remove registered keys, given exactly as they were registered.

    Raises:
        PatchRegistryError: A key is not registered (the registry is left unchanged).
    """
    patch_registry.unregister([keys] if isinstance(keys, str) else keys)


def clear_patch_mapping() -> None:
    """Remove every registered patch."""
    patch_registry.clear()


def get_patch_mapping() -> dict[str, type[nn.Module]]:
    """A copy of the registered ``{class name or pattern: replacement}`` in registration order."""
    return dict(patch_registry.snapshot())
