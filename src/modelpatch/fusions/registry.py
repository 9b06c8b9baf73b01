"""The fusion registry: fusion name -> :class:`ModuleFusionSpec`."""

from __future__ import annotations

import threading

from ..errors import FusionError
from .spec import ModuleFusionSpec

_lock = threading.Lock()
_fusions: dict[str, ModuleFusionSpec] = {}


def register_fusion(name: str, spec: ModuleFusionSpec, overwrite: bool = False) -> None:
    """Make ``spec`` available as ``fusion_config={name: True}``."""
    if not isinstance(name, str) or not name.isidentifier():
        raise FusionError(f"A fusion name must be an identifier, got {name!r}.")
    if not isinstance(spec, ModuleFusionSpec):
        raise TypeError(f"spec must be a ModuleFusionSpec instance, got {spec!r}.")
    with _lock:
        if name in _fusions and not overwrite:
            raise FusionError(f"A fusion named {name!r} is already registered; pass overwrite=True to replace it.")
        _fusions[name] = spec


def unregister_fusion(name: str) -> None:
    with _lock:
        if name not in _fusions:
            raise FusionError(f"No fusion named {name!r}; available: {', '.join(available_fusions())}.")
        del _fusions[name]


def available_fusions() -> list[str]:
    """Names accepted in ``fusion_config``."""
    return sorted(_fusions)


def get_fusion(name: str) -> ModuleFusionSpec:
    try:
        return _fusions[name]
    except KeyError:
        raise FusionError(f"Unknown fusion {name!r}; available: {', '.join(available_fusions()) or 'none'}.") from None
