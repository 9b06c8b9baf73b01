"""PEFT on fused models, with stock PEFT doing the work.

* LoRA on the fused layers (``target_modules=["qkv_proj", "gate_up_proj"]``) needs nothing from modelpatch: they are
  ``nn.Linear`` subclasses, and the slices look the fused layer up at call time, so they run PEFT's wrapper.
* LoRA on the original names (``["q_proj", "v_proj"]``, ``"all-linear"``): :func:`get_peft_model`. The original
  names are :class:`ProjectionSlice` modules, which PEFT refuses; a LoRA layer class for them is registered on a copy
  of the config (``LoraConfig._register_custom_module``), and ``"all-linear"`` is resolved to the original names.
  The adapter then has the modules and state-dict keys it has on the stock model, so adapters move between both.
* An adapter saved from the stock model: :func:`load_adapter`.
* ``linear_experts``: the experts get LoRA in stock PEFT's ``target_parameters`` form (:mod:`.peft_experts`), so
  adapters move between the fused and the stock model both ways; what cannot be carried exactly is refused. The
  PeftModel returned there gets ``add_adapter`` / ``load_adapter`` of its own (:func:`add_further_adapter`,
  :func:`load_further_adapter`), so that further adapters added through PEFT's methods take the same route.
* Stock PEFT's own ``"all-linear"`` on a fused model is refused (:mod:`modelpatch.boundary.adapters`): it would adapt
  the fused layers, names the original checkpoint lacks; the resolution here is let through.

``peft`` is imported on first use; modelpatch itself does not depend on it. Every private PEFT name is reached through
``modelpatch/_peft.py`` (the PEFT door).
"""

from __future__ import annotations

import contextvars
import copy
import logging
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .. import _peft as door
from ..boundary.methods import bind_method
from ..checkpoint.json_file import MAX_CONFIG_BYTES, read_json
from ..errors import PeftIntegrationError
from ..fusions.linear_experts.modules import LinearExperts
from ..fusions.projections import ProjectionSlice
from ..modes.distributed import refuse_adapters
from .lazy_classes import lazy_class, module_getattr
from .peft_experts import (
    DOWN,
    GATE_UP,
    STOCK_PARAMETERS,
    child_names,
    expert_linear_names,
    experts_modules,
    stock_experts_for_peft,
    stock_from_per_expert,
)

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


@lazy_class(__name__)
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

    return ProjectionSliceLoraLinear


# The layer class is created on first use, and importable (and picklable) by name all the same.
__getattr__ = module_getattr(__name__, {"ProjectionSliceLoraLinear": _slice_lora_class})


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
    become ``target_parameters`` (``gate_up_proj`` with rank and alpha doubled), and ``"all-linear"`` becomes leaf
    names plus the experts and the router. Done first, the config is the one stock PEFT adapts the stock model with,
    and :func:`_resolve_all_linear` starts from what PEFT would.
    """
    door.convert_config_for_transformers(config, model)


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


@dataclass
class _Plan:
    """What to hand PEFT for a model, which experts stand in stock form while it runs, and the config saved.

    Attributes:
        runtime: The config PEFT injects the adapter with.
        stock: The adapter's config on the stock model (saved with it), where it differs from ``runtime``, whose
            target modules are names of the fused model resolved without the per-expert Linears (None: no
            difference).
        experts: Path of each experts module -> the stock parameters (``gate_up_proj``, ``down_proj``) whose LoRA
            its per-expert Linears get (PEFT makes it on the stock module's stand-in:
            :func:`modelpatch.integrations.peft_experts.stock_experts_for_peft`).
    """

    runtime: PeftConfig
    stock: PeftConfig | None = None
    experts: dict[str, tuple[str, ...]] = field(default_factory=dict)


def _config_for(config: PeftConfig, model: nn.Module, *, creating: bool) -> _Plan:
    """The plan for ``config`` on ``model``: nothing is changed, everything that cannot be carried exactly to the
    stock model is refused here, before any adapter layer exists.

    LoRA: a copy, with PEFT's transformers-v5 target rewrite applied, the slice layer class registered and
    ``"all-linear"`` resolved to the original names. With ``linear_experts``, the experts are adapted in stock's
    form (``target_parameters``, see :mod:`.peft_experts`): from ``target_parameters`` (a stock adapter), and
    ``creating`` an adapter, also from target modules naming every expert's Linears (they become target parameters,
    gate_up with rank and alpha doubled where gate and up are both targeted, as PEFT converts per-expert targets).
    Other methods (and subclasses of LoRA: AdaLoRA, ...): ``config`` itself, provided it targets no slice and no
    per-expert Linear (they have no layer for one, or no stock form).
    """
    slices = _projection_slices(model)
    experts = experts_modules(model)
    if not slices and not experts:
        return _Plan(config)
    peft = door.import_peft()  # its error names the missing package
    if not isinstance(config, peft.LoraConfig) or config.peft_type != peft.PeftType.LORA:
        _refuse_other_methods(config, model, slices, experts)
        return _Plan(config)
    lora: LoraConfig = copy.deepcopy(cast("LoraConfig", config))
    is_all_linear = _is_all_linear(lora.target_modules)
    _convert_for_transformers_v5(lora, model)
    if slices:
        door.register_custom_lora_module(lora, {ProjectionSlice: _slice_lora_class()})
        if is_all_linear:
            _resolve_all_linear(lora, model, slices)
        _refuse_fused_layers_with_their_parts(lora, model, slices)
    if not experts:
        return _Plan(lora)
    if _is_all_linear(lora.target_modules):
        door.include_all_linear_layers(lora, model)
    linears = {name for path, module in experts.items() for name in expert_linear_names(path, module)}
    if creating:
        _targets_to_parameters(lora, model, experts)
    targets = _expert_parameters(lora, experts)
    if targets:
        _refuse_options_stock_lacks(lora, targets)
    runtime = copy.deepcopy(lora)
    names = [name for name, _ in model.named_modules() if name not in linears]
    modules = _targeted_modules(lora, model, names)
    parameters = [name for name, _ in model.named_parameters()]
    stock_parameters = [*parameters, *(f"{path}.{p}" for path in experts for p in STOCK_PARAMETERS)]
    lost = sorted(
        t for t in lora.target_parameters or () if not any(p == t or p.endswith(f".{t}") for p in stock_parameters)
    )
    if lost:
        raise PeftIntegrationError(
            f"target_parameters {lost} name parameters of the stock model that this fused model does not hold: "
            "their LoRA would be dropped. Target the modules instead, or load the model without the fusions."
        )
    runtime.target_modules = modules or (door.dummy_target_modules() if targets else lora.target_modules)
    runtime.exclude_modules = None
    return _Plan(runtime, lora if targets else None, targets)


def _refuse_other_methods(
    config: PeftConfig, model: nn.Module, slices: dict[str, ProjectionSlice], experts: dict[str, LinearExperts]
) -> None:
    """A PEFT method other than plain LoRA has no layer for a projection slice, and no stock form on experts."""
    # "all-linear" adapts every part of the stock model's projections (plain Linears there).
    all_linear = _is_all_linear(getattr(config, "target_modules", None))
    linears = [name for path, module in experts.items() for name in expert_linear_names(path, module)]
    targeted = list(slices) if all_linear else _targeted_modules(config, model, slices)
    targeted += linears if all_linear else _targeted_modules(config, model, linears)
    if targeted:
        fused = sorted({_fused_layer_name(name, slices[name]) for name in targeted if name in slices})
        fused_hint = f"target the fused layers ({fused[:2]}...), " if fused else ""
        raise PeftIntegrationError(
            f"{type(config).__name__} targets {targeted[:3]}{'...' if len(targeted) > 3 else ''}: parts of fused "
            "projections or per-expert Linears of linear_experts, whose adapter stock PEFT cannot load on the stock "
            f"model (modelpatch carries plain LoraConfig adapters there only). Use a LoraConfig, {fused_hint}leave "
            "them out of target_modules, or load the model without the qkv / gate_up / linear_experts fusions."
        )


def _refuse_fused_layers_with_their_parts(
    config: LoraConfig, model: nn.Module, slices: dict[str, ProjectionSlice]
) -> None:
    """A fused layer adapted together with its parts: its adapter would hold LoRA of both, which the stock model
    (having the parts only) drops without a word."""
    fused = {_fused_layer_name(name, part): name for name, part in slices.items()}
    both = [
        name
        for name in _targeted_modules(config, model, list(fused))
        if _targeted_modules(config, model, [n for n, p in slices.items() if _fused_layer_name(n, p) == name])
    ]
    if both:
        raise PeftIntegrationError(
            f"target_modules {config.target_modules!r} match the fused layers {both[:3]} and also their parts (the "
            "original names): stock PEFT would drop the fused layers' LoRA on the stock model. Target either the "
            "original names (q_proj, gate_proj, ...) or the fused layers (qkv_proj, gate_up_proj), not both."
        )


def _targets_to_parameters(config: LoraConfig, model: nn.Module, experts: dict[str, LinearExperts]) -> None:
    """Expert Linears that ``config`` targets by module name become ``target_parameters`` of the stock experts, in
    place; refused where that is not exact: some experts' Linears without the others, gate without up, or a rank /
    alpha pattern naming them."""
    added: list[str] = []
    for path, module in experts.items():
        gate, up, down = child_names(module)
        chosen: dict[str, bool] = {}
        for child in (gate, up, down):
            names = [f"{path}.{index}.{child}" for index in range(len(module))]
            hit = _targeted_modules(config, model, names)
            if hit and len(hit) != len(names):
                raise PeftIntegrationError(
                    f"target_modules {config.target_modules!r} match {hit[:2]}... but not every expert's {child} of "
                    f"{path}: stock PEFT adapts all experts of its 3-D {GATE_UP if child != down else DOWN} or none. "
                    "Target every expert (the name alone: "
                    f"{child!r}) or none."
                )
            chosen[child] = bool(hit)
        if chosen[gate] != chosen[up]:
            raise PeftIntegrationError(
                f"target_modules {config.target_modules!r} match the experts' {gate if chosen[gate] else up} of "
                f"{path} without their {up if chosen[gate] else gate}: the stock model holds both in one 3-D "
                f"{GATE_UP}, adapted as one. Target both or neither."
            )
        for pattern in (*(config.rank_pattern or {}), *(config.alpha_pattern or {})):
            named = [n for n in expert_linear_names(path, module) if door.pattern_key([pattern], n) == pattern]
            if named:
                raise PeftIntegrationError(
                    f"rank_pattern / alpha_pattern key {pattern!r} names per-expert Linears ({named[0]}, ...): "
                    f"their stock form is the 3-D {GATE_UP} / {DOWN}; key the pattern on those instead."
                )
        if chosen[gate]:
            added.append(f"{path}.{GATE_UP}")
        if chosen[down]:
            added.append(f"{path}.{DOWN}")
    if not added:
        return
    if any(name.endswith(GATE_UP) for name in added):
        # As PEFT converts per-expert gate and up targets: one LoRA of rank 2r for both, alpha doubled with it.
        key = rf".*\.{GATE_UP}"
        config.rank_pattern = {**(config.rank_pattern or {}), key: 2 * config.r}
        config.alpha_pattern = {**(config.alpha_pattern or {}), key: 2 * config.lora_alpha}
    config.target_parameters = sorted({*(config.target_parameters or ()), *added})
    # What the stock model has of the other targets, by name (a string target would match nothing else there).
    linears = {name for path, module in experts.items() for name in expert_linear_names(path, module)}
    others = _targeted_modules(config, model, [name for name, _ in model.named_modules() if name not in linears])
    config.target_modules = sorted(others) or None


def _expert_parameters(config: LoraConfig, experts: dict[str, LinearExperts]) -> dict[str, tuple[str, ...]]:
    """Each experts module's stock parameters that ``config.target_parameters`` adapts, matched as PEFT matches them
    (the parameter's path, or a suffix of it after a dot)."""
    targets = set(config.target_parameters or ())
    found: dict[str, tuple[str, ...]] = {}
    for path in experts:
        adapted = tuple(
            p for p in STOCK_PARAMETERS if any(f"{path}.{p}" == t or f"{path}.{p}".endswith(f".{t}") for t in targets)
        )
        if adapted:
            found[path] = adapted
    return found


def _refuse_options_stock_lacks(config: LoraConfig, targets: dict[str, tuple[str, ...]]) -> None:
    """Options stock PEFT's LoRA of 3-D parameters (``ParamWrapper``) does not have, or that these layers would not
    compute as it does."""
    wrong = [
        f"{name}={value!r}"
        for name, value, fine in (
            ("lora_dropout", config.lora_dropout, not config.lora_dropout),
            ("use_dora", config.use_dora, not config.use_dora),
            ("lora_bias", config.lora_bias, not config.lora_bias),
            ("fan_in_fan_out", config.fan_in_fan_out, not config.fan_in_fan_out),
            ("init_lora_weights", config.init_lora_weights, isinstance(config.init_lora_weights, bool)),
            ("layers_to_transform", config.layers_to_transform, config.layers_to_transform is None),
            ("use_qalora", getattr(config, "use_qalora", False), not getattr(config, "use_qalora", False)),
        )
        if not fine
    ]
    if wrong:
        shown = [f"{path}.{p}" for path, params in targets.items() for p in params][:2]
        raise PeftIntegrationError(
            f"LoRA on the experts ({shown}..., stock's target_parameters) with {', '.join(wrong)}: stock PEFT's "
            "LoRA of 3-D expert parameters does not support that, so the adapter would not load on the stock model. "
            "Use lora_dropout=0 and no DoRA / lora_bias / fan_in_fan_out / layers_to_transform / data-dependent "
            "init on the experts, or leave the experts out (target_modules without gate_proj / up_proj / down_proj)."
        )


def get_peft_model(model: nn.Module, peft_config: PeftConfig, *args: Any, **kwargs: Any) -> PeftModel | PeftMixedModel:
    """``peft.get_peft_model`` (same arguments) that also works on the original names of fused projections and on
    the experts of ``linear_experts``, saving the adapter the stock model takes.

    On a model without fused modules this is ``peft.get_peft_model``. Otherwise a ``LoraConfig`` may target the
    original names (``q_proj``, ``gate_proj``, ``"all-linear"``) as on the stock model, with the same adapter modules
    and state-dict keys; it may also target the fused layers (``qkv_proj``), not both. With ``linear_experts``,
    targets naming the experts' Linears (``"all-linear"``, ``gate_proj`` + ``up_proj``, ``down_proj``, a pattern
    matching every expert) and ``target_parameters`` naming the stock 3-D experts adapt each expert's Linears in the
    stock adapter's parameterization, and ``save_pretrained`` writes the stock adapter (``target_parameters``; see
    :mod:`modelpatch.integrations.peft_experts`). ``merge_and_unload()`` merges into the fused layers' rows and the
    experts' Linears. ``peft_config`` itself is not modified.

    Raises:
        PeftIntegrationError: before any adapter layer is made, when the adapter could not be carried exactly to the
            stock model: a non-LoRA config (or a subclass of LoRA, such as AdaLoRA) targeting an original name of a
            fused projection or an expert's Linear; targets matching a fused layer and its parts; expert targets
            covering some experts or gate without up; options stock's expert LoRA lacks (dropout, DoRA, lora_bias,
            ...); ``target_parameters`` this model does not hold; or a sharded model (tensor parallelism, FSDP2: add
            adapters before ``fully_shard``).
        ImportError: PEFT is not installed.
    """
    peft = door.import_peft()
    refuse_adapters(model, "modelpatch.get_peft_model()")
    plan = _config_for(peft_config, model, creating=True)
    with stock_experts_for_peft(model, plan.experts):
        peft_model = peft.get_peft_model(model, plan.runtime, *args, **kwargs)
    _finish(peft_model, plan, kwargs.get("adapter_name", args[0] if args else "default"))
    _bind_further_adapters(peft, peft_model)
    return peft_model


def _finish(peft_model: Any, plan: _Plan, adapter_name: str) -> None:
    """The stock config put where PEFT saves it from."""
    if plan.stock is None:
        return
    stock = copy.deepcopy(plan.stock)
    stock.inference_mode = peft_model.peft_config[adapter_name].inference_mode
    peft_model.peft_config[adapter_name] = stock


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

    With ``linear_experts``: the adapter's ``target_parameters`` of the stock 3-D experts (PEFT's form, and what
    :func:`get_peft_model` saves) become LoRA layers of the experts' Linears in the same parameterization, holding
    the saved tensors cut per expert; saved again, they are the same tensors. Target modules naming ``gate_proj``
    and the like adapt, as on the stock model, the modules the stock model has under that name, not the per-expert
    Linears. An adapter of per-expert Linears (PEFT on transformers 4, or stock PEFT on these Linears) is first
    converted exactly into the stock form (gate and up as one LoRA of twice the rank with a block-diagonal B: see
    :func:`~modelpatch.integrations.peft_experts.stock_from_per_expert`), so that it computes what it computed per
    expert and saves as the stock adapter.

    Raises:
        PeftIntegrationError: see :func:`get_peft_model`; also an adapter of per-expert Linears that has no exact
            stock form (see :func:`~modelpatch.integrations.peft_experts.stock_from_per_expert`), or holds them with
            another method than LoRA.
        ImportError: PEFT is not installed.
    """
    peft = door.import_peft()
    refuse_adapters(model, "modelpatch.load_adapter()")
    directory = Path(adapter_dir, kwargs.get("subfolder") or "")
    config = _saved_config(peft, adapter_dir, directory, kwargs)
    experts = experts_modules(model)
    held = _per_expert_modules(directory, config, experts)
    with tempfile.TemporaryDirectory(prefix="modelpatch-adapter-") as converted:
        if held:
            config, adapter_dir = _converted_to_stock_form(peft, config, directory, model, experts, held, converted)
            kwargs = {key: value for key, value in kwargs.items() if key != "subfolder"}
        plan = _config_for(config, model, creating=False)
        with stock_experts_for_peft(model, plan.experts):
            peft_model = peft.PeftModel.from_pretrained(
                model,
                str(adapter_dir),
                adapter_name=adapter_name,
                is_trainable=is_trainable,
                config=plan.runtime,
                **kwargs,
            )
    _finish(peft_model, plan, adapter_name)
    _bind_further_adapters(peft, peft_model)
    return peft_model


# Set while a PeftModel's own load_adapter (bound by _bind_further_adapters) runs: the adapter it adds is a saved one,
# planned as load_adapter plans it.
_LOADING: contextvars.ContextVar[bool] = contextvars.ContextVar("modelpatch_loading_adapter", default=False)


def _bind_further_adapters(peft: ModuleType, peft_model: Any) -> None:
    """Give a PeftModel of a ``linear_experts`` model :func:`add_further_adapter` and :func:`load_further_adapter`
    as its ``add_adapter`` / ``load_adapter`` (bound methods; PEFT's class is untouched).

    PEFT adds a second adapter by its own matching, which finds no stock 3-D experts on this model: the second
    adapter's expert LoRA would be dropped with a warning (``target_parameters``), or made per expert Linear (names,
    ``"all-linear"``), which the stock model cannot load. Bound here, both go through the plan and the stock experts'
    stand-in as the first adapter did. (PEFT's ``load_adapter`` adds the adapter through ``self.add_adapter``.)
    """
    if isinstance(peft_model, peft.PeftModel) and experts_modules(peft_model.base_model.model):
        bind_method(peft_model, "add_adapter", add_further_adapter)
        bind_method(peft_model, "load_adapter", load_further_adapter)


@contextmanager
def _as_before_peft(model: nn.Module) -> Iterator[None]:
    """``model`` as it was before PEFT adapted it while the context runs: each outermost adapter layer replaced by the
    layer it wraps (so that a plan reads the names and experts :func:`_config_for` read for the first adapter), put
    back after."""
    tuner = door.lora_merge_layers().tuner
    replaced: list[tuple[nn.Module, str, nn.Module]] = []
    outer: list[str] = []
    for name, module in list(model.named_modules()):
        if isinstance(module, tuner) and not any(name.startswith(f"{done}.") for done in outer):
            layer: Any = module  # a PEFT adapter layer (and a module)
            parent, _, child = name.rpartition(".")
            owner = model.get_submodule(parent)
            replaced.append((owner, child, layer))
            outer.append(name)
            setattr(owner, child, layer.get_base_layer())
    try:
        yield
    finally:
        for owner, child, module in reversed(replaced):
            setattr(owner, child, module)


def add_further_adapter(
    peft_model: PeftModel,
    adapter_name: str,
    peft_config: PeftConfig,
    low_cpu_mem_usage: bool = False,
    autocast_adapter_dtype: bool = True,
) -> None:
    """``peft_model.add_adapter`` of a PeftModel that :func:`get_peft_model` or :func:`load_adapter` made on a
    ``linear_experts`` model (bound to it): PEFT's ``PeftModel.add_adapter``, with the adapter planned as
    :func:`get_peft_model` plans one (:func:`load_adapter`'s plan inside ``peft_model.load_adapter``), so that its
    expert LoRA is made in stock's ``target_parameters`` form beside the adapters there, and saved as stock's.

    Raises:
        PeftIntegrationError: see :func:`get_peft_model`, before any layer of the new adapter is made.
    """
    model = cast(nn.Module, peft_model.base_model.model)
    with _as_before_peft(model):
        plan = _config_for(peft_config, model, creating=not _LOADING.get())
    with stock_experts_for_peft(model, plan.experts):
        type(peft_model).add_adapter(
            peft_model,
            adapter_name,
            plan.runtime,
            low_cpu_mem_usage=low_cpu_mem_usage,
            autocast_adapter_dtype=autocast_adapter_dtype,
        )
    _finish(peft_model, plan, adapter_name)


def load_further_adapter(
    peft_model: PeftModel, model_id: str | Path, adapter_name: str, *args: Any, **kwargs: Any
) -> Any:
    """``peft_model.load_adapter`` of a PeftModel that :func:`get_peft_model` or :func:`load_adapter` made on a
    ``linear_experts`` model (bound to it): PEFT's ``PeftModel.load_adapter`` (same arguments), whose adapter is added
    by :func:`add_further_adapter` as :func:`load_adapter` adds one, so that a stock ``target_parameters`` adapter's
    expert LoRA is there. An adapter of per-expert Linears (PEFT on transformers 4) is first converted exactly into
    the stock form, as :func:`load_adapter` converts one.

    Raises:
        PeftIntegrationError: see :func:`load_adapter`, before any layer of the new adapter is made.
    """
    peft = door.import_peft()
    model = cast(nn.Module, peft_model.base_model.model)
    directory = Path(model_id, kwargs.get("subfolder") or "")
    with tempfile.TemporaryDirectory(prefix="modelpatch-adapter-") as converted:
        if directory.is_dir():
            config = _saved_config(peft, model_id, directory, {k: v for k, v in kwargs.items() if k == "subfolder"})
            with _as_before_peft(model):
                experts = experts_modules(model)
                held = _per_expert_modules(directory, config, experts)
                if held:
                    stock, model_id = _converted_to_stock_form(peft, config, directory, model, experts, held, converted)
                    stock.save_pretrained(converted)  # PEFT's load_adapter reads the config from the directory
                    kwargs = {key: value for key, value in kwargs.items() if key != "subfolder"}
        token = _LOADING.set(True)
        try:
            return type(peft_model).load_adapter(peft_model, model_id, adapter_name, *args, **kwargs)
        finally:
            _LOADING.reset(token)


def _per_expert_modules(directory: Path, config: PeftConfig, experts: dict[str, LinearExperts]) -> list[str]:
    """The per-expert Linears the adapter in ``directory`` has weights for (transformers-4-era expert LoRA)."""
    if not experts:
        return []
    linears = {name for path, module in experts.items() for name in expert_linear_names(path, module)}
    return sorted(_saved_modules(directory, config) & linears)


def _converted_to_stock_form(
    peft: ModuleType,
    config: PeftConfig,
    directory: Path,
    model: nn.Module,
    experts: dict[str, LinearExperts],
    held: list[str],
    into: str,
) -> tuple[PeftConfig, str]:
    """The adapter in ``directory``, whose LoRA of per-expert Linears (``held``) the stock model has no modules for,
    converted exactly into the stock form (:func:`~modelpatch.integrations.peft_experts.stock_from_per_expert`):
    its config, and the directory ``into`` where its weights are now written."""
    if not isinstance(config, peft.LoraConfig) or config.peft_type != peft.PeftType.LORA:
        prefix = door.adapter_parameter_prefix(config)
        raise PeftIntegrationError(
            f"The adapter in {directory} ({type(config).__name__}) holds {prefix} weights of per-expert Linears "
            f"({held[:2]}, ...): modules the stock model does not have (its experts are 3-D parameters), and only "
            "plain LoRA has a stock form there. Load the model without linear_experts."
        )
    saved = _saved_tensors(directory, _saved_keys(directory))
    linears = {name for path, module in experts.items() for name in expert_linear_names(path, module)}
    modules = [name for name, _ in model.named_modules() if name not in linears]
    parameters = [name for name, _ in model.named_parameters() if name.rpartition(".")[0] not in linears]
    state = {key.removeprefix(_SAVED_KEY_PREFIX): value for key, value in saved.items()}
    stock, converted = stock_from_per_expert(config, state, experts, modules, parameters)
    save_file(
        {f"{_SAVED_KEY_PREFIX}{key}": value.contiguous() for key, value in converted.items()},
        str(Path(into, door.adapter_weights_name())),
        metadata={"format": "pt"},
    )
    logger.info("%s: per-expert LoRA of %d Linears converted to the stock target_parameters form", directory, len(held))
    return stock, into


def _saved_config(peft: ModuleType, adapter_dir: str | Path, directory: Path, kwargs: dict[str, Any]) -> PeftConfig:
    """The adapter's ``PeftConfig``; a local ``adapter_config.json`` is first read with modelpatch's bounds (size,
    nesting), which PEFT's plain JSON read lacks (100k nested lists are a RecursionError there)."""
    config_file = directory / "adapter_config.json"
    if config_file.is_file():
        read_json(config_file, MAX_CONFIG_BYTES)
    return peft.PeftConfig.from_pretrained(str(adapter_dir), **kwargs)


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
