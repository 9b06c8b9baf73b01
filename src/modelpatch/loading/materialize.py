"""Execute a validated load plan: put checkpoint data into a meta-device model.

Tensors that need no conversion are memory-mapped views of the checkpoint (zero-copy) whenever their dtype and
device already match. Converted groups are materialised one at a time, so peak memory stays near the model's size
plus its largest group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from .plan import LoadPlan

# Below this many bytes a load is quick enough that a progress bar is noise.
PROGRESS_BAR_MIN_BYTES = 256 * 1024 * 1024


def set_tensor(model: nn.Module, key: str, value: torch.Tensor) -> None:
    """Replace parameter or buffer ``key`` of ``model`` by ``value``, keeping its kind and ``requires_grad``."""
    module_name, _, name = key.rpartition(".")
    module = model.get_submodule(module_name)
    if name in module._parameters:
        old = module._parameters[name]
        param = nn.Parameter(value, requires_grad=old.requires_grad if old is not None else value.is_floating_point())
        param._is_hf_initialized = True
        module._parameters[name] = param
    elif name in module._buffers:
        value._is_hf_initialized = True
        module._buffers[name] = value
    else:
        raise KeyError(f"{key} is neither a parameter nor a buffer of the model.")


def _placed(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if tensor.is_floating_point() and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor if tensor.device == device else tensor.to(device)


def load_into_model(
    model: nn.Module,
    plan: LoadPlan,
    fetch: Callable[[str], torch.Tensor],
    device: torch.device,
    total_bytes: int,
) -> None:
    """Fill every planned parameter of ``model`` from ``fetch(checkpoint_key)``."""
    expected = plan.expected
    with tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        desc="Loading weights",
        disable=total_bytes < PROGRESS_BAR_MIN_BYTES,
        leave=False,
    ) as progress:
        for runtime_key, checkpoint_key in plan.conversion.direct.items():
            if runtime_key not in expected:
                continue
            tensor = fetch(checkpoint_key)
            set_tensor(model, runtime_key, _placed(tensor, expected[runtime_key].dtype, device))
            progress.update(tensor.numel() * tensor.element_size())
        for group in plan.conversion.groups:
            outputs = group.run(fetch)
            for runtime_key, tensor in outputs.items():
                if runtime_key in expected:
                    set_tensor(model, runtime_key, _placed(tensor.contiguous(), expected[runtime_key].dtype, device))
                progress.update(tensor.numel() * tensor.element_size())
            del outputs
