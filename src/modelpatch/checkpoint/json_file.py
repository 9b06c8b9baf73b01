"""Bounded reading of the small JSON files of a checkpoint (``config.json``, shard indexes, generation config).

A few kilobytes of crafted JSON can cost gigabytes once parsed and acted on: deep nesting exhausts the parser's
recursion, a thousand-digit integer costs quadratic time to convert, and a count such as ``num_hidden_layers`` makes
transformers build lists and modules of that length. Every such file is therefore read with a size cap, and its
nesting depth and integers are bounded, before anything else looks at it.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from modelpatch.errors import CheckpointError

MAX_CONFIG_BYTES = 16 * 2**20
"""Cap on ``config.json`` and ``generation_config.json``: real ones are a few kilobytes."""

MAX_INDEX_BYTES = 64 * 2**20
"""Cap on a shard index: the largest public ones (100k+ tensors, trillion-parameter models) are about 15 MB."""

MAX_JSON_DEPTH = 32
"""Deepest nesting of objects and arrays accepted; real configs nest five or six levels."""

_MAX_INTEGER_DIGITS = 19  # int64 has 19 digits: no tensor size, count or id needs more


def read_json(path: Path, max_bytes: int, fd: int | None = None) -> Any:
    """Parse JSON file ``path`` (read from ``fd``, which is then closed, when given).

    Raises:
        CheckpointError: naming ``path``, when it is not a regular file, is larger than ``max_bytes``, is not UTF-8
            JSON, nests deeper than :data:`MAX_JSON_DEPTH` or holds an integer of more than 19 digits.
    """
    try:
        if fd is None:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO never blocks
        with os.fdopen(fd, "rb") as f:
            status = os.fstat(f.fileno())
            if not stat.S_ISREG(status.st_mode):
                raise CheckpointError(f"{path}: not a regular file")
            if status.st_size > max_bytes:
                raise CheckpointError(f"{path}: {status.st_size} bytes is more than the {max_bytes}-byte limit")
            raw = f.read(max_bytes + 1)  # the file may have grown since fstat
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it: {exc}") from exc
    if len(raw) > max_bytes:
        raise CheckpointError(f"{path}: more than the {max_bytes}-byte limit")
    return parse_json(path, raw)


def parse_json(path: Path, raw: bytes, *, unique_keys: bool = False) -> Any:
    """Parse ``raw``, the content of ``path``, with the depth and integer bounds of :func:`read_json`.

    ``unique_keys``: an object with the same key twice is refused too (JSON parsers keep the last one silently).

    Raises:
        CheckpointError: naming ``path``, when ``raw`` is not UTF-8 JSON, nests deeper than :data:`MAX_JSON_DEPTH`
            (however deep: past the parser's own recursion limit too), holds an integer of more than 19 digits or,
            with ``unique_keys``, a duplicate key.
    """

    def bounded_int(literal: str) -> int:
        if len(literal.lstrip("-")) > _MAX_INTEGER_DIGITS:
            raise CheckpointError(f"{path}: the integer {literal[:24]}... has {len(literal)} digits (at most 19)")
        return int(literal)

    try:
        value = json.loads(
            raw.decode("utf-8"), parse_int=bounded_int, object_pairs_hook=_unique_keys if unique_keys else None
        )
    except CheckpointError:
        raise
    except RecursionError:
        raise CheckpointError(f"{path}: nested too deeply to parse (at most {MAX_JSON_DEPTH} levels)") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    _check_depth(path, value)
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _check_depth(path: Path, value: Any) -> None:
    """Refuse nesting deeper than :data:`MAX_JSON_DEPTH` (iteratively: the check itself must not recurse)."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > MAX_JSON_DEPTH:
            raise CheckpointError(f"{path}: nested {depth} levels deep (at most {MAX_JSON_DEPTH})")
        pending.extend((child, depth + 1) for child in children)
