"""Tensor-parallel loading on ``torch.distributed``: ``from_pretrained(..., tp_plan="auto")`` under ``torchrun``.

The model is sharded as transformers 5.23 shards it: the model's own TP plan (``base_model_tp_plan`` and the class
plans), transformers' parallel styles from its ``ParallelInterface`` (the same forward hooks), parameters as
``DTensor``s whose local shard lives on each rank, the mesh made by transformers' ``prepare_distribute_model``.
What modelpatch adds is what its restructured modules need:

* the plan is translated to fused names. A fused ``qkv_proj`` / ``gate_up_proj`` whose parts the plan shards
  colwise is sharded *part by part*: rank ``r`` holds ``[q_r; k_r; v_r]``, so that each rank's slices take whole
  heads of q, k and v. No ``DTensor`` placement describes that layout when the parts differ in size (grouped-query
  attention), so these two parameters hold their local rows as plain tensors, and the projection slices read the
  local part sizes. Per-expert ``nn.Linear`` experts (``linear_experts``) are sharded as the model's plan shards its
  fused experts: gate and up colwise, down rowwise, every rank's partial sum all-reduced by the experts module;
* each rank reads only its slices: a checkpoint tensor is a view of the memory-mapped file, sliced before anything
  is copied, and the parts of a fused projection (the experts of a stacked MoE parameter) are sliced before they
  are concatenated (stacked);
* a save gathers the full tensors on every rank (collectives), and rank 0 alone writes them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard
from transformers import DistributedConfig, PreTrainedModel

from .. import _transformers
from .._transformers import (
    apply_tensor_parallel,
    device_mesh_of,
    generic_module_name,
    local_shard,
    mark_distributed,
    mark_initialized,
    prepare_distributed,
    register_parallel_style,
    resolved_tp_plan,
    set_tp_plan,
)
from ..conversion.operations import Concatenate, MergeModulelist
from ..conversion.planner import ConversionGroup
from ..errors import TensorParallelError
from ..fusions.linear_experts.modules import ExpertMLP, LinearExperts
from ..fusions.projections import FusedLinear, ProjectionSlice
from .distributed import is_tensor_parallel
from .modes import LoadMode, TensorSource
from .record import ensure_model_record, model_record

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint
    from .plan import LoadPlan

logger = logging.getLogger(__name__)

# The style modelpatch registers for fused projections sharded part by part.
COLWISE_PARTS = "modelpatch_colwise_parts"


@functools.cache
def _register_colwise_parts() -> None:
    """Register the part-by-part colwise style under :data:`COLWISE_PARTS`, at the first tensor-parallel load.

    Its base is transformers' ``PackedColwiseParallel``, looked up then: on a transformers without it, tensor-parallel
    loads are refused by name and every other load is unaffected.
    """

    class ColwisePartsParallel(_transformers.PackedColwiseParallel):
        """Colwise sharding of a :class:`FusedLinear`, part by part: rank ``r`` holds ``[part_0_r; part_1_r; ...]``.

        The input is replicated and the output is this rank's rows of every part, in part order: what the projection
        slices split with the local part sizes. The parameters hold those rows as plain tensors (see the module
        docstring); the forward hooks are transformers' packed-colwise ones.
        """

        def shard_param(self, module: FusedLinear, param: str, mesh: DeviceMesh) -> None:
            meta = module._parameters.get(param)
            if meta is None:
                return
            rows = sum(size // mesh.size() for size in module.part_sizes)
            module._parameters[param] = nn.Parameter(
                torch.empty((rows, *meta.shape[1:]), dtype=meta.dtype, device="meta"),
                requires_grad=meta.requires_grad,
            )

    register_parallel_style(COLWISE_PARTS, ColwisePartsParallel())


@dataclass
class TensorParallelSetup(LoadMode):
    """The load mode of tensor parallelism: the mesh and device of this rank, made before anything is built
    (torch.distributed initialised if needed); once planned, the :class:`ShardedLoad` of the load."""

    name = "tensor parallelism"

    config: DistributedConfig
    mesh_manager: Any  # transformers' TransformersDeviceMesh
    local_device: torch.device
    sharded: ShardedLoad | None = None

    def plan(self, model: PreTrainedModel, plan: LoadPlan, checkpoint: Checkpoint) -> None:
        """Refuse a quantized load; shard the meta model (:meth:`shard`), before any tensor data is read."""
        if any(mode.quantizes for mode in plan.modes):
            raise ValueError("Tensor-parallel loading of quantized models is not supported by modelpatch.")
        self.sharded = self.shard(model, plan)

    def wrap_source(self, source: TensorSource) -> TensorSource:
        """Each rank's shard of every tensor it can slice before reading."""
        assert self.sharded is not None  # plan() ran first
        return TensorSource(self.sharded.fetch(source.fetch), source.file_mapped)

    def device(self) -> torch.device:
        return self.local_device

    def after_load(self, model: PreTrainedModel, plan: LoadPlan, checkpoint: Checkpoint) -> None:
        assert self.sharded is not None
        self.sharded.finish(model)

    def prepare_save(self, model: PreTrainedModel, state: Mapping[str, Any]) -> dict[str, Any]:
        """The full tensors, gathered on every rank (:func:`gather_state`)."""
        return gather_state(model, state)

    @property
    def mesh(self) -> DeviceMesh:
        mesh: DeviceMesh = self.mesh_manager.get_mesh("tp")
        return mesh

    def shard(self, model: PreTrainedModel, plan: LoadPlan) -> ShardedLoad:
        """Apply the model's (translated) TP plan to the meta-device ``model``: placeholders and forward hooks."""
        mesh = self.mesh
        mark_distributed(model, self.config, self.mesh_manager)
        override = self.config.tp_plan if isinstance(self.config.tp_plan, dict) else {}
        _check_plan_names(model, override)
        set_tp_plan(model, _translate_plan(model, {**model.tp_plan, **override}, mesh.size()))
        # The plan is complete now: transformers resolves it (validation, layer numbers) as for a stock model.
        tp_plan = resolved_tp_plan(model, mesh.size())
        apply_tensor_parallel(model, mesh, tp_plan)
        parts = _localize_fused(model, tp_plan, mesh.size())
        ensure_model_record(model).tensor_parallel_parts = parts
        return ShardedLoad(model, plan, mesh, parts)


@dataclass
class UnshardedPlan(LoadMode):
    """The ``tp_plan`` rules of a load that shards nothing (one process: transformers loads such a model whole),
    checked against the model as every rank of a sharded load checks them (:func:`_check_plan_names`): the rules are
    the ones the same script gives ``torchrun``, and a rule naming no module is refused here, before any data is
    read, not found out there."""

    name = "tensor-parallel plan (one process, unsharded)"

    rules: Mapping[str, str]

    def plan(self, model: PreTrainedModel, plan: LoadPlan, checkpoint: Checkpoint) -> None:
        _check_plan_names(model, self.rules)


def _check_plan_names(model: PreTrainedModel, override: Mapping[str, str]) -> None:
    """Refuse the rules of a ``tp_plan`` dict that name no module or parameter of ``model`` (as transformers names
    them: layer numbers as ``*``) and no rule of its own plan: transformers only warns, and shards without them."""
    names = {generic_module_name(name) for name, _ in (*model.named_modules(), *model.named_parameters())}
    unknown = sorted(set(override) - names - set(model.tp_plan))
    if unknown:
        example = next((name for name in sorted(names) if name.endswith("proj")), sorted(names)[-1])
        raise TensorParallelError(
            f"tp_plan rules {unknown} name no module or parameter of {type(model).__name__}: rules name them as "
            f"named_modules() does, layer numbers as '*' (e.g. {example!r})."
        )


def prepare(distributed_config: DistributedConfig | None) -> TensorParallelSetup | None:
    """The mesh of a tensor-parallel load, made by transformers' own ``prepare_distribute_model``."""
    if distributed_config is None:
        return None
    prepared = prepare_distributed(distributed_config)
    if prepared is None:
        return None
    _register_colwise_parts()
    mesh_manager, device = prepared
    return TensorParallelSetup(distributed_config, mesh_manager, device)


def _translate_plan(model: nn.Module, plan: dict[str, str], tp_size: int) -> dict[str, str]:
    """``plan`` (generic names, stock modules) for the modules of ``model`` as modelpatch restructured them."""
    plan = dict(plan)
    seen: set[str] = set()
    for name, module in model.named_modules():
        generic = generic_module_name(name)
        if generic in seen:
            continue
        seen.add(generic)
        if isinstance(module, FusedLinear):
            _translate_fused(model, plan, name, generic, module, tp_size)
        elif isinstance(module, LinearExperts):
            _translate_experts(plan, generic, module)
    return plan


def _slices_of(owner: nn.Module, fused_name: str) -> list[tuple[str, ProjectionSlice]]:
    found = [
        (child_name, child)
        for child_name, child in owner.named_children()
        if isinstance(child, ProjectionSlice) and child.fused_name == fused_name
    ]
    return sorted(found, key=lambda item: item[1].index)


def _translate_fused(
    model: nn.Module, plan: dict[str, str], name: str, generic: str, fused: FusedLinear, tp_size: int
) -> None:
    owner_name, _, fused_name = name.rpartition(".")
    owner_generic = generic.rpartition(".")[0]
    slices = _slices_of(model.get_submodule(owner_name), fused_name)
    part_names = [f"{owner_generic}.{child}" if owner_generic else child for child, _ in slices]
    styles = [plan.pop(part, None) for part in part_names]
    if all(style is None for style in styles) or generic in plan:
        return
    if any(style != "colwise" for style in styles):
        raise TensorParallelError(
            f"The TP plan shards the parts of {generic} ({dict(zip(part_names, styles, strict=True))}); modelpatch "
            "shards a fused projection only when every part is 'colwise'. Load without this fusion, or pass a tp_plan "
            f"that sets {generic!r} itself."
        )
    uneven = [size for size in fused.part_sizes if size % tp_size]
    if uneven:
        raise TensorParallelError(
            f"{generic} cannot be sharded part by part over {tp_size} ranks: its part sizes {fused.part_sizes} do "
            "not all divide by the TP size."
        )
    plan[generic] = COLWISE_PARTS


def _translate_experts(plan: dict[str, str], generic: str, experts: LinearExperts) -> None:
    """Stock shards fused experts as gate_up packed-colwise, down rowwise, outputs all-reduced by the experts module:
    per-expert Linears get the same shards (gate and up colwise, down rowwise) and run on their local tensors."""
    styles = (plan.get(generic), plan.get(f"{generic}.gate_up_proj"), plan.get(f"{generic}.down_proj"))
    if styles == (None, None, None):
        return
    if styles != ("moe_tp_experts", "packed_colwise", "rowwise"):
        raise TensorParallelError(
            f"The TP plan shards the experts {generic} as {styles} (experts, gate_up_proj, down_proj); modelpatch's "
            "linear_experts follow the ('moe_tp_experts', 'packed_colwise', 'rowwise') plan only. Load without the "
            "linear_experts fusion."
        )
    plan.pop(f"{generic}.gate_up_proj")
    plan.pop(f"{generic}.down_proj")
    expert = experts[0]
    if not isinstance(expert, ExpertMLP):
        raise TensorParallelError(f"The experts {generic} hold {type(expert).__name__}s, not modelpatch ExpertMLPs.")
    gate, up, down = expert.names
    for child, style in ((gate, "colwise"), (up, "colwise"), (down, "rowwise")):
        plan[f"{generic}.*.{child}.weight"] = style
        plan[f"{generic}.*.{child}"] = "local_params"


def _localize_fused(model: nn.Module, tp_plan: Mapping[str, str], tp_size: int) -> dict[str, tuple[int, ...]]:
    """Point the projection slices of every part-sharded fused layer at their local part sizes.

    Returns ``{parameter name: global part sizes}`` for those layers' parameters (what loads and saves slice by).
    """
    parts: dict[str, tuple[int, ...]] = {}
    modules = dict(model.named_modules())
    for name, style in tp_plan.items():
        # The resolved plan names each parameter (sharded) and its module (hooked): the modules are what counts here.
        if style != COLWISE_PARTS or name not in modules:
            continue
        fused = modules[name]
        if not isinstance(fused, FusedLinear):
            raise TensorParallelError(f"{name} is sharded part by part but is a {type(fused).__name__}.")
        owner_name, _, fused_name = name.rpartition(".")
        local = tuple(size // tp_size for size in fused.part_sizes)
        for _, part in _slices_of(model.get_submodule(owner_name), fused_name):
            part.part_sizes = local
            part.out_features = local[part.index]
        for param_name, _ in fused.named_parameters(recurse=False):
            parts[f"{name}.{param_name}"] = tuple(fused.part_sizes)
    return parts


def _stacks_experts(group: ConversionGroup, placeholders: Mapping[str, DTensor]) -> bool:
    """Whether ``group`` stacks per-expert tensors into one sharded parameter in a way that commutes with slicing
    each expert's tensor first (what transformers does when it reads experts): experts stacked on dim 0, which is
    not sharded, then concatenated along dims sharded only as the concatenation's parts (strided by their count)."""
    targets = group.target_keys()
    if len(targets) != 1 or targets[0] not in placeholders or not all(isinstance(s, tuple) for s in group.sources):
        return False
    first, *rest = group.operations
    if not (isinstance(first, MergeModulelist) and first.dim == 0):
        return False
    concatenations = [op for op in rest if isinstance(op, Concatenate)]
    if len(concatenations) != len(rest) or not all(op.dim > 0 and not op.indexed for op in concatenations):
        return False
    concatenated = {op.dim for op in concatenations}
    placeholder = placeholders[targets[0]]
    for placement in placeholder.placements:
        if not hasattr(placement, "dim"):
            continue
        dim = placement.dim % placeholder.ndim
        strided = isinstance(placement, _StridedShard)
        if dim == 0 or (dim in concatenated) != strided:
            return False
        if isinstance(placement, _StridedShard) and placement.split_factor != len(group.sources):
            return False
    return True


def _part_rows(sizes: tuple[int, ...], rank: int, tp_size: int) -> list[slice]:
    """This rank's rows of each part of a dim-0 concatenation of parts ``sizes``."""
    rows, start = [], 0
    for size in sizes:
        local = size // tp_size
        rows.append(slice(start + rank * local, start + (rank + 1) * local))
        start += size
    return rows


class ShardedLoad:
    """Turns the tensors a load reads into this rank's shards, and the loaded shards into the model's parameters."""

    def __init__(self, model: nn.Module, plan: LoadPlan, mesh: DeviceMesh, parts: Mapping[str, tuple[int, ...]]):
        self.mesh = mesh
        self.rank = mesh.get_local_rank()
        self.size = mesh.size()
        self.parts = dict(parts)
        state = model.state_dict(keep_vars=True)
        self.placeholders = {key: value for key, value in state.items() if isinstance(value, DTensor)}
        self._direct = {checkpoint: runtime for runtime, checkpoint in plan.conversion.direct.items()}
        # Sources of a fused projection's concatenation: each is sliced to this rank's rows before the concatenation.
        self._part_sources: set[str] = set()
        # Per-expert sources stacked into a sharded 3-D parameter: source key -> (parameter, expert index).
        self._expert_sources: dict[str, tuple[str, int]] = {}
        for group in plan.conversion.groups:
            if all(key in self.parts for key in group.target_keys()) and all(
                isinstance(op, Concatenate) and op.dim == 0 and not op.indexed for op in group.operations
            ):
                self._part_sources.update(group.source_keys())
            elif _stacks_experts(group, self.placeholders):
                target = group.target_keys()[0]
                for slot in group.sources:
                    if isinstance(slot, tuple):  # always: _stacks_experts checked it
                        self._expert_sources.update((key, (target, index)) for index, key in enumerate(slot))

    def fetch(self, fetch: Callable[[str], torch.Tensor]) -> Callable[[str], torch.Tensor]:
        """``fetch`` returning this rank's slice of every tensor it can slice before reading (views: no data read)."""

        def sharded(key: str) -> torch.Tensor:
            tensor = fetch(key)
            if key in self._part_sources:
                return tensor[self._rows(tensor.shape[0])]
            if key in self._expert_sources:
                target, index = self._expert_sources[key]
                return self._shard(target, tensor, index)
            runtime = self._direct.get(key)
            return tensor if runtime is None else self._local(runtime, tensor)

        return sharded

    def _rows(self, size: int) -> slice:
        local = size // self.size
        return slice(self.rank * local, (self.rank + 1) * local)

    def _shard(self, key: str, tensor: torch.Tensor, index: int | None = None) -> torch.Tensor:
        """This rank's shard of ``tensor`` for the ``DTensor`` parameter ``key`` (its ``index``-th expert's tensor)."""
        shard = local_shard(self.placeholders[key], tensor, index)
        if shard is None:  # only for an expert this rank does not own: experts are stacked on dim 0, never sharded
            raise TensorParallelError(f"Rank {self.rank} holds no shard of expert {index} of {key}.")
        return shard

    def _local(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the full tensor of parameter ``key`` (a view wherever one slice is enough)."""
        if key in self.placeholders:
            return self._shard(key, tensor)
        if key in self.parts:
            return torch.cat([tensor[rows] for rows in _part_rows(self.parts[key], self.rank, self.size)])
        return tensor

    def finish(self, model: nn.Module) -> None:
        """Wrap every loaded shard as the ``DTensor`` its placeholder describes (transformers' convention); shard
        what a conversion produced whole (a conversion other than a fused projection's reads its full sources)."""
        for key, placeholder in self.placeholders.items():
            module_name, _, name = key.rpartition(".")
            module = model.get_submodule(module_name)
            is_parameter = name in module._parameters
            loaded = module._parameters[name] if is_parameter else module._buffers[name]
            if loaded is None or isinstance(loaded, DTensor) or loaded.device.type == "meta":
                continue  # not loaded here (a tied or new parameter: transformers' finalisation handles it)
            local = loaded.detach()
            if tuple(local.shape) == tuple(placeholder.shape) and local.shape != placeholder.to_local().shape:
                local = self._local(key, local)
            value = DTensor.from_local(
                local.contiguous(),
                placeholder.device_mesh,
                placeholder.placements,
                run_check=False,
                shape=placeholder.shape,
                stride=tuple(placeholder.stride()),
            )
            if is_parameter:
                parameter = nn.Parameter(value, requires_grad=placeholder.requires_grad)
                mark_initialized(parameter)
                module._parameters[name] = parameter
            else:
                mark_initialized(value)
                module._buffers[name] = value
        for key, sizes in self.parts.items():
            module_name, _, name = key.rpartition(".")
            module = model.get_submodule(module_name)
            loaded = module._parameters[name]
            if loaded is not None and loaded.shape[0] == sum(sizes):  # produced whole by a conversion
                sharded = nn.Parameter(self._local(key, loaded.detach()), requires_grad=loaded.requires_grad)
                mark_initialized(sharded)
                module._parameters[name] = sharded


def gather_state(model: nn.Module, state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with every shard gathered into its full tensor; every rank must call it (collectives).

    A no-op for a model not loaded with tensor parallelism.
    """
    record = model_record(model)
    parts = None if record is None else record.tensor_parallel_parts
    if parts is None:
        return dict(state)
    group = _tp_group(model)
    size = dist.get_world_size(group)
    gathered: dict[str, Any] = {}
    # Tied parameters (one shard under two keys) are gathered once, so that the save still sees them tied.
    full: dict[tuple, torch.Tensor] = {}
    for key, tensor in state.items():
        if isinstance(tensor, DTensor):
            local = tensor.to_local()
            identity = (local.data_ptr(), local.dtype, tuple(local.shape), tuple(local.stride()))
            if identity not in full:
                full[identity] = tensor.full_tensor()
            tensor = full[identity]
        elif key in parts:
            local = tensor.detach().contiguous()
            shards = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(shards, local, group=group)
            pieces = [shard.split([p // size for p in parts[key]]) for shard in shards]
            # Part by part: all ranks' rows of q, then of k, then of v.
            tensor = torch.cat([piece[index] for index in range(len(parts[key])) for piece in pieces])
        gathered[key] = tensor
    return gathered


def writes_files(model: nn.Module) -> bool:
    """Whether this process writes a save of ``model``: rank 0 of a tensor-parallel model, any other model."""
    return not is_tensor_parallel(model) or dist.get_rank() == 0


def barrier(model: nn.Module) -> None:
    """Wait for every rank (after rank 0 wrote a save); a no-op for a model not loaded with tensor parallelism."""
    if is_tensor_parallel(model):
        dist.barrier(group=_tp_group(model))


def _tp_group(model: nn.Module) -> dist.ProcessGroup:
    """The process group of the ranks ``model`` (loaded with tensor parallelism) is sharded over."""
    mesh = device_mesh_of(model)
    if mesh is None:
        raise TensorParallelError(f"{type(model).__name__} has no device mesh: it was not loaded tensor-parallel.")
    return mesh["tp"].get_group()
