"""The conversion registry: transformers' own mapping translated, register_checkpoint_conversion_mapping /
get_checkpoint_conversion_mapping, legacy renamings. (How a model's transforms are collected:
tests/test_transformers_mapping.py.)"""

from __future__ import annotations

import pytest

import modelpatch
from modelpatch import (
    Concatenate,
    ConversionError,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
)
from modelpatch.conversion.registry import registered_model_types
from support.threads import run_on_threads

QKV = WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])


def test_builtin_keys_are_transformers_mapping():
    keys = set(registered_model_types())
    assert {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "Qwen2VLForConditionalGeneration", "legacy"} <= keys
    from transformers import conversion_mapping

    # Every entry of the installed transformers' registry (251 in 5.23), nothing hand-copied.
    assert set(conversion_mapping._build_checkpoint_conversion_mapping()) <= keys
    assert get_checkpoint_conversion_mapping("llama") is None


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe", "olmoe"])
def test_builtin_per_expert_to_fused(model_type):
    gate_up, down = get_checkpoint_conversion_mapping(model_type)
    assert gate_up.source_patterns == ("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight")
    assert gate_up.target_patterns == ("mlp.experts.gate_up_proj",)
    assert gate_up.operations == (MergeModulelist(dim=0), Concatenate(dim=1, equal_parts=True))
    assert down.source_patterns == ("mlp.experts.*.down_proj.weight",) and down.operations == (MergeModulelist(dim=0),)


def test_builtin_mixtral():
    renaming, gate_up, down = get_checkpoint_conversion_mapping("mixtral")
    assert renaming == WeightRenaming(".block_sparse_moe.", ".mlp.")
    assert gate_up.source_patterns == (".experts.*.w1.weight", ".experts.*.w3.weight")
    assert down.source_patterns == (".experts.*.w2.weight",)


@pytest.mark.parametrize("class_name", ["Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"])
def test_builtin_qwen_vl_renamings(class_name):
    visual, text = get_checkpoint_conversion_mapping(class_name)
    assert visual.rename("visual.patch_embed.proj.weight") == "model.visual.patch_embed.proj.weight"
    assert text.rename("model.layers.0.mlp.up_proj.weight") == "model.language_model.layers.0.mlp.up_proj.weight"
    # Keys already in the runtime layout (what save_pretrained(save_original_format=False) writes) are left alone.
    for key in ("model.visual.blocks.0.norm1.weight", "model.language_model.norm.weight", "lm_head.weight"):
        assert visual.rename(key) is None and text.rename(key) is None


def test_transformers_objects_are_translated():
    from transformers import core_model_loading as transformers

    hf = transformers.WeightConverter(
        ["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
        "mlp.experts.gate_up_proj",
        [transformers.MergeModulelist(dim=0), transformers.Concatenate(dim=1)],
    )
    register_checkpoint_conversion_mapping(
        "qwen2_moe", [hf, transformers.WeightRenaming(r"\.moe\.", ".mlp.")], overwrite=True
    )
    converter, renaming = get_checkpoint_conversion_mapping("qwen2_moe")
    assert converter == WeightConverter(
        hf.source_patterns, "mlp.experts.gate_up_proj", [MergeModulelist(dim=0), Concatenate(dim=1, equal_parts=True)]
    )
    assert renaming == WeightRenaming(r"\.moe\.", ".mlp.")


def test_an_operation_without_translation_is_named():
    from transformers.core_model_loading import ConversionOps
    from transformers.core_model_loading import WeightConverter as HFConverter

    class Dequantize(ConversionOps):
        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
            return input_dict

    with pytest.raises(ConversionError, match=r"Dequantize.*'my_moe'"):
        register_checkpoint_conversion_mapping("my_moe", [HFConverter("w", "w2", [Dequantize()])])
    assert get_checkpoint_conversion_mapping("my_moe") is None


def test_register_with_keyword_model_type_and_overwrite():
    register_checkpoint_conversion_mapping(model_type="llama", mapping=[QKV])
    assert get_checkpoint_conversion_mapping("llama") == [QKV]
    with pytest.raises(ConversionError, match="overwrite=True"):
        register_checkpoint_conversion_mapping(model_type="llama", mapping=[])
    assert get_checkpoint_conversion_mapping("llama") == [QKV]  # unchanged by the failed call
    register_checkpoint_conversion_mapping("llama", [], overwrite=True)
    assert get_checkpoint_conversion_mapping("llama") == []


def test_builtins_need_overwrite_too():
    with pytest.raises(ConversionError, match="qwen2_moe"):
        register_checkpoint_conversion_mapping(model_type="qwen2_moe", mapping=[QKV])
    register_checkpoint_conversion_mapping(model_type="qwen2_moe", mapping=[QKV], overwrite=True)
    assert get_checkpoint_conversion_mapping("qwen2_moe") == [QKV]


def test_get_returns_a_copy():
    mapping = get_checkpoint_conversion_mapping("qwen2_moe")
    mapping.append(QKV)
    mapping[0].operations = ()
    fresh = get_checkpoint_conversion_mapping("qwen2_moe")
    assert len(fresh) == 2 and fresh[0].operations == (MergeModulelist(dim=0), Concatenate(dim=1, equal_parts=True))


def test_registered_mapping_is_snapshotted():
    items = [QKV]
    register_checkpoint_conversion_mapping(model_type="mistral", mapping=items)
    items.append(WeightRenaming("a", "b"))
    assert get_checkpoint_conversion_mapping("mistral") == [QKV]


def test_any_iterable_mapping():
    register_checkpoint_conversion_mapping(model_type="gpt2", mapping=(t for t in [QKV]))
    assert get_checkpoint_conversion_mapping("gpt2") == [QKV]


@pytest.mark.parametrize("model_type", ["", None, 3])
def test_bad_model_type(model_type):
    with pytest.raises(ConversionError, match="model_type"):
        register_checkpoint_conversion_mapping(model_type=model_type, mapping=[QKV])


def test_bad_mapping_items_leave_the_registry_unchanged():
    with pytest.raises(TypeError, match="WeightConverter/WeightRenaming"):
        register_checkpoint_conversion_mapping(
            model_type="qwen2_moe", mapping=[QKV, Concatenate(dim=0)], overwrite=True
        )
    assert len(get_checkpoint_conversion_mapping("qwen2_moe")) == 2


def test_public_names():
    assert modelpatch.register_checkpoint_conversion_mapping is register_checkpoint_conversion_mapping
    assert modelpatch.get_checkpoint_conversion_mapping is get_checkpoint_conversion_mapping


def test_concurrent_registrations_all_land():
    errors = []

    def register(i):
        try:
            register_checkpoint_conversion_mapping(model_type=f"custom_{i}", mapping=[QKV])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    run_on_threads(register, 16)
    assert not errors
    assert all(get_checkpoint_conversion_mapping(f"custom_{i}") == [QKV] for i in range(16))
