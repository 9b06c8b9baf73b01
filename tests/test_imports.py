"""No module imports a higher layer (docs/ARCHITECTURE.md), read from the sources.

Every module of ``src/modelpatch`` is parsed with ``ast``; each import of the package (absolute or relative, at
module level, under ``TYPE_CHECKING`` or inside a function) is resolved to the module it names and checked against
the layers, bottom-up:

* ``errors.py``, ``state.py``, ``registry.py``, ``_transformers.py``, ``_peft.py`` and ``_installs.py`` sit beside
  the layers: every layer may import them, they import only each other;
* ``checkpoint/`` (file I/O), then ``conversion/`` (tensors; it may read checkpoints, never the reverse), then
  ``_transformers_mapping.py`` (transformers' conversion objects, translated);
* ``patching/``, then ``fusions/`` (a fusion is a class patch with transforms);
* the pipelines: ``loading/``, ``saving/``, ``modes/``, ``boundary/``, ``restructuring/`` (importing each other, without
  circles);
* the user API: ``__init__.py``, ``auto.py``, ``verify.py``, ``cli/``, ``integrations/`` (importing each other).

No module imports another that imports it back, directly or through others, by any import: at module level, inside
a function (which runs when called) or under ``if TYPE_CHECKING:``. A type-checking import never runs, but it ties
the two modules together all the same: neither can be read, moved or type-checked without the other.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = "modelpatch"
SOURCE = Path(__file__).resolve().parents[1] / "src" / PACKAGE

# The rank of each top-level module or sub-package of modelpatch: a module may import ranks up to its own.
LAYERS: dict[str, float] = {
    "errors": 0,
    "state": 0,
    "registry": 0,
    "_transformers": 0,
    "_installs": 0,
    "_peft": 0,
    "checkpoint": 1,
    "conversion": 2,
    # The border where transformers' conversion objects enter: above conversion/, which never imports it (and
    # imports no transformers at all, test_conversion_imports_no_transformers), below what hands it transforms.
    "_transformers_mapping": 2.5,
    "patching": 3,
    "fusions": 4,
    # The pipelines, one concept a folder: the load, the save, the modes both run, the state-dict boundary, the
    # restructuring of a live model.
    "loading": 5,
    "saving": 5,
    "modes": 5,
    "boundary": 5,
    "restructuring": 5,
    "": 6,  # modelpatch/__init__.py
    "auto": 6,
    "verify": 6,
    "cli": 6,
    "integrations": 6,
    "testing": 6,
}


def module_name(path: Path, root: Path = SOURCE) -> str:
    """``modelpatch.loading.build`` for ``src/modelpatch/loading/build.py`` (a package for its ``__init__.py``)."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(root: Path = SOURCE) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def imported_modules(path: Path, name: str, known: set[str]) -> set[str]:
    """The modules of the package that module ``name`` (the file ``path``) imports, anywhere in its body (under
    ``if TYPE_CHECKING:`` too).

    ``from X import y`` names module ``X.y`` when that is a module of the package (``from . import registry``),
    else ``X`` itself.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, node.module] if node.module else anchor)
            else:
                base = node.module or ""
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in known else base)
    return {module for module in found if module == PACKAGE or module.startswith(PACKAGE + ".")}


def layer(module: str) -> float:
    """The rank of ``module``; a module outside every layer fails the test, so that a new one gets placed."""
    top = module.split(".")[1] if "." in module else ""
    if top not in LAYERS:
        pytest.fail(f"{module} belongs to no layer: add {top!r} to LAYERS in tests/test_imports.py")
    return LAYERS[top]


def upward_imports(root: Path = SOURCE) -> list[tuple[str, str]]:
    modules = package_modules(root)
    edges = sorted(
        (name, target) for name, path in modules.items() for target in imported_modules(path, name, set(modules))
    )
    return [(name, target) for name, target in edges if layer(target) > layer(name)]


def test_no_module_imports_a_higher_layer():
    violations = upward_imports()
    assert not violations, "imports from a higher layer:\n" + "\n".join(f"  {a} -> {b}" for a, b in violations)


def test_imports_inside_functions_and_relative_ones_are_resolved(tmp_path):
    """The walker sees what the check relies on: a relative import two levels up, inside a function."""
    root = tmp_path / PACKAGE
    (root / "fusions").mkdir(parents=True)
    (root / "loading").mkdir()
    for name in ("__init__.py", "fusions/__init__.py", "loading/__init__.py", "loading/build.py", "state.py"):
        (root / name).write_text("")
    (root / "fusions" / "apply.py").write_text(
        "from .. import state\n\n\ndef prepare():\n    from ..loading.build import build_empty_model\n"
    )
    modules = package_modules(root)
    found = imported_modules(root / "fusions" / "apply.py", "modelpatch.fusions.apply", set(modules))
    assert found == {"modelpatch.state", "modelpatch.loading.build"}
    assert upward_imports(root) == [("modelpatch.fusions.apply", "modelpatch.loading.build")]


def import_circles(root: Path = SOURCE) -> list[list[str]]:
    """Every circle of imports among the package's modules (as its strongly connected groups, each sorted)."""
    modules = package_modules(root)
    graph = {
        name: sorted(target for target in imported_modules(path, name, set(modules)) if target != name)
        for name, path in modules.items()
    }
    # Tarjan's algorithm, iterative: a group of more than one module is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, position = work.pop()
            if position == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            targets = [t for t in graph[node] if t in graph]
            if position < len(targets):
                work.append((node, position + 1))
                target = targets[position]
                if target not in index:
                    work.append((target, 0))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    circles.append(sorted(group))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return sorted(circles)


def test_no_import_circle():
    circles = import_circles()
    listed = "\n".join("  " + " <-> ".join(group) for group in circles)
    assert not circles, f"modules importing each other (module level, in functions or under TYPE_CHECKING):\n{listed}"


def test_circles_are_found_through_functions_and_type_checking_imports(tmp_path):
    root = tmp_path / PACKAGE
    (root / "loading").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "loading/__init__.py": "",
        # a -> b at module level, b -> c in a function, c -> a at module level: one circle of three.
        "loading/a.py": "from .b import f\n",
        "loading/b.py": "def f():\n    from .c import g\n",
        "loading/c.py": "from . import a\n",
        # d <-> e and f <-> g through type-checking imports (either spelling): circles too.
        "loading/d.py": "from .e import h\n",
        "loading/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import x\ndef h(): pass\n",
        "loading/f.py": "from .g import h\n",
        "loading/g.py": "import typing\nif typing.TYPE_CHECKING:\n    from . import f\ndef h(): pass\n",
        # i -> j only: no circle.
        "loading/i.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .j import k\n",
        "loading/j.py": "k = 1\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)
    assert import_circles(root) == [
        ["modelpatch.loading.a", "modelpatch.loading.b", "modelpatch.loading.c"],
        ["modelpatch.loading.d", "modelpatch.loading.e"],
        ["modelpatch.loading.f", "modelpatch.loading.g"],
    ]


@pytest.mark.parametrize("module", ["modelpatch.conversion", "modelpatch.conversion.operations"])
def test_conversion_imports_no_transformers(module):
    """The conversion layer is pure tensor code: transformers' objects are translated above it, where they enter."""
    code = f"import sys, {module}; assert 'transformers' not in sys.modules, 'transformers imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_child_env())
    assert result.returncode == 0, result.stderr


def test_a_lookup_imports_the_border_that_provides_the_builtin_mappings():
    """The lazy hook: a lookup made before anything imported the border module still sees transformers' registry."""
    code = (
        "import sys\n"
        "from modelpatch.conversion import get_checkpoint_conversion_mapping\n"
        "assert 'modelpatch._transformers_mapping' not in sys.modules\n"
        "assert get_checkpoint_conversion_mapping('mixtral'), 'no built-in mapping'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_child_env())
    assert result.returncode == 0, result.stderr


def _child_env() -> dict[str, str]:
    """This process's environment, with the source tree this test module reads first on the path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SOURCE.parent), os.environ.get("PYTHONPATH", "")])}


# Each module imported first, in a process where no module of modelpatch is imported yet (torch and transformers are:
# they are what takes the time, and modelpatch never re-initialises them).
_IMPORT_EACH_FIRST = """
import importlib, sys, traceback
import torch, transformers
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "modelpatch" or m.startswith("modelpatch.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        print(f"{name}: {traceback.format_exc(limit=-1).strip().splitlines()[-1]}")
"""


def test_every_module_imports_first_in_a_fresh_process():
    """What pickle (or a user) does in a new process: import the one module a class lives in. The package
    ``__init__`` modules that this runs first must import nothing that comes back to the module half-initialised,
    a circle that runs only through packages and so escapes the module-level check above."""
    modules = sorted(name for name in package_modules() if not name.endswith(".__main__"))  # __main__ runs the CLI
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH_FIRST, *modules], capture_output=True, text=True, env=_child_env()
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "", "modules that fail when imported first:\n" + result.stdout
