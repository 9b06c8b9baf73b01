"""The stage interface of load modes: what a load does besides filling a model on one device.

A load runs the same stages whatever it was asked for: plan (config and headers only), build the model on the meta
device, plan where every tensor comes from, read and convert the tensors, let transformers finish the model. A *load
mode* changes where and how the tensors land — quantization, tensor parallelism, device-map dispatch and disk
offload, fully sharded data parallelism — and it does so only through the hooks below, called by the loader at the
same points of every load, for each mode it was given, in order. The loader never asks which modes it holds.

Every hook has a default that changes nothing, so a mode implements only the stages it takes part in. The hooks of
a save (:meth:`LoadMode.prepare_save`) run when a model the mode loaded is saved, so the mode that changed how
tensors live on the model is the one that gives them back in plain form.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..checkpoint import Checkpoint
    from .plan import LoadPlan


@dataclass(frozen=True)
class TensorSource:
    """Where the loader reads a checkpoint tensor from.

    Attributes:
        fetch: ``fetch(checkpoint_key)`` returns the tensor (a view of the memory-mapped file where possible).
        file_mapped: ``file_mapped(checkpoint_key)`` says whether ``fetch`` returns a view of a private file mapping,
            whose resident pages may be dropped once the tensor was copied or converted.
    """

    fetch: Callable[[str], torch.Tensor]
    file_mapped: Callable[[str], bool]


class LoadMode:
    """One way of placing a load's tensors; subclasses override the hooks of the stages they take part in.

    The hooks, in the order a load calls them:

    1. :meth:`update_dtype` — while the load's dtype is resolved, before anything is built;
    2. :meth:`prepare_model` — on the meta model as it is built (still under the load's patches);
    3. :meth:`plan` — once the load plan is complete and validated, before any tensor data is read: a mode that
       cannot do what it was asked refuses here, so nothing is read;
    4. :meth:`wrap_source` — the tensor source the loader reads from (each mode wraps the previous mode's);
    5. :meth:`device` — where the loaded tensors are placed (the last mode that names one wins);
    6. :meth:`after_load` — after every tensor was placed, while the checkpoint files are still open;
    7. :meth:`finish` — after transformers' finalisation (buffers, new parameters, tied weights) and the load
       report; returns the model the caller gets (a mode may wrap it);
    8. :meth:`prepare_save` — when the model is saved: turns the model's state into plain tensors of the runtime
       layout (gathered, dequantized or read back from disk), before the save's reverse conversions run.
    """

    #: Short name used in messages ("quantization", "tensor parallelism", ...).
    name: str = "load mode"

    def update_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the model is built in, given the one the load resolved."""
        return dtype

    def prepare_model(self, model: PreTrainedModel, *, dtype: torch.dtype, checkpoint: Checkpoint) -> None:
        """Change the meta model before the load is planned into it (e.g. replace Linears by quantized ones)."""

    def plan(self, model: PreTrainedModel, plan: LoadPlan, checkpoint: Checkpoint) -> None:
        """Check and prepare this mode's part of the load; raise here, before any tensor data is read."""

    def wrap_source(self, source: TensorSource) -> TensorSource:
        """The source the loader reads from, given the previous one (e.g. each rank's shard of every tensor)."""
        return source

    def device(self) -> torch.device | None:
        """Where the loaded tensors are placed; None: this mode does not decide it."""
        return None

    def after_load(self, model: PreTrainedModel, plan: LoadPlan, checkpoint: Checkpoint) -> None:
        """Work on the filled model while the checkpoint files are still open (e.g. wrap local shards in DTensors)."""

    def finish(self, model: PreTrainedModel) -> PreTrainedModel:
        """The model the caller gets, once transformers finished it (e.g. dispatched over several devices)."""
        return model

    def prepare_save(self, model: PreTrainedModel, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` (the model's state dict) as plain tensors of the runtime layout, ready to be converted back."""
        return dict(state)
