"""Fused projections: the ``qkv`` and ``gate_up`` fusion families, which share their runtime modules
(``modules.py``: :class:`FusedLinear`, :class:`ProjectionSlice`) and their spec (``spec.py``: one
:class:`FusedProjectionsSpec`, two tables of children to fuse)."""

from .modules import FusedLinear, ProjectionSlice, fuse_linears
from .spec import FusedProjectionsSpec, GateUpFusionSpec, QKVFusionSpec

__all__ = [
    "FusedLinear",
    "FusedProjectionsSpec",
    "GateUpFusionSpec",
    "ProjectionSlice",
    "QKVFusionSpec",
    "fuse_linears",
]
