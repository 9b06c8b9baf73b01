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

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from .._transformers import tied_weight_keys
from ..conversion.planner import format_problems
from ..errors import LoadPlanError
from ..modes.distributed import local_part, shard_like, shard_of
from ..saving.save import planned_save


def get_original_state_dict(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """``model``'s state in the checkpoint's original layout, sharded, for ``torch.distributed.checkpoint.save``
    (and, on the model to resume, as the placeholders ``torch.distributed.checkpoint.load`` fills). Call it on every
    rank: converted groups are gathered one at a time (collectives).

    Tensors read unchanged are the model's own (``DTensor`` shards where sharded); each converted group is converted
    back exactly as :func:`modelpatch.save_pretrained` writes it, and sharded as its first source is.
    """
    plan = planned_save(model)
    result: dict[str, torch.Tensor] = {ckpt: plan.state[runtime] for ckpt, runtime in plan.layout.direct.items()}
    with torch.no_grad():
        for group in plan.layout.groups:
            sources = group.source_keys()
            fulls = {key: plan.fetch(key) for key in sources}
            for key, tensor in group.run(fulls.__getitem__).items():
                # Sharded as the source is, this rank's part copied out of the whole converted tensor.
                result[key] = shard_like(tensor, plan.state[sources[0]]).clone()
    return result


def set_original_state_dict(model: PreTrainedModel, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Fill ``model`` from ``state_dict``, its state in the original layout (the placeholders of
    :func:`get_original_state_dict`, filled by ``torch.distributed.checkpoint.load``). Call it on every rank.

    Every key of ``state_dict`` is checked against the model's original layout before anything is written, as torch's
    strict ``load_state_dict`` checks its keys and shapes: a tensor is never broadcast into a parameter, and one on the
    meta device (a placeholder the checkpoint did not fill) is refused, not found out halfway through the writes.

    Raises:
        LoadPlanError: ``state_dict`` does not fit the model's original layout: keys missing, keys the layout does not
            have, values that are not tensors, not of the layout's full shape or on the meta device (every key at
            fault is named); nothing was written.
    """
    plan = planned_save(model)
    _check_original_state(model, plan.checkpoint_metas(), state_dict)
    targets = model.state_dict(keep_vars=True)

    def full(key: str) -> torch.Tensor:
        tensor = state_dict[key]
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    with torch.no_grad():
        for ckpt, runtime in plan.layout.direct.items():
            source, target = state_dict[ckpt], targets[runtime]
            same = (
                isinstance(source, DTensor)
                and isinstance(target, DTensor)
                and source.device_mesh == target.device_mesh
                and source.placements == target.placements
            )
            local_part(target).copy_(local_part(source) if same else shard_of(target, full(ckpt)))
        for group in plan.layout.groups:
            forward = group.reverse()
            fulls = {key: full(key) for key in forward.source_keys()}
            for runtime, tensor in forward.run(fulls.__getitem__).items():
                local_part(targets[runtime]).copy_(shard_of(targets[runtime], tensor))


def _check_original_state(
    model: PreTrainedModel, layout: Mapping[str, torch.Tensor], state_dict: Mapping[str, Any]
) -> None:
    """Raise :class:`LoadPlanError` naming every key of ``state_dict`` that does not fit ``layout`` (the model's
    original layout: full shapes), and every key of ``layout`` it lacks."""
    tied = tied_weight_keys(model)
    problems: dict[str, list[str]] = defaultdict(list)
    problems["missing from the state dict"] = [key for key in layout if key not in state_dict]
    for key, value in state_dict.items():
        meta = layout.get(key)
        if meta is None:
            note = f" (tied to {tied[key]}: the original layout holds it once, under that name)" if key in tied else ""
            problems["not in the model's original layout"].append(key + note)
        elif not isinstance(value, torch.Tensor):
            problems["not tensors"].append(f"{key}: a {type(value).__name__}")
        elif tuple(value.shape) != tuple(meta.shape):  # a DTensor's shape is its full shape
            problems["shape mismatches"].append(
                f"{key}: the state dict gives {list(value.shape)}, the model's original layout has {list(meta.shape)}"
            )
        elif local_part(value).is_meta:
            problems["on the meta device (placeholders never filled: no data to copy)"].append(key)
    if not any(problems.values()):
        return
    lines = [
        f"The original-layout state dict does not fit {type(model).__name__}; nothing was changed.",
        *format_problems(problems),
        "Hint: pass the placeholders get_original_state_dict(model) gives for this model, filled by "
        "torch.distributed.checkpoint.load; a checkpoint of a model of other sizes or layers does not fit it.",
    ]
    raise LoadPlanError("\n".join(lines), {kind: items for kind, items in problems.items() if items})
