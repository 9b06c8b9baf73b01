"""LoRA on the experts of a ``linear_experts`` model, in stock PEFT's form (``target_parameters``).

Stock transformers keeps an MoE layer's experts as two 3-D parameters, ``gate_up_proj`` and ``down_proj``, and stock
PEFT adapts them with ``LoraConfig(target_parameters=[...])``: one ``ParamWrapper`` per parameter (the first one the
stock module registers innermost, as PEFT nests them), whose ``lora_A`` is ``(r·E, in)`` (expert ``e`` owns rows
``e·r .. e·r + r - 1``: expert-major) and ``lora_B`` ``(out, r·E)`` (expert ``e`` owns columns ``j·E + e``:
expert-minor); expert ``e``'s update is ``B_e @ A_e`` in the layout PEFT reads the parameter in (``[E, out, in]``,
or ``[E, in, out]`` where the stock module says ``is_transposed``). One ``A_e`` serves the expert's gate rows and its
up rows alike.

``linear_experts`` holds each expert as three Linears. The same adapter there is :class:`ExpertsLora`, a PEFT tuner
layer of ours standing where stock's ``ParamWrapper`` stands (the experts' path, nested the same way), holding
``lora_A`` and ``lora_B`` of stock's shapes: its state-dict keys and tensors are the stock adapter's, so PEFT's own
save and load write and read the stock adapter, and an optimizer sees stock's parameters. The LoRA is computed at each
expert's Linears (a forward hook adds ``B_e (A_e x)`` of views into those tensors, gate and up reading the same
``A_e``), so the experts are called one by one with their own Linears, and gradients reach the stock-shaped tensors as
they reach stock's. Expert ``e``'s factors in the Linears' orientation are index permutations of stock's
(:func:`per_expert_factors`, reversed by :func:`stock_factors`).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import _peft as door
from ..errors import PeftIntegrationError
from ..fusions.linear_experts.modules import ExpertMLP, LinearExperts
from ..fusions.linear_experts.spec import ExpertsLayout
from .lazy_classes import lazy_class, module_getattr

# The stock experts' 3-D parameters, in the order the stock classes register them (gate_up_proj first in every
# experts class linear_experts fuses), which is the order PEFT wraps them in: the first is the innermost wrapper.
GATE_UP, DOWN = "gate_up_proj", "down_proj"
STOCK_PARAMETERS = (GATE_UP, DOWN)
_FACTORS = ("lora_A", "lora_B")


def experts_modules(model: nn.Module) -> dict[str, LinearExperts]:
    """Every fused experts module of ``model`` by its path."""
    return {name: module for name, module in model.named_modules() if isinstance(module, LinearExperts)}


def expert_linear_names(path: str, experts: LinearExperts, parameter: str | None = None) -> list[str]:
    """The paths of the per-expert Linears of the experts at ``path`` (of one stock parameter's, or of all)."""
    gate, up, down = child_names(experts)
    children = {GATE_UP: (gate, up), DOWN: (down,), None: (gate, up, down)}[parameter]
    return [f"{path}.{index}.{child}" for index in range(len(experts)) for child in children]


def child_names(experts: LinearExperts) -> tuple[str, str, str]:
    """The (gate, up, down) names of each expert's Linears."""
    return cast(ExpertMLP, experts[0]).names


def _stock_layout(experts: LinearExperts) -> ExpertsLayout:
    # Set by the fused class's constructor (fusions/linear_experts/spec.py).
    return cast(ExpertsLayout, experts.__dict__["stock_layout"])


def _reads_as_linear(experts: LinearExperts) -> bool:
    """Whether PEFT reads the stock 3-D weights in the Linears' ``(out, in)`` orientation: it takes them as
    ``[E, out, in]`` unless the stock module says ``is_transposed``, and they are ``[E, in, out]`` where the stock
    layout is transposed (Llama 4's experts are, without saying so)."""
    return bool(experts.__dict__["stock_is_transposed"]) == _stock_layout(experts).transposed


def _gate_up_rows(experts: LinearExperts) -> tuple[slice, slice]:
    """Which rows of an expert's gate/up update (in the stock parameter's order) are the gate's and the up's."""
    if _stock_layout(experts).gate == "interleaved":
        return slice(0, None, 2), slice(1, None, 2)
    size = experts.intermediate_dim
    return slice(0, size), slice(size, 2 * size)


def per_expert_factors(
    experts: LinearExperts, lora_a: torch.Tensor, lora_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stock ``lora_A (r·E, in)`` and ``lora_B (out, r·E)`` -> ``(B_e, A_e)`` of every expert in the Linears'
    orientation: ``[E, out, r]`` and ``[E, r, in]``, so that ``B_e @ A_e`` is expert ``e``'s weight update."""
    count = experts.num_experts
    rank = lora_a.shape[0] // count
    a = lora_a.reshape(count, rank, lora_a.shape[1])
    b = lora_b.reshape(lora_b.shape[0], rank, count).permute(2, 0, 1)
    if _reads_as_linear(experts):
        return b, a
    return a.transpose(1, 2), b.transpose(1, 2)


def stock_factors(experts: LinearExperts, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reverse of :func:`per_expert_factors`: ``(lora_A, lora_B)`` of the stock adapter."""
    if not _reads_as_linear(experts):
        a, b = b.transpose(1, 2), a.transpose(1, 2)
    count, rank = a.shape[0], a.shape[1]
    lora_a = a.reshape(count * rank, a.shape[2]).contiguous()
    lora_b = b.permute(1, 2, 0).reshape(b.shape[1], rank * count).contiguous()
    return lora_a, lora_b


def _lora_linear_rows(experts: LinearExperts, parameter: str) -> list[tuple[int, str, slice]]:
    """(expert, child, its rows of the expert's update) of the Linears ``parameter``'s LoRA acts on."""
    gate, up, down = child_names(experts)
    if parameter == DOWN:
        return [(index, down, slice(None)) for index in range(len(experts))]
    gate_rows, up_rows = _gate_up_rows(experts)
    return [(index, child, rows) for index in range(len(experts)) for child, rows in ((gate, gate_rows), (up, up_rows))]


class _ExpertHook:
    """The forward hook on one expert Linear: its output plus, for each active adapter of ``layer``, its rows of
    ``scale · B_e (A_e x)``."""

    def __init__(self, layer: nn.Module, index: int, rows: slice):
        self.layer = layer
        self.index = index
        self.rows = rows

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        layer: Any = self.layer
        if layer.disable_adapters or layer.merged:
            return output
        x = args[0]
        for adapter in layer.active_adapters:
            if adapter not in layer.lora_A:
                continue
            b, a = layer.factors(adapter)
            lora_a, lora_b = a[self.index], b[self.index, self.rows]
            update = nn.functional.linear(nn.functional.linear(x.to(lora_a.dtype), lora_a), lora_b)
            output = output + (update * layer.scaling[adapter]).to(output.dtype)
        return output


@lazy_class(__name__)
def experts_lora_class() -> type[nn.Module]:
    """:class:`ExpertsLora`, created on first use because it derives from PEFT's ``LoraLayer``."""

    class ExpertsLora(nn.Module, door.lora_layer()):  # type: ignore[misc]  # a class of the installed PEFT
        """LoRA of one stock 3-D expert parameter (``parameter_name``) on ``linear_experts``: stock ``ParamWrapper``'s
        tensors and keys, computed at the experts' Linears.

        Made from the ``ParamWrapper`` stock PEFT made (or loaded) for the stock parameter (see
        :func:`stock_experts_for_peft`): it takes over that layer's adapters, the very tensors, so that what PEFT
        drew or read is what this layer holds. ``base_layer`` is the experts module, or the ``ExpertsLora`` of its
        other parameter (nested as stock PEFT nests its wrappers). Merging adds each expert's update to its Linears'
        weights.
        """

        def __init__(self, base_layer: nn.Module, wrapper: Any):
            nn.Module.__init__(self)
            self.parameter_name = wrapper.parameter_name
            self.num_experts = wrapper.num_experts
            self._features = (wrapper.in_features, wrapper.out_features)
            door.lora_layer().__init__(self, base_layer)
            for name in (*self.adapter_layer_names, *self.other_param_names, "lora_variant", "merged_adapters"):
                setattr(self, name, getattr(wrapper, name))
            # PEFT freezes or trains an adapter's factors all alike; set_adapter keeps that state.
            active = [a for a in wrapper.active_adapters if a in self.lora_A]
            trainable = any(
                p.requires_grad for a in active for p in (*self.lora_A[a].parameters(), *self.lora_B[a].parameters())
            )
            self.set_adapter(wrapper.active_adapters, inference_mode=not trainable)
            experts = _experts_below(base_layer)
            self._handles: list[RemovableHandle] = [
                getattr(experts[index], child).register_forward_hook(_ExpertHook(self, index, rows))
                for index, child, rows in _lora_linear_rows(experts, self.parameter_name)
            ]

        def base_features(self, module: nn.Module) -> tuple[int, int]:
            return self._features

        def factors(self, adapter_name: str) -> tuple[torch.Tensor, torch.Tensor]:
            """Every expert's ``(B_e, A_e)`` in the Linears' orientation (views)."""
            experts = _experts_below(self)
            return per_expert_factors(experts, self.lora_A[adapter_name].weight, self.lora_B[adapter_name].weight)

        def delta_weights(self, adapter_name: str) -> Iterator[tuple[nn.Linear, Callable[[], torch.Tensor]]]:
            """Each expert Linear this LoRA acts on, with what merging ``adapter_name`` adds to its weight (as
            ``weight + update.to(weight.dtype)``), computed when called: a stream of merged weights holds one."""
            experts = _experts_below(self)
            b, a = self.factors(adapter_name)
            scale = self.scaling[adapter_name]
            for index, child, rows in _lora_linear_rows(experts, self.parameter_name):
                yield (
                    getattr(experts[index], child),
                    functools.partial(_scaled_product, b[index, rows], a[index], scale),
                )

        def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
            for adapter in adapter_names if adapter_names is not None else self.active_adapters:
                if adapter not in self.lora_A or adapter in self.merged_adapters:
                    continue
                with torch.no_grad():
                    for linear, delta in self.delta_weights(adapter):
                        merged = linear.weight.data + delta().to(linear.weight.dtype)
                        if safe_merge and not torch.isfinite(merged).all():
                            raise ValueError(f"NaNs detected in the merged weights of adapter {adapter!r}.")
                        linear.weight.data.copy_(merged)
                self.merged_adapters.append(adapter)

        def unmerge(self) -> None:
            while self.merged_adapters:
                adapter = self.merged_adapters.pop()
                with torch.no_grad():
                    for linear, delta in self.delta_weights(adapter):
                        linear.weight.data -= delta().to(linear.weight.dtype)

        def unload_and_optionally_merge_module(
            self, merge: bool, safe_merge: bool, adapter_names: list[str] | None
        ) -> nn.Module:
            layer: Any = self
            while isinstance(layer, ExpertsLora):
                if merge:
                    layer.merge(safe_merge=safe_merge, adapter_names=adapter_names)
                layer.detach()
                layer = layer.base_layer
            return layer

        def detach(self) -> None:
            """Take this layer's hooks off the experts' Linears (it no longer computes their LoRA)."""
            for handle in self._handles:
                handle.remove()
            self._handles.clear()

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return self.base_layer(*args, **kwargs)

        def __getattr__(self, name: str) -> Any:
            try:
                return super().__getattr__(name)
            except AttributeError:
                if name == "base_layer":
                    raise
                return getattr(self.base_layer, name)  # what the MoE block reads of its experts

    return ExpertsLora


# The layer class is created on first use, and importable (and picklable) by name all the same.
__getattr__ = module_getattr(__name__, {"ExpertsLora": experts_lora_class})


def _scaled_product(b: torch.Tensor, a: torch.Tensor, scale: float) -> torch.Tensor:
    return (b @ a) * scale


def _experts_below(layer: nn.Module) -> LinearExperts:
    while not isinstance(layer, LinearExperts):
        layer = layer.base_layer  # type: ignore[assignment]
    return layer


class StockExperts(nn.Module):
    """What stock PEFT sees of a fused experts module while it makes or loads an adapter (see
    :func:`stock_experts_for_peft`): the stock experts module's 3-D parameters, in its order and shapes (views of one
    element: they hold no memory and are never read), and its ``is_transposed``. The fused module itself is the child
    ``fused``, so that PEFT's freezing of the base model's weights (by name) reaches its Linears as it reaches stock's
    weights."""

    def __init__(self, experts: LinearExperts):
        super().__init__()
        weight = next(experts.parameters())
        count, hidden, intermediate = experts.num_experts, experts.hidden_dim, experts.intermediate_dim
        transposed = _stock_layout(experts).transposed
        shapes = {
            GATE_UP: (hidden, 2 * intermediate) if transposed else (2 * intermediate, hidden),
            DOWN: (intermediate, hidden) if transposed else (hidden, intermediate),
        }
        for name in STOCK_PARAMETERS:
            placeholder = torch.empty((), dtype=weight.dtype, device=weight.device).expand(count, *shapes[name])
            self.register_parameter(name, nn.Parameter(placeholder, requires_grad=False))
        self.is_transposed = bool(experts.__dict__["stock_is_transposed"])
        self.fused = experts


@contextmanager
def stock_experts_for_peft(model: nn.Module, paths: Iterable[str]) -> Iterator[None]:
    """While stock PEFT makes or loads an adapter on ``model``: the experts at ``paths`` stand there as the stock
    module (:class:`StockExperts`), so that PEFT itself makes their ``ParamWrapper`` layers, in stock's order among
    all its layers (under one seed: stock's initial weights), with stock's ranks, and reads their saved weights.
    Experts already adapted stand there as stock's wrappers of the stock module holding their adapters
    (:func:`_stock_wrappers`), which PEFT extends with a further adapter as it extends its own.
    Afterwards each ``ParamWrapper`` becomes an :class:`ExpertsLora` of the fused experts holding the very tensors;
    if PEFT raised, the experts are put back with the adapters they had (the new adapter's wrappers dropped)."""
    stand_ins: dict[str, StockExperts] = {}
    views: set[int] = set()  # the wrappers standing for existing ExpertsLora layers
    for path in paths:
        parent, _, child = path.rpartition(".")
        current = model.get_submodule(path)
        stand_ins[path] = StockExperts(_experts_below(current))
        setattr(model.get_submodule(parent), child, _stock_wrappers(current, stand_ins[path], views))
    done = False
    try:
        yield
        done = True
    finally:
        layer_class: Any = experts_lora_class()
        for path, stand_in in stand_ins.items():
            parent, _, child = path.rpartition(".")
            owner = model.get_submodule(parent)
            wrappers = []
            layer = getattr(owner, child)
            while layer is not stand_in:
                wrappers.append(layer)
                layer = layer.base_layer
            restored: nn.Module = stand_in.fused
            for wrapper in reversed(wrappers):
                if done or id(wrapper) in views:
                    restored = layer_class(restored, wrapper)
            setattr(owner, child, restored)


def _stock_wrappers(layer: nn.Module, stand_in: StockExperts, views: set[int]) -> nn.Module:
    """``layer`` (fused experts, or the :class:`ExpertsLora` layers over them) as stock PEFT has it: the stand-in,
    or stock ``ParamWrapper`` layers over it, nested alike, holding the same adapters (their ids added to
    ``views``). The ``ExpertsLora`` layers' hooks are taken off: the layers made afterwards compute the LoRA."""
    if isinstance(layer, LinearExperts):
        return stand_in
    held: Any = layer
    held.detach()
    wrapper = door.param_wrapper_holding(_stock_wrappers(held.base_layer, stand_in, views), held)
    views.add(id(wrapper))
    return cast(nn.Module, wrapper)


def stock_from_per_expert(
    config: Any,
    state: Mapping[str, torch.Tensor],
    experts: Mapping[str, LinearExperts],
    module_names: Iterable[str],
    parameter_names: Iterable[str],
) -> tuple[Any, dict[str, torch.Tensor]]:
    """An adapter holding per-expert LoRA (``<experts>.3.gate_proj.lora_A.weight``: PEFT on transformers 4, or stock
    PEFT on the per-expert Linears), converted exactly into stock PEFT's ``target_parameters`` form: ``(config,
    state)`` of the stock adapter, both new (``config``, a ``LoraConfig``, and ``state`` are not modified).

    ``state`` is keyed by module path (``<module>.lora_A.weight``, without PEFT's ``base_model.model.`` prefix);
    ``module_names`` and ``parameter_names`` are the model's others (not the per-expert Linears' nor theirs): the
    rewritten ranks must leave theirs as they were, and a target parameter named by its name alone must name the
    experts' parameter and none of them.
    Per experts module, the experts' ``down_proj`` LoRA of rank ``r`` is stock's ``down_proj`` LoRA as it is
    (expert ``e``'s ``A_e`` and ``B_e`` placed as :func:`stock_factors` places them); gate and up, each of rank
    ``r``, are one ``gate_up_proj`` LoRA of rank ``2r``: ``A_e`` the gate's rows then the up's, ``B_e``
    block-diagonal (the gate's rows of the update read the first ``r``, the up's the last ``r``), alpha doubled
    with the rank so that ``alpha / r`` stays. The ranks are written as PEFT writes them for a converted
    transformers-4 adapter (``rank_pattern`` / ``alpha_pattern`` keyed ``.*\\.gate_up_proj``).

    Raises:
        PeftIntegrationError: what has no exact stock form: some experts of a module without the others, gate
            without up, ranks or alphas differing between experts or between gate and up, weights other than
            ``lora_A`` / ``lora_B`` (DoRA, a LoRA bias), rsLoRA on gate and up (its scale does not follow the
            rank), or a rewritten rank that would change another module's.
    """
    modules, parameters = list(module_names), list(parameter_names)
    names = [*modules, *parameters]
    stock = copy.deepcopy(config)
    converted = {key: value for key, value in state.items()}
    ranks = dict(config.rank_pattern or {})
    alphas = dict(config.alpha_pattern or {})
    targets: dict[str, list[str]] = {GATE_UP: [], DOWN: []}
    needs: dict[str, tuple[int, float]] = {}

    def rank_and_alpha(
        name: str, patterns: tuple[dict[str, Any], dict[str, Any]] = (ranks, alphas)
    ) -> tuple[int, float]:
        """The rank and alpha PEFT gives the module or parameter ``name`` (the rewritten patterns, by default)."""
        return (
            patterns[0].get(door.pattern_key(patterns[0], name), config.r),
            patterns[1].get(door.pattern_key(patterns[1], name), config.lora_alpha),
        )

    for path, module in experts.items():
        gate, up, down = child_names(module)
        factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for child in (gate, up, down):
            linears = [f"{path}.{index}.{child}" for index in range(len(module))]
            held = [name for name in linears if any(key.startswith(f"{name}.") for key in state)]
            if not held:
                continue
            if len(held) != len(linears):
                raise PeftIntegrationError(
                    f"The adapter holds LoRA of {held[:2]}... but not of every expert's {child} of {path}: the stock "
                    "model adapts all experts of a 3-D parameter or none, so it has no exact stock form."
                )
            stacked = []
            for name in linears:
                keys = sorted(key for key in state if key.startswith(f"{name}."))
                if keys != [f"{name}.lora_A.weight", f"{name}.lora_B.weight"]:
                    raise PeftIntegrationError(
                        f"The adapter holds {keys} for {name}: per-expert LoRA converts to stock's 3-D experts' form "
                        "with lora_A and lora_B weights alone (no DoRA, no LoRA bias)."
                    )
                stacked.append((state[f"{name}.lora_B.weight"], state[f"{name}.lora_A.weight"]))
                for key in keys:
                    del converted[key]
            found = {(b.shape[1], rank_and_alpha(name)) for (b, _), name in zip(stacked, linears, strict=True)}
            if len(found) != 1 or any(rank != r for r, (rank, _) in found):
                raise PeftIntegrationError(
                    f"The experts' {child} LoRA of {path} has ranks / alphas {sorted(found)} (the tensors' rank, then "
                    "the config's rank and alpha): stock's LoRA of a 3-D parameter has one rank and alpha for all "
                    "experts, so this adapter has no exact stock form."
                )
            factors[child] = (torch.stack([b for b, _ in stacked]), torch.stack([a for _, a in stacked]))
            needs[f"{path}.{child}"] = next(iter(found))[1]
        if (gate in factors) != (up in factors):
            present, absent = (gate, up) if gate in factors else (up, gate)
            raise PeftIntegrationError(
                f"The adapter holds LoRA of the experts' {present} of {path} without their {absent}: the stock model "
                f"holds both in one 3-D {GATE_UP}, adapted as one, so it has no exact stock form."
            )
        nested = gate in factors and down in factors  # stock nests down_proj's wrapper around gate_up_proj's
        if gate in factors:
            if needs[f"{path}.{gate}"] != needs[f"{path}.{up}"]:
                raise PeftIntegrationError(
                    f"The experts' {gate} and {up} LoRA of {path} have other ranks / alphas "
                    f"({needs[f'{path}.{gate}']}, {needs[f'{path}.{up}']}): stock's {GATE_UP} LoRA has one."
                )
            if config.use_rslora:
                raise PeftIntegrationError(
                    f"The adapter uses rsLoRA on the experts' {gate} and {up} of {path}: their stock form is one LoRA "
                    "of twice the rank, whose rsLoRA scale (alpha / sqrt(rank)) is not theirs. Convert it without "
                    "rsLoRA, or load the model without linear_experts."
                )
            (b_gate, a_gate), (b_up, a_up) = factors[gate], factors[up]
            rank = a_gate.shape[1]
            gate_rows, up_rows = _gate_up_rows(module)
            b = b_gate.new_zeros(b_gate.shape[0], 2 * b_gate.shape[1], 2 * rank)
            b[:, gate_rows, :rank] = b_gate
            b[:, up_rows, rank:] = b_up
            lora_a, lora_b = stock_factors(module, b, torch.cat([a_gate, a_up], dim=1))
            prefix = f"{path}.base_layer" if nested else path
            converted[f"{prefix}.lora_A.weight"], converted[f"{prefix}.lora_B.weight"] = lora_a, lora_b
            targets[GATE_UP].append(path)
            rank_alpha = needs[f"{path}.{gate}"]
            needs[f"{path}.{GATE_UP}"] = (2 * rank_alpha[0], 2 * rank_alpha[1])
        if down in factors:
            lora_a, lora_b = stock_factors(module, *factors[down])
            converted[f"{path}.lora_A.weight"], converted[f"{path}.lora_B.weight"] = lora_a, lora_b
            targets[DOWN].append(path)
            needs[f"{path}.{DOWN}"] = needs[f"{path}.{down}"]

    for parameter, paths in targets.items():
        if not paths:
            continue
        key = rf".*\.{parameter}"
        rank, alpha = needs[f"{paths[0]}.{parameter}"]
        if parameter == GATE_UP or any(rank_and_alpha(f"{p}.{parameter}") != needs[f"{p}.{parameter}"] for p in paths):
            ranks[key], alphas[key] = rank, alpha
        # The parameter's name alone (as PEFT writes its conversion) where it names these parameters and no other.
        adapted = {f"{p}.{parameter}" for p in paths}
        matched = {
            n for n in (*parameters, *(f"{p}.{parameter}" for p in experts)) if n.rpartition(".")[2] == parameter
        }
        stock.target_parameters = sorted(
            {*(stock.target_parameters or ()), *([parameter] if matched == adapted else adapted)}
        )
    stock.rank_pattern, stock.alpha_pattern = ranks, alphas
    # The other targets of the adapter keep their ranks and alphas under the rewritten patterns.
    kept_parameters = set(config.target_parameters or ())
    targeted = [
        *(name for name in modules if door.targets_module(config, name)),
        *(name for name in parameters if any(name == t or name.endswith(f".{t}") for t in kept_parameters)),
    ]
    original = (config.rank_pattern or {}, config.alpha_pattern or {})
    changed = [name for name in targeted if rank_and_alpha(name) != rank_and_alpha(name, original)]
    wrong = [
        name
        for name, need in needs.items()
        if name.rpartition(".")[2] in STOCK_PARAMETERS and rank_and_alpha(name) != need
    ]
    if changed or wrong:
        raise PeftIntegrationError(
            f"Converting the adapter's per-expert LoRA to stock's 3-D experts' form needs rank_pattern / alpha_pattern "
            f"keys that would also change {(changed or wrong)[:2]}: it has no exact stock form with these patterns."
        )
    # Target modules that name per-expert Linears alone (the stock model has no such modules) are dropped; a name
    # or pattern that matches other modules too stays, for those.
    if isinstance(stock.target_modules, str):
        if not any(door.targets_module(config, name) for name in names):
            stock.target_modules = []
    elif stock.target_modules:
        stock.target_modules = [
            t for t in sorted(stock.target_modules) if any(n == t or n.endswith(f".{t}") for n in names)
        ]
    return stock, converted
