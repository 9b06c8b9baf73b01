"""``from_pretrained`` and ``from_config``: build a patched model and fill it from a local checkpoint.

Data flow of a load:

1. read ``config.json`` and resolve the concrete class (an Auto class is resolved from the config);
2. collect the patch layers (Patcher mapping, fusions, the global registry) and the weight transforms (the model
   type's mapping adjusted by the Patcher, plus fusion transforms);
3. build the model on the meta device under those patches;
4. read the safetensors *headers* and plan: every parameter's source keys and bound operations; validate coverage,
   shapes and dtypes, raising one error naming every offending key before any tensor data is read;
5. execute the plan (zero-copy for unconverted tensors), then let transformers initialise non-persistent buffers and
   requested new parameters and tie weights exactly as stock does;
6. attach a :class:`LoadReport` to the model (it is what ``save_pretrained`` reverses).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel

from ..checkpoint import Checkpoint
from ..conversion.planner import TensorMeta
from ..conversion.registry import get_checkpoint_conversion_mapping
from ..conversion.transforms import WeightTransform
from ..errors import CheckpointError
from ..fusions.apply import PreparedFusions, prepare_fusions
from ..patching import registry
from ..patching.mapping import PatchMapping
from ..patching.patcher import Patcher
from ..patching.scope import PatchScope
from .build import build_empty_model_patched, build_initialized_model, model_state_lock
from .config import RUNTIME_LAYOUT_ATTRIBUTE, checkpoint_directory, load_config, resolve_dtype, resolve_model_class
from .materialize import load_into_model
from .plan import LoadPlan, UnexpectedKeys, plan_model_load
from .report import REPORT_ATTRIBUTE, LoadReport

logger = logging.getLogger(__name__)

FusionConfig = Mapping[str, bool | Mapping[str, Any]]

# Set by from_config on the model: the weight transforms of its build (a loaded model has them in its LoadReport).
TRANSFORMS_ATTRIBUTE = "_modelpatch_transforms"


def model_conversions(model: PreTrainedModel) -> list[WeightTransform]:
    """The registered transforms of ``model``'s type and of its nested sub-models' types, in that order."""
    transforms: list[WeightTransform] = []
    seen: set[str] = set()
    for module in model.modules():
        model_type = getattr(getattr(module, "config", None), "model_type", None)
        if isinstance(module, PreTrainedModel) and model_type and model_type not in seen:
            seen.add(model_type)
            transforms.extend(get_checkpoint_conversion_mapping(model_type) or [])
    return transforms


def _check_patcher(patcher: Patcher | None) -> None:
    if patcher is not None and not isinstance(patcher, Patcher):
        raise TypeError(f"patcher must be a modelpatch.Patcher, got {patcher!r}.")


def _load_setup(
    model_class: type[PreTrainedModel], config: PretrainedConfig, patcher: Patcher | None, fusion_config: FusionConfig | None
):
    """Patch layers (highest priority first) and the fusion transforms of one load."""
    base_layers = [patcher.mapping] if patcher is not None else []
    base_layers.append(registry.snapshot())
    fusions = prepare_fusions(model_class, config, fusion_config, base_layers, patcher)
    return [*base_layers[:-1], fusions.mapping, base_layers[-1]], fusions


def _check_patches(
    model_class: type, scope: PatchScope, patcher: Patcher | None, registry_layer: PatchMapping
) -> dict[str, tuple[str, str]]:
    """Warn about every Patcher or registry key that matched no class the build made; return what was replaced.

    A key that matches nothing is most often a typo or a pattern written for another architecture: the load is
    stock where the user expected a patch, so it must not pass in silence.
    """
    sources = [("the Patcher", patcher.mapping)] if patcher is not None else []
    sources.append(("the global patch registry", registry_layer))
    for source, layer in sources:
        for key in layer.unmatched_keys(scope.matched):
            logger.warning(
                "Patch key %r of %s matched no class built by this load of %s; nothing was replaced for it.",
                key,
                source,
                model_class.__name__,
            )
    return {
        name: (key, f"{replacement.__module__}.{replacement.__qualname__}")
        for name, (key, replacement) in sorted(scope.replaced.items())
    }


def _conversions(model: PreTrainedModel, patcher: Patcher | None, fusions: PreparedFusions) -> list[WeightTransform]:
    transforms = fusions.adjust_conversions(model_conversions(model))
    return patcher.adjust_conversions(transforms) if patcher is not None else transforms


@dataclass
class PlannedLoad:
    """A load planned from headers alone: the meta-device model and where each of its parameters comes from."""

    directory: Path
    model: PreTrainedModel
    plan: LoadPlan
    checkpoint: dict[str, TensorMeta]
    transforms: list[WeightTransform]
    fusions: PreparedFusions
    runtime_layout: bool
    replaced: dict[str, tuple[str, str]]


def _plan(
    model_class: type,
    config: PretrainedConfig,
    checkpoint: Checkpoint,
    patcher: Patcher | None,
    fusion_config: FusionConfig | None,
    dtype: torch.dtype | str | None,
    *,
    new_parameters: Sequence[str],
    unexpected_keys: UnexpectedKeys,
) -> PlannedLoad:
    _check_patcher(patcher)
    if unexpected_keys not in ("warn", "error", "ignore"):
        raise ValueError(f"unexpected_keys must be 'warn', 'error' or 'ignore', got {unexpected_keys!r}.")
    directory = checkpoint.directory
    config = copy.deepcopy(config)
    concrete = resolve_model_class(model_class, config)
    config.name_or_path = str(directory)
    layers, fusions = _load_setup(concrete, config, patcher, fusion_config)
    metas = {key: TensorMeta(checkpoint.info(key).shape, checkpoint.info(key).dtype) for key in checkpoint.keys()}
    # Stock 5.x from_pretrained defaults to "auto" and records the dtype on the config and its sub-configs.
    resolved_dtype = resolve_dtype("auto" if dtype is None else dtype, config, (m.dtype for m in metas.values()))
    _set_config_dtype(config, resolved_dtype)
    model, scope = build_empty_model_patched(concrete, config, resolved_dtype, layers)
    replaced = _check_patches(concrete, scope, patcher, layers[-1])
    transforms = _conversions(model, patcher, fusions)
    runtime_layout = bool(getattr(config, RUNTIME_LAYOUT_ATTRIBUTE, False))
    plan = plan_model_load(
        model,
        metas,
        [] if runtime_layout else transforms,
        new_parameters=new_parameters,
        unexpected_keys=unexpected_keys,
    )
    return PlannedLoad(directory, model, plan, metas, transforms, fusions, runtime_layout, replaced)


def plan_pretrained(
    model_class: type,
    path: str | Path,
    *,
    patcher: Patcher | None = None,
    fusion_config: FusionConfig | None = None,
    dtype: torch.dtype | str | None = None,
    new_parameters: Sequence[str] = (),
    allow_pickle: bool = False,
) -> PlannedLoad:
    """Plan :func:`from_pretrained` without reading any tensor data: the meta-device model and its :class:`LoadPlan`.

    Raises the same errors as :func:`from_pretrained` would before loading (``LoadPlanError`` naming every key).
    """
    directory = checkpoint_directory(path)
    config = load_config(directory)
    with Checkpoint.open(directory, allow_pickle=allow_pickle) as checkpoint:
        return _plan(
            model_class, config, checkpoint, patcher, fusion_config, dtype, new_parameters=new_parameters, unexpected_keys="ignore"
        )


def from_pretrained(
    model_class: type,
    path: str | Path,
    *,
    patcher: Patcher | None = None,
    fusion_config: FusionConfig | None = None,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    device_map: str | Mapping[str, Any] | None = None,
    max_memory: Mapping[Any, Any] | None = None,
    offload_folder: str | Path | None = None,
    new_parameters: Sequence[str] = (),
    unexpected_keys: UnexpectedKeys = "warn",
    allow_pickle: bool = False,
) -> PreTrainedModel:
    """Load a local checkpoint into ``model_class`` with patches, fusions and weight conversions applied.

    Args:
        model_class: An Auto class (``AutoModelForCausalLM``) or a concrete ``PreTrainedModel`` subclass.
        path: A local checkpoint directory (``config.json`` + safetensors files). Hubs are never contacted.
        patcher: Class replacements and conversion adjustments for this load only.
        fusion_config: ``{fusion name: True / False / options}``; defaults to the one stored in the config.
        dtype: Like transformers 5: ``"auto"`` (the config's dtype, else the checkpoint's; what None means, as in
            stock ``from_pretrained``) or a ``torch.dtype`` (or its name).
        device: Where parameters go (default CPU). Unconverted CPU tensors stay memory-mapped (zero-copy).
        device_map: Spread the model over several devices with accelerate: ``"auto"`` (fit ``max_memory``) or
            ``{module name: device}``; ``"disk"`` entries are offloaded to ``offload_folder``.
        max_memory: ``{device: bytes or "10GiB"}`` limits for ``device_map="auto"``.
        offload_folder: Where weights offloaded to ``"disk"`` are written.
        new_parameters: Regex patterns of parameters that may be absent from the checkpoint; they are initialised
            as stock transformers initialises them (a fresh task head, say). Any other absent parameter is an error.
        unexpected_keys: What to do with checkpoint keys the model has no place for: "warn", "error" or "ignore".
        allow_pickle: Accept ``pytorch_model.bin`` checkpoints, read with ``torch.load(weights_only=True)``.

    Raises:
        CheckpointError: ``path`` is not a local checkpoint directory, or a file in it is malformed.
        LoadPlanError: The checkpoint does not cover the model (every offending key is named); nothing is loaded.
    """
    if device is not None and device_map is not None:
        raise ValueError("Pass either device or device_map, not both.")
    target_device = torch.device(device) if device is not None else torch.device("cpu")
    directory = checkpoint_directory(path)
    config = load_config(directory)
    generation_config = _load_generation_config(directory)
    with Checkpoint.open(directory, allow_pickle=allow_pickle) as checkpoint:
        planned = _plan(
            model_class, config, checkpoint, patcher, fusion_config, dtype, new_parameters=new_parameters, unexpected_keys=unexpected_keys
        )
        model, plan, metas = planned.model, planned.plan, planned.checkpoint
        runtime_layout, transforms, fusions = planned.runtime_layout, planned.transforms, planned.fusions
        # Safetensors tensors (byte range known) are views of a private file mapping; pickle ones are not.
        load_into_model(
            model,
            plan,
            checkpoint.tensor,
            target_device,
            checkpoint.total_bytes,
            file_mapped=lambda key: checkpoint.info(key).start >= 0,
        )

    _finalize(model, plan.expected.keys() - set(plan.loaded_keys()), target_device)
    fusions.record(model)
    if generation_config is not None and model.can_generate():
        model.generation_config = generation_config

    report = LoadReport(
        source=directory,
        checkpoint_keys=tuple(metas),
        direct={k: v for k, v in plan.conversion.direct.items() if k in plan.expected},
        groups=tuple(plan.conversion.groups),
        transforms=tuple(transforms if runtime_layout else plan.transforms),
        new_parameters=tuple(plan.new_parameters),
        dropped=tuple(plan.dropped),
        unexpected=tuple(plan.unexpected),
        tied=dict(plan.tied),
        runtime_layout=runtime_layout,
        replaced=planned.replaced,
    )
    setattr(model, REPORT_ATTRIBUTE, report)
    logger.info("%s", report.summary())
    if device_map is not None:
        from .dispatch import dispatch

        model = dispatch(model, device_map, max_memory=max_memory, offload_folder=offload_folder)
    return model


def _set_config_dtype(config: PretrainedConfig, dtype: torch.dtype) -> None:
    config.dtype = dtype
    for name in getattr(config, "sub_configs", {}) or {}:
        if (sub_config := getattr(config, name, None)) is not None:
            sub_config.dtype = dtype


def _load_generation_config(directory: Path) -> GenerationConfig | None:
    """``generation_config.json`` if the checkpoint has one; read before any weight so a broken one costs nothing."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return None
    try:
        return GenerationConfig.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{path} is not a valid generation config: {exc}") from None


def _finalize(model: PreTrainedModel, missing: set[str], device: torch.device) -> None:
    """Non-persistent buffers, requested new parameters and tied weights, the way stock transformers does them.

    ``missing`` holds every parameter the checkpoint did not fill: new parameters and tied ones.
    """
    with model_state_lock:
        for key in getattr(model, "all_tied_weights_keys", {}) or {}:
            model.get_parameter(key)._is_hf_initialized = True
        model._move_missing_keys_from_meta_to_device(missing, {"": device}, None, None)
        model._initialize_missing_keys(is_quantized=False)
        model.tie_weights(missing_keys=missing, recompute_mapping=False)
        model.eval()


def from_config(
    model_class: type,
    config: PretrainedConfig,
    *,
    patcher: Patcher | None = None,
    fusion_config: FusionConfig | None = None,
    dtype: torch.dtype | str | None = None,
) -> PreTrainedModel:
    """Build a freshly initialised model from ``config`` with patches and fusions applied (no weights read).

    Args mirror :func:`from_pretrained`; ``model_class`` may be an Auto class.
    """
    _check_patcher(patcher)
    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"config must be a transformers PretrainedConfig, got {config!r}.")
    concrete = resolve_model_class(model_class, config)
    config = copy.deepcopy(config)
    layers, fusions = _load_setup(concrete, config, patcher, fusion_config)
    model, scope = build_initialized_model(concrete, config, None if dtype is None else resolve_dtype(dtype, config), layers)
    _check_patches(concrete, scope, patcher, layers[-1])
    fusions.record(model)
    # What save_pretrained runs backwards to write this never-loaded model in the checkpoint layout: the model
    # type's mapping as adjusted by this build's Patcher and fusions.
    setattr(model, TRANSFORMS_ATTRIBUTE, tuple(_conversions(model, patcher, fusions)))
    return model
