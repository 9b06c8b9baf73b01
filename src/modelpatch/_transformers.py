"""The one door to transformers' private API: every private name modelpatch uses, one small function each.

modelpatch builds, finalises, converts and quantizes models exactly as stock transformers does, which takes some of
transformers' internals: underscore methods and attributes (``_from_config``, ``_initialize_missing_keys``,
``_can_record_outputs``, ...), positional signatures of internal helpers (``get_init_context``, ``get_hf_quantizer``)
and names that only live in submodules (the Auto-class factory, the conversion registry, the quantizers). They are
all reached through this module, so moving to another transformers release means auditing this one file (and
``_transformers_mapping.py``, which translates transformers' conversion objects).

:data:`PRIVATE_API` lists every such name, where it lives, the first release that has it, and the feature that needs
it. Each function resolves the names it needs when it is called (:func:`require`), so on a transformers release
that dropped or moved one, ``import modelpatch`` still works, every feature that does not need the name still
works, and the one that does is refused with a :class:`~modelpatch.errors.TransformersVersionError` naming the
release, the name, the feature and the supported range, instead of an ``AttributeError`` from deep inside.

The supported range is :data:`SUPPORTED` (pyproject.toml declares the same; tests/test_packaging.py checks it). CI
runs the suite on the lowest and the newest release of the range (.ci/constraints-lowest.txt, .ci/constraints.txt);
"Checked against A–B" in a function's docstring means read in those releases' source and exercised by the suite on
both. scripts/check_transformers_release.py runs the suite against a release outside the range.

Only public names are imported at module level. The modules and classes below are imported on first use (module
``__getattr__``), so that modules needing only the Auto classes stay quick to import.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import transformers
from packaging.specifiers import SpecifierSet  # packaging: a dependency of transformers itself
from transformers import PretrainedConfig, PreTrainedModel

# Public from its submodule in every supported release (exported at the top level only from 5.16 on).
from transformers.distributed import DistributedConfig

from ._doors import Door, private_api
from .errors import TransformersVersionError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from transformers.models.auto.auto_factory import _BaseAutoModelClass
    from transformers.utils.output_capturing import OutputRecorder

logger = logging.getLogger(__name__)

# The transformers releases modelpatch supports (pyproject.toml's range) and the releases CI checks: the lowest and
# the newest of the range.
SUPPORTED = ">=5.15,<5.25"
CHECKED = ("5.15.1", "5.24.0")

# Every private name of transformers the door relies on, by the feature that needs it: "module:attribute path" (no
# attribute: the module itself). Each is in transformers 5.15, the lowest supported release, but those of ``since``.
# PRIVATE_API: path -> (the first supported release that has it, the feature).
PRIVATE_API: dict[str, tuple[str, str]] = private_api(
    "5.15",
    {
        # Building and finalising a model
        "building a model (from_pretrained)": ["transformers.modeling_utils:PreTrainedModel.get_init_context"],
        "building a model from its config": ["transformers.modeling_utils:PreTrainedModel._from_config"],
        "keeping modules in float32": ["transformers.modeling_utils:PreTrainedModel._get_dtype_plan"],
        "attn_implementation=": ["transformers.configuration_utils:PretrainedConfig._attn_implementation"],
        "experts_implementation=": ["transformers.configuration_utils:PretrainedConfig._experts_implementation"],
        "class patching (transformers' own patch registry)": [
            "transformers.monkey_patching",
            "transformers.monkey_patching:get_patch_mapping",
        ],
        "initialising what a checkpoint does not hold": [
            "transformers.modeling_utils:PreTrainedModel._move_missing_keys_from_meta_to_device",
            "transformers.modeling_utils:PreTrainedModel._initialize_missing_keys",
        ],
        "tying weights": ["transformers.modeling_utils:PreTrainedModel.tie_weights"],
        "load reports": [
            "transformers.modeling_utils:PreTrainedModel._keys_to_ignore_on_load_missing",
            "transformers.modeling_utils:PreTrainedModel._keys_to_ignore_on_load_unexpected",
        ],
        "device maps": [
            "transformers.modeling_utils:PreTrainedModel._no_split_modules",
            "transformers.modeling_utils:PreTrainedModel._skip_keys_device_placement",
        ],
        "saving a model with an adapter": ["transformers.modeling_utils:PreTrainedModel._hf_peft_config_loaded"],
        # Output recorders
        "output_attentions / output_hidden_states": [
            "transformers.utils.output_capturing:OutputRecorder",
            "transformers.modeling_utils:PreTrainedModel._can_record_outputs",
        ],
        # Auto classes
        "modelpatch's Auto classes": [
            "transformers.models.auto.auto_factory:_BaseAutoModelClass",
            "transformers.models.auto.auto_factory:_BaseAutoModelClass._model_mapping",
            "transformers.models.auto.auto_factory:_get_model_class",
        ],
        "finding a model type's classes": ["transformers.models.auto.modeling_auto"],
        # Conversions
        "checkpoint conversions (transformers' mapping)": ["transformers.conversion_mapping"],
        "checkpoint conversions": [
            "transformers.conversion_mapping:get_checkpoint_conversion_mapping",
            "transformers.conversion_mapping:_checkpoint_conversion_mapping_cache",
            "transformers.conversion_mapping:USER_REGISTERED_MAPPINGS",
            "transformers.core_model_loading:WeightTransform._original_source_patterns",
            "transformers.core_model_loading:WeightTransform._original_target_patterns",
        ],
        "checkpoint conversions (transformers' operations)": ["transformers.core_model_loading"],
        # Quantizers
        "quantized loads": [
            "transformers.quantizers:HfQuantizer",
            "transformers.quantizers:HfQuantizer.update_weight_conversions",
            "transformers.quantizers.auto:get_hf_quantizer",
        ],
        "loading FP8 checkpoints": ["transformers.integrations.finegrained_fp8:Fp8Dequantize"],
        "loading torchao checkpoints": ["transformers.integrations.torchao:TorchAoDeserialize"],
        # Tensor parallelism (releases before 5.23 have another distributed API: tensor_parallel_supported() is False
        # there)
        "tensor-parallel loads": [
            "transformers.modeling_utils:PreTrainedModel._resolve_parallel_plans",
            "transformers.modeling_utils:PreTrainedModel.prepare_distribute_model",
            "transformers.modeling_utils:PreTrainedModel._tp_plan",
            "transformers.modeling_utils:PreTrainedModel._mesh_manager",
            "transformers.modeling_utils:PreTrainedModel._device_mesh",
            "transformers.modeling_utils:PreTrainedModel._is_distributed_loading_by_transformers",
            "transformers.modeling_utils:PreTrainedModel._tp_size",
            "transformers.modeling_utils:PreTrainedModel._fsdp_size",
            "transformers.distributed.parallel_utils:ALL_PARALLEL_STYLES",
            "transformers.distributed.parallel_utils:replace_layer_number_by_wildcard",
            "transformers.distributed.tensor_parallel:apply_tensor_parallelism",
            "transformers.distributed.tensor_parallel:PackedColwiseParallel",
            "transformers.distributed.sharding_utils:DtensorShardOperation",
        ],
        # FSDP2 / HSDP loads (distributed_config with fsdp_size / dp_replicate_size), on the same distributed API
        "FSDP2 loads": ["transformers.distributed.fsdp:apply_fully_sharded_data_parallelism"],
    },
    since={
        "transformers.distributed.tensor_parallel:apply_tensor_parallelism": "5.16",
        "transformers.distributed.tensor_parallel:PackedColwiseParallel": "5.16",
        "transformers.modeling_utils:PreTrainedModel._fsdp_size": "5.18",
        "transformers.modeling_utils:PreTrainedModel._mesh_manager": "5.19",
        "transformers.modeling_utils:PreTrainedModel._is_distributed_loading_by_transformers": "5.19",
        "transformers.distributed.parallel_utils:ALL_PARALLEL_STYLES": "5.22",
        "transformers.modeling_utils:PreTrainedModel._resolve_parallel_plans": "5.23",
        "transformers.distributed.parallel_utils:replace_layer_number_by_wildcard": "5.23",
    },
)
# Markers transformers sets on instances (no class declares them), exercised by the suite rather than looked up.
INSTANCE_ATTRIBUTES = ("all_tied_weights_keys", "_is_hf_initialized")


# require(path): the private name path of PRIVATE_API, looked up now (TransformersVersionError, naming it, the feature
# that needs it, the installed release and SUPPORTED, where the installed transformers lacks it); available(path):
# whether the installed transformers has it.
_DOOR = Door(
    PRIVATE_API,
    TransformersVersionError,
    lambda: f"transformers {transformers.__version__}",
    f"; supported: transformers{SUPPORTED}. Install a supported release: pip install 'transformers{SUPPORTED}'.",
)
require = _DOOR.require
available = _DOOR.available


def supports(version: str) -> bool:
    """Whether transformers ``version`` lies in :data:`SUPPORTED` (pre-releases of a supported release included)."""
    return version in SpecifierSet(SUPPORTED, prereleases=True)


def _warn_outside_supported_range() -> None:
    if not supports(transformers.__version__):
        logger.warning(
            "transformers %s is outside the range modelpatch supports (%s): a feature whose transformers internals "
            "changed is refused with a TransformersVersionError naming what it misses.",
            transformers.__version__,
            SUPPORTED,
        )


_warn_outside_supported_range()

# Names imported on first use: {name: its PRIVATE_API path}.
_LAZY = {
    "conversion_mapping": "transformers.conversion_mapping",  # the registry module (not exported at top level)
    "core_model_loading": "transformers.core_model_loading",  # its transforms and operations
    "HfQuantizer": "transformers.quantizers:HfQuantizer",
    "Fp8Dequantize": "transformers.integrations.finegrained_fp8:Fp8Dequantize",
    "TorchAoDeserialize": "transformers.integrations.torchao:TorchAoDeserialize",
    # The packed-colwise TP style (transformers' forward hooks), base of modelpatch's part-by-part style.
    "PackedColwiseParallel": "transformers.distributed.tensor_parallel:PackedColwiseParallel",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = require(_LAZY[name])
    globals()[name] = value
    return value


# --- Building a model ---------------------------------------------------------------------------------------------


def init_contexts(
    model_class: type[PreTrainedModel], dtype: torch.dtype, quantized: bool
) -> list[AbstractContextManager]:
    """The context managers stock ``from_pretrained`` builds a model under (meta device, default dtype, no init).

    Checked against 5.15.1–5.24.0: ``get_init_context(dtype, is_quantized, _is_ds_init_called, allow_all_kernels)``,
    positional.
    """
    require("transformers.modeling_utils:PreTrainedModel.get_init_context")
    return model_class.get_init_context(dtype, quantized, False, None)


def initialized_from_config(
    model_class: type[PreTrainedModel], config: PretrainedConfig, dtype: torch.dtype | None
) -> PreTrainedModel:
    """A model built and initialised from ``config`` as stock ``AutoModel.from_config`` builds it.

    Checked against 5.15.1–5.24.0: ``PreTrainedModel._from_config(config, dtype=...)``.
    """
    require("transformers.modeling_utils:PreTrainedModel._from_config")
    return model_class._from_config(config, **({"dtype": dtype} if dtype is not None else {}))


def fp32_module_patterns(model: PreTrainedModel, dtype: torch.dtype) -> list[str]:
    """The glob patterns of the tensors stock keeps in float32 when loading in ``dtype``.

    Checked against 5.15.1–5.24.0: ``PreTrainedModel._get_dtype_plan(dtype)`` (``_keep_in_fp32_modules`` and
    ``_keep_in_fp32_modules_strict``).
    """
    require("transformers.modeling_utils:PreTrainedModel._get_dtype_plan")
    return list(model._get_dtype_plan(dtype) or [])


def set_attention_implementation(config: PretrainedConfig, implementation: str | None) -> None:
    """Set the attention implementation as stock's ``attn_implementation=`` does; None resets it to the default.

    Checked against 5.15.1–5.24.0: the ``_attn_implementation`` setter of ``PretrainedConfig``, which reaches the
    sub-configs of composite models.
    """
    require("transformers.configuration_utils:PretrainedConfig._attn_implementation")
    config._attn_implementation = implementation


def set_experts_implementation(config: PretrainedConfig, implementation: str | None) -> None:
    """Set the experts implementation as stock's ``experts_implementation=`` does; None resets it to the default.

    Checked against 5.15.1–5.24.0: the ``_experts_implementation`` setter of ``PretrainedConfig``.
    """
    require("transformers.configuration_utils:PretrainedConfig._experts_implementation")
    config._experts_implementation = implementation


def patch_registry_module() -> ModuleType:
    """``transformers.monkey_patching``: transformers' own patch registry and ``apply_patches``.

    Checked against 5.15.1–5.24.0: ``apply_patches`` and ``patch_output_recorders`` read the registry through the
    module global ``get_patch_mapping`` at call time (``loading/build.py`` checks this and refuses otherwise).
    """
    require("transformers.monkey_patching:get_patch_mapping")
    module: ModuleType = require("transformers.monkey_patching")
    return module


# --- Finalising a loaded model ------------------------------------------------------------------------------------


def tied_weight_keys(model: PreTrainedModel) -> dict[str, str]:
    """``{tied parameter: its source}`` by the model's tying rules (empty for a model that ties nothing).

    Checked against 5.15.1–5.24.0: ``PreTrainedModel.all_tied_weights_keys``, set when the model is built.
    """
    return dict(getattr(model, "all_tied_weights_keys", None) or {})


def mark_initialized(tensor: torch.Tensor) -> None:
    """Tell transformers' initialisation to leave ``tensor`` alone (it holds loaded data).

    Checked against 5.15.1–5.24.0: the ``_is_hf_initialized`` flag ``_initialize_missing_keys`` honours.
    """
    # transformers' marker attribute on tensors, unknown to torch's stubs.
    tensor._is_hf_initialized = True  # type: ignore[attr-defined]


def initialize_missing(model: PreTrainedModel, missing: set[str], device: torch.device) -> None:
    """Stock's finalisation of a loaded model: what the checkpoint did not fill (non-persistent buffers, new
    parameters) is moved off the meta device onto ``device`` and initialised, then weights are tied.

    Checked against 5.15.1–5.24.0: ``_move_missing_keys_from_meta_to_device(missing, device_map, device_mesh,
    hf_quantizer)``, ``_initialize_missing_keys(is_quantized=...)``, ``tie_weights(missing_keys=...,
    recompute_mapping=...)``.
    """
    require("transformers.modeling_utils:PreTrainedModel._move_missing_keys_from_meta_to_device")
    require("transformers.modeling_utils:PreTrainedModel._initialize_missing_keys")
    require("transformers.modeling_utils:PreTrainedModel.tie_weights")
    tied = tied_weight_keys(model)
    for key in tied:
        mark_initialized(model.get_parameter(key))
    # transformers annotates a list but subtracts a dict's keys from it: it needs a set.
    model._move_missing_keys_from_meta_to_device(missing, {"": device}, None, None)  # type: ignore[arg-type]
    if not missing - set(tied):
        _mark_loaded_modules(model)
    model._initialize_missing_keys(is_quantized=False)
    model.tie_weights(missing_keys=missing, recompute_mapping=False)


def _mark_loaded_modules(model: torch.nn.Module) -> None:
    """Flag every module whose whole subtree was loaded as initialised, so that transformers' initialisation walk
    calls ``_init_weights`` only where a tensor still needs it (the non-persistent buffers just made, rotary
    ``inv_freq`` say).

    On a loaded module ``_init_weights`` changes nothing: transformers' init functions leave a tensor flagged as
    loaded alone. Calling it costs a walk of config lookups per module, most of the finalisation. Only for loads
    with nothing new to initialise: some ``_init_weights`` draw random numbers before their guarded write, and a new
    parameter must be drawn from the generator state stock reaches at it. Stock flags every module it walked, so
    the end state is the same.

    Checked against 5.15.1–5.24.0: the module-level ``_is_hf_initialized`` flag ``_initialize_missing_keys`` skips.
    """

    def loaded(module: torch.nn.Module) -> bool:
        # Every child is visited (no short-circuit): each flags itself.
        children = [loaded(child) for child in module.children()]
        tensors = (*module._parameters.values(), *module._buffers.values())
        if all(children) and all(getattr(t, "_is_hf_initialized", False) for t in tensors if t is not None):
            # What transformers sets on every module it initialised.
            # A plain attribute (not a tensor or module), which torch's stubs for Module.__setattr__ do not allow for.
            module._is_hf_initialized = True  # type: ignore[assignment]
            return True
        return False

    loaded(model)


def keys_to_ignore_on_load(model: PreTrainedModel, kind: str) -> list[str]:
    """The patterns of keys stock loads without a warning: ``kind`` "missing" or "unexpected".

    Checked against 5.15.1–5.24.0: ``_keys_to_ignore_on_load_missing`` / ``_keys_to_ignore_on_load_unexpected``.
    """
    require(
        "transformers.modeling_utils:PreTrainedModel._keys_to_ignore_on_load_missing"
        if kind == "missing"
        else "transformers.modeling_utils:PreTrainedModel._keys_to_ignore_on_load_unexpected"
    )
    return list(getattr(model, f"_keys_to_ignore_on_load_{kind}", None) or [])


def no_split_modules(model: PreTrainedModel) -> list[str]:
    """The class names a device map must keep whole on one device, sorted.

    Checked against 5.15.1–5.24.0: ``PreTrainedModel._no_split_modules`` (the class attribute; sub-models' are merged
    by transformers into the top model's).
    """
    require("transformers.modeling_utils:PreTrainedModel._no_split_modules")
    return sorted(getattr(model, "_no_split_modules", None) or [])


def skip_keys_device_placement(model: PreTrainedModel) -> str | list[str] | None:
    """The state keys a dispatch leaves where they are (a cache buffer, say), as stock passes them to accelerate.

    Checked against 5.15.1–5.24.0: ``PreTrainedModel._skip_keys_device_placement`` (a class attribute; its default is
    None up to 5.23, ``["cache"]`` from 5.24 on).
    """
    require("transformers.modeling_utils:PreTrainedModel._skip_keys_device_placement")
    return getattr(model, "_skip_keys_device_placement", None)


def has_transformers_adapter(model: PreTrainedModel) -> bool:
    """Whether an adapter was loaded through transformers' own PEFT integration (``model.load_adapter``).

    Checked against 5.15.1–5.24.0: ``_hf_peft_config_loaded``.
    """
    require("transformers.modeling_utils:PreTrainedModel._hf_peft_config_loaded")
    return bool(getattr(model, "_hf_peft_config_loaded", False))


# --- Output recorders ---------------------------------------------------------------------------------------------


def output_recorder_class() -> type[OutputRecorder]:
    """transformers' ``OutputRecorder`` (the dataclass naming a recorded class and the output index it reads).

    Checked against 5.15.1–5.24.0: ``transformers.utils.output_capturing.OutputRecorder``.
    """
    recorder: type[OutputRecorder] = require("transformers.utils.output_capturing:OutputRecorder")
    return recorder


def recorded_outputs(model_class: type) -> dict[str, Any] | None:
    """The model class's ``{output name: class or OutputRecorder (or a list)}``, the dict itself (None if it has none).

    Checked against 5.15.1–5.24.0: the ``_can_record_outputs`` class attribute; hooks are attached by class at the
    first forward that asks for those outputs.
    """
    require("transformers.modeling_utils:PreTrainedModel._can_record_outputs")
    specs = getattr(model_class, "_can_record_outputs", None)
    return specs if isinstance(specs, dict) else None


# --- Auto classes -------------------------------------------------------------------------------------------------


def is_auto_class(value: object) -> TypeGuard[type[_BaseAutoModelClass]]:
    """Whether ``value`` is one of transformers' Auto model classes (``AutoModelForCausalLM``, ...).

    Checked against 5.15.1–5.24.0: they subclass ``transformers.models.auto.auto_factory._BaseAutoModelClass``.
    """
    base = require("transformers.models.auto.auto_factory:_BaseAutoModelClass")
    return isinstance(value, type) and issubclass(value, base)


def auto_model_class(auto_class: type[_BaseAutoModelClass], config: PretrainedConfig) -> type[PreTrainedModel] | None:
    """The concrete class ``auto_class`` builds for ``config``, as its ``from_config`` picks it; None when it maps no
    class to that config's type.

    Checked against 5.15.1–5.24.0: ``auto_class._model_mapping`` (keyed by config class) and
    ``auto_factory._get_model_class`` (which chooses among several architectures by ``config.architectures``).
    """
    require("transformers.models.auto.auto_factory:_BaseAutoModelClass._model_mapping")
    mapping = auto_class._model_mapping
    if mapping is None or type(config) not in mapping:
        return None
    model_class: type[PreTrainedModel] = require("transformers.models.auto.auto_factory:_get_model_class")(
        config, mapping
    )
    return model_class


def model_class_names_for(model_type: str) -> list[str]:
    """Every model class name transformers' Auto mappings give ``model_type`` (base model and task heads), sorted.

    Checked against 5.15.1–5.24.0: the ``MODEL*_MAPPING_NAMES`` dicts of ``transformers.models.auto.modeling_auto``
    (values: a class name, or a tuple of them).
    """
    modeling_auto = require("transformers.models.auto.modeling_auto")
    found: set[str] = set()
    for attribute in dir(modeling_auto):
        if attribute.startswith("MODEL") and attribute.endswith("MAPPING_NAMES"):
            value = getattr(modeling_auto, attribute).get(model_type)
            found.update([value] if isinstance(value, str) else value or ())
    return sorted(found)


# --- Conversions --------------------------------------------------------------------------------------------------


def conversion_mapping_cache() -> dict[str, list[Any]]:
    """transformers' conversion registry, every key (model types, class names, ``"legacy"``), built if need be.

    Checked against 5.15.1–5.24.0: ``conversion_mapping._checkpoint_conversion_mapping_cache``, filled on the first
    ``get_checkpoint_conversion_mapping`` call and by ``register_checkpoint_conversion_mapping``.
    """
    conversion_mapping_of("legacy")
    cache: dict[str, list[Any]] = require("transformers.conversion_mapping:_checkpoint_conversion_mapping_cache")
    return cache


def conversion_mapping_of(key: str) -> list[Any] | None:
    """transformers' own conversion mapping for ``key`` (a model type, a class name or ``"legacy"``), a copy; None
    when it has none.

    Checked against 5.15.1–5.24.0: ``conversion_mapping.get_checkpoint_conversion_mapping(key)``.
    """
    mapping: list[Any] | None = require("transformers.conversion_mapping:get_checkpoint_conversion_mapping")(key)
    return mapping


def user_registered_in_transformers(key: str) -> bool:
    """Whether ``key`` was registered through transformers' own ``register_checkpoint_conversion_mapping``.

    Checked against 5.15.1–5.24.0: ``conversion_mapping.USER_REGISTERED_MAPPINGS`` (keys registered by users).
    """
    return key in require("transformers.conversion_mapping:USER_REGISTERED_MAPPINGS")


def original_patterns(transform: Any) -> tuple[list[str], list[str]]:
    """The source and target patterns a transformers transform was constructed with.

    Checked against 5.15.1–5.24.0: ``WeightTransform._original_source_patterns`` / ``_original_target_patterns``; its
    public ``source_patterns`` / ``target_patterns`` are rewritten in place (anchors, capture groups).
    """
    require("transformers.core_model_loading:WeightTransform._original_source_patterns")
    require("transformers.core_model_loading:WeightTransform._original_target_patterns")
    return list(transform._original_source_patterns), list(transform._original_target_patterns)


# --- Quantizers ---------------------------------------------------------------------------------------------------


def quantizer_for(config: PretrainedConfig, quantization_config: Any, device_map: Any) -> Any:
    """The ``HfQuantizer`` stock ``from_pretrained`` would use, after its environment checks.

    Checked against 5.15.1–5.24.0: ``get_hf_quantizer(config, quantization_config, device_map, weights_only,
    user_agent)`` returns ``(quantizer, config, device_map)``.
    """
    get_hf_quantizer = require("transformers.quantizers.auto:get_hf_quantizer")
    quantizer, _, _ = get_hf_quantizer(config, quantization_config, device_map, True, {})
    return quantizer


def weight_conversions_of(quantizer: Any, model: PreTrainedModel) -> Sequence[Any]:
    """The weight conversions the quantizer adds to a model that has none of its own.

    Checked against 5.15.1–5.24.0: ``HfQuantizer.update_weight_conversions(conversions, model)``; before 5.21 it
    takes the conversions alone (it did not yet look at the model's parameters).
    """
    require("transformers.quantizers:HfQuantizer.update_weight_conversions")
    if "model" in inspect.signature(quantizer.update_weight_conversions).parameters:
        return quantizer.update_weight_conversions([], model)
    return quantizer.update_weight_conversions([])


# --- Tensor parallelism -------------------------------------------------------------------------------------------


def tensor_parallel_supported() -> bool:
    """Whether this transformers has the distributed API modelpatch's tensor-parallel loads drive.

    Checked against 5.15.1–5.24.0: ``PreTrainedModel._resolve_parallel_plans`` and ``prepare_distribute_model``
    (5.15-5.22 have the second only, with another ``DistributedConfig``).
    """
    return available("transformers.modeling_utils:PreTrainedModel._resolve_parallel_plans") and available(
        "transformers.modeling_utils:PreTrainedModel.prepare_distribute_model"
    )


def register_parallel_style(name: str, style: object) -> None:
    """Make ``style`` (a ``TensorParallelLayer``) the parallel style a TP plan names ``name``, for every model.

    Checked against 5.22.2–5.24.0: ``transformers.distributed.parallel_utils.ALL_PARALLEL_STYLES.register`` (a
    ``GeneralInterface`` class-level mapping), which ``apply_tensor_parallelism`` and the plan validation read.
    """
    require("transformers.distributed.parallel_utils:ALL_PARALLEL_STYLES").register(name, style)


def parallel_style_names() -> frozenset[str]:
    """The names a TP plan may give as styles: every parallel style registered (transformers' and modelpatch's).

    Checked against 5.23.0: ``transformers.distributed.parallel_utils.ALL_PARALLEL_STYLES`` (a ``GeneralInterface``),
    filled when ``transformers.distributed.tensor_parallel`` and ``expert_parallel`` are imported.
    """
    importlib.import_module("transformers.distributed.tensor_parallel")
    importlib.import_module("transformers.distributed.expert_parallel")
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    return frozenset(ALL_PARALLEL_STYLES.valid_keys())


def generic_module_name(name: str) -> str:
    """``name`` with its layer numbers replaced by ``*`` (``model.layers.*.mlp``), as TP plans name modules.

    Checked against 5.23.0–5.24.0: ``transformers.distributed.parallel_utils.replace_layer_number_by_wildcard`` (in
    ``tensor_parallel`` in 5.22, whose tensor-parallel loads modelpatch refuses).
    """
    generic: str = require("transformers.distributed.parallel_utils:replace_layer_number_by_wildcard")(name)
    return generic


def prepare_distributed(config: DistributedConfig) -> tuple[Any, torch.device] | None:
    """The mesh manager (a ``TransformersDeviceMesh``) and this rank's device for a distributed load, made as stock
    ``from_pretrained`` makes them (``torch.distributed`` initialised if need be); None where nothing is sharded.

    Checked against 5.22.2–5.24.0: the classmethod ``PreTrainedModel.prepare_distribute_model(distributed_config,
    device_map=None)`` returns ``(config, device, mesh_manager)``, the device a ``torch.device`` when there is a
    mesh.
    """
    require("transformers.modeling_utils:PreTrainedModel.prepare_distribute_model")
    _, device, mesh_manager = PreTrainedModel.prepare_distribute_model(config)
    if mesh_manager is None:
        return None
    if not isinstance(device, torch.device | str | int):
        raise TypeError(f"transformers prepared a distributed load on device {device!r}, not a torch device.")
    return mesh_manager, torch.device(device)


def mark_distributed(model: PreTrainedModel, config: DistributedConfig, mesh_manager: Any) -> None:
    """Set on ``model`` what stock sets on a model it shards while loading (its saves and generation read them).

    Checked against 5.23.0–5.24.0: ``DistributedMixin.maybe_distribute_model`` sets ``config.distributed_config``,
    ``_mesh_manager``, ``_device_mesh`` (the ``("pp", "fsdp", "tp")`` mesh),
    ``_is_distributed_loading_by_transformers``, ``_tp_size`` and ``_fsdp_size``.
    """
    for path in (
        "transformers.modeling_utils:PreTrainedModel._mesh_manager",
        "transformers.modeling_utils:PreTrainedModel._device_mesh",
        "transformers.modeling_utils:PreTrainedModel._is_distributed_loading_by_transformers",
        "transformers.modeling_utils:PreTrainedModel._tp_size",
        "transformers.modeling_utils:PreTrainedModel._fsdp_size",
    ):
        require(path)
    model.config.distributed_config = config
    model._mesh_manager = mesh_manager
    model._device_mesh = mesh_manager.get_mesh(("pp", "fsdp", "tp"))
    model._is_distributed_loading_by_transformers = True
    # transformers declares these two `= None` on the mixin, with no type.
    model._tp_size = config.tp_size  # type: ignore[assignment]
    model._fsdp_size = config.fsdp_size  # type: ignore[assignment]


def set_tp_plan(model: PreTrainedModel, plan: dict[str, str]) -> None:
    """Make ``plan`` (generic names: ``layers.*.self_attn.q_proj``) the model's TP plan, as is (no validation).

    Checked against 5.23.0–5.24.0: the ``_tp_plan`` instance attribute behind ``DistributedMixin.tp_plan`` (whose
    setter validates and warns; ``resolved_tp_plan`` validates).
    """
    require("transformers.modeling_utils:PreTrainedModel._tp_plan")
    model._tp_plan = plan


def resolved_tp_plan(model: PreTrainedModel, tp_size: int) -> dict[str, str]:
    """The model's TP plan as stock resolves it for ``tp_size`` ranks: validated, one entry per concrete module or
    parameter name (layer numbers in place of ``*``).

    Checked against 5.23.0–5.24.0: ``DistributedMixin._resolve_parallel_plans(DistributedConfig)`` returns
    ``(tp_plan, ep_plan, fsdp_plan)``; with ``tp_plan="auto"`` it overrides nothing.
    """
    require("transformers.modeling_utils:PreTrainedModel._resolve_parallel_plans")
    tp_plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_plan="auto", tp_size=tp_size))
    return tp_plan


def resolved_fsdp_plan(model: PreTrainedModel, config: DistributedConfig) -> dict[str, str]:
    """The model's FSDP plan as stock resolves it for ``config`` (FSDP2 or HSDP): one entry per concrete module
    (``fully_shard`` unit) to its style, innermost first, tied embeddings folded and float32 modules in their own
    units, as stock's ``maybe_distribute_model`` applies it.

    Checked against 5.24.0–5.24.0 (read in that release only): ``DistributedMixin._resolve_parallel_plans`` returns
    ``(tp_plan, ep_plan, fsdp_plan)``; its errors (a model without an FSDP plan) are ``ValueError``.
    """
    require("transformers.modeling_utils:PreTrainedModel._resolve_parallel_plans")
    _, _, fsdp_plan = model._resolve_parallel_plans(config)
    return fsdp_plan


def apply_fully_sharded(model: PreTrainedModel, mesh_manager: Any, fsdp_plan: dict[str, str]) -> None:
    """``fully_shard`` the meta-device ``model`` as stock does at load: each module of the resolved ``fsdp_plan``
    (reshard after forward or not, by its style; the final norm and head as one unit), then the root, over the
    ``fsdp`` mesh, or ``("dp_replicate", "fsdp")`` for HSDP; with the policies of ``model.config.distributed_config``.

    Checked against 5.24.0–5.24.0 (read in that release only): ``apply_fully_sharded_data_parallelism(model,
    mesh_manager, fsdp_plan, ep_plan)``, which reads ``model.config.distributed_config`` (``mark_distributed``).
    """
    require("transformers.distributed.fsdp:apply_fully_sharded_data_parallelism")(model, mesh_manager, fsdp_plan, {})


def apply_tensor_parallel(model: PreTrainedModel, mesh: DeviceMesh, tp_plan: dict[str, str]) -> None:
    """Shard the meta-device ``model`` by the resolved ``tp_plan``: ``DTensor`` placeholders and forward hooks.

    Checked against 5.23.0–5.24.0: ``transformers.distributed.tensor_parallel.apply_tensor_parallelism(model, tp_mesh,
    tp_plan)``, which shards in place.
    """
    require("transformers.distributed.tensor_parallel:apply_tensor_parallelism")(model, mesh, tp_plan)


def local_shard(placeholder: DTensor, tensor: torch.Tensor, index: int | None = None) -> torch.Tensor | None:
    """This rank's shard of the full ``tensor`` of the sharded parameter ``placeholder`` (a view where slicing is
    enough); with ``index``, of the ``index``-th slice along dim 0 (one expert), None if this rank does not own it.

    Checked against 5.23.0–5.24.0: ``transformers.distributed.sharding_utils.DtensorShardOperation(param)
    .shard_tensor(source, tensor_idx=...)``.
    """
    operation = require("transformers.distributed.sharding_utils:DtensorShardOperation")(placeholder)
    shard: torch.Tensor | None = operation.shard_tensor(tensor, tensor_idx=index)
    return shard


def device_mesh_of(model: torch.nn.Module) -> DeviceMesh | None:
    """The ``("pp", "fsdp", "tp")`` device mesh of a model sharded while loading (None for any other model).

    Checked against 5.22.2–5.24.0: the ``_device_mesh`` attribute ``maybe_distribute_model`` sets
    (``mark_distributed``).
    """
    require("transformers.modeling_utils:PreTrainedModel._device_mesh")
    return getattr(model, "_device_mesh", None)
