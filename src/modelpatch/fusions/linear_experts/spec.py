"""``linear_experts``: transformers' fused 3-D experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) of
qwen2_moe, qwen3_moe, mixtral, olmoe, ... become :class:`LinearExperts`.

Per-expert child names follow the model type's published checkpoint (``gate_proj/up_proj/down_proj``, or
``w1/w3/w2`` for Mixtral), so per-expert checkpoint keys load without conversion and save back unchanged; the model
type's per-expert -> fused converters are dropped for the load.

Some checkpoints store the experts fused, as 3-D ``experts.gate_up_proj`` / ``experts.down_proj`` keys (Qwen3.5-MoE
as published, anything stock transformers saved with ``save_original_format=False``). The spec's transforms split
those into the per-expert keys; the load records the split, so a default save writes the 3-D keys back bitwise.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import cast

import torch
from torch import nn
from transformers import PretrainedConfig

from ...conversion.operations import Chunk, SplitModulelist
from ...conversion.transforms import WeightConverter, WeightTransform
from ..generated import make_class
from ..spec import FusionOptions, ModuleFusionSpec
from .modules import LinearExperts

DEFAULT_CHILD_NAMES = ("gate_proj", "up_proj", "down_proj")

# (gate, up, down) child names of one expert in the published checkpoints of the model types that do not use
# DEFAULT_CHILD_NAMES (transformers 5.23's per-expert -> fused conversions name the same ones).
EXPERT_CHILD_NAMES: Mapping[str, tuple[str, str, str]] = MappingProxyType(
    {
        **dict.fromkeys(
            (
                "deepseek_v4",
                "kimi_linear",
                "lfm2_moe",
                "minimax",
                "minimax_m2",
                "minimax_m3_vl",
                "mistral_large4_text",
                "mixtral",
                "phimoe",
            ),
            ("w1", "w3", "w2"),
        ),
        "dots3_note_vision_encoder": ("fc1", "fc3", "fc2"),
    }
)


@dataclasses.dataclass(frozen=True)
class LinearExpertsOptions(FusionOptions):
    """Options of ``fusion_config={"linear_experts": {...}}``.

    Attributes:
        child_names: ``(gate, up, down)`` names of each expert's Linears, for checkpoints that name them otherwise
            than :data:`EXPERT_CHILD_NAMES` says for their model type (default: that table).
    """

    child_names: tuple[str, str, str] | None = None

    def __post_init__(self) -> None:
        names = self.child_names
        if names is None:
            return
        if isinstance(names, str) or not isinstance(names, (list, tuple)):
            raise TypeError(f"child_names must be three names (gate, up, down), got {names!r}.")
        given = tuple(names)
        if len(given) != 3 or not all(isinstance(n, str) and n.isidentifier() for n in given) or len(set(given)) != 3:
            raise ValueError(f"child_names must be three distinct identifiers (gate, up, down), got {given!r}.")
        # A JSON list (from a stored config) and a tuple are the same option.
        object.__setattr__(self, "child_names", given)


def expert_child_names(model_type: str | None) -> tuple[str, str, str]:
    """(gate, up, down) child names of one expert in ``model_type``'s checkpoints."""
    return EXPERT_CHILD_NAMES.get(model_type or "", DEFAULT_CHILD_NAMES)


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
    options_class = LinearExpertsOptions

    def child_names(self, model_type: str | None) -> tuple[str, str, str]:
        """The experts' child names: the ``child_names`` option, else the model type's entry of the table."""
        options = self.options
        if isinstance(options, LinearExpertsOptions) and options.child_names is not None:
            return options.child_names
        return expert_child_names(model_type)

    def is_fusable(self, module: nn.Module) -> bool:
        return _is_fused_experts(module)

    def make_transforms(self, config: PretrainedConfig, modules: Mapping[str, nn.Module]) -> list[WeightTransform]:
        """3-D expert keys -> per-expert keys: ``<experts>.gate_up_proj [E, 2I, H]`` is chunked into its gate rows
        (the first half, as transformers' experts read them) and up rows and split per expert; ``<experts>.down_proj
        [E, H, I]`` is split per expert.

        Per-expert keys match none of these patterns, so per-expert checkpoints load unchanged. The converters are
        ``alternative``: a model with nothing recorded (``from_config``) still saves per expert, the published layout.
        Patterns are anchored on the experts' attribute name at a key segment boundary and at the key's end, so
        ``shared_experts.*`` or ``gate_up_proj_bias`` / ``_scale_inv`` keys never match.
        """
        # The experts are built with the text config, which is what the fused class reads its child names from.
        gate, up, down = self.child_names(config.get_text_config().model_type)
        counts: dict[str, set[int]] = defaultdict(set)
        for name, module in modules.items():
            # nn.Module annotates attributes as Tensor | Module: the stock experts' gate_up_proj is a 3-D parameter.
            counts[name.rpartition(".")[2]].add(cast(torch.Tensor, module.gate_up_proj).shape[0])
        transforms: list[WeightTransform] = []
        for anchor, found in sorted(counts.items()):
            # The number of experts is declared (always one per model in transformers), so a 3-D tensor holding more
            # experts is a plan error rather than unused per-expert keys; the model's shapes catch any other misfit.
            split = SplitModulelist(dim=0, count=found.pop() if len(found) == 1 else None)
            experts = rf"(?<![^.]){re.escape(anchor)}"
            transforms += [
                WeightConverter(
                    rf"{experts}\.gate_up_proj$",
                    [f"{anchor}.*.{gate}.weight", f"{anchor}.*.{up}.weight"],
                    [Chunk(dim=1), split],
                    alternative=True,
                ),
                WeightConverter(rf"{experts}\.down_proj$", f"{anchor}.*.{down}.weight", [split], alternative=True),
            ]
        return transforms

    def finish_module(self, module: nn.Module) -> None:
        """Lay the loaded experts' weights out for the grouped forward (:meth:`LinearExperts.pack`), releasing the
        checkpoint pages they were read from."""
        # Called on fused modules only, whose class derives from LinearExperts (see make_fused_class), once they hold
        # the tensors just loaded or converted, which nothing else references yet.
        cast(LinearExperts, module).pack(release_sources=True)

    def make_fused_class(self, original_cls: type[nn.Module]) -> type[nn.Module]:
        spec = self

        def __init__(self, config, *args, **kwargs):
            # Build the original without dispatch (it is the class being replaced) on meta to read its sizes.
            reference = object.__new__(original_cls)
            with torch.device("meta"):
                original_cls.__init__(reference, config, *args, **kwargs)
            gate_up_proj = cast(torch.Tensor, reference.gate_up_proj)  # a 3-D parameter (see make_transforms)
            experts, double_intermediate, hidden = gate_up_proj.shape
            LinearExperts.__init__(
                self,
                experts,
                hidden,
                double_intermediate // 2,
                cast(Callable[[torch.Tensor], torch.Tensor], reference.act_fn),
                spec.child_names(getattr(config, "model_type", None)),
                device=None,
                dtype=gate_up_proj.dtype,
            )

        return make_class("Linear", original_cls, {"__init__": __init__}, base=LinearExperts, spec=self)
