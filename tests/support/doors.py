"""The name scan of the door tests (``tests/test_transformers_door.py``, ``tests/test_peft_door.py``): where a module
uses a package's private API."""

from __future__ import annotations

import ast
from collections.abc import Callable, Collection
from pathlib import Path


def private_uses(
    path: Path, root: Path, package: str, private_names: Collection[str], public_import: Callable[[str], bool]
) -> list[str]:
    """Each use of ``package``'s private API in the module at ``path`` (named relative to ``root``), as ``file:line:
    what``: an import from one of its submodules, a name imported from it that ``public_import`` rejects, and one of
    its ``private_names`` read (``.name``) or spelled (``"name"``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith(f"{package}."):
                found.append(f"{where}: from {node.module} import ...")
            elif node.module == package:
                found += [f"{where}: from {package} import {a.name}" for a in node.names if not public_import(a.name)]
        elif isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if a.name.startswith(f"{package}.")]
        elif isinstance(node, ast.Attribute) and node.attr in private_names:
            found.append(f"{where}: .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in private_names:
            found.append(f"{where}: {node.value!r}")
    return found


def assert_only_the_door_uses(root: Path, door: Path, scan: Callable[[Path], list[str]]) -> None:
    """Fail, listing each use, where ``scan`` finds private API in a module under ``root`` other than the ``door``."""
    outside = [use for path in sorted(root.rglob("*.py")) if path != door for use in scan(path)]
    assert outside == [], f"private API outside modelpatch/{door.name}:\n" + "\n".join(outside)


def required_paths(node: ast.AST) -> list[str]:
    """The ``PRIVATE_API`` paths code under ``node`` passes to the door's ``require`` / ``available`` (literals)."""
    return [
        arg.value
        for call in ast.walk(node)
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in {"require", "available"}
        for arg in call.args
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
    ]
