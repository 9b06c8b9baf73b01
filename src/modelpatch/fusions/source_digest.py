"""An identity of Python source code that does not depend on the interpreter reading it.

A fusion family that reproduces what a stock module computes recognises the stock forwards it knows by a digest of
their syntax trees (formatting, comments and the docstring do not change it). ``ast.dump`` cannot be that digest: its
text changes with the Python release (3.12 adds ``type_params=[]`` to every function, 3.13 leaves empty fields out),
so a table computed on one interpreter would match nothing on another. :func:`tree_text` writes a tree the same way
on every supported release: node names and non-empty fields, in field-name order.

This module imports nothing beyond the standard library, so the tests can load it by path in every interpreter the
machine has (without torch or modelpatch) and check that the digests agree.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
from collections.abc import Callable, Iterable
from typing import Any


def tree_text(node: object) -> str:
    """``node`` written out: the node's class name and its fields in name order, leaving out fields that are None or
    empty lists (which releases add or drop without changing what the code means)."""
    if isinstance(node, ast.AST):
        fields = []
        for name in sorted(node._fields):
            value = getattr(node, name, None)
            if value is None or (isinstance(value, list) and not value):
                continue
            fields.append(f"{name}={tree_text(value)}")
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return f"[{', '.join(tree_text(item) for item in node)}]"
    return repr(node)


def function_tree(source: str) -> str:
    """The :func:`tree_text` of the first function or class defined in ``source`` (indented as in its class or not),
    its docstring left out."""
    node = ast.parse(textwrap.dedent(source)).body[0]
    body = getattr(node, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        node.body = body[1:]  # type: ignore[attr-defined]
    return tree_text(node)


def sources_digest(sources: Iterable[str]) -> str:
    """A 16-hex-digit digest of the trees of ``sources`` (each the source of one function), in order."""
    return hashlib.sha256("\n".join(function_tree(s) for s in sources).encode()).hexdigest()[:16]


def wrapped_sources(function: Callable[..., Any]) -> list[str]:
    """The source of ``function`` and of every function it wraps (``__wrapped__``, as ``functools.wraps`` sets it),
    outermost first. ``OSError`` / ``TypeError`` when one cannot be read."""
    found: list[str] = []
    current: Any = function
    while current is not None:
        found.append(inspect.getsource(current))
        current = getattr(current, "__wrapped__", None)
    return found


def function_digest(function: Callable[..., Any]) -> str | None:
    """The digest of ``function`` and of every function it wraps, or None when a source cannot be read or parsed."""
    try:
        return sources_digest(wrapped_sources(function))
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
