"""The one door to PEFT's private API: every private PEFT name modelpatch's PEFT integration uses, one small function
each (the same shape as :mod:`modelpatch._transformers`, the door to transformers).

``integrations/peft.py`` runs stock PEFT on fused models, which takes a few of PEFT's internals: names that live
only in its submodules (``peft.tuners.lora.Linear``, ``peft.tuners.tuners_utils``, ``peft.utils.constants``,
``peft.mapping``, ``peft.utils.transformers_weight_conversion``) and underscore members
(``LoraConfig._register_custom_module``, ``Linear._get_in_out_features``, a tuner's ``_prepare_adapter_config``,
``_maybe_include_all_linear_layers`` (called, and recognised as the caller of ``get_output_embeddings``)). They
are all reached through this module, so moving to another PEFT release means auditing this one file.

:data:`PRIVATE_API` lists every such name, where it lives, the first release that has it and the feature that needs
it. Each function resolves the names it needs when it is called (:func:`require`): PEFT is imported only then (it is
an optional dependency), and on a release that dropped or moved a name, only the feature needing it is refused, with a
:class:`~modelpatch.errors.PeftVersionError` naming the release, the name, the feature and the checked releases.
``tests/test_peft_door.py`` fails if a private PEFT name is used anywhere else, or is used here unlisted.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import inspect
from collections.abc import Iterator, Mapping
from types import FrameType
from typing import Any, NamedTuple

from torch import nn

from ._doors import Door, private_api
from .errors import PeftVersionError

# The PEFT releases the door was read against and the suite exercises ("Checked against" in the functions below);
# pyproject.toml's ``peft`` extra requires the first of them.
CHECKED = ("0.21.2",)

# Every private name of PEFT the door relies on, by the feature that needs it: "module:attribute path" (no attribute:
# the module itself), each in the first PEFT release modelpatch supports. PRIVATE_API: path -> (that release, feature).
PRIVATE_API: dict[str, tuple[str, str]] = private_api(
    "0.21",
    {
        "LoRA on the original names of fused projections": [
            "peft.tuners.lora:Linear",
            "peft.tuners.lora:Linear._get_in_out_features",
            "peft.tuners.lora:LoraConfig._register_custom_module",
        ],
        'LoRA on "all-linear" of a fused model': [
            "peft.utils.constants:INCLUDE_LINEAR_LAYERS_SHORTHAND",
            "peft.tuners.tuners_utils:_maybe_include_all_linear_layers",
        ],
        "adapters on a fused model (which modules)": ["peft.tuners.tuners_utils:check_target_module_exists"],
        "adapters on a fused model (defaults)": ["peft.tuners.tuners_utils:BaseTuner._prepare_adapter_config"],
        "LoRA on a linear_experts model (PEFT's transformers-v5 expert targets)": [
            "peft.utils.transformers_weight_conversion:convert_peft_config_for_transformers"
        ],
        "load_adapter on a linear_experts model": [
            "peft.mapping:PEFT_TYPE_TO_PREFIX_MAPPING",
            "peft.utils.constants:SAFETENSORS_WEIGHTS_NAME",
        ],
        "LoRA on a linear_experts model (ranks of the experts)": ["peft.utils.other:get_pattern_key"],
        "LoRA on a linear_experts model (experts only)": ["peft.utils.constants:DUMMY_TARGET_MODULES"],
        "LoRA on a linear_experts model (the experts' layer)": [
            "peft.tuners.lora:LoraLayer",
            "peft.tuners.lora:LoraLayer._get_in_out_features",
        ],
        "the merged weights of a LoRA model streamed": [
            "peft.tuners.tuners_utils:BaseTunerLayer",
            "peft.tuners.lora:Embedding",
            "peft.tuners.lora:ParamWrapper",
            "peft.utils.other:AuxiliaryTrainingWrapper",
        ],
        "a further adapter on a linear_experts model": [
            "peft.tuners.lora:ParamWrapper",
            "peft.tuners.tuners_utils:BaseTunerLayer._active_adapter",
            "peft.tuners.tuners_utils:BaseTunerLayer._disable_adapters",
        ],
    },
)


_DOOR = Door(
    PRIVATE_API,
    PeftVersionError,
    lambda: f"PEFT {import_peft().__version__}",
    f"; modelpatch's PEFT integration was checked against PEFT {', '.join(CHECKED)}. Install one of those: "
    f"pip install 'peft=={CHECKED[-1]}'.",
)


def require(path: str) -> Any:
    """The private name ``path`` of :data:`PRIVATE_API` ("module:attribute"), looked up now (PEFT imported here).

    Raises:
        PeftVersionError: the installed PEFT lacks it (named, with the feature that needs it).
        ImportError: PEFT is not installed.
    """
    import_peft()
    return _DOOR.require(path)


def import_peft() -> Any:
    """``peft`` itself, imported now.

    Raises:
        ImportError: PEFT is not installed (saying how to install it).
    """
    try:
        import peft
    except ImportError as error:
        raise ImportError("modelpatch's PEFT integration needs PEFT: pip install peft") from error
    return peft


@functools.cache
def lora_linear() -> Any:
    """PEFT's LoRA ``Linear`` layer, as a base whose public hook ``base_features(module)`` sizes a base layer PEFT
    does not know (``(in_features, out_features)``, or None for PEFT's own answer).

    Checked against 0.21.2: ``peft.tuners.lora.Linear._get_in_out_features(module)`` is where the layer reads its
    base layer's sizes.
    """
    base = require("peft.tuners.lora:Linear")
    require("peft.tuners.lora:Linear._get_in_out_features")
    return _sized_by_hook(base, "LoraLinear")


def _sized_by_hook(base: type, name: str) -> type:
    """A subclass ``name`` of ``base``, a LoRA layer class of the installed PEFT that reads its base layer's sizes in
    ``_get_in_out_features(module)``, that asks its public hook ``base_features(module)`` first."""

    class Sized(base):  # base: a class of the installed PEFT
        def base_features(self, module: nn.Module) -> tuple[int, int] | None:
            return None

        def _get_in_out_features(self, module: nn.Module) -> tuple[int, int] | tuple[None, None]:
            features = self.base_features(module)
            return features if features is not None else super()._get_in_out_features(module)

    Sized.__name__ = Sized.__qualname__ = name
    return Sized


def register_custom_lora_module(config: Any, mapping: Mapping[type[nn.Module], type[nn.Module]]) -> None:
    """Make ``config`` (a ``LoraConfig``) build ``mapping[type(base)]`` as the LoRA layer of such base layers.

    Checked against 0.21.2: ``LoraConfig._register_custom_module(mapping)``.
    """
    require("peft.tuners.lora:LoraConfig._register_custom_module")
    config._register_custom_module(dict(mapping))


def all_linear_shorthand() -> str:
    """The ``target_modules`` value that means every linear layer (``"all-linear"``).

    Checked against 0.21.2: ``peft.utils.constants.INCLUDE_LINEAR_LAYERS_SHORTHAND``.
    """
    return str(require("peft.utils.constants:INCLUDE_LINEAR_LAYERS_SHORTHAND"))


# Set while modelpatch itself runs PEFT's resolution of "all-linear" (to replace the fused layers it finds by their
# parts): the resolution stock PEFT runs on a fused model is refused (see resolves_all_linear), modelpatch's is not.
_MODELPATCH_RESOLVES: contextvars.ContextVar[bool] = contextvars.ContextVar("modelpatch_resolves", default=False)


@contextlib.contextmanager
def _resolving_for_modelpatch() -> Iterator[None]:
    token = _MODELPATCH_RESOLVES.set(True)
    try:
        yield
    finally:
        _MODELPATCH_RESOLVES.reset(token)


def modelpatch_resolves() -> bool:
    """Whether the current call runs inside modelpatch's own use of PEFT's ``"all-linear"`` resolution
    (:func:`include_all_linear_layers`, :func:`convert_config_for_transformers`)."""
    return _MODELPATCH_RESOLVES.get()


def include_all_linear_layers(config: Any, model: nn.Module) -> None:
    """Resolve ``"all-linear"`` in ``config.target_modules`` in place, as PEFT does when it injects an adapter.

    Checked against 0.21.2: ``peft.tuners.tuners_utils._maybe_include_all_linear_layers(config, model)``.
    """
    resolve = require("peft.tuners.tuners_utils:_maybe_include_all_linear_layers")
    with _resolving_for_modelpatch():
        resolve(config, model)


def runs_peft(frame: FrameType) -> bool:
    """Whether ``frame`` runs code of a PEFT module (told by its globals' module name: PEFT is not imported)."""
    return str(frame.f_globals.get("__name__", "")).startswith("peft.")


def resolves_all_linear(frame: FrameType) -> bool:
    """Whether ``frame`` is PEFT resolving ``"all-linear"`` (every PEFT method does it there, also inside its
    transformers-v5 target rewrite), before any adapter layer is made. PEFT is not imported for a frame that is not
    PEFT's.

    Checked against 0.21.2: ``peft.tuners.tuners_utils._maybe_include_all_linear_layers(peft_config, model)`` calls
    ``model.get_output_embeddings()`` of a transformers model (to leave the output embedding out) after collecting
    the Linear layers and before setting ``target_modules``.

    Raises:
        PeftVersionError: ``frame`` runs PEFT code and the installed PEFT has no such function (its resolution
            cannot be recognised).
    """
    if not runs_peft(frame):
        return False
    resolve = require("peft.tuners.tuners_utils:_maybe_include_all_linear_layers")
    return frame.f_code is resolve.__code__


def saves_adapter(frame: FrameType | None) -> bool:
    """Whether ``frame`` or one of its callers is PEFT collecting an adapter's weights to save them. PEFT is not
    imported for a call stack that runs no PEFT code.

    Checked against 0.21.2: ``PeftModel.save_pretrained`` (and every other save of PEFT's) takes the weights from
    ``peft.get_peft_model_state_dict(model)``, which calls ``model.state_dict()``.
    """
    return _runs_within(frame, "get_peft_model_state_dict")


def loads_adapter(frame: FrameType | None) -> bool:
    """Whether ``frame`` or one of its callers is PEFT putting an adapter's saved weights into a model. PEFT is not
    imported for a call stack that runs no PEFT code.

    Checked against 0.21.2: ``PeftModel.from_pretrained`` and ``PeftModel.load_adapter`` load the weights with
    ``peft.set_peft_model_state_dict(model, weights)``, which calls ``model.load_state_dict(..., strict=False)``.
    """
    return _runs_within(frame, "set_peft_model_state_dict")


def _runs_within(frame: FrameType | None, function: str) -> bool:
    """Whether ``frame`` or one of its callers runs the public PEFT function ``peft.<function>``."""
    while frame is not None:
        if runs_peft(frame) and frame.f_code is getattr(import_peft(), function).__code__:
            return True
        frame = frame.f_back
    return False


def targets_module(config: Any, name: str) -> bool:
    """Whether PEFT adapts the module named ``name`` with ``config``.

    Checked against 0.21.2: ``peft.tuners.tuners_utils.check_target_module_exists(config, name)``.
    """
    return bool(require("peft.tuners.tuners_utils:check_target_module_exists")(config, name))


def default_target_modules(config: Any, model_type: str | None) -> Any:
    """The ``target_modules`` PEFT fills in for ``config`` (which has none) on a ``model_type`` model, or None (PEFT
    then asks for them itself; prompt learning has no target modules).

    Checked against 0.21.2: most tuners read their ``target_module_mapping`` table; a few (IA3) fill the config in a
    static ``BaseTuner._prepare_adapter_config(config, model_config)`` of their own.
    """
    peft = import_peft()
    tuner = peft.PEFT_TYPE_TO_TUNER_MAPPING.get(peft.PeftType(config.peft_type)) if config.peft_type else None
    if tuner is None:
        return None
    require("peft.tuners.tuners_utils:BaseTuner._prepare_adapter_config")
    prepare = inspect.getattr_static(tuner, "_prepare_adapter_config")
    if isinstance(prepare, staticmethod):
        try:
            return prepare.__func__(copy.deepcopy(config), {"model_type": model_type}).target_modules
        except ValueError:
            return None
    return getattr(tuner, "target_module_mapping", {}).get(model_type)


def convert_config_for_transformers(config: Any, model: nn.Module) -> None:
    """Apply PEFT's rewrite of LoRA targets for transformers v5 MoE layouts to ``config``, in place.

    Checked against 0.21.2: ``peft.utils.transformers_weight_conversion.convert_peft_config_for_transformers(config,
    model=, conversions=None)``.
    """
    convert = require("peft.utils.transformers_weight_conversion:convert_peft_config_for_transformers")
    with _resolving_for_modelpatch():  # it resolves "all-linear" for some model types
        convert(config, model=model, conversions=None)


def adapter_parameter_prefix(config: Any) -> str:
    """The prefix of an adapter's parameter names for ``config``'s method (``lora_``).

    Checked against 0.21.2: ``peft.mapping.PEFT_TYPE_TO_PREFIX_MAPPING[PeftType]``.
    """
    peft = import_peft()
    return str(require("peft.mapping:PEFT_TYPE_TO_PREFIX_MAPPING")[peft.PeftType(config.peft_type)])


def adapter_weights_name() -> str:
    """The file name PEFT saves an adapter's weights under in safetensors (``adapter_model.safetensors``).

    Checked against 0.21.2: ``peft.utils.constants.SAFETENSORS_WEIGHTS_NAME``.
    """
    return str(require("peft.utils.constants:SAFETENSORS_WEIGHTS_NAME"))


def pattern_key(patterns: Any, key: str) -> str:
    """The key of ``patterns`` (a ``rank_pattern`` / ``alpha_pattern``) that PEFT applies to the module or parameter
    named ``key``, or ``key`` itself when none does.

    Checked against 0.21.2: ``peft.utils.other.get_pattern_key(pattern_keys, key)``.
    """
    return str(require("peft.utils.other:get_pattern_key")(list(patterns), key))


def dummy_target_modules() -> str:
    """The ``target_modules`` value with which PEFT injects no module and raises nothing (``"dummy-target-modules"``).

    Checked against 0.21.2: ``peft.utils.constants.DUMMY_TARGET_MODULES``.
    """
    return str(require("peft.utils.constants:DUMMY_TARGET_MODULES"))


@functools.cache
def lora_layer() -> Any:
    """PEFT's ``LoraLayer``: the tuner-layer base of its LoRA layers (what PEFT's merge, unload, adapter switching,
    save and load recognise), for a LoRA layer of modelpatch's own; its public hook ``base_features(module)`` sizes
    the base layer (``(in_features, out_features)``, or None for PEFT's own answer), as in :func:`lora_linear`.

    Checked against 0.21.2: ``peft.tuners.lora.LoraLayer(base_layer)`` sets up the adapter dicts and reads the sizes
    through ``_get_in_out_features``.
    """
    base = require("peft.tuners.lora:LoraLayer")
    require("peft.tuners.lora:LoraLayer._get_in_out_features")
    return _sized_by_hook(base, "LoraLayer")


class LoraMergeLayers(NamedTuple):
    """The classes of PEFT's layers a stream of merged weights tells apart (:mod:`modelpatch.boundary.peft_merge`)."""

    tuner: type  # every adapter layer of every PEFT method (BaseTunerLayer)
    linear: type  # LoRA of a Linear: merged as ``weight += delta`` (the add in the two dtypes' common one)
    embedding: type  # LoRA of an Embedding: merged as ``weight += delta.to(weight.dtype)``
    parameter: type  # LoRA of a parameter (target_parameters, ParamWrapper): ``parameter += delta``
    auxiliary: type  # modules_to_save / trainable tokens wrappers (AuxiliaryTrainingWrapper)


@functools.cache
def lora_merge_layers() -> LoraMergeLayers:
    """PEFT's layer classes whose merge a stream of merged weights reproduces, and those it refuses.

    Checked against 0.21.2: ``peft.tuners.tuners_utils.BaseTunerLayer``, ``peft.tuners.lora.Linear`` / ``Embedding`` /
    ``ParamWrapper`` (each ``merge`` adds ``get_delta_weight(adapter)`` to its base tensor in place, the adapters
    listed in ``merged_adapters`` skipped), ``peft.utils.other.AuxiliaryTrainingWrapper``.
    """
    return LoraMergeLayers(
        require("peft.tuners.tuners_utils:BaseTunerLayer"),
        require("peft.tuners.lora:Linear"),
        require("peft.tuners.lora:Embedding"),
        require("peft.tuners.lora:ParamWrapper"),
        require("peft.utils.other:AuxiliaryTrainingWrapper"),
    )


def param_wrapper_holding(base_layer: nn.Module, layer: Any) -> Any:
    """A PEFT ``ParamWrapper`` of ``layer.parameter_name`` over ``base_layer`` (a stand-in holding the stock 3-D
    parameter) that holds ``layer``'s adapters, the very modules and settings, nothing drawn: what stock PEFT finds
    when it adds a further adapter to a parameter it already adapts, and extends with its own ``update_layer``.
    ``layer`` is a LoRA layer of that parameter with ``ParamWrapper``'s sizes (``in_features`` / ``out_features``
    as PEFT's wrapper holds them once made).

    Checked against 0.21.2: ``ParamWrapper.__init__`` sets ``parameter_name``, runs ``LoraLayer.__init__(base_layer)``
    (its sizes read from the parameter), sets ``fan_in_fan_out`` and the instance flag ``_did_swap_in_out_features``
    (the sizes swapped once for a 3-D parameter PEFT reads as ``[E, out, in]``; ``update_layer`` reads it), then draws
    its first adapter; the adapter switching state is ``BaseTunerLayer._active_adapter`` / ``_disable_adapters``.
    """
    wrapper_class = require("peft.tuners.lora:ParamWrapper")
    lora_base = require("peft.tuners.lora:LoraLayer")
    require("peft.tuners.tuners_utils:BaseTunerLayer._active_adapter")
    require("peft.tuners.tuners_utils:BaseTunerLayer._disable_adapters")
    wrapper = wrapper_class.__new__(wrapper_class)
    wrapper.parameter_name = layer.parameter_name
    nn.Module.__init__(wrapper)
    lora_base.__init__(wrapper, base_layer)
    wrapper.fan_in_fan_out = False
    wrapper.in_features, wrapper.out_features = layer.in_features, layer.out_features
    wrapper._did_swap_in_out_features = True  # the sizes are already the wrapper's
    for name in (*layer.adapter_layer_names, *layer.other_param_names, "lora_variant", "merged_adapters"):
        setattr(wrapper, name, getattr(layer, name))
    wrapper._active_adapter = layer._active_adapter
    wrapper._disable_adapters = layer._disable_adapters
    return wrapper
