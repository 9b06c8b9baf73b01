"""The weights of a LoRA model as ``merge_and_unload()`` would leave them, computed one tensor at a time.

Reinforcement learning with LoRA (TRL's GRPO and the like) pushes the merged weights to an inference engine after
each step. Stock PEFT gets them by ``merge_adapter()``, reading ``named_parameters()`` (fused names on a fused model,
``base_layer.`` infixes to strip) and ``unmerge_adapter()``, or by merging a second copy of the model.
:func:`merged_model` describes instead, without changing the model, what a merge would change: each tensor of the
merged model under its name there (the adapter layers' ``lora_*`` tensors left out, ``base_layer.`` infixes dropped)
and, for each tensor an adapter touches, the updates its merge adds, in the order and the dtypes PEFT adds them. The
stream (:func:`modelpatch.iter_original_state_dict`) plans the save of that state as it plans any other, and each
updated tensor is computed when its turn comes: the model's tensor copied, each layer's own delta added to the copy.

Every layer is asked for its own delta (PEFT's ``get_delta_weight``, or ``delta_weights`` of a layer of modelpatch's
whose update lands on other modules' weights: the experts' LoRA of ``linear_experts``), and added as that layer's
``merge`` adds it, so that the bits are the merge's. A LoRA on one part of a fused projection adds to that part's
rows of the fused weight. Adapters already merged (``merge_adapter()``; each layer lists them in
``merged_adapters``) are in the weights already and are not added again; adapters not active are not added, as
``merge_and_unload()`` merges the active ones. What no exact merge is known for here is refused by name before
anything is computed: other PEFT methods (IA3, LoHa, ...), LoRA variants (DoRA, ...), LoRA of other layer kinds
(convolutions, quantized layers), ``modules_to_save`` and trainable-token wrappers, replicated layers, a sharded
model.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast, runtime_checkable

import torch
from torch import nn
from transformers import PreTrainedModel

from .. import _peft as door
from ..errors import PeftIntegrationError
from ..fusions.projections.modules import ProjectionSlice
from ..modes.distributed import refuse_sharded

__all__ = ["MergedModel", "PerModuleDeltas", "merged_model"]

_REMEDY = (
    "Merge a copy instead (merged = copy.deepcopy(peft_model).merge_and_unload(), then "
    "modelpatch.iter_original_state_dict(merged)), or stream the adapter and the base weights apart."
)


@runtime_checkable
class PerModuleDeltas(Protocol):
    """A LoRA layer whose merge adds to the weights of modules below its base layer, one update per module (the
    experts' LoRA of ``linear_experts``: each expert's Linears), each added as ``weight + update.to(weight.dtype)``."""

    def delta_weights(self, adapter_name: str) -> Iterator[tuple[nn.Module, Callable[[], torch.Tensor]]]:
        """Each module whose ``weight`` merging ``adapter_name`` changes, with its update (computed when called)."""
        ...


@dataclass(frozen=True)
class _Update:
    """What merging one adapter of one layer adds to one tensor of the merged model.

    Attributes:
        delta: The layer's delta, computed when called (the stream holds one at a time).
        rows: The rows of the tensor it adds to (one part of a fused projection); None: the whole tensor.
        cast_first: The delta is cast to the tensor's dtype before the add (PEFT's Embedding, the experts' LoRA);
            otherwise it is added in place in the two dtypes' common one (PEFT's Linear and parameter LoRA: a
            float32 delta into a bfloat16 weight is added in float32, then rounded).
    """

    delta: Callable[[], torch.Tensor]
    rows: slice | None = None
    cast_first: bool = False

    def apply(self, merged: torch.Tensor) -> None:
        target = merged if self.rows is None else merged[self.rows]
        delta = self.delta()
        target += delta.to(target.dtype) if self.cast_first else delta


@dataclass(frozen=True)
class MergedModel:
    """A LoRA model's weights as ``merge_and_unload()`` would leave them, under the names the merged model has.

    Attributes:
        model: The transformers model under the adapters (what ``merge_and_unload()`` returns, unmerged).
        state: Its tensors but the adapters', under the merged model's names, as the model holds them now.
        updates: Name -> what merging adds to that tensor, in the order the merge adds it.
    """

    model: PreTrainedModel
    state: dict[str, torch.Tensor]
    updates: Mapping[str, list[_Update]]

    def fetch(self, read: Callable[[str], torch.Tensor]) -> Callable[[str], torch.Tensor]:
        """``read`` (the model's tensor by name) with each updated tensor merged: a copy, the updates added to it."""

        def merged(key: str) -> torch.Tensor:
            tensor = read(key)
            updates = self.updates.get(key)
            if not updates:
                return tensor
            with torch.no_grad():
                result = tensor.clone()
                for update in updates:
                    update.apply(result)
            return result

        return merged


def merged_model(model: Any) -> MergedModel | None:
    """What merging the adapters of ``model`` (a ``PeftModel``, its ``LoraModel``, or the transformers model they
    adapt) would give, or None when ``model`` carries no PEFT adapter. Nothing is changed and no delta computed.

    Raises:
        PeftIntegrationError: An adapter this cannot merge exactly (named, with the layer), or a sharded model.
    """
    if not (_from_peft(model) or any(_from_peft(module) for module in _modules(model))):
        return None
    peft = door.import_peft()
    layers = door.lora_merge_layers()
    base = _unwrapped(peft, model)
    refuse_sharded(base, "iter_original_state_dict() of a LoRA model", _REMEDY, PeftIntegrationError)
    tuners: dict[str, Any] = {}
    for path, module in base.named_modules():
        if isinstance(module, layers.auxiliary):
            raise PeftIntegrationError(
                f"{path} is a {type(module).__name__} (modules_to_save / trainable tokens): its merged weights are not "
                f"streamed. {_REMEDY}"
            )
        if isinstance(module, layers.tuner):
            tuners[path] = module
    rename = functools.partial(_merged_name, set(tuners))
    names = {id(module): rename(path) for path, module in base.named_modules()}
    state: dict[str, torch.Tensor] = {}
    for key, tensor in base.state_dict().items():
        name = rename(key)
        if name is not None:
            state[name] = tensor
    updates: dict[str, list[_Update]] = defaultdict(list)
    for path, layer in tuners.items():
        for key, update in _layer_updates(layers, path, layer, names):
            if key not in state:
                raise PeftIntegrationError(
                    f"The LoRA of {path} ({type(layer).__name__}) merges into {key}, which the model does not hold "
                    f"(a LoRA bias on a layer without one?). {_REMEDY}"
                )
            updates[key].append(update)
    return MergedModel(base, state, dict(updates))


def _from_peft(obj: object) -> bool:
    """Whether ``obj``'s class is, or derives from, one of PEFT's (a PEFT model or adapter layer, or ours)."""
    return any(cls.__module__.split(".")[0] == "peft" for cls in type(obj).__mro__)


def _modules(model: Any) -> Iterator[nn.Module]:
    return model.modules() if isinstance(model, nn.Module) else iter(())


def _unwrapped(peft: Any, model: Any) -> PreTrainedModel:
    """The transformers model under a ``PeftModel`` or a ``LoraModel`` (or ``model`` itself), refusing what is no
    LoRA model PEFT's merge would merge."""
    if isinstance(model, peft.PeftModel) and not isinstance(model, peft.PeftMixedModel):
        model = model.base_model
    if isinstance(model, peft.LoraModel):
        replicated = [name for name, config in model.peft_config.items() if getattr(config, "layer_replication", None)]
        if replicated:
            raise PeftIntegrationError(
                f"Adapter(s) {replicated} replicate layers (layer_replication): PEFT does not merge those, and neither "
                "does the stream of merged weights."
            )
        model = model.model
    if not isinstance(model, PreTrainedModel) or _from_peft(model):
        raise PeftIntegrationError(
            f"iter_original_state_dict() merges LoRA adapters of a PeftModel over a transformers model; "
            f"{type(model).__name__} is none (another PEFT method, a mixed model or a prompt-learning model has no "
            f"merge it could stream). {_REMEDY}"
        )
    return model


def _merged_name(tuners: set[str], key: str) -> str | None:
    """``key`` (a module path or a tensor key of the adapted model) in the merged model: each ``base_layer`` below an
    adapter layer dropped; None for what lies inside an adapter layer but outside its base layer (``lora_A``, ...)."""
    kept: list[str] = []
    path = ""
    for index, part in enumerate(key.split(".")):
        if index and path in tuners:
            if part != "base_layer":
                return None
        else:
            kept.append(part)
        path = f"{path}.{part}" if index else part
    return ".".join(kept)


def _to_merge(layer: Any, adapters: Mapping[str, Any]) -> list[str]:
    """The adapters ``merge_and_unload()`` merges into ``layer``: the active ones it has, less those merged already."""
    merged = set(layer.merged_adapters)
    return [name for name in layer.active_adapters if name in adapters and name not in merged]


def _layer_updates(
    layers: door.LoraMergeLayers, path: str, layer: Any, names: Mapping[int, str | None]
) -> Iterator[tuple[str, _Update]]:
    """(tensor name in the merged model, update) of each adapter ``layer`` (at ``path``) merges, as its merge adds
    them."""
    if isinstance(layer, door.lora_layer()) and isinstance(layer, PerModuleDeltas):
        for adapter in _to_merge(layer, cast(Any, layer).lora_A):
            for module, delta in layer.delta_weights(adapter):
                yield f"{names[id(module)]}.weight", _Update(delta, cast_first=True)
        return
    kind = type(layer)
    base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else None
    if kind is layers.linear or (isinstance(layer, door.lora_linear()) and isinstance(base, ProjectionSlice)):
        if isinstance(base, ProjectionSlice):  # one part of a fused projection: its rows of the fused weight
            owner = path.rpartition(".")[0]
            target, rows = f"{owner}.{base.fused_name}" if owner else base.fused_name, base.rows()
        else:
            target, rows = str(names[id(base)]), None
        for adapter in _to_merge(layer, layer.lora_A):
            _refuse_variant(path, layer, adapter)
            yield f"{target}.weight", _Update(functools.partial(layer.get_delta_weight, adapter), rows)
            if layer.lora_bias[adapter]:
                yield f"{target}.bias", _Update(functools.partial(_lora_bias, layer, adapter), rows)
    elif kind is layers.embedding:
        for adapter in _to_merge(layer, layer.lora_embedding_A):
            _refuse_variant(path, layer, adapter)
            yield f"{names[id(base)]}.weight", _Update(functools.partial(layer.get_delta_weight, adapter), None, True)
    elif kind is layers.parameter:
        for adapter in _to_merge(layer, layer.lora_A):
            yield (
                f"{names[id(base)]}.{layer.parameter_name}",
                _Update(functools.partial(layer.get_delta_weight, adapter)),
            )
    else:
        raise PeftIntegrationError(
            f"{path} is a {kind.__module__}.{kind.__qualname__} adapter layer: the stream of merged weights merges "
            "PEFT's LoRA of Linear and Embedding layers and of parameters (target_parameters), and modelpatch's LoRA "
            f"layers, not this one. {_REMEDY}"
        )


def _lora_bias(layer: Any, adapter: str) -> torch.Tensor:
    # What PEFT's Linear.merge adds to the base bias for lora_bias=True.
    return layer.lora_B[adapter].bias * layer.scaling[adapter]


def _refuse_variant(path: str, layer: Any, adapter: str) -> None:
    variant = getattr(layer, "lora_variant", {}).get(adapter)
    if variant is not None:
        raise PeftIntegrationError(
            f"Adapter {adapter!r} of {path} is a LoRA variant ({type(variant).__name__}: DoRA, ...), whose merge is "
            f"not the plain W + scale * B @ A: its merged weights are not streamed. {_REMEDY}"
        )
