"""Fusion mapping: opt-in, load-scoped replacement of modules by fused equivalents, reversible on save.

Each family lives in its own sub-package with the same shape (``modules.py``: the runtime modules, ``spec.py``: its
:class:`ModuleFusionSpec`), and registers itself here.
"""

from .registry import available_fusions, get_fusion, register_fusion, unregister_fusion
from .spec import ModuleFusionSpec

__all__ = ["ModuleFusionSpec", "available_fusions", "get_fusion", "register_fusion", "unregister_fusion"]
