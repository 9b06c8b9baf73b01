"""The conversion registry: which transforms turn a checkpoint into a model's runtime layout.

Mappings are keyed by model type (``config.model_type``) or by class name, as in transformers. The built-in ones are
transformers' own registry, read live and translated by the border module :mod:`modelpatch._transformers_mapping`;
what is registered here takes precedence over it, key by key.

This layer imports no transformers, nor the border module: the border, when imported, registers itself here as the
:class:`BuiltinMappings` provider (:func:`set_builtin_mappings`); a lookup that needs the built-in mappings before
anything imported it has it imported then (:func:`_builtins`, the one lazy hook) through :mod:`modelpatch._border`,
to which the package's ``__init__`` handed that import down. So ``import modelpatch.conversion`` stays free of
transformers, a lookup answers the same either way, and no import points back up.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Protocol

from .._border import import_border
from ..errors import ConversionError, ConversionRegistryError
from ..registry import Registry
from .transforms import WeightTransform

LEGACY = "legacy"
"""The key of the renamings every load applies after the model's own (transformers' ``"legacy"`` entry)."""

conversion_registry: Registry[str, tuple[WeightTransform, ...]] = Registry(
    "conversion mapping", ConversionRegistryError
)
"""What was registered through modelpatch (translated); it overrides transformers' entry of the same key.
``conversion_registry.scoped()`` restores it on exit."""


class BuiltinMappings(Protocol):
    """Where the built-in mappings come from, and how foreign transforms are translated where they enter."""

    def keys(self) -> set[str]:
        """Every key with a built-in mapping (model types, class names, ``"legacy"``)."""
        ...

    def mapping(self, key: str) -> list[WeightTransform] | None:
        """The built-in mapping of ``key``, as modelpatch transforms; None when there is none."""
        ...

    def translate(self, items: Iterable[object], owner: str) -> list[WeightTransform]:
        """``items`` as modelpatch transforms (modelpatch's kept, foreign ones translated; ``owner`` names them in
        errors)."""
        ...


_provider: BuiltinMappings | None = None


def set_builtin_mappings(provider: BuiltinMappings) -> None:
    """Install the provider of built-in mappings (the border module does, when imported)."""
    global _provider
    _provider = provider


def _builtins() -> BuiltinMappings:
    if _provider is None:
        # The lazy hook: importing the border module registers it (set_builtin_mappings). Done here, at the first
        # lookup, rather than at import, so that this layer's import never pulls transformers in.
        import_border()
    if _provider is None:
        raise RuntimeError("modelpatch's border module did not register the built-in conversion mappings.")
    return _provider


def as_transforms(items: Iterable[object], owner: str) -> list[WeightTransform]:
    """``items`` as modelpatch transforms: what every entry point taking transforms from a user calls (a ``Patcher``'s
    extra conversions, a fusion's transforms, the registry, ``plan_load`` / ``plan_save``). modelpatch's are kept as
    they are; any other item (transformers' own ``WeightConverter`` / ``WeightRenaming``) goes to the provider, which
    translates it or refuses it by name, with ``owner``.

    Raises:
        TypeError: an item is no weight transform.
        ConversionError: a transformers transform or operation that has no translation.
    """
    items = list(items)
    own = [item for item in items if isinstance(item, WeightTransform)]
    return own if len(own) == len(items) else _builtins().translate(items, owner)


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
    builtins = _builtins()
    transforms = tuple(builtins.translate(mapping, model_type))
    # transformers' keys (built in, or registered through transformers) are checked here; modelpatch's own keys by
    # the registry, atomically with the change.
    if not overwrite and model_type in builtins.keys():
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
    return _builtins().mapping(model_type)


def registered_model_types() -> list[str]:
    """Every key with a mapping: registered here or built into transformers (model types, class names, legacy)."""
    return sorted(set(conversion_registry.snapshot()) | _builtins().keys())


def legacy_conversions() -> list[WeightTransform]:
    """The ``"legacy"`` renamings every load applies after the model's own (``LayerNorm.gamma`` -> ``LayerNorm.weight``,
    ...). Legacy key names are another layout of the same checkpoints, so they are ``alternative``: a model with
    nothing recorded never writes them, as stock transformers leaves them out of such a save."""
    transforms = get_checkpoint_conversion_mapping(LEGACY) or []
    for transform in transforms:
        transform.alternative = True
    return transforms
