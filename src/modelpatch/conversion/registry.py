"""The conversion registry: which transforms turn a checkpoint into a model's runtime layout.

Mappings are keyed by model type (``config.model_type``) or by class name, as in transformers. The built-in ones are
transformers' own registry, read live and translated (:mod:`.transformers_mapping`); what is registered here takes
precedence over it, key by key. :func:`model_conversions` collects a model's transforms the way transformers'
``get_model_conversion_mapping`` does: every ``PreTrainedModel`` in the module tree is looked up by class name first,
then by model type; a sub-model's transforms are scoped to its prefix; ``"legacy"`` renamings come last.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Iterable

from torch import nn
from transformers import PreTrainedModel

from .._transformers import user_registered_in_transformers
from ..errors import ConversionError, ConversionRegistryError
from ..registry import Registry
from . import transformers_mapping
from .transforms import WeightTransform

conversion_registry: Registry[str, tuple[WeightTransform, ...]] = Registry(
    "conversion mapping", ConversionRegistryError
)
"""What was registered through modelpatch (translated); it overrides transformers' entry of the same key.
``conversion_registry.scoped()`` restores it on exit."""


def register_checkpoint_conversion_mapping(
    model_type: str, mapping: Iterable[WeightTransform], overwrite: bool = False
) -> None:
    """Register the transforms that load checkpoints of ``model_type`` (a ``config.model_type`` or a class name,
    which wins over the model type of its instances).

    Args:
        model_type: e.g. ``"qwen2_moe"`` or ``"Qwen2MoeForCausalLM"``.
        mapping: ``WeightConverter`` / ``WeightRenaming`` instances, modelpatch's or transformers' own (translated
            here); applied renamings first, then the first converter whose source pattern matches a key.
        overwrite: Replace an existing mapping (transformers' built-in ones included) instead of raising.

    Raises:
        TypeError: An item is not a weight transform.
        ConversionError: ``model_type`` already has a mapping and ``overwrite`` is False (a
            :class:`~modelpatch.errors.RegistryError` too); or a transformers transform or operation that modelpatch
            cannot translate (named).
    """
    if not isinstance(model_type, str) or not model_type:
        raise ConversionError(f"model_type must be a non-empty string, got {model_type!r}.")
    transforms = tuple(transformers_mapping.translate(mapping, model_type))
    # transformers' keys (built in, or registered through transformers) are checked here; modelpatch's own keys by
    # the registry, atomically with the change.
    if not overwrite and model_type in transformers_mapping.builtin_keys():
        raise ConversionRegistryError(
            f"A conversion mapping for model type {model_type!r} is built into transformers; pass overwrite=True to "
            "replace it."
        )
    conversion_registry.register({model_type: transforms}, overwrite=overwrite)


def get_checkpoint_conversion_mapping(model_type: str) -> list[WeightTransform] | None:
    """A copy of the transforms registered for ``model_type`` (a model type or class name), or None."""
    transforms = conversion_registry.get(model_type, None)
    if transforms is not None:
        return copy.deepcopy(list(transforms))
    return transformers_mapping.builtin_mapping(model_type)


def registered_model_types() -> list[str]:
    """Every key with a mapping: registered here or built into transformers (model types, class names, legacy)."""
    return sorted(set(conversion_registry.snapshot()) | transformers_mapping.builtin_keys())


def _user_registered(key: str) -> bool:
    return key in conversion_registry.snapshot() or user_registered_in_transformers(key)


def legacy_conversions() -> list[WeightTransform]:
    """The ``"legacy"`` renamings every load applies after the model's own (``LayerNorm.gamma`` -> ``LayerNorm.weight``,
    ...). Legacy key names are another layout of the same checkpoints, so they are ``alternative``: a model with
    nothing recorded never writes them, as stock transformers leaves them out of such a save."""
    transforms = get_checkpoint_conversion_mapping(transformers_mapping.LEGACY) or []
    for transform in transforms:
        transform.alternative = True
    return transforms


def model_conversions(model: nn.Module) -> list[WeightTransform]:
    """The transforms of ``model`` and of its sub-models, as stock transformers collects them, configured with the
    model's config (head counts, numbers of parts).

    Each ``PreTrainedModel`` in the tree is looked up by class name, then by model type. A sub-model whose class or
    model type an ancestor already matched is skipped; the transforms of any other sub-model only apply to keys under
    its prefix. Custom code (a class outside transformers) gets only what was registered explicitly. The ``"legacy"``
    renamings are not part of it (see :func:`legacy_conversions`).
    """
    transforms: list[WeightTransform] = []
    claimed: dict[str, list[str]] = defaultdict(list)
    base_model_prefix = getattr(model, "base_model_prefix", "") or ""

    def claimed_above(identifier: str, name: str) -> bool:
        return any(owner == "" or name.startswith(owner + ".") for owner in claimed[identifier])

    for name, module in model.named_modules():
        if not isinstance(module, PreTrainedModel):
            continue
        class_name, model_type = type(module).__name__, module.config.model_type
        if module.is_custom_code() and not (
            _user_registered(class_name) or (model_type and _user_registered(model_type))
        ):
            continue
        if claimed_above(class_name, name):
            continue
        found = get_checkpoint_conversion_mapping(class_name)
        by_class = found is not None
        if not by_class:
            if not model_type or claimed_above(model_type, name):
                continue
            found = get_checkpoint_conversion_mapping(model_type)
        if found is None:
            continue
        if name:
            scope = name.removeprefix(base_model_prefix).removeprefix(".")
            found = [t.scoped(scope, base_model_prefix) for t in found]
        transforms.extend(found)
        claimed[class_name].append(name)
        if not by_class and model_type:
            claimed[model_type].append(name)
    config = getattr(model, "config", None)
    return [t.configured(config) for t in transforms]
