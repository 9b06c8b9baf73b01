"""Models whose parameters are spread over processes: sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``) or
loaded tensor-parallel (``tp_plan``). How to tell them, how to read a parameter whole, how to cut a whole tensor
into this rank's shard of a parameter.

Both kinds hold ``DTensor`` parameters between forwards (a fused projection of a tensor-parallel model holds its local
rows as a plain tensor: ``loading/parallel.py``). Reading one whole (:func:`full_tensor`) is a collective: every rank
of its mesh must make the same calls in the same order.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from ..errors import ModelPatchError, PeftIntegrationError, ShardingError
from ..state import model_record

__all__ = [
    "full_tensor",
    "is_fsdp",
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


def _tensor_parallel(model: nn.Module) -> bool:
    record = model_record(model)
    return record is not None and record.tensor_parallel_parts is not None


def sharding_of(model: nn.Module) -> str | None:
    """How ``model``'s parameters are spread over processes, in words for messages ("tensor-parallel",
    "FSDP2-sharded", or both), or None when each process holds them whole."""
    kinds = {"tensor-parallel": _tensor_parallel(model), "FSDP2-sharded": is_fsdp(model)}
    return " and ".join(kind for kind, sharded in kinds.items() if sharded) or None


def refuse_sharded(model: nn.Module, what: str, remedy: str, error: type[ModelPatchError] = ShardingError) -> None:
    """Raise ``error`` naming ``what`` (the operation), how ``model`` is sharded and ``remedy``, when it is sharded."""
    sharding = sharding_of(model)
    if sharding is not None:
        raise error(f"{what} does not work on a {sharding} model ({type(model).__name__}): {remedy}")


def refuse_two_shardings(model: nn.Module, what: str) -> None:
    """Raise :class:`ShardingError` naming ``what`` when ``model`` is both tensor-parallel and FSDP2-sharded."""
    if _tensor_parallel(model) and is_fsdp(model):
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
