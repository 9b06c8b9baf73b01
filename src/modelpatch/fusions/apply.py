"""Turn a ``fusion_config`` into what one load needs: a patch mapping, weight transforms and conversion filters.

Fusions are scoped to the load that asks for them: the mapping is one more patch layer of that load, never a
global registration, so a later load without the fusion builds stock classes.
"""

from __future__ import annotations

import copy
import inspect
import logging
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from ..conversion.transforms import WeightTransform
from ..errors import FusionError
from ..patching.mapping import PatchMapping
from ..state import is_runtime_layout, record_fusion_config, stored_fusion_config
from .registry import available_fusions, get_fusion
from .spec import ModuleFusionSpec

logger = logging.getLogger(__name__)

@dataclass
class PreparedFusions:
    """The fusions of one load."""

    config: dict[str, Any] = field(default_factory=dict)
    mapping: PatchMapping = field(default_factory=PatchMapping)
    transforms: list[WeightTransform] = field(default_factory=list)
    filters: tuple[re.Pattern[str], ...] = ()
    fused: dict[str, list[str]] = field(default_factory=dict)

    def adjust_conversions(self, conversions: Sequence[WeightTransform]) -> list[WeightTransform]:
        """Fusion transforms first, then ``conversions`` minus those the fused layout replaces."""
        kept = [
            t
            for t in conversions
            if not any(f.search(p) for f in self.filters for p in (*t.source_patterns, *t.target_patterns))
        ]
        return [*self.transforms, *kept]

    def record(self, model: PreTrainedModel) -> None:
        """Persist the fusion config on the model's config (``save_pretrained`` writes it to config.json)."""
        record_fusion_config(model.config, copy.deepcopy(self.config))


def normalize_fusion_config(fusion_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validate names and options; return ``{name: False | True | options dict}``."""
    if fusion_config is None:
        return {}
    if not isinstance(fusion_config, Mapping):
        raise FusionError(f"fusion_config must be a dict of fusion name -> True/False/options, got {fusion_config!r}.")
    normalized: dict[str, Any] = {}
    for name, value in fusion_config.items():
        if name not in available_fusions():
            raise FusionError(f"Unknown fusion {name!r}; available fusions: {', '.join(available_fusions())}.")
        if isinstance(value, bool):
            normalized[name] = value
        elif isinstance(value, Mapping):
            try:
                get_fusion(name).validate_options(value)
            except (TypeError, ValueError) as exc:
                raise FusionError(f"Invalid options for fusion {name!r}: {exc}") from None
            normalized[name] = dict(value)
        else:
            raise FusionError(f"fusion_config[{name!r}] must be True, False or an options dict, got {value!r}.")
    return normalized


def _enabled(normalized: Mapping[str, Any]) -> set[str]:
    return {name for name, value in normalized.items() if value is not False}


def _stored_fusions(config: PretrainedConfig) -> Any:
    """The fusion config stored with a checkpoint, minus fusions this process does not know when that is safe.

    A checkpoint in the original layout needs no fusion code to load (its tensors are the stock model's), so a
    fusion someone else registered under a name unknown here is skipped with a warning. A runtime-layout checkpoint
    holds that fusion's tensors and cannot be loaded without it: the error names it and how to make it available.
    """
    stored = stored_fusion_config(config)
    if not isinstance(stored, Mapping):
        return stored
    unknown = [name for name in stored if name not in available_fusions()]
    if not unknown:
        return stored
    if is_runtime_layout(config):
        raise FusionError(
            f"The checkpoint is stored in the runtime layout of fusion(s) {', '.join(map(repr, unknown))}, which this "
            "process does not have. Import the code that defines them and register them with "
            f"modelpatch.register_fusion(name, spec) before loading; available fusions: {', '.join(available_fusions())}."
        )
    logger.warning(
        "The checkpoint was saved with fusion(s) %s, which this process does not have; its tensors are in the original "
        "layout, so it loads without them.",
        ", ".join(map(repr, unknown)),
    )
    return {name: value for name, value in stored.items() if name not in unknown}


def spec_transforms(
    spec: ModuleFusionSpec, config: PretrainedConfig, modules: Mapping[str, nn.Module]
) -> list[WeightTransform]:
    """``spec.make_transforms`` for ``modules`` (unfused instances by name); specs written for the one-argument form
    of the hook get the config alone."""
    parameters = inspect.signature(spec.make_transforms).parameters
    return spec.make_transforms(config, modules) if len(parameters) >= 2 else spec.make_transforms(config)


def discover(
    model: nn.Module, specs: Mapping[str, ModuleFusionSpec]
) -> tuple[dict[str, type[nn.Module]], dict[str, dict[str, nn.Module]]]:
    """Map each fusable class of ``model`` (a meta-device instance) to its fused class, per spec."""
    by_class: dict[str, dict[type, list[tuple[str, nn.Module]]]] = {name: defaultdict(list) for name in specs}
    unfusable: dict[str, set[type]] = {name: set() for name in specs}
    compiled = {name: [re.compile(p) for p in spec.target_modules_patterns] for name, spec in specs.items()}
    for module_name, module in model.named_modules():
        for name, spec in specs.items():
            if compiled[name] and not any(p.search(module_name) for p in compiled[name]):
                continue
            if spec.is_fusable(module):
                by_class[name][type(module)].append((module_name, module))
            elif type(module) in by_class[name]:
                unfusable[name].add(type(module))
    mapping: dict[str, type[nn.Module]] = {}
    owner: dict[str, str] = {}
    modules: dict[str, dict[str, nn.Module]] = {name: {} for name in specs}
    for name, classes in by_class.items():
        for cls, instances in classes.items():
            if cls in unfusable[name]:
                logger.warning("Fusion %r skips %s: some of its instances are not fusable.", name, cls.__name__)
                continue
            if cls.__name__ in owner:
                raise FusionError(
                    f"Fusions {owner[cls.__name__]!r} and {name!r} both want to replace {cls.__name__}; enable one."
                )
            owner[cls.__name__] = name
            mapping[cls.__name__] = specs[name].make_fused_class(cls)
            modules[name].update(instances)
    return mapping, modules


def prepare_fusions(
    model_class: type[PreTrainedModel],
    config: PretrainedConfig,
    fusion_config: Mapping[str, Any] | None,
    base_layers: Sequence[PatchMapping],
) -> PreparedFusions:
    """Resolve ``fusion_config`` (explicit, else the one stored in ``config``) into a :class:`PreparedFusions`."""
    from ..loading.build import build_empty_model

    stored = _stored_fusions(config)
    normalized = normalize_fusion_config(fusion_config if fusion_config is not None else stored)
    if is_runtime_layout(config) and _enabled(normalized) != _enabled(normalize_fusion_config(stored)):
        raise FusionError(
            f"The checkpoint is stored in the runtime layout of fusions {sorted(_enabled(normalize_fusion_config(stored)))}"
            f"; it cannot be loaded with fusions {sorted(_enabled(normalized))}. Leave fusion_config unset to load it "
            "as stored, or write it back in the original layout first: `modelpatch convert SRC DST --fusion none`."
        )
    enabled = {name: get_fusion(name) for name, value in normalized.items() if value is not False}
    prepared = PreparedFusions(config=normalized)
    if not enabled:
        return prepared
    meta_model = build_empty_model(model_class, copy.deepcopy(config), torch.float32, base_layers)
    mapping, modules = discover(meta_model, enabled)
    for name, spec in enabled.items():
        if not modules[name]:
            logger.warning("Fusion %r found nothing to fuse in %s.", name, model_class.__name__)
            continue
        prepared.fused[name] = sorted(modules[name])
        prepared.transforms.extend(spec_transforms(spec, config, modules[name]))
        prepared.filters += tuple(re.compile(p) for p in spec.filtered_conversion_patterns)
    prepared.mapping = PatchMapping.from_items(mapping.items())
    return prepared
