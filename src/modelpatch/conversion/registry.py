"""The per-model-type conversion registry: which transforms turn a checkpoint of a model type into its runtime layout."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable

from torch import nn
from transformers import PreTrainedModel

from ..errors import ConversionError
from .builtin import builtin_conversions
from .transforms import WeightTransform

_lock = threading.Lock()
_mappings: dict[str, tuple[WeightTransform, ...]] = {k: tuple(v) for k, v in builtin_conversions().items()}


def register_checkpoint_conversion_mapping(
    model_type: str, mapping: Iterable[WeightTransform], overwrite: bool = False
) -> None:
    """Register the transforms that load checkpoints of ``model_type`` (``config.model_type``).

    Args:
        model_type: e.g. ``"qwen2_moe"``.
        mapping: ``WeightConverter`` / ``WeightRenaming`` instances, applied renamings first, then the first converter
            whose source pattern matches a key.
        overwrite: Replace an existing mapping (built-in ones included) instead of raising.

    Raises:
        TypeError: An item is not a ``WeightTransform``.
        ConversionError: ``model_type`` already has a mapping and ``overwrite`` is False.
    """
    if not isinstance(model_type, str) or not model_type:
        raise ConversionError(f"model_type must be a non-empty string, got {model_type!r}.")
    transforms = tuple(mapping)
    for transform in transforms:
        if not isinstance(transform, WeightTransform):
            raise TypeError(f"Conversion mapping items must be WeightConverter/WeightRenaming, got {transform!r}.")
    with _lock:
        if model_type in _mappings and not overwrite:
            raise ConversionError(
                f"A conversion mapping for model type {model_type!r} already exists; pass overwrite=True to replace it."
            )
        _mappings[model_type] = transforms


def get_checkpoint_conversion_mapping(model_type: str) -> list[WeightTransform] | None:
    """A copy of the transforms registered for ``model_type``, or None."""
    transforms = _mappings.get(model_type)
    return None if transforms is None else copy.deepcopy(list(transforms))


def registered_model_types() -> list[str]:
    return sorted(_mappings)


def model_conversions(model: nn.Module) -> list[WeightTransform]:
    """The registered transforms of ``model``'s type and of its nested sub-models' types, in that order."""
    transforms: list[WeightTransform] = []
    seen: set[str] = set()
    for module in model.modules():
        model_type = getattr(getattr(module, "config", None), "model_type", None)
        if isinstance(module, PreTrainedModel) and model_type and model_type not in seen:
            seen.add(model_type)
            transforms.extend(get_checkpoint_conversion_mapping(model_type) or [])
    return transforms
