"""No module imports a higher layer (docs/ARCHITECTURE.md), read from the sources.

Every module of ``src/modelpatch`` is parsed with ``ast``; each import of the package (absolute or relative, at
module level, under ``TYPE_CHECKING`` or inside a function) is resolved to the module it names and checked against
the layers, bottom-up:

* ``errors.py``, ``state.py``, ``registry.py``, ``_transformers.py``, ``_peft.py``, ``_torch.py``, ``_doors.py``,
  ``_installs.py`` and ``_border.py`` sit beside the layers: every layer may import them, they import only each other;
* ``checkpoint/`` (file I/O), then ``conversion/`` (tensors; it may read checkpoints, never the reverse), then
  ``_transformers_mapping.py`` (transformers' conversion objects, translated);
* ``patching/``, then ``fusions/`` (a fusion is a class patch with transforms);
* the pipelines: ``loading/``, ``saving/``, ``modes/``, ``boundary/``, ``restructuring/`` (importing each other, without
  circles);
* the user API: ``__init__.py``, ``auto.py``, ``verify.py``, ``cli/``, ``integrations/`` (importing each other).

No module imports another that imports it back, directly or through others, by any import: at module level, inside
a function (which runs when called), under ``if TYPE_CHECKING:``, or through ``importlib.import_module`` of a name
written in the module (a literal, a module-level constant, a loop over one; what a user names at run time is not
followed). A type-checking import never runs, but it ties
the two modules together all the same: neither can be read, moved or type-checked without the other.
"""

from __future__ import annotations

import ast
import importlib.util
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
    "_torch": 0,
    "_doors": 0,
    "_border": 0,
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
    strings = _Strings(tree, name, package)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_import_module(node.func):
            found.update(strings.imported(node))
        elif isinstance(node, ast.Import):
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


def _is_import_module(func: ast.expr) -> bool:
    """``importlib.import_module`` or ``import_module`` (imported from ``importlib``)."""
    if isinstance(func, ast.Attribute):
        return func.attr == "import_module" and isinstance(func.value, ast.Name) and func.value.id == "importlib"
    return isinstance(func, ast.Name) and func.id == "import_module"


class _Strings:
    """The strings an expression of one module can be, where they are written in that module: literals, module-level
    constants (a name, a tuple, list or dict of them, ``dict.fromkeys``, an item of one), the variable of a ``for``
    loop over such a constant, ``__name__`` / ``__package__``, and f-strings or sums of these. Anything else (a
    name a user typed, read at run time) is unknown: None."""

    def __init__(self, tree: ast.Module, name: str, package: str):
        self.special = {"__name__": name, "__package__": package}
        self.constants: dict[str, ast.expr] = {}
        for statement in tree.body:
            if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
                target, value = statement.targets[0], statement.value
            elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
                target, value = statement.target, statement.value
            else:
                continue
            if isinstance(target, ast.Name):
                self.constants[target.id] = value
        self.loops: dict[str, list[ast.expr]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.For | ast.comprehension) and isinstance(node.target, ast.Name):
                self.loops.setdefault(node.target.id, []).append(node.iter)

    def values(self, node: ast.expr | None, seen: frozenset[str] = frozenset()) -> set[str] | None:
        if isinstance(node, ast.Constant):
            return {node.value} if isinstance(node.value, str) else None
        if isinstance(node, ast.Name):
            if node.id in self.special:
                return {self.special[node.id]}
            if node.id in seen:
                return None
            sources = self.loops.get(node.id) or ([self.constants[node.id]] if node.id in self.constants else [])
            return self._union([self.values(source, seen | {node.id}) for source in sources])
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return self._union([self.values(element, seen) for element in node.elts])
        if isinstance(node, ast.Dict):  # the values (an item read by key); {**other} adds the other's
            return self._union([self.values(value, seen) for value in node.values])
        if isinstance(node, ast.Subscript):
            return self.values(node.value, seen)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "fromkeys":
            return self.values(node.args[1], seen) if len(node.args) == 2 else None
        if isinstance(node, ast.JoinedStr | ast.BinOp):
            parts = node.values if isinstance(node, ast.JoinedStr) else [node.left, node.right]
            if isinstance(node, ast.BinOp) and not isinstance(node.op, ast.Add):
                return None
            results: set[str] | None = {""}
            for part in parts:
                value = self.values(part.value if isinstance(part, ast.FormattedValue) else part, seen)
                results = None if value is None or results is None else {a + b for a in results for b in value}
            return results
        return None

    @staticmethod
    def _union(groups: list[set[str] | None]) -> set[str] | None:
        if not groups or any(group is None for group in groups):
            return None
        return set().union(*groups)  # type: ignore[arg-type]

    def imported(self, call: ast.Call) -> set[str]:
        """The modules an ``import_module(name, package)`` call can import (none when the name is unknown)."""
        package_arg = (
            call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "package"), None)
        )
        names = self.values(call.args[0]) if call.args else None
        packages = {None} if package_arg is None else self.values(package_arg)
        if names is None or packages is None:
            return set()
        return {importlib.util.resolve_name(n, p) if n.startswith(".") else n for n in names for p in packages}


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


def test_import_module_of_a_name_written_in_the_module_is_followed(tmp_path):
    """``importlib.import_module`` is an import too: of a literal, a module-level constant (relative to
    ``__name__``, an item of a dict, a loop over a tuple, an f-string) it is an edge like any other, so the circle
    it closes is found; a name read at run time is not followed."""
    root = tmp_path / PACKAGE
    (root / "conversion").mkdir(parents=True)
    files = {
        "__init__.py": "import importlib\n_LAZY = {**dict.fromkeys(['x'], '.a')}\n"
        "def __getattr__(name):\n    return importlib.import_module(_LAZY[name], __name__)\n",
        "a.py": "",
        "conversion/__init__.py": "",
        # registry -> border through a constant, border -> registry: the circle of the border's provider hook.
        "conversion/registry.py": "import importlib\n_BORDER = 'modelpatch.border'\n"
        "def lookup():\n    importlib.import_module(_BORDER)\n",
        "border.py": "from .conversion import registry\n",
        "b.py": "from importlib import import_module\nNAMES = ('c', 'd')\n"
        "for n in NAMES:\n    import_module(f'{__package__}.{n}')\n",
        "c.py": "",
        "d.py": "import importlib, sys\nimportlib.import_module(sys.argv[1])\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)
    modules = package_modules(root)
    assert imported_modules(root / "__init__.py", "modelpatch", set(modules)) == {"modelpatch.a"}
    assert imported_modules(root / "b.py", "modelpatch.b", set(modules)) == {"modelpatch.c", "modelpatch.d"}
    assert imported_modules(root / "d.py", "modelpatch.d", set(modules)) == set()
    assert import_circles(root) == [["modelpatch.border", "modelpatch.conversion.registry"]]
