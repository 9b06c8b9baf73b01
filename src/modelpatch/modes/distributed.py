"""Models whose parameters are spread over processes: sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``) or
loaded tensor-parallel (``tp_plan``). How to tell them, how to read a parameter whole, how to cut a whole tensor
into this rank's shard of a parameter, which rows of a tensor this rank holds (what the sharded load, the collective
save and DCP in the original layout read and write).

Both kinds hold ``DTensor`` parameters between forwards (a fused projection of a tensor-parallel model holds its local
rows as a plain tensor: ``modes/parallel.py``). Reading one whole (:func:`full_tensor`) is a collective: every rank
of its mesh must make the same calls in the same order.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ..errors import ModelPatchError, PeftIntegrationError, ShardingError, TorchVersionError
from ..loading.record import model_record
from ..saving.plan import Rows

__all__ = [
    "Rows",
    "current_rank",
    "is_fully_sharded",
    "local_part",
    "local_rows",
    "model_class",
    "shard_of",
    "full_tensor",
    "is_fsdp",
    "is_tensor_parallel",
    "refuse_adapters",
    "refuse_sharded",
    "refuse_two_shardings",
    "shard_like",
    "sharding_of",
]

# What a model both tensor-parallel and FSDP2-sharded (a 2-D mesh) is told: modelpatch reads each kind on its own.
_TWO_D_REMEDY = (
    "modelpatch reads and writes models sharded one way (FSDP2 over one mesh dimension, or tensor parallelism), not "
    "both at once on a 2-D mesh. Use one of the two, or gather the weights with torch.distributed.checkpoint's "
    "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)) and convert them on an unsharded "
    "model."
)


def is_fsdp(model: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` or any module inside it."""
    return any(isinstance(module, FSDPModule) for module in model.modules())


def is_tensor_parallel(model: nn.Module) -> bool:
    """Whether ``model`` was loaded with tensor parallelism (its parameters are shards)."""
    record = model_record(model)
    return record is not None and record.tensor_parallel_parts is not None


def sharding_of(model: nn.Module) -> str | None:
    """How ``model``'s parameters are spread over processes, in words for messages ("tensor-parallel",
    "FSDP2-sharded", or both), or None when each process holds them whole."""
    kinds = {"tensor-parallel": is_tensor_parallel(model), "FSDP2-sharded": is_fsdp(model)}
    return " and ".join(kind for kind, sharded in kinds.items() if sharded) or None


def refuse_sharded(model: nn.Module, what: str, remedy: str, error: type[ModelPatchError] = ShardingError) -> None:
    """Raise ``error`` naming ``what`` (the operation), how ``model`` is sharded and ``remedy``, when it is sharded."""
    sharding = sharding_of(model)
    if sharding is not None:
        raise error(f"{what} does not work on a {sharding} model ({type(model).__name__}): {remedy}")


def refuse_two_shardings(model: nn.Module, what: str) -> None:
    """Raise :class:`ShardingError` naming ``what`` when ``model`` is both tensor-parallel and FSDP2-sharded."""
    if is_tensor_parallel(model) and is_fsdp(model):
        raise ShardingError(
            f"{what} does not work on a tensor-parallel and FSDP2-sharded model ({type(model).__name__}): "
            + _TWO_D_REMEDY
        )


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole: a ``DTensor`` gathered from its shards (a collective: every rank of its mesh must call it),
    any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def shard_like(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``tensor`` (whole, on every rank) as a ``DTensor`` placed as the ``DTensor`` ``like``: this rank keeps its own
    shard, cut locally (no communication; uneven shards as torch cuts them). Any other ``like``: ``tensor`` as it is."""
    if not isinstance(like, DTensor) or isinstance(tensor, DTensor):
        return tensor
    if "src_data_rank" not in inspect.signature(distribute_tensor).parameters:
        # Without it distribute_tensor broadcasts rank 0's tensor: a collective the ranks need not reach in step here.
        raise TorchVersionError(
            f"torch {torch.__version__} lacks distribute_tensor(src_data_rank=), which loading whole tensors into "
            "DTensor parameters (FSDP2, tensor parallelism) needs; it needs torch >= 2.7."
        )
    return distribute_tensor(tensor.detach(), like.device_mesh, like.placements, src_data_rank=None)


def refuse_adapters(model: nn.Module, what: str) -> None:
    """Refuse PEFT adapters (``what``: the call) on a sharded model, by name, before anything is injected.

    PEFT injects new modules: under tensor parallelism their plain-tensor products meet the sharded outputs of the
    base layers' hooks (a shape error deep in the forward); under FSDP2 their parameters are not among those
    ``fully_shard`` manages.
    """
    refuse_sharded(
        model,
        what,
        "add the adapters to the unsharded model, then shard it (get_peft_model before fully_shard); a "
        "tensor-parallel model takes no adapters: load it without tp_plan.",
        PeftIntegrationError,
    )


def is_fully_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds ``DTensor`` parameters (FSDP2's ``fully_shard``, or a model sharded by hand)."""
    return any(isinstance(parameter, DTensor) for parameter in model.parameters())


def model_class(model: nn.Module) -> type:
    """The class of ``model`` as built: ``fully_shard`` swaps a module's class for a subclass of ``FSDPModule``."""
    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))


def current_rank() -> int:
    """This process's rank in the default process group (0 outside ``torch.distributed``)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def local_rows(tensor: torch.Tensor) -> Rows | None:
    """This rank's rows of ``tensor`` when its local part is one block of whole rows: a ``DTensor`` sharded on dim 0
    (FSDP2's ``Shard(0)``) or replicated, or a plain tensor (every rank holds it whole; rank 0 writes it). None when
    it is not (a shard along another dim, as tensor parallelism's rowwise one, or a 0-d tensor)."""
    if tensor.ndim == 0:
        return None
    if not isinstance(tensor, DTensor):
        return Rows(0, tensor.shape[0], current_rank() == 0)
    if not all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in tensor.placements):
        return None
    # DCP's own description of a DTensor's local part: one chunk (offsets and sizes in the full tensor).
    chunks = tensor.__create_chunk_list__()
    if len(chunks) != 1:
        return None
    (chunk,) = chunks
    if any(chunk.offsets[1:]) or tuple(chunk.sizes[1:]) != tuple(tensor.shape[1:]):
        return None
    coordinate: Sequence[int] = tensor.device_mesh.get_coordinate() or ()
    writes = all(
        index == 0 for index, placement in zip(coordinate, tensor.placements, strict=True) if placement.is_replicate()
    )
    start = chunk.offsets[0]
    return Rows(start, start + chunk.sizes[0], writes)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's part of ``tensor`` (its local shard for a ``DTensor``)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard_of(target: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` (the whole value of ``target``), as ``target`` holds it: its rows where the
    target is row-sharded, else DTensor's own split of ``full`` along ``target``'s placements (no communication:
    every rank holds ``full``)."""
    rows = local_rows(target)
    if rows is not None and isinstance(target, DTensor):
        return full[rows.start : rows.stop]  # a view: what torch's own split of these placements gives, uncopied
    return local_part(shard_like(full, target))
