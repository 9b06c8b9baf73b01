"""Home of the classes fusions generate at run time, so that pickle can find them by name."""

from __future__ import annotations

import sys
import threading
from typing import Any

_lock = threading.Lock()
_made: dict[tuple[str, type, tuple], type] = {}


def make_class(prefix: str, original: type, namespace: dict[str, Any], base: type | None = None) -> type:
    """``class <prefix><Original>(base or original)`` with ``namespace``, created once per (prefix, original) and
    importable as ``modelpatch.fusions.generated.<name>``."""
    key = (prefix, original, base)
    with _lock:
        if key in _made:
            return _made[key]
        module = sys.modules[__name__]
        name = f"{prefix}{original.__name__}"
        suffix = 1
        while hasattr(module, name):
            suffix += 1
            name = f"{prefix}{original.__name__}{suffix}"
        cls = type(name, (base or original,), {**namespace, "__module__": __name__, "__qualname__": name})
        cls.__doc__ = f"{original.__qualname__} from {original.__module__}, rebuilt by modelpatch's {prefix!r} fusion."
        setattr(module, name, cls)
        _made[key] = cls
        return cls
