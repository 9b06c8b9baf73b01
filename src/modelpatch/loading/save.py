"""``save_pretrained``: write a model back in its checkpoint's layout (default) or in its runtime layout.

Data flow of a save:

1. take the model's state dict, minus tied parameters the source checkpoint did not store;
2. original format: every key read unchanged is written under its checkpoint name; every converted group is run
   through its exact reverse (operations bound to the source's shapes at load time); keys the load never saw (a
   model built with ``from_config``, a new task head) are mapped back by running the model type's transforms
   backwards. Runtime format: the state dict as is, and config.json records that it needs no conversion;
3. config.json (with the fusion config, under ``modelpatch_fusion_config``) and generation_config.json are written with the tensors into a temporary
   sibling directory that replaces the target only when complete.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from pathlib import Path

import torch
from transformers import PreTrainedModel

from ..checkpoint import write_checkpoint
from ..conversion.planner import TensorMeta, plan_save
from ..errors import ConversionError
from ..fusions.apply import CONFIG_ATTRIBUTE, SAVED_CONFIG_KEY
from .config import RUNTIME_LAYOUT_ATTRIBUTE
from .load import TRANSFORMS_ATTRIBUTE, model_conversions
from .report import LoadReport, get_load_report

logger = logging.getLogger(__name__)

def _state_to_save(model: PreTrainedModel, report: LoadReport | None) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    stored = set(report.checkpoint_keys) | set(report.direct) if report else set()
    for tied in getattr(model, "all_tied_weights_keys", {}) or {}:
        if tied not in stored:
            state.pop(tied, None)
    return state


def _checkpoint_layout(model: PreTrainedModel, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    report = get_load_report(model)
    out: dict[str, torch.Tensor] = {}
    remaining = dict(state)
    if report is not None and not report.runtime_layout:
        for runtime_key, checkpoint_key in report.direct.items():
            if runtime_key in remaining:
                out[checkpoint_key] = remaining.pop(runtime_key)
        for group in report.groups:
            if not all(k in remaining for k in group.target_keys()):
                raise ConversionError(
                    f"Cannot save {group.target_keys()} back to {group.source_keys()[:3]}...: the model no longer has "
                    "all of these parameters."
                )
            reverse = group.reversed()
            out.update(reverse.run(remaining.__getitem__))
            for key in group.target_keys():
                remaining.pop(key)
    if remaining:
        if report is not None:
            transforms = list(report.transforms)
        elif (built := getattr(model, TRANSFORMS_ATTRIBUTE, None)) is not None:
            transforms = list(built)  # from_config: its Patcher's and fusions' transforms included
        else:
            transforms = model_conversions(model)
        metas = {k: TensorMeta(tuple(v.shape), v.dtype) for k, v in remaining.items()}
        plan = plan_save(metas, transforms)
        plan.raise_problems()
        for checkpoint_key, runtime_key in plan.direct.items():
            out[checkpoint_key] = remaining[runtime_key]
        for group in plan.groups:
            out.update(group.run(remaining.__getitem__))
    return out


def _independent(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors safe to serialise: each owns its storage (converted parts may be views of one fused parameter)."""
    owners: dict[int, str] = {}
    result = {}
    for key, tensor in tensors.items():
        tensor = tensor.detach()
        storage = tensor.untyped_storage().data_ptr()
        if storage in owners or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()
        owners.setdefault(storage, key)
        result[key] = tensor.contiguous()
    return result


def save_pretrained(
    model: PreTrainedModel,
    path: str | Path,
    *,
    save_original_format: bool = True,
    max_shard_size: int | str = "50GB",
) -> list[Path]:
    """Save ``model`` atomically into directory ``path``.

    Args:
        model: A transformers model, typically loaded with :func:`modelpatch.from_pretrained`.
        path: Target directory; written next to it and swapped in only when complete, so a failure or a kill
            mid-save leaves the previous checkpoint intact. Unrelated files already there (tokenizer, ...) are kept.
        save_original_format: Reverse every conversion applied at load, so the files hold exactly the source
            checkpoint's keys, shapes, dtypes and values. False writes the runtime layout and records in config.json
            that a later :func:`modelpatch.from_pretrained` must load it without conversions.
        max_shard_size: Shard above this size (``"5GB"`` or bytes), like transformers.

    Returns:
        The files written.
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}.")
    report = get_load_report(model)
    state = _state_to_save(model, report)
    tensors = _checkpoint_layout(model, state) if save_original_format else state

    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    fusion_config = config.__dict__.pop(CONFIG_ATTRIBUTE, None)
    if fusion_config:
        setattr(config, SAVED_CONFIG_KEY, fusion_config)
    if save_original_format:
        config.__dict__.pop(RUNTIME_LAYOUT_ATTRIBUTE, None)
    else:
        setattr(config, RUNTIME_LAYOUT_ATTRIBUTE, True)
    extra_files = {"config.json": config.to_json_string(use_diff=True).encode()}
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and model.can_generate():
        extra_files["generation_config.json"] = (generation_config.to_json_string()).encode()
    files = write_checkpoint(path, _independent(tensors), extra_files=extra_files, max_shard_size=max_shard_size)
    logger.info("Saved %d tensors to %s (%s layout)", len(tensors), path, "checkpoint" if save_original_format else "runtime")
    return files
