"""The load plan: checkpoint keys -> model parameters, validated against the model before any tensor is read."""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from .._transformers import keys_to_ignore_on_load, tied_weight_keys
from ..conversion.planner import ConversionPlan, TensorMeta, format_problems, plan_load
from ..conversion.registry import legacy_conversions
from ..conversion.transforms import WeightTransform
from ..errors import LoadPlanError
from ..modes.base import LoadMode
from .diagnose import Replacement, collapse_lines, explain
from .diagnose import quantization as quantization_problem
from .options import LoadOptions, UnexpectedKeys

if TYPE_CHECKING:  # imports modules that use this one
    from transformers import GenerationConfig

    from ..fusions.apply import PreparedFusions

logger = logging.getLogger(__name__)


@dataclass
class LoadPlan:
    """A load planned from safetensors headers alone: the meta-device model and where each of its tensors comes
    from, validated against that model before any tensor data is read. Executing it is the load; what it loads is
    :meth:`LoadReport.from_plan <modelpatch.LoadReport.from_plan>`.

    Attributes:
        directory: The checkpoint directory.
        model: The model built on the meta device, with the load's patches and fusions.
        checkpoint: Every checkpoint key's shape and dtype.
        transforms: The load's transforms (the model type's mapping adjusted by the Patcher, the fusions'); those a
            save runs backwards. A checkpoint in the runtime layout is read without them.
        fusions: The fusions of the load and the modules they fused.
        runtime_layout: The checkpoint was saved in the runtime layout.
        replaced: Class name -> ``(key, replacement)`` for every class the build replaced.
        conversion: Every runtime key's checkpoint source: read as is (possibly renamed) or converted in groups.
        used_transforms: The transforms the conversion ran, as translated for the model, with the legacy renamings
            some key had.
        expected: Every parameter and persistent buffer of the model.
        tied: Tied parameter -> the parameter it shares storage with.
        new_parameters: Parameters the checkpoint does not fill that are initialised freshly.
        dropped: Checkpoint keys of buffers the model recomputes.
        ignored: Checkpoint keys the model class declares ignorable.
        unexpected: Checkpoint keys the model has no place for.
        modes: The load modes of the load (quantization, tensor parallelism, dispatch), in the order their hooks run.
        options: The options the load was planned with (what executing it needs: the device, file permissions).
        generation_config: The model's generation config (the checkpoint's ``generation_config.json``, or the one
            passed), set on the model when it is loaded.
        config_files: The bytes of the checkpoint's config files the plan was made from (``config.json``,
            ``generation_config.json``, each unless passed; None: absent): executing it checks they are unchanged.
        loaded: The plan was executed (its model holds the checkpoint's tensors): a plan loads once.
    """

    directory: Path
    model: PreTrainedModel
    checkpoint: dict[str, TensorMeta]
    transforms: list[WeightTransform]
    fusions: PreparedFusions
    runtime_layout: bool
    replaced: dict[str, tuple[str, str]]
    conversion: ConversionPlan
    used_transforms: list[WeightTransform]
    expected: dict[str, TensorMeta]
    tied: dict[str, str]
    new_parameters: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    modes: tuple[LoadMode[LoadPlan], ...] = ()
    options: LoadOptions = field(default_factory=LoadOptions)
    generation_config: GenerationConfig | None = None
    config_files: dict[str, bytes | None] = field(default_factory=dict)
    loaded: bool = False

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


def plan_checkpoint_keys(
    model: PreTrainedModel,
    checkpoint: Mapping[str, TensorMeta],
    transforms: Sequence[WeightTransform],
    expected: Mapping[str, TensorMeta],
    *,
    prefixes: bool = True,
) -> tuple[ConversionPlan, list[WeightTransform]]:
    """Plan ``checkpoint``'s keys into ``model``'s (``expected``) as every load plans them: ``transforms`` configured
    like the model's own (transformers' own transforms were translated where they entered), then transformers' legacy
    key names; the base model's prefix added or stripped as stock does (unless not ``prefixes``: keys keep theirs, as
    torch's ``load_state_dict`` takes them). Problems are in the plan, not raised.

    Returns:
        The plan and the transforms it ran: the configured ones, with the legacy renamings some key had (what a load
        report keeps).
    """
    translated = [t.configured(model.config) for t in transforms]
    legacy = legacy_conversions()
    conversion = plan_load(
        checkpoint,
        [*translated, *legacy],
        expected=expected,
        base_model_prefix=(getattr(model, "base_model_prefix", "") or "") if prefixes else "",
    )
    return conversion, [*translated, *(t for t in legacy if id(t) in conversion.used)]


def plan_model_load(
    model: PreTrainedModel,
    directory: Path,
    checkpoint: dict[str, TensorMeta],
    transforms: list[WeightTransform],
    options: LoadOptions,
    *,
    fusions: PreparedFusions,
    runtime_layout: bool,
    replaced: dict[str, tuple[str, str]],
    modes: Sequence[LoadMode[LoadPlan]] = (),
    parameters: Mapping[str, TensorMeta] | None = None,
    replacements: Callable[[], Sequence[Replacement]] | None = None,
) -> LoadPlan:
    """Plan and validate the load of ``checkpoint`` into ``model``. Raises :class:`LoadPlanError` naming every
    offending key, grouped by problem.

    ``transforms`` are applied unless the checkpoint is in the ``runtime_layout``. Checkpoint keys the model has no
    place for are ``dropped`` when the model recomputes them (non-persistent buffers), ``ignored`` when the model
    class declares them ignorable (``_keys_to_ignore_on_load_unexpected``) and ``unexpected`` otherwise (handled as
    ``options.unexpected_keys`` says). ``parameters``: the checkpoint as the ``modes`` made it for the plan
    (:meth:`LoadMode.plan_parameters`); a quantized checkpoint is an error unless a mode ``quantizes``: otherwise its
    weights would load without their scales. ``replacements`` lists the modules the load's patches replaced; it is
    called only to explain missing keys in the error.
    """
    expected = model_expectations(model)
    conversion, used_transforms = plan_checkpoint_keys(
        model, checkpoint if parameters is None else parameters, [] if runtime_layout else transforms, expected
    )
    plan = LoadPlan(
        directory=directory,
        model=model,
        checkpoint=checkpoint,
        transforms=transforms,
        fusions=fusions,
        runtime_layout=runtime_layout,
        replaced=replaced,
        conversion=conversion,
        used_transforms=used_transforms,
        expected=expected,
        tied=tied_weight_keys(model),
        modes=tuple(modes),
        options=options,
    )
    problems: dict[str, list[str]] = defaultdict(list)
    for kind, items in conversion.problems.items():
        problems[kind].extend(items)
    _check_outputs(conversion, expected, problems)
    _sort_absent(plan, problems)
    _sort_extra(plan)
    unexpected_keys = options.unexpected_keys
    if plan.unexpected and unexpected_keys == "error":
        problems["unexpected in the checkpoint"].extend(plan.unexpected)
    handled = any(mode.quantizes for mode in modes)
    quantized_by = quantization_problem(model.config, plan.unexpected, conversion.outputs, handled=handled)
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


def _check_outputs(
    conversion: ConversionPlan, expected: Mapping[str, TensorMeta], problems: dict[str, list[str]]
) -> None:
    """Shape and dtype mismatches between what the plan produces and what the model expects, into ``problems``."""
    sources: dict[str, str] | None = None  # described only for an error: a repr per key costs
    for key, meta in conversion.outputs.items():
        want = expected.get(key)
        if want is None:
            continue
        if tuple(meta.shape) != tuple(want.shape):
            sources = sources or conversion.described_sources()
            problems["shape mismatches"].append(
                f"{key}: checkpoint {sources[key]} gives {list(meta.shape)}, model expects {list(want.shape)}"
            )
        elif meta.dtype != want.dtype and _kind(meta.dtype) != _kind(want.dtype):
            sources = sources or conversion.described_sources()
            problems["dtype mismatches"].append(
                f"{key}: checkpoint {sources[key]} is {meta.dtype}, model expects {want.dtype}"
            )


def _sort_absent(plan: LoadPlan, problems: dict[str, list[str]]) -> None:
    """The model's tensors the plan does not fill: new parameters (allowed), else missing (into ``problems``)."""
    # A tied pair needs one of its two keys; transformers ties the missing one to the present one.
    tied, expected = plan.tied, plan.expected
    provided = plan.conversion.outputs.keys() & expected.keys()
    not_needed = {t for t, s in tied.items() if s in provided or t not in provided} | {
        s for t, s in tied.items() if t in provided
    }
    # The patterns below are compiled only when there are keys to match: a load that fits needs none of them.
    absent = sorted(expected.keys() - provided - not_needed)
    patterns = [*plan.options.new_parameters, *keys_to_ignore_on_load(plan.model, "missing")]
    allowed_new = _compile_any(patterns) if absent else None
    for key in absent:
        if allowed_new is not None and allowed_new.search(key):
            plan.new_parameters.append(key)
        else:
            problems["missing from the checkpoint"].append(key)


def _sort_extra(plan: LoadPlan) -> None:
    """The checkpoint's keys the model has no place for: dropped (recomputed), ignored (declared) or unexpected."""
    extra = sorted(plan.conversion.outputs.keys() - plan.expected.keys())
    if not extra:
        return
    buffers = [re.escape(name) + "$" for name, _ in plan.model.named_buffers() if name not in plan.expected]
    recomputed = _compile_any([*buffers, r"rotary_emb\.inv_freq$"])
    ignorable = _compile_any(keys_to_ignore_on_load(plan.model, "unexpected"))
    for key in extra:
        if recomputed is not None and recomputed.search(key):
            plan.dropped.append(key)
        elif ignorable is not None and ignorable.search(key):
            plan.ignored.append(key)
        else:
            plan.unexpected.append(key)


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
    sections = dict(problems)
    if unexpected and unexpected_keys != "error":
        # Not an error by themselves, but they are usually the other half of the story (renamed or fused weights).
        sections["in the checkpoint but not used by the model"] = unexpected
    lines.extend(format_problems(sections, collapse_lines))
    missing = problems.get("missing from the checkpoint", [])
    hints, explained = explain(missing, unexpected, conversion.unbuilt, quantized, replacements)
    if missing and not explained:
        hints.append("Pass new_parameters=[...] (regex patterns) for parameters you want freshly initialised.")
    lines.extend(f"Hint: {hint}" for hint in hints)
    return LoadPlanError("\n".join(lines), {k: list(v) for k, v in problems.items() if v})
