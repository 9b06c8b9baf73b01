"""Fully sharded models (FSDP2, DTensor): each rank loads only its own shard of every parameter from the checkpoint.

Two ways in, one load mode. ``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=...))`` under
``torchrun`` (:class:`FullyShardedSetup`; HSDP with ``dp_replicate_size``) shards the meta model as stock
transformers does (its mesh, its resolved FSDP plan, its ``fully_shard`` units and policies) before any data is read;
or the user shards the model first (``fully_shard`` per decoder layer and on the root of a model built on the meta
device, then ``model.to_empty(device=...)``) and :func:`~modelpatch.load_sharded` fills it. Either way:

* the load is planned as :func:`modelpatch.from_pretrained` plans it (:func:`~modelpatch.plan_pretrained`: the same
  transforms, groups and bound operations), from the safetensors headers alone;
* a parameter whose local shard is a block of whole rows (FSDP2's ``Shard(0)``, a replicated or plain tensor) is read
  as those rows only: for a tensor read unchanged, a slice of the memory-mapped file; for a fused ``q/k/v`` or
  ``gate/up`` (a concatenation along dim 0) the matching row ranges of its source tensors; for experts stacked along
  dim 0, the experts this rank holds. Any other conversion (or placement) converts the group whole and keeps this
  rank's shard of it, so a rank's peak memory is its shards plus the largest converted group;
* the checkpoint's file pages a rank read are released once copied, so they do not stay resident.

:class:`FullyShardedLoad` is this as a :class:`~modelpatch.modes.base.LoadMode` (its ``plan``, ``wrap_source``,
``device``, ``run_group``, ``place`` and ``after_load`` hooks): ``load_sharded`` plans the load with it and runs
the loader's execute stage into the sharded model, :class:`FullyShardedSetup` is the same mode sharding the load's
own model first, so the tensors go through the one materialize loop of every load; the collective save
(``saving/sharded.py``) reads the same row layout back.

A fused parameter (``qkv_proj``, ``gate_up_proj``) is sharded like any other: FSDP2 gathers every parameter whole
before its module's forward, so its ``Shard(0)`` rows need not align with the parts it was fused from, and any size
works (4 key/value heads over 8 ranks included); a rank's rows are read from the matching rows of the parts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from .._transformers import (
    DistributedConfig,
    apply_fully_sharded,
    initialize_missing,
    mark_distributed,
    mark_initialized,
    prepare_distributed,
    resolved_fsdp_plan,
)
from ..checkpoint import Checkpoint
from ..conversion.operations import Concatenate, MergeModulelist, run_operations
from ..conversion.planner import ConversionGroup
from ..errors import ModelPatchError, TensorParallelError
from ..fusions.sharding import FusedParts
from ..loading.plan import LoadPlan
from ..loading.record import record_report
from ..loading.report import LoadReport
from .base import LoadMode, TensorSource
from .distributed import Rows, local_part, local_rows, shard_of


class ShardedLoadError(ModelPatchError, ValueError):
    """A sharded load or save that cannot be done as asked (the message names the parameter or keyword)."""


def _stacked_rows(group: ConversionGroup) -> bool:
    """Whether ``group``'s one output stacks indexed sources (experts) along dim 0 and then only concatenates along
    other dims: rows ``a:b`` of the output are then made of the sources' entries ``a..b-1`` alone."""
    if len(group.targets) != 1 or not isinstance(group.targets[0], str):
        return False
    first, *rest = group.operations
    if not isinstance(first, MergeModulelist) or not all(isinstance(slot, tuple) for slot in group.sources):
        return False
    shape = group.target_shapes[0]
    if not isinstance(shape, tuple):
        return False
    rank = len(shape)
    if first.dim % rank != 0:
        return False
    return all(isinstance(op, Concatenate) and not op.indexed and op.dim % rank != 0 for op in rest)


class FullyShardedLoad(LoadMode):
    """Loads a checkpoint into a model whose parameters are already sharded (FSDP2, DTensor), each rank reading only
    its shards (see the module docstring).

    Args:
        model: The sharded model to fill (its parameters materialised, e.g. by ``model.to_empty(device=...)``).
    """

    name = "fully sharded data parallelism"

    def __init__(self, model: nn.Module):
        self._bind(model)

    def _bind(self, model: nn.Module) -> None:
        """Make the sharded ``model`` the one this mode fills."""
        self.model = model
        self.targets: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
        self.rows: dict[str, Rows | None] = {}
        self._direct: dict[str, str] = {}

    def device(self) -> torch.device | None:
        """The device of the model's shards."""
        return next((local_part(t).device for t in self.targets.values()), None)

    def plan(self, model: PreTrainedModel, plan: LoadPlan, checkpoint: Checkpoint) -> None:
        """Check that ``plan`` (planned into a meta model of the same structure) fills the sharded model, and note
        each parameter's local rows. Raises :class:`ShardedLoadError` naming every key that differs."""
        differing = [
            f"{key}: the checkpoint gives {list(meta.shape)}, the sharded model has "
            f"{list(self.targets[key].shape) if key in self.targets else 'no such key'}"
            for key, meta in plan.expected.items()
            if key not in self.targets or tuple(self.targets[key].shape) != tuple(meta.shape)
        ]
        differing += [f"{key}: not in the planned model" for key in self.targets if key not in plan.expected]
        if differing:
            raise ShardedLoadError(
                f"The sharded {type(self.model).__name__} is not the model the checkpoint {plan.directory} loads into "
                f"(built with other fusions or patches?); nothing was loaded:\n  - " + "\n  - ".join(differing)
            )
        if others := [mode.name for mode in plan.modes if mode is not self]:
            raise ShardedLoadError(
                f"A sharded load of {type(self.model).__name__} cannot also be a load with {', '.join(others)} (from "
                "the checkpoint's config or the keywords); nothing was loaded."
            )
        # A parameter the checkpoint does not fill would keep the uninitialised memory to_empty gave it.
        if unfilled := sorted(plan.expected.keys() - set(plan.loaded_keys()) - plan.tied.keys()):
            raise ShardedLoadError(
                f"The checkpoint {plan.directory} does not fill {unfilled[:5]}"
                f"{' and more' if len(unfilled) > 5 else ''} of the sharded {type(self.model).__name__}: a sharded "
                "load initialises no new parameters (load unsharded with new_parameters=, save, then load sharded); "
                "nothing was loaded."
            )
        self.rows = {key: local_rows(tensor) for key, tensor in self.targets.items()}
        self._direct = {checkpoint: runtime for runtime, checkpoint in plan.conversion.direct.items()}

    def wrap_source(self, source: TensorSource) -> TensorSource:
        """Tensors read unchanged come as this rank's part of their parameter: its rows (views of the file) for a
        row-sharded one, else its shard of the whole tensor."""

        def fetch(key: str) -> torch.Tensor:
            tensor = source.fetch(key)
            runtime = self._direct.get(key)
            if runtime is None or runtime not in self.targets:
                return tensor
            rows, target = self.rows.get(runtime), self.targets[runtime]
            if rows is None:
                return shard_of(target, tensor)
            return tensor[rows.start : rows.stop] if isinstance(target, DTensor) else tensor

        return TensorSource(fetch, source.file_mapped)

    def run_group(self, group: ConversionGroup, fetch: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """This rank's part of each output of ``group``, reading through ``fetch`` only the source rows it needs
        where the group allows it (a concatenation along dim 0, experts stacked along dim 0), else the whole group."""
        targets = group.target_keys()
        rows = self.rows.get(targets[0]) if len(targets) == 1 else None
        if rows is not None and isinstance(self.targets[targets[0]], DTensor):
            if rows.start == rows.stop:  # an uneven shard can leave this rank no rows at all: nothing to read
                return {targets[0]: torch.empty_like(local_part(self.targets[targets[0]]))}
            concatenated = group.concatenated_rows()
            if concatenated is not None:
                parts = FusedParts(tuple(shape[0] for shape in _source_shapes(group)))
                pieces = [fetch(concatenated[held.part])[held.rows] for held in parts.held(rows.start, rows.stop)]
                return {targets[0]: _concatenated(pieces, group)}
            if _stacked_rows(group):
                slots = [[fetch(key) for key in keys[rows.start : rows.stop]] for keys in group.sources]  # type: ignore[index]
                (output,) = run_operations(list(group.operations), slots)  # type: ignore[arg-type]
                assert isinstance(output, torch.Tensor)  # one stacked tensor: _stacked_rows checked the chain
                return {targets[0]: output}
        return {key: shard_of(self.targets[key], tensor) for key, tensor in group.run(fetch).items()}

    def place(self, key: str, value: torch.Tensor) -> bool:
        """Copy ``value``, this rank's part of ``key`` (:meth:`wrap_source`, :meth:`run_group`), into its shard."""
        target = self.targets.get(key)
        if target is None:
            return False
        with torch.no_grad():
            local_part(target).copy_(value)
        return True

    def after_load(self, model: PreTrainedModel, plan: LoadPlan, checkpoint: Checkpoint) -> None:
        """Mark the loaded shards as loaded, recompute the non-persistent buffers (``to_empty`` left them
        uninitialised) as transformers' finalisation does, and record the load (what a save reverses)."""
        target = self.model
        if not isinstance(target, PreTrainedModel):
            return
        for tensor in self.targets.values():
            mark_initialized(tensor)
        device = self.device() or torch.device("cpu")
        with torch.no_grad():
            initialize_missing(target, set(), device)
        record_report(target, LoadReport.from_plan(plan))


def _source_shapes(group: ConversionGroup) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []
    for slot in group.source_shapes:
        if isinstance(slot, list):
            shapes.extend(slot)
        elif isinstance(slot, tuple):
            shapes.append(slot)
    return shapes


def _concatenated(pieces: list[torch.Tensor], group: ConversionGroup) -> torch.Tensor:
    if len(pieces) == 1:
        return pieces[0]
    if pieces:
        return torch.cat(pieces)
    shape = _source_shapes(group)[0]
    return torch.empty((0, *shape[1:]), dtype=group.dtype)


class FullyShardedSetup(FullyShardedLoad):
    """The load mode of ``distributed_config=DistributedConfig(fsdp_size=...)`` (FSDP2; HSDP with
    ``dp_replicate_size``): the mesh and device of this rank, made by transformers before anything is built; once the
    load is planned, the meta model sharded as stock shards it, then filled as :class:`FullyShardedLoad` fills a
    sharded model.

    Stock's own resolution and application are used, so every module a fusion leaves alone is placed exactly as
    stock places it: the same ``fully_shard`` units (the model's ``base_model_fsdp_plan`` and ``_fsdp_plan`` with the
    config's ``fsdp_plan`` rules over them, tied embeddings folded, float32 modules in their own units), the same mesh
    and ``DTensor`` placements, the same policies (``fsdp_mixed_precision``). A fused module
    lies inside one of those units (a decoder layer), so its parameters are ``Shard(0)`` over the same mesh.
    """

    name = "fully sharded data parallelism (distributed_config)"

    def __init__(self, config: DistributedConfig, mesh_manager: Any, local_device: torch.device):
        self.config = config
        self.mesh_manager = mesh_manager
        self.local_device = local_device

    def device(self) -> torch.device:
        return self.local_device

    def plan(self, model: PreTrainedModel, plan: LoadPlan, checkpoint: Checkpoint) -> None:
        """Refuse a quantized load; shard the meta ``model`` (:meth:`shard`) and give it this rank's empty shards,
        then check and plan as :class:`FullyShardedLoad` does, before any tensor data is read."""
        if quantizing := [mode.name for mode in plan.modes if mode.quantizes]:
            raise TensorParallelError(
                f"An FSDP2 load (distributed_config) cannot also be a load with {', '.join(quantizing)}: modelpatch "
                "does not shard quantized models; load it unsharded, or with transformers."
            )
        self.shard(model)
        model.to_empty(device=self.local_device)
        self._bind(model)
        super().plan(model, plan, checkpoint)

    def shard(self, model: PreTrainedModel) -> None:
        """``fully_shard`` the meta ``model`` by its FSDP plan, as stock transformers resolves and applies it."""
        mark_distributed(model, self.config, self.mesh_manager)
        try:
            fsdp_plan = resolved_fsdp_plan(model, self.config)
        except ValueError as exc:  # transformers' refusal of the plan: a model without one, a rule naming nothing
            raise TensorParallelError(f"{type(model).__name__} cannot be sharded with FSDP2: {exc}") from None
        # A rule of a caller's fsdp_plan can name a module a fusion left without parameters of its own (q_proj, now a
        # slice of qkv_proj): stock would make it a unit of its own; here it would shard nothing.
        if empty := sorted(name for name in fsdp_plan if not any(True for _ in model.get_submodule(name).parameters())):
            raise TensorParallelError(
                f"The fsdp_plan of {type(model).__name__} shards {empty[:3]}{' and more' if len(empty) > 3 else ''}, "
                "which hold no parameters in this model (a fusion made them slices of a fused module): name the "
                "fused module (qkv_proj, gate_up_proj) or the decoder layer instead."
            )
        apply_fully_sharded(model, self.mesh_manager, fsdp_plan)

    def after_load(self, model: PreTrainedModel, plan: LoadPlan, checkpoint: Checkpoint) -> None:
        """Mark the loaded shards as loaded; the loader's finalisation then makes the non-persistent buffers (which
        ``to_empty`` left uninitialised) and records the load, as for every load."""
        for tensor in self.targets.values():
            mark_initialized(tensor)


def prepare(distributed_config: DistributedConfig) -> FullyShardedSetup | None:
    """The mesh of an FSDP2 / HSDP load, made by transformers' own ``prepare_distribute_model`` (``torch.distributed``
    initialised if need be); None where it shards nothing."""
    prepared = prepare_distributed(distributed_config)
    if prepared is None:
        return None
    mesh_manager, device = prepared
    return FullyShardedSetup(distributed_config, mesh_manager, device)
