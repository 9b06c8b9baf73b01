"""Helpers for the tests of code built on modelpatch.

:func:`scoped_registries` gives a test a private view of every process-wide registry: whatever it registers (patches,
patchable namespaces, conversion mappings, fusions) is gone when it ends, pass or fail.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from .conversion.registry import conversion_registry
from .fusions.registry import fusion_registry
from .patching.candidates import namespace_registry
from .patching.registry import patch_registry
from .registry import Registry

REGISTRIES: tuple[Registry, ...] = (patch_registry, namespace_registry, conversion_registry, fusion_registry)
"""Every registry of modelpatch, each a :class:`~modelpatch.registry.Registry`."""


@contextmanager
def scoped_registries() -> Iterator[None]:
    """Restore every registry in :data:`REGISTRIES`, on exit, to what it held on entry.

    Example (a pytest fixture)::

        @pytest.fixture(autouse=True)
        def _isolated_registries():
            with modelpatch.testing.scoped_registries():
                yield
    """
    with ExitStack() as stack:
        for registry in REGISTRIES:
            stack.enter_context(registry.scoped())
        yield
