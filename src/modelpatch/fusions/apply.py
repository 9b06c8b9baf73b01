"""Turn a ``fusion_config`` into what one load needs: a patch mapping, weight transforms and conversion filters.

Fusions are scoped to the load that asks for them: the mapping is one more patch layer of that load, never a
global registration, so a later load without the fusion builds stock classes.
"""

from __future__ import annotations

import copy
import logging
import re
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from .._transformers import tied_weight_keys
from .._transformers_mapping import model_conversions
from ..conversion.registry import as_transforms
from ..conversion.transforms import WeightConverter, WeightTransform, compile_user_pattern
from ..errors import FusionError
from ..patching.candidates import is_patch_candidate
from ..patching.mapping import PatchMapping
from ..patching.patcher import Patcher
from ..state import is_runtime_layout, record_fusion_config, stored_fusion_config
from .registry import available_fusions, get_fusion
from .spec import ModuleFusionSpec, ModulesToFuse

logger = logging.getLogger(__name__)


@dataclass
class PreparedFusions:
    """The fusions of one load."""

    config: dict[str, Any] = field(default_factory=dict)
    mapping: PatchMapping = field(default_factory=PatchMapping)
    transforms: list[WeightTransform] = field(default_factory=list)
    filters: tuple[re.Pattern[str], ...] = ()
    fused: dict[str, list[str]] = field(default_factory=dict)
    specs: dict[str, ModuleFusionSpec] = field(default_factory=dict)

    def fused_modules(self) -> dict[str, ModuleFusionSpec]:
        """Each fused module's dotted name -> the spec (with its options) that fused it."""
        return {path: self.specs[name] for name, paths in self.fused.items() for path in paths}

    def adjust_conversions(self, conversions: Sequence[WeightTransform]) -> list[WeightTransform]:
        """Fusion transforms first, then ``conversions`` minus those the fused layout replaces."""
        return [*self.transforms, *(t for t in conversions if not t.filtered_by(self.filters))]

    def record(self, model: PreTrainedModel) -> None:
        """Persist the fusion config on the model's config (``save_pretrained`` writes it to config.json)."""
        record_fusion_config(model.config, copy.deepcopy(self.config))


def normalize_fusion_config(fusion_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validate names and options; return ``{name: False | True | options dict}``."""
    if fusion_config is None:
        return {}
    if not isinstance(fusion_config, Mapping):
        raise FusionError(f"fusion_config must be a dict of fusion name -> True/False/options, got {fusion_config!r}.")
    normalized: dict[str, Any] = {}
    for name, value in fusion_config.items():
        if name not in available_fusions():
            raise FusionError(f"Unknown fusion {name!r}; available fusions: {', '.join(available_fusions())}.")
        if isinstance(value, bool):
            normalized[name] = value
        elif isinstance(value, Mapping):
            try:
                get_fusion(name).validate_options(value)
            except (TypeError, ValueError) as exc:
                raise FusionError(f"Invalid options for fusion {name!r}: {exc}") from None
            normalized[name] = dict(value)
        else:
            raise FusionError(f"fusion_config[{name!r}] must be True, False or an options dict, got {value!r}.")
    return normalized


def _enabled(normalized: Mapping[str, Any]) -> set[str]:
    return {name for name, value in normalized.items() if value is not False}


def _stored_fusions(config: PretrainedConfig) -> Any:
    """The fusion config stored with a checkpoint, minus fusions this process does not know when that is safe.

    A checkpoint in the original layout needs no fusion code to load (its tensors are the stock model's), so a
    fusion someone else registered under a name unknown here is skipped with a warning. A runtime-layout checkpoint
    holds that fusion's tensors and cannot be loaded without it: the error names it and how to make it available.
    """
    stored = stored_fusion_config(config)
    if not isinstance(stored, Mapping):
        return stored
    unknown = [name for name in stored if name not in available_fusions()]
    if not unknown:
        return stored
    if is_runtime_layout(config):
        raise FusionError(
            f"The checkpoint is stored in the runtime layout of fusion(s) {', '.join(map(repr, unknown))}, which this "
            "process does not have. Import the code that defines them and register them with "
            "modelpatch.register_fusion(name, spec) before loading; "
            f"available fusions: {', '.join(available_fusions())}."
        )
    logger.warning(
        "The checkpoint was saved with fusion(s) %s, which this process does not have; its tensors are in the original "
        "layout, so it loads without them.",
        ", ".join(map(repr, unknown)),
    )
    return {name: value for name, value in stored.items() if name not in unknown}


def spec_transforms(
    spec: ModuleFusionSpec, config: PretrainedConfig, modules: Mapping[str, nn.Module], base_model_prefix: str = ""
) -> list[WeightTransform]:
    """``spec.make_transforms`` for ``modules`` (unfused instances by name) of a model whose ``base_model_prefix``
    is given (see :class:`ModulesToFuse`). A spec may return transformers' own transforms: they enter here, and are
    translated."""
    transforms = spec.make_transforms(config, ModulesToFuse(modules, base_model_prefix))
    return as_transforms(transforms, f"{type(spec).__name__}.make_transforms")


@dataclass(frozen=True)
class LeftUnfused:
    """A candidate module a fusion leaves as it is, and why."""

    fusion: str
    path: str
    class_name: str
    reason: str


@dataclass
class Discovery:
    """What discovery found: the fused class of each class (by name), the modules fused per fusion (dotted name ->
    meta instance), and the candidates left as they are per fusion."""

    mapping: dict[str, type[nn.Module]] = field(default_factory=dict)
    modules: dict[str, dict[str, nn.Module]] = field(default_factory=dict)
    unfused: dict[str, list[LeftUnfused]] = field(default_factory=dict)


def _converted_state(
    path: str, module: nn.Module, conversions: Sequence[WeightTransform], spec: ModuleFusionSpec
) -> str | None:
    """Why ``module``'s tensors cannot come to the fusion's transforms as they are: one of them is the target of a
    converter of the model (its checkpoint stores it otherwise, a fused ``Wqkv`` say), which the fusion's filters do
    not drop. A fusion's converter reads checkpoint keys; it does not chain after another converter."""
    filters = _compiled(spec.filtered_conversion_patterns, "filtered_conversion_patterns")
    for key in module.state_dict(prefix=f"{path}." if path else ""):
        for transform in conversions:
            if not isinstance(transform, WeightConverter) or transform.match_target(key) is None:
                continue
            if transform.filtered_by(filters):
                continue
            return (
                f"its {key.rpartition('.')[0][len(path) + 1 :] or key} comes from the model's conversion of "
                f"{list(transform.source_patterns)} (the checkpoint stores it in another layout), which a fusion's "
                "converter cannot follow"
            )
    return None


def _compiled(patterns: Sequence[str], what: str) -> list[re.Pattern[str]]:
    """A fusion spec's ``patterns`` (its ``what``) compiled; a bad one is a FusionError naming it."""
    return [compile_user_pattern(p, what, FusionError) for p in patterns]


def _tied_state(path: str, tied: Mapping[str, str]) -> str | None:
    head = f"{path}." if path else ""
    for target, source in tied.items():
        if target.startswith(head) or source.startswith(head):
            return f"{target} is tied to {source}, which a fused tensor cannot share"
    return None


def discover(
    model: nn.Module,
    specs: Mapping[str, ModuleFusionSpec],
    conversions: Sequence[WeightTransform] = (),
    tied: Mapping[str, str] | None = None,
    replaceable: Callable[[type], bool] | None = None,
) -> Discovery:
    """Map each fusable class of ``model`` (a meta-device instance) to its fused class, per spec, and say why each
    candidate left as it is is left.

    A fusion replaces a class wherever it is built. For a spec whose fused class decides per instance
    (``per_instance``), the fusable instances of a class are fused and the others stay instances of the original
    class; otherwise a class is fused only when *every* instance of it is a candidate and fusable. Either way, a
    class is left whole when an instance that would be fused is outside ``target_modules_patterns``, holds a tensor
    tied to another, or (for a spec that ``reads_runtime_names``) a tensor that ``conversions`` (the model's own)
    produce from another checkpoint layout: those instances could not load. So is a class for which
    ``replaceable`` (a load: whether its constructions are dispatched) is false.
    """
    instances, aliases, namesakes = _module_index(model)
    tied = tied or {}
    found = Discovery(modules={name: {} for name in specs}, unfused={name: [] for name in specs})
    owner: dict[str, str] = {}
    for name, spec in specs.items():
        targets = _compiled(spec.target_modules_patterns, "target_modules_patterns")
        for cls, members in instances.items():
            reasons = _unfusable_reasons(spec, members, targets)
            fusable = [(path, module) for path, module in members if reasons[path] is None]
            candidates = [(path, m) for path, m in members if reasons[path] is not None and spec.is_candidate(m)]
            blocker = None
            if fusable:
                blocker = _class_blocker(spec, cls, members, reasons, len(fusable), targets, replaceable, namesakes)
                blocker = blocker or _instance_blocker(spec, fusable, tied, conversions)
            if blocker is not None:
                candidates = [(path, m) for path, m in members if reasons[path] is None or spec.is_candidate(m)]
                reasons = {path: reason or blocker for path, reason in reasons.items()}
                fusable = []
            found.unfused[name] += [LeftUnfused(name, p, cls.__name__, reasons[p] or "") for p, _ in candidates]
            if not fusable:
                continue
            if cls.__name__ in owner:
                raise FusionError(
                    f"Fusions {owner[cls.__name__]!r} and {name!r} both want to replace {cls.__name__}; enable one."
                )
            owner[cls.__name__] = name
            found.mapping[cls.__name__] = spec.make_fused_class(cls)
            for _, module in fusable:
                for alias in aliases[id(module)]:
                    found.modules[name][alias] = module
    return found


_Members = list[tuple[str, nn.Module]]


def _module_index(
    model: nn.Module,
) -> tuple[dict[type, _Members], dict[int, list[str]], dict[str, set[type]]]:
    """The model's modules by class; every name of each module (one held in several places has its tensors saved
    under each); the classes of each class name (a fusion maps a class by its name: another class of the same name,
    another modeling module's, would be built as the fused class too)."""
    instances: dict[type, _Members] = defaultdict(list)
    for module_name, module in model.named_modules():
        instances[type(module)].append((module_name, module))
    aliases: dict[int, list[str]] = defaultdict(list)
    for module_name, module in model.named_modules(remove_duplicate=False):
        aliases[id(module)].append(module_name)
    namesakes: dict[str, set[type]] = defaultdict(set)
    for cls in instances:
        namesakes[cls.__name__].add(cls)
    return instances, aliases, namesakes


def _unfusable_reasons(
    spec: ModuleFusionSpec, members: _Members, targets: Sequence[re.Pattern[str]]
) -> dict[str, str | None]:
    """Why each instance cannot be fused by ``spec`` on its own (None: it can)."""
    reasons: dict[str, str | None] = {}
    for path, module in members:
        if targets and not any(p.search(path) for p in targets):
            reasons[path] = "outside the fusion's target_modules_patterns"
        else:
            reasons[path] = spec.unfusable_reason(module)
    return reasons


def _class_blocker(
    spec: ModuleFusionSpec,
    cls: type,
    members: _Members,
    reasons: Mapping[str, str | None],
    fusable: int,
    targets: Sequence[re.Pattern[str]],
    replaceable: Callable[[type], bool] | None,
    namesakes: Mapping[str, set[type]],
) -> str | None:
    """Why ``cls``, of which ``fusable`` instances could be fused, must be left whole, or None (the last reason of
    these that holds is the one said)."""
    if len(namesakes[cls.__name__]) > 1:
        others = sorted(c.__module__ for c in namesakes[cls.__name__] if c is not cls)
        return f"a class of the same name from {others[0]} is built too, and a fusion maps classes by name"
    if replaceable is not None and not replaceable(cls):
        return (
            f"its class is defined in {cls.__module__}, outside the modeling modules whose constructions a "
            "load replaces (register_patchable_namespace adds a namespace)"
        )
    if spec.per_instance and targets:
        outside = [p for p, m in members if not any(t.search(p) for t in targets) and spec.is_fusable(m)]
        if outside:
            return f"its instance {outside[0]!r} is outside the fusion's target_modules_patterns"
    if not spec.per_instance and fusable < len(members):
        path = next(p for p, _ in members if reasons[p] is not None)
        return f"its instance {path!r} is not fusable ({reasons[path]}), and every instance of a fused class is"
    return None


def _instance_blocker(
    spec: ModuleFusionSpec, fusable: _Members, tied: Mapping[str, str], conversions: Sequence[WeightTransform]
) -> str | None:
    """Why an instance that would be fused could not load fused (a tied tensor, or one the model's conversions
    produce from another layout), which leaves its whole class; or None."""
    for path, module in fusable:
        blocker = _tied_state(path, tied)
        if blocker is None and spec.reads_runtime_names:
            blocker = _converted_state(path, module, conversions, spec)
        if blocker is not None:
            return blocker
    return None


def _report_unfused(name: str, spec: ModuleFusionSpec, found: Discovery, model_name: str) -> None:
    """Say once, at INFO, which candidates ``name`` leaves as they are and why (grouped by class and reason); under
    ``strict``, refuse instead."""
    left = found.unfused[name]
    grouped: dict[tuple[str, str], list[str]] = defaultdict(list)
    for item in left:
        grouped[(item.class_name, item.reason)].append(item.path or "<the model>")
    lines = [f"{cls} at {', '.join(paths)} as it is: {reason}" for (cls, reason), paths in grouped.items()]
    if spec.strict and left:
        raise FusionError(
            f"Fusion {name!r} (strict) would leave {len(left)} module(s) of {model_name} unfused:\n"
            + "\n".join(f"  - {line}" for line in lines)
            + f"\nLoad without strict to fuse the others and leave these as they are, or without {name!r}."
        )
    if not found.modules[name]:
        logger.info(
            "Fusion %r found nothing to fuse in %s%s",
            name,
            model_name,
            (": it leaves " + "; ".join(lines)) if lines else " (no candidate module).",
        )
        return
    for line in lines:
        logger.info("Fusion %r leaves %s.", name, line)


def _check_patch_conflicts(
    fused: Mapping[type[nn.Module], str], base_layers: Sequence[PatchMapping], patcher: Patcher | None
) -> None:
    """Refuse to fuse a class (``fused``: class -> fusion name) that a Patcher or registry entry also patches.

    A class takes one replacement per load, and a replacement is never replaced again: left alone, the fusion would
    silently not apply (or apply inside a wrapper) while its weight conversions still run, and the load would fail
    blaming the checkpoint.
    """
    for layer in base_layers:
        source = "the Patcher" if patcher is not None and layer is patcher.mapping else "the global patch registry"
        for cls, fusion in fused.items():
            if (found := layer.match(cls.__name__)) is not None:
                key, replacement = found
                raise FusionError(
                    f"Fusion {fusion!r} and {source} both replace {cls.__name__} ({source}'s key {key!r} -> "
                    f"{replacement.__qualname__}); a class takes one replacement per load: drop one of them."
                )
            keys = [key for key, replacement in layer.entries.items() if replacement is cls]
            if keys:
                raise FusionError(
                    f"Fusion {fusion!r} would replace {cls.__name__}, which {source} builds in place of what its key "
                    f"{keys[0]!r} matches; a replacement is never replaced again, so the fusion cannot apply: drop "
                    "one of them."
                )


def _check_shadowed_conversions(
    fusion_transforms: Sequence[tuple[str, WeightTransform]],
    user_transforms: Sequence[tuple[str, WeightTransform]],
    keys: Sequence[str],
) -> None:
    """Refuse a user converter for a weight that a fusion converts: only one of the two could run on it, silently."""
    for key in keys:
        fusion_hit = next(((n, t) for n, t in fusion_transforms if t.match_source(key) is not None), None)
        if fusion_hit is None:
            continue
        for source, transform in user_transforms:
            if isinstance(transform, WeightConverter) and transform.match_source(key) is not None:
                raise FusionError(
                    f"{transform!r} from {source} and fusion {fusion_hit[0]!r}'s {fusion_hit[1]!r} both convert "
                    f"{key!r}; only one of them would run. Drop the converter or the fusion, or filter the "
                    "converter out (Patcher filtered_weight_conversion_patterns)."
                )


def resolve_fusion_config(config: PretrainedConfig, fusion_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The fusions of one load: ``fusion_config`` if given, else the one stored in ``config``; validated, and checked
    against the layout of a runtime-layout checkpoint (which loads only with the fusions it was saved with).

    Raises:
        FusionError: An invalid config, or fusions other than a runtime-layout checkpoint's.
    """
    stored = _stored_fusions(config)
    normalized = normalize_fusion_config(fusion_config if fusion_config is not None else stored)
    if is_runtime_layout(config) and _enabled(normalized) != _enabled(normalize_fusion_config(stored)):
        raise FusionError(
            "The checkpoint is stored in the runtime layout of fusions "
            f"{sorted(_enabled(normalize_fusion_config(stored)))}"
            f"; it cannot be loaded with fusions {sorted(_enabled(normalized))}. Leave fusion_config unset to load it "
            "as stored, or write it back in the original layout first: `modelpatch convert SRC DST --fusion none`."
        )
    return normalized


def has_enabled_fusions(normalized: Mapping[str, Any]) -> bool:
    """Whether a config from :func:`resolve_fusion_config` enables any fusion (only then is discovery needed)."""
    return bool(_enabled(normalized))


def prepare_fusions(
    model: PreTrainedModel,
    config: PretrainedConfig,
    normalized: Mapping[str, Any],
    base_layers: Sequence[PatchMapping],
    patcher: Patcher | None = None,
) -> PreparedFusions:
    """Turn a fusion config (from :func:`resolve_fusion_config`) into a :class:`PreparedFusions` for ``model``.

    ``model`` is the model as the load builds it without fusions: on the meta device, from ``config``, under
    ``base_layers`` alone (the load's other patch layers: the Patcher's mapping, then the registry snapshot).
    Discovery runs over its modules; the caller builds it (the loader, which uses it as the load's model when nothing
    is fused), so this layer never builds models itself. ``patcher`` is the load's Patcher, if any.

    Raises:
        FusionError: A fused class that a Patcher or registry entry patches too, and a Patcher extra conversion or a
            registered conversion of the model type (what the fusions and the Patcher do not filter out) for a weight
            a fusion converts.
    """
    enabled = {
        name: get_fusion(name).configure(value if isinstance(value, Mapping) else None)
        for name, value in normalized.items()
        if value is not False
    }
    prepared = PreparedFusions(config=dict(normalized))
    if not enabled:
        return prepared
    conversions = model_conversions(model)
    # A replacement the other layers build is left to _check_patch_conflicts, which says what to drop.
    replacements = frozenset().union(*(layer.replacements() for layer in base_layers))
    found = discover(
        model,
        enabled,
        conversions,
        tied_weight_keys(model),
        lambda cls: is_patch_candidate(cls) or cls in replacements,
    )
    modules = found.modules
    for name, spec in enabled.items():
        _report_unfused(name, spec, found, type(model).__name__)
    fused_classes = {type(m): name for name, found_modules in modules.items() for m in found_modules.values()}
    _check_patch_conflicts(fused_classes, base_layers, patcher)
    fusion_transforms: list[tuple[str, WeightTransform]] = []
    for name, spec in enabled.items():
        if not modules[name]:
            continue
        prepared.fused[name] = sorted(modules[name])
        prepared.specs[name] = spec
        transforms = spec_transforms(spec, config, modules[name], getattr(model, "base_model_prefix", ""))
        fusion_transforms.extend((name, t) for t in transforms)
        prepared.transforms.extend(transforms)
        prepared.filters += tuple(_compiled(spec.filtered_conversion_patterns, "filtered_conversion_patterns"))
    extras = patcher.extra_weight_conversions if patcher is not None else []
    user_transforms = [("the Patcher's extra_weight_conversions", t) for t in extras]
    # The model type's registered conversions that survive the fusions' filters (adjust_conversions puts the
    # fusion transforms first) and the Patcher's.
    registered = prepared.adjust_conversions(conversions)[len(prepared.transforms) :]
    user_transforms += [
        ("the registered conversion mapping", t) for t in registered if patcher is None or not patcher.filters_out(t)
    ]
    _check_shadowed_conversions(fusion_transforms, user_transforms, list(model.state_dict()))
    # Anchored keys: a patch key is also a pattern, and ``PixtralAttention`` would match ``PixtralAttentionLayer``.
    prepared.mapping = PatchMapping.from_items((f"^{re.escape(k)}$", v) for k, v in found.mapping.items())
    return prepared
