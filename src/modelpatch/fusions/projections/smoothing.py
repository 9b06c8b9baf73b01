"""llm-compressor's smoothing mappings (SmoothQuant's and AWQ's) on fused projections: a mapping that names the parts
(``q_proj``, ``k_proj``, ``v_proj`` -> ``input_layernorm``) balances the fused layer (``qkv_proj``) instead.

Both modifiers scale, per mapping, the input channels of every Linear that reads one layer's output by one scale per
channel, and divide that layer's output by it. The parts of a fused layer read that one input, so balancing the fused
layer is the same computation:

* SmoothQuant's scale comes from the largest weight of all balanced Linears together: the largest of the fused
  layer's rows is the largest of the parts' (a maximum rounds nothing), and multiplying its columns multiplies each
  part's rows.
* AWQ's scale comes from a grid search: the mean input of the balanced Linears (the fused layer's input is the
  parts'), their weights scaled and fake-quantized (per row, per group of a row or per channel: the fused layer's rows
  quantize as the parts' do), and the error of the mapping's parent module's output, the parent being the common
  ancestor of the names the mapping matched (the parts' attention block or MLP, as on the stock model), resolved
  before the rewrite below. Its weight means for ``duo_scaling`` sum the fused layer's normalised rows in
  one float64 reduction where stock sums each part's and adds the sums: the same unless a float64 sum of float32
  values at most 1 rounds (a row's value under about 2**-20 of the sum, with low bits set), a difference in
  float64's last bits, which reaches the float32 weights only where a scaled weight lies that close to a float32
  rounding boundary.

Resolved mappings (llm-compressor keeps each mapping's Linears as module objects) are rewritten once resolved: every
projection slice becomes its fused layer, and each fused layer is balanced once. That matters beyond the slices,
which hold no parameters for llm-compressor's offloaded updates to write: llm-compressor's own Llama patterns
(``re:.*v_proj$``, ``re:.*up_proj$``) also match ``qkv_proj`` and ``gate_up_proj`` themselves, and balancing a fused
layer and its parts would scale each row twice.

A mapping naming only some parts of a fused layer cannot be folded (scaling the fused layer would scale the other parts
too): refused by name, before any weight changes. SmoothQuant refuses a mapping smoothing a slice's output too. AWQ's
own mappings smooth slices (``v_proj`` -> ``o_proj``, ``up_proj`` -> ``down_proj``); modelpatch has it smooth the fused
layer, whose last rows llm-compressor divides when a fused smooth layer has more rows than the balanced Linear reads
(its own rule for fused ``qkv_proj`` layers). Those are the slice's rows, and the very division of stock's, when the
slice is its fused layer's last part; otherwise refused by name, as is (among the mappings llm-compressor goes on to
smooth) a fused smooth layer with a bias, whose whole bias llm-compressor would divide. Its shape check for ``qkv_proj``
-> ``o_proj`` (``3 * o_proj.in_features`` rows) then decides as stock's for ``v_proj`` does (``o_proj.in_features``
rows), since ``q_proj`` has ``o_proj.in_features`` rows and ``k_proj`` as many as ``v_proj``.

llm-compressor is never imported here. Its modules get the rewrite when a model with fused projections is built: at
once where a module is already imported, else at its import (a finder placed first on ``sys.meta_path``, which takes
itself off again once every module is rewritten). Checked against llmcompressor 0.14.0.1:
``llmcompressor.modifiers.transform.smoothquant.base``: ``SmoothQuantModifier._resolve_mappings(model)`` returning
``SmoothQuantMapping`` objects whose ``balance_layers`` (a list of modules) and ``smooth_layer`` are what its smoothing
reads; ``llmcompressor.modifiers.transform.awq.base``: ``AWQModifier._set_resolved_mappings(model)`` storing
``ResolvedMapping`` objects in ``_resolved_mappings``, each mapping's modules matched by the module's
``match_modules_set`` (the smooth layers first).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

from torch import nn

from ..._installs import made
from ...errors import FusionError
from .modules import FusedLinear, ProjectionSlice

_SMOOTHQUANT_MODULE = "llmcompressor.modifiers.transform.smoothquant.base"
_AWQ_MODULE = "llmcompressor.modifiers.transform.awq.base"
# Set on every function of llm-compressor's that modelpatch wrapped (each is wrapped once per process only).
_FOLDED_MARK = "_modelpatch_folds_fused_projections"


def fold_fused_parts(layers: Sequence[nn.Module], modifier: str, smooth_name: Callable[[], str]) -> list[nn.Module]:
    """``layers`` (the Linears one mapping of ``modifier`` balances) with every projection slice replaced by its fused
    layer, each fused layer once, in the order first met. Refuses, naming them (``smooth_name()``: the name of the
    layer the mapping smooths), the slices of a fused layer whose siblings the mapping leaves out (and does not name
    the fused layer itself)."""
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
                f"{modifier}'s mapping for {smooth_name()} balances part(s) {sorted(named)} of the fused "
                f"{first.fused_name} ({len(first.part_sizes)} parts), not all of them: balancing the fused layer "
                "would scale its other parts too. Name every part, or the fused layer, or load the model without "
                "this fusion."
            )
    return folded


def _refuse_smoothed_slice(modifier: str, name: str, part: ProjectionSlice, why: str) -> FusionError:
    return FusionError(
        f"{modifier}'s mapping smooths {name}, part {part.index} of the fused {part.fused_name}{why}. Load the model "
        "without this fusion to smooth it."
    )


def _folded_smoothquant_resolution(resolve: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(resolve)
    def resolve_mappings(modifier: Any, model: nn.Module) -> Any:
        mappings = resolve(modifier, model)
        for mapping in mappings:
            if isinstance(mapping.smooth_layer, ProjectionSlice):
                raise _refuse_smoothed_slice(
                    "SmoothQuant", mapping.smooth_name, mapping.smooth_layer, ": its output rows are not a layer here"
                )
        for mapping in mappings:
            mapping.balance_layers = fold_fused_parts(
                mapping.balance_layers, "SmoothQuant", _named(mapping.smooth_name)
            )
        return mappings

    return _marked(resolve_mappings)


def _awq_smooth_layers(layers: Sequence[nn.Module], model: nn.Module) -> list[nn.Module]:
    """AWQ's smooth layers of one match with every slice replaced by its fused layer, each once; a slice that is not
    its fused layer's last part is refused by name (see the module's docstring)."""
    folded: list[nn.Module] = []
    for layer in layers:
        if isinstance(layer, ProjectionSlice):
            if layer.index != len(layer.part_sizes) - 1:
                raise _refuse_smoothed_slice(
                    "AWQ", _name_of(layer, model), layer, ": llm-compressor divides a fused layer's last rows"
                )
            layer = layer.fused
        if all(layer is not other for other in folded):
            folded.append(layer)
    return folded


def _named(name: str) -> Callable[[], str]:
    return lambda: name


def _name_of(layer: nn.Module, model: nn.Module) -> str:
    return next(name for name, module in model.named_modules() if module is layer)


def _folded_awq_matches(match: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(match)
    def match_modules_set(model: nn.Module, targets: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        for smooth_layers, *balance_layers in match(model, targets, *args, **kwargs):
            # Refused here, before llm-compressor skips a mapping whose balanced Linears (slices) are not targeted
            # for quantization: only the fused layer is. The slices themselves stay until the parent is resolved.
            fold_fused_parts(
                [layer for layers in balance_layers for layer in layers],
                "AWQ",
                functools.partial(_name_of, smooth_layers[0], model),
            )
            yield [_awq_smooth_layers(smooth_layers, model), *balance_layers]

    return _marked(match_modules_set)


def _folded_awq_resolution(resolve: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(resolve)
    def set_resolved_mappings(modifier: Any, model: nn.Module) -> None:
        # The parents are resolved from the names matched, the parts' among them: the rewrite comes after.
        resolve(modifier, model)
        for mapping in modifier._resolved_mappings:
            smooth = mapping.smooth_layer
            # Decided on the mappings that passed llm-compressor's shape checks: those it would smooth.
            if not isinstance(smooth, FusedLinear) or smooth.bias is None:
                continue
            rows = mapping.balance_layers[0].in_features
            if smooth.out_features != rows:
                raise FusionError(
                    f"AWQ's mapping smooths {mapping.smooth_name}, a fused layer with a bias, by {rows} scales: "
                    "llm-compressor divides its last rows but the whole bias. Load the model without this fusion to "
                    "smooth it."
                )
        names = {id(module): name for name, module in model.named_modules()}
        for mapping in modifier._resolved_mappings:
            mapping.balance_layers = fold_fused_parts(mapping.balance_layers, "AWQ", _named(mapping.smooth_name))
            mapping.balance_names = [names[id(layer)] for layer in mapping.balance_layers]

    return _marked(set_resolved_mappings)


def _marked(function: Callable[..., Any]) -> Callable[..., Any]:
    setattr(function, _FOLDED_MARK, True)
    return function


def _wrap_once(owner: Any, attribute: str, wrap: Callable[[Any], Callable[..., Any]]) -> None:
    function = getattr(owner, attribute, None)
    if function is not None and not getattr(function, _FOLDED_MARK, False):
        setattr(owner, attribute, wrap(function))


def _fold_smoothquant(module: ModuleType) -> None:
    """Give ``module``'s SmoothQuant modifier the folding resolution (once)."""
    modifier = getattr(module, "SmoothQuantModifier", None)
    if modifier is not None:
        _wrap_once(modifier, "_resolve_mappings", _folded_smoothquant_resolution)


def _fold_awq(module: ModuleType) -> None:
    """Give ``module``'s AWQ modifier the folding resolution, and its matching the folding of smooth layers (once
    each)."""
    modifier = getattr(module, "AWQModifier", None)
    if modifier is None:
        return
    _wrap_once(module, "match_modules_set", _folded_awq_matches)
    _wrap_once(modifier, "_set_resolved_mappings", _folded_awq_resolution)


_FOLDS: dict[str, Callable[[ModuleType], None]] = {_SMOOTHQUANT_MODULE: _fold_smoothquant, _AWQ_MODULE: _fold_awq}


class _FoldAtImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: at the import of one of llm-compressor's modules in ``_FOLDS``, has the finder after it
    find the module and its loader rewrite the module once it has run."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        fold = _FOLDS.get(fullname)
        if fold is None:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        loader = None if spec is None else spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            fold(module)
            if all(name in sys.modules for name in _FOLDS):
                _remove_finder()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _remove_finder() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _FoldAtImport)]


def fold_smoothing_mappings() -> None:
    """Have llm-compressor's SmoothQuant and AWQ fold mappings naming fused parts into the fused layers (idempotent;
    called whenever a module with fused projections is built)."""
    for name, fold in _FOLDS.items():
        module = sys.modules.get(name)
        if module is not None:
            fold(module)
    if all(name in sys.modules for name in _FOLDS):
        _remove_finder()
        made("smoothing_mappings")
    elif _llmcompressor_installed():
        if not any(isinstance(finder, _FoldAtImport) for finder in sys.meta_path):
            sys.meta_path.insert(0, _FoldAtImport())
        made("smoothing_mappings")


@functools.cache
def _llmcompressor_installed() -> bool:
    # Once per process: a search of sys.path for every fused module built would cost more than the build.
    return importlib.util.find_spec("llmcompressor") is not None
