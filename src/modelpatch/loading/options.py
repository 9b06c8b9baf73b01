"""The settings a load is planned from, gathered and validated once from the keywords of the public entry points."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from ..checkpoint import Checkpoint
from ..patching.patcher import Patcher
from .hub import HubOptions

FusionConfig = Mapping[str, bool | Mapping[str, Any]]
UnexpectedKeys = Literal["warn", "error", "ignore"]


@dataclass(frozen=True)
class LoadOptions:
    """What :func:`~modelpatch.from_pretrained`, :func:`~modelpatch.plan_pretrained` and offline conversion plan a
    load from; the keywords of the same names mean the same here. Checked when built, so a bad value is refused
    before anything is read.

    Attributes:
        patcher: Class replacements and conversion adjustments for this load only.
        fusion_config: ``{fusion name: True / False / options}``; None: the one stored in the config.
        dtype: ``"auto"`` / None (the config's dtype, else the checkpoint's), a ``torch.dtype`` or its name.
        new_parameters: Regex patterns of parameters that may be absent from the checkpoint.
        unexpected_keys: What to do with checkpoint keys the model has no place for.
        allow_pickle: Accept ``pytorch_model.bin`` checkpoints.
        allow_external_symlinks: Follow symlinked checkpoint files wherever they lead.
        hub: Where and how a hub repository is resolved.
        quantization_config: Quantize at load, or loading options of a quantized checkpoint.
        device_map: Where the modules go; the quantizer of a quantized checkpoint plans with it.
    """

    patcher: Patcher | None = None
    fusion_config: FusionConfig | None = None
    dtype: torch.dtype | str | None = None
    new_parameters: Sequence[str] = ()
    unexpected_keys: UnexpectedKeys = "warn"
    allow_pickle: bool = False
    allow_external_symlinks: bool = False
    hub: HubOptions = field(default_factory=HubOptions)
    quantization_config: Any = None
    device_map: Any = None

    def __post_init__(self) -> None:
        if self.patcher is not None and not isinstance(self.patcher, Patcher):
            raise TypeError(f"patcher must be a modelpatch.Patcher, got {self.patcher!r}.")
        if self.unexpected_keys not in ("warn", "error", "ignore"):
            raise ValueError(f"unexpected_keys must be 'warn', 'error' or 'ignore', got {self.unexpected_keys!r}.")
        _check_patterns(self.new_parameters)
        # Frozen: a list the caller changes later must not change the options.
        object.__setattr__(self, "new_parameters", tuple(self.new_parameters))

    def open_checkpoint(self, directory: Path) -> Checkpoint:
        """The checkpoint in ``directory``, opened with these options' file permissions (headers validated)."""
        return Checkpoint.open(
            directory, allow_pickle=self.allow_pickle, allow_external_symlinks=self.allow_external_symlinks
        )


def _check_patterns(new_parameters: Sequence[str]) -> None:
    # A bare string would be taken letter by letter: every parameter containing an "e" would be allowed to be new.
    if isinstance(new_parameters, str) or not all(isinstance(p, str) for p in new_parameters):
        raise TypeError(f"new_parameters must be a list of regex patterns, got {new_parameters!r}.")
    for pattern in new_parameters:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"new_parameters entry {pattern!r} is not a valid regular expression: {exc}.") from None
