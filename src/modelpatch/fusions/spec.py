"""``ModuleFusionSpec``: how one fusion family finds, replaces and converts the modules it fuses."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn
from transformers import PretrainedConfig

from ..conversion.transforms import WeightTransform


class ModuleFusionSpec:
    """Describe a fusion family. Subclass it and override the hooks, then :func:`modelpatch.register_fusion` it.

    Discovery builds the model on the meta device, keeps the modules whose dotted name matches one of
    ``target_modules_patterns`` (all modules when it is empty) and for which :meth:`is_fusable` is true, and maps each
    such class to ``make_fused_class(cls)``. Every instance of a class must be fusable for the class to be fused.

    Attributes:
        target_modules_patterns: Optional regexes (``re.search``) pre-filtering candidate module names.
        filtered_conversion_patterns: Regexes dropping the model type's own conversions that the fused layout
            replaces (matched against their source and target patterns, like ``Patcher``'s filter).
    """

    target_modules_patterns: Sequence[str] = ()
    filtered_conversion_patterns: Sequence[str] = ()

    def is_fusable(self, module: nn.Module) -> bool:
        """Whether ``module`` (a meta-device instance) can be fused."""
        raise NotImplementedError

    def make_fused_class(self, original_cls: type[nn.Module]) -> type[nn.Module]:
        """The runtime replacement of ``original_cls``; it is constructed with the original's arguments."""
        raise NotImplementedError

    def make_transforms(
        self, config: PretrainedConfig, modules: Mapping[str, nn.Module] | None = None
    ) -> list[WeightTransform]:
        """Transforms from the checkpoint layout to the fused runtime layout (default: none needed).

        ``modules`` maps the dotted runtime name of every module that will be fused to its meta-device instance.
        """
        return []

    def validate_options(self, options: Mapping[str, Any]) -> None:
        """Reject unknown or invalid options given as ``fusion_config={name: {...}}`` (default: accept none)."""
        if options:
            raise ValueError(f"{type(self).__name__} takes no options, got {dict(options)!r}.")
