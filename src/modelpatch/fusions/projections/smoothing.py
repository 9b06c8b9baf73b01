"""llm-compressor's SmoothQuant mappings on fused projections: a mapping that names the parts (``q_proj``,
``k_proj``, ``v_proj`` -> ``input_layernorm``) smooths the fused layer (``qkv_proj``) instead.

SmoothQuant balances every Linear that reads one layernorm's output by one scale per input channel, computed from the
largest weight of all of them together; the parts of a fused layer read that one input. Balancing the fused layer is
therefore the same computation: the largest weight of its rows is the largest of the parts' (a maximum rounds
nothing), and multiplying its columns multiplies each part's rows. Its resolved mappings (llm-compressor keeps each
mapping's Linears as module objects) are rewritten once resolved: every projection slice becomes its fused layer, and
each fused layer is balanced once. That matters beyond the slices, which hold no parameters for llm-compressor's
offloaded updates to write: llm-compressor's own Llama patterns (``re:.*v_proj``, ``re:.*up_proj``, unanchored) also
match ``qkv_proj`` and ``gate_up_proj`` themselves, and balancing a fused layer and its parts would scale each row
twice.

A mapping naming only some parts of a fused layer cannot be folded (scaling the fused layer would scale the other
parts too), nor one smoothing a slice's output: both are refused by name, before any weight changes.

llm-compressor is never imported here. Its SmoothQuant module gets the rewrite when a model with fused projections
is built: at once where the module is already imported, else at its import (a finder placed first on
``sys.meta_path``, which takes itself off again at that import, or when the rewrite is installed by then).
Checked against llmcompressor 0.14.0.1: ``llmcompressor.modifiers.transform.smoothquant.base``,
``SmoothQuantModifier._resolve_mappings(model)`` returning ``SmoothQuantMapping`` objects whose ``balance_layers``
(a list of modules) and ``smooth_layer`` are what its smoothing reads.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from torch import nn

from ..._installs import made
from ...errors import FusionError
from .modules import ProjectionSlice

_SMOOTHQUANT_MODULE = "llmcompressor.modifiers.transform.smoothquant.base"
# Set on the resolution function modelpatch wrapped (the class may be wrapped once per process only).
_FOLDED_MARK = "_modelpatch_folds_fused_projections"


def fold_fused_parts(layers: Sequence[nn.Module], smooth_name: str) -> list[nn.Module]:
    """``layers`` (the Linears one mapping balances) with every projection slice replaced by its fused layer, each
    fused layer once, in the order first met. Refuses, naming them, the slices of a fused layer whose siblings the
    mapping leaves out (and does not name the fused layer itself)."""
    folded: list[nn.Module] = []
    reached: dict[int, list[ProjectionSlice]] = {}
    direct: set[int] = set()
    for layer in layers:
        target = layer.fused if isinstance(layer, ProjectionSlice) else layer
        if isinstance(layer, ProjectionSlice):
            reached.setdefault(id(target), []).append(layer)
        else:
            direct.add(id(layer))
        if all(target is not other for other in folded):
            folded.append(target)
    for key, slices in reached.items():
        named = {part.index for part in slices}
        first = slices[0]
        if key not in direct and len(named) < len(first.part_sizes):
            raise FusionError(
                f"SmoothQuant's mapping for {smooth_name} balances part(s) {sorted(named)} of the fused "
                f"{first.fused_name} ({len(first.part_sizes)} parts), not all of them: balancing the fused layer "
                "would scale its other parts too. Name every part, or the fused layer, or load the model without "
                "this fusion."
            )
    return folded


def _folded_resolution(resolve: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(resolve)
    def resolve_mappings(modifier: Any, model: nn.Module) -> Any:
        mappings = resolve(modifier, model)
        for mapping in mappings:
            if isinstance(mapping.smooth_layer, ProjectionSlice):
                raise FusionError(
                    f"SmoothQuant's mapping smooths {mapping.smooth_name}, one part of the fused "
                    f"{mapping.smooth_layer.fused_name}: its output rows are not a layer of their own here. Load the "
                    "model without this fusion to smooth it."
                )
        for mapping in mappings:
            mapping.balance_layers = fold_fused_parts(mapping.balance_layers, mapping.smooth_name)
        return mappings

    setattr(resolve_mappings, _FOLDED_MARK, True)
    return resolve_mappings


def _fold_in(module: ModuleType) -> None:
    """Give ``module``'s SmoothQuant modifier the folding resolution (once)."""
    modifier = getattr(module, "SmoothQuantModifier", None)
    resolve = getattr(modifier, "_resolve_mappings", None)
    if resolve is None or getattr(resolve, _FOLDED_MARK, False):
        return
    modifier._resolve_mappings = _folded_resolution(resolve)  # type: ignore[union-attr]


class _FoldAtImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: at the import of llm-compressor's SmoothQuant module, lets the other finders find it and
    has its loader fold the resolution in once the module has run."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _SMOOTHQUANT_MODULE:
            return None
        _remove_finder()
        spec = importlib.util.find_spec(fullname)  # the parent package is being imported: its finders find this one
        loader = None if spec is None else spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _fold_in(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _remove_finder() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _FoldAtImport)]


def fold_smoothquant_mappings() -> None:
    """Have llm-compressor's SmoothQuant fold mappings naming fused parts into the fused layers (idempotent; called
    whenever a module with fused projections is built)."""
    module = sys.modules.get(_SMOOTHQUANT_MODULE)
    if module is not None:
        _fold_in(module)
        _remove_finder()
        made("smoothquant_mappings")
    elif _llmcompressor_installed() and not any(isinstance(finder, _FoldAtImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _FoldAtImport())
        made("smoothquant_mappings")


@functools.cache
def _llmcompressor_installed() -> bool:
    # Once per process: a search of sys.path for every fused module built would cost more than the build.
    return importlib.util.find_spec("llmcompressor") is not None
