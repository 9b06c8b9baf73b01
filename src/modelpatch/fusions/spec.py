"""``ModuleFusionSpec``: how one fusion family finds, replaces and converts the modules it fuses, and the typed
options (``FusionOptions``) a family may take from ``fusion_config={name: {...}}``."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar

from torch import nn
from transformers import PretrainedConfig

from ..conversion.transforms import WeightTransform
from .sharding import TensorParallelLayout


class ModulesToFuse(dict[str, nn.Module]):
    """What :meth:`ModuleFusionSpec.make_transforms` gets: the dotted runtime name of each module to fuse -> its
    meta-device instance, and the root model's ``base_model_prefix`` (a checkpoint may name every module with that
    prefix removed or added, as stock loads allow)."""

    def __init__(self, modules: Mapping[str, nn.Module] = MappingProxyType({}), base_model_prefix: str = ""):
        super().__init__(modules)
        self.base_model_prefix = base_model_prefix

    def key_space_names(self, name: str) -> list[str]:
        """``name`` and its other spelling in a checkpoint: without the base model's prefix, or with it."""
        prefix = self.base_model_prefix
        if not prefix:
            return [name]
        return [
            name,
            name[len(prefix) + 1 :] if name.startswith(f"{prefix}.") else f"{prefix}.{name}" if name else prefix,
        ]


@dataclasses.dataclass(frozen=True)
class FusionOptions:
    """Base of a family's options: a frozen dataclass whose fields are the option names.

    Subclasses validate their values in ``__post_init__`` (raising ``TypeError`` or ``ValueError``).

    Attributes:
        strict: Every family's option: a candidate the family leaves as it is (and a load that the fusion cannot
            apply to) is a :class:`~modelpatch.errors.FusionError` naming the modules and reasons, instead of an INFO
            line and a load without it.
    """

    strict: bool = dataclasses.field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.strict, bool):
            raise TypeError(f"strict must be True or False, got {self.strict!r}.")

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> FusionOptions:
        """The options ``fusion_config`` gives as a dict; an unknown name is a ``ValueError`` naming the allowed."""
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ValueError(
                f"unknown option(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(allowed) or 'none'}."
            )
        return cls(**options)


# Guards each spec's cache of configured copies (loads run in parallel threads).
_configured_lock = threading.Lock()

# Each hook's parameters after ``self``: the one signature the fusion code calls it with.
_HOOKS = {
    "is_fusable": ("module",),
    "is_candidate": ("module",),
    "unfusable_reason": ("module",),
    "make_fused_class": ("original_cls",),
    "make_transforms": ("config", "modules"),
    "finish_module": ("module",),
    "tensor_parallel_layout": ("module", "rules", "ranks"),
    "finish_tensor_parallel": ("module", "layout", "ranks"),
}


class ModuleFusionSpec(ABC):
    """Describe a fusion family. Subclass it, implement the abstract hooks, then :func:`modelpatch.register_fusion` it.

    Discovery builds the model on the meta device, keeps the modules whose dotted name matches one of
    ``target_modules_patterns`` (all modules when it is empty) and for which :meth:`is_fusable` is true, and maps each
    such class to ``make_fused_class(cls)``. Every instance of a class must be fusable for the class to be fused,
    unless the family's fused class decides per instance (``per_instance``). Candidates (:meth:`is_candidate`) left
    as they are are reported once each, at INFO, with :meth:`unfusable_reason`.

    Attributes:
        target_modules_patterns: Optional regexes (``re.search``) pre-filtering candidate module names.
        filtered_conversion_patterns: Regexes dropping the model type's own conversions that the fused layout
            replaces (matched against their source and target patterns, like ``Patcher``'s filter).
        options_class: The family's :class:`FusionOptions` subclass (:class:`FusionOptions` itself: ``strict``
            alone; None: no options at all).
        options: This instance's options (None: the defaults, or a family without options); see :meth:`configure`.
        per_instance: Whether the fused class decides per instance: its ``__init__`` leaves an instance for which
            :meth:`unfusable_reason` is not None as the original class (then discovery fuses the fusable instances of a
            class and leaves the others as they are, instead of leaving the whole class).
        reads_runtime_names: Whether the family's converters read the modules' tensors under their runtime names
            alone: then a module holding a tensor that the model's own converter makes from another checkpoint
            layout (a ``Wqkv`` split into q/k/v) is left as it is, since a converter does not chain after another.
    """

    target_modules_patterns: Sequence[str] = ()
    filtered_conversion_patterns: Sequence[str] = ()
    options_class: ClassVar[type[FusionOptions] | None] = FusionOptions
    options: FusionOptions | None = None
    per_instance: ClassVar[bool] = False
    reads_runtime_names: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A hook with another signature would fail deep inside a load (or be called wrongly): say so at definition.
        for hook, parameters in _HOOKS.items():
            function = cls.__dict__.get(hook)
            if function is None:
                continue
            names = tuple(inspect.signature(function).parameters)[1:]
            if len(names) != len(parameters):
                raise TypeError(
                    f"{cls.__qualname__}.{hook} must take ({', '.join(parameters)}) after self, "
                    f"got ({', '.join(names)})."
                )

    def _state(self) -> dict[str, Any]:
        # What configures this instance: its attributes, minus modelpatch's caches.
        return {k: v for k, v in vars(self).items() if not k.startswith("_modelpatch_")}

    def __eq__(self, other: object) -> bool:
        """Specs of one class with equal options and attributes are one fusion: they generate the same classes (an
        unpickled spec finds the classes its original made)."""
        return type(other) is type(self) and self._state() == other._state()

    def __hash__(self) -> int:
        return hash((type(self), self.options))

    @abstractmethod
    def is_fusable(self, module: nn.Module) -> bool:
        """Whether ``module`` (a meta-device instance) can be fused."""

    def is_candidate(self, module: nn.Module) -> bool:
        """Whether ``module`` is one of the modules this family is about (an attention with q/k/v projections, say),
        fusable or not: discovery reports each candidate it leaves as it is. Default: the fusable ones only."""
        return self.is_fusable(module)

    @property
    def strict(self) -> bool:
        """The ``strict`` option (see :class:`FusionOptions`)."""
        return isinstance(self.options, FusionOptions) and self.options.strict

    def unfusable_reason(self, module: nn.Module) -> str | None:
        """Why ``module`` (a meta-device instance) cannot be fused, or None when it can.

        Discovery reports this reason (class, module path, reason) when it leaves a candidate as it is. Override it
        to say *what* the family does not know about the module (an extra norm, a bias, a layout); the default only
        restates :meth:`is_fusable`.
        """
        return None if self.is_fusable(module) else f"{type(self).__name__}.is_fusable() is false for it"

    @abstractmethod
    def make_fused_class(self, original_cls: type[nn.Module]) -> type[nn.Module]:
        """The runtime replacement of ``original_cls``; it is constructed with the original's arguments."""

    def make_transforms(self, config: PretrainedConfig, modules: Mapping[str, nn.Module]) -> list[WeightTransform]:
        """Transforms from the checkpoint layout to the fused runtime layout (default: none needed).

        ``modules`` maps the dotted runtime name of every module that will be fused to its meta-device instance
        (empty when nothing is known about them).
        """
        return []

    def finish_module(self, module: nn.Module) -> None:  # noqa: B027 - an optional hook, a no-op by default
        """Called on each fused module once it holds its final tensors (after a load or a live fuse); default:
        nothing. For modules that lay their loaded tensors out for speed."""

    def runtime_key_parts(self) -> Sequence[tuple[tuple[str, ...], str]]:
        """``(part names, fused name)`` for each way this family renames checkpoint keys in its runtime layout
        (``(("q_proj", "k_proj", "v_proj"), "qkv_proj")``): how the load's diagnostics recognise a checkpoint saved
        in that layout (``save_original_format=False``) and name the fusion to load it with. Default: none."""
        return ()

    def tensor_parallel_layout(
        self, module: nn.Module, rules: Mapping[str, str], ranks: int
    ) -> TensorParallelLayout | None:
        """How the fused ``module`` (an instance this spec made) splits over ``ranks`` tensor-parallel ranks.

        ``rules`` are the model's TP plan rules at or under ``module``, named relative to it (``""`` for the module
        itself; layer numbers as ``*``), with transformers' style names (``"colwise"``, ``"rowwise"``, ...): the plan
        of the stock modules it replaced, which the layout translates. Raise
        :class:`~modelpatch.errors.TensorParallelError` for rules the fused module cannot follow.

        Default: None, the plan is left as it is: its rules for modules the fusion removed name nothing any more,
        so the fused module's own tensors stay whole on every rank (replicated), and it computes what it computes
        unsharded.
        """
        return None

    def finish_tensor_parallel(  # noqa: B027 - an optional hook, a no-op by default
        self, module: nn.Module, layout: TensorParallelLayout, ranks: int
    ) -> None:
        """Called on each fused module once tensor parallelism sharded it by ``layout`` (this spec's
        :meth:`tensor_parallel_layout`); default: nothing. For modules whose forward reads sizes that sharding
        changed (a projection slice's part sizes)."""

    def validate_options(self, options: Mapping[str, Any]) -> FusionOptions | None:
        """The typed options of ``fusion_config={name: options}``; ``TypeError`` / ``ValueError`` for unknown or
        invalid ones (a family without ``options_class`` takes none)."""
        if self.options_class is None:
            if options:
                raise ValueError(f"{type(self).__name__} takes no options, got {dict(options)!r}.")
            return None
        return self.options_class.from_mapping(options)

    def configure(self, options: Mapping[str, Any] | None) -> ModuleFusionSpec:
        """This spec with ``options`` (validated): itself when they are the defaults, else a copy holding them, the
        same copy for equal options (the classes a spec generates are cached per spec, equal specs being one).
        """
        typed = self.validate_options(options or {})
        if typed is None or typed == self.options_class():  # type: ignore[misc]
            return self
        with _configured_lock:
            configured = self.__dict__.setdefault("_modelpatch_configured", {})
            if typed not in configured:
                spec = copy.copy(self)
                spec.__dict__.pop("_modelpatch_configured", None)
                spec.options = typed
                configured[typed] = spec
            return configured[typed]
