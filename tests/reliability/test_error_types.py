"""Every error for bad input is a ``ModelPatchError``, as ``modelpatch.errors`` promises.

Bad files, configs, patch mappings, conversions, fusions and save targets go through the public API; each must raise
a ``ModelPatchError`` subclass. Invalid arguments of the call itself raise the documented plain ``TypeError`` or
``ValueError``, never a ``RuntimeError``, ``KeyError`` or ``re.error`` from deeper down.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import modelpatch
from modelpatch import ModelPatchError
from modelpatch.checkpoint import Checkpoint, write_checkpoint
from modelpatch.fusions import QKVFusionSpec
from support.models import tiny_config, wide

pytestmark = pytest.mark.reliability


def with_config(**changes) -> Callable[[Path], Path]:
    def edit(directory: Path) -> Path:
        config = json.loads((directory / "config.json").read_text())
        config.update(changes)
        (directory / "config.json").write_text(json.dumps(config))
        return directory

    return edit


def with_file(name: str, content: str) -> Callable[[Path], Path]:
    def edit(directory: Path) -> Path:
        (directory / name).write_text(content)
        return directory

    return edit


def without_weights(directory: Path) -> Path:
    for file in directory.glob("*.safetensors"):
        file.unlink()
    return directory


LOADS = {
    "config value of the wrong type": with_config(hidden_size="wide"),
    "config with zero heads": with_config(num_attention_heads=0),
    "config with a negative size": with_config(intermediate_size=-2),
    "config with an unknown rope type": with_config(rope_parameters={"rope_type": "nonsense", "rope_theta": 1.0}),
    "config with an absurd count": with_config(num_hidden_layers=10**9),
    "config with a 30-digit integer": with_file(
        "config.json", '{"model_type": "llama", "vocab_size": ' + "9" * 30 + "}"
    ),
    "generation config nested too deeply": with_file("generation_config.json", "[" * 5000 + "]" * 5000),
    "generation config of the wrong type": with_file("generation_config.json", '{"max_new_tokens": "many"}'),
    "no weights": without_weights,
}
PLANNED = sorted(case for case in LOADS if not case.startswith("generation config"))  # planning does not read it


@pytest.mark.parametrize(
    "entry, case", [("from_pretrained", case) for case in sorted(LOADS)] + [("plan_pretrained", c) for c in PLANNED]
)
def test_bad_checkpoints_raise_modelpatch_errors(stock, tmp_path, entry, case):
    directory = tmp_path / "ckpt"
    shutil.copytree(stock("llama").path, directory)
    LOADS[case](directory)
    with pytest.raises(ModelPatchError):
        getattr(modelpatch, entry)(AutoModelForCausalLM, directory)


@pytest.fixture(scope="module")
def model(stock):
    return modelpatch.from_pretrained(AutoModelForCausalLM, stock("llama").path)


def test_bad_save_targets_raise_modelpatch_errors(model, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("not a directory")
    for target in (a_file, a_file / "ckpt", a_file / "deeper" / "ckpt"):
        with pytest.raises(ModelPatchError, match=str(a_file)):
            modelpatch.save_pretrained(model, target)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with pytest.raises(ModelPatchError, match=str(locked)):
            modelpatch.save_pretrained(model, locked / "ckpt")
    finally:
        locked.chmod(0o755)
    with pytest.raises(ModelPatchError, match="max_shard_size"):
        modelpatch.save_pretrained(model, tmp_path / "ckpt", max_shard_size="lots")


def test_bad_mappings_conversions_fusions_and_tensors_raise_modelpatch_errors(tmp_path):
    cases = [
        lambda: modelpatch.register_patch_mapping({"(unclosed": nn.Linear}),
        lambda: modelpatch.Patcher(filtered_weight_conversion_patterns="(unclosed"),
        lambda: modelpatch.WeightRenaming("(unclosed", "x"),
        lambda: modelpatch.register_fusion("not an identifier", QKVFusionSpec()),
        lambda: modelpatch.from_config(
            AutoModelForCausalLM, tiny_config("llama", **wide()), fusion_config={"no_such_fusion": True}
        ),
        lambda: Checkpoint.open(tmp_path),
        lambda: write_checkpoint(tmp_path / "w", {"a": (w := torch.ones(4)), "b": w}),
    ]
    for case in cases:
        with pytest.raises(ModelPatchError):
            case()


ARGUMENTS = {
    "model_class that is no class": ({"model_class": 3}, TypeError),
    "unknown dtype name": ({"dtype": "float_seventeen"}, ValueError),
    "unknown device": ({"device": "no_such_device"}, ValueError),
    "new_parameters given as one string": ({"new_parameters": "lm_head"}, TypeError),
    "new_parameters with an invalid pattern": ({"new_parameters": ["(unclosed"]}, ValueError),
    "unknown unexpected_keys policy": ({"unexpected_keys": "explode"}, ValueError),
    "device_map naming missing modules": ({"device_map": {"no.such.module": "cpu"}}, ValueError),
}


@pytest.mark.parametrize("case", sorted(ARGUMENTS))
def test_invalid_arguments_raise_the_documented_type_or_value_error(stock, case):
    kwargs, expected = ARGUMENTS[case]
    kwargs = {"model_class": AutoModelForCausalLM, **kwargs}
    with pytest.raises(expected) as info:
        modelpatch.from_pretrained(kwargs.pop("model_class"), stock("llama").path, **kwargs)
    assert type(info.value) in (TypeError, ValueError), f"{type(info.value).__name__}: {info.value}"
