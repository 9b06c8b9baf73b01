"""Classes made on first use, because they derive from a class of the installed PEFT, that are importable (and so
picklable) by name from the module defining them all the same."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any


def lazy_class(module: str) -> Callable[[Callable[[], type]], Callable[[], type]]:
    """Make the decorated factory run once, and name the class it returns as a class of ``module`` (where pickle and
    :func:`module_getattr` find it), not of the factory's body."""

    def decorate(factory: Callable[[], type]) -> Callable[[], type]:
        @functools.cache
        def made() -> type:
            cls = factory()
            cls.__module__ = module
            cls.__qualname__ = cls.__name__
            return cls

        functools.update_wrapper(made, factory)
        return made

    return decorate


def module_getattr(module: str, factories: Mapping[str, Callable[[], type]]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` (PEP 562) for ``module`` that makes each class of ``factories`` when its name is
    first read."""

    def __getattr__(name: str) -> Any:
        factory = factories.get(name)
        if factory is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return factory()

    return __getattr__
