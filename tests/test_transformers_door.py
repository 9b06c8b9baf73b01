"""Every use of transformers' private API goes through ``modelpatch/_transformers.py`` (the door), and the door's
functions do what stock does on this release."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.core_model_loading import WeightRenaming
from transformers.models.auto.auto_factory import _BaseAutoModelClass

import modelpatch
from modelpatch import _transformers as door

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
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.relative_to(SOURCE)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("transformers."):
                found.append(f"{where}: from {node.module} import ...")
            elif node.module == "transformers":
                found += [
                    f"{where}: from transformers import {a.name}"
                    for a in node.names
                    if _is_transformers_submodule(a.name)
                ]
        elif isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if a.name.startswith("transformers.")]
        elif isinstance(node, ast.Attribute) and node.attr in PRIVATE_NAMES | INTERNAL_NAMES:
            found.append(f"{where}: .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in PRIVATE_NAMES | INTERNAL_NAMES:
            found.append(f"{where}: {node.value!r}")
    return found


def test_the_private_names_are_known_to_this_transformers():
    # The scan below is only as good as this list: it must hold transformers' real private names.
    assert {"_from_config", "_initialize_missing_keys", "_get_dtype_plan", "_model_mapping"} <= PRIVATE_NAMES
    assert "_parameters" not in PRIVATE_NAMES  # torch's, used by any nn.Module code


def test_no_module_but_the_door_uses_transformers_private_api():
    violations = [v for path in sorted(SOURCE.rglob("*.py")) if path != DOOR for v in _violations(path)]
    assert violations == [], "private transformers API outside modelpatch/_transformers.py:\n" + "\n".join(violations)


def test_the_scan_finds_private_uses():
    # What the door itself does is what the scan must catch anywhere else.
    found = _violations(DOOR)
    assert any("._from_config" in v for v in found) and any("from transformers.models.auto" in v for v in found)
    assert any("'_can_record_outputs'" in v for v in found) and any(".get_init_context" in v for v in found)


def test_every_door_function_names_the_release_it_was_checked_against():
    tree = ast.parse(DOOR.read_text())
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef) and not node.name.startswith("__")]
    assert functions
    unchecked = [f.name for f in functions if "Checked against 5.23" not in (ast.get_docstring(f) or "")]
    assert unchecked == []


def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        vocab_size=64,
        tie_word_embeddings=True,
    )


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
    renaming = WeightRenaming("mlp.experts.*.w1.weight", "mlp.experts.*.gate_proj.weight")
    assert door.original_patterns(renaming) == (["mlp.experts.*.w1.weight"], ["mlp.experts.*.gate_proj.weight"])
