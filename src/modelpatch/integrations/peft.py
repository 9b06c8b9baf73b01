"""PEFT on fused models, with stock PEFT doing the work.

* LoRA on the fused layers (``target_modules=["qkv_proj", "gate_up_proj"]``) needs nothing from modelpatch: they are
  ``nn.Linear`` subclasses, and the slices look the fused layer up at call time, so they run PEFT's wrapper.
* LoRA on the original names (``["q_proj", "v_proj"]``, ``"all-linear"``): :func:`get_peft_model`. The original
  names are :class:`ProjectionSlice` modules, which PEFT refuses; a LoRA layer class for them is registered on a copy
  of the config (``LoraConfig._register_custom_module``), and ``"all-linear"`` is resolved to the original names.
  The adapter then has the modules and state-dict keys it has on the stock model, so adapters move between both.
* An adapter saved from the stock model: :func:`load_adapter`.
* Stock PEFT's own ``"all-linear"`` on a fused model is refused (:mod:`modelpatch.boundary.adapters`): it would adapt
  the fused layers, names the original checkpoint lacks; the resolution here is let through.

``peft`` is imported on first use; modelpatch itself does not depend on it. Every private PEFT name is reached through
``modelpatch/_peft.py`` (the PEFT door).
"""

from __future__ import annotations

import copy
import functools
import logging
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

import torch
from safetensors import safe_open
from torch import nn

from .. import _peft as door
from ..checkpoint.json_file import MAX_CONFIG_BYTES, read_json
from ..errors import PeftIntegrationError
from ..fusions.linear_experts.modules import LinearExperts
from ..fusions.projections import ProjectionSlice
from ..modes.distributed import refuse_adapters

if TYPE_CHECKING:
    from peft import LoraConfig, PeftConfig, PeftMixedModel, PeftModel

logger = logging.getLogger(__name__)

# Prefix of the module names in the keys of a saved adapter (``base_model.model.<module>.lora_A.weight``).
_SAVED_KEY_PREFIX = "base_model.model."


@runtime_checkable
class _TargetsModules(Protocol):
    """A PEFT config whose tuner adapts modules by name (LoraConfig, IA3Config, ...): ``PeftConfig`` itself, the base
    of prompt-learning configs too, declares no ``target_modules``."""

    target_modules: Any


@functools.cache
def _slice_lora_class() -> type[nn.Module]:
    """The LoRA layer class for :class:`ProjectionSlice`, created on first use because it subclasses PEFT's."""

    class ProjectionSliceLoraLinear(door.lora_linear()):  # type: ignore[misc]  # a class of the installed PEFT
        """LoRA on one part of a fused projection.

        The forward is PEFT's: the slice's output (its part of the fused layer's output) plus the low-rank update.
        PEFT merges by changing ``base_layer.weight``, in place or (``safe_merge``) by assigning its ``.data``; a
        slice's weight is a view made at each access, so the assignment would be lost. Merge and unmerge therefore
        run PEFT's own code on a plain ``nn.Linear`` holding a copy of the slice's rows, then write the rows back.
        """

        base_layer: nn.Module  # PEFT's attribute: the layer adapted

        def base_features(self, module: nn.Module) -> tuple[int, int] | None:
            if isinstance(module, ProjectionSlice):
                return module.in_features, module.out_features
            return None

        def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
            with self._rows_as_linear():
                super().merge(safe_merge=safe_merge, adapter_names=adapter_names)

        def unmerge(self) -> None:
            with self._rows_as_linear():
                super().unmerge()

        @contextmanager
        def _rows_as_linear(self) -> Iterator[None]:
            # PEFT builds this layer over a ProjectionSlice only (the custom module mapping in _config_for).
            part = cast(ProjectionSlice, self.base_layer)
            weight, bias = _fused_parameters(part)
            rows = part.rows()
            rows_linear = nn.Linear(part.in_features, part.out_features, bias=bias is not None, device="meta")
            rows_linear.weight = nn.Parameter(weight.data[rows].clone(), requires_grad=False)
            if bias is not None:
                rows_linear.bias = nn.Parameter(bias.data[rows].clone(), requires_grad=False)
            self.base_layer = rows_linear
            try:
                yield
            finally:
                # Even after an error: PEFT's unsafe merge changes the weight in place before it can fail (a LoRA
                # bias without a base bias), and what it did must reach the fused layer as it would on stock.
                self.base_layer = part
                weight.data[rows] = rows_linear.weight.data
                if bias is not None:
                    bias.data[rows] = rows_linear.bias.data

    ProjectionSliceLoraLinear.__module__ = __name__
    ProjectionSliceLoraLinear.__qualname__ = ProjectionSliceLoraLinear.__name__
    return ProjectionSliceLoraLinear


def __getattr__(name: str) -> Any:
    # The layer class is created on first use; this makes it importable (and picklable) by name all the same.
    if name == "ProjectionSliceLoraLinear":
        return _slice_lora_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _fused_parameters(part: ProjectionSlice) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused layer's weight and bias, checked to be the plain matrix whose rows ``part.rows()`` index."""
    fused = part.fused
    weight, bias = getattr(fused, "weight", None), getattr(fused, "bias", None)
    shape = (sum(part.part_sizes), part.in_features)
    if not (isinstance(weight, torch.Tensor) and weight.is_floating_point() and tuple(weight.shape) == shape):
        raise PeftIntegrationError(
            f"Cannot merge LoRA into part {part.index} of {part.fused_name!r} ({type(fused).__name__}): its weight is "
            f"not a floating-point {list(shape)} matrix (a quantized layer packs it differently). Keep the adapter "
            "unmerged, or merge on an unquantized model."
        )
    return weight, bias


def _projection_slices(model: nn.Module) -> dict[str, ProjectionSlice]:
    return {name: module for name, module in model.named_modules() if isinstance(module, ProjectionSlice)}


def _expert_linears(model: nn.Module) -> list[str]:
    """Names of the per-expert Linears of ``linear_experts``: modules that the stock model does not have."""
    return [
        f"{name}.{child}"
        for name, experts in model.named_modules()
        if isinstance(experts, LinearExperts)
        for child, linear in experts.named_modules()
        if isinstance(linear, nn.Linear)
    ]


def _fused_layer_name(slice_name: str, part: ProjectionSlice) -> str:
    owner = slice_name.rpartition(".")[0]
    return f"{owner}.{part.fused_name}" if owner else part.fused_name


def _is_all_linear(target_modules: object) -> bool:
    return isinstance(target_modules, str) and target_modules.lower() == door.all_linear_shorthand()


def _model_type(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def _targeted_modules(config: PeftConfig, model: nn.Module, names: Iterable[str]) -> list[str]:
    """Which of ``names`` PEFT would adapt with ``config``."""
    if not isinstance(config, _TargetsModules):  # prompt learning: no target modules
        return []
    if config.target_modules is None:
        defaults = door.default_target_modules(config, _model_type(model))
        if defaults is None:
            return []
        config = copy.copy(config)
        config.target_modules = defaults if isinstance(defaults, str) else set(defaults)
    return [name for name in names if door.targets_module(config, name)]


def _convert_for_transformers_v5(config: LoraConfig, model: nn.Module) -> None:
    """Apply PEFT's rewrite of LoRA targets for transformers v5 MoE layouts now, in place.

    PEFT does it first thing when it injects an adapter (a no-op when repeated): for model types whose experts
    transformers fuses into 3-D parameters (qwen3_moe, mixtral, olmoe, ...; not qwen2_moe), ``gate_proj`` and the like
    become ``target_parameters``, and ``"all-linear"`` becomes leaf names plus the experts and the router. Done first,
    :func:`_resolve_all_linear` starts from what PEFT would, and a ``linear_experts`` model (per-expert Linears, no
    3-D expert parameters) is refused where those targets would silently adapt nothing.
    """
    before = set(config.target_parameters or ())
    door.convert_config_for_transformers(config, model)
    added = set(config.target_parameters or ()) - before
    if not added or not _expert_linears(model):
        return
    parameters = [name for name, _ in model.named_parameters()]
    lost = sorted(t for t in added if not any(p == t or p.endswith(f".{t}") for p in parameters))
    if lost:
        raise PeftIntegrationError(
            f"PEFT turns the expert targets of {_model_type(model)} models into targets of transformers' fused "
            f"3-D expert parameters {lost}, which this model does not have (linear_experts made them per-expert "
            "Linears): they would get no LoRA. Load the model without linear_experts to adapt its experts, or leave "
            "the expert projections out of target_modules."
        )


def _resolve_all_linear(config: PeftConfig, model: nn.Module, slices: dict[str, ProjectionSlice]) -> None:
    """Resolve ``"all-linear"`` in place to what PEFT resolves it to on the stock model.

    PEFT's own resolution on this model (every Linear but the output embedding and a classification head) finds
    the fused layers; each is replaced by its parts' original names, which are what the stock model has. Targets
    PEFT already turned into leaf names (see :func:`_convert_for_transformers_v5`) are swapped leaf for leaf.
    """
    if not isinstance(config, _TargetsModules):  # a prompt-learning config targets no module
        return
    if _is_all_linear(config.target_modules):
        door.include_all_linear_layers(config, model)
    targets = set(config.target_modules)
    resolved = set(targets)
    for name, part in slices.items():
        fused = _fused_layer_name(name, part)
        if fused in targets:
            resolved.discard(fused)
            resolved.add(name)
        if part.fused_name in targets:
            resolved.discard(part.fused_name)
            resolved.add(name.rpartition(".")[2])
    config.target_modules = resolved
    logger.debug("all-linear on a fused model: %s replaced by their parts", sorted(targets - resolved))


def _config_for(config: PeftConfig, model: nn.Module) -> PeftConfig:
    """The config to hand PEFT for ``model``.

    LoRA: a copy, with PEFT's transformers-v5 target rewrite applied, the slice layer class registered and
    ``"all-linear"`` resolved to the original names. Other methods: ``config`` itself, provided it targets no slice
    (they have no layer class for one).
    """
    slices = _projection_slices(model)
    if not slices and not _expert_linears(model):
        return config
    door.import_peft()  # its error names the missing package
    from peft import LoraConfig

    if not isinstance(config, LoraConfig):
        # "all-linear" adapts every part of the stock model's projections (plain Linears there).
        all_linear = _is_all_linear(getattr(config, "target_modules", None))
        targeted = list(slices) if all_linear else _targeted_modules(config, model, slices)
        if targeted:
            fused = sorted({_fused_layer_name(name, slices[name]) for name in targeted})
            raise PeftIntegrationError(
                f"{type(config).__name__} targets {targeted[:3]}{'...' if len(targeted) > 3 else ''}: parts of fused "
                f"projections, which modelpatch supports for LoraConfig only. Target the fused layers ({fused[:2]}...) "
                "or load the model without the qkv / gate_up fusions."
            )
        return config
    config = copy.deepcopy(config)
    is_all_linear = _is_all_linear(config.target_modules)
    _convert_for_transformers_v5(config, model)
    if slices:
        door.register_custom_lora_module(config, {ProjectionSlice: _slice_lora_class()})
        if is_all_linear:
            _resolve_all_linear(config, model, slices)
    return config


def get_peft_model(model: nn.Module, peft_config: PeftConfig, *args: Any, **kwargs: Any) -> PeftModel | PeftMixedModel:
    """``peft.get_peft_model`` (same arguments) that also works on the original names of fused projections.

    On a model without fused projections this is ``peft.get_peft_model``. Otherwise a ``LoraConfig`` may target the
    original names (``q_proj``, ``gate_proj``, ``"all-linear"``) as on the stock model, with the same adapter modules
    and state-dict keys; it may also target the fused layers (``qkv_proj``). ``merge_and_unload()`` merges into the
    fused layers' rows. ``peft_config`` itself is not modified.

    Raises:
        PeftIntegrationError: a non-LoRA config targets an original name of a fused projection, PEFT would turn
            expert targets of a ``linear_experts`` model into parameters it does not have, or the model is sharded
            (tensor parallelism, FSDP2: add adapters before ``fully_shard``).
        ImportError: PEFT is not installed.
    """
    peft = door.import_peft()
    refuse_adapters(model, "modelpatch.get_peft_model()")
    return peft.get_peft_model(model, _config_for(peft_config, model), *args, **kwargs)


def load_adapter(
    model: nn.Module,
    adapter_dir: str | Path,
    adapter_name: str = "default",
    is_trainable: bool = False,
    **kwargs: Any,
) -> PeftModel:
    """Attach an adapter saved with PEFT (``peft_model.save_pretrained(dir)``), from the stock model or a fused one.

    Like ``peft.PeftModel.from_pretrained(model, adapter_dir, ...)``; ``kwargs`` go to it and to
    ``PeftConfig.from_pretrained``. The adapter's keys name the original modules, which a fused model keeps.

    With ``linear_experts``, two things differ from a plain PEFT load:

    * the model has per-expert Linears that the stock model has not. A stock adapter's suffix targets
      (``gate_proj``) match them, and PEFT would give them new adapter layers (random ones, for a LoRA made with
      ``init_lora_weights=False``): per-expert Linears the adapter has no weights for are left out;
    * PEFT converts saved per-expert LoRA weights for transformers' fused 3-D experts, which this model does not
      have: the adapter's weights of per-expert Linears are loaded as saved.

    Raises:
        PeftIntegrationError: see :func:`get_peft_model`.
        ImportError: PEFT is not installed.
    """
    peft = door.import_peft()
    refuse_adapters(model, "modelpatch.load_adapter()")
    directory = Path(adapter_dir, kwargs.get("subfolder") or "")
    config = _config_for(_saved_config(peft, adapter_dir, directory, kwargs), model)
    expert_linears = set(_expert_linears(model))
    reload = set()
    if expert_linears:
        saved = _saved_modules(directory, config)
        _skip_unsaved(config, model, expert_linears - saved)
        reload = expert_linears & saved if isinstance(config, peft.LoraConfig) else set()
    with warnings.catch_warnings():
        if reload:
            # PEFT counts the weights it converted away as missing; they are loaded below, which warns as PEFT does
            # about whatever is still missing then.
            warnings.filterwarnings("ignore", message="Found missing adapter keys")
        peft_model = peft.PeftModel.from_pretrained(
            model, str(adapter_dir), adapter_name=adapter_name, is_trainable=is_trainable, config=config, **kwargs
        )
    if reload:
        _load_as_saved(peft_model, directory, adapter_name, reload)
    return peft_model


def _saved_config(peft: ModuleType, adapter_dir: str | Path, directory: Path, kwargs: dict[str, Any]) -> PeftConfig:
    """The adapter's ``PeftConfig``; a local ``adapter_config.json`` is first read with modelpatch's bounds (size,
    nesting), which PEFT's plain JSON read lacks (100k nested lists are a RecursionError there)."""
    config_file = directory / "adapter_config.json"
    if config_file.is_file():
        read_json(config_file, MAX_CONFIG_BYTES)
    return peft.PeftConfig.from_pretrained(str(adapter_dir), **kwargs)


def _skip_unsaved(config: PeftConfig, model: nn.Module, unsaved: set[str]) -> None:
    """Pin ``config.target_modules`` to the modules it matches in ``model``, minus the ``unsaved`` ones it matches."""
    if not isinstance(config, _TargetsModules) or config.target_modules is None:
        return
    if _is_all_linear(config.target_modules):  # as PEFT would resolve it: the expert Linears are in it
        _resolve_all_linear(config, model, _projection_slices(model))
    skipped = set(_targeted_modules(config, model, unsaved))
    if not skipped:
        return
    targeted = _targeted_modules(config, model, [name for name, _ in model.named_modules()])
    config.target_modules = {name for name in targeted if name not in skipped}
    logger.info(
        "load_adapter: %d per-expert Linear layers match the adapter's target_modules but have no weights in it "
        "(it was made on a model without linear_experts); they stay without adapter layers.",
        len(skipped),
    )


def _load_as_saved(peft_model: PeftModel, directory: Path, adapter_name: str, modules: set[str]) -> None:
    """Load the saved LoRA weights of ``modules`` without PEFT's key conversion; warn about any adapter weight
    missing then, as PEFT does.

    Saved keys are mapped to parameters by PEFT's own mapping (the reverse of how it saves them).
    """
    prefix = door.adapter_parameter_prefix(peft_model.peft_config[adapter_name])
    remap = door.adapter_state_remapper(peft_model, adapter_name)
    keys = _saved_keys(directory)
    state = remap(state_dict=_saved_tensors(directory, [k for k in keys if _module_of(k, prefix) in modules]))
    # With low_cpu_mem_usage, PEFT made the parameters on the meta device, to be assigned (as PEFT does).
    parameters = dict(peft_model.named_parameters())
    assign = any(parameters[key].is_meta for key in state if key in parameters)
    result = peft_model.load_state_dict(state, strict=False, assign=assign)
    if result.unexpected_keys:
        raise PeftIntegrationError(f"Adapter weights {result.unexpected_keys[:3]} in {directory} fit no LoRA layer.")
    if assign:
        door.move_adapters_to_their_base_layers(peft_model, adapter_name)
    # Only the names are remapped here: PEFT reads the keys, not the values (annotated as tensors).
    provided = remap(state_dict=dict.fromkeys(keys))
    missing = [k for k in peft_model.state_dict() if prefix in k and adapter_name in k and k not in provided]
    if missing:
        # stacklevel 3: the warning points at the caller of load_adapter.
        warnings.warn(f"Found missing adapter keys while loading the checkpoint: {missing}.", stacklevel=3)


def _module_of(saved_key: str, prefix: str) -> str:
    """``base_model.model.<module>.lora_A.weight`` -> ``<module>``."""
    return saved_key.removeprefix(_SAVED_KEY_PREFIX).partition(f".{prefix}")[0]


def _saved_keys(directory: Path) -> list[str]:
    """The keys of the adapter saved in ``directory``; for a safetensors file, from its header alone."""
    file = _safetensors_file(directory)
    if file.is_file():
        with safe_open(str(file), "pt") as handle:
            return list(handle.keys())
    return list(_load_all(directory))


def _saved_tensors(directory: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    file = _safetensors_file(directory)
    if file.is_file():
        with safe_open(str(file), "pt") as handle:
            return {key: handle.get_tensor(key) for key in keys}
    saved = _load_all(directory)
    return {key: saved[key] for key in keys}


def _safetensors_file(directory: Path) -> Path:
    return directory / door.adapter_weights_name()


def _load_all(directory: Path) -> dict[str, torch.Tensor]:
    from peft import load_peft_weights

    return load_peft_weights(str(directory), device="cpu")


def _saved_modules(directory: Path, config: PeftConfig) -> set[str]:
    """Names of the modules that the adapter saved in ``directory`` has weights for."""
    prefix = door.adapter_parameter_prefix(config)
    return {_module_of(key, prefix) for key in _saved_keys(directory) if f".{prefix}" in key}
