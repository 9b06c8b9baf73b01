"""The fusion registry: fusion name -> :class:`ModuleFusionSpec`."""

from __future__ import annotations

from ..errors import FusionError, FusionRegistryError
from ..registry import Registry
from .spec import ModuleFusionSpec

fusion_registry: Registry[str, ModuleFusionSpec] = Registry("fusion", FusionRegistryError)
"""The fusions ``fusion_config`` may name (``fusion_registry.scoped()`` restores it on exit)."""


def register_fusion(name: str, spec: ModuleFusionSpec, overwrite: bool = False) -> None:
    """Make ``spec`` available as ``fusion_config={name: True}``.

    Raises:
        FusionError: ``name`` is not an identifier, or is already registered and ``overwrite`` is False.
        TypeError: ``spec`` is not a :class:`ModuleFusionSpec`.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise FusionError(f"A fusion name must be an identifier, got {name!r}.")
    if not isinstance(spec, ModuleFusionSpec):
        raise TypeError(f"spec must be a ModuleFusionSpec instance, got {spec!r}.")
    fusion_registry.register({name: spec}, overwrite=overwrite)


def unregister_fusion(name: str) -> None:
    """Remove the fusion registered as ``name``; an unknown name is a :class:`FusionError` listing the known ones."""
    fusion_registry.unregister([name])


def available_fusions() -> list[str]:
    """Names accepted in ``fusion_config``."""
    return sorted(fusion_registry.snapshot())


def get_fusion(name: str) -> ModuleFusionSpec:
    """The spec registered as ``name``; an unknown name is a :class:`FusionError` listing the known ones."""
    return fusion_registry.get(name)
