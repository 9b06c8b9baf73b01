"""The stage interface of load modes: what a load does besides filling a model on one device.

A load runs the same stages whatever it was asked for: plan (config and headers only), build the model on the meta
device, plan where every tensor comes from, read and convert the tensors, let transformers finish the model. A *load
mode* changes where and how the tensors land — quantization, tensor parallelism, device-map dispatch and disk
offload, fully sharded data parallelism — and it does so only through the hooks below, called by the loader at the
same points of every load, for each mode it was given, in order. The loader never asks which modes it holds.

Every hook has a default that changes nothing, so a mode implements only the stages it takes part in. A load mode is
also a :class:`~modelpatch.saving.stages.SaveMode`: its save hooks (which writer, the save's plan, each tensor
on its way out) run when a model the mode loaded is saved, so the mode that changed how tensors live on the model is
the one that gives them back in plain form (``saving/stages.py``, the save's stages).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeAlias, TypeVar

import torch

from ..saving.plan import SaveMode

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..checkpoint import Checkpoint
    from ..conversion.planner import ConversionGroup, TensorMeta
    from ..conversion.transforms import WeightTransform

#: A checkpoint as its headers describe it: key -> shape and dtype.
Metas: TypeAlias = "Mapping[str, TensorMeta]"

#: The load plan a mode's :meth:`~LoadMode.plan` and :meth:`~LoadMode.after_load` receive: ``plan.py``'s ``LoadPlan``,
#: which holds the load's modes (``LoadMode[LoadPlan]``). A type parameter rather than an import, so that this module
#: names no module that imports it. A mode subclasses ``LoadMode`` as it is and annotates its hooks' plan as
#: ``LoadPlan``.
Plan = TypeVar("Plan")


@dataclass(frozen=True)
class TensorSource:
    """Where the loader reads a checkpoint tensor from.

    Attributes:
        fetch: ``fetch(checkpoint_key)`` returns the tensor (a view of the memory-mapped file where possible).
        file_mapped: ``file_mapped(checkpoint_key)`` says whether ``fetch`` returns a view of a private file mapping,
            whose resident pages may be dropped once the tensor was copied or converted.
        joined: ``joined(checkpoint_keys)`` returns those tensors' bytes back to back as one flat view of a private
            file mapping (their concatenation along dim 0, with no copy) where the file holds them so, else None. A
            mode that wraps the source leaves it out: its ``fetch`` no longer returns the file's tensors as they are.
    """

    fetch: Callable[[str], torch.Tensor]
    file_mapped: Callable[[str], bool]
    joined: Callable[[Sequence[str]], torch.Tensor | None] = lambda keys: None


class LoadMode(SaveMode, Generic[Plan]):
    """One way of placing a load's tensors; subclasses override the hooks of the stages they take part in.

    The hooks, in the order a load calls them:

    1. :meth:`update_dtype` — while the load's dtype is resolved, before anything is built;
    2. :meth:`prepare_model` — on the meta model once it is built (inside transformers' init contexts when a mode
       :attr:`quantizes`, as stock runs its quantizer's ``preprocess_model``);
    3. :meth:`plan_parameters` — the checkpoint's tensors (headers) as the load plan sees them, before it is made;
    4. :meth:`plan` — once the load plan is complete and validated, before any tensor data is read: a mode that
       cannot do what it was asked refuses here, so nothing is read;
    5. :meth:`wrap_source` — the tensor source the loader reads from (each mode wraps the previous mode's);
    6. :meth:`device` — where the loaded tensors are placed (the last mode that names one wins);
    7. :meth:`run_group` and :meth:`place` — for each converted group, then each tensor, while the model is filled:
       how a group is converted and how a tensor lands on the model (for each, the last mode that takes it decides;
       none: the group runs whole, the tensor is cast to its planned dtype, moved to the device and set);
    8. :meth:`after_load` — after every tensor was placed and the files were found unchanged, while the checkpoint
       files are still open;
    9. :meth:`finish` — after transformers' finalisation (buffers, new parameters, tied weights) and the load
       report; returns the model the caller gets (a mode may wrap it).

    When the model is saved, the save hooks of :class:`~modelpatch.saving.stages.SaveMode` (``save_writer``,
    ``plan_save``, ``save_tensor``): each tensor on its way out gathered, read back from disk or serialised.

    Hooks 1–4 run when the load is planned (:func:`~modelpatch.plan_pretrained`), 5–9 when it is executed
    (:func:`~modelpatch.load_planned`); :func:`~modelpatch.from_pretrained` does both.
    """

    #: Short name used in messages ("quantization", "tensor parallelism", ...).
    name: str = "load mode"
    #: Whether the mode reads or makes quantized tensors: the model is built in transformers' init contexts of a
    #: quantized model (the modes prepare it there), a ``quantization_config`` of the checkpoint is this mode's to
    #: honour, and the loaded tensors are not the checkpoint's as they are (a disk offload cannot read them in place).
    quantizes: bool = False

    def update_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the model is built in, given the one the load resolved."""
        return dtype

    def prepare_model(self, model: PreTrainedModel, *, dtype: torch.dtype, checkpoint: Checkpoint) -> None:
        """Change the meta model before the load is planned into it (e.g. replace Linears by quantized ones)."""

    def plan_parameters(
        self, model: PreTrainedModel, checkpoint: Metas, *, dtype: torch.dtype, transforms: Sequence[WeightTransform]
    ) -> Metas:
        """The checkpoint's tensors as the load plan sees them, given the previous mode's (e.g. the tensors of each
        quantized parameter grouped into it); ``transforms``: those the plan will run on them. Reads no data."""
        return checkpoint

    def plan(self, model: PreTrainedModel, plan: Plan, checkpoint: Checkpoint) -> None:
        """Check and prepare this mode's part of the load; raise here, before any tensor data is read."""

    def wrap_source(self, source: TensorSource) -> TensorSource:
        """The source the loader reads from, given the previous one (e.g. each rank's shard of every tensor)."""
        return source

    def device(self) -> torch.device | None:
        """Where the loaded tensors are placed; None: this mode does not decide it."""
        return None

    def run_group(self, group: ConversionGroup, fetch: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """The outputs of converted ``group`` (runtime key -> tensor), reading its sources through ``fetch``; None:
        this mode leaves the group to the previous mode (or, for the first, to ``group.run(fetch)``)."""
        return None

    def place(self, key: str, value: torch.Tensor) -> bool:
        """Put ``value``, what was read or converted for runtime tensor ``key``, on the model; True: placed (the
        loader copies nothing, and may release the file pages ``value`` was read from); False: this mode leaves it
        to the previous mode (or, for the first, to the loader's cast, move and set)."""
        return False

    def after_load(self, model: PreTrainedModel, plan: Plan, checkpoint: Checkpoint) -> None:
        """Work on the filled model while the checkpoint files are still open (e.g. wrap local shards in DTensors)."""

    def finish(self, model: PreTrainedModel) -> PreTrainedModel:
        """The model the caller gets, once transformers finished it (e.g. dispatched over several devices)."""
        return model

    def __deepcopy__(self, memo: dict[int, Any]) -> LoadMode[Plan]:
        # A copied model shares the modes that loaded it: the save hooks read the model they are given, not the mode.
        return self
