"""Declarative weight transforms: ``WeightRenaming`` and ``WeightConverter`` (seed vocabulary).

Patterns are regular expressions searched (``re.search``) in dotted parameter names, with one addition: a dotted
segment that is exactly ``*`` stands for an integer index (a layer or an expert) and is captured. What a pattern
matched is replaced by the target pattern; the rest of the key is kept, so ``["q_proj", "k_proj", "v_proj"] ->
["qkv_proj"]`` turns ``model.layers.3.self_attn.q_proj.weight`` (with its ``k``/``v`` siblings) into
``model.layers.3.self_attn.qkv_proj.weight``, and the same converter handles the ``.bias`` keys.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from ..errors import ConversionError
from .operations import ConversionOperation

_INDEX_SEGMENT = re.compile(r"(?:(?<=\.)|^)\*(?=\.|$)")
_INDEX_GROUP = "(?P<index>\\d+)"
_LOOKAROUND = re.compile(r"\(\?<?[=!][^()]*(?:\([^()]*\)[^()]*)*\)")


def _as_patterns(value: str | Sequence[str], what: str, allow_empty: bool = False) -> tuple[str, ...]:
    patterns = (value,) if isinstance(value, str) else tuple(value)
    if not patterns or not all(isinstance(p, str) and (p or allow_empty) for p in patterns):
        raise ConversionError(f"{what} must be a non-empty string or list of non-empty strings, got {value!r}.")
    return patterns


def compile_key_pattern(pattern: str) -> re.Pattern[str]:
    """Compile a key pattern, turning a ``*`` segment into a captured integer index."""
    if len(_INDEX_SEGMENT.findall(pattern)) > 1:
        raise ConversionError(f"Pattern {pattern!r} has more than one '*' index segment.")
    try:
        return re.compile(_INDEX_SEGMENT.sub(lambda _: _INDEX_GROUP, pattern))
    except re.error as exc:
        raise ConversionError(f"Invalid key pattern {pattern!r}: {exc}.") from None


def has_index(pattern: str) -> bool:
    return bool(_INDEX_SEGMENT.search(pattern))


def render_target(template: str, match: re.Match[str], index: int | str | None = None) -> str:
    """Replace ``match``'s span in its key by ``template`` (``\\1`` back-references and a ``*`` index filled in)."""
    if index is not None:
        template = _INDEX_SEGMENT.sub(str(index), template)
    elif has_index(template):
        raise ConversionError(f"Target pattern {template!r} has a '*' index but the source gives none.")
    key = match.string
    return key[: match.start()] + match.expand(template) + key[match.end() :]


def literal_form(pattern: str) -> str | None:
    """The plain text a simple pattern stands for (anchors and look-arounds dropped), or None if it has wildcards."""
    text = _LOOKAROUND.sub("", pattern).removeprefix("^").removesuffix("$")
    text = re.sub(r"\\(.)", lambda m: "\x00" + m.group(1), text)
    if re.search(r"[\[\]()*+?{}|\\]", text.replace("\x00", "")):
        return None
    return text.replace("\x00", "")


class WeightTransform:
    """Base of :class:`WeightRenaming` and :class:`WeightConverter`."""

    def __init__(self, source_patterns: str | Sequence[str], target_patterns: str | Sequence[str]):
        self.source_patterns = _as_patterns(source_patterns, "source_patterns")
        self.target_patterns = _as_patterns(target_patterns, "target_patterns", allow_empty=True)
        self._compiled = tuple(compile_key_pattern(p) for p in self.source_patterns)

    def match_source(self, key: str) -> tuple[int, re.Match[str]] | None:
        """The first source pattern that matches ``key``, with its match."""
        for position, pattern in enumerate(self._compiled):
            if (match := pattern.search(key)) is not None:
                return position, match
        return None

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple:
        return (type(self).__name__, self.source_patterns, self.target_patterns)


class WeightRenaming(WeightTransform):
    """Rename keys: ``WeightRenaming(r"^visual", "model.visual")``. Back-references (``\\1``) are allowed."""

    def __init__(self, source_patterns: str | Sequence[str], target_patterns: str | Sequence[str]):
        super().__init__(source_patterns, target_patterns)
        if len(self.source_patterns) != 1 or len(self.target_patterns) != 1:
            raise ConversionError(f"WeightRenaming takes one source and one target pattern, got {self!r}.")

    def rename(self, key: str) -> str | None:
        """The renamed key, or None when the pattern does not match."""
        match = self._compiled[0].search(key)
        return None if match is None else render_target(self.target_patterns[0], match)

    def inverse(self) -> WeightRenaming:
        """The renaming that undoes this one, for saving in the checkpoint layout.

        Only defined when both patterns stand for plain text (anchors and look-arounds allowed in the source).
        """
        source, target = literal_form(self.source_patterns[0]), literal_form(self.target_patterns[0])
        if source is None or target is None or "\\" in self.target_patterns[0]:
            raise ConversionError(f"{self!r} cannot be reversed automatically: its patterns are not plain text.")
        anchored = self.source_patterns[0].startswith("^")
        return WeightRenaming(("^" if anchored else "") + re.escape(target), source)

    def __repr__(self) -> str:
        return f"WeightRenaming({self.source_patterns[0]!r}, {self.target_patterns[0]!r})"


class WeightConverter(WeightTransform):
    """Convert a group of checkpoint tensors into runtime tensors through ``operations``.

    Example (the seeds' fused attention)::

        WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])

    and per-expert MoE weights into one 3-D parameter::

        WeightConverter(["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
                        "mlp.experts.gate_up_proj", [MergeModulelist(dim=0), Concatenate(dim=1)])

    ``alternative=True`` declares that the targets already are a checkpoint layout (the one the model saves to) and
    the sources another layout some checkpoints use (per-expert keys vs. 3-D ones, say). A load converts what it
    finds and records it, so saving writes those keys back the way they came; a model with nothing recorded (built
    with ``from_config``, or reloaded from a runtime-layout save) is saved in the target layout: :func:`plan_save`
    does not run the converter backwards.

    ``optional`` names source patterns that a group may lack: the operations get None in their slot. Quantized
    checkpoints need them: a weight's scales are stored beside it only where the weight was quantized. The first
    source pattern cannot be optional (it names the group).
    """

    def __init__(
        self,
        source_patterns: str | Sequence[str],
        target_patterns: str | Sequence[str],
        operations: Iterable[ConversionOperation] | ConversionOperation = (),
        *,
        alternative: bool = False,
        optional: Iterable[str] = (),
    ):
        super().__init__(source_patterns, target_patterns)
        self.alternative = alternative
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
        self._compiled_targets = tuple(compile_key_pattern(p) for p in self.target_patterns)

    def match_target(self, key: str) -> tuple[int, re.Match[str]] | None:
        """The first target pattern that matches a runtime ``key``, with its match (used when saving)."""
        for position, pattern in enumerate(self._compiled_targets):
            if (match := pattern.search(key)) is not None:
                return position, match
        return None

    def _key(self) -> tuple:
        return (*super()._key(), self.operations, self.alternative, self.optional)

    def __repr__(self) -> str:
        return (
            f"WeightConverter(source_patterns={list(self.source_patterns)!r}, "
            f"target_patterns={list(self.target_patterns)!r}, operations={list(self.operations)!r}"
            f"{', alternative=True' if self.alternative else ''}"
            f"{f', optional={sorted(self.optional)!r}' if self.optional else ''})"
        )
