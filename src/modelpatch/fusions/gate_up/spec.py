"""``gate_up``: ``gate_proj``/``up_proj`` of gated MLPs (Llama, Mistral, Qwen2, Qwen2Moe's shared expert) -> one
``gate_up_proj`` Linear."""

from __future__ import annotations

from ..projections import FusedProjectionsSpec


class GateUpFusionSpec(FusedProjectionsSpec):
    groups = ((("gate_proj", "up_proj"), "gate_up_proj"),)
    prefix = "GateUpFused"
