"""The load plan: checkpoint keys -> model parameters, validated against the model before any tensor is read."""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import PreTrainedModel

from .._transformers import keys_to_ignore_on_load, tied_weight_keys
from ..conversion.planner import ConversionPlan, TensorMeta, plan_load
from ..conversion.registry import legacy_conversions
from ..conversion.transformers_mapping import translate
from ..conversion.transforms import WeightTransform
from ..errors import LoadPlanError
from .diagnose import Replacement, collapse_lines, explain, quantization

logger = logging.getLogger(__name__)

UnexpectedKeys = Literal["warn", "error", "ignore"]


@dataclass
class LoadPlan:
    """What a load will do, computed from safetensors headers and the meta-device model."""

    conversion: ConversionPlan
    transforms: list[WeightTransform]
    expected: dict[str, TensorMeta]
    tied: dict[str, str]
    new_parameters: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    def loaded_keys(self) -> list[str]:
        """Runtime keys that receive checkpoint data."""
        return [k for k in self.conversion.outputs if k in self.expected]


def model_expectations(model: PreTrainedModel) -> dict[str, TensorMeta]:
    """Every parameter and persistent buffer of ``model`` (meta tensors are fine)."""
    return {k: TensorMeta(tuple(v.shape), v.dtype) for k, v in model.state_dict(keep_vars=True).items()}


def _kind(dtype: torch.dtype) -> str:
    if dtype.is_floating_point:
        return "floating"
    if dtype.is_complex:
        return "complex"
    return "bool" if dtype == torch.bool else "integer"


def _compile_any(patterns: Iterable[str]) -> re.Pattern[str] | None:
    patterns = [p for p in patterns if p]
    return re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None


def plan_model_load(
    model: PreTrainedModel,
    checkpoint: Mapping[str, TensorMeta],
    transforms: Sequence[WeightTransform],
    *,
    new_parameters: Sequence[str] = (),
    unexpected_keys: UnexpectedKeys = "warn",
    replacements: Callable[[], Sequence[Replacement]] | None = None,
    quantized: bool = False,
) -> LoadPlan:
    """Plan and validate a load. Raises :class:`LoadPlanError` naming every offending key, grouped by problem.

    Checkpoint keys the model has no place for are ``dropped`` when the model recomputes them (non-persistent
    buffers), ``ignored`` when the model class declares them ignorable (``_keys_to_ignore_on_load_unexpected``)
    and ``unexpected`` otherwise. A quantized checkpoint is an error unless ``quantized`` (a quantizer of the load
    turned ``checkpoint`` into the parameters already): its weights would load without their scales.
    ``replacements`` lists the modules the load's patches replaced; it is called only to explain missing keys in
    the error.
    """
    expected = model_expectations(model)
    tied = tied_weight_keys(model)

    # transformers' own transforms (a Patcher's extras, say) become modelpatch's, configured like the model's own.
    transforms = [t.configured(model.config) for t in translate(transforms, type(model).__name__)]
    legacy = legacy_conversions()
    conversion = plan_load(
        checkpoint,
        [*transforms, *legacy],
        expected=expected,
        base_model_prefix=getattr(model, "base_model_prefix", "") or "",
    )
    # Every load also reads transformers' legacy key names; the report keeps those some key had.
    used = [*transforms, *(t for t in legacy if id(t) in conversion.used)]

    problems: dict[str, list[str]] = defaultdict(list)
    for kind, items in conversion.problems.items():
        problems[kind].extend(items)

    sources: dict[str, str] | None = None  # described only for an error: a repr per key costs
    for key, meta in conversion.outputs.items():
        want = expected.get(key)
        if want is None:
            continue
        if tuple(meta.shape) != tuple(want.shape):
            sources = sources or _sources_by_output(conversion)
            problems["shape mismatches"].append(
                f"{key}: checkpoint {sources[key]} gives {list(meta.shape)}, model expects {list(want.shape)}"
            )
        elif meta.dtype != want.dtype and _kind(meta.dtype) != _kind(want.dtype):
            sources = sources or _sources_by_output(conversion)
            problems["dtype mismatches"].append(
                f"{key}: checkpoint {sources[key]} is {meta.dtype}, model expects {want.dtype}"
            )

    plan = LoadPlan(conversion=conversion, transforms=used, expected=expected, tied=tied)
    # A tied pair needs one of its two keys; transformers ties the missing one to the present one.
    provided = conversion.outputs.keys() & expected.keys()
    not_needed = {t for t, s in tied.items() if s in provided or t not in provided} | {
        s for t, s in tied.items() if t in provided
    }
    # The patterns below are compiled only when there are keys to match: a load that fits needs none of them.
    absent = sorted(expected.keys() - provided - not_needed)
    allowed_new = (
        _compile_any([*new_parameters, *keys_to_ignore_on_load(model, "missing")])
        if absent
        else None
    )
    for key in absent:
        if allowed_new is not None and allowed_new.search(key):
            plan.new_parameters.append(key)
        else:
            problems["missing from the checkpoint"].append(key)

    extra = sorted(conversion.outputs.keys() - expected.keys())
    if extra:
        buffers = [re.escape(name) + "$" for name, _ in model.named_buffers() if name not in expected]
        recomputed = _compile_any([*buffers, r"rotary_emb\.inv_freq$"])
        ignorable = _compile_any(keys_to_ignore_on_load(model, "unexpected"))
    for key in extra:
        if recomputed is not None and recomputed.search(key):
            plan.dropped.append(key)
        elif ignorable is not None and ignorable.search(key):
            plan.ignored.append(key)
        else:
            plan.unexpected.append(key)
    if plan.unexpected and unexpected_keys == "error":
        problems["unexpected in the checkpoint"].extend(plan.unexpected)
    quantized_by = quantization(model.config, plan.unexpected, conversion.outputs, handled=quantized)
    if quantized_by is not None:
        problems["quantized checkpoint"].append(quantized_by)

    if any(problems.values()):
        raise _plan_error(model, conversion, problems, plan.unexpected, unexpected_keys, quantized_by, replacements)
    if plan.unexpected and unexpected_keys == "warn":
        logger.warning(
            "%d checkpoint keys are not used by %s: %s",
            len(plan.unexpected),
            type(model).__name__,
            ", ".join(plan.unexpected),
        )
    return plan


def _plan_error(
    model: PreTrainedModel,
    conversion: ConversionPlan,
    problems: Mapping[str, list[str]],
    unexpected: list[str],
    unexpected_keys: UnexpectedKeys,
    quantized: str | None,
    replacements: Callable[[], Sequence[Replacement]] | None,
) -> LoadPlanError:
    """One error listing every problem (indices collapsed), the keys the model has no place for, and hints."""
    lines = [f"The checkpoint does not match {type(model).__name__}; nothing was loaded."]
    sections = [(kind, items) for kind, items in problems.items() if items]
    if unexpected and unexpected_keys != "error":
        # Not an error by themselves, but they are usually the other half of the story (renamed or fused weights).
        sections.append(("in the checkpoint but not used by the model", unexpected))
    for kind, items in sections:
        lines.append(f"{kind} ({len(items)}):")
        lines.extend(f"  - {item}" for item in collapse_lines(items))
    missing = problems.get("missing from the checkpoint", [])
    hints, explained = explain(missing, unexpected, conversion.unbuilt, quantized, replacements)
    if missing and not explained:
        hints.append("Pass new_parameters=[...] (regex patterns) for parameters you want freshly initialised.")
    lines.extend(f"Hint: {hint}" for hint in hints)
    return LoadPlanError("\n".join(lines), {k: list(v) for k, v in problems.items() if v})


def _sources_by_output(conversion: ConversionPlan) -> dict[str, str]:
    sources = {out: repr(src) for out, src in conversion.direct.items()}
    for group in conversion.groups:
        described = f"{group.sources_summary()} via {group.converter!r}"
        sources.update(dict.fromkeys(group.target_keys(), described))
    return sources
