"""``device_map``: one device for the whole model, or several (and disk) with accelerate's big-model dispatch."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from .._transformers import no_split_modules

_AUTO = ("auto", "balanced", "balanced_low_0", "sequential")


def single_device(device_map: str | int | torch.device | Mapping[str, Any]) -> torch.device | None:
    """The one device ``device_map`` puts the whole model on, or None when it asks for a dispatch.

    As in transformers: a device name (``"cpu"``, ``"cuda:0"``; ``"cuda"`` is the ``LOCAL_RANK`` GPU), an index, a
    ``torch.device`` or ``{"": device}`` mean one device; the model is then loaded straight onto it.
    """
    if isinstance(device_map, Mapping):
        whole = device_map.get("") if len(device_map) == 1 else None
        return None if whole is None or whole == "disk" else _device(whole)
    if isinstance(device_map, str) and device_map in _AUTO:
        return None
    if device_map == "cuda":
        device_map = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return _device(device_map)


def _device(value: Any) -> torch.device:
    if isinstance(value, bool) or (isinstance(value, int) and value < 0):
        raise ValueError(f"device_map names no device: {value!r} (for the CPU, pass 'cpu').")
    try:
        return torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device_map must be a dict or one of {_AUTO}, or a device ('cpu', 'cuda:0', 0), got {value!r}."
        ) from None


def resolve_device_map(
    model: PreTrainedModel, device_map: str | Mapping[str, Any], max_memory: Mapping[Any, Any] | None
) -> dict[str, Any]:
    """``device_map`` as an explicit ``{module name: device}``; "auto" asks accelerate to fit ``max_memory``."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    if isinstance(device_map, str):
        no_split = no_split_modules(model)
        if device_map != "sequential":
            max_memory = get_balanced_memory(
                model, max_memory=max_memory, no_split_module_classes=no_split, low_zero=device_map == "balanced_low_0"
            )
        return infer_auto_device_map(
            model, max_memory=dict(max_memory) if max_memory else None, no_split_module_classes=no_split
        )
    modules = dict(model.named_modules())
    unknown = sorted(name for name in device_map if name not in modules)
    if unknown:
        raise ValueError(
            f"device_map names modules that {type(model).__name__} does not have: {', '.join(map(repr, unknown))}."
        )
    return dict(device_map)


def dispatch(
    model: PreTrainedModel,
    device_map: str | Mapping[str, Any],
    *,
    max_memory: Mapping[Any, Any] | None = None,
    offload_folder: str | Path | None = None,
    offload_buffers: bool = False,
) -> PreTrainedModel:
    """Place ``model``'s modules per ``device_map`` and add the hooks that move activations between devices.

    ``device_map`` is ``"auto"`` (or another of accelerate's strategies) or ``{module name: device}``; one device for
    the whole model is :func:`single_device`'s case, loaded there directly.
    """
    from accelerate import dispatch_model

    resolved = resolve_device_map(model, device_map, max_memory)
    if "disk" in resolved.values() and offload_folder is None:
        raise ValueError("device_map offloads modules to 'disk'; pass offload_folder=... for the offloaded weights.")
    model = dispatch_model(model, device_map=resolved, offload_dir=offload_folder, offload_buffers=offload_buffers)
    # torch annotates Module.__setattr__ for tensors and modules; other values are stored as plain attributes.
    model.hf_device_map = resolved  # type: ignore[assignment]
    return model
