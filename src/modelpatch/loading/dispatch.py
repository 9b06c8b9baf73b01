"""Spread a loaded model over several devices (and disk) with accelerate's big-model dispatch."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

_AUTO = ("auto", "balanced", "balanced_low_0", "sequential")


def resolve_device_map(
    model: PreTrainedModel, device_map: str | Mapping[str, Any], max_memory: Mapping[Any, Any] | None
) -> dict[str, Any]:
    """``device_map`` as an explicit ``{module name: device}``; "auto" asks accelerate to fit ``max_memory``."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    if isinstance(device_map, str):
        if device_map not in _AUTO:
            raise ValueError(f"device_map must be a dict or one of {_AUTO}, got {device_map!r}.")
        no_split = sorted(getattr(model, "_no_split_modules", None) or [])
        if device_map != "sequential":
            max_memory = get_balanced_memory(
                model, max_memory=max_memory, no_split_module_classes=no_split, low_zero=device_map == "balanced_low_0"
            )
        return infer_auto_device_map(model, max_memory=dict(max_memory) if max_memory else None, no_split_module_classes=no_split)
    if not isinstance(device_map, Mapping):
        raise TypeError(f"device_map must be a dict or one of {_AUTO}, got {device_map!r}.")
    modules = dict(model.named_modules())
    unknown = sorted(name for name in device_map if name not in modules)
    if unknown:
        raise ValueError(f"device_map names modules that {type(model).__name__} does not have: {', '.join(map(repr, unknown))}.")
    return dict(device_map)


def dispatch(
    model: PreTrainedModel,
    device_map: str | Mapping[str, Any],
    *,
    max_memory: Mapping[Any, Any] | None = None,
    offload_folder: str | Path | None = None,
) -> PreTrainedModel:
    """Place ``model``'s modules per ``device_map`` and add the hooks that move activations between devices."""
    from accelerate import dispatch_model

    resolved = resolve_device_map(model, device_map, max_memory)
    if "disk" in resolved.values() and offload_folder is None:
        raise ValueError("device_map offloads modules to 'disk'; pass offload_folder=... for the offloaded weights.")
    model = dispatch_model(model, device_map=resolved, offload_dir=offload_folder)
    model.hf_device_map = resolved
    return model
