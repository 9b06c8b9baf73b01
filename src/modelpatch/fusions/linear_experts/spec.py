"""``linear_experts``: transformers' fused 3-D experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) of
qwen2_moe, qwen3_moe, mixtral, olmoe, ... become :class:`LinearExperts`.

Per-expert child names follow the model type's published checkpoint (``gate_proj/up_proj/down_proj``, or
``w1/w3/w2`` for Mixtral), so checkpoint keys load without conversion and save back unchanged; the model type's
per-expert -> fused converters are dropped for the load.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ...conversion.registry import get_checkpoint_conversion_mapping
from ...conversion.transforms import WeightConverter
from ..generated import make_class
from ..spec import ModuleFusionSpec
from .modules import LinearExperts

_DEFAULT_NAMES = ("gate_proj", "up_proj", "down_proj")
_EXPERT_CHILD = re.compile(r"experts\.\*\.(\w+)\.weight$")


def expert_child_names(model_type: str | None) -> tuple[str, str, str]:
    """(gate, up, down) child names of one expert in ``model_type``'s checkpoints, read from its conversion mapping."""
    gate_up = down = None
    for transform in get_checkpoint_conversion_mapping(model_type or "") or []:
        if not isinstance(transform, WeightConverter):
            continue
        names = [m.group(1) for p in transform.source_patterns if (m := _EXPERT_CHILD.search(p))]
        if transform.target_patterns[0].endswith("experts.gate_up_proj") and len(names) == 2:
            gate_up = names
        elif transform.target_patterns[0].endswith("experts.down_proj") and len(names) == 1:
            down = names[0]
    return (gate_up[0], gate_up[1], down) if gate_up and down else _DEFAULT_NAMES


def _is_fused_experts(module: nn.Module) -> bool:
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, nn.Parameter)
        and isinstance(down, nn.Parameter)
        and gate_up.dim() == 3
        and down.dim() == 3
        and gate_up.shape[0] == down.shape[0]
        and gate_up.shape[1] == 2 * down.shape[2]
        and gate_up.shape[2] == down.shape[1]
        and getattr(module, "gate_up_proj_bias", None) is None
        and callable(getattr(module, "act_fn", None))
    )


class LinearExpertsFusionSpec(ModuleFusionSpec):
    filtered_conversion_patterns = (r"experts\.gate_up_proj$", r"experts\.down_proj$")

    def is_fusable(self, module: nn.Module) -> bool:
        return _is_fused_experts(module)

    def make_fused_class(self, original_cls: type[nn.Module]) -> type[nn.Module]:
        def __init__(self, config, *args, **kwargs):
            # Build the original without dispatch (it is the class being replaced) on meta to read its sizes.
            reference = object.__new__(original_cls)
            with torch.device("meta"):
                original_cls.__init__(reference, config, *args, **kwargs)
            experts, double_intermediate, hidden = reference.gate_up_proj.shape
            LinearExperts.__init__(
                self,
                experts,
                hidden,
                double_intermediate // 2,
                reference.act_fn,
                expert_child_names(getattr(config, "model_type", None)),
                device=None,
                dtype=reference.gate_up_proj.dtype,
            )

        return make_class("Linear", original_cls, {"__init__": __init__}, base=LinearExperts, spec=self)
