"""Every use of PEFT's private API goes through ``modelpatch/_peft.py`` (the PEFT door), which lists each name it
uses and refuses a feature by name on a PEFT release that lacks one."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import peft
import pytest
from peft import LoraConfig, PeftConfig, PeftModel
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer, LoraModel
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from torch import nn

import modelpatch
from modelpatch import _peft as door
from modelpatch.errors import PeftIntegrationError, PeftVersionError
from support.doors import assert_only_the_door_uses, private_uses, required_paths

SOURCE = Path(modelpatch.__file__).parent
DOOR = SOURCE / "_peft.py"

# PEFT's own private members of the classes modelpatch works with (torch's, which nn.Module code uses everywhere,
# are not PEFT's), plus the private module-level functions of the PEFT modules it reads.
PRIVATE_NAMES = {
    name
    for cls in (LoraConfig, PeftConfig, PeftModel, LoraModel, BaseTuner, LoraLayer, LoraLinear, BaseTunerLayer)
    for name in dir(cls)
    if name.startswith("_") and not name.startswith("__")
} - set(dir(nn.Module)) | {"_maybe_include_all_linear_layers"}


def _is_public(name: str) -> bool:
    """Exported by ``peft`` itself (``__all__``, or a dunder such as ``__version__``), and not one of its modules."""
    exported = name in peft.__all__ or name.startswith("__")
    return exported and importlib.util.find_spec(f"peft.{name}") is None


def _violations(path: Path) -> list[str]:
    """The transformers door's scan, plus what a subclass of a PEFT layer does: ``peft.<name>`` outside its exports,
    and a private PEFT method overridden (``def _get_in_out_features``)."""
    found = private_uses(path, SOURCE, "peft", PRIVATE_NAMES, _is_public)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.relative_to(SOURCE)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "peft":
            if not _is_public(node.attr):
                found.append(f"{where}: peft.{node.attr}")
        elif isinstance(node, ast.FunctionDef) and node.name in PRIVATE_NAMES:
            found.append(f"{where}: def {node.name}")
    return found


def test_the_private_names_are_known_to_this_peft():
    # The scan below is only as good as this list: it must hold PEFT's real private names.
    assert {"_register_custom_module", "_get_in_out_features", "_prepare_adapter_config"} <= PRIVATE_NAMES
    assert "_parameters" not in PRIVATE_NAMES  # torch's, used by any nn.Module code


def test_no_module_but_the_door_uses_peft_private_api():
    assert_only_the_door_uses(SOURCE, DOOR, _violations)


def test_the_scan_finds_private_uses():
    # What the door itself does is what the scan must catch anywhere else.
    found = _violations(DOOR)
    assert any("def _get_in_out_features" in v for v in found)
    assert any("._register_custom_module" in v for v in found)
    assert any("'_prepare_adapter_config'" in v for v in found)


def _functions(tree: ast.Module) -> list[ast.FunctionDef]:
    return [node for node in tree.body if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")]


def test_every_private_name_the_door_uses_is_listed_and_checked():
    """What the door requires is in PRIVATE_API; every private name it touches is listed there; every function
    reaching one says which releases it was checked against."""
    tree = ast.parse(DOOR.read_text())
    required = required_paths(tree)
    assert required and set(required) <= door.PRIVATE_API.keys()
    listed = {re.split(r"[.:]", path)[-1] for path in door.PRIVATE_API}
    used = {v.rpartition(" ")[2].strip(".'") for v in _violations(DOOR) if ": from" not in v}
    assert used - listed == set()
    for function in _functions(tree):
        if required_paths(function):
            claim = re.search(r"Checked against ([\d.]+)", ast.get_docstring(function) or "")
            assert claim is not None and claim[1] in door.CHECKED, function.name


def test_every_private_name_the_door_lists_is_in_this_peft():
    assert [path for path in door.PRIVATE_API if not _resolves(path)] == []


def _resolves(path: str) -> bool:
    try:
        door.require(path)
    except PeftVersionError:
        return False
    return True


def test_a_name_this_peft_lacks_is_refused_by_name(monkeypatch):
    """A name the installed PEFT really does not have: modelpatch's error naming the release, the name and the
    feature (not an AttributeError), and a PeftIntegrationError too."""
    monkeypatch.setitem(door.PRIVATE_API, "peft.tuners.lora:Linear._no_such_internal", ("0.21", "a feature"))
    monkeypatch.setitem(door.PRIVATE_API, "peft.no_such_module:x", ("0.21", "another feature"))
    expected = f"PEFT {peft.__version__} lacks peft.tuners.lora.Linear._no_such_internal, which a feature needs"
    with pytest.raises(PeftVersionError, match=re.escape(expected)):
        door.require("peft.tuners.lora:Linear._no_such_internal")
    with pytest.raises(PeftVersionError, match=r"lacks peft\.no_such_module, which another feature needs"):
        door.require("peft.no_such_module:x")
    assert issubclass(PeftVersionError, PeftIntegrationError)
