"""Plan a conversion from tensor *metadata* alone: which keys become which, through which bound operations.

Planning reads no tensor data. It yields a :class:`ConversionPlan` whose groups carry their operations bound to
the real shapes, so executing it is mechanical and reversing it is exact.

* :func:`plan_load` maps checkpoint keys to runtime keys (renamings first, in order, then the first converter whose
  source pattern matches).
* :func:`plan_save` maps runtime keys back to checkpoint keys for a model that has no recorded load plan (one built
  with ``from_config``), by running the transforms backwards (``alternative`` converters excepted).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..errors import ConversionError
from .operations import (
    ConversionOperation,
    DtypeSlot,
    KeySlot,
    Shape,
    ShapeSlot,
    Slot,
    bind_operations,
    common_dtype,
    run_operations,
)
from .transforms import (
    _INDEX_SEGMENT,
    WeightConverter,
    WeightRenaming,
    WeightTransform,
    has_index,
    literal_form,
    render_target,
)

_ANY_INDEX = "\x01"


@dataclass(frozen=True)
class TensorMeta:
    """What planning knows of a tensor: its shape and dtype."""

    shape: Shape
    dtype: torch.dtype


@dataclass(frozen=True)
class ConversionGroup:
    """One converter applied to one group of tensors (one layer's ``q/k/v``, one layer's experts, ...)."""

    converter: WeightConverter
    sources: tuple[KeySlot, ...]
    targets: tuple[KeySlot, ...]
    operations: tuple[ConversionOperation, ...]
    source_shapes: tuple[ShapeSlot, ...]
    target_shapes: tuple[ShapeSlot, ...]
    dtype: torch.dtype

    def source_keys(self) -> list[str]:
        return _flatten(self.sources)

    def target_keys(self) -> list[str]:
        return _flatten(self.targets)

    def sources_summary(self) -> str:
        """The first few source keys, for messages."""
        keys = self.source_keys()
        return f"{keys[:3]}{'...' if len(keys) > 3 else ''}"

    def target_metas(self) -> dict[str, TensorMeta]:
        return {
            key: TensorMeta(tuple(shape), self.dtype)
            for keys, shapes in zip(self.targets, self.target_shapes)
            for key, shape in (zip(keys, shapes) if isinstance(keys, tuple) else [(keys, shapes)])
        }

    def reversed(self) -> ConversionGroup:
        """The group that turns this group's targets back into its sources, exactly."""
        return ConversionGroup(
            converter=self.converter,
            sources=self.targets,
            targets=self.sources,
            operations=tuple(op.reverse() for op in reversed(self.operations)),
            source_shapes=self.target_shapes,
            target_shapes=self.source_shapes,
            dtype=self.dtype,
        )

    def run(self, fetch: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Read this group's sources through ``fetch`` and return its targets."""
        slots: list[Slot] = [
            [fetch(k) for k in keys] if isinstance(keys, tuple) else None if keys is None else fetch(keys)
            for keys in self.sources
        ]
        outputs = run_operations(list(self.operations), slots)
        result: dict[str, torch.Tensor] = {}
        for keys, value in zip(self.targets, outputs):
            if isinstance(keys, tuple):
                result.update(zip(keys, value))  # type: ignore[arg-type]
            else:
                result[keys] = value  # type: ignore[assignment]
        return result


@dataclass
class ConversionPlan:
    """Where every output key comes from: a single input key (``direct``) or a converted group.

    ``unbuilt`` holds the output keys of groups that a problem stopped (incomplete, or failing to bind), with ``*``
    for an index: their absence is explained by that problem.
    """

    direct: dict[str, str] = field(default_factory=dict)
    groups: list[ConversionGroup] = field(default_factory=list)
    outputs: dict[str, TensorMeta] = field(default_factory=dict)
    problems: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    unbuilt: set[str] = field(default_factory=set)

    def raise_problems(self) -> None:
        if any(self.problems.values()):
            raise ConversionError(_format_problems(self.problems))


def _format_problems(problems: Mapping[str, list[str]]) -> str:
    lines = []
    for kind, items in problems.items():
        if items:
            lines.append(f"{kind} ({len(items)}):")
            lines.extend(f"  - {item}" for item in items)
    return "\n".join(lines)


def _flatten(slots: Sequence[KeySlot]) -> list[str]:
    return [k for s in slots if s is not None for k in (s if isinstance(s, tuple) else (s,))]


def _slot_dtype(keys: KeySlot, metas: Mapping[str, TensorMeta]) -> DtypeSlot:
    """The dtype of a slot's tensors (None for an absent slot); the tensors of an indexed slot share one."""
    if keys is None:
        return None
    dtypes = {metas[k].dtype for k in (keys if isinstance(keys, tuple) else (keys,))}
    if len(dtypes) > 1:
        raise ConversionError(f"the tensors of one slot have different dtypes {sorted(map(str, dtypes))}")
    return dtypes.pop()


def _source_template(pattern: str, index: int | str | None) -> str:
    """The literal checkpoint key fragment a source pattern stands for, for saving."""
    text = literal_form(_INDEX_SEGMENT.sub(str(index), pattern) if index is not None else pattern)
    if text is None:
        raise ConversionError(f"Cannot derive a checkpoint key from source pattern {pattern!r}: it is not plain text.")
    return text


def _group_and_bind(
    keys: Mapping[str, TensorMeta],
    converters: Sequence[WeightConverter],
    plan: ConversionPlan,
    *,
    reverse: bool,
    names: Mapping[str, str] | None = None,
) -> set[str]:
    """Group ``keys`` by converter, bind each group and add it to ``plan``. Returns the keys consumed.

    ``names`` maps keys to what problem messages call them (the checkpoint's own names, before renaming).
    """

    def name(key: str) -> str:
        return names.get(key, key) if names else key

    buckets: dict[tuple[int, str], dict[int, dict[int | None, tuple[str, re.Match[str]]]]] = defaultdict(
        lambda: defaultdict(dict)
    )
    consumed: set[str] = set()
    for key in keys:
        for number, converter in enumerate(converters):
            found = converter.match_target(key) if reverse else converter.match_source(key)
            if found is None:
                continue
            position, match = found
            index = int(match.group("index")) if "index" in match.re.groupindex else None
            outputs = converter.source_patterns if reverse else converter.target_patterns
            # Keys of one group render to the same first output key (whatever the index of an indexed slot).
            group_id = _render(outputs[0], match, _ANY_INDEX, reverse)
            slot = buckets[(number, group_id)][position]
            if index in slot:
                plan.problems["duplicate keys"].append(
                    f"{name(key)!r} and {name(slot[index][0])!r} fill the same slot of {converter!r}"
                )
            slot[index] = (key, match)
            consumed.add(key)
            break

    for (number, _), slots in buckets.items():
        converter = converters[number]
        inputs = converter.target_patterns if reverse else converter.source_patterns
        outputs = converter.source_patterns if reverse else converter.target_patterns
        optional = frozenset() if reverse else converter.optional
        missing = [p for i, p in enumerate(inputs) if i not in slots and p not in optional]
        any_key, any_match = next(iter(next(iter(slots.values())).values()))
        if missing:
            present = sorted(name(k) for s in slots.values() for k, _ in s.values())
            plan.problems["incomplete groups"].append(f"{present} match {converter!r} but nothing matches {missing}")
            plan.unbuilt |= _unbuilt(outputs, any_match, reverse)
            continue
        try:
            key_slots: list[KeySlot] = []
            shape_slots: list[ShapeSlot] = []
            for position in range(len(inputs)):
                entries = slots.get(position)
                if entries is None:  # an optional pattern this group lacks
                    key_slots.append(None)
                    shape_slots.append(None)
                elif has_index(inputs[position]):
                    indices = sorted(entries)
                    if indices != list(range(len(indices))):
                        raise ConversionError(f"indices {indices} of pattern {inputs[position]!r} are not 0..{len(indices) - 1}")
                    key_slots.append(tuple(entries[i][0] for i in indices))
                    shape_slots.append([keys[entries[i][0]].shape for i in indices])
                else:
                    (key, _), = entries.values()
                    key_slots.append(key)
                    shape_slots.append(keys[key].shape)
            slot_dtypes = [_slot_dtype(k, keys) for k in key_slots]
            operations = (
                [op.reverse() for op in reversed(converter.operations)] if reverse else list(converter.operations)
            )
            if operations:
                source_names = [
                    None if k is None else tuple(map(name, k)) if isinstance(k, tuple) else name(k) for k in key_slots
                ]
                operations[0] = operations[0].for_sources(source_names, slot_dtypes)
            bound, out_shapes = bind_operations(operations, shape_slots, len(outputs))
            dtype = _output_dtype(bound, slot_dtypes)
            if len(out_shapes) != len(outputs):
                raise ConversionError(f"the operations produce {len(out_shapes)} tensors for {len(outputs)} patterns")
            _, first_match = next(iter(slots[0].values()))
            out_keys: list[KeySlot] = []
            for template, shape in zip(outputs, out_shapes):
                if isinstance(shape, list):
                    out_keys.append(tuple(_render(template, first_match, i, reverse) for i in range(len(shape))))
                else:
                    out_keys.append(_render(template, first_match, None, reverse))
        except ConversionError as exc:
            plan.problems["conversion errors"].append(f"{converter!r} on {name(any_key)!r}: {exc}")
            plan.unbuilt |= _unbuilt(outputs, any_match, reverse)
            continue
        group = ConversionGroup(
            converter=converter,
            sources=tuple(key_slots),
            targets=tuple(out_keys),
            operations=tuple(bound),
            source_shapes=tuple(shape_slots),
            target_shapes=tuple(out_shapes),
            dtype=dtype,
        )
        plan.groups.append(group)
        plan.outputs.update(group.target_metas())
    return consumed


def _output_dtype(bound: Sequence[ConversionOperation], dtypes: list[DtypeSlot]) -> torch.dtype:
    """The dtype a bound chain produces from slots of ``dtypes`` (a chain without operations keeps the one dtype)."""
    if not bound:
        return common_dtype(dtypes, "the group")
    dtype = bound[0].output_dtype(dtypes)
    for op in bound[1:]:
        dtype = op.output_dtype([dtype])
    return dtype


def _unbuilt(outputs: Sequence[str], match: re.Match[str], reverse: bool) -> set[str]:
    """The output keys a group that could not be built would have had (``*`` for an index)."""
    keys = set()
    for template in outputs:
        try:
            keys.add(_render(template, match, _ANY_INDEX, reverse).replace(_ANY_INDEX, "*"))
        except ConversionError:  # a source pattern that stands for no literal key (saving only): nothing to name
            continue
    return keys


def _render(template: str, match: re.Match[str], index: int | str | None, reverse: bool) -> str:
    if reverse:
        key = match.string
        return key[: match.start()] + _source_template(template, index) + key[match.end() :]
    return render_target(template, match, index)


def _split(transforms: Sequence[WeightTransform]) -> tuple[list[WeightRenaming], list[WeightConverter]]:
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return renamings, converters


def _add_direct(plan: ConversionPlan, output: str, source: str, meta: TensorMeta) -> None:
    if output in plan.direct or output in plan.outputs:
        plan.problems["duplicate keys"].append(f"{source!r} and {_producer(plan, output)} both become {output!r}")
        return
    plan.direct[output] = source
    plan.outputs[output] = meta


def _producer(plan: ConversionPlan, output: str) -> str:
    """What already gives ``output`` in ``plan``: the key read unchanged, or the sources of the group converting it."""
    if output in plan.direct:
        return repr(plan.direct[output])
    group = next(g for g in plan.groups if output in g.target_keys())
    return f"the conversion of {group.sources_summary()}"


def plan_load(checkpoint: Mapping[str, TensorMeta], transforms: Sequence[WeightTransform]) -> ConversionPlan:
    """Plan checkpoint keys -> runtime keys. Problems are collected in ``plan.problems``, not raised."""
    renamings, converters = _split(transforms)
    plan = ConversionPlan()
    renamed: dict[str, str] = {}
    for key in checkpoint:
        new = key
        for renaming in renamings:
            new = renaming.rename(new) or new
        if new in renamed:
            plan.problems["duplicate keys"].append(f"{key!r} and {renamed[new]!r} are both renamed to {new!r}")
            continue
        renamed[new] = key
    renamed_meta = {new: checkpoint[old] for new, old in renamed.items()}
    consumed = _group_and_bind(renamed_meta, converters, plan, reverse=False, names=renamed)
    # Groups were built on renamed keys; record the checkpoint's own names as their sources.
    plan.groups = [
        _rename_sources(group, renamed) for group in plan.groups
    ]
    for new, old in renamed.items():
        if new not in consumed:
            _add_direct(plan, new, old, checkpoint[old])
    return plan


def _rename_sources(group: ConversionGroup, renamed: Mapping[str, str]) -> ConversionGroup:
    sources = tuple(
        tuple(renamed[k] for k in keys) if isinstance(keys, tuple) else None if keys is None else renamed[keys]
        for keys in group.sources
    )
    return ConversionGroup(
        group.converter, sources, group.targets, group.operations, group.source_shapes, group.target_shapes, group.dtype
    )


def plan_save(
    runtime: Mapping[str, TensorMeta], transforms: Sequence[WeightTransform], *, alternatives: bool = False
) -> ConversionPlan:
    """Plan runtime keys -> checkpoint keys by running ``transforms`` backwards (for models never loaded).

    ``alternative`` converters are skipped unless ``alternatives`` is true: their targets already are the checkpoint
    layout the model saves to. (Unfusing a live model runs them backwards: there the sources are the layout wanted.)
    """
    renamings, converters = _split(transforms)
    converters = [c for c in converters if alternatives or not c.alternative]
    plan = ConversionPlan()
    consumed = _group_and_bind(runtime, converters, plan, reverse=True)
    inverses = [r.inverse() for r in reversed(renamings)]

    def unrename(key: str) -> str:
        for inverse in inverses:
            key = inverse.rename(key) or key
        return key

    plan.groups = [
        ConversionGroup(
            g.converter,
            g.sources,
            tuple(tuple(map(unrename, k)) if isinstance(k, tuple) else unrename(k) for k in g.targets),
            g.operations,
            g.source_shapes,
            g.target_shapes,
            g.dtype,
        )
        for g in plan.groups
    ]
    plan.outputs = {unrename(k): v for k, v in plan.outputs.items()}
    for key, meta in runtime.items():
        if key not in consumed:
            _add_direct(plan, unrename(key), key, meta)
    return plan
