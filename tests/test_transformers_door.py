"""Every use of transformers' private API goes through ``modelpatch/_transformers.py`` (the door), and the door's
functions do what stock does on this release."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest
import torch
import transformers
from packaging.requirements import Requirement
from packaging.version import Version
from torch import nn
from transformers import LlamaForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.core_model_loading import WeightRenaming
from transformers.models.auto.auto_factory import _BaseAutoModelClass

import modelpatch
from modelpatch import TransformersVersionError
from modelpatch import _transformers as door
from support.doors import assert_only_the_door_uses, private_uses, required_paths
from support.models import sized_config

ROOT = Path(__file__).resolve().parents[1]
SOURCE = Path(modelpatch.__file__).parent
DOOR = SOURCE / "_transformers.py"

# transformers' own private members of the classes modelpatch works with (torch's, which nn.Module code uses
# everywhere, are not transformers'), plus the private instance attributes transformers sets.
PRIVATE_NAMES = (
    {
        name
        for cls in (PreTrainedModel, PretrainedConfig, _BaseAutoModelClass)
        for name in dir(cls)
        if name.startswith("_") and not name.startswith("__")
    }
    - set(dir(nn.Module))
) | {
    "_is_hf_initialized",
    "_hf_peft_config_loaded",
    "_checkpoint_conversion_mapping_cache",
    "_original_source_patterns",
    "_original_target_patterns",
    "_keys_to_ignore_on_load_missing",
    "_keys_to_ignore_on_load_unexpected",
    "_no_split_modules",
    "_can_record_outputs",
}
# Public names whose calling convention is transformers-internal.
INTERNAL_NAMES = {"get_init_context", "all_tied_weights_keys", "get_hf_quantizer"}


def _is_transformers_submodule(name: str) -> bool:
    return importlib.util.find_spec(f"transformers.{name}") is not None


def _violations(path: Path) -> list[str]:
    return private_uses(
        path, SOURCE, "transformers", PRIVATE_NAMES | INTERNAL_NAMES, lambda name: not _is_transformers_submodule(name)
    )


def test_the_private_names_are_known_to_this_transformers():
    # The scan below is only as good as this list: it must hold transformers' real private names.
    assert {"_from_config", "_initialize_missing_keys", "_get_dtype_plan", "_model_mapping"} <= PRIVATE_NAMES
    assert "_parameters" not in PRIVATE_NAMES  # torch's, used by any nn.Module code


def test_no_module_but_the_door_uses_transformers_private_api():
    assert_only_the_door_uses(SOURCE, DOOR, _violations)


def test_the_scan_finds_private_uses():
    # What the door itself does is what the scan must catch anywhere else.
    found = _violations(DOOR)
    assert any("._from_config" in v for v in found) and any("._model_mapping" in v for v in found)
    assert any("'_can_record_outputs'" in v for v in found) and any(".get_init_context" in v for v in found)


def _pins(name: str) -> dict[str, Version]:
    lines = (ROOT / ".ci" / name).read_text().splitlines()
    return {
        Requirement(line).name.lower(): Version(next(iter(Requirement(line).specifier)).version)
        for line in lines
        if line.strip() and not line.startswith("#")
    }


def test_the_door_claims_the_releases_ci_runs():
    """CHECKED is the lowest and the newest release CI runs (the pins of .ci/constraints-lowest.txt and
    .ci/constraints.txt): moving CI to another release means auditing the door and saying so here."""
    lowest, newest = _pins("constraints-lowest.txt")["transformers"], _pins("constraints.txt")["transformers"]
    assert door.CHECKED == (str(lowest), str(newest))
    assert door.supports(str(lowest)) and door.supports(str(newest))


def _functions(tree: ast.Module) -> list[ast.FunctionDef]:
    return [node for node in tree.body if isinstance(node, ast.FunctionDef) and not node.name.startswith("__")]


def test_every_door_function_names_the_releases_it_was_checked_against():
    """Every function that reaches a private name says which releases it was checked against, ending at the newest
    release CI runs and starting no lower than the lowest."""
    tree = ast.parse(DOOR.read_text())
    functions = [f for f in _functions(tree) if required_paths(f) or _violations_in(f)]
    assert len(functions) > 25
    lowest, newest = (Version(v) for v in door.CHECKED)
    unchecked = []
    for function in functions:
        claim = re.search(r"Checked against (\d+\.\d+\.\d+)–(\d+\.\d+\.\d+)", ast.get_docstring(function) or "")
        if claim is None or Version(claim[2]) != newest or Version(claim[1]) < lowest:
            unchecked.append(function.name)
    assert unchecked == []


def _violations_in(node: ast.AST) -> list[str]:
    return [
        sub.attr if isinstance(sub, ast.Attribute) else sub.value
        for sub in ast.walk(node)
        if (isinstance(sub, ast.Attribute) and sub.attr in PRIVATE_NAMES | INTERNAL_NAMES)
        or (isinstance(sub, ast.Constant) and sub.value in PRIVATE_NAMES | INTERNAL_NAMES)
    ]


def test_every_private_name_the_door_uses_is_listed():
    """What the door requires is in PRIVATE_API, and every private name it touches is listed there (or is one of
    the instance markers no class declares)."""
    tree = ast.parse(DOOR.read_text())
    required = required_paths(tree)
    assert required and set(required) <= door.PRIVATE_API.keys()
    listed = {path.rpartition(".")[2].rpartition(":")[2] for path in door.PRIVATE_API} | set(door.INSTANCE_ATTRIBUTES)
    unlisted = {name for function in _functions(tree) for name in _violations_in(function)} - listed
    assert unlisted == set()


def test_every_private_name_the_door_lists_is_in_this_transformers():
    """Each name exists from the release PRIVATE_API says it came in; before it (within the supported range), it is
    really absent. On a release outside the range, what this lists is what the door would refuse."""
    installed = Version(transformers.__version__)
    missing, claimed_too_late = [], []
    for path, (since, _) in door.PRIVATE_API.items():
        if installed >= Version(since):
            if not door.available(path):
                missing.append(path)
        elif door.supports(str(installed)) and door.available(path):
            claimed_too_late.append(path)
    assert missing == [] and claimed_too_late == []
    for path in door.INSTANCE_ATTRIBUTES:
        assert not hasattr(PreTrainedModel, path)  # set on instances only: exercised below instead


def test_a_name_this_transformers_lacks_is_refused_by_name(monkeypatch):
    """The door's lookup, given names the installed transformers really does not have, raises modelpatch's error
    naming the release, the name, the feature that needs it and the supported range (not an AttributeError)."""
    internal = "transformers.modeling_utils:PreTrainedModel._no_such_internal"
    monkeypatch.setitem(door.PRIVATE_API, internal, ("5.15", "building a model"))
    monkeypatch.setitem(door.PRIVATE_API, "transformers.no_such_module", ("5.15", "conversions"))
    expected = (
        f"transformers {transformers.__version__} lacks transformers.modeling_utils.PreTrainedModel._no_such_internal"
        ", which building a model needs; supported: transformers>=5.15,<5.25"
    )
    with pytest.raises(TransformersVersionError, match=re.escape(expected)):
        door.require(internal)
    assert not door.available(internal)
    with pytest.raises(TransformersVersionError, match=r"lacks transformers\.no_such_module, which conversions need"):
        door.require("transformers.no_such_module")
    assert issubclass(TransformersVersionError, modelpatch.ModelPatchError)
    # A name the installed release lacks among the door's own (5.15-5.22 have no _resolve_parallel_plans): refused.
    for path, (_, feature) in door.PRIVATE_API.items():
        if not door.available(path):
            with pytest.raises(TransformersVersionError, match=re.escape(feature)):
                door.require(path)


def test_the_supported_range():
    assert door.supports("5.15.0") and door.supports("5.22.0") and door.supports("5.24.0") and door.supports("5.24.3")
    assert not door.supports("5.14.9") and not door.supports("5.25.0") and not door.supports("5.25.0.dev0")


def tiny_llama_config() -> PretrainedConfig:
    return sized_config("llama", vocab=64, hidden=16, intermediate=32, layers=1, heads=2, tie_word_embeddings=True)


def test_door_functions_agree_with_stock():
    config = tiny_llama_config()
    torch.manual_seed(0)
    built = door.initialized_from_config(LlamaForCausalLM, config, torch.float32)
    torch.manual_seed(0)
    stock = LlamaForCausalLM._from_config(config, dtype=torch.float32)
    assert built.state_dict().keys() == stock.state_dict().keys()
    assert all(torch.equal(built.state_dict()[k], v) for k, v in stock.state_dict().items())
    assert door.tied_weight_keys(built) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert door.no_split_modules(built) == sorted(LlamaForCausalLM._no_split_modules)
    assert door.recorded_outputs(LlamaForCausalLM) is LlamaForCausalLM._can_record_outputs
    assert not door.has_transformers_adapter(built)
    assert door.is_auto_class(transformers.AutoModelForCausalLM) and not door.is_auto_class(LlamaForCausalLM)
    assert door.auto_model_class(transformers.AutoModelForCausalLM, config) is LlamaForCausalLM
    assert door.auto_model_class(transformers.AutoModelForImageClassification, config) is None
    assert {"LlamaForCausalLM", "LlamaModel"} <= set(door.model_class_names_for("llama"))
    assert "legacy" in door.conversion_mapping_cache() and "mixtral" in door.conversion_mapping_cache()
    assert [type(t).__name__ for t in door.conversion_mapping_of("mixtral")][0] == "WeightRenaming"
    assert door.conversion_mapping_of("llama") is None and not door.user_registered_in_transformers("mixtral")
    renaming = WeightRenaming("mlp.experts.*.w1.weight", "mlp.experts.*.gate_proj.weight")
    assert door.original_patterns(renaming) == (["mlp.experts.*.w1.weight"], ["mlp.experts.*.gate_proj.weight"])
