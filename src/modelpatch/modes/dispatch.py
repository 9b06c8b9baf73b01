"""``device_map``: one device for the whole model, or several (and disk) with accelerate's big-model dispatch.

Disk offload reads weights in place from the checkpoint where it can, as stock transformers does (``offload.py``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedModel

from .._transformers import no_split_modules, skip_keys_device_placement
from ..loading.record import ensure_model_record, offloaded_weights
from .base import LoadMode
from .offload import DiskOffload, meta_tensors

if TYPE_CHECKING:
    import torch

    from ..checkpoint import Checkpoint
    from ..loading.plan import LoadPlan
    from ..saving.plan import Rows, SavePlan


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


class Dispatch(LoadMode):
    """The load mode of a ``device_map`` over several devices (and disk): the map is resolved on the meta-device
    model, and how the weights of its ``"disk"`` modules are read is decided, before any tensor data is read (as
    stock resolves its map on the meta model), so that an offload that cannot be done is refused before the load;
    the loaded model is then dispatched with accelerate.

    ``device_map``: as asked for, then (once planned) as resolved, ``{module name: device}``.
    """

    name = "device-map dispatch"

    def __init__(
        self,
        device_map: str | Mapping[str, Any],
        *,
        max_memory: Mapping[Any, Any] | None = None,
        offload_folder: str | os.PathLike[str] | None = None,
        offload_buffers: bool = False,
    ) -> None:
        self.requested = device_map
        self.max_memory = max_memory
        self.offload_folder = offload_folder
        self.offload_buffers = offload_buffers
        self.device_map: dict[str, Any] = {}
        self.offload: DiskOffload | None = None

    def plan(self, model: PreTrainedModel, plan: LoadPlan, checkpoint: Checkpoint) -> None:
        """Resolve ``device_map`` ("auto" fits ``max_memory``) and plan the disk offload (:class:`DiskOffload`):
        weights are read in place unless a mode of the load changes them (quantization)."""
        self.device_map = resolve_device_map(model, self.requested, self.max_memory)
        if "disk" in self.device_map.values():
            self.offload = DiskOffload.plan(
                model,
                self.device_map,
                plan,
                checkpoint,
                offload_folder=self.offload_folder,
                offload_buffers=self.offload_buffers,
                in_place=not any(mode.quantizes for mode in plan.modes),
            )

    def after_load(self, model: PreTrainedModel, plan: LoadPlan, checkpoint: Checkpoint) -> None:
        """Keep the checkpoint files that offloaded weights are read from in place (before the load closes them)."""
        if self.offload is not None:
            self.offload.keep_files(checkpoint)

    def finish(self, model: PreTrainedModel) -> PreTrainedModel:
        return self.apply(model)

    def plan_save(self, plan: SavePlan) -> None:
        """The weights offloaded to disk (on the meta device) are read back from their files on the way out; one
        with no file to read it from is left to the save, which refuses it by name."""
        weights = offloaded_weights(plan.model)
        for key in meta_tensors(plan.state):
            if weights is not None and key in weights:
                plan.take(key, plan.state[key])

    def save_tensor(self, plan: SavePlan, key: str, tensor: torch.Tensor, rows: Rows | None) -> torch.Tensor:
        """An offloaded weight read from its file, as a forward reads it (checked against the file's identity;
        mapped, or cast to the model's dtype)."""
        weights = offloaded_weights(plan.model) if tensor.is_meta else None
        return weights[key] if weights is not None and key in weights else tensor

    def apply(self, model: PreTrainedModel) -> PreTrainedModel:
        """Place the loaded ``model``'s modules and add accelerate's hooks that move weights and activations."""
        from accelerate import dispatch_model
        from accelerate.utils import extract_submodules_state_dict

        options: dict[str, Any] = {}
        if self.offload is not None:
            # On an accelerator, accelerate offloads the "cpu" modules too and reads them from the same mapping.
            accelerated = set(self.device_map.values()) - {"cpu", "disk"}
            cpu_modules = [name for name, device in self.device_map.items() if device == "cpu"]
            resident = extract_submodules_state_dict(model.state_dict(), cpu_modules) if accelerated else {}
            weights = self.offload.weights(model, resident)
            ensure_model_record(model).offloaded = weights
            # accelerate reads an offloaded weight from the mapping it is given, ahead of any index or folder; the
            # empty index only tells it that nothing is to be written.
            options = {"state_dict": weights, "offload_index": {}}
        model = dispatch_model(
            model,
            device_map=self.device_map,
            offload_buffers=self.offload_buffers,
            skip_keys=skip_keys_device_placement(model),
            **options,
        )
        # torch annotates Module.__setattr__ for tensors and modules; other values are stored as plain attributes.
        model.hf_device_map = self.device_map  # type: ignore[assignment]
        return model
