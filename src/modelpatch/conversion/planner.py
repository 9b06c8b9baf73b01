"""Plan a conversion from tensor *metadata* alone: which keys become which, through which bound operations.

Planning reads no tensor data. It yields a :class:`ConversionPlan` whose groups carry their operations bound to
the real shapes, so executing it is mechanical and reversing it is exact.

* :func:`plan_load` maps checkpoint keys to runtime keys (renamings first, in order, then the first converter whose
  source pattern matches).
* :func:`plan_save` maps runtime keys back to checkpoint keys for a model that has no recorded load plan (one built
  with ``from_config``), by running the transforms backwards (``alternative`` converters excepted).
"""

from __future__ import annotations

import functools
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..errors import ConversionError
from .operations import (
    ConversionOperation,
    DtypeSlot,
    KeySlot,
    LayoutPick,
    Shape,
    ShapeSlot,
    Slot,
    bind_operations,
    common_dtype,
    concatenates_rows,
    reverse_operations,
    run_operations,
)
from .registry import as_transforms
from .transforms import (
    _PLACEHOLDER,
    GroupWeightRename,
    KeyMatch,
    WeightConverter,
    WeightRenaming,
    WeightTransform,
    has_index,
    key_template,
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
            for keys, shapes in zip(self.targets, self.target_shapes, strict=True)
            for key, shape in _per_key(keys, shapes)
        }

    def reverse(self) -> ConversionGroup:
        """The group that turns this group's targets back into its sources, exactly."""
        return ConversionGroup(
            converter=self.converter,
            sources=self.targets,
            targets=self.sources,
            operations=tuple(reverse_operations(list(self.operations))),
            source_shapes=self.target_shapes,
            target_shapes=self.source_shapes,
            dtype=self.dtype,
        )

    def reversed(self) -> ConversionGroup:
        """Deprecated spelling of :meth:`reverse` (modelpatch's one verb for undoing a conversion)."""
        warnings.warn("ConversionGroup.reversed() is deprecated; use .reverse().", DeprecationWarning, stacklevel=2)
        return self.reverse()

    def concatenated_rows(self) -> list[str] | None:
        """The source keys whose bytes, one after the other, are this group's one target's bytes (a concatenation
        along dim 0), else None."""
        if (
            len(self.targets) != 1
            or not isinstance(self.targets[0], str)
            or not isinstance(self.target_shapes[0], tuple)
        ):
            return None
        if not concatenates_rows(self.operations, len(self.target_shapes[0])) or None in self.sources:
            return None
        return self.source_keys()

    def run(self, fetch: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Read this group's sources through ``fetch`` and return its targets."""
        slots: list[Slot] = [
            [fetch(k) for k in keys] if isinstance(keys, tuple) else None if keys is None else fetch(keys)
            for keys in self.sources
        ]
        outputs = run_operations(list(self.operations), slots)
        result: dict[str, torch.Tensor] = {}
        for keys, value in zip(self.targets, outputs, strict=True):
            result.update(_per_key(keys, value))
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
    used: set[int] = field(default_factory=set)  # ids of the transforms that matched some key
    unbuilt: set[str] = field(default_factory=set)

    def raise_problems(self) -> None:
        if any(self.problems.values()):
            raise ConversionError("\n".join(format_problems(self.problems)))

    def problem_lines(self) -> list[str]:
        """Every problem reported, across kinds, in the order found."""
        return [line for lines in self.problems.values() for line in lines]

    def produced_keys(self) -> list[str]:
        """Every output key as planned: the direct ones, then each group's targets (a key planned twice shows twice)."""
        return [*self.direct, *(key for group in self.groups for key in group.target_keys())]

    def sources_of(self) -> dict[str, tuple[str, ...]]:
        """Output key -> the input keys it is built from: the one read unchanged, or its group's sources."""
        result: dict[str, tuple[str, ...]] = {output: (source,) for output, source in self.direct.items()}
        for group in self.groups:
            result.update(dict.fromkeys(group.target_keys(), tuple(group.source_keys())))
        return result

    def described_sources(self) -> dict[str, str]:
        """Output key -> what it is built from, for messages: the input key read unchanged (quoted), or the group's
        sources and converter."""
        result = {output: repr(source) for output, source in self.direct.items()}
        for group in self.groups:
            result.update(dict.fromkeys(group.target_keys(), f"{group.sources_summary()} via {group.converter!r}"))
        return result

    def reads(self) -> dict[str, int]:
        """Input key -> how many times the plan reads it (more than once: two outputs claim it); unread keys absent."""
        counts: dict[str, int] = defaultdict(int)
        for key in [*self.direct.values(), *(key for group in self.groups for key in group.source_keys())]:
            counts[key] += 1
        return dict(counts)

    def group_producing(self, output: str) -> ConversionGroup:
        """The converted group whose targets include ``output``."""
        for group in self.groups:
            if output in group.target_keys():
                return group
        raise KeyError(f"no converted group of this plan produces {output!r}")

    def run(self, fetch: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every output of the plan, from the input tensors ``fetch`` returns by key (direct keys as fetched)."""
        outputs = {output: fetch(source) for output, source in self.direct.items()}
        for group in self.groups:
            outputs.update(group.run(fetch))
        return outputs


def format_problems(
    problems: Mapping[str, Sequence[str]], collapse: Callable[[Sequence[str]], Sequence[str]] = list
) -> list[str]:
    """The lines of a problem list in a message: ``kind (count):`` then ``  - item`` for each item of each kind that
    has any (``collapse`` may shorten the items, indices collapsed, say; the count is of the items given)."""
    lines = []
    for kind, items in problems.items():
        if items:
            lines.append(f"{kind} ({len(items)}):")
            lines.extend(f"  - {item}" for item in collapse(items))
    return lines


def _per_key(keys: KeySlot, values: Any) -> list[tuple[str, Any]]:
    """(key, value) of each tensor of a slot: an indexed slot holds one value per key; an absent slot none."""
    if keys is None:
        return []
    return list(zip(keys, values, strict=True)) if isinstance(keys, tuple) else [(keys, values)]


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
    """The checkpoint key fragment a source pattern stands for, for saving: plain text, where ``\\1`` stands for
    what the target's capture group matched (a converter scoped to module paths captures the path)."""
    found = key_template(_PLACEHOLDER.sub(str(index), pattern) if index is not None else pattern)
    if found is None or found[1] is not None or "*" in found[0]:
        raise ConversionError(f"Cannot derive a checkpoint key from source pattern {pattern!r}: it is not plain text.")
    return found[0]


@dataclass(frozen=True)
class _Entry:
    """One key matched by a converter: the key, the converter's number and the match, and how the base model's
    prefix changes its outputs (``"+"`` added, ``"-"`` stripped, ``""`` neither)."""

    key: str
    number: int
    found: KeyMatch
    prefix_change: str = ""


def _change_prefix(key: str, change: str, prefix: str) -> str:
    if change == "+":
        return f"{prefix}.{key}"
    return key[len(prefix) + 1 :] if change == "-" else key


def _prefix_change(key: str, expected: Mapping[str, TensorMeta] | None, prefix: str) -> str:
    """As transformers: strip the base model's prefix when the model has the key without it, else add it when the
    model has the key with it (a task model from a base-model checkpoint and the other way round)."""
    if expected is None or not prefix or key in expected:
        return ""
    if key.startswith(prefix + ".") and key[len(prefix) + 1 :] in expected:
        return "-"
    return "+" if f"{prefix}.{key}" in expected else ""


_Buckets = dict[tuple[int, str, str], dict[int, dict[int | None, _Entry]]]
"""Matched keys by group ``(converter number, prefix change, group id)``, then input position, then index."""


def _group_and_bind(
    keys: Mapping[str, TensorMeta],
    entries: Sequence[_Entry],
    converters: Sequence[WeightConverter],
    plan: ConversionPlan,
    *,
    reverse: bool,
    names: Mapping[str, str] | None = None,
    expected: Mapping[str, TensorMeta] | None = None,
    prefix: str = "",
) -> set[str]:
    """Group the matched ``entries`` by converter, bind each group and add it to ``plan``. Returns the keys consumed.

    ``names`` maps keys to what problem messages call them (the checkpoint's own names, before renaming);
    ``expected`` (the model's keys) gives the operations that need them the model's shapes of their targets.
    """

    def name(key: str) -> str:
        return names.get(key, key) if names else key

    for (number, change, _), slots in _bucket_entries(entries, converters, plan, reverse, name).items():
        converter = converters[number]
        inputs = converter.target_patterns if reverse else converter.source_patterns
        outputs = converter.source_patterns if reverse else converter.target_patterns
        optional = frozenset() if reverse else converter.optional
        missing = [p for i, p in enumerate(inputs) if i not in slots and p not in optional]
        any_entry = next(iter(next(iter(slots.values())).values()))
        if missing:
            present = sorted(name(e.key) for s in slots.values() for e in s.values())
            plan.problems["incomplete groups"].append(f"{present} match {converter!r} but nothing matches {missing}")
            plan.unbuilt |= _unbuilt(converter, outputs, any_entry.found, reverse)
            continue
        try:
            first = next(iter(slots[0].values())).found
            output_key = functools.partial(_output_key, converter, first, reverse, change, prefix)
            group = _bind_group(converter, slots, keys, output_key, reverse=reverse, name=name, expected=expected)
        except ConversionError as exc:
            plan.problems["conversion errors"].append(f"{converter!r} on {name(any_entry.key)!r}: {exc}")
            plan.unbuilt |= _unbuilt(converter, outputs, any_entry.found, reverse)
            continue
        plan.groups.append(group)
        plan.outputs.update(group.target_metas())
    return {entry.key for entry in entries}


def _bucket_entries(
    entries: Sequence[_Entry],
    converters: Sequence[WeightConverter],
    plan: ConversionPlan,
    reverse: bool,
    name: Callable[[str], str],
) -> _Buckets:
    """The entries by group and slot; two keys filling one slot are a problem of ``plan`` (the first stays)."""
    buckets: _Buckets = defaultdict(lambda: defaultdict(dict))
    for entry in entries:
        converter = converters[entry.number]
        # Keys of one group render to the same first output key (whatever the index of an indexed slot).
        group_id = _render(converter, 0, entry.found, _ANY_INDEX, reverse)
        slot = buckets[(entry.number, entry.prefix_change, group_id)][entry.found.position]
        index = entry.found.index
        if index in slot:
            plan.problems["duplicate keys"].append(
                f"{name(entry.key)!r} and {name(slot[index].key)!r} fill the same slot of {converter!r}"
            )
        slot[index] = entry
    return buckets


def _input_slots(
    slots: Mapping[int, Mapping[int | None, _Entry]], inputs: Sequence[str], keys: Mapping[str, TensorMeta]
) -> tuple[list[KeySlot], list[ShapeSlot | None]]:
    """The keys and shapes of a group's inputs, position by position (None: an optional pattern it lacks)."""
    key_slots: list[KeySlot] = []
    shape_slots: list[ShapeSlot | None] = []
    for position in range(len(inputs)):
        found = slots.get(position)
        if found is None:
            key_slots.append(None)
            shape_slots.append(None)
        elif None not in found:
            indices = sorted(i for i in found if i is not None)
            if indices != list(range(len(indices))):
                raise ConversionError(
                    f"indices {indices} of pattern {inputs[position]!r} are not 0..{len(indices) - 1}"
                )
            key_slots.append(tuple(found[i].key for i in indices))
            shape_slots.append([keys[found[i].key].shape for i in indices])
        else:
            (entry,) = found.values()
            key_slots.append(entry.key)
            shape_slots.append(keys[entry.key].shape)
    return key_slots, shape_slots


def _bind_group(
    converter: WeightConverter,
    slots: Mapping[int, Mapping[int | None, _Entry]],
    keys: Mapping[str, TensorMeta],
    output_key: Callable[[int, int | None], str],
    *,
    reverse: bool,
    name: Callable[[str], str],
    expected: Mapping[str, TensorMeta] | None,
) -> ConversionGroup:
    """One complete group of ``converter`` bound to its real shapes: its operations (reversed when saving) learn
    their sources and, with ``expected``, the model's shapes of their targets.

    Raises:
        ConversionError: the group's keys or shapes do not fit the operations.
    """
    inputs = converter.target_patterns if reverse else converter.source_patterns
    outputs = converter.source_patterns if reverse else converter.target_patterns
    key_slots, shape_slots = _input_slots(slots, inputs, keys)
    slot_dtypes = [_slot_dtype(k, keys) for k in key_slots]
    operations = reverse_operations(list(converter.operations)) if reverse else list(converter.operations)
    if expected is not None:
        targets = [
            None if has_index(template) else getattr(expected.get(output_key(i, None)), "shape", None)
            for i, template in enumerate(outputs)
        ]
        operations = [op.for_targets(targets) for op in operations]
    if operations:
        source_names = [
            None if k is None else tuple(map(name, k)) if isinstance(k, tuple) else name(k) for k in key_slots
        ]
        operations[0] = operations[0].for_sources(source_names, slot_dtypes)
    bound, out_shapes = bind_operations(operations, shape_slots, len(outputs))
    dtype = _output_dtype(bound, slot_dtypes)
    if len(out_shapes) != len(outputs):
        raise ConversionError(f"the operations produce {len(out_shapes)} tensors for {len(outputs)} patterns")
    out_keys: list[KeySlot] = [
        tuple(output_key(position, i) for i in range(len(shape)))
        if isinstance(shape, list)
        else output_key(position, None)
        for position, shape in enumerate(out_shapes)
    ]
    return ConversionGroup(
        converter=converter,
        sources=tuple(key_slots),
        targets=tuple(out_keys),
        operations=tuple(bound),
        source_shapes=tuple(shape_slots),
        target_shapes=tuple(out_shapes),
        dtype=dtype,
    )


def _output_dtype(bound: Sequence[ConversionOperation], dtypes: list[DtypeSlot]) -> torch.dtype:
    """The dtype a bound chain produces from slots of ``dtypes`` (a chain without operations keeps the one dtype)."""
    if not bound:
        return common_dtype(dtypes, "the group")
    dtype = bound[0].output_dtype(dtypes)
    for op in bound[1:]:
        dtype = op.output_dtype([dtype])
    return dtype


def _unbuilt(converter: WeightConverter, outputs: Sequence[str], found: KeyMatch, reverse: bool) -> set[str]:
    """The output keys a group that could not be built would have had (``*`` for an index)."""
    keys = set()
    for position in range(len(outputs)):
        try:
            keys.add(_render(converter, position, found, _ANY_INDEX, reverse).replace(_ANY_INDEX, "*"))
        except ConversionError:  # a source pattern that stands for no literal key (saving only): nothing to name
            continue
    return keys


def _output_key(
    converter: WeightConverter,
    found: KeyMatch,
    reverse: bool,
    change: str,
    prefix: str,
    position: int,
    index: int | None,
) -> str:
    """Output ``position`` (entry ``index`` of an indexed one) of the group ``found`` belongs to, prefix changed."""
    return _change_prefix(_render(converter, position, found, index, reverse), change, prefix)


def _render(converter: WeightConverter, position: int, found: KeyMatch, index: int | str | None, reverse: bool) -> str:
    """Output ``position`` of ``converter`` for the key ``found`` matched (a checkpoint key when ``reverse``)."""
    if reverse:
        return found.render(_source_template(converter.source_patterns[position], index))
    return found.render(converter.template(position), index)


def _match_converters(
    keys: Iterable[str], converters: Sequence[WeightConverter], *, reverse: bool
) -> dict[str, tuple[int, KeyMatch]]:
    """The first converter matching each key (its sources, or its targets when ``reverse``)."""
    matched = {}
    for key in keys:
        for number, converter in enumerate(converters):
            found = converter.match_target(key) if reverse else converter.match_source(key)
            if found is not None:
                matched[key] = (number, found)
                break
    return matched


def apply_renamings(
    keys: Iterable[str], renamings: Sequence[WeightRenaming], used: set[int] | None = None
) -> dict[str, str]:
    """Each key renamed by every renaming in turn (the ids of those that renamed something are added to ``used``).
    A :class:`GroupWeightRename` applies only when some key (as renamed so far) matches its guard pattern."""
    renamed = {key: key for key in keys}
    for renaming in renamings:
        if isinstance(renaming, GroupWeightRename) and not any(map(renaming.is_guard, renamed.values())):
            continue
        for key, current in renamed.items():
            new = renaming.rename(current)
            if new is not None:
                renamed[key] = new
                if used is not None:
                    used.add(id(renaming))
    return renamed


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


def plan_load(
    checkpoint: Mapping[str, TensorMeta],
    transforms: Sequence[WeightTransform],
    *,
    expected: Mapping[str, TensorMeta] | None = None,
    base_model_prefix: str = "",
) -> ConversionPlan:
    """Plan checkpoint keys -> runtime keys. Problems are collected in ``plan.problems``, not raised.

    Renamings apply first, in order, then the first converter whose source pattern matches. With ``expected`` (the
    model's keys), each key behaves as in stock transformers: the base model's prefix is stripped or added when that
    gives a key of the model, a key the transforms would make unknown to the model loads under its own name when the
    model has it, and operations learn the model's shapes of their targets.
    """
    renamings, converters = _split(as_transforms(transforms, "plan_load"))
    plan = ConversionPlan()
    renamed: dict[str, str] = {}
    entries: list[_Entry] = []
    after_renamings = apply_renamings(checkpoint, renamings, plan.used)
    matched = _match_converters(after_renamings.values(), converters, reverse=False)
    for key, new in after_renamings.items():
        found = matched.get(new)
        first = new if found is None else found[1].render(converters[found[0]].template(0), 0)
        change = _prefix_change(first, expected, base_model_prefix)
        if (
            expected is not None
            and _change_prefix(first, change, base_model_prefix) not in expected
            and key in expected
        ):
            found, new, change = None, key, ""
        if found is None:
            new = _change_prefix(new, change, base_model_prefix)
        if new in renamed:
            plan.problems["duplicate keys"].append(f"{key!r} and {renamed[new]!r} are both renamed to {new!r}")
            continue
        renamed[new] = key
        if found is not None:
            entries.append(_Entry(new, found[0], found[1], change))
            plan.used.add(id(converters[found[0]]))
    renamed_meta = {new: checkpoint[old] for new, old in renamed.items()}
    consumed = _group_and_bind(
        renamed_meta,
        entries,
        converters,
        plan,
        reverse=False,
        names=renamed,
        expected=expected,
        prefix=base_model_prefix,
    )
    # Groups were built on renamed keys; record the checkpoint's own names as their sources.
    plan.groups = [_rename_sources(group, renamed) for group in plan.groups]
    _pick_layouts(plan)
    for new, old in renamed.items():
        if new not in consumed:
            _add_direct(plan, new, old, checkpoint[old])
    return plan


def _pick_layouts(plan: ConversionPlan) -> None:
    """Decide the operations whose layout the tensor's shape could not tell, from the checkpoint's other tensors.

    An operation that converts a tensor only when the checkpoint holds it in another layout than the model's, and
    tells which by its shape (transformers' check-dims ``Transpose``: Qwen3-VL-MoE's experts, stored ``(E, H, 2I)``
    before transformers 5 and ``(E, 2I, H)`` since), cannot where both layouts have the same shape (``H == 2I``).
    Stock then reads the tensor as it is, silently transposed if the checkpoint is the older one. A checkpoint is
    written in one layout, so such an operation takes the one its other tensors of that kind show (there the
    ``down_proj`` experts, ``(E, I, H)`` against ``(E, H, I)``, which differ since ``H != I``); when none shows one,
    or they disagree, the group is a problem of the plan, named by key.
    """
    picks = [
        (index, position, pick)
        for index, group in enumerate(plan.groups)
        for position, op in enumerate(group.operations)
        if (pick := op.layout_pick()) is not None
    ]
    shown: dict[LayoutPick, str] = {}  # each layout the shapes told -> the first key in it
    for index, _, pick in picks:
        if pick is not LayoutPick.UNDECIDED:
            shown.setdefault(pick, plan.groups[index].source_keys()[0])
    for index, position, pick in picks:
        if pick is not LayoutPick.UNDECIDED:
            continue
        group = plan.groups[index]
        if len(shown) == 1:
            operations = list(group.operations)
            operations[position] = operations[position].picking(*shown)
            plan.groups[index] = replace(group, operations=tuple(operations))
            continue
        if shown:
            reason = "the checkpoint's other tensors disagree: " + ", ".join(
                f"{key!r} is in {layout.value}" for layout, key in shown.items()
            )
        else:
            reason = "no other tensor of the checkpoint shows which layout it is written in"
        plan.problems["layouts the shapes cannot tell"].append(
            f"{group.converter!r} on {group.source_keys()[0]!r}: its shape {group.source_shapes[0]} is the model's "
            f"and that of the other layout the converter reads, so the shape cannot tell which the checkpoint holds, "
            f"and {reason}."
        )


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

    ``alternative`` transforms are skipped unless ``alternatives`` is true: their targets already are the checkpoint
    layout the model saves to. (Unfusing a live model runs them backwards: there the sources are the layout wanted.)
    """
    transforms = [t for t in as_transforms(transforms, "plan_save") if alternatives or not t.alternative]
    renamings, converters = _split(transforms)
    plan = ConversionPlan()
    matched = _match_converters(runtime, converters, reverse=True)
    entries = [_Entry(key, number, found) for key, (number, found) in matched.items()]
    consumed = _group_and_bind(runtime, entries, converters, plan, reverse=True)
    inverses = [r.reverse() for r in reversed(renamings)]
    produced = [k for g in plan.groups for k in g.target_keys()] + [k for k in runtime if k not in consumed]
    unrenamed = apply_renamings(produced, inverses)

    def unrename(keys: KeySlot) -> KeySlot:
        if keys is None:
            return None
        return tuple(unrenamed[k] for k in keys) if isinstance(keys, tuple) else unrenamed[keys]

    plan.groups = [
        ConversionGroup(
            g.converter,
            g.sources,
            tuple(map(unrename, g.targets)),
            g.operations,
            g.source_shapes,
            g.target_shapes,
            g.dtype,
        )
        for g in plan.groups
    ]
    plan.outputs = {unrenamed[k]: v for k, v in plan.outputs.items()}
    for key, meta in runtime.items():
        if key not in consumed:
            _add_direct(plan, unrenamed[key], key, meta)
    return plan
