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

import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import _peft as door
from ..fusions.linear_experts.modules import ExpertMLP, LinearExperts
from ..fusions.linear_experts.spec import ExpertsLayout

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


@functools.cache
def experts_lora_class() -> type[nn.Module]:
    """:class:`ExpertsLora`, created on first use because it derives from PEFT's ``LoraLayer``."""

    class ExpertsLora(nn.Module, door.lora_layer()):  # type: ignore[misc]  # a class of the installed PEFT
        """LoRA of one stock 3-D expert parameter (``parameter_name``) on ``linear_experts``: stock ``ParamWrapper``'s
        tensors and keys, computed at the experts' Linears.

        ``base_layer`` is the experts module, or the ``ExpertsLora`` of its other parameter (nested as stock PEFT
        nests its wrappers). Merging adds each expert's update to its Linears' weights.
        """

        def __init__(
            self, base_layer: nn.Module, adapter_name: str, parameter_name: str, config: Any, r: int, lora_alpha: float
        ):
            nn.Module.__init__(self)
            self.parameter_name = parameter_name
            experts = _experts_below(base_layer)
            count, hidden, intermediate = experts.num_experts, experts.hidden_dim, experts.intermediate_dim
            out_features, in_features = (
                (2 * intermediate, hidden) if parameter_name == GATE_UP else (hidden, intermediate)
            )
            if not _reads_as_linear(experts):
                out_features, in_features = in_features, out_features
            self._features = (in_features, out_features)
            self.num_experts = count
            door.lora_layer().__init__(self, base_layer)
            self.set_adapter(adapter_name)  # as PEFT's layers start: the adapter they are made for is active
            self._handles: list[RemovableHandle] = []
            self.update_layer(adapter_name, r, lora_alpha, config)
            for index, child, rows in _lora_linear_rows(experts, parameter_name):
                linear = getattr(experts[index], child)
                self._handles.append(linear.register_forward_hook(_ExpertHook(self, index, rows)))

        def base_features(self, module: nn.Module) -> tuple[int, int]:
            return self._features

        def update_layer(self, adapter_name: str, r: int, lora_alpha: float, config: Any, **kwargs: Any) -> None:
            # As stock's ParamWrapper makes them: lora_A (r·E, in), lora_B (out, r·E), initialised alike.
            self.r[adapter_name] = r
            self.lora_alpha[adapter_name] = lora_alpha
            self.lora_dropout[adapter_name] = nn.Identity()
            self.lora_A[adapter_name] = nn.Linear(self.in_features, r * self.num_experts, bias=False)
            self.lora_B[adapter_name] = nn.Linear(r * self.num_experts, self.out_features, bias=False)
            self.lora_bias[adapter_name] = False
            self.scaling[adapter_name] = lora_alpha / (r**0.5 if config.use_rslora else r)
            self.use_rslora[adapter_name] = config.use_rslora
            self.use_dora[adapter_name] = False
            self.reset_lora_parameters(adapter_name, config.init_lora_weights)
            weight = _experts_below(self).parameters().__next__()
            for factor in (self.lora_A, self.lora_B):
                factor[adapter_name] = factor[adapter_name].to(weight.device, dtype=weight.dtype)
            self.set_adapter(self.active_adapters, inference_mode=config.inference_mode)

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
                for handle in layer._handles:
                    handle.remove()
                layer = layer.base_layer
            return layer

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return self.base_layer(*args, **kwargs)

        def __getattr__(self, name: str) -> Any:
            try:
                return super().__getattr__(name)
            except AttributeError:
                if name == "base_layer":
                    raise
                return getattr(self.base_layer, name)  # what the MoE block reads of its experts

    ExpertsLora.__module__ = __name__
    ExpertsLora.__qualname__ = ExpertsLora.__name__
    return ExpertsLora


def __getattr__(name: str) -> Any:
    # The layer class is created on first use; this makes it importable (and picklable) by name all the same.
    if name == "ExpertsLora":
        return experts_lora_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _scaled_product(b: torch.Tensor, a: torch.Tensor, scale: float) -> torch.Tensor:
    return (b @ a) * scale


def _experts_below(layer: nn.Module) -> LinearExperts:
    while not isinstance(layer, LinearExperts):
        layer = layer.base_layer  # type: ignore[assignment]
    return layer


def add_expert_layers(
    peft_model: Any, config: Any, adapter_name: str, targets: Mapping[str, tuple[str, ...]], autocast: bool = True
) -> None:
    """Wrap the experts at each path of ``targets`` (below ``peft_model``'s base model) in an :class:`ExpertsLora` per
    stock parameter listed, in stock's order (the first innermost), for the stock adapter ``config``.

    Ranks and alphas are those PEFT gives the stock parameter (``rank_pattern`` / ``alpha_pattern`` looked up for
    ``<experts>.gate_up_proj``, as PEFT does). Float16 / bfloat16 LoRA weights become float32 as PEFT's
    ``autocast_adapter_dtype`` makes its own; in inference mode they are frozen.
    """
    model = peft_model.base_model.model
    layer_class: Any = experts_lora_class()
    for path, parameters in targets.items():
        parent_name, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_name)
        for parameter in parameters:
            key = f"{path}.{parameter}"
            ranks, alphas = config.rank_pattern or {}, config.alpha_pattern or {}
            rank = ranks.get(door.pattern_key(ranks, key), config.r)
            alpha = alphas.get(door.pattern_key(alphas, key), config.lora_alpha)
            current: Any = getattr(parent, child)
            layer = current
            while isinstance(layer, layer_class) and layer.parameter_name != parameter:
                layer = layer.base_layer
            if isinstance(layer, layer_class):  # another adapter on the same parameter
                layer.update_layer(adapter_name, rank, alpha, config)
            else:
                setattr(parent, child, layer_class(current, adapter_name, parameter, config, rank, alpha))
        for name, weight in cast(nn.Module, getattr(parent, child)).named_parameters():
            if f"lora_A.{adapter_name}." in name or f"lora_B.{adapter_name}." in name:
                if autocast and weight.dtype in (torch.float16, torch.bfloat16):
                    weight.data = weight.data.float()
                weight.requires_grad_(not config.inference_mode)
