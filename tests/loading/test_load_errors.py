"""Every bad input to the loader gets a clear error; nothing is ever returned with silently random weights."""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    BertForSequenceClassification,
    BertModel,
)

import modelpatch
from modelpatch import CheckpointError, LoadPlanError
from modelpatch.checkpoint import Checkpoint, SafetensorsFile
from modelpatch.checkpoint import safetensors_file as safetensors_module
from support.compare import assert_bitwise_equal
from support.files import rewrite_checkpoint

PLAN_LOGGER = "modelpatch.loading.plan"


# --------------------------------------------------------------------------------------------------------- the path


def test_path_that_does_not_exist(tmp_path):
    # Not a repo id either (an absolute path); repo ids not in the hub cache: tests/loading/test_hub.py.
    with pytest.raises(CheckpointError, match="not a local directory, nor a hub repo id"):
        modelpatch.from_pretrained(AutoModelForCausalLM, tmp_path / "missing")


def test_path_that_is_a_file(stock_checkpoint):
    file = stock_checkpoint("llama").path / "model.safetensors"
    with pytest.raises(CheckpointError, match="not a local directory"):
        modelpatch.from_pretrained(AutoModelForCausalLM, file)


def test_directory_without_config_json(stock_checkpoint, tmp_path):
    shutil.copy(stock_checkpoint("llama").path / "model.safetensors", tmp_path)
    with pytest.raises(CheckpointError, match="no config.json"):
        modelpatch.from_pretrained(AutoModelForCausalLM, tmp_path)


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe\x00garbage", b"[1, 2, 3]", b""])
def test_config_json_that_is_not_a_json_object(stock_checkpoint, tmp_path, content):
    directory = tmp_path / "ckpt"
    shutil.copytree(stock_checkpoint("llama").path, directory)
    (directory / "config.json").write_bytes(content)
    with pytest.raises(CheckpointError, match="config.json"):
        modelpatch.from_pretrained(AutoModelForCausalLM, directory)


@pytest.mark.parametrize("model_type", ["definitely_not_a_model", None])
def test_unknown_or_missing_model_type(stock_checkpoint, tmp_path, model_type):
    directory = tmp_path / "ckpt"
    shutil.copytree(stock_checkpoint("llama").path, directory)
    config = json.loads((directory / "config.json").read_text())
    if model_type is None:
        del config["model_type"]
    else:
        config["model_type"] = model_type
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=repr(model_type) if model_type else "no model_type"):
        modelpatch.from_pretrained(AutoModelForCausalLM, directory)


def test_directory_without_weights(stock_checkpoint, tmp_path):
    shutil.copy(stock_checkpoint("llama").path / "config.json", tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint found"):
        modelpatch.from_pretrained(AutoModelForCausalLM, tmp_path)


# ----------------------------------------------------------------------------------------------- other arguments


@pytest.mark.parametrize("model_class", ["LlamaForCausalLM", torch.nn.Linear, 3])
def test_model_class_must_be_auto_or_pretrained_model(stock_checkpoint, model_class):
    with pytest.raises(TypeError, match="model_class"):
        modelpatch.from_pretrained(model_class, stock_checkpoint("llama").path)


def test_auto_class_without_a_model_for_the_config(stock_checkpoint):
    with pytest.raises(CheckpointError, match="AutoModelForImageClassification"):
        modelpatch.from_pretrained(AutoModelForImageClassification, stock_checkpoint("llama").path)


def test_bad_dtype(stock_checkpoint):
    path = stock_checkpoint("llama").path
    with pytest.raises(ValueError, match="dtype"):
        modelpatch.from_pretrained(AutoModelForCausalLM, path, dtype="float_seventeen")
    with pytest.raises(TypeError, match="dtype"):
        modelpatch.from_pretrained(AutoModelForCausalLM, path, dtype=16)


def test_bad_patcher(stock_checkpoint):
    with pytest.raises(TypeError, match="Patcher"):
        modelpatch.from_pretrained(AutoModelForCausalLM, stock_checkpoint("llama").path, patcher={"A": torch.nn.Linear})
    with pytest.raises(TypeError, match="Patcher"):
        modelpatch.from_config(AutoModelForCausalLM, AutoConfig.for_model("llama"), patcher=object())


def test_bad_unexpected_keys_value(stock_checkpoint):
    with pytest.raises(ValueError, match="unexpected_keys"):
        modelpatch.from_pretrained(AutoModelForCausalLM, stock_checkpoint("llama").path, unexpected_keys="explode")


def test_from_config_needs_a_config():
    with pytest.raises(TypeError, match="PretrainedConfig"):
        modelpatch.from_config(AutoModelForCausalLM, {"model_type": "llama"})


# ------------------------------------------------------------------------------ plan errors: one error, no data read


@pytest.fixture
def no_tensor_data_read(monkeypatch):
    """Fail the test if any tensor data is read: no tensor fetched, no file memory-mapped, no pickle loaded."""
    reads: list[str] = []

    def forbid(what):
        def _raise(*args, **kwargs):
            reads.append(what)
            raise AssertionError(f"tensor data was read ({what}) before the load plan was validated")

        return _raise

    monkeypatch.setattr(Checkpoint, "tensor", forbid("Checkpoint.tensor"))
    monkeypatch.setattr(SafetensorsFile, "tensor", forbid("SafetensorsFile.tensor"))
    monkeypatch.setattr(safetensors_module.mmap, "mmap", forbid("mmap.mmap"))
    monkeypatch.setattr(torch, "load", forbid("torch.load"))
    return reads


def _broken_llama(source: Path, target: Path) -> Path:
    def edit(tensors):
        del tensors["model.layers.0.mlp.up_proj.weight"]
        del tensors["model.norm.weight"]
        tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(48, 64)
        tensors["lm_head.weight"] = torch.zeros(129, 64)

    return rewrite_checkpoint(source, target, edit)


def test_missing_and_mismatched_keys_in_one_error_before_any_data_is_read(
    stock_checkpoint, tmp_path, no_tensor_data_read
):
    directory = _broken_llama(stock_checkpoint("llama").path, tmp_path / "broken")
    with pytest.raises(LoadPlanError) as info:
        modelpatch.from_pretrained(AutoModelForCausalLM, directory)
    error = info.value
    assert sorted(error.problems) == ["missing from the checkpoint", "shape mismatches"]
    assert error.problems["missing from the checkpoint"] == ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    assert sorted(line.split(":")[0] for line in error.problems["shape mismatches"]) == [
        "lm_head.weight",
        "model.layers.1.self_attn.k_proj.weight",
    ]
    message = str(error)
    for key in (
        "model.layers.0.mlp.up_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
        "[129, 64]",
        "[128, 64]",
        "model.layers.1.self_attn.k_proj.weight",
        "[48, 64]",
        "[32, 64]",
        "new_parameters",
    ):
        assert key in message
    assert no_tensor_data_read == []


def test_plan_error_comes_before_corrupt_tensor_data(stock_checkpoint, tmp_path):
    """A checkpoint whose header is fine but whose data bytes are garbage still fails on the plan, not on data."""
    directory = _broken_llama(stock_checkpoint("llama").path, tmp_path / "broken")
    file = directory / "model.safetensors"
    header_end = 8 + int.from_bytes(file.read_bytes()[:8], "little")
    with file.open("r+b") as f:
        f.seek(header_end)
        f.write(b"\xff" * (file.stat().st_size - header_end))  # every float is now NaN
    with pytest.raises(LoadPlanError):
        modelpatch.from_pretrained(AutoModelForCausalLM, directory)


def test_dtype_kind_mismatch_is_a_plan_error(stock_checkpoint, tmp_path, no_tensor_data_read):
    def edit(tensors):
        tensors["model.norm.weight"] = torch.ones(64, dtype=torch.int32)

    directory = rewrite_checkpoint(stock_checkpoint("llama").path, tmp_path / "int", edit)
    with pytest.raises(LoadPlanError, match="model.norm.weight") as info:
        modelpatch.from_pretrained(AutoModelForCausalLM, directory)
    assert list(info.value.problems) == ["dtype mismatches"]


def test_incomplete_expert_group_is_a_plan_error(stock_checkpoint, tmp_path, no_tensor_data_read):
    def edit(tensors):
        del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
        tensors["model.layers.0.mlp.experts.3.down_proj.weight"] = torch.zeros(64, 31)

    directory = rewrite_checkpoint(stock_checkpoint("qwen2_moe").path, tmp_path / "moe", edit)
    with pytest.raises(LoadPlanError) as info:
        modelpatch.from_pretrained(AutoModelForCausalLM, directory)
    message = str(info.value)
    assert "model.layers.1.mlp.experts" in message and "model.layers.0.mlp.experts" in message
    # Nothing of layer 1's experts is loaded half-way: the fused parameter is reported missing too.
    assert "model.layers.1.mlp.experts.gate_up_proj" in info.value.problems["missing from the checkpoint"]
    assert "model.layers.0.mlp.experts.down_proj" in info.value.problems["missing from the checkpoint"]


def test_new_parameters_never_hide_a_shape_mismatch(stock_checkpoint, tmp_path):
    def edit(tensors):
        tensors["lm_head.weight"] = torch.zeros(129, 64)

    directory = rewrite_checkpoint(stock_checkpoint("llama").path, tmp_path / "head", edit)
    with pytest.raises(LoadPlanError, match="lm_head.weight"):
        modelpatch.from_pretrained(AutoModelForCausalLM, directory, new_parameters=["lm_head"])


# ---------------------------------------------------------------------------------- unexpected and dropped keys


@pytest.fixture
def llama_with_extra_keys(stock_checkpoint, tmp_path):
    def edit(tensors):
        tensors["model.layers.0.self_attn.extra_scale"] = torch.ones(3)
        tensors["something.else"] = torch.zeros(2, 2)

    return rewrite_checkpoint(stock_checkpoint("llama").path, tmp_path / "extra", edit)


def test_unexpected_keys_warn_by_default(llama_with_extra_keys, stock_checkpoint, caplog):
    with caplog.at_level(logging.WARNING, logger=PLAN_LOGGER):
        model = modelpatch.from_pretrained(AutoModelForCausalLM, llama_with_extra_keys)
    warnings = [r.getMessage() for r in caplog.records if r.name == PLAN_LOGGER]
    assert len(warnings) == 1
    assert "model.layers.0.self_attn.extra_scale" in warnings[0] and "something.else" in warnings[0]
    assert modelpatch.get_load_report(model).unexpected == ("model.layers.0.self_attn.extra_scale", "something.else")
    reference = modelpatch.from_pretrained(AutoModelForCausalLM, stock_checkpoint("llama").path)
    assert_bitwise_equal(model.state_dict(), reference.state_dict())


def test_unexpected_keys_error(llama_with_extra_keys, no_tensor_data_read):
    with pytest.raises(LoadPlanError) as info:
        modelpatch.from_pretrained(AutoModelForCausalLM, llama_with_extra_keys, unexpected_keys="error")
    assert info.value.problems == {
        "unexpected in the checkpoint": ["model.layers.0.self_attn.extra_scale", "something.else"]
    }


def test_unexpected_keys_ignore(llama_with_extra_keys, caplog):
    with caplog.at_level(logging.WARNING, logger=PLAN_LOGGER):
        model = modelpatch.from_pretrained(AutoModelForCausalLM, llama_with_extra_keys, unexpected_keys="ignore")
    assert not [r for r in caplog.records if r.name == PLAN_LOGGER]
    assert len(modelpatch.get_load_report(model).unexpected) == 2


def test_bert_position_ids_in_checkpoint_are_dropped_quietly(stock_checkpoint, tmp_path, caplog):
    """Older BERT checkpoints store the non-persistent ``embeddings.position_ids`` buffer."""

    def edit(tensors):
        tensors["embeddings.position_ids"] = torch.arange(64).unsqueeze(0)

    directory = rewrite_checkpoint(stock_checkpoint("bert_base").path, tmp_path / "bert_old", edit)
    with caplog.at_level(logging.WARNING):
        model = modelpatch.from_pretrained(BertModel, directory, unexpected_keys="error")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("modelpatch")]
    report = modelpatch.get_load_report(model)
    assert report.dropped == ("embeddings.position_ids",) and report.unexpected == ()
    stock = BertModel.from_pretrained(directory)
    assert_bitwise_equal(model.state_dict(), stock.state_dict())
    assert torch.equal(model.embeddings.position_ids, stock.embeddings.position_ids)


# ---------------------------------------------------------------------------------------- fresh task head


def test_task_head_from_base_checkpoint_needs_new_parameters(stock_checkpoint, no_tensor_data_read):
    with pytest.raises(LoadPlanError) as info:
        modelpatch.from_pretrained(BertForSequenceClassification, stock_checkpoint("bert_base").path)
    assert info.value.problems == {"missing from the checkpoint": ["classifier.bias", "classifier.weight"]}


def test_task_head_with_new_parameters_is_initialised_like_stock(stock_checkpoint):
    path = stock_checkpoint("bert_base").path
    torch.manual_seed(1234)
    stock = BertForSequenceClassification.from_pretrained(path)
    torch.manual_seed(1234)
    model = modelpatch.from_pretrained(BertForSequenceClassification, path, new_parameters=[r"^classifier\."])
    # Same RNG stream, same initialisation: the fresh head is bitwise stock's.
    assert_bitwise_equal(model.state_dict(), stock.state_dict())
    assert torch.count_nonzero(model.classifier.bias) == 0
    assert 0.01 < float(model.classifier.weight.detach().std()) < 0.04  # normal(0, initializer_range=0.02)
    report = modelpatch.get_load_report(model)
    assert report.new_parameters == ("classifier.bias", "classifier.weight")
    inputs = stock_checkpoint("bert_base").inputs()
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, stock(**inputs).logits)


def test_base_model_from_task_checkpoint(stock_checkpoint, caplog):
    """The other direction: BertModel from a BertForMaskedLM checkpoint drops the ``bert.`` prefix and the MLM head.

    That checkpoint has no pooler (BertForMaskedLM builds none): stock silently initialises it at random; modelpatch
    asks for it to be named in new_parameters.
    """
    path = stock_checkpoint("bert").path
    with pytest.raises(LoadPlanError) as info:
        modelpatch.from_pretrained(BertModel, path)
    assert info.value.problems == {"missing from the checkpoint": ["pooler.dense.bias", "pooler.dense.weight"]}

    torch.manual_seed(5)
    stock = BertModel.from_pretrained(path)
    torch.manual_seed(5)
    with caplog.at_level(logging.WARNING, logger=PLAN_LOGGER):
        model = modelpatch.from_pretrained(BertModel, path, new_parameters=["^pooler"])
    assert_bitwise_equal(model.state_dict(), stock.state_dict())
    report = modelpatch.get_load_report(model)
    assert report.unexpected and all(k.startswith("cls.") for k in report.unexpected)
    assert any("cls.predictions" in r.getMessage() for r in caplog.records if r.name == PLAN_LOGGER)


# ------------------------------------------------------------------------------------------- layer count


def test_more_layers_than_a_layer_list_can_hold_is_refused_naming_the_list(tmp_path, no_tensor_data_read):
    """OneFormer's decoder holds ``num_hidden_layers - 1`` layers, so a checkpoint of 10 has indices up to 8 only
    (loaded as stock: tests/conversion/test_zoo_slice.py); one more layer in its config is refused, before any data,
    naming the decoder's list and the layer the checkpoint lacks."""
    from transformers import OneFormerConfig, OneFormerModel

    from support.zoo import load_zoo

    config = load_zoo().tiny_config(OneFormerConfig)
    config.decoder_layers = 10
    OneFormerModel(config).save_pretrained(tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**stored, "decoder_layers": 11}))
    with pytest.raises(LoadPlanError, match=r"num_hidden_layers = 11, .*decoder\.layers\[9\]") as info:
        modelpatch.from_pretrained(OneFormerModel, tmp_path)
    assert info.value.problems == {"missing from the checkpoint": ["transformer_module.decoder.layers.9"]}


# ------------------------------------------------------------------------------------------- corrupt files


def test_truncated_safetensors_file_is_named(stock_checkpoint, tmp_path):
    directory = tmp_path / "trunc"
    shutil.copytree(stock_checkpoint("llama").path, directory)
    file = directory / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=str(file)):
        modelpatch.from_pretrained(AutoModelForCausalLM, directory)


def test_corrupt_safetensors_header_is_named(stock_checkpoint, tmp_path):
    directory = tmp_path / "corrupt"
    shutil.copytree(stock_checkpoint("llama").path, directory)
    file = directory / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:20] = b"@" * 12
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=str(file)):
        modelpatch.from_pretrained(AutoModelForCausalLM, directory)


def test_truncated_shard_is_named(stock_checkpoint, tmp_path):
    directory = tmp_path / "sharded"
    shutil.copytree(stock_checkpoint("llama_sharded").path, directory)
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=shard.name):
        modelpatch.from_pretrained(AutoModelForCausalLM, directory)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/../../outside.safetensors"])
def test_shard_names_are_confined_to_the_directory(stock_checkpoint, tmp_path, name):
    directory = tmp_path / "sharded"
    shutil.copytree(stock_checkpoint("llama_sharded").path, directory)
    shutil.copy(sorted(directory.glob("model-*.safetensors"))[0], tmp_path / "outside.safetensors")
    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    first_key = sorted(index["weight_map"])[0]
    index["weight_map"][first_key] = name
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="inside the directory|outside"):
        modelpatch.from_pretrained(AutoModelForCausalLM, directory)


def test_index_naming_a_missing_shard(stock_checkpoint, tmp_path):
    directory = tmp_path / "sharded"
    shutil.copytree(stock_checkpoint("llama_sharded").path, directory)
    victim = sorted(directory.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        modelpatch.from_pretrained(AutoModelForCausalLM, directory)


# ------------------------------------------------------------------------------------------------ pickle files


@pytest.fixture
def pickle_checkpoint(stock_checkpoint, tmp_path) -> Path:
    source = stock_checkpoint("llama").path
    directory = tmp_path / "bin"
    directory.mkdir()
    shutil.copy(source / "config.json", directory)
    torch.save(load_file(str(source / "model.safetensors")), directory / "pytorch_model.bin")
    return directory


def test_pickle_checkpoint_refused_without_allow_pickle(pickle_checkpoint):
    with pytest.raises(CheckpointError, match="allow_pickle"):
        modelpatch.from_pretrained(AutoModelForCausalLM, pickle_checkpoint)


def test_pickle_checkpoint_with_allow_pickle(pickle_checkpoint, stock_checkpoint):
    model = modelpatch.from_pretrained(AutoModelForCausalLM, pickle_checkpoint, allow_pickle=True)
    reference = AutoModelForCausalLM.from_pretrained(stock_checkpoint("llama").path)
    assert_bitwise_equal(model.state_dict(), reference.state_dict())


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_pickle_checkpoint_is_read_with_weights_only(pickle_checkpoint, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with (pickle_checkpoint / "pytorch_model.bin").open("wb") as f:
        pickle.dump({"model.norm.weight": _Payload()}, f)
    with pytest.raises(CheckpointError, match="pytorch_model.bin"):
        modelpatch.from_pretrained(AutoModelForCausalLM, pickle_checkpoint, allow_pickle=True)
    assert not (tmp_path / "pwned").exists()


def test_safetensors_preferred_over_pickle(stock_checkpoint, tmp_path):
    directory = tmp_path / "both"
    shutil.copytree(stock_checkpoint("llama").path, directory)
    (directory / "pytorch_model.bin").write_bytes(b"not a pickle at all")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, directory)  # allow_pickle not needed, .bin never read
    assert model.model.norm.weight.shape == (64,)


def test_quantized_checkpoints_on_a_transformers_without_the_quantizer_api_are_refused_by_name(
    stock_checkpoint, tmp_path
):
    from modelpatch.modes.quantization import quantizer_api_supported

    if quantizer_api_supported():
        pytest.skip("this transformers has the quantizer API modelpatch drives (tests/modes/test_quantized.py)")
    path = shutil.copytree(stock_checkpoint("llama").path, tmp_path / "fp8")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
    }
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(modelpatch.LoadPlanError, match=r"fp8.*update_weight_conversions.*Upgrade transformers"):
        modelpatch.from_pretrained(AutoModelForCausalLM, path)
