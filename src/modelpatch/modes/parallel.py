"""Tensor-parallel loading on ``torch.distributed``: ``from_pretrained(..., tp_plan="auto")`` under ``torchrun``.

The model is sharded as transformers 5.23 shards it: the model's own TP plan (``base_model_tp_plan`` and the class
plans), transformers' parallel styles from its ``ParallelInterface`` (the same forward hooks), parameters as
``DTensor``s whose local shard lives on each rank, the mesh made by transformers' ``prepare_distribute_model``.
This module is the mode alone (keywords, mesh, the style it registers, applying plans); how each fused module
shards is its fusion family's (``ModuleFusionSpec.tensor_parallel_layout``, data of ``fusions/sharding.py``):

* the plan's rules for the modules a fusion replaced are translated by the fusion's layout. A module sharded colwise
  *part by part* (a fused ``qkv_proj``: rank ``r`` holds ``[q_r; k_r; v_r]``) gets the style registered here; no
  ``DTensor`` placement describes that layout when the parts differ in size (grouped-query attention), so its
  parameters hold their local rows as plain tensors, recorded with their part sizes. A fusion that declares no
  layout leaves the plan as it is: its fused tensors stay whole on every rank;
* each rank reads only its slices: a checkpoint tensor is a view of the memory-mapped file, sliced before anything
  is copied, and the parts of a fused tensor (the experts of a stacked MoE parameter) are sliced before they are
  concatenated (stacked);
* a save gathers the full tensors on every rank (collectives), and rank 0 alone writes them.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from .. import _installs, _transformers
from .._torch import strided_split_factor
from .._transformers import (
    DistributedConfig,
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
from ..conversion.planner import ConversionGroup, ConversionPlan
from ..errors import TensorParallelError  # raised here; importable from this module as before
from ..fusions.sharding import FusedParts, TensorParallelLayout
from ..fusions.spec import ModuleFusionSpec
from ..loading.record import ensure_model_record, model_record
from ..saving.plan import SaveWriter
from ..saving.stages import WholeFiles
from .base import LoadMode, TensorSource

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint
    from ..loading.plan import LoadPlan
    from ..saving.plan import Rows, SavePlan

logger = logging.getLogger(__name__)

# The style modelpatch registers for fused tensors sharded part by part.
COLWISE_PARTS = "modelpatch_colwise_parts"

# The attribute holding a module's FusedParts while the COLWISE_PARTS style shards it (set and removed by the mode).
_PARTS_ATTRIBUTE = "_modelpatch_tensor_parallel_parts"

# The styles that split a projection's output rows over the ranks, each rank computing its rows only (the others,
# "colwise_gather_output" or "colwise_rep", give every rank the whole output).
_ROW_SPLITTING_STYLES = frozenset({"colwise", "packed_colwise", COLWISE_PARTS})
# An attention module's projections whose output rows are heads of its head_dim, and which heads they are.
_HEAD_PROJECTIONS = {"q_proj": "attention", "k_proj": "key/value", "v_proj": "key/value"}


@functools.cache
def _register_colwise_parts() -> None:
    """Register the part-by-part colwise style under :data:`COLWISE_PARTS`, at the first tensor-parallel load.

    Its base is transformers' ``PackedColwiseParallel``, looked up then: on a transformers without it, tensor-parallel
    loads are refused by name and every other load is unaffected.
    """

    class ColwisePartsParallel(_transformers.PackedColwiseParallel):
        """Colwise sharding of a module fused from parts, part by part: rank ``r`` holds ``[part_0_r; part_1_r; ...]``
        (:meth:`FusedParts.by_part`, the parts a fusion's layout declared).

        The input is replicated and the output is this rank's rows of every part, in part order: what the fused
        module's forward splits with the local part sizes. The parameters hold those rows as plain tensors (see the
        module docstring); the forward hooks are transformers' packed-colwise ones.
        """

        def shard_param(self, module: nn.Module, param: str, mesh: DeviceMesh) -> None:
            meta = module._parameters.get(param)
            if meta is None:
                return
            parts = getattr(module, _PARTS_ATTRIBUTE, None)
            if not isinstance(parts, FusedParts):
                raise TensorParallelError(
                    f"A tp_plan rule shards a {type(module).__name__} with {COLWISE_PARTS!r}, but no fusion declared "
                    "the parts of its rows: the fusion's tensor_parallel_layout names that style's modules."
                )
            rows = sum(parts.local_sizes(mesh.size()))
            module._parameters[param] = nn.Parameter(
                torch.empty((rows, *meta.shape[1:]), dtype=meta.dtype, device="meta"),
                requires_grad=meta.requires_grad,
            )

    register_parallel_style(COLWISE_PARTS, ColwisePartsParallel())
    _installs.made("tensor_parallel_style")


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

    def save_writer(self, model: PreTrainedModel) -> SaveWriter:
        """Rank 0 writes whole files, once every rank has gathered the tensors; the others wait for it. (A model whose
        parameters are ``DTensor``s is written collectively: the save's own mode for them names its writer last.)"""
        return WholeFiles(writes=dist.get_rank() == 0, done=functools.partial(_barrier, model))

    def plan_save(self, plan: SavePlan) -> None:
        """The fused parameters sharded part by part (plain local tensors) stand in with their full shapes; they are
        gathered on the way out, not written row by row."""
        parts = _parts(plan.model)
        for key, tensor in plan.state.items():
            if key in parts and not isinstance(tensor, DTensor):
                full = torch.empty((sum(parts[key]), *tensor.shape[1:]), dtype=tensor.dtype, device="meta")
                plan.take(key, full, spread=f"tensor-parallel parts {list(parts[key])}")

    def save_tensor(self, plan: SavePlan, key: str, tensor: torch.Tensor, rows: Rows | None) -> torch.Tensor:
        """A fused parameter sharded part by part, gathered whole on every rank (a collective)."""
        parts = _parts(plan.model)
        if key not in parts or isinstance(tensor, DTensor):
            return tensor
        group = _tp_group(plan.model)
        size = dist.get_world_size(group)
        local = tensor.detach().contiguous()
        shards = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(shards, local, group=group)
        fused = FusedParts(parts[key])
        gathered = local.new_empty((sum(fused.sizes), *local.shape[1:]))
        for rank, shard in enumerate(shards):
            for held in fused.by_part(rank, size):
                gathered[held.fused] = shard[held.shard]
        return gathered

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
        rules = {**model.tp_plan, **override}
        _check_head_counts(model, rules, mesh.size())
        fused = _fused_layouts(model, plan.fusions.fused_modules(), rules, mesh.size())
        _check_declared_layouts(model, fused, plan.conversion)
        set_tp_plan(model, _translate_plan(rules, fused))
        # The plan is complete now: transformers resolves it (validation, layer numbers) as for a stock model.
        tp_plan = resolved_tp_plan(model, mesh.size())
        parts = _declare_parts(model, fused, tp_plan)
        try:
            apply_tensor_parallel(model, mesh, tp_plan)
        finally:
            for name in parts:
                model.get_submodule(name).__dict__.pop(_PARTS_ATTRIBUTE, None)
        for name, (spec, layout) in fused.items():
            spec.finish_tensor_parallel(model.get_submodule(name), layout, mesh.size())
        # Each parameter of a module sharded part by part -> its global part sizes (what loads and saves slice by).
        recorded = {
            f"{name}.{param}": held.sizes
            for name, held in parts.items()
            for param, _ in model.get_submodule(name).named_parameters(recurse=False)
        }
        ensure_model_record(model).tensor_parallel_parts = recorded
        return ShardedLoad(model, plan, mesh, recorded)


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


def _check_head_counts(model: PreTrainedModel, rules: Mapping[str, str], ranks: int) -> None:
    """Refuse to split attention heads over ``ranks`` ranks when a head count does not divide by it.

    An attention module whose ``q_proj`` / ``k_proj`` / ``v_proj`` the plan splits by rows computes, on each rank,
    that rank's rows reshaped into heads of its ``head_dim``: with more ranks than key/value heads (or any count that
    does not divide) a rank holds part of a head, and the first forward fails deep in the attention (stock too:
    ``shape '[2, 16, -1, 16]' is invalid``). The rules checked are those for the stock projections, which a fused
    ``qkv_proj``'s slices keep the names of, so fused and unfused models are refused alike, before the plan is
    translated or anything is read.
    """
    counts: dict[str, tuple[str, dict[str, int]]] = {}  # generic name -> (class, {kind of heads: count})
    for name, module in model.named_modules():
        head_dim = getattr(module, "head_dim", None)
        if not isinstance(head_dim, int) or head_dim <= 0:
            continue
        generic = generic_module_name(name)
        heads: dict[str, int] = {}
        for child, kind in _HEAD_PROJECTIONS.items():
            rows = getattr(getattr(module, child, None), "out_features", None)
            if isinstance(rows, int) and rules.get(f"{generic}.{child}") in _ROW_SPLITTING_STYLES:
                heads[kind] = rows // head_dim
        if heads:
            counts.setdefault(generic, (type(module).__name__, heads))
    uneven = {generic: found for generic, found in counts.items() if any(n % ranks for n in found[1].values())}
    if not uneven:
        return
    common = math.gcd(*(n for _, heads in counts.values() for n in heads.values()))
    sizes = [size for size in range(1, common + 1) if common % size == 0]
    described = "; ".join(
        f"{generic} ({cls}) has " + " and ".join(f"{n} {kind} heads" for kind, n in heads.items())
        for generic, (cls, heads) in uneven.items()
    )
    raise TensorParallelError(
        f"{type(model).__name__} cannot be sharded over {ranks} ranks: each rank computes whole attention heads, "
        f"and {described}, which do not all divide by {ranks}. TP sizes that divide every head count: {sizes}."
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


def rules_under(rules: Mapping[str, str], generic: str) -> dict[str, str]:
    """The ``rules`` of a TP plan at or under the module ``generic`` (its name with layer numbers as ``*``), named
    relative to it (``""`` for the module itself): what a fusion's ``tensor_parallel_layout`` is given."""
    return {
        rule[len(generic) + 1 :] if rule != generic else "": style
        for rule, style in rules.items()
        if rule == generic or rule.startswith(f"{generic}.")
    }


def _fused_layouts(
    model: nn.Module, specs: Mapping[str, ModuleFusionSpec], rules: Mapping[str, str], ranks: int
) -> dict[str, tuple[ModuleFusionSpec, TensorParallelLayout]]:
    """Each fused module's layout under tensor parallelism (``{name: (spec, layout)}``), from its spec given the plan's
    ``rules`` at or under it; modules whose spec declares none are left out (their plan stays as it is)."""
    layouts: dict[str, tuple[ModuleFusionSpec, TensorParallelLayout]] = {}
    for name, spec in specs.items():
        module = model.get_submodule(name)
        generic = generic_module_name(name)
        try:
            layout = spec.tensor_parallel_layout(module, rules_under(rules, generic), ranks)
        except TensorParallelError as exc:
            raise TensorParallelError(f"{generic} ({type(module).__name__}): {exc}") from None
        if layout is None:
            continue
        uneven = {
            shard_name: shard.parts.sizes
            for shard_name, shard in layout.shards.items()
            if shard.parts is not None and not shard.parts.divides(ranks)
        }
        if uneven:
            raise TensorParallelError(
                f"{generic} cannot be sharded part by part over {ranks} ranks: the part sizes of {uneven} do not all "
                "divide by the TP size."
            )
        layouts[name] = (spec, layout)
    return layouts


def _joined_parts(conversion: ConversionPlan) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Each runtime tensor that the load concatenates from several parts (a fused ``qkv_proj``, a user fusion's
    stacked weight) -> the dim it joins them along and their sizes there."""
    joined = {}
    for group in conversion.groups:
        last = group.operations[-1] if group.operations else None
        shapes = group.target_shapes
        if isinstance(last, Concatenate) and not last.indexed and last.sizes and len(last.sizes) > 1:
            if len(shapes) == 1 and isinstance(shapes[0], tuple):
                (target,) = group.target_keys()
                joined[target] = (last.dim % len(shapes[0]), tuple(last.sizes))
    return joined


def _check_declared_layouts(
    model: nn.Module, fused: Mapping[str, tuple[ModuleFusionSpec, TensorParallelLayout]], conversion: ConversionPlan
) -> None:
    """Refuse, before anything is sharded, a fusion's layout that does not fit the module it was declared for: a
    shard naming no module of it, or one holding no parameter, parts that do not tile a weight's rows, a split that
    cuts across the parts a weight is joined from (:meth:`TensorParallelShard.problems`). transformers shards what it
    is told, and such a model computes something else on every rank."""
    joined = _joined_parts(conversion)
    problems: dict[str, None] = {}  # in order, each once: every layer of a fused class repeats its layout's faults
    for name, (spec, layout) in fused.items():
        owner, generic = model.get_submodule(name), generic_module_name(name)
        declared_by = f"the layout {type(spec).__name__} declares for {type(owner).__name__}"
        # Each module of the fused one by its path and its name relative to it as plans name it (layer numbers '*').
        modules = [
            (path, module, generic_module_name(path)[len(generic) + 1 :])
            for inner, module in owner.named_modules()
            for path in [f"{name}.{inner}" if inner else name]
        ]
        for shard_name, shard in layout.shards.items():
            matched = [(path, module) for path, module, relative in modules if relative == shard_name]
            if not matched:
                names = sorted({relative for _, _, relative in modules if relative})
                problems[
                    f"{declared_by} shards {shard_name!r}, which names no module of {generic} "
                    f"(its modules: {', '.join(names) or 'none'})"
                ] = None
            for path, module in matched:
                local = {key[len(path) + 1 :]: value for key, value in joined.items() if key.startswith(f"{path}.")}
                for problem in shard.problems(generic_module_name(path), module, local):
                    problems[f"{declared_by}: {problem}"] = None
    if problems:
        raise TensorParallelError(
            "A fusion's tensor_parallel_layout does not fit its module: "
            + "; ".join(problems)
            + ". Fix what the spec's tensor_parallel_layout returns, or return None to keep the module whole."
        )


def _translate_plan(
    rules: Mapping[str, str], fused: Mapping[str, tuple[ModuleFusionSpec, TensorParallelLayout]]
) -> dict[str, str]:
    """``rules`` (generic names, stock modules) with each fused module's translated by its layout (one per generic
    name: its first module's, as the plan names every layer alike)."""
    plan = dict(rules)
    seen: set[str] = set()
    for name, (_, layout) in fused.items():
        generic = generic_module_name(name)
        if generic in seen:
            continue
        seen.add(generic)
        for rule in layout.replaces:
            plan.pop(f"{generic}.{rule}" if rule else generic, None)
        for shard_name, shard in layout.shards.items():
            target = f"{generic}.{shard_name}" if shard_name else generic
            if shard.parts is not None:
                plan[target] = COLWISE_PARTS
            elif shard.local:  # its weight sharded, no hooks: the module above combines the ranks' results
                plan[f"{target}.weight"] = shard.split
                plan[target] = "local_params"
            else:
                plan[target] = shard.split
    return plan


def _declare_parts(
    model: nn.Module, fused: Mapping[str, tuple[ModuleFusionSpec, TensorParallelLayout]], tp_plan: Mapping[str, str]
) -> dict[str, FusedParts]:
    """Give each module that the resolved ``tp_plan`` shards part by part the parts its fusion's layout declares (what
    :data:`COLWISE_PARTS` shards by); returns them by module name."""
    parts: dict[str, FusedParts] = {}
    for name, (_, layout) in fused.items():
        owner = model.get_submodule(name)
        for shard_name, shard in layout.shards.items():
            if shard.parts is None:
                continue
            for inner, module in owner.named_modules():
                path = f"{name}.{inner}" if inner else name
                if generic_module_name(inner) == shard_name and tp_plan.get(path) == COLWISE_PARTS:
                    setattr(module, _PARTS_ATTRIBUTE, shard.parts)
                    parts[path] = shard.parts
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
        factor = strided_split_factor(placement)
        strided = factor is not None
        if dim == 0 or (dim in concatenated) != strided:
            return False
        if strided and factor != len(group.sources):
            return False
    return True


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
            return torch.cat([tensor[held.fused] for held in FusedParts(self.parts[key]).by_part(self.rank, self.size)])
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


def _parts(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The fused parameters of a tensor-parallel ``model`` sharded part by part: key -> global part sizes."""
    record = model_record(model)
    return (None if record is None else record.tensor_parallel_parts) or {}


def _barrier(model: nn.Module) -> None:
    """Wait for every rank of tensor-parallel ``model`` (after rank 0 wrote a save)."""
    dist.barrier(group=_tp_group(model))


def _tp_group(model: nn.Module) -> dist.ProcessGroup:
    """The process group of the ranks ``model`` (loaded with tensor parallelism) is sharded over."""
    mesh = device_mesh_of(model)
    if mesh is None:
        raise TensorParallelError(f"{type(model).__name__} has no device mesh: it was not loaded tensor-parallel.")
    return mesh["tp"].get_group()
