"""Home of the classes fusions generate at run time: importable by name, and picklable across processes."""

from __future__ import annotations

import sys
import threading
from typing import Any

ORIGINAL_CLASS_ATTRIBUTE = "_modelpatch_original_class"
SPEC_ATTRIBUTE = "_modelpatch_fusion_spec"

_lock = threading.Lock()
# (prefix, original, base, spec) -> class: a spec's options shape the classes it makes, so two configurations of one
# family never share one; equal specs (an unpickled copy of one) do.
_made: dict[tuple[str, type, type | None, Any], type] = {}


def _rebuild(spec: Any, original: type) -> Any:
    """Unpickling: an empty instance of ``spec``'s fused class for ``original``, generated again if this process has
    not made it yet (a fresh interpreter has none of the generated classes)."""
    return object.__new__(spec.make_fused_class(original))


def make_class(prefix: str, original: type, namespace: dict[str, Any], base: type | None = None, *, spec: Any) -> type:
    """``class <prefix><Original>(base or original)`` with ``namespace``, created once per (spec, prefix, original,
    base), equal specs counting as one, and importable as ``modelpatch.fusions.generated.<name>``.

    ``spec`` is the :class:`ModuleFusionSpec` making the class. Instances pickle as "``spec``'s fused class for
    ``original``" plus their state, so they unpickle in a process that has not generated the class yet.
    """
    key = (prefix, original, base, spec)
    with _lock:
        if key in _made:
            return _made[key]
        module = sys.modules[__name__]
        name = f"{prefix}{original.__name__}"
        suffix = 1
        while hasattr(module, name):
            suffix += 1
            name = f"{prefix}{original.__name__}{suffix}"

        def __reduce_ex__(self, protocol):
            return (_rebuild, (spec, original), self.__getstate__())

        attributes = {
            "__reduce_ex__": __reduce_ex__,
            **namespace,
            "__module__": __name__,
            "__qualname__": name,
            # What modelpatch.unfuse needs to rebuild the stock module: the class replaced and the spec that did it.
            ORIGINAL_CLASS_ATTRIBUTE: original,
            SPEC_ATTRIBUTE: spec,
        }
        cls = type(name, (base or original,), attributes)
        cls.__doc__ = f"{original.__qualname__} from {original.__module__}, rebuilt by modelpatch's {prefix!r} fusion."
        setattr(module, name, cls)
        _made[key] = cls
        return cls


def fused_origin(module: Any) -> tuple[type, Any] | None:
    """``(original class, spec)`` when ``module`` is an instance of a class a fusion generated, else None."""
    return fused_class_origin(type(module))


def fused_class_origin(cls: type) -> tuple[type, Any] | None:
    """``(original class, spec)`` when ``cls`` is a class a fusion generated, else None."""
    if cls.__module__ != __name__ or ORIGINAL_CLASS_ATTRIBUTE not in cls.__dict__:
        return None
    return cls.__dict__[ORIGINAL_CLASS_ATTRIBUTE], cls.__dict__[SPEC_ATTRIBUTE]


def finish_fused_modules(model: Any) -> None:
    """Run each fused module's ``spec.finish_module`` hook: called once the modules hold their final tensors."""
    for module in model.modules():
        if (origin := fused_origin(module)) is not None:
            origin[1].finish_module(module)
