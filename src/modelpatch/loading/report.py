"""What a load did, kept on the model for inspection and for saving back to the checkpoint's layout."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..conversion.planner import ConversionGroup
from ..conversion.transforms import WeightTransform

if TYPE_CHECKING:  # plan.py's users import this module
    from .plan import LoadPlan


@dataclass(frozen=True)
class LoadReport:
    """The outcome of :func:`modelpatch.from_pretrained`.

    Attributes:
        source: The checkpoint directory.
        checkpoint_keys: Every key of the source checkpoint.
        direct: Runtime key -> the checkpoint key it was read from unchanged (possibly renamed).
        groups: Converted groups, with operations bound to the checkpoint's shapes (their reverse is exact).
        transforms: The transforms the load used (model type mapping, Patcher adjustments, fusions).
        new_parameters: Parameters initialised freshly because the caller asked for them.
        dropped: Checkpoint keys dropped quietly because the model recomputes them (non-persistent buffers such as
            ``position_ids``).
        ignored: Checkpoint keys dropped quietly because the model class declares them ignorable
            (``_keys_to_ignore_on_load_unexpected``); unlike ``dropped`` they may be real weights (an MTP layer).
        unexpected: Checkpoint keys the model has no place for.
        tied: Tied parameter -> the parameter it shares storage with.
        runtime_layout: The checkpoint was saved in the runtime layout; ``transforms`` were not applied at load and
            are what turns it back into the original layout.
        replaced: Class name -> ``(key, replacement)`` for every class the build replaced: the Patcher, fusion or
            registry key that decided it (a fused class's key is its own name) and the replacement's qualified name.
    """

    source: Path
    checkpoint_keys: tuple[str, ...]
    direct: Mapping[str, str]
    groups: tuple[ConversionGroup, ...]
    transforms: tuple[WeightTransform, ...]
    new_parameters: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    tied: Mapping[str, str] = field(default_factory=dict)
    runtime_layout: bool = False
    replaced: Mapping[str, tuple[str, str]] = field(default_factory=dict)

    @classmethod
    def from_plan(cls, plan: LoadPlan) -> LoadReport:
        """What executing ``plan`` loads: the record a save of the loaded model reverses."""
        return cls(
            source=plan.directory,
            checkpoint_keys=tuple(plan.checkpoint),
            direct={k: v for k, v in plan.conversion.direct.items() if k in plan.expected},
            groups=tuple(plan.conversion.groups),
            transforms=tuple(plan.transforms if plan.runtime_layout else plan.used_transforms),
            new_parameters=tuple(plan.new_parameters),
            dropped=tuple(plan.dropped),
            ignored=tuple(plan.ignored),
            unexpected=tuple(plan.unexpected),
            tied=dict(plan.tied),
            runtime_layout=plan.runtime_layout,
            replaced=plan.replaced,
        )

    @property
    def converted(self) -> dict[str, list[str]]:
        """Runtime key -> the checkpoint keys it was built from, for every converted parameter."""
        return {target: group.source_keys() for group in self.groups for target in group.target_keys()}

    def loading_info(self) -> dict[str, Any]:
        """What transformers' ``from_pretrained(..., output_loading_info=True)`` returns beside the model.

        ``missing_keys`` are the parameters initialised freshly (tied ones are not missing, as in stock); no key is
        ever mismatched or in error, since such a load is refused before any tensor is read.
        """
        return {
            "missing_keys": set(self.new_parameters),
            "unexpected_keys": set(self.unexpected),
            "mismatched_keys": set(),
            "error_msgs": [],
        }

    def summary(self) -> str:
        """A few human-readable lines."""
        renamed = sum(1 for runtime, source in self.direct.items() if runtime != source)
        return "\n".join(
            [
                f"loaded from {self.source}: {len(self.checkpoint_keys)} checkpoint tensors",
                f"  unchanged: {len(self.direct) - renamed}, renamed: {renamed}, converted groups: {len(self.groups)}",
                f"  tied: {len(self.tied)}, new parameters: {len(self.new_parameters)}, "
                f"dropped: {len(self.dropped)}, ignored: {len(self.ignored)}, unexpected: {len(self.unexpected)}",
            ]
        )
