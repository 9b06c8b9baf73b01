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

Steps 1–4 are :func:`plan_pretrained` (a :class:`LoadPlan`), 5–6 :func:`load_planned`; :func:`from_pretrained` runs
both on one open checkpoint. What a load does besides filling a model on one device (quantization, tensor
parallelism, dispatch over devices and disk) is a load mode (``modes/base.py``): the loader calls every mode's hooks, in
order, at the same points of every load.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, overload

import torch
from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel

from .._transformers import (
    DistributedConfig,
    initialize_missing,
    set_attention_implementation,
    set_experts_implementation,
)
from .._transformers_mapping import model_conversions
from ..boundary.state_dict import install_state_dict_boundary
from ..checkpoint import Checkpoint
from ..checkpoint.json_file import MAX_CONFIG_BYTES, read_json
from ..checkpoint.prefetch import prefetching
from ..conversion.planner import TensorMeta
from ..conversion.transforms import WeightTransform
from ..errors import CheckpointError, FusionError, LoadPlanError, ModelPatchError, TensorParallelError
from ..fusions.apply import PreparedFusions, has_enabled_fusions, prepare_fusions, resolve_fusion_config
from ..fusions.generated import finish_fused_modules
from ..modes.base import LoadMode, TensorSource
from ..modes.dispatch import Dispatch
from ..modes.fsdp import prepare as prepare_fully_sharded
from ..modes.parallel import UnshardedPlan
from ..modes.parallel import prepare as prepare_tensor_parallel
from ..modes.quantization import load_quantization
from ..patching import registry
from ..patching.mapping import PatchMapping
from ..patching.patcher import Patcher
from ..patching.scope import PatchScope
from ..state import is_runtime_layout
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
from .hub import CONFIG_NAME, GENERATION_CONFIG_NAME, HubOptions, resolve_checkpoint
from .materialize import load_into_model
from .options import FusionConfig, LoadOptions
from .placement import is_fully_sharded_config
from .plan import LoadPlan, model_expectations, plan_model_load
from .record import ensure_model_record, get_load_report, record_report
from .report import LoadReport

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


@dataclass
class _Request:
    """A load as asked for, resolved as its checkpoint is opened: the options, the checkpoint's directory, the config
    to build from (keywords applied), the generation config, the sharded load's mode (tensor parallelism or FSDP2: its
    mesh made once), and the bytes of
    the checkpoint's config files those were read from (``config.json``, ``generation_config.json``; None: absent)."""

    model_class: type
    path: str | os.PathLike[str]
    options: LoadOptions
    directory: Path
    config: PretrainedConfig
    generation_config: GenerationConfig | None
    sharding: LoadMode | None
    config_files: dict[str, bytes | None]

    @classmethod
    @contextmanager
    def opened(
        cls, model_class: type, path: str | os.PathLike[str], options: LoadOptions
    ) -> Iterator[tuple[_Request, Checkpoint]]:
        """The request and its checkpoint, open while the caller uses it: the config files it was read from and the
        weights are those of one saved version, whatever saves replace the directory meanwhile."""
        # The mesh first (torch.distributed initialised), as transformers makes it before looking at any file.
        sharding = _sharding(options.distributed)
        directory = resolve_checkpoint(
            path, options.hub, allow_pickle=options.allow_pickle, safetensors_only=bool(options.use_safetensors)
        )

        def read() -> _Request:
            config = _model_config(directory, options.config, options.hub, options.config_overrides)
            _check_remote_code(config, options.trust_remote_code)
            # Stock sets both on the config before building (its setters reach the sub-configs of composite models).
            if options.attn_implementation is not None:
                set_attention_implementation(config, options.attn_implementation)
            if options.experts_implementation is not None:
                set_experts_implementation(config, options.experts_implementation)
            generation_config = options.generation_config
            if generation_config is None:
                generation_config = _load_generation_config(directory)
            read_here = [name for name, passed in _CONFIG_FILES.items() if getattr(options, passed) is None]
            config_files = _config_files(directory, read_here)
            return cls(model_class, path, options, directory, config, generation_config, sharding, config_files)

        checkpoint, request = options.open_checkpoint(directory, read)
        with checkpoint:
            yield request, checkpoint

    def modes(self, config: PretrainedConfig, options: LoadOptions) -> list[LoadMode]:
        """The load modes of one planning of the load, in the order their hooks run: quantization (refused by name
        here, before anything is built or read, when unsupported), the sharding (tensor parallelism or FSDP2),
        device-map dispatch."""
        modes: list[LoadMode] = []
        quantization = load_quantization(config, options.quantization_config, device_map=options.device_map)
        if quantization is not None:
            modes.append(quantization)
        if self.sharding is not None:
            modes.append(self.sharding)
        elif options.unsharded_tp_plan:
            modes.append(UnshardedPlan(options.unsharded_tp_plan))
        if options.device_map is not None:
            modes.append(
                Dispatch(
                    options.device_map,
                    max_memory=options.max_memory,
                    offload_folder=options.offload_folder,
                    offload_buffers=options.offload_buffers,
                )
            )
        return [*modes, *options.load_modes]

    def prefetches(self) -> bool:
        """Whether reading the checkpoint ahead helps: not for placements that read part of it."""
        return self.options.device_map is None and self.sharding is None


def _sharding(distributed: DistributedConfig | None) -> LoadMode | None:
    """The mode of a sharded load: FSDP2 / HSDP for a config whose data-parallel mesh has more than one rank (the
    options refused it combined with tensor parallelism), else tensor parallelism; None for no sharding."""
    if distributed is None:
        return None
    if is_fully_sharded_config(distributed):
        return prepare_fully_sharded(distributed)
    return prepare_tensor_parallel(distributed)


def _plan(request: _Request, checkpoint: Checkpoint) -> LoadPlan:
    """Build the model of a load on the meta device, plan where each of its tensors comes from, and let the load
    modes plan their part (:meth:`LoadMode.plan`): every refusal comes from here, before any tensor data is read.

    A fusion steps aside rather than refuse a load that loads without it: when the fused model cannot be built as
    discovery found it, or the checkpoint does not plan into it, the load is planned again without fusions (said at
    INFO), unless a fusion asked to be ``strict``.
    """
    options, model_class = request.options, request.model_class
    try:
        plan = _plan_once(request, checkpoint, options)
    except _FusionsStepAside as aside:
        requested = resolve_fusion_config(request.config, options.fusion_config)
        if any(isinstance(value, Mapping) and value.get("strict") for value in requested.values()):
            raise FusionError(f"Fusions {sorted(n for n, v in requested.items() if v)} (strict): {aside}") from None
        unfused = dataclasses.replace(options, fusion_config=dict.fromkeys(requested, False))
        try:
            plan = _plan_once(request, checkpoint, unfused)
        except LoadPlanError:
            # The checkpoint does not load without the fusions either: the error is the fused load's, as asked for.
            if isinstance(aside.__cause__, LoadPlanError):
                raise aside.__cause__ from None
            raise
        logger.info("Loading %s without fusions: %s", getattr(model_class, "__name__", model_class), aside)
    plan.generation_config = request.generation_config
    plan.config_files = request.config_files
    for mode in plan.modes:
        mode.plan(plan.model, plan, checkpoint)
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


def _plan_once(request: _Request, checkpoint: Checkpoint, options: LoadOptions) -> LoadPlan:
    """One try of :func:`_plan` with ``options``."""
    directory = checkpoint.directory
    config = copy.deepcopy(request.config)
    modes = request.modes(config, options)
    concrete = resolve_model_class(request.model_class, config)
    # What the caller named (a repo id stays a repo id), as stock from_pretrained records it.
    config.name_or_path = str(request.path)
    metas = {key: TensorMeta(checkpoint.info(key).shape, checkpoint.info(key).dtype) for key in checkpoint.keys()}
    # Stock 5.x from_pretrained defaults to "auto" and records the dtype on the config and its sub-configs.
    dtype = "auto" if options.dtype is None else options.dtype
    resolved_dtype = resolve_dtype(dtype, config, (m.dtype for m in metas.values()))
    for mode in modes:
        resolved_dtype = mode.update_dtype(resolved_dtype)
    _set_config_dtype(config, resolved_dtype)
    if not options.new_parameters:
        check_layer_count(concrete, config, metas, directory / "config.json", resolved_dtype)
    model, scope, setup = _build(concrete, config, options, resolved_dtype, modes, checkpoint)
    fusions, layers = setup.fusions, setup.layers.ordered()
    if setup.unfused is not None and fusions.fused and not is_runtime_layout(config):
        if differing := _differing_decisions(model, setup.unfused[0], fusions):
            raise _FusionsStepAside(f"the fused build fuses other modules than discovery found ({differing[:3]})")
    replaced = _check_patches(concrete, scope, options.patcher, setup.layers.registry)
    keep_in_fp32(model, resolved_dtype)
    transforms = _conversions(model, options.patcher, fusions)
    runtime_layout = is_runtime_layout(config)
    # What the plan reads: the checkpoint as the modes make it (a quantized checkpoint's tensors grouped into the
    # parameters they make up).
    parameters: Mapping[str, TensorMeta] = metas
    for mode in modes:
        parameters = mode.plan_parameters(
            model, parameters, dtype=resolved_dtype, transforms=[] if runtime_layout else transforms
        )
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
            modes=modes,
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


def _build(
    concrete: type[PreTrainedModel],
    config: PretrainedConfig,
    options: LoadOptions,
    dtype: torch.dtype,
    modes: Sequence[LoadMode],
    checkpoint: Checkpoint,
) -> tuple[PreTrainedModel, PatchScope, _Setup]:
    """The load's model on the meta device, under its patch layers, prepared by its modes
    (:meth:`LoadMode.prepare_model`); with the setup it was built under.

    A mode that ``quantizes`` prepares the model inside transformers' init contexts of a quantized model, as stock
    runs its quantizer's ``preprocess_model``; without one, the modes prepare the model once it is built (then the
    build fusion discovery ran on is the load's model when nothing is fused).
    """

    def prepare(model: PreTrainedModel) -> None:
        for mode in modes:
            mode.prepare_model(model, dtype=dtype, checkpoint=checkpoint)

    quantized = any(mode.quantizes for mode in modes)
    try:
        setup = _load_setup(concrete, config, options, dtype)
        if setup.unfused is not None and not setup.fusions.fused and not quantized:
            model, scope = setup.unfused  # nothing to fuse: the discovery build is this load's model
        else:
            layers = setup.layers.ordered()
            model, scope = build_empty_model_patched(concrete, config, dtype, layers, prepare if quantized else None)
        if not quantized:
            prepare(model)
        return model, scope, setup
    except Exception as exc:
        if not isinstance(exc, ModelPatchError):
            # The config's fault if the stock model cannot be built either, with transformers' default attention
            # and experts implementations; otherwise a replacement's or a keyword's error, raised as is.
            stock_config = copy.deepcopy(config)
            set_attention_implementation(stock_config, None)
            set_experts_implementation(stock_config, None)
            with config_build_errors(checkpoint.directory / "config.json", concrete):
                build_empty_model(concrete, stock_config, dtype, [])
        raise


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


def plan_pretrained(model_class: type, path: str | os.PathLike[str], **keywords: Any) -> LoadPlan:
    """Plan :func:`from_pretrained` without reading any tensor data; :func:`load_planned` executes the plan.

    Takes the arguments of :func:`from_pretrained` (but ``output_loading_info``) with their meanings, except that
    ``unexpected_keys`` defaults to ``"ignore"``: the plan lists them (``LoadPlan.unexpected``). A hub repository's
    files are fetched into the cache: the safetensors headers are in them. Builds the model on the meta device,
    plans where each of its tensors comes from and lets the load modes (quantization, tensor parallelism, dispatch)
    plan their part.

    Raises:
        LoadPlanError, CheckpointError, ValueError, ...: Everything :func:`from_pretrained` refuses before loading
            (``LoadPlanError`` naming every key); nothing was read but headers and configs.
    """
    options = LoadOptions.from_keywords(**{"unexpected_keys": "ignore", **keywords})
    with open_plan(model_class, path, options) as (plan, _):
        return plan


@contextmanager
def open_plan(
    model_class: type, path: str | os.PathLike[str], options: LoadOptions
) -> Iterator[tuple[LoadPlan, Checkpoint]]:
    """The plan of a load with ``options``, and its checkpoint, open while the caller uses them (offline conversion
    streams the checkpoint's tensors through the plan)."""
    with _Request.opened(model_class, path, options) as (request, checkpoint):
        yield _plan(request, checkpoint), checkpoint


def load_planned(plan: LoadPlan) -> PreTrainedModel:
    """Execute a plan of :func:`plan_pretrained`: read the tensors into its model and return the loaded model (what
    :func:`from_pretrained` with the same arguments returns). A plan loads once.

    Raises:
        CheckpointError: The checkpoint's headers changed since the plan was made (plan again), or a file is
            rewritten while it is read.
        ValueError: The plan was loaded already.
    """
    device = execute_plan(plan, plan.model)
    return _finish(plan, device)


# The return type follows output_loading_info, as in transformers; the other keywords are LoadOptions'.
@overload
def from_pretrained(
    model_class: type,
    path: str | os.PathLike[str],
    *,
    output_loading_info: Literal[False] = False,
    **keywords: Any,
) -> PreTrainedModel: ...
@overload
def from_pretrained(
    model_class: type,
    path: str | os.PathLike[str],
    *,
    output_loading_info: Literal[True],
    **keywords: Any,
) -> tuple[PreTrainedModel, dict[str, Any]]: ...
def from_pretrained(
    model_class: type, path: str | os.PathLike[str], *, output_loading_info: bool = False, **keywords: Any
) -> PreTrainedModel | tuple[PreTrainedModel, dict[str, Any]]:
    """Load a checkpoint into ``model_class`` with patches, fusions and weight conversions applied.

    Takes transformers' ``from_pretrained`` keywords with their meanings; the few it cannot honour are refused with
    the reason (docs/loading_and_saving.md has the table). :func:`plan_pretrained` then :func:`load_planned` do the
    same in two steps.

    Args:
        model_class: An Auto class (``AutoModelForCausalLM``) or a concrete ``PreTrainedModel`` subclass.
        path: A local checkpoint directory (``config.json`` + safetensors files) or a hub repo id (``"org/name"``),
            whose files are resolved through huggingface_hub's cache as transformers does (``HF_HUB_OFFLINE=1``:
            from the cache only).
        output_loading_info: Also return transformers' loading-info dict (``missing_keys``, ``unexpected_keys``,
            ``mismatched_keys``, ``error_msgs``).
        **keywords: The settings of the load, each documented as the attribute of :class:`LoadOptions` it sets:
            ``patcher``, ``fusion_config``, ``dtype`` (``torch_dtype``), ``device``, ``device_map``,
            ``max_memory``, ``offload_folder``, ``offload_buffers``, ``new_parameters``, ``unexpected_keys``,
            ``allow_pickle``, ``allow_external_symlinks``, ``config``, the hub's ``revision``, ``subfolder``,
            ``cache_dir``, ``token``, ``local_files_only``, ``force_download``, ``use_safetensors``,
            ``attn_implementation``, ``experts_implementation``, ``generation_config``, ``trust_remote_code``,
            ``quantization_config``, ``tp_plan``, ``tp_size``, ``distributed_config``; any other keyword overrides the
            config attribute of its name, as in transformers.

    Raises:
        CheckpointError: ``path`` is neither a checkpoint directory nor a hub repository that can be resolved, or a
            file in it is malformed.
        LoadPlanError: The checkpoint does not cover the model (every offending key is named); nothing is loaded.
    """
    options = LoadOptions.from_keywords(**keywords)
    model = load_with_options(model_class, path, options)
    report = get_load_report(model)
    assert report is not None  # every load records one
    return (model, report.loading_info()) if output_loading_info else model


def load_with_options(model_class: type, path: str | os.PathLike[str], options: LoadOptions) -> PreTrainedModel:
    """:func:`from_pretrained` with its keywords gathered in ``options``: planned and executed on one open
    checkpoint."""
    # A prefetch modelpatch's Auto classes started (before torch was imported) is adopted here; otherwise one starts
    # here only with MODELPATCH_PREFETCH=1. It reads the files into the page cache while the model is built and
    # loaded and during the first forward (a hint: off for placements reading part of them).
    with (
        _Request.opened(model_class, path, options) as (request, checkpoint),
        prefetching(checkpoint, enabled=request.prefetches()),
    ):
        plan = _plan(request, checkpoint)
        device = _fill(plan, checkpoint)
    return _finish(plan, device)


def execute_plan(plan: LoadPlan, model: PreTrainedModel) -> torch.device:
    """The execute stage of :func:`load_planned`, into ``model`` (the plan's model, or one of its structure a mode
    fills, as :func:`~modelpatch.load_sharded` fills a sharded model): reopen the checkpoint, check its headers are
    those planned, and fill the model (:func:`_fill`), without transformers' finalisation. Returns the device the
    tensors were placed on.

    Raises:
        CheckpointError: The checkpoint's headers changed since the plan was made.
        ValueError: The plan was loaded already.
    """
    if plan.loaded:
        raise ValueError(
            "This LoadPlan was executed already (a plan loads once, failed or not): plan again with plan_pretrained."
        )
    opened, config_files = plan.options.open_checkpoint(
        plan.directory, lambda: _config_files(plan.directory, list(plan.config_files))
    )
    with opened as checkpoint:
        planned = plan.checkpoint
        now = {key: TensorMeta(checkpoint.info(key).shape, checkpoint.info(key).dtype) for key in checkpoint.keys()}
        # The config the model was built from must be the one of the weights read.
        if changed_files := sorted(
            name for name, now_read in config_files.items() if plan.config_files[name] != now_read
        ):
            raise CheckpointError(
                f"{plan.directory}: the checkpoint changed since it was planned ({', '.join(changed_files)} "
                "differ): plan it again. Nothing was loaded."
            )
        if now != planned:
            changed = sorted(k for k in planned.keys() | now.keys() if planned.get(k) != now.get(k))
            raise CheckpointError(
                f"{plan.directory}: the checkpoint changed since it was planned ({len(changed)} tensor(s) differ: "
                f"{', '.join(changed[:3])}): plan it again. Nothing was loaded."
            )
        return _fill(plan, checkpoint, model)


def _fill(plan: LoadPlan, checkpoint: Checkpoint, model: PreTrainedModel | None = None) -> torch.device:
    """Read every planned tensor into ``model`` (default: the plan's), through the tensor source the modes wrap
    (:meth:`LoadMode.wrap_source`), onto the device they name, each group converted and each tensor placed as the
    modes take them (:meth:`LoadMode.run_group`, :meth:`LoadMode.place`); then :meth:`LoadMode.after_load`. Returns
    that device."""
    plan.loaded = True  # from here on the model holds read tensors: a failure leaves nothing to load again
    model = plan.model if model is None else model
    # Safetensors tensors (byte range known) are views of a private file mapping; pickle ones are not.
    source = TensorSource(checkpoint.tensor, lambda key: checkpoint.info(key).start >= 0, checkpoint.joined)
    for mode in plan.modes:
        source = mode.wrap_source(source)
    device = _device(plan)
    load_into_model(model, plan, source, device, checkpoint.total_bytes, modes=plan.modes)
    # A file rewritten in place while its tensors were being read may have given data of two versions.
    checkpoint.check_unchanged()
    for mode in plan.modes:
        mode.after_load(model, plan, checkpoint)
    return device


def _device(plan: LoadPlan) -> torch.device:
    """Where the loaded tensors go: the ``device`` option, unless a mode names one (the last that does wins)."""
    device = plan.options.device or torch.device("cpu")
    for mode in plan.modes:
        device = mode.device() or device
    return device


def _finish(plan: LoadPlan, device: torch.device) -> PreTrainedModel:
    """transformers' finalisation, the fused modules' own finishing, the record and report; then each mode's
    :meth:`LoadMode.finish`, which gives the model the caller gets."""
    model = plan.model
    _finalize(model, plan.expected.keys() - set(plan.loaded_keys()), device)
    finish_fused_modules(model)
    plan.fusions.record(model)
    if plan.generation_config is not None and model.can_generate():
        model.generation_config = plan.generation_config
    report = LoadReport.from_plan(plan)
    record_report(model, report)
    _record_build(model, plan.expected, _conversions(model, plan.options.patcher, PreparedFusions()))
    logger.info("%s", report.summary())
    ensure_model_record(model).load_modes = plan.modes  # whose save hooks a save of the model calls (saving/stages.py)
    for mode in plan.modes:
        model = mode.finish(model)
    return model


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


def _set_config_dtype(config: PretrainedConfig, dtype: torch.dtype) -> None:
    config.dtype = dtype
    for name in getattr(config, "sub_configs", {}) or {}:
        if (sub_config := getattr(config, name, None)) is not None:
            sub_config.dtype = dtype


_CONFIG_FILES = {CONFIG_NAME: "config", GENERATION_CONFIG_NAME: "generation_config"}
"""The config files a load reads from the checkpoint's directory, each unless this option passes its content."""


def _config_files(directory: Path, names: Sequence[str]) -> dict[str, bytes | None]:
    """The bytes of the files ``names`` of ``directory`` (None for each it lacks; what the configs' limit allows of
    one larger, which its parse refused or will refuse)."""
    contents: dict[str, bytes | None] = {}
    for name in names:
        try:
            with (directory / name).open("rb") as f:
                contents[name] = f.read(MAX_CONFIG_BYTES + 1)
        except FileNotFoundError:
            contents[name] = None
        except OSError as exc:
            raise CheckpointError(f"{directory / name}: cannot read it: {exc}") from exc
    return contents


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
    distributed_config: DistributedConfig | Mapping[str, Any] | None = None,
    tp_plan: str | Mapping[str, str] | None = None,
    tp_size: int | None = None,
) -> PreTrainedModel:
    """Build a freshly initialised model from ``config`` with patches and fusions applied (no weights read).

    Args mirror :func:`from_pretrained`; ``model_class`` may be an Auto class. ``distributed_config``, ``tp_plan``
    and ``tp_size`` are refused (:class:`~modelpatch.TensorParallelError`, naming the keyword and what to do): stock
    transformers' ``from_config`` does not take them either (it hands them to the model's ``__init__``, which fails
    with a ``TypeError``), and a freshly initialised model has no checkpoint whose shards each rank could read.
    """
    _refuse_sharded_build(distributed_config=distributed_config, tp_plan=tp_plan, tp_size=tp_size)
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


def _refuse_sharded_build(**keywords: Any) -> None:
    """Refuse the sharding keywords given to :func:`from_config` by name, with the two ways to a sharded model."""
    if given := [name for name, value in keywords.items() if value is not None]:
        raise TensorParallelError(
            f"from_config takes no {' / '.join(given)}: stock transformers' from_config does not shard a model at "
            "build time either (it passes the keyword to the model's __init__, which refuses it). Save the built "
            "model (save_pretrained) and load it under torchrun with modelpatch.from_pretrained(..., "
            f"{given[0]}=...), or build it on the meta device, fully_shard it yourself and fill it with "
            "modelpatch.load_sharded."
        )


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
