"""Read a local checkpoint's config and resolve the concrete model class (no hub access, ever)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
from transformers.models.auto.auto_factory import _BaseAutoModelClass, _get_model_class
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from ..errors import CheckpointError

def checkpoint_directory(path: str | Path) -> Path:
    """``path`` as an existing local directory holding a ``config.json``; a clear error otherwise."""
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(
            f"{str(path)!r} is not a local directory. modelpatch loads local checkpoints only; download hub models "
            "first (e.g. with huggingface_hub.snapshot_download) and pass the directory."
        )
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{directory} has no config.json, so it is not a transformers checkpoint directory.")
    return directory


def load_config(directory: Path) -> PretrainedConfig:
    """Parse ``directory/config.json`` with the config class of its ``model_type``."""
    config_file = directory / "config.json"
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{config_file} is not valid JSON: {exc}.") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_file} must hold a JSON object, got {type(raw).__name__}.")
    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise CheckpointError(
            f"{config_file} names model_type {model_type!r}, which transformers does not know."
            if model_type
            else f"{config_file} has no model_type."
        )
    return AutoConfig.from_pretrained(str(directory), local_files_only=True)


def resolve_model_class(model_class: type, config: PretrainedConfig) -> type[PreTrainedModel]:
    """The concrete ``PreTrainedModel`` class: ``model_class`` itself, or what an Auto class maps ``config`` to.

    modelpatch's own Auto classes stand for transformers' (their ``transformers_class``).
    """
    model_class = getattr(model_class, "transformers_class", model_class)
    if isinstance(model_class, type) and issubclass(model_class, _BaseAutoModelClass):
        mapping = model_class._model_mapping
        if type(config) not in mapping:
            raise CheckpointError(
                f"{model_class.__name__} has no model for config {type(config).__name__} (model_type "
                f"{config.model_type!r})."
            )
        return _get_model_class(config, mapping)
    if isinstance(model_class, type) and issubclass(model_class, PreTrainedModel):
        return model_class
    raise TypeError(f"model_class must be a transformers Auto class or PreTrainedModel subclass, got {model_class!r}.")


def resolve_dtype(
    dtype: torch.dtype | str | None, config: PretrainedConfig, checkpoint_dtypes: Iterable[torch.dtype] = ()
) -> torch.dtype:
    """Like transformers: None -> torch's default dtype, "auto" -> the config's dtype, or an explicit dtype.

    "auto" with no dtype in the config falls back, like transformers, to the first floating dtype among
    ``checkpoint_dtypes`` (the checkpoint's tensors), then to torch's default.
    """
    if dtype is None:
        return torch.get_default_dtype()
    if dtype == "auto":
        configured = getattr(config, "dtype", None)
        if isinstance(configured, str):
            configured = getattr(torch, configured, None)
        if isinstance(configured, torch.dtype):
            return configured
        return next((d for d in checkpoint_dtypes if d.is_floating_point), torch.get_default_dtype())
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, 'auto' or the name of a torch dtype, got {dtype!r}.")
        return resolved
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, 'auto' or None, got {dtype!r}.")
    return dtype
