"""Declarative weight transforms with transformers 5.23's key-pattern syntax.

``WeightRenaming`` (with its ``GroupWeightRename``, ``PrefixChange``, ``IndexOffsetRenaming`` and ``LayerPairRenaming``
forms) renames keys;
``WeightConverter`` turns groups of keys into other keys through operations. docs/conversions.md states the pattern
rules; in short:

* a source pattern is a regular expression searched in the dotted key; ``*.`` matches any characters followed by a
  dot (several per pattern allowed), except in a converter, where it matches a digits-only index (one per pattern)
  that groups per-index keys (``experts.*.w1.weight``) for ``MergeModulelist`` and the like;
* a pattern ending in a letter or digit stops at a key boundary: ``mlp.w2.weight`` does not match
  ``mlp.w2.weight_scale_inv``;
* of a transform's source patterns, the one matching leftmost wins, ties going to the longest pattern;
* a target pattern is a key template: ``^``, ``$`` and look-arounds are dropped, escapes stand for their character,
  ``\\1`` for the source's first group, a capture group for ``\\1`` (and is what the inverse matches), and ``*.`` for
  the index; what the source matched is replaced by it and the rest of the key is kept;
* a transform scoped to a sub-model (:meth:`WeightTransform.scoped`) only sees keys under the sub-model's prefix
  (with or without the base model's prefix), and matches them without it.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import ConversionError
from .operations import ConversionOperation

_WILDCARD = re.compile(r"\*\.")
_INDEX_GROUP = r"(?P<index>\d+)\."
_ANY_CHARACTERS = r".*\."
_PLACEHOLDER = re.compile(r"\*(?=\.)")
# transformers' rules for turning a pattern into a template (``process_target_pattern``): look-arounds are dropped
# (here with one level of nested groups, which transformers' lazy expression cuts short) and so are the empty
# non-capturing groups that leaves; the first remaining group is the captured part.
_LOOKAROUND = re.compile(r"\(\?<?[=!][^()]*(?:\([^()]*\)[^()]*)*\)|\(\?:\)")
_CAPTURE = re.compile(r"\(.+?\)")
_BACKREFERENCE = re.compile(r"\\(\d+)")
_REGEX_SYNTAX = re.compile(r"[\[\](){}+?|^$]")


def _as_patterns(value: str | Sequence[str], what: str, allow_empty: bool = False) -> tuple[str, ...]:
    patterns = (value,) if isinstance(value, str) else tuple(value)
    if not patterns or not all(isinstance(p, str) and (p or allow_empty) for p in patterns):
        raise ConversionError(f"{what} must be a non-empty string or list of non-empty strings, got {value!r}.")
    return patterns


def compile_user_pattern(pattern: object, what: str, error: type[Exception] = ValueError) -> re.Pattern[str]:
    """``pattern``, a regular expression a user gave as ``what`` (``"new_parameters"``, a fusion's
    ``target_modules_patterns``, ...), compiled for ``re.search``.

    Raises:
        TypeError: it is not a string.
        error: it does not compile (named, with ``what`` and why).
    """
    if not isinstance(pattern, str):
        raise TypeError(f"{what} must be regex strings, got {pattern!r}.")
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise error(f"{what} entry {pattern!r} is not a valid regular expression: {exc}.") from None


def compile_key_pattern(pattern: str, *, indexed: bool = False) -> re.Pattern[str]:
    """Compile a source pattern: ``*.`` is any characters (a captured digits-only ``index`` when ``indexed``), and a
    pattern ending in a letter or digit must end at a key boundary."""
    if indexed:
        if len(_WILDCARD.findall(pattern)) > 1:
            raise ConversionError(f"Pattern {pattern!r} has more than one '*' index.")
        body = _WILDCARD.sub(lambda _: _INDEX_GROUP, pattern)
    else:
        body = _WILDCARD.sub(lambda _: _ANY_CHARACTERS, pattern)
    if re.search(r"[A-Za-z0-9]$", body):
        body += r"(?!\w)"
    try:
        return re.compile(body)
    except re.error as exc:
        raise ConversionError(f"Invalid key pattern {pattern!r}: {exc}.") from None


def has_index(pattern: str) -> bool:
    """Whether ``pattern`` has the ``*.`` index (of a converter's source, or placeholder of a target)."""
    return bool(_PLACEHOLDER.search(pattern))


def key_template(pattern: str) -> tuple[str, str | None] | None:
    """The key text a pattern stands for, and the capture group it had (which the text shows as ``\\1``).

    ``^``, ``$`` and look-arounds are dropped and escapes stand for their character; None when something else of
    regular-expression syntax remains (``layers\\.\\d+``, ``a|b``).
    """
    text, previous = pattern.removeprefix("^"), None
    while text != previous:
        text, previous = _LOOKAROUND.sub("", text), text
    if text.endswith("$") and not text.endswith("\\$"):
        text = text[:-1]
    group = _CAPTURE.search(text)
    if group is not None:
        text = text.replace(group.group(0), "\x00", 1)
    if _REGEX_SYNTAX.search(re.sub(r"\\.", "", text)) or re.search(r"\\[A-Za-z]", text):
        return None
    text = re.sub(r"\\(\W)", r"\1", text).replace("\x00", "\\1")
    return text, None if group is None else group.group(0)


def literal_form(pattern: str) -> str | None:
    """The plain text a pattern stands for (anchors and look-arounds dropped), or None if it has wildcards."""
    template = key_template(pattern)
    if template is None or template[1] is not None or _BACKREFERENCE.search(template[0]) or "*" in template[0]:
        return None
    return template[0]


def _expand(template: str, match: re.Match[str], index: int | str | None) -> str:
    if index is not None:
        template = _PLACEHOLDER.sub(str(index), template)
    elif has_index(template):
        raise ConversionError(f"Target pattern {template!r} has a '*' index but the source gives none.")

    def group(reference: re.Match[str]) -> str:
        number = int(reference.group(1))
        if number > (match.re.groups or 0):
            raise ConversionError(f"Target {template!r} refers to group {number}, which {match.re.pattern!r} lacks.")
        return match.group(number) or ""

    return _BACKREFERENCE.sub(group, template)


@dataclass(frozen=True)
class KeyMatch:
    """Where a transform's pattern matched a key: which pattern, its match (on the key without the scope prefix) and
    the scope prefix that was stripped."""

    position: int
    match: re.Match[str]
    prefix: str = ""

    @property
    def index(self) -> int | None:
        return int(self.match.group("index")) if "index" in self.match.re.groupindex else None

    def replace(self, text: str) -> str:
        """The key with the matched span replaced by ``text``."""
        key = self.match.string
        return self.prefix + key[: self.match.start()] + text + key[self.match.end() :]

    def render(self, template: str, index: int | str | None = None) -> str:
        """The key with the matched span replaced by ``template`` (back-references and the index filled in)."""
        return self.replace(_expand(template, self.match, index))


class WeightTransform:
    """Base of :class:`WeightRenaming` and :class:`WeightConverter`.

    ``alternative=True`` marks a transform whose sources are another layout some checkpoints use, while its targets
    are the layout the model saves to: a load applies it and records what it did (so a save writes those keys back
    the way they came), but :func:`plan_save` (a model with nothing recorded) does not run it backwards. transformers'
    ``PrefixChange`` and its ``"legacy"`` renamings are of this kind.
    """

    indexed = False

    def __init__(
        self, source_patterns: str | Sequence[str], target_patterns: str | Sequence[str], *, alternative: bool = False
    ):
        self.source_patterns = _as_patterns(source_patterns, "source_patterns")
        self.target_patterns = _as_patterns(target_patterns, "target_patterns", allow_empty=True)
        self.alternative = alternative
        self.scope: tuple[str, str] | None = None
        templates = []
        for pattern in self.target_patterns:
            template = key_template(pattern)
            if template is None:
                raise ConversionError(f"Target pattern {pattern!r} of {type(self).__name__} is not a key template.")
            templates.append(template)
        self._templates = tuple(text for text, _ in templates)
        groups = {group for _, group in templates if group is not None}
        if len(groups) > 1:
            raise ConversionError(f"Target patterns {self.target_patterns} capture different groups {sorted(groups)}.")
        # As in transformers: a source's ``\1`` stands for the targets' captured group, and a source paired with a
        # target anchored at the key's start is anchored too (both matter for inverses).
        sources = []
        for position, pattern in enumerate(self.source_patterns):
            if "\\1" in pattern:
                if not groups:
                    raise ConversionError(
                        f"Source pattern {pattern!r} has \\1, but no target pattern captures a group."
                    )
                pattern = pattern.replace("\\1", next(iter(groups)), 1)
            if len(self.source_patterns) == len(self.target_patterns) and self.target_patterns[position].startswith(
                "^"
            ):
                pattern = pattern if pattern.startswith("^") else "^" + pattern
            sources.append(pattern)
        self._compiled = tuple(compile_key_pattern(p, indexed=self.indexed) for p in sources)
        self._order = tuple(sorted(range(len(sources)), key=lambda i: -len(sources[i])))

    def filtered_by(self, filters: Iterable[re.Pattern[str]]) -> bool:
        """Whether one of ``filters`` (``re.search``) matches one of this transform's source or target patterns: how
        a ``Patcher``'s ``filtered_weight_conversion_patterns`` and a fusion's ``filtered_conversion_patterns`` drop
        conversions."""
        names = (*self.source_patterns, *self.target_patterns)
        return any(f.search(name) for f in filters for name in names)

    def scoped(self, scope_prefix: str, base_model_prefix: str) -> WeightTransform:
        """A copy that only matches keys under sub-model ``scope_prefix`` (optionally after ``base_model_prefix``)."""
        clone = copy.copy(self)
        clone.scope = (scope_prefix, base_model_prefix)
        return clone

    def configured(self, config: object) -> WeightTransform:
        """This transform with what its operations read from the model's config filled in."""
        return self

    def _unscoped(self, key: str) -> tuple[str, str] | None:
        if self.scope is None:
            return "", key
        scope, base = (f"{part}." if part else "" for part in self.scope)
        for prefix in (base + scope, scope):
            if key.startswith(prefix):
                return prefix, key[len(prefix) :]
        return None

    def _search(self, compiled: Sequence[re.Pattern[str]], order: Iterable[int], key: str) -> KeyMatch | None:
        found = self._unscoped(key)
        if found is None:
            return None
        prefix, rest = found
        best: KeyMatch | None = None
        for position in order:
            match = compiled[position].search(rest)
            if match is not None and (best is None or match.start() < best.match.start()):
                best = KeyMatch(position, match, prefix)
        return best

    def match_source(self, key: str) -> KeyMatch | None:
        """Where a source pattern matches ``key``: the leftmost match, the longest pattern on ties."""
        return self._search(self._compiled, self._order, key)

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple:
        return (type(self).__name__, self.source_patterns, self.target_patterns, self.alternative, self.scope)

    def _repr_extra(self) -> str:
        return (", alternative=True" if self.alternative else "") + (f", scope={self.scope!r}" if self.scope else "")


class WeightRenaming(WeightTransform):
    """Rename keys: ``WeightRenaming(r"^visual", "model.visual")``. Several source patterns may share the one target
    (transformers' legacy ``["^model\\.language_model\\.model", ...] -> "model.language_model"``)."""

    def __init__(
        self, source_patterns: str | Sequence[str], target_patterns: str | Sequence[str], *, alternative: bool = False
    ):
        super().__init__(source_patterns, target_patterns, alternative=alternative)
        self._check_counts()

    def _check_counts(self) -> None:
        if len(self.target_patterns) != 1:
            raise ConversionError(f"WeightRenaming takes one target pattern, got {self!r}.")

    def _template(self, position: int) -> str:
        return self._templates[0]

    def rename(self, key: str) -> str | None:
        """The renamed key, or None when no source pattern matches."""
        found = self.match_source(key)
        return None if found is None else found.render(self._template(found.position))

    def _reverse_pairs(self) -> tuple[list[str], list[str]]:
        """Source and target patterns of the renaming that undoes this one (of its first source, when several share
        the target: which one a key came from is unknown)."""
        target_group = next((group for _, group in map(key_template, self.target_patterns) if group), None)  # type: ignore[misc]
        sources, targets = [], []
        for position in self._positions():
            source, target = self.source_patterns[position], self._templates[self._target_position(position)]
            back = key_template(source)
            if back is None:
                raise ConversionError(f"{self!r} cannot be reversed automatically: {source!r} is not a key template.")
            pattern = re.escape(target)
            if "\\1" in target:
                captured = target_group or back[1]
                if captured is None:
                    raise ConversionError(f"{self!r} cannot be reversed automatically: \\1 refers to no group.")
                pattern = pattern.replace(re.escape("\\1"), captured, 1)
            sources.append(("^" if source.startswith("^") else "") + pattern)
            targets.append(back[0])
        return sources, targets

    def _positions(self) -> list[int]:
        return [0]

    def _target_position(self, position: int) -> int:
        return 0

    def reverse(self) -> WeightRenaming:
        """The renaming that undoes this one, for saving in the checkpoint layout (transformers' reverse rules, with
        the inverse's source escaped so that it matches only the text this renaming writes)."""
        sources, targets = self._reverse_pairs()
        inverse = WeightRenaming(sources[0], targets[0], alternative=self.alternative)
        inverse.scope = self.scope
        return inverse

    def inverse(self) -> WeightRenaming:
        """Deprecated spelling of :meth:`reverse` (modelpatch's one verb for undoing a conversion)."""
        warnings.warn(
            f"{type(self).__name__}.inverse() is deprecated; use .reverse().", DeprecationWarning, stacklevel=2
        )
        return self.reverse()

    def __repr__(self) -> str:
        sources = self.source_patterns[0] if len(self.source_patterns) == 1 else list(self.source_patterns)
        return f"{type(self).__name__}({sources!r}, {self.target_patterns[0]!r}{self._repr_extra()})"


class GroupWeightRename(WeightRenaming):
    """Paired renamings (source ``i`` -> target ``i``) applied only to checkpoints that have a key matching the first
    (guard) source: ``norm0 -> norm1`` and ``norm1 -> norm2`` must not both apply to an already converted checkpoint,
    which has ``norm1`` and ``norm2`` but no ``norm0`` (transformers' ``GroupWeightRename``)."""

    def _check_counts(self) -> None:
        if len(self.target_patterns) != len(self.source_patterns):
            raise ConversionError(f"GroupWeightRename pairs each source with a target, got {self!r}.")

    def _template(self, position: int) -> str:
        return self._templates[position]

    def is_guard(self, key: str) -> bool:
        """Whether ``key`` matches the guard pattern (the first source)."""
        found = self.match_source(key)
        return found is not None and found.position == 0

    def _positions(self) -> list[int]:
        return list(range(len(self.source_patterns)))

    def _target_position(self, position: int) -> int:
        return position

    def reverse(self) -> GroupWeightRename:
        sources, targets = self._reverse_pairs()
        # The smallest inverse source is the guard, as transformers orders them.
        pairs = sorted(zip(sources, targets, strict=True))
        inverse = GroupWeightRename([s for s, _ in pairs], [t for _, t in pairs], alternative=self.alternative)
        inverse.scope = self.scope
        return inverse

    def __repr__(self) -> str:
        return f"GroupWeightRename({list(self.source_patterns)!r}, {list(self.target_patterns)!r}{self._repr_extra()})"


class IndexOffsetRenaming(WeightRenaming):
    """A renaming whose ``\\1`` (an integer) is shifted by ``offset``: ``attn_queries.0`` belongs to ``layers.1``
    (transformers' ``Inkling2IndexOffsetWeightRename``)."""

    def __init__(
        self,
        source_patterns: str | Sequence[str],
        target_patterns: str | Sequence[str],
        offset: int,
        *,
        alternative: bool = False,
    ):
        super().__init__(source_patterns, target_patterns, alternative=alternative)
        self.offset = offset

    def rename(self, key: str) -> str | None:
        found = self.match_source(key)
        if found is None:
            return None
        shifted = str(int(found.match.group(1)) + self.offset)
        return found.replace(self._templates[0].replace("\\1", shifted))

    def reverse(self) -> IndexOffsetRenaming:
        sources, targets = self._reverse_pairs()
        inverse = IndexOffsetRenaming(sources[0], targets[0], -self.offset, alternative=self.alternative)
        inverse.scope = self.scope
        return inverse

    def _key(self) -> tuple:
        return (*super()._key(), self.offset)


class LayerPairRenaming(WeightRenaming):
    """Decoder layers a checkpoint stores as pairs of blocks, the attention ``layers.{2i}.mixer`` and the MLP
    ``layers.{2i+1}.mixer`` with their residual rates ``attn_alpha`` / ``mlp_alpha``, renamed to the model's
    ``layers.{i}.self_attn`` / ``mlp`` / ``lambda_1`` / ``lambda_2`` (transformers' ``LayerPairCollapse``);
    ``split=True`` renames back, the attention's rate into the even block and the MLP's into the odd one.

    It describes another layout of the same keys, so it is ``alternative``: a model loaded from that layout saves
    back to it, one never loaded saves the model's layout (as stock, whose reverse leaves the keys alone).
    """

    # The model's name of each block -> (its position in the pair, the checkpoint's name).
    _BLOCKS = {
        "self_attn": (0, "mixer"),
        "mlp": (1, "mixer"),
        "lambda_1": (0, "attn_alpha"),
        "lambda_2": (1, "mlp_alpha"),
    }
    _RATES = {"attn_alpha": "lambda_1", "mlp_alpha": "lambda_2"}

    def __init__(self, split: bool = False):
        self.split = split
        names = self._BLOCKS if split else ("mixer", *self._RATES)
        super().__init__(rf"layers\.(\d+)\.({'|'.join(names)})(?=\.|$)", r"layers.\1", alternative=True)

    def rename(self, key: str) -> str | None:
        found = self.match_source(key)
        if found is None:
            return None
        index, name = int(found.match.group(1)), found.match.group(2)
        if self.split:
            position, stored = self._BLOCKS[name]
            return found.replace(f"layers.{2 * index + position}.{stored}")
        return found.replace(f"layers.{index // 2}.{self._RATES.get(name, ('self_attn', 'mlp')[index % 2])}")

    def reverse(self) -> LayerPairRenaming:
        inverse = LayerPairRenaming(split=not self.split)
        inverse.scope = self.scope
        return inverse

    def __repr__(self) -> str:
        return f"LayerPairRenaming(split={self.split}{self._repr_extra().replace(', alternative=True', '')})"


class PrefixChange(WeightRenaming):
    """Add ``prefix_to_add`` (unless present) or remove ``prefix_to_remove`` right after ``model_prefix``
    (transformers' ``PrefixChange``). It describes another layout of the same keys, so it is ``alternative``."""

    def __init__(
        self, prefix_to_add: str | None = None, prefix_to_remove: str | None = None, model_prefix: str | None = None
    ):
        if (prefix_to_add is None) == (prefix_to_remove is None):
            raise ConversionError("PrefixChange takes exactly one of prefix_to_add and prefix_to_remove.")
        self.prefix_to_add, self.prefix_to_remove, self.model_prefix = (
            prefix_to_add,
            prefix_to_remove,
            model_prefix or "",
        )
        prefix = rf"{self.model_prefix}\." if self.model_prefix else ""
        if prefix_to_add is not None:
            source, target = rf"^{prefix}(?:(?!{prefix_to_add}\.))(.+)", rf"{prefix}{prefix_to_add}\.\1"
        else:
            source, target = rf"^{prefix}{prefix_to_remove}\.(.+)", rf"{prefix}\1"
        super().__init__(source, target, alternative=True)

    def reverse(self) -> PrefixChange:
        inverse = PrefixChange(self.prefix_to_remove, self.prefix_to_add, self.model_prefix)
        inverse.scope = self.scope
        return inverse


class WeightConverter(WeightTransform):
    """Convert a group of checkpoint tensors into runtime tensors through ``operations``.

    Example (the seeds' fused attention)::

        WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])

    and per-expert MoE weights into one 3-D parameter (``*.`` binds the expert index)::

        WeightConverter(["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
                        "mlp.experts.gate_up_proj", [MergeModulelist(dim=0), Concatenate(dim=1)])

    ``alternative=True`` (see :class:`WeightTransform`): the fusions' 3-D experts -> per-expert keys, say.

    ``optional`` names source patterns that a group may lack: the operations get None in their slot. Quantized
    checkpoints need them: a weight's scales are stored beside it only where the weight was quantized. The first
    source pattern cannot be optional (it names the group).
    """

    indexed = True

    def __init__(
        self,
        source_patterns: str | Sequence[str],
        target_patterns: str | Sequence[str],
        operations: Iterable[ConversionOperation] | ConversionOperation = (),
        *,
        alternative: bool = False,
        optional: Iterable[str] = (),
    ):
        super().__init__(source_patterns, target_patterns, alternative=alternative)
        self.optional = frozenset(optional)
        if not self.optional <= set(self.source_patterns[1:]):
            raise ConversionError(
                f"optional patterns {sorted(self.optional - set(self.source_patterns[1:]))} are not source patterns "
                f"after the first of {list(self.source_patterns)}."
            )
        operations = (operations,) if isinstance(operations, ConversionOperation) else tuple(operations)
        for op in operations:
            if not isinstance(op, ConversionOperation):
                raise TypeError(f"WeightConverter operations must be ConversionOperation instances, got {op!r}.")
        self.operations: tuple[ConversionOperation, ...] = operations
        self._compiled_targets = tuple(compile_key_pattern(p, indexed=True) for p in self.target_patterns)
        self._target_order = tuple(
            sorted(range(len(self.target_patterns)), key=lambda i: -len(self.target_patterns[i]))
        )

    def template(self, position: int) -> str:
        """Target ``position`` as a key template."""
        return self._templates[position]

    def match_target(self, key: str) -> KeyMatch | None:
        """Where a target pattern matches a runtime ``key`` (used when saving)."""
        return self._search(self._compiled_targets, self._target_order, key)

    def configured(self, config: object) -> WeightConverter:
        operations = tuple(op.configured(config) for op in self.operations)
        if operations == self.operations:
            return self
        clone = copy.copy(self)
        clone.operations = operations
        return clone

    def _key(self) -> tuple:
        return (*super()._key(), self.operations, self.optional)

    def __repr__(self) -> str:
        return (
            f"WeightConverter(source_patterns={list(self.source_patterns)!r}, "
            f"target_patterns={list(self.target_patterns)!r}, operations={list(self.operations)!r}{self._repr_extra()}"
            f"{f', optional={sorted(self.optional)!r}' if self.optional else ''})"
        )
