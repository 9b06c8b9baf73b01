"""How the conversion layer reaches the border module without importing it.

The built-in conversion mappings are transformers' own registry, translated by the border module
:mod:`modelpatch._transformers_mapping`, which sits above ``conversion/`` and imports its registry (it registers itself
there as the provider, :func:`~modelpatch.conversion.registry.set_builtin_mappings`). The registry's first lookup may
come before anything imported the border (``from modelpatch.conversion import get_checkpoint_conversion_mapping``);
importing it from the registry would close an import circle. So the package's ``__init__``, above every layer and
always imported before any of them, hands this module the function that imports the border, and the registry calls
:func:`import_border` at its first lookup that needs the built-in mappings: every import points down.
"""

from __future__ import annotations

from collections.abc import Callable

_import_border: Callable[[], None] | None = None


def set_border_import(function: Callable[[], None]) -> None:
    """Hand down the function that imports the border module (``modelpatch/__init__.py`` does, when imported)."""
    global _import_border
    _import_border = function


def import_border() -> None:
    """Import the border module, which registers the built-in conversion mappings.

    Raises:
        RuntimeError: nothing handed the import down (``modelpatch/__init__.py`` always does; a copy of a module
            outside the package would not).
    """
    if _import_border is None:
        raise RuntimeError("modelpatch's __init__ did not hand down the import of its border module.")
    _import_border()
