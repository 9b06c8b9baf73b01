"""The plain settings a module computes with: the attributes that are neither tensors nor modules (a head size, a
scaling, GPT-OSS's gate ``limit``), which a fused module takes from the config it is built from.

A live ``fuse`` / ``unfuse`` builds the new modules from the model's config, so a setting changed on the live module
after it was built (``attn.scaling = ...``, ``experts.limit = ...``) would silently be lost; the restructuring compares
the two modules' settings first and refuses a difference by name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch import nn

# The values compared: what a module's constructor derives from its config. Anything else (a function, a config
# object, a tensor) is left aside.
_PLAIN = (bool, int, float, str, type(None))


def _plain(value: object) -> bool:
    if isinstance(value, tuple):
        return all(_plain(item) for item in value)
    return isinstance(value, _PLAIN)


def plain_settings(owner: object) -> dict[str, object]:
    """The public plain attributes of ``owner`` (a module or a namespace), ``training`` aside."""
    attributes: Mapping[str, Any] = vars(owner)
    return {
        name: value
        for name, value in attributes.items()
        if not name.startswith("_") and name != "training" and _plain(value)
    }


def computing_settings(module: nn.Module) -> dict[str, object]:
    """The settings ``module`` computes with, under its stock class's names: what the module says
    (``computing_settings()``, for a fused module that keeps them elsewhere, e.g. in its experts' gate), else its own
    plain attributes."""
    own = getattr(module, "computing_settings", None)
    return dict(own()) if callable(own) else plain_settings(module)


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def settings_differences(name: str, live: nn.Module, built: nn.Module) -> list[str]:
    """Each setting both modules have whose values differ, as ``"<name>.<setting> is <live> (its config builds
    <built>)"``."""
    ours, theirs = computing_settings(live), computing_settings(built)
    return [
        f"{name}.{key} is {ours[key]!r} (its config builds {theirs[key]!r})"
        for key in sorted(ours.keys() & theirs.keys())
        if not _same(ours[key], theirs[key])
    ]
