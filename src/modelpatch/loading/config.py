"""Read a checkpoint directory's config and resolve the concrete model class (``hub.py`` finds the directory)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig, PreTrainedModel

from .._transformers import auto_model_class, is_auto_class
from ..checkpoint.json_file import MAX_CONFIG_BYTES, read_json
from ..errors import CheckpointError
from ..state import unmark_runtime_layout

MAX_CONFIG_COUNT = 2**20
"""Largest value accepted for a count (a ``num_*`` or ``n_*`` key) in ``config.json``.

transformers turns counts into lists and modules of that length (``num_hidden_layers: 300000000`` in a 4 KB file
once made a 2.4 GB ``layer_types`` list); real counts (layers, experts, heads, labels of a vocabulary) stay far
below a million.
"""


def load_config(directory: Path, overrides: Mapping[str, Any] | None = None) -> PretrainedConfig:
    """Parse ``directory/config.json`` with the config class of its ``model_type``.

    The file is read with the bounds of :func:`~modelpatch.checkpoint.json_file.read_json` and its counts are
    checked against :data:`MAX_CONFIG_COUNT` before transformers sees it; whatever transformers then rejects is a
    :class:`CheckpointError` naming the file too. ``overrides`` set config attributes as transformers'
    ``from_pretrained(path, **kwargs)`` does (through the config class's own ``from_dict``, so ``num_labels`` also
    rebuilds the label maps).

    Raises:
        CheckpointError: ``config.json`` is not valid, or names a model type transformers does not have.
        TypeError: An override names no attribute of the config: the keyword is unknown.
    """
    config_file = directory / "config.json"
    raw = read_json(config_file, MAX_CONFIG_BYTES)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_file} must hold a JSON object, got {type(raw).__name__}.")
    unmarked = unmark_runtime_layout(raw)
    raw = raw if unmarked is None else unmarked
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        if "auto_map" in raw:
            raise CheckpointError(
                f"{config_file} names model_type {model_type!r}, a custom model whose code ships with the checkpoint "
                "(auto_map, trust_remote_code): modelpatch loads only the model types built into transformers."
            )
        raise CheckpointError(
            f"{config_file} names model_type {model_type!r}, which transformers does not know."
            if model_type
            else f"{config_file} has no model_type."
        )
    _check_counts(config_file, raw)

    def build(**kwargs: Any) -> PretrainedConfig:
        if unmarked is None:
            return AutoConfig.from_pretrained(str(directory), local_files_only=True, **kwargs)
        # A runtime-layout save, its model type marked for stock transformers to refuse: built from the unmarked
        # object by the config class AutoConfig would pick.
        config = CONFIG_MAPPING[model_type].from_dict(raw, **kwargs)
        config._name_or_path = str(directory)
        return config

    try:
        config = build()
    except Exception as exc:  # transformers' validation raises many types (its strict dataclasses: plain Exception)
        raise CheckpointError(f"{config_file} is not a valid {model_type} config: {exc}") from exc
    if not overrides:
        return config
    # Checked first: transformers' config loader would also consume download options (user_agent, _commit_hash, ...).
    unknown = sorted(name for name in overrides if not hasattr(config, name))
    if unknown:
        raise TypeError(
            f"from_pretrained() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}: neither a loading "
            f"option of modelpatch or transformers nor an attribute of {type(config).__name__} to override."
        )
    return build(**overrides)


def _check_counts(config_file: Path, raw: dict[str, Any]) -> None:
    """Refuse a count (``num_*`` / ``n_*`` key, at any depth) above :data:`MAX_CONFIG_COUNT`, naming its key."""
    pending: list[tuple[str, Any]] = [("", raw)]
    while pending:
        where, value = pending.pop()
        if isinstance(value, dict):
            pending.extend((f"{where}.{key}" if where else str(key), item) for key, item in value.items())
        elif isinstance(value, list):
            pending.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
        elif (
            isinstance(value, int) and value > MAX_CONFIG_COUNT and where.rpartition(".")[2].startswith(("num_", "n_"))
        ):
            raise CheckpointError(
                f"{config_file}: {where} = {value} is not a plausible count (at most {MAX_CONFIG_COUNT}); "
                "transformers would build structures of that size"
            )


def resolve_model_class(model_class: type, config: PretrainedConfig) -> type[PreTrainedModel]:
    """The concrete ``PreTrainedModel`` class: ``model_class`` itself, or what an Auto class maps ``config`` to.

    modelpatch's own Auto classes stand for transformers' (their ``transformers_class``).
    """
    model_class = getattr(model_class, "transformers_class", model_class)
    if is_auto_class(model_class):
        concrete = auto_model_class(model_class, config)
        if concrete is None:
            raise CheckpointError(
                f"{model_class.__name__} has no model for config {type(config).__name__} (model_type "
                f"{config.model_type!r})."
            )
        return concrete
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
