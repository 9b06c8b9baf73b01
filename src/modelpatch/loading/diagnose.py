"""Why a load plan fails, in words that point at the cause.

A list of missing keys says *what* is wrong; the hints here say *why*, when the keys show it: a patch that replaced
a container class (whose children hold the weights), a checkpoint saved in a fused runtime layout and loaded without
its fusions, a quantized checkpoint, a fusion that does not fit the checkpoint. Key lists are shown with their layer
and expert indices collapsed (``model.layers.{0..23}.mlp.experts.{0..63}.gate_proj.weight``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..fusions import available_fusions, get_fusion

_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")
_QUOTED_LIST = re.compile(r"\['[^'\]]*'(?:, '[^'\]]*')+\]")

# What modelpatch loads, by ``quant_method`` (quantization.py refuses the others by name; a checkpoint quantized
# otherwise is explained here). compressed-tensors loads its tensors as they are into the parameters its
# ``preprocess_model`` adds (their dequantizing op, ``dequantize=True``, has no translation and is refused by name).
SUPPORTED_METHODS = ("fp8", "torchao", "compressed-tensors")


def collapse_lines(lines: Iterable[str]) -> list[str]:
    """Problem lines for a message: key lists inside a line and lines across, with their indices collapsed."""

    def collapse_list(match: re.Match[str]) -> str:
        return "['" + "', '".join(collapse_indices(re.findall(r"'([^']*)'", match[0]))) + "']"

    return collapse_indices(_QUOTED_LIST.sub(collapse_list, line) for line in lines)


def collapse_indices(lines: Iterable[str]) -> list[str]:
    """``lines`` with those that differ only in dotted indices merged, e.g. ``layers.{0..23}.mlp.experts.{0,2}.w``.

    Exact: the merged lines stand for precisely the input lines (a product of index sets is merged only when every
    combination is present), in the order of first appearance.
    """
    groups: dict[tuple[str, ...], list[tuple[frozenset[str], ...]]] = {}
    for line in lines:
        template = tuple(_INDEX.split(line))
        groups.setdefault(template, []).append(tuple(frozenset([i]) for i in _INDEX.findall(line)))
    out = []
    for template, rows in groups.items():
        for position in reversed(range(len(template) - 1)):
            merged: dict[tuple[frozenset[str], ...], frozenset[str]] = {}
            for row in rows:
                rest = row[:position] + row[position + 1 :]
                merged[rest] = merged.get(rest, frozenset()) | row[position]
            rows = [rest[:position] + (indices,) + rest[position:] for rest, indices in merged.items()]
        for row in rows:
            out.append("".join(part + (_render(row[i]) if i < len(row) else "") for i, part in enumerate(template)))
    return out


def _render(indices: frozenset[str]) -> str:
    if len(indices) == 1:
        return next(iter(indices))
    values = sorted(indices, key=int)
    runs: list[list[str]] = []
    for value in values:
        if runs and int(value) == int(runs[-1][-1]) + 1:
            runs[-1].append(value)
        else:
            runs.append([value])
    return "{" + ",".join(run[0] if len(run) == 1 else f"{run[0]}..{run[-1]}" for run in runs) + "}"


@dataclass(frozen=True)
class Replacement:
    """A module that a patch layer of the load built instead of the stock class.

    ``patch_key`` is the class name or pattern of a Patcher or registry mapping that caused it, ``fusion`` the name
    of the fusion that did; both None for a patch scope the caller opened around the load.
    """

    path: str
    original: str
    replacement: str
    patch_key: str | None = None
    fusion: str | None = None


# Unexpected keys that only quantized checkpoints have: packed weights and their scales (GPTQ / AWQ, bitsandbytes).
_QUANTIZED_KEY = re.compile(r"\.(qweight|qzeros|scales|g_idx|SCB|absmax|quant_map|nested_absmax|quant_state\.\w+)$")
# Per-tensor scales (fp8, compressed-tensors): ``<module>.weight_scale`` counts only next to a ``<module>.weight``,
# so that an unused ``logit_scale`` or ``layer_scale`` of an ordinary checkpoint is not taken for one.
_SCALE_KEY = re.compile(r"^(?P<module>.+)\.\w*_scale(_inv)?$")
_METHOD_BY_KEY = (
    (re.compile(r"_scale_inv$"), "fp8 with block-wise scales"),
    (re.compile(r"\.(qweight|qzeros|scales|g_idx)$"), "gptq or awq"),
    (re.compile(r"\.SCB$"), "bitsandbytes 8-bit"),
    (re.compile(r"\.(absmax|quant_map|nested_absmax|quant_state\.\w+)$"), "bitsandbytes 4-bit"),
    (re.compile(r"_scale$"), "fp8 or compressed-tensors"),
)


def quantization(
    config: Any, unexpected: Sequence[str], present: Mapping[str, object], handled: bool = False
) -> str | None:
    """How a checkpoint is quantized (method and evidence) beyond what the load's quantizer handles, or None.

    Evidence: ``quantization_config`` in the config (unless ``handled``: a quantizer of the load reads it), or
    ``unexpected`` keys (the model has no place for them) that only quantized checkpoints have; ``present`` holds
    every key the checkpoint provides, after renaming.
    """
    evidence = []
    method = None
    settings = None if handled else getattr(config, "quantization_config", None)
    if settings is not None:
        method = (
            settings.get("quant_method") if isinstance(settings, Mapping) else getattr(settings, "quant_method", None)
        )
        evidence.append(f"config.json has a quantization_config (quant_method {method!r})")
    keys = [
        key
        for key in unexpected
        if _QUANTIZED_KEY.search(key) or ((m := _SCALE_KEY.match(key)) and f"{m['module']}.weight" in present)
    ]
    if keys:
        method = method or next(name for pattern, name in _METHOD_BY_KEY if pattern.search(keys[0]))
        shown = collapse_indices(keys)
        evidence.append(f"keys such as {', '.join(shown[:3])}")
    if not evidence:
        return None
    return f"{method}: {'; '.join(evidence)}"


def explain(
    missing: Sequence[str],
    unexpected: Sequence[str],
    unbuilt: Iterable[str],
    quantized: str | None,
    replacements: Callable[[], Sequence[Replacement]] | None,
) -> tuple[list[str], bool]:
    """Hints for a failed plan, and whether every missing key is explained (by a hint or a conversion problem).

    ``unbuilt`` are the outputs of conversion groups a listed problem stopped (``*`` for an index).
    ``replacements`` is called only when a missing key is not explained by the checkpoint's layout (it builds the
    stock model).
    """
    if quantized is not None:
        return [
            f"This is a quantized checkpoint ({quantized}), and its quantization is not one modelpatch loads: "
            f"modelpatch does not support quantized checkpoints other than {', '.join(SUPPORTED_METHODS)} declared by "
            "a quantization_config in config.json (their weights would load without their scales). Load a "
            "full-precision checkpoint of this model, or this one with stock transformers."
        ], True
    hints = []
    unexplained = set(missing)
    layout_hint, explained = _runtime_layout(unexplained, unexpected)
    if layout_hint:
        hints.append(layout_hint)
        unexplained -= explained
    if unexplained and replacements is not None:
        replaced_hints, explained = _replaced_modules(unexplained, replacements())
        hints.extend(replaced_hints)
        unexplained -= explained
    stopped = [re.compile(re.escape(key).replace(r"\*", r"\d+")) for key in unbuilt]
    unexplained = {key for key in unexplained if not any(p.fullmatch(key) for p in stopped)}
    return hints, not unexplained


def _runtime_layout(missing: set[str], unexpected: Sequence[str]) -> tuple[str | None, set[str]]:
    """A checkpoint with fused projections (``qkv_proj``) where the model expects the parts (``q_proj`` ...)."""
    fusions: dict[str, str] = {}
    explained: set[str] = set()
    for name in available_fusions():
        for parts, fused in get_fusion(name).runtime_key_parts():
            for key in unexpected:
                match = re.fullmatch(rf"(?P<owner>.+)\.{re.escape(fused)}\.(?P<leaf>\w+)", key)
                if match is None:
                    continue
                found = {f"{match['owner']}.{part}.{match['leaf']}" for part in parts} & missing
                if found:
                    fusions.setdefault(name, f"{key!r} where the model expects {'/'.join(parts)}")
                    explained |= found
    if not fusions:
        return None, explained
    enabled = ", ".join(f"{name!r}: True" for name in fusions)
    return (
        f"The checkpoint is in the fused runtime layout of {', '.join(map(repr, fusions))} (it has "
        f"{'; '.join(fusions.values())}): it was saved with save_original_format=False. Load it with "
        f'fusion_config={{{enabled}}}. (modelpatch records this in config.json under its "modelpatch" key; this '
        "config.json lacks it, or the fusions were turned off.)"
    ), explained


def _replaced_modules(missing: set[str], replacements: Sequence[Replacement]) -> tuple[list[str], set[str]]:
    """Missing keys that lie under a module a patch or fusion replaced: the replacement lacks what they fill."""
    by_cause: dict[Replacement, tuple[list[str], list[str]]] = {}
    explained: set[str] = set()
    for key in sorted(missing):
        owner = next((r for r in replacements if key.startswith(r.path + ".")), None)
        if owner is None:
            continue
        cause = replace(owner, path="")  # one hint per replaced class, listing every place
        paths, keys = by_cause.setdefault(cause, ([], []))
        if owner.path not in paths:
            paths.append(owner.path)
        keys.append(key)
        explained.add(key)
    hints = []
    for cause, (paths, keys) in by_cause.items():
        where = ", ".join(collapse_indices(paths))
        if cause.fusion is not None:
            hints.append(
                f"Fusion {cause.fusion!r} replaced {cause.original} with {cause.replacement} (at {where}), and the "
                f"checkpoint does not provide what it needs ({', '.join(collapse_indices(keys)[:3])}). Check that "
                f"the checkpoint loads without it (fusion_config={{{cause.fusion!r}: False}}); if it does, the "
                "fusion does not fit this checkpoint."
            )
            continue
        if cause.patch_key is None:
            source = "A patch scope open around the load"
        else:
            source = f"The patch {cause.patch_key!r}"
        hint = (
            f"{source} replaced {cause.original} with {cause.replacement} (at {where}); the checkpoint stores "
            f"{cause.original}'s weights under names {cause.replacement} does not have, so they are missing."
        )
        if cause.patch_key is not None and cause.patch_key != cause.original:
            hint += (
                f" The pattern is a regular expression matched anywhere in class names, so it also matches "
                f"{cause.original}: use the exact name of the class you meant, or anchor the pattern (^...$)."
            )
        hints.append(hint)
    return hints, explained
