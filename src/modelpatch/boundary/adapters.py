"""Stock PEFT's ``target_modules="all-linear"`` on a fused model: refused before PEFT adapts anything.

On a fused model PEFT's "all-linear" finds the fused layers (``qkv_proj``, ``gate_up_proj``: ``nn.Linear``
subclasses) and adapts them. Its adapter then names modules that only the fused model has while it names the original
checkpoint as its base model, and stock PEFT loading it there adapts the other layers and drops the fused layers'
weights without a word. The experts of ``linear_experts`` are the same case: "all-linear" finds their per-expert
Linears, which the stock model (two 3-D parameters per experts module) does not have. (An adapter of the fused
layers alone loads nowhere but on a fused model: there stock PEFT says so, as it finds none of its target modules.)

Saving that adapter in the original names instead (one LoRA of the same rank per part: the same A, B's rows split) is
not done: PEFT resolves "all-linear" in the config itself and writes that config as it is, and no call of PEFT's
between the two reaches modelpatch. What does reach it is the one call PEFT's resolution makes to the model:
``model.get_output_embeddings()`` (to leave the output embedding out), after finding the Linear layers and before
making any adapter layer. Every transformers model (the model and its sub-models) of a model that modelpatch builds or
restructures therefore gets that method as an instance attribute (transformers' classes stay untouched):
:func:`output_embeddings` (a bound method), transformers' own method except when its caller is PEFT's resolution
(recognised through the PEFT door) and the model holds fused projections. Where the resolution is modelpatch's own
(``modelpatch.get_peft_model`` replaces the fused layers it finds by their original names), it is let through.

PEFT asks for the output embedding of transformers models only: "all-linear" on a module that is none (a wrapper of a
fused model) is not seen here.

Stock PEFT given the per-expert Linears by name is refused later, when it saves their LoRA
(:func:`refuse_per_expert_lora_save`): no earlier call of PEFT's reaches modelpatch. Stock PEFT loading an adapter
with ``target_parameters`` of the stock 3-D experts onto fused experts (``PeftModel.from_pretrained(fused, dir)``),
which matches nothing there and only warns, is refused when it loads their weights
(:func:`refuse_stock_expert_lora_load`), for the same reason.
"""

from __future__ import annotations

import sys
import weakref
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn
from transformers import PreTrainedModel

from .. import _peft as door
from ..errors import PeftIntegrationError
from ..fusions.projections.modules import ProjectionSlice
from .methods import bind_method

__all__ = [
    "install_adapter_guard",
    "output_embeddings",
    "refuse_per_expert_lora_save",
    "refuse_stock_expert_lora_load",
]


def output_embeddings(model: PreTrainedModel) -> nn.Module | None:
    """``model.get_output_embeddings`` of a transformers model modelpatch built or restructured (bound to it):
    transformers' method, which refuses PEFT's resolution of ``"all-linear"`` on a model holding fused projections."""
    # The caller's frame, to tell PEFT's resolution of "all-linear" from every other caller. Only a fused model asks
    # the door which PEFT function calls (a PEFT release without that function is refused there by name).
    caller = sys._getframe(1)
    if door.runs_peft(caller) and not door.modelpatch_resolves():
        fused = fused_projections(model)
        if fused and door.resolves_all_linear(caller):
            raise PeftIntegrationError(_all_linear_refusal(model, fused))
    return type(model).get_output_embeddings(model)


def install_adapter_guard(model: nn.Module) -> None:
    """Give each transformers model within ``model`` (itself included) :func:`output_embeddings` as its
    ``get_output_embeddings``, and ``model`` the state-dict hooks that refuse stock PEFT's saves and loads of expert
    LoRA it would carry partly (:func:`refuse_per_expert_lora_save`, :func:`refuse_stock_expert_lora_load`), once.

    The hooks sit on ``model`` itself, not on its experts modules: a live ``fuse`` / ``unfuse`` replaces those, and a
    state-dict hook of modelpatch's own there would read to the restructuring as a user's hook losing its meaning.
    """
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            bind_method(module, "get_output_embeddings", output_embeddings)
    if model not in _GUARDED:
        _GUARDED.add(model)
        model.register_state_dict_post_hook(_saving)
        model.register_load_state_dict_pre_hook(_loading)


# The models given the state-dict hooks (a restructuring installs the guard again on the same model).
_GUARDED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _fused_experts(model: nn.Module, prefix: str) -> Iterator[tuple[nn.Module, str]]:
    """Each module of ``model`` that stands for stock parameters (``original_names()``: the fused experts), with the
    prefix of its keys."""
    for name, module in model.named_modules():
        if callable(getattr(type(module), "original_names", None)):
            yield module, f"{prefix}{name}."


def _saving(model: nn.Module, state_dict: Mapping[str, Any], prefix: str, metadata: Any) -> None:
    if door.saves_adapter(sys._getframe(1)):
        for _, experts_prefix in _fused_experts(model, prefix):
            refuse_per_expert_lora_save(state_dict, experts_prefix)


def _loading(model: nn.Module, state_dict: Mapping[str, Any], prefix: str, *args: Any) -> None:
    if door.loads_adapter(sys._getframe(1)):
        for experts, experts_prefix in _fused_experts(model, prefix):
            refuse_stock_expert_lora_load(experts, state_dict, experts_prefix)


def refuse_stock_expert_lora_load(module: nn.Module, state_dict: Mapping[str, Any], prefix: str) -> None:
    """PEFT loading LoRA that the fused experts ``module`` (its keys under ``prefix``) has no layer for is refused.

    Stock ``PeftModel.from_pretrained(fused_model, dir)`` (or ``load_adapter`` on a PeftModel stock PEFT made) of an
    adapter with ``target_parameters`` of the stock 3-D experts finds no such parameter on the fused experts (they
    are per-expert Linears) and only warns; the adapter's other layers are made, and its expert LoRA would be left
    out. PEFT matches the targets by its own code, so the first call that reaches modelpatch is the weights' load
    (``peft.set_peft_model_state_dict``), where the experts' keys (``<experts>.lora_A.<adapter>.weight``, nested
    ``base_layer.`` for the second parameter) arrive at a module that has nothing of that name.
    """
    own = {name for name, _ in module.named_children()} | set(module._parameters) | set(module._buffers)
    relative = [key[len(prefix) :] for key in state_dict if key.startswith(prefix)]
    lost = [f"{prefix}{key}" for key in relative if ".lora_" in f".{key}" and key.split(".")[0] not in own]
    if lost:
        raise PeftIntegrationError(
            f"PEFT is loading LoRA of the stock 3-D experts of {prefix.rstrip('.')} ({lost[:2]}, ...) onto "
            "modelpatch's linear_experts, whose experts are per-expert Linears: stock PEFT made no layer for it and "
            "would drop it without a word (its target_parameters matched nothing). Load the adapter with "
            "modelpatch.load_adapter(model, dir), and further adapters with load_adapter of the PeftModel it returns, "
            "which carry the experts' LoRA exactly."
        )


def refuse_per_expert_lora_save(state_dict: Mapping[str, Any], prefix: str) -> None:
    """PEFT saving LoRA of the per-expert Linears of the fused experts whose keys lie under ``prefix`` is refused.

    Stock PEFT given those Linears by name (``LoraConfig(target_modules=["gate_proj", "up_proj", "down_proj"])``,
    for model types PEFT does not rewrite into ``target_parameters``) adapts each Linear: its adapter names modules
    the original checkpoint does not have (two 3-D parameters per experts module), and stock PEFT loading it there
    drops their LoRA without a word. PEFT calls nothing of the model's between resolving those targets and making the
    layers (the names are matched by PEFT's own code), so nothing is refused before the layers exist; what does reach
    modelpatch is the save (``peft.get_peft_model_state_dict`` collects the weights through ``state_dict``), and its
    config (names, no ``target_parameters``) is PEFT's, so that save cannot be made the stock adapter here.
    """
    held = [key for key in state_dict if key.startswith(prefix) and ".lora_" in key]
    if held:
        raise PeftIntegrationError(
            f"PEFT is saving LoRA of the per-expert Linears of {prefix.rstrip('.')} ({held[:2]}, ...), which stock "
            "PEFT made on modelpatch's linear_experts: the original checkpoint holds these experts as 3-D parameters, "
            "so stock PEFT loading this adapter there would drop their LoRA without a word. Make the adapter with "
            "modelpatch.get_peft_model(model, config) (the same config), which saves stock PEFT's target_parameters "
            "form; an adapter already saved per expert (PEFT on transformers 4) loads exactly with "
            "modelpatch.load_adapter."
        )


def fused_projections(model: nn.Module) -> dict[str, list[str]]:
    """Each fused layer of ``model`` (its path) -> the original names of its parts, in order: the fused projections
    (told by their slices) and every fused module that says which original names it stands for (an
    ``original_names()`` method of its class: the experts of ``linear_experts``, whose per-expert Linears
    "all-linear" would adapt one by one where the stock model has two 3-D parameters)."""
    parts: dict[str, dict[int, str]] = defaultdict(dict)
    for name, module in model.named_modules():
        if isinstance(module, ProjectionSlice):
            owner, _, original = name.rpartition(".")
            fused = f"{owner}.{module.fused_name}" if owner else module.fused_name
            parts[fused][module.index] = original
        elif callable(getattr(type(module), "original_names", None)):
            parts[name] = dict(enumerate(module.original_names()))
    return {fused: [names[i] for i in sorted(names)] for fused, names in parts.items()}


def _all_linear_refusal(model: PreTrainedModel, fused: dict[str, list[str]]) -> str:
    shown = [f"{name} ({', '.join(parts)})" for name, parts in list(fused.items())[:3]]
    more = f", ... ({len(fused)} in all)" if len(fused) > 3 else ""
    base = model.__dict__.get("name_or_path") or "the original checkpoint"
    return (
        f"PEFT's target_modules='all-linear' would adapt the fused layers {', '.join(shown)}{more} of this "
        f"{type(model).__name__}: its adapter would name them, and stock PEFT loading it on its base model ({base}) "
        "would drop their weights without a word. Use modelpatch.get_peft_model(model, config), which adapts their "
        "original names as on the stock model (and modelpatch.load_adapter for an adapter saved with "
        "'all-linear' in its config)."
    )
