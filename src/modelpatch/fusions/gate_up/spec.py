"""``gate_up``: ``gate_proj``/``up_proj`` of gated MLPs (Llama, Mistral, Qwen2, Qwen2Moe's shared expert) -> one
``gate_up_proj`` Linear; also the other names of the two input projections of a gated MLP: ``w1``/``w3`` -> ``w13``,
T5's gated ``wi_0``/``wi_1`` -> ``wi``. The MLP's own forward runs unchanged (each name calls its rows)."""

from __future__ import annotations

from ..projections import FusedProjectionsSpec


class GateUpFusionSpec(FusedProjectionsSpec):
    groups = (
        (("gate_proj", "up_proj"), "gate_up_proj"),
        (("w1", "w3"), "w13"),
        (("wi_0", "wi_1"), "wi"),
    )
    prefix = "GateUpFused"
