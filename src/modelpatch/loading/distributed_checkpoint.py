"""Distributed checkpoints (``torch.distributed.checkpoint``) in the original layout, for restructured sharded models.

A fused model's own state dict (``get_state_dict`` / ``set_state_dict`` of ``torch.distributed.checkpoint.state_dict``)
resumes into the same structure at any world size: DCP reshards it. To resume into another structure (an unfused
model, or other fusions), save the model's state in the checkpoint's original layout instead:

* :func:`get_original_state_dict` gives DCP the original-layout tensors (``q_proj``, ``k_proj``, ``v_proj``, one
  tensor per expert, ...): a tensor read unchanged is the model's own ``DTensor``; a converted group is converted back
  one group at a time (its sources gathered with ``DTensor.full_tensor``) and sharded as its source was;
* :func:`set_original_state_dict` fills a model, of whatever structure and world size, from those tensors once
  ``torch.distributed.checkpoint.load`` has read them into the placeholders :func:`get_original_state_dict` gave for
  that model: each group of the model's own layout is converted forwards (the exact reverse of its save), one group
  at a time, and each rank keeps its shard.

The optimizer state is keyed by the model's own parameters: it resumes with ``get_state_dict(model, optimizer)`` into
the same structure only (exact across world sizes); across a fusion, the parameters differ and torch refuses it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from ..errors import SaveError
from .distributed import local_part, shard_like, shard_of
from .save_sharded import ShardedState


def get_original_state_dict(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """``model``'s state in the checkpoint's original layout, sharded, for ``torch.distributed.checkpoint.save``
    (and, on the model to resume, as the placeholders ``torch.distributed.checkpoint.load`` fills). Call it on every
    rank: converted groups are gathered one at a time (collectives).

    Tensors read unchanged are the model's own (``DTensor`` shards where sharded); each converted group is converted
    back exactly as :func:`modelpatch.save_pretrained` writes it, and sharded as its first source is.
    """
    sharded = ShardedState(model, model.state_dict(), original_format=True)
    result: dict[str, torch.Tensor] = {ckpt: sharded.state[runtime] for ckpt, runtime in sharded.plan.direct.items()}
    with torch.no_grad():
        for group in sharded.plan.groups:
            sources = group.source_keys()
            fulls = {key: sharded.full(key) for key in sources}
            for key, tensor in group.run(fulls.__getitem__).items():
                # Sharded as the source is, this rank's part copied out of the whole converted tensor.
                result[key] = shard_like(tensor, sharded.state[sources[0]]).clone()
    return result


def set_original_state_dict(model: PreTrainedModel, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Fill ``model`` from ``state_dict``, its state in the original layout (the placeholders of
    :func:`get_original_state_dict`, filled by ``torch.distributed.checkpoint.load``). Call it on every rank.

    Raises:
        SaveError: ``state_dict`` lacks keys of the original layout (every missing key is named).
    """
    sharded = ShardedState(model, model.state_dict(), original_format=True)
    missing = sorted(key for key in sharded.layout if key not in state_dict)
    if missing:
        raise SaveError(
            f"The original-layout state dict lacks {len(missing)} key(s) of {type(model).__name__}: {missing}"
        )
    targets = model.state_dict(keep_vars=True)

    def full(key: str) -> torch.Tensor:
        tensor = state_dict[key]
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    with torch.no_grad():
        for ckpt, runtime in sharded.plan.direct.items():
            source, target = state_dict[ckpt], targets[runtime]
            same = (
                isinstance(source, DTensor)
                and isinstance(target, DTensor)
                and source.device_mesh == target.device_mesh
                and source.placements == target.placements
            )
            local_part(target).copy_(local_part(source) if same else shard_of(target, full(ckpt)))
        for group in sharded.plan.groups:
            forward = group.reverse()
            fulls = {key: full(key) for key in forward.source_keys()}
            for runtime, tensor in forward.run(fulls.__getitem__).items():
                local_part(targets[runtime]).copy_(shard_of(targets[runtime], tensor))
