"""Bottom I/O layer: validated, zero-copy checkpoint reading and atomic checkpoint writing.

The names below are imported on first use (PEP 562): the modules that map tensors import torch, and the checkpoint
prefetch (:mod:`~modelpatch.checkpoint.prefetch`) runs before torch is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modelpatch.checkpoint.checkpoint import Checkpoint
    from modelpatch.checkpoint.safetensors_file import SafetensorsFile, TensorInfo
    from modelpatch.checkpoint.writer import write_checkpoint

# Public name -> the module that defines it.
_LAZY = {
    "Checkpoint": "checkpoint",
    "SafetensorsFile": "safetensors_file",
    "TensorInfo": "safetensors_file",
    "write_checkpoint": "writer",
}

__all__ = ["Checkpoint", "SafetensorsFile", "TensorInfo", "write_checkpoint"]


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value
