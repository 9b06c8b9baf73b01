"""modelpatch's versioned record, in config.json (what each path writes, how older saves migrate, what is refused)
and on the models it builds (one record per model, through copies)."""

from __future__ import annotations

import copy
import json
import pickle
import shutil
from pathlib import Path

import pytest
from fusion_models import assert_outputs_close, assert_outputs_equal, assert_same_files, module_types
from transformers import LlamaConfig

import modelpatch
from modelpatch import CheckpointError
from modelpatch.loading.record import MODEL_RECORD_ATTRIBUTE, ModelRecord, model_record
from modelpatch.state import (
    RECORD_KEY,
    RECORD_VERSION,
    ConfigRecord,
    read_record,
    record_file_layout,
    write_record,
)


def config_json(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


def rewrite_config(directory: Path, change) -> None:
    config = config_json(directory)
    change(config)
    (directory / "config.json").write_text(json.dumps(config))


def to_version_0(config: dict) -> None:
    """The config.json of a save made before the record was versioned: two flat keys."""
    record = config.pop(RECORD_KEY)
    if "fusion_config" in record:
        config["modelpatch_fusion_config"] = record["fusion_config"]
    if record.get("runtime_layout"):
        config["modelpatch_runtime_layout"] = True


def tiny_config(**record) -> LlamaConfig:
    return LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, **record)


# --- What each path writes ----------------------------------------------------------------------------------------


def test_every_path_writes_the_current_version(tiny, tmp_path):
    ckpt = tiny("llama")
    expected = {"version": RECORD_VERSION, "fusion_config": {"qkv": True}}
    assert getattr(ckpt.load({"qkv": True}).config, RECORD_KEY) == expected  # from_pretrained
    built = modelpatch.from_config(ckpt.model_class, ckpt.stock().config, fusion_config={"qkv": True})
    assert getattr(built.config, RECORD_KEY) == expected  # from_config
    live = ckpt.load()
    assert not hasattr(live.config, RECORD_KEY)  # nothing to record: a plain load carries no record
    modelpatch.fuse(live, {"qkv": True})
    assert getattr(live.config, RECORD_KEY) == expected  # fuse
    modelpatch.unfuse(live)
    assert not hasattr(live.config, RECORD_KEY)  # unfuse

    modelpatch.save_pretrained(built, tmp_path / "original")
    assert config_json(tmp_path / "original")[RECORD_KEY] == expected
    modelpatch.save_pretrained(built, tmp_path / "runtime", save_original_format=False)
    assert config_json(tmp_path / "runtime")[RECORD_KEY] == {**expected, "runtime_layout": True}
    assert getattr(built.config, RECORD_KEY) == expected  # the file's layout never stays on the model's config


def test_stock_transformers_loads_a_save_that_carries_the_record(tiny, tmp_path):
    ckpt = tiny("llama")
    modelpatch.save_pretrained(ckpt.load({"qkv": True, "gate_up": True}), tmp_path / "saved")
    assert RECORD_KEY in config_json(tmp_path / "saved")
    stock = ckpt.model_class.from_pretrained(tmp_path / "saved")
    assert module_types(stock) == module_types(ckpt.stock())
    assert_outputs_equal(ckpt.outputs(stock), ckpt.stock_outputs())


def modelpatch_attributes(model) -> set[str]:
    """The names modelpatch set on ``model`` itself: its instance-level methods aside, and the list of them that lets
    them survive a pickle (``boundary/methods.py``), which is no state of the model's."""
    return {name for name in vars(model) if "modelpatch" in name and name != "_modelpatch_bound_methods"}


def test_every_path_keeps_one_record_on_the_model(tiny):
    ckpt = tiny("llama")
    loaded = ckpt.load({"qkv": True})  # from_pretrained
    record = model_record(loaded)
    assert isinstance(record, ModelRecord) and record.version == RECORD_VERSION
    assert modelpatch_attributes(loaded) == {MODEL_RECORD_ATTRIBUTE, "modelpatch_report"}
    assert loaded.modelpatch_report is record.report is modelpatch.get_load_report(loaded)  # the public alias
    assert record.expected_state and record.base_transforms is not None  # llama's mapping is empty

    built = modelpatch.from_config(ckpt.model_class, ckpt.stock().config, fusion_config={"qkv": True})
    record = model_record(built)
    assert modelpatch_attributes(built) == {MODEL_RECORD_ATTRIBUTE}  # no load, no report
    assert record is not None and record.report is None and record.transforms and record.expected_state

    stock = ckpt.model_class.from_pretrained(ckpt.path)  # its own: fuse restructures it (ckpt.stock() is shared)
    assert model_record(stock) is None
    modelpatch.fuse(stock, {"qkv": True})  # a model modelpatch did not build gets its record from fuse
    record = model_record(stock)
    assert modelpatch_attributes(stock) == {MODEL_RECORD_ATTRIBUTE}
    assert record is not None and record.transforms and record.base_transforms is not None and record.expected_state
    modelpatch.unfuse(stock)
    assert model_record(stock) is record  # updated in place, still one


def test_the_record_travels_with_pickle_and_deepcopy(tiny, tmp_path):
    """A copy saves exactly like the original: the record's transforms are what undo a live fuse."""
    ckpt = tiny("llama")
    model = modelpatch.fuse(ckpt.model_class.from_pretrained(ckpt.path), {"qkv": True, "gate_up": True})
    loaded = ckpt.load({"qkv": True})
    for index, clone in enumerate([pickle.loads(pickle.dumps(model)), copy.deepcopy(model)]):
        assert model_record(clone) is not model_record(model)
        modelpatch.save_pretrained(clone, tmp_path / str(index))
        assert_same_files(tmp_path / str(index), ckpt.path)
    for clone in (pickle.loads(pickle.dumps(loaded)), copy.deepcopy(loaded)):
        record = model_record(clone)
        assert record is not None and clone.modelpatch_report is record.report  # still one object, two names
        assert record.report.converted == loaded.modelpatch_report.converted


def test_a_model_record_of_another_version_is_refused(tiny, tmp_path):
    model = tiny("llama").load({"qkv": True})
    record = model_record(model)
    assert record is not None
    record.version = RECORD_VERSION + 1  # as a model pickled by a newer modelpatch would carry
    with pytest.raises(TypeError, match=f"{MODEL_RECORD_ATTRIBUTE}.*version {RECORD_VERSION + 1}"):
        modelpatch.save_pretrained(model, tmp_path / "saved")
    assert not (tmp_path / "saved").exists()


# --- Migration from version 0 -------------------------------------------------------------------------------------


def test_a_version_0_runtime_layout_checkpoint_loads_and_saves_as_the_current_version(tiny, tmp_path):
    ckpt = tiny("llama")
    fused = ckpt.load({"qkv": True, "gate_up": True})
    old = tmp_path / "old"
    modelpatch.save_pretrained(fused, old, save_original_format=False)
    rewrite_config(old, to_version_0)
    assert config_json(old)["modelpatch_runtime_layout"] is True and RECORD_KEY not in config_json(old)

    reloaded = ckpt.load(path=old)  # the stored fusions and layout are read from the old keys
    assert modelpatch.get_load_report(reloaded).runtime_layout
    assert module_types(reloaded) == module_types(fused)
    assert_outputs_equal(ckpt.outputs(reloaded), ckpt.outputs(fused))
    assert_outputs_close(ckpt.outputs(reloaded), ckpt.stock_outputs())

    migrated = tmp_path / "migrated"
    modelpatch.save_pretrained(reloaded, migrated)
    assert_same_files(migrated, ckpt.path)  # the original layout, bit for bit
    saved = config_json(migrated)
    assert "modelpatch_fusion_config" not in saved and "modelpatch_runtime_layout" not in saved
    assert saved[RECORD_KEY] == {"version": RECORD_VERSION, "fusion_config": {"qkv": True, "gate_up": True}}


def test_a_version_0_original_layout_checkpoint_gets_its_fusions_back(tiny, tmp_path):
    ckpt = tiny("llama")
    old = tmp_path / "old"
    modelpatch.save_pretrained(ckpt.load({"qkv": True}), old)
    rewrite_config(old, to_version_0)
    assert config_json(old)["modelpatch_fusion_config"] == {"qkv": True}

    reloaded = ckpt.load(path=old)
    assert module_types(reloaded) == module_types(ckpt.load({"qkv": True}))
    assert_outputs_close(ckpt.outputs(reloaded), ckpt.stock_outputs())
    assert getattr(reloaded.config, RECORD_KEY) == {"version": RECORD_VERSION, "fusion_config": {"qkv": True}}
    assert not hasattr(reloaded.config, "modelpatch_fusion_config")


def test_read_record_versions():
    assert read_record(tiny_config()) == ConfigRecord(version=0)  # nothing recorded
    old = read_record(tiny_config(modelpatch_fusion_config={"qkv": True}, modelpatch_runtime_layout=True))
    assert old == ConfigRecord({"qkv": True}, True, version=0)
    current = {"version": 1, "fusion_config": {"qkv": True}, "runtime_layout": True}
    assert read_record(tiny_config(modelpatch=current)) == ConfigRecord({"qkv": True}, True, version=1)
    # transformers' own key is read when modelpatch recorded no fusions (a checkpoint stock 5.23 fused).
    stock_fused = tiny_config(fusion_config={"patch_embeddings": True})
    assert read_record(stock_fused).fusion_config == {"patch_embeddings": True}


def test_write_record_migrates_and_writes_nothing_for_an_empty_record():
    config = tiny_config(modelpatch_fusion_config={"qkv": True}, modelpatch_runtime_layout=True)
    record_file_layout(config, runtime_layout=False)
    assert getattr(config, RECORD_KEY) == {"version": RECORD_VERSION, "fusion_config": {"qkv": True}}
    assert not hasattr(config, "modelpatch_fusion_config") and not hasattr(config, "modelpatch_runtime_layout")
    write_record(config, ConfigRecord())
    assert not hasattr(config, RECORD_KEY)
    assert (
        json.loads(config.to_json_string(use_diff=True))
        .keys()
        .isdisjoint({RECORD_KEY, "modelpatch_fusion_config", "modelpatch_runtime_layout"})
    )


# --- Refusals -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "record, message",
    [
        ({"version": 2, "fusion_config": {"qkv": True}}, r"format version 2, written by a newer modelpatch.*up to 1"),
        (["qkv"], r"'modelpatch' must be an object with a 'version'"),
        ({"fusion_config": {"qkv": True}}, r"integer 'version' of at least 1, got None"),
        ({"version": "1"}, r"integer 'version' of at least 1, got '1'"),
        ({"version": True}, r"integer 'version' of at least 1, got True"),
        ({"version": 0}, r"integer 'version' of at least 1, got 0"),
        ({"version": 1, "fusion_config": {}, "layout": "fused"}, r"unknown field\(s\) 'layout' for version 1"),
        ({"version": 1, "runtime_layout": "yes"}, r"'runtime_layout' must be true or false, got 'yes'"),
    ],
    ids=["newer", "not-an-object", "no-version", "string-version", "bool-version", "version-0", "unknown", "layout"],
)
def test_malformed_or_newer_records_are_refused_by_name(record, message):
    with pytest.raises(CheckpointError, match=message):
        read_record(tiny_config(modelpatch=record))


def test_a_record_in_both_formats_is_refused():
    config = tiny_config(modelpatch={"version": 1}, modelpatch_runtime_layout=True)
    with pytest.raises(CheckpointError, match=r"both as 'modelpatch' and as 'modelpatch_runtime_layout'"):
        read_record(config)


def test_a_checkpoint_of_a_newer_format_is_not_loaded(tiny, tmp_path):
    ckpt = tiny("llama")
    newer = tmp_path / "newer"
    shutil.copytree(ckpt.path, newer)
    rewrite_config(newer, lambda config: config.update({RECORD_KEY: {"version": RECORD_VERSION + 1}}))
    with pytest.raises(CheckpointError, match=f"format version {RECORD_VERSION + 1}.*Upgrade modelpatch"):
        ckpt.load(path=newer)
