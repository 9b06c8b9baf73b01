"""Every use of torch's private API goes through ``modelpatch/_torch.py`` (the torch door), which lists each name
with the first torch release that has it, and the door's functions do what torch does on this release."""

from __future__ import annotations

import ast
import collections
import importlib
import re
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from packaging.version import Version
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

import modelpatch
from modelpatch import TorchVersionError
from modelpatch import _torch as door
from support.doors import assert_only_the_door_uses, required_paths

ROOT = Path(__file__).resolve().parents[1]
SOURCE = Path(modelpatch.__file__).parent
DOOR = SOURCE / "_torch.py"
INSTALLED = Version(torch.__version__.split("+")[0])


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


# torch's private names modelpatch code could touch: the members of nn.Module and Tensor, what nn.Module.__init__
# sets on every instance, the state dict's marker, and the module-level names the door reads; less the nn.Module
# internals the door lists as read directly (MODULE_INTERNALS).
PRIVATE_NAMES = (
    {
        name
        for cls in (nn.Module, torch.Tensor)
        for name in dir(cls)
        if name.startswith("_") and not name.startswith("__")
    }
    | {name for name in vars(nn.Linear(1, 1)) if name.startswith("_")}
    | {"_metadata"}
    | {path.rpartition(":")[2].rpartition(".")[2] for path in door.PRIVATE_API}
) - set(door.MODULE_INTERNALS)


def _torch_aliases(tree: ast.Module) -> set[str]:
    """The names a module binds to torch or one of its modules (``torch``, ``nn``, ``dist``, ``torch_module``)."""
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name.partition(".")[0] for a in node.names if a.name.partition(".")[0] == "torch"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").partition(".")[0] == "torch":
            parent = importlib.import_module(node.module or "")
            modules = (a for a in node.names if isinstance(getattr(parent, a.name, None), types.ModuleType))
            aliases |= {a.asname or a.name for a in modules}
    return aliases


def _violations(path: Path, root: Path = SOURCE) -> list[str]:
    """Each use of torch's private API in the module at ``path``: an import of a private torch module or name, a
    private attribute of torch or of one of its modules, one of torch's private names read (``.name``), spelled
    (``"name"``) or overridden (a method ``def name``)."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = _torch_aliases(tree)
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [
                f"{where}: import {a.name}" for a in node.names if a.name.startswith("torch.") and _private(a.name)
            ]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").partition(".")[0] == "torch":
            found += [
                f"{where}: from {node.module} import {a.name}"
                for a in node.names
                if _private(node.module or "") or _private(a.name)
            ]
        elif isinstance(node, ast.Attribute):
            base = node
            while isinstance(base, ast.Attribute):
                base = base.value  # type: ignore[assignment]
            if node.attr in PRIVATE_NAMES or (
                isinstance(base, ast.Name) and base.id in aliases and _private(node.attr)
            ):
                found.append(f"{where}: .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in PRIVATE_NAMES:
            found.append(f"{where}: {node.value!r}")
        elif isinstance(node, ast.ClassDef):
            found += [
                f"{where}: def {item.name}"
                for item in node.body
                if isinstance(item, ast.FunctionDef) and item.name in PRIVATE_NAMES
            ]
    return found


def test_the_private_names_are_known_to_this_torch():
    # The scan is only as good as this list: it must hold torch's real private names, and leave modelpatch's own out.
    assert {"_forward_hooks", "_load_state_dict_pre_hooks", "_backward_hooks", "_grouped_mm", "_WrappedHook"} <= (
        PRIVATE_NAMES
    )
    assert {"_parameters", "_apply"}.isdisjoint(PRIVATE_NAMES)  # listed as read directly


def test_no_module_but_the_door_uses_torch_private_api():
    assert_only_the_door_uses(SOURCE, DOOR, _violations)


def test_the_scan_finds_private_uses(tmp_path):
    found = _violations(DOOR)
    assert any("._forward_hooks" in v for v in found) and any("'_post_accumulate_grad_hooks'" in v for v in found)
    assert any("._global_forward_hooks" in v for v in found) and any("._is_full_backward_hook" in v for v in found)
    # The spellings the door's own code does not use.
    module = tmp_path / "probe.py"
    module.write_text(
        "import torch\nimport torch._dynamo\nfrom torch import nn\nfrom torch.nn.modules import module as mod\n"
        "from torch.nn.modules.module import _WrappedHook\nfrom torch._prims_common import check\n"
        "x = torch._grouped_mm\ny = mod._global_forward_hooks\nw = m._forward_hooks\n"
        "kept = m._parameters\nmine = self._lock\n"
        "class M(nn.Module):\n    def _load_from_state_dict(self, *args):\n        pass\n"
        "    def _apply(self, fn, recurse=True):\n        return super()._apply(fn, recurse)\n"
    )
    assert sorted(v.partition(": ")[2] for v in _violations(module, tmp_path)) == [
        "._forward_hooks",
        "._global_forward_hooks",
        "._grouped_mm",
        "def _load_from_state_dict",
        "from torch._prims_common import check",
        "from torch.nn.modules.module import _WrappedHook",
        "import torch._dynamo",
    ]


def _pin(name: str) -> str:
    line = next(line for line in (ROOT / ".ci" / name).read_text().splitlines() if line.startswith("torch=="))
    return line.partition("==")[2].strip()


def test_the_door_claims_the_releases_ci_runs():
    """CHECKED is the lowest and the newest torch CI runs: moving CI to another release means auditing the door."""
    assert door.CHECKED == (_pin("constraints-lowest.txt"), _pin("constraints.txt"))


def _functions(tree: ast.Module) -> list[ast.FunctionDef]:
    return [node for node in tree.body if isinstance(node, ast.FunctionDef)]


def test_every_door_function_names_the_releases_it_was_checked_against():
    tree = ast.parse(DOOR.read_text())
    # Every function but the lookup itself reaches a private name (some through the tables of hook dicts).
    functions = [f for f in _functions(tree) if f.name not in {"require", "available"}]
    assert len([f for f in functions if required_paths(f) or _violations_in(f)]) >= 8
    claim = f"Checked against {door.CHECKED[0]}–{door.CHECKED[1]}"
    assert [f.name for f in functions if claim not in (ast.get_docstring(f) or "")] == []


def _violations_in(node: ast.AST) -> list[str]:
    return [
        sub.attr if isinstance(sub, ast.Attribute) else sub.value
        for sub in ast.walk(node)
        if (isinstance(sub, ast.Attribute) and sub.attr in PRIVATE_NAMES)
        or (isinstance(sub, ast.Constant) and sub.value in PRIVATE_NAMES)
    ]


def test_every_private_name_the_door_uses_is_listed():
    tree = ast.parse(DOOR.read_text())
    required = required_paths(tree)
    assert required and set(required) <= door.PRIVATE_API.keys()
    listed = {path.rpartition(":")[2].rpartition(".")[2] for path in door.PRIVATE_API} | {
        path.rpartition(".")[2] for path in door.INSTANCE_ATTRIBUTES
    }
    unlisted = {name for function in _functions(tree) for name in _violations_in(function)} - listed
    assert unlisted == set()


def test_every_private_name_the_door_lists_is_in_this_torch():
    """Each name exists from the release the door says it came in, and not before (torch 2.6 has no _grouped_mm)."""
    missing, claimed_too_late = [], []
    for path, (since, _) in door.PRIVATE_API.items():
        if INSTALLED >= Version(since) and not door.available(path):
            missing.append(path)
        elif INSTALLED < Version(since) and door.available(path):
            claimed_too_late.append(path)
    assert missing == [] and claimed_too_late == []
    instances = {"Module": nn.Linear(1, 1), "Tensor": torch.zeros(1), "OrderedDict": nn.Linear(1, 1).state_dict()}
    for path, (since, _) in door.INSTANCE_ATTRIBUTES.items():
        owner, _, name = path.partition(".")
        assert Version(since) <= INSTALLED and hasattr(instances[owner], name), path
    assert all(hasattr(nn.Linear(1, 1), name) for name in door.MODULE_INTERNALS)


def test_a_name_this_torch_lacks_is_refused_by_name(monkeypatch):
    monkeypatch.setitem(door.PRIVATE_API, "torch.nn.modules.module:_no_such_internal", ("2.6", "a feature"))
    expected = f"torch {torch.__version__} lacks torch.nn.modules.module._no_such_internal, which a feature needs"
    with pytest.raises(TorchVersionError, match=re.escape(expected)):
        door.require("torch.nn.modules.module:_no_such_internal")
    assert not door.available("torch.nn.modules.module:_no_such_internal")


def test_the_grouped_product_is_the_public_one_where_torch_has_it():
    public = getattr(torch.nn.functional, "grouped_mm", None)
    if public is not None:
        assert door.grouped_mm() is public
    elif INSTALLED >= Version("2.8"):
        assert door.grouped_mm() is getattr(torch, "_grouped_mm")  # noqa: B009  (a private name, spelled as such)
    else:
        assert door.grouped_mm() is None


def test_hook_readers_agree_with_torch():
    module = nn.Linear(2, 2)
    assert not door.has_call_hooks(module) and door.call_hook_kinds(module) == []
    handle = module.register_forward_hook(lambda *args: None)
    module.register_load_state_dict_post_hook(lambda *args: None)
    assert door.has_call_hooks(module) and door.call_hook_kinds(module) == ["forward hook"]
    assert door.state_hook_kinds(module) == ["load-state-dict post-hook"]
    handle.remove()
    assert not door.has_call_hooks(module)
    assert not door.has_global_call_hooks()
    with torch.nn.modules.module.register_module_forward_pre_hook(lambda *args: None):
        assert door.has_global_call_hooks()
    assert not door.has_global_call_hooks()
    tensor = torch.zeros(2, requires_grad=True)
    assert not door.tensor_has_hooks(tensor)
    tensor.register_post_accumulate_grad_hook(lambda t: None)
    assert door.tensor_has_hooks(tensor)


def test_shared_hooks_run_on_the_new_module_and_their_handles_remove_them_there():
    live, new = nn.Linear(2, 2), nn.Linear(2, 2)
    calls = []
    handle = live.register_forward_hook(lambda module, args, output: calls.append(module))
    live.register_load_state_dict_pre_hook(lambda module, *args: calls.append(module))
    door.share_hooks(live, new, keep_own=False)
    new(torch.zeros(1, 2))
    new.load_state_dict(live.state_dict())
    assert calls == [new, new]  # the state-dict hook bound to its module now gets the new one
    handle.remove()
    assert not door.has_call_hooks(new)


def test_state_dict_metadata_and_strided_shards():
    source = nn.Linear(2, 2).state_dict()
    target: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict(source)
    door.copy_state_dict_metadata(target, source)
    assert target._metadata == source._metadata  # type: ignore[attr-defined]
    door.copy_state_dict_metadata(target, {})  # nothing to carry: unchanged
    assert target._metadata == source._metadata  # type: ignore[attr-defined]
    assert door.strided_split_factor(_StridedShard(0, split_factor=3)) == 3
    assert door.strided_split_factor(Shard(0)) is None


def test_the_default_store_is_the_process_group_s(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        store = door.default_store()
        store.set("modelpatch", "door")
        assert store.get("modelpatch") == b"door"
    finally:
        dist.destroy_process_group()
