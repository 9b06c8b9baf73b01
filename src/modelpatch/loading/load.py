"""``from_pretrained`` and ``from_config``: build a patched model and fill it from a checkpoint.

Data flow of a load:

1. find the checkpoint (a local directory, or a hub repository resolved into the local cache by ``hub.py``), read
   ``config.json`` and resolve the concrete class (an Auto class is resolved from the config);
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
import dataclasses
import functools
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, overload

import torch
from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel

from .._transformers import initialize_missing, set_attention_implementation, set_experts_implementation
from .._transformers_mapping import model_conversions
from ..checkpoint import Checkpoint
from ..checkpoint.json_file import MAX_CONFIG_BYTES, read_json
from ..checkpoint.prefetch import prefetching
from ..conversion.planner import TensorMeta
from ..conversion.transforms import WeightTransform
from ..errors import CheckpointError, FusionError, LoadPlanError, ModelPatchError
from ..fusions.apply import PreparedFusions, has_enabled_fusions, prepare_fusions, resolve_fusion_config
from ..fusions.generated import finish_fused_modules
from ..patching import registry
from ..patching.mapping import PatchMapping
from ..patching.patcher import Patcher
from ..patching.scope import PatchScope
from ..state import (
    ensure_model_record,
    is_runtime_layout,
    record_report,
)
from .build import (
    build_empty_model,
    build_empty_model_patched,
    build_initialized_model,
    check_layer_count,
    config_build_errors,
    keep_in_fp32,
    model_state_lock,
)
from .config import load_config, resolve_dtype, resolve_model_class
from .diagnose import Replacement
from .dispatch import Dispatch, single_device
from .hub import HubOptions, resolve_checkpoint
from .keywords import config_overrides
from .materialize import load_into_model
from .options import FusionConfig, LoadOptions, UnexpectedKeys
from .parallel import distributed_config_of
from .parallel import prepare as prepare_tensor_parallel
from .plan import LoadPlan, model_expectations, plan_model_load
from .quantization import load_quantization
from .report import LoadReport
from .state_dict import install_state_dict_boundary

logger = logging.getLogger(__name__)

# modelpatch exports this name for what plan_pretrained returns; it is now the one plan type of the loading layer.
PlannedLoad = LoadPlan


@dataclass(frozen=True)
class _Layers:
    """The patch layers of one load. Priority, highest first: the Patcher's mapping, the fusions', the registry
    snapshot (a class a fusion replaces that the others patch too was refused by :func:`prepare_fusions`)."""

    patcher: PatchMapping | None
    fusions: PatchMapping
    registry: PatchMapping

    def without_fusions(self) -> list[PatchMapping]:
        return [self.registry] if self.patcher is None else [self.patcher, self.registry]

    def ordered(self) -> list[PatchMapping]:
        return [self.fusions, self.registry] if self.patcher is None else [self.patcher, self.fusions, self.registry]


@dataclass
class _Setup:
    """What a load builds its model under, and the build fusion discovery ran on (None when no fusion is enabled):
    the model on the meta device under the layers without fusions, with the scope of that build."""

    layers: _Layers
    fusions: PreparedFusions
    unfused: tuple[PreTrainedModel, PatchScope] | None


def _load_setup(
    model_class: type[PreTrainedModel],
    config: PretrainedConfig,
    options: LoadOptions,
    dtype: torch.dtype,
) -> _Setup:
    """Patch layers and fusions of one load, built in ``dtype`` (resolved from ``options.dtype``).

    Fusion discovery needs the model as built without fusions: with a fusion enabled, that build is made here once
    (from a copy of ``config``, which a model's ``__init__`` may change) and handed to discovery; a load that then has
    nothing to fuse uses it as its model.
    """
    patcher = options.patcher
    layers = _Layers(patcher.mapping if patcher is not None else None, PatchMapping(), registry.snapshot())
    normalized = resolve_fusion_config(config, options.fusion_config)
    if not has_enabled_fusions(normalized):
        return _Setup(layers, PreparedFusions(config=normalized), None)
    unfused = build_empty_model_patched(model_class, copy.deepcopy(config), dtype, layers.without_fusions())
    fusions = prepare_fusions(unfused[0], config, normalized, layers.without_fusions(), patcher)
    return _Setup(_Layers(layers.patcher, fusions.mapping, layers.registry), fusions, unfused)


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


class _FusionsStepAside(Exception):
    """The load's fusions do not apply to this model and checkpoint as discovery found them (why: the message)."""


def _plan(
    model_class: type,
    name_or_path: str | os.PathLike[str],
    config: PretrainedConfig,
    checkpoint: Checkpoint,
    options: LoadOptions,
) -> LoadPlan:
    """Build the model of a load on the meta device and plan where each of its tensors comes from.

    A fusion steps aside rather than refuse a load that loads without it: when the fused model cannot be built as
    discovery found it, or the checkpoint does not plan into it, the load is planned again without fusions (said at
    INFO), unless a fusion asked to be ``strict``.
    """
    try:
        return _plan_once(options, checkpoint, config, model_class, name_or_path)
    except _FusionsStepAside as aside:
        requested = resolve_fusion_config(config, options.fusion_config)
        if any(isinstance(value, Mapping) and value.get("strict") for value in requested.values()):
            raise FusionError(f"Fusions {sorted(n for n, v in requested.items() if v)} (strict): {aside}") from None
        unfused = dataclasses.replace(options, fusion_config=dict.fromkeys(requested, False))
        try:
            plan = _plan_once(unfused, checkpoint, config, model_class, name_or_path)
        except LoadPlanError:
            # The checkpoint does not load without the fusions either: the error is the fused load's, as asked for.
            if isinstance(aside.__cause__, LoadPlanError):
                raise aside.__cause__ from None
            raise
        logger.info("Loading %s without fusions: %s", getattr(model_class, "__name__", model_class), aside)
        return plan


def _differing_decisions(model: PreTrainedModel, unfused: PreTrainedModel, fusions: PreparedFusions) -> list[str]:
    """The modules of a fused class's original that the fused build fused where discovery did not, or the other way
    round. Fused classes that decide per instance decide as discovery did on the unfused build; a model whose modules
    change after they are built could make them differ."""
    planned = {path for paths in fusions.fused.values() for path in paths}
    differing = []
    for path, module in unfused.named_modules():
        if fusions.mapping.match(type(module).__name__) is None:
            continue
        try:
            built = model.get_submodule(path)
        except AttributeError:
            differing.append(path)
            continue
        if (type(built) is not type(module)) != (path in planned):
            differing.append(path)
    return differing


def _plan_once(
    options: LoadOptions,
    checkpoint: Checkpoint,
    config: PretrainedConfig,
    model_class: type,
    name_or_path: str | os.PathLike[str],
) -> LoadPlan:
    """One try of :func:`_plan` with ``options``."""
    directory = checkpoint.directory
    config = copy.deepcopy(config)
    # An unsupported quantization method is refused by name here, before anything is built or read.
    quantization = load_quantization(config, options.quantization_config, device_map=options.device_map)
    concrete = resolve_model_class(model_class, config)
    # What the caller named (a repo id stays a repo id), as stock from_pretrained records it.
    config.name_or_path = str(name_or_path)
    metas = {key: TensorMeta(checkpoint.info(key).shape, checkpoint.info(key).dtype) for key in checkpoint.keys()}
    # Stock 5.x from_pretrained defaults to "auto" and records the dtype on the config and its sub-configs.
    dtype = "auto" if options.dtype is None else options.dtype
    resolved_dtype = resolve_dtype(dtype, config, (m.dtype for m in metas.values()))
    if quantization is not None:
        resolved_dtype = quantization.update_dtype(resolved_dtype)
    _set_config_dtype(config, resolved_dtype)
    if not options.new_parameters:
        check_layer_count(concrete, config, metas, directory / "config.json", resolved_dtype)
    fusions = PreparedFusions()
    try:
        setup = _load_setup(concrete, config, options, resolved_dtype)
        fusions, layers = setup.fusions, setup.layers.ordered()
        if setup.unfused is not None and not fusions.fused and quantization is None:
            model, scope = setup.unfused  # nothing to fuse: the discovery build is this load's model
        else:
            prepare = (
                None
                if quantization is None
                else lambda m: quantization.preprocess(m, dtype=resolved_dtype, checkpoint_files=checkpoint.files)
            )
            model, scope = build_empty_model_patched(concrete, config, resolved_dtype, layers, prepare)
    except Exception as exc:
        if not isinstance(exc, ModelPatchError):
            # The config's fault if the stock model cannot be built either, with transformers' default attention
            # and experts implementations; otherwise a replacement's or a keyword's error, raised as is.
            stock_config = copy.deepcopy(config)
            set_attention_implementation(stock_config, None)
            set_experts_implementation(stock_config, None)
            with config_build_errors(directory / "config.json", concrete):
                build_empty_model(concrete, stock_config, resolved_dtype, [])
        raise
    if setup.unfused is not None and fusions.fused and not is_runtime_layout(config):
        if differing := _differing_decisions(model, setup.unfused[0], fusions):
            raise _FusionsStepAside(f"the fused build fuses other modules than discovery found ({differing[:3]})")
    replaced = _check_patches(concrete, scope, options.patcher, setup.layers.registry)
    keep_in_fp32(model, resolved_dtype)
    transforms = _conversions(model, options.patcher, fusions)
    runtime_layout = is_runtime_layout(config)
    # A quantized checkpoint's tensors first become the parameters they make up (stage one, quantization.py).
    parameters = None
    if quantization is not None:
        parameters = quantization.plan_checkpoint(model, metas, resolved_dtype)
        quantization.check_conversions([] if runtime_layout else transforms)
    try:
        return plan_model_load(
            model,
            directory,
            metas,
            transforms,
            options,
            fusions=fusions,
            runtime_layout=runtime_layout,
            replaced=replaced,
            quantization=quantization,
            parameters=parameters,
            # Explaining missing keys by the classes the patches replaced needs a stock build: only on error.
            replacements=(lambda: _replacements(model, concrete, config, resolved_dtype, layers, fusions))
            if any(layers)
            else None,
        )
    except LoadPlanError as exc:
        if not fusions.fused or runtime_layout:
            raise
        raise _FusionsStepAside(f"the checkpoint does not load into the fused model ({exc})") from exc


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
        layer = next(
            (layer for layer in layers if (layer.match(original.__name__) or (None, None))[1] is type(module)), None
        )
        patch_key = fusion = None
        if layer is fusions.mapping:
            fusion = next((f for f, paths in fusions.fused.items() if name in paths), ", ".join(fusions.fused))
        elif layer is not None:
            patch_key = layer.match(original.__name__)[0]  # type: ignore[index]
        found.append(Replacement(name, original.__name__, type(module).__name__, patch_key, fusion))
    return found


def plan_pretrained(
    model_class: type,
    path: str | os.PathLike[str],
    *,
    patcher: Patcher | None = None,
    fusion_config: FusionConfig | None = None,
    dtype: torch.dtype | str | None = None,
    new_parameters: Sequence[str] = (),
    allow_pickle: bool = False,
    allow_external_symlinks: bool = False,
    revision: str | None = None,
    subfolder: str = "",
    cache_dir: str | os.PathLike[str] | None = None,
    token: bool | str | None = None,
    local_files_only: bool = False,
    force_download: bool = False,
    quantization_config: Any = None,
) -> LoadPlan:
    """Plan :func:`from_pretrained` without reading any tensor data: a :class:`LoadPlan` holds the meta-device model
    and where each of its tensors comes from.

    ``path`` and the keywords mean what they mean to :func:`from_pretrained` (a hub repository's files are fetched
    into the cache: the safetensors headers are in them). Raises the same errors as :func:`from_pretrained` would
    before loading (``LoadPlanError`` naming every key).
    """
    options = LoadOptions(
        patcher=patcher,
        fusion_config=fusion_config,
        dtype=dtype,
        new_parameters=new_parameters,
        unexpected_keys="ignore",
        allow_pickle=allow_pickle,
        allow_external_symlinks=allow_external_symlinks,
        hub=HubOptions(revision, subfolder, cache_dir, token, local_files_only, force_download),
        quantization_config=quantization_config,
    )
    directory = resolve_checkpoint(path, options.hub, allow_pickle=allow_pickle)
    config = load_config(directory)
    with options.open_checkpoint(directory) as checkpoint:
        return _plan(model_class, path, config, checkpoint, options)


# The return type follows output_loading_info, as in transformers; the other keywords are the implementation's.
@overload
def from_pretrained(
    model_class: type,
    path: str | os.PathLike[str],
    *,
    output_loading_info: Literal[False] = False,
    **kwargs: Any,
) -> PreTrainedModel: ...
@overload
def from_pretrained(
    model_class: type,
    path: str | os.PathLike[str],
    *,
    output_loading_info: Literal[True],
    **kwargs: Any,
) -> tuple[PreTrainedModel, dict[str, Any]]: ...
def from_pretrained(
    model_class: type,
    path: str | os.PathLike[str],
    *,
    patcher: Patcher | None = None,
    fusion_config: FusionConfig | None = None,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    device_map: str | int | torch.device | Mapping[str, Any] | None = None,
    max_memory: Mapping[Any, Any] | None = None,
    offload_folder: str | Path | None = None,
    offload_buffers: bool = False,
    new_parameters: Sequence[str] = (),
    unexpected_keys: UnexpectedKeys = "warn",
    allow_pickle: bool = False,
    allow_external_symlinks: bool = False,
    config: PretrainedConfig | str | os.PathLike[str] | None = None,
    revision: str | None = None,
    subfolder: str = "",
    cache_dir: str | os.PathLike[str] | None = None,
    token: bool | str | None = None,
    local_files_only: bool = False,
    force_download: bool = False,
    use_safetensors: bool | None = None,
    attn_implementation: str | None = None,
    experts_implementation: str | None = None,
    generation_config: GenerationConfig | None = None,
    trust_remote_code: bool | None = None,
    torch_dtype: torch.dtype | str | None = None,
    output_loading_info: bool = False,
    quantization_config: Any = None,
    tp_plan: str | dict[str, str] | None = None,
    tp_size: int | None = None,
    distributed_config: Any = None,
    **kwargs: Any,
) -> PreTrainedModel | tuple[PreTrainedModel, dict[str, Any]]:
    """Load a checkpoint into ``model_class`` with patches, fusions and weight conversions applied.

    Takes transformers' ``from_pretrained`` keywords with their meanings; the few it cannot honour are refused with
    the reason (docs/loading_and_saving.md has the table).

    Args:
        model_class: An Auto class (``AutoModelForCausalLM``) or a concrete ``PreTrainedModel`` subclass.
        path: A local checkpoint directory (``config.json`` + safetensors files) or a hub repo id (``"org/name"``),
            whose files are resolved through huggingface_hub's cache as transformers does (``HF_HUB_OFFLINE=1``:
            from the cache only).
        patcher: Class replacements and conversion adjustments for this load only.
        fusion_config: ``{fusion name: True / False / options}``; defaults to the one stored in the config.
        dtype: Like transformers 5: ``"auto"`` (the config's dtype, else the checkpoint's; what None means, as in
            stock ``from_pretrained``) or a ``torch.dtype`` (or its name).
        device: Where parameters go (default CPU). Unconverted CPU tensors stay memory-mapped (zero-copy).
        device_map: One device for the whole model (``"cpu"``, ``"cuda:0"``, ``0``, ``{"": device}``: the same as
            ``device``), or spread over several with accelerate: ``"auto"`` (fit ``max_memory``) or
            ``{module name: device}``. Weights of ``"disk"`` modules are read in place from the checkpoint's
            safetensors files when the load reads them unconverted, as in stock; converted ones need ``offload_folder``.
        max_memory: ``{device: bytes or "10GiB"}`` limits for ``device_map="auto"``.
        offload_folder: Where the weights offloaded to ``"disk"`` that cannot be read in place are written.
        offload_buffers: Offload buffers with the parameters of modules on ``"disk"``.
        new_parameters: Regex patterns of parameters that may be absent from the checkpoint; they are initialised
            as stock transformers initialises them (a fresh task head, say). Any other absent parameter is an error.
        unexpected_keys: What to do with checkpoint keys the model has no place for: "warn", "error" or "ignore".
        allow_pickle: Accept ``pytorch_model.bin`` checkpoints, read with ``torch.load(weights_only=True)``.
        allow_external_symlinks: Follow symlinked checkpoint files wherever they lead. By default a symlink must stay
            inside the checkpoint directory or, in a hub cache snapshot, inside its repository's ``blobs/``.
        config: The config to build the model from instead of the checkpoint's ``config.json``: a
            ``PretrainedConfig`` or a directory / repo id holding one.
        revision: Branch, tag, ``refs/pr/N`` or commit of a hub repository (default: main).
        subfolder: The checkpoint's folder inside ``path``.
        cache_dir: The huggingface_hub cache to use instead of ``HF_HUB_CACHE``.
        token: Hub token for private or gated repositories (``True``: the one saved by ``hf auth login``).
        local_files_only: Never download; use the cache only.
        force_download: Download the files again even if they are cached.
        use_safetensors: ``True`` refuses checkpoints without safetensors weights; ``None`` (default) reads
            safetensors, or pickle files when the checkpoint has nothing else and ``allow_pickle=True``.
        attn_implementation: ``"eager"``, ``"sdpa"``, ... set on the config before the model is built, as stock.
        experts_implementation: The MoE experts implementation, set on the config as stock does.
        generation_config: Used instead of the checkpoint's ``generation_config.json``.
        trust_remote_code: modelpatch loads the model types built into transformers only: ``True`` is refused for
            a checkpoint that ships its own modeling code (``auto_map``).
        torch_dtype: Deprecated alias of ``dtype`` (``dtype`` wins when both are given), as in transformers.
        output_loading_info: Also return transformers' loading-info dict (``missing_keys``, ``unexpected_keys``,
            ``mismatched_keys``, ``error_msgs``).
        **kwargs: Attributes of the checkpoint's config to override (``output_attentions=True``), as in
            transformers. ``low_cpu_mem_usage`` (and ``offload_state_dict``) are accepted and change nothing:
            modelpatch always loads lazily (meta-device build, memory-mapped tensors). transformers keywords that
            modelpatch cannot honour (``key_mapping``, ``state_dict``, ...) raise
            ``ValueError`` saying why; any other keyword raises ``TypeError``.
        quantization_config: Quantize at load like stock (a transformers ``TorchAoConfig``), or loading options of a
            quantized checkpoint. Quantized checkpoints (``quantization_config`` in config.json) need nothing: fp8,
            torchao and compressed-tensors load as stock loads them; other methods are refused by name.
        tp_plan: ``"auto"`` (the model's own TP plan; a dict overrides some of its rules) loads tensor-parallel over
            the ``torchrun`` processes, as transformers does: each rank reads only its shards
            (docs/loading_and_saving.md, "Tensor parallelism").
        tp_size: The number of ranks to shard over (default: the world size).
        distributed_config: A transformers ``DistributedConfig`` (or dict) instead of ``tp_plan`` / ``tp_size``;
            tensor parallelism only.

    Raises:
        CheckpointError: ``path`` is neither a checkpoint directory nor a hub repository that can be resolved, or a
            file in it is malformed.
        LoadPlanError: The checkpoint does not cover the model (every offending key is named); nothing is loaded.
    """
    overrides = config_overrides(kwargs)
    dtype = _dtype_argument(dtype, torch_dtype)
    if use_safetensors is False:
        raise ValueError(
            "use_safetensors=False is not supported: modelpatch reads safetensors whenever a checkpoint has them; "
            "allow_pickle=True reads checkpoints that have only pytorch_model.bin."
        )
    if device is not None and device_map is not None:
        raise ValueError("Pass either device or device_map, not both.")
    distributed = distributed_config_of(tp_plan, tp_size, distributed_config)
    if distributed is not None and (device is not None or device_map is not None):
        raise ValueError(
            "Tensor parallelism places each rank's shards on its own device: pass no device or device_map."
        )
    if device_map is not None and (one_device := single_device(device_map)) is not None:
        device, device_map = one_device, None
    try:
        target_device = torch.device(device) if device is not None else torch.device("cpu")
    except RuntimeError as exc:  # torch's error for an unknown device string
        raise ValueError(f"device {device!r} is not a torch device: {exc}") from None
    tensor_parallel = prepare_tensor_parallel(distributed)
    if tensor_parallel is not None:
        target_device = tensor_parallel.device
    options = LoadOptions(
        patcher=patcher,
        fusion_config=fusion_config,
        dtype=dtype,
        new_parameters=new_parameters,
        unexpected_keys=unexpected_keys,
        allow_pickle=allow_pickle,
        allow_external_symlinks=allow_external_symlinks,
        hub=HubOptions(revision, subfolder, cache_dir, token, local_files_only, force_download),
        quantization_config=quantization_config,
        device_map=device_map,
    )
    directory = resolve_checkpoint(path, options.hub, allow_pickle=allow_pickle, safetensors_only=bool(use_safetensors))
    config = _model_config(directory, config, options.hub, overrides)
    _check_remote_code(config, trust_remote_code)
    # Stock sets both on the config before building (its setters reach the sub-configs of composite models).
    if attn_implementation is not None:
        set_attention_implementation(config, attn_implementation)
    if experts_implementation is not None:
        set_experts_implementation(config, experts_implementation)
    if generation_config is None:
        generation_config = _load_generation_config(directory)
    # With MODELPATCH_PREFETCH=1, the files are read into the page cache on a background thread from here on, while
    # the model is built and loaded and during the first forward (a hint: off for placements reading part of them).
    with (
        options.open_checkpoint(directory) as checkpoint,
        prefetching(checkpoint, enabled=device_map is None and tensor_parallel is None),
    ):
        plan = _plan(model_class, path, config, checkpoint, options)
        model, quantization = plan.model, plan.quantization
        # Resolved on the meta model, as stock does: an offload to disk that cannot be done is refused before any read.
        placement = None
        if device_map is not None:
            # single_device took every one-device form above: a dispatch map or one of accelerate's strategies is left.
            assert isinstance(device_map, (str, Mapping))
            placement = Dispatch.plan(
                model,
                device_map,
                plan,
                checkpoint,
                max_memory=max_memory,
                offload_folder=offload_folder,
                offload_buffers=offload_buffers,
                in_place=quantization is None,
            )
        # Safetensors tensors (byte range known) are views of a private file mapping; pickle ones are not.
        fetch, file_mapped = checkpoint.tensor, lambda key: checkpoint.info(key).start >= 0
        if quantization is not None:
            fetch, file_mapped = quantization.fetch(fetch, file_mapped)
        if tensor_parallel is not None and quantization is not None:
            raise ValueError("Tensor-parallel loading of quantized models is not supported by modelpatch.")
        sharded = tensor_parallel.shard(model, plan) if tensor_parallel is not None else None
        if sharded is not None:
            fetch = sharded.fetch(fetch)
        load_into_model(model, plan, fetch, target_device, checkpoint.total_bytes, file_mapped=file_mapped)
        if sharded is not None:
            sharded.finish(model)
        # A file rewritten in place while its tensors were being read may have given data of two versions.
        checkpoint.check_unchanged()
        if placement is not None:
            placement.keep_files(checkpoint)

    if quantization is not None:
        quantization.quantize_loaded(model, plan.loaded_keys())
    _finalize(model, plan.expected.keys() - set(plan.loaded_keys()), target_device)
    if quantization is not None:
        quantization.finish(model)
    finish_fused_modules(model)
    plan.fusions.record(model)
    if generation_config is not None and model.can_generate():
        model.generation_config = generation_config

    report = LoadReport.from_plan(plan)
    record_report(model, report)
    _record_build(model, plan.expected, _conversions(model, options.patcher, PreparedFusions()))
    logger.info("%s", report.summary())
    if placement is not None:
        model = placement.apply(model)
    return (model, report.loading_info()) if output_loading_info else model


def _model_config(
    directory: Path,
    config: PretrainedConfig | str | os.PathLike[str] | None,
    hub: HubOptions,
    overrides: Mapping[str, Any],
) -> PretrainedConfig:
    """The config to build from: the checkpoint's, or the one passed as ``config=`` (an object, a directory or a
    repo id, resolved like the checkpoint), with ``overrides`` applied as transformers applies its ``**kwargs``."""
    if isinstance(config, PretrainedConfig):
        if overrides:
            # Stock passes them to the model's __init__, which modelpatch does not call with extra arguments.
            raise TypeError(
                f"from_pretrained() got unexpected keyword argument(s) {', '.join(map(repr, overrides))}: with "
                "config=<a config object>, set them on that config instead."
            )
        return copy.deepcopy(config)
    source = directory if config is None else resolve_checkpoint(config, hub, weights=False)
    return load_config(source, overrides)


def _check_remote_code(config: PretrainedConfig, trust_remote_code: bool | None) -> None:
    auto_map = getattr(config, "auto_map", None)
    if trust_remote_code and auto_map:
        raise ValueError(
            f"trust_remote_code=True asks for the modeling code this checkpoint ships (auto_map {auto_map}), which "
            "modelpatch does not run: it restructures the classes built into transformers. Leave trust_remote_code "
            f"unset to load transformers' own {config.model_type!r} implementation, or load this model with "
            "transformers."
        )


def _dtype_argument(dtype: torch.dtype | str | None, torch_dtype: torch.dtype | str | None) -> torch.dtype | str | None:
    """``dtype``, or transformers' deprecated alias ``torch_dtype`` when ``dtype`` is not given (as in stock)."""
    if torch_dtype is None:
        return dtype
    _warn_torch_dtype_deprecated()
    return dtype if dtype is not None else torch_dtype


@functools.cache
def _warn_torch_dtype_deprecated() -> None:
    logger.warning("`torch_dtype` is deprecated! Use `dtype` instead!")  # transformers' own wording, once


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
        initialize_missing(model, missing, device)
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
    options = LoadOptions(patcher=patcher, fusion_config=fusion_config, dtype=dtype)
    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"config must be a transformers PretrainedConfig, got {config!r}.")
    concrete = resolve_model_class(model_class, config)
    config = copy.deepcopy(config)
    resolved_dtype = None if options.dtype is None else resolve_dtype(options.dtype, config)
    setup = _load_setup(concrete, config, options, resolved_dtype or torch.get_default_dtype())
    fusions = setup.fusions
    model, scope = build_initialized_model(concrete, config, resolved_dtype, setup.layers.ordered())
    _check_patches(concrete, scope, options.patcher, setup.layers.registry)
    fusions.record(model)
    # What save_pretrained runs backwards to write this never-loaded model in the checkpoint layout: the model
    # type's mapping as adjusted by this build's Patcher and fusions.
    ensure_model_record(model).transforms = tuple(_conversions(model, options.patcher, fusions))
    _record_build(model, model_expectations(model), _conversions(model, options.patcher, PreparedFusions()))
    return model


def _record_build(
    model: PreTrainedModel, expected: Mapping[str, TensorMeta], base_transforms: Sequence[WeightTransform]
) -> None:
    """What every save of ``model`` relies on: the state as built, the transforms without fusions (what
    :func:`modelpatch.unfuse` goes back to), and the stock save method writing the original layout (so Trainer
    checkpoints and ``model.save_pretrained`` give stock-loadable directories)."""
    record = ensure_model_record(model)
    record.expected_state = dict(expected)
    record.base_transforms = tuple(base_transforms)
    install_state_dict_boundary(model)
