"""The border where transformers' conversion objects enter modelpatch: transformers' own conversion registry and
any transformers ``WeightConverter`` / ``WeightRenaming`` a user hands in, translated once into modelpatch's
transforms and operations.

This is the one module that works with transformers' conversion machinery (``transformers.conversion_mapping`` and
``transformers.core_model_loading``: their registry, its transforms, its classes of operations); the private names
it reads (the registry's cache, the ``_original_*_patterns`` of its transforms) come through
:mod:`modelpatch._transformers`. Moving to another transformers release means auditing this file and that one. It
sits above ``conversion/`` (whose modules import no transformers) and below ``patching/``: everything above
translates what it is given here, where it enters (a ``Patcher``'s extra conversions, a fusion's transforms,
:func:`~modelpatch.conversion.registry.register_checkpoint_conversion_mapping` through the provider this module
registers), and the conversion layer only ever sees modelpatch's transforms.

The registry of transformers is read live, at lookup time: its ~260 built-in entries (model types, class names and
``"legacy"``) and whatever was registered there since. Every transform and operation is translated one to one; one
that has no translation (a class a newer release added, say) raises :class:`ConversionError` naming it and the
mapping it belongs to, rather than loading something else than stock would. transformers' classes are looked up by
name (:func:`_hf`), so a release that lacks or renamed one changes which mappings translate, never whether this
module imports. Checked against transformers 5.22.2–5.24.0.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch import nn
from transformers import PreTrainedModel

from ._transformers import (
    conversion_mapping_cache,
    conversion_mapping_of,
    original_patterns,
    user_registered_in_transformers,
)
from ._transformers import core_model_loading as hf
from .conversion import operations as ops
from .conversion import registry
from .conversion import transforms as ours
from .conversion.transforms import WeightTransform
from .errors import ConversionError


class _Absent:
    """Stands for a transformers class this release does not have (it never matches an object)."""


def _hf(name: str) -> type:
    """``transformers.core_model_loading.<name>``, or :class:`_Absent` on releases without it (``Split``,
    ``Inkling2IndexOffsetWeightRename`` came in later 5.x releases; ``Inkling2UnpadVocab``, ``LayerPairCollapse`` and
    the ``Inkling2Loop*`` operations in 5.24)."""
    return getattr(hf, name, _Absent)


def builtin_keys() -> set[str]:
    """Model types and class names transformers registers a mapping for (``"legacy"`` included)."""
    return set(conversion_mapping_cache())


def builtin_mapping(key: str) -> list[WeightTransform] | None:
    """transformers' mapping for ``key`` (a model type or class name), translated; None when it has none."""
    items = conversion_mapping_of(key)
    return None if items is None else translate(items, key)


def translate(items: Iterable[Any], owner: str) -> list[WeightTransform]:
    """modelpatch transforms for ``items`` (modelpatch's, kept as they are, or transformers', translated): what
    :func:`~modelpatch.conversion.registry.as_transforms`, which every entry point taking transforms calls, hands
    foreign items to.

    Raises:
        TypeError: an item is neither.
        ConversionError: a transformers transform or operation that has no translation (named, with ``owner``).
    """
    translated = []
    for item in items:
        if isinstance(item, _hf("WeightTransform")):
            translated.append(_translate_transform(item, owner))
        elif isinstance(item, WeightTransform):
            translated.append(item)
        else:
            raise TypeError(f"{owner}: items must be WeightConverter/WeightRenaming instances, got {item!r}.")
    return translated


def _translate_transform(transform: Any, owner: str) -> WeightTransform:
    kind = type(transform)
    sources, targets = original_patterns(transform)  # what its constructor took, and what ours takes
    result: WeightTransform
    if kind is _hf("PrefixChange"):
        result = ours.PrefixChange(transform.prefix_to_add, transform.prefix_to_remove, transform.model_prefix)
    elif kind is _hf("GroupWeightRename"):
        result = ours.GroupWeightRename(sources, targets)
    elif kind is _hf("LayerPairCollapse"):
        result = ours.LayerPairRenaming()
    elif kind is _hf("Inkling2IndexOffsetWeightRename"):
        result = ours.IndexOffsetRenaming(sources, targets, transform.offset)
    elif kind is _hf("WeightRenaming"):
        # transformers reads a renaming with several targets through its first (its reverse, say).
        result = ours.WeightRenaming(sources, targets[:1])
    elif kind is _hf("WeightConverter"):
        # transformers runs a converter on whichever of its sources a group has; ours names the ones it may lack.
        lacking = any(type(operation) in _COMPANIONS for operation in transform.operations)
        result = ours.WeightConverter(
            sources,
            targets,
            _translate_operations(transform.operations, sources, targets, owner),
            optional=sources[1:] if lacking else (),
        )
    else:
        raise ConversionError(f"Cannot translate transformers' {kind.__name__} in the conversion mapping of {owner!r}.")
    if getattr(transform, "scope_prefix", None) is not None:
        result = result.scoped(transform.scope_prefix, transform.base_model_prefix or "")
    return result


def _translate_operations(
    operations: Sequence[Any], sources: Sequence[str], targets: Sequence[str], owner: str
) -> list[ops.ConversionOperation]:
    """Translate a chain. transformers' ``PermuteForRope`` picks the tensors it permutes by name (its
    ``permute_layer_names`` searched in the patterns the tensors carry at that point of the chain: the sources, then
    the targets once an operation changed their number); ours takes their positions."""
    names = list(sources)
    translated: list[ops.ConversionOperation] = []
    for operation in operations:
        kind = type(operation)
        if kind is _hf("PermuteForRope"):
            translated.append(_permute_for_rope(operation, names))
        elif kind is _hf("VisionFuseAndPermuteForRope"):
            translated += [
                _permute_for_rope(operation.permute_op, names),
                ops.Concatenate(operation.dim, equal_parts=True),
            ]
        elif kind is _hf("VisionUnfuseAndPermuteForRope"):
            translated += [ops.Chunk(operation.dim), _permute_for_rope(operation.permute_op, list(targets))]
        elif kind in _OPERATIONS:
            translated.append(_OPERATIONS[kind](operation))
        else:
            raise ConversionError(
                f"Cannot translate transformers' operation {kind.__name__} in the conversion mapping of {owner!r}."
            )
        if kind not in _PER_TENSOR:
            names = list(targets)
    return translated


def _permute_for_rope(operation: Any, names: Sequence[str]) -> ops.PermuteForRope:
    selected = operation.permute_layer_names
    slots = None if selected is None else tuple(i for i, name in enumerate(names) if any(s in name for s in selected))
    return ops.PermuteForRope(inverse=operation.inverse, slots=slots, subconfig_key=operation.subconfig_key)


def _parts(operation: Any) -> dict[str, Any]:
    # The config attribute naming how many parts a tensor holds (5.16 added it: before, no mapping has one).
    attribute = getattr(operation, "num_shards_attribute", None)
    return {} if attribute is None else {"indexed": True, "parts_attribute": attribute}


_OPERATIONS: dict[type, Callable[[Any], ops.ConversionOperation]] = {
    # Concatenate reverses as an equal Chunk in transformers; ours records the real sizes when it loads, and falls
    # back to equal parts (what stock writes) only for a model that was never loaded.
    _hf("Concatenate"): lambda op: ops.Concatenate(op.dim, equal_parts=True, **_parts(op)),
    _hf("Chunk"): lambda op: ops.Chunk(op.dim, **_parts(op)),
    _hf("Split"): lambda op: ops.Split(op.dim),
    _hf("MergeModulelist"): lambda op: ops.MergeModulelist(op.dim),
    _hf("SplitModulelist"): lambda op: ops.SplitModulelist(op.dim),
    _hf("Transpose"): lambda op: ops.Transpose(op.dim0, op.dim1, check_dims=op.check_dims),
    _hf("Interleave"): lambda op: ops.Interleave(op.dim, op.inverse),
    _hf("Conv3dToLinear"): lambda op: ops.Conv3dToLinear(kernel_shape=(op.in_channels, *op.kernel_size)),
    _hf("LinearToConv3d"): lambda op: ops.LinearToConv3d(kernel_shape=(op.in_channels, *op.kernel_size)),
    _hf("ErnieFuseAndSplitTextVisionExperts"): lambda op: ops.FuseExpertGroups(op.stack_dim, op.concat_dim),
    _hf("ErnieSplitAndDecoupleTextVisionExperts"): lambda op: ops.SplitExpertGroups(op.stack_dim, op.concat_dim),
    # The message queries of Inkling2Loop (5.24): [query, mlp] and [key, value] rows per loop layer -> one
    # (loop layers, 4, hidden) tensor of [query, key, value, mlp].
    _hf("Inkling2LoopMergeMessageQueries"): lambda op: ops.MergeRowGroups((2, 2), (0, 2, 3, 1), inverse=op.inverse),
    # Inkling2Loop's experts (5.24): a weight alone passes (what save_pretrained writes); NVFP4 / MXFP8 experts with
    # their scales (the original checkpoints) are refused by name, not dequantized.
    _hf("Inkling2LoopDequantizeExperts"): lambda op: ops.WithoutCompanions(companions=3, format="NVFP4 / MXFP8 scale"),
    # The unembedding stored padded to `vocab_size` rows (transformers 5.24); its sizes come from the text config.
    _hf("Inkling2UnpadVocab"): lambda op: ops.Unpad(
        0, size_attribute="unpadded_vocab_size", padded_size_attribute="vocab_size", inverse=op.inverse
    ),
}
# Operations that take a weight and the optional companions a quantized format keeps beside it.
_COMPANIONS = {_hf("Inkling2LoopDequantizeExperts")}
# Operations that keep one tensor per pattern, so the tensors keep the patterns' names after them.
_PER_TENSOR = {
    _hf(name)
    for name in (
        "PermuteForRope",
        "Transpose",
        "Interleave",
        "Conv3dToLinear",
        "LinearToConv3d",
        "MergeModulelist",
        "Inkling2UnpadVocab",
    )
}


class _TransformersMappings:
    """transformers' registry as the conversion registry's provider of built-in mappings."""

    def keys(self) -> set[str]:
        return builtin_keys()

    def mapping(self, key: str) -> list[WeightTransform] | None:
        return builtin_mapping(key)

    def translate(self, items: Iterable[object], owner: str) -> list[WeightTransform]:
        return translate(items, owner)


registry.set_builtin_mappings(_TransformersMappings())


def _user_registered(key: str) -> bool:
    return key in registry.conversion_registry.snapshot() or user_registered_in_transformers(key)


def model_conversions(model: nn.Module) -> list[WeightTransform]:
    """The transforms of ``model`` and of its sub-models, as stock transformers collects them, configured with the
    model's config (head counts, numbers of parts).

    Each ``PreTrainedModel`` in the tree is looked up by class name, then by model type (as transformers'
    ``get_model_conversion_mapping`` does). A sub-model whose class or model type an ancestor already matched is
    skipped; the transforms of any other sub-model only apply to keys under its prefix. Custom code (a class outside
    transformers) gets only what was registered explicitly. The ``"legacy"`` renamings are not part of it (see
    :func:`~modelpatch.conversion.registry.legacy_conversions`).
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
        found = registry.get_checkpoint_conversion_mapping(class_name)
        by_class = found is not None
        if not by_class:
            if not model_type or claimed_above(model_type, name):
                continue
            found = registry.get_checkpoint_conversion_mapping(model_type)
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
