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
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel

from ..checkpoint import Checkpoint
from ..checkpoint.json_file import MAX_CONFIG_BYTES, read_json
from ..conversion.planner import TensorMeta
from ..conversion.registry import model_conversions
from ..conversion.transforms import WeightTransform
from ..errors import CheckpointError, ModelPatchError
from ..fusions.apply import PreparedFusions, prepare_fusions
from ..patching import registry
from ..patching.mapping import PatchMapping, is_exact_key
from ..patching.patcher import Patcher
from ..state import (
    BASE_TRANSFORMS_ATTRIBUTE,
    EXPECTED_STATE_ATTRIBUTE,
    REPORT_ATTRIBUTE,
    TRANSFORMS_ATTRIBUTE,
    is_runtime_layout,
)
from .build import build_empty_model, build_initialized_model, config_build_errors, keep_in_fp32, model_state_lock
from .config import checkpoint_directory, load_config, resolve_dtype, resolve_model_class
from .diagnose import Replacement
from .materialize import load_into_model
from .plan import LoadPlan, UnexpectedKeys, model_expectations, plan_model_load
from .quantization import Quantization, load_quantization
from .report import LoadReport
from .save import install_original_format_save

logger = logging.getLogger(__name__)

FusionConfig = Mapping[str, bool | Mapping[str, Any]]

def _check_patterns(new_parameters: Sequence[str]) -> None:
    # A bare string would be taken letter by letter: every parameter containing an "e" would be allowed to be new.
    if isinstance(new_parameters, str) or not all(isinstance(p, str) for p in new_parameters):
        raise TypeError(f"new_parameters must be a list of regex patterns, got {new_parameters!r}.")
    for pattern in new_parameters:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"new_parameters entry {pattern!r} is not a valid regular expression: {exc}.") from None


def _check_patcher(patcher: Patcher | None) -> None:
    if patcher is not None and not isinstance(patcher, Patcher):
        raise TypeError(f"patcher must be a modelpatch.Patcher, got {patcher!r}.")


def _load_setup(
    model_class: type[PreTrainedModel], config: PretrainedConfig, patcher: Patcher | None, fusion_config: FusionConfig | None
):
    """Patch layers (highest priority first) and the fusion transforms of one load."""
    base_layers = [patcher.mapping] if patcher is not None else []
    base_layers.append(registry.snapshot())
    fusions = prepare_fusions(model_class, config, fusion_config, base_layers)
    return [*base_layers[:-1], fusions.mapping, base_layers[-1]], fusions


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
    quantization: Quantization | None = None


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
    quantization_config: Any = None,
    device_map: Any = None,
) -> PlannedLoad:
    _check_patcher(patcher)
    if unexpected_keys not in ("warn", "error", "ignore"):
        raise ValueError(f"unexpected_keys must be 'warn', 'error' or 'ignore', got {unexpected_keys!r}.")
    _check_patterns(new_parameters)
    directory = checkpoint.directory
    config = copy.deepcopy(config)
    # An unsupported quantization method is refused by name here, before anything is built or read.
    quantization = load_quantization(config, quantization_config, device_map=device_map)
    concrete = resolve_model_class(model_class, config)
    config.name_or_path = str(directory)
    metas = {key: TensorMeta(checkpoint.info(key).shape, checkpoint.info(key).dtype) for key in checkpoint.keys()}
    # Stock 5.x from_pretrained defaults to "auto" and records the dtype on the config and its sub-configs.
    resolved_dtype = resolve_dtype("auto" if dtype is None else dtype, config, (m.dtype for m in metas.values()))
    if quantization is not None:
        resolved_dtype = quantization.update_dtype(resolved_dtype)
    _set_config_dtype(config, resolved_dtype)
    try:
        layers, fusions = _load_setup(concrete, config, patcher, fusion_config)
        prepare = (
            None
            if quantization is None
            else lambda m: quantization.preprocess(m, dtype=resolved_dtype, checkpoint_files=checkpoint.files)
        )
        model = build_empty_model(concrete, config, resolved_dtype, layers, prepare)
    except Exception as exc:
        if not isinstance(exc, ModelPatchError):
            # The config's fault if the stock model cannot be built either; otherwise a replacement's, raised as is.
            with config_build_errors(directory / "config.json", concrete):
                build_empty_model(concrete, copy.deepcopy(config), resolved_dtype, [])
        raise
    keep_in_fp32(model, resolved_dtype)
    transforms = _conversions(model, patcher, fusions)
    runtime_layout = is_runtime_layout(config)
    # A quantized checkpoint's tensors first become the parameters they make up (stage one, quantization.py).
    parameters = metas
    if quantization is not None:
        parameters = quantization.plan_checkpoint(model, metas, resolved_dtype)
        quantization.check_conversions([] if runtime_layout else transforms)
    plan = plan_model_load(
        model,
        parameters,
        [] if runtime_layout else transforms,
        new_parameters=new_parameters,
        unexpected_keys=unexpected_keys,
        # Explaining missing keys by the classes the patches replaced needs a stock build: only on error.
        replacements=(lambda: _replacements(model, concrete, config, resolved_dtype, layers, fusions))
        if any(layers)
        else None,
        quantized=quantization is not None,
    )
    return PlannedLoad(directory, model, plan, metas, transforms, fusions, runtime_layout, quantization)


def _replacements(
    model: PreTrainedModel,
    concrete: type[PreTrainedModel],
    config: PretrainedConfig,
    dtype: torch.dtype,
    layers: Sequence[PatchMapping],
    fusions: PreparedFusions,
) -> list[Replacement]:
    """The outermost modules of ``model`` whose class differs from a stock build's, and the layer responsible.

    Builds the stock model on the meta device: only called to explain a failed plan.
    """
    stock = {name: type(m) for name, m in build_empty_model(concrete, copy.deepcopy(config), dtype, []).named_modules()}
    found: list[Replacement] = []
    for name, module in model.named_modules():
        original = stock.get(name)
        if original is None or type(module) is original or any(name.startswith(r.path + ".") for r in found):
            continue
        # The first layer that maps the class is the one the dispatcher used; none: a scope around the load.
        layer = next((layer for layer in layers if layer.lookup(original.__name__) is type(module)), None)
        patch_key = fusion = None
        if layer is fusions.mapping:
            fusion = next((f for f, paths in fusions.fused.items() if name in paths), ", ".join(fusions.fused))
        elif layer is not None:
            patch_key = _patch_key(layer, original.__name__)
        found.append(Replacement(name, original.__name__, type(module).__name__, patch_key, fusion))
    return found


def _patch_key(mapping: PatchMapping, class_name: str) -> str:
    """The key of ``mapping`` that :meth:`PatchMapping.lookup` matched for ``class_name``: exact name, else pattern."""
    if class_name in mapping.entries:
        return class_name
    return next(key for key in mapping.entries if not is_exact_key(key) and re.search(key, class_name))


def plan_pretrained(
    model_class: type,
    path: str | Path,
    *,
    patcher: Patcher | None = None,
    fusion_config: FusionConfig | None = None,
    dtype: torch.dtype | str | None = None,
    new_parameters: Sequence[str] = (),
    allow_pickle: bool = False,
    quantization_config: Any = None,
) -> PlannedLoad:
    """Plan :func:`from_pretrained` without reading any tensor data: the meta-device model and its :class:`LoadPlan`.

    Raises the same errors as :func:`from_pretrained` would before loading (``LoadPlanError`` naming every key).
    """
    directory = checkpoint_directory(path)
    config = load_config(directory)
    with Checkpoint.open(directory, allow_pickle=allow_pickle) as checkpoint:
        return _plan(
            model_class, config, checkpoint, patcher, fusion_config, dtype, new_parameters=new_parameters,
            unexpected_keys="ignore", quantization_config=quantization_config,
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
    quantization_config: Any = None,
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
        quantization_config: Quantize at load like stock (a transformers ``TorchAoConfig``), or loading options of a
            quantized checkpoint. Quantized checkpoints (``quantization_config`` in config.json) need nothing: fp8,
            torchao and compressed-tensors load as stock loads them; other methods are refused by name.

    Raises:
        CheckpointError: ``path`` is not a local checkpoint directory, or a file in it is malformed.
        LoadPlanError: The checkpoint does not cover the model (every offending key is named); nothing is loaded.
    """
    if device is not None and device_map is not None:
        raise ValueError("Pass either device or device_map, not both.")
    try:
        target_device = torch.device(device) if device is not None else torch.device("cpu")
    except RuntimeError as exc:  # torch's error for an unknown device string
        raise ValueError(f"device {device!r} is not a torch device: {exc}") from None
    directory = checkpoint_directory(path)
    config = load_config(directory)
    generation_config = _load_generation_config(directory)
    with Checkpoint.open(directory, allow_pickle=allow_pickle) as checkpoint:
        planned = _plan(
            model_class, config, checkpoint, patcher, fusion_config, dtype, new_parameters=new_parameters,
            unexpected_keys=unexpected_keys, quantization_config=quantization_config, device_map=device_map,
        )
        model, plan, metas = planned.model, planned.plan, planned.checkpoint
        runtime_layout, transforms, fusions = planned.runtime_layout, planned.transforms, planned.fusions
        # Safetensors tensors (byte range known) are views of a private file mapping; pickle ones are not.
        fetch, file_mapped = checkpoint.tensor, lambda key: checkpoint.info(key).start >= 0
        if planned.quantization is not None:
            fetch, file_mapped = planned.quantization.fetch(fetch, file_mapped)
        load_into_model(model, plan, fetch, target_device, checkpoint.total_bytes, file_mapped=file_mapped)
        # A file rewritten in place while its tensors were being read may have given data of two versions.
        checkpoint.check_unchanged()

    if planned.quantization is not None:
        planned.quantization.quantize_loaded(model, plan.loaded_keys())
    _finalize(model, plan.expected.keys() - set(plan.loaded_keys()), target_device)
    if planned.quantization is not None:
        planned.quantization.finish(model)
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
        ignored=tuple(plan.ignored),
        unexpected=tuple(plan.unexpected),
        tied=dict(plan.tied),
        runtime_layout=runtime_layout,
    )
    setattr(model, REPORT_ATTRIBUTE, report)
    _record_build(model, plan.expected, _conversions(model, patcher, PreparedFusions()))
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
    read_json(path, MAX_CONFIG_BYTES)  # bounded, before transformers reads it
    try:
        return GenerationConfig.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # transformers' validation raises many types
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
    model = build_initialized_model(concrete, config, None if dtype is None else resolve_dtype(dtype, config), layers)
    fusions.record(model)
    # What save_pretrained runs backwards to write this never-loaded model in the checkpoint layout: the model
    # type's mapping as adjusted by this build's Patcher and fusions.
    setattr(model, TRANSFORMS_ATTRIBUTE, tuple(_conversions(model, patcher, fusions)))
    _record_build(model, model_expectations(model), _conversions(model, patcher, PreparedFusions()))
    return model


def _record_build(
    model: PreTrainedModel, expected: Mapping[str, TensorMeta], base_transforms: Sequence[WeightTransform]
) -> None:
    """What every save of ``model`` relies on: the state as built, the transforms without fusions (what
    :func:`modelpatch.unfuse` goes back to), and the stock save method writing the original layout (so Trainer
    checkpoints and ``model.save_pretrained`` give stock-loadable directories)."""
    object.__setattr__(model, EXPECTED_STATE_ATTRIBUTE, dict(expected))
    object.__setattr__(model, BASE_TRANSFORMS_ATTRIBUTE, tuple(base_transforms))
    install_original_format_save(model)
