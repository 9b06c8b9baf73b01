"""The ``gate_up`` fusion: one Linear for a gated MLP's gate and up projections."""

from .spec import GateUpFusionSpec

__all__ = ["GateUpFusionSpec"]
