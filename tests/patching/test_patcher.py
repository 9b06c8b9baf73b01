"""``Patcher``: argument validation and weight-conversion adjustments (``filters_out`` / ``adjust_conversions``)."""

from __future__ import annotations

import pytest
from torch import nn
from transformers import LlamaModel
from transformers.models.llama.modeling_llama import LlamaAttention

import modelpatch
from modelpatch import (
    Concatenate,
    MergeModulelist,
    Patcher,
    PatchRegistryError,
    WeightConverter,
    WeightRenaming,
)
from support.patching import MarkedLlamaAttention, MarkedLlamaMLP, PlainModule, llama_config


def _qkv_converter(suffix: str = "weight") -> WeightConverter:
    return WeightConverter(
        source_patterns=[f"q_proj.{suffix}", f"k_proj.{suffix}", f"v_proj.{suffix}"],
        target_patterns=[f"qkv_proj.{suffix}"],
        operations=[Concatenate(dim=0)],
    )


def _experts_converters() -> list[WeightConverter]:
    return [
        WeightConverter(
            ["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
            "mlp.experts.gate_up_proj",
            [MergeModulelist(dim=0), Concatenate(dim=1)],
        ),
        WeightConverter(["mlp.experts.*.down_proj.weight"], "mlp.experts.down_proj", [MergeModulelist(dim=0)]),
    ]


# --- validation -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [object, "LlamaAttention", nn.Linear(2, 2), None])
def test_bad_class_mapping_value_is_a_type_error(bad):
    with pytest.raises(TypeError, match="LlamaAttention"):
        Patcher(class_mapping={"LlamaAttention": bad})


@pytest.mark.parametrize("bad", [["LlamaAttention"], "LlamaAttention", 3])
def test_class_mapping_must_be_a_mapping(bad):
    with pytest.raises(TypeError):
        Patcher(class_mapping=bad)


def test_invalid_class_mapping_pattern_names_it():
    with pytest.raises(PatchRegistryError, match=r"'\[Attention'"):
        Patcher(class_mapping={"[Attention": MarkedLlamaAttention})


def test_invalid_filter_pattern_names_it():
    with pytest.raises(PatchRegistryError) as info:
        Patcher(filtered_weight_conversion_patterns=[r"\.gate_up_proj", "down_proj(", "x"])
    assert "'down_proj('" in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("bad", [[3], [None], [b"gate_up_proj"], 3.5])
def test_filter_patterns_must_be_strings(bad):
    with pytest.raises(TypeError):
        Patcher(filtered_weight_conversion_patterns=bad)


@pytest.mark.parametrize(
    "bad",
    ["q_proj", {"source_patterns": ["q_proj"]}, [_qkv_converter(), "k_proj"], [Concatenate(dim=0)], 1],
    ids=["string", "dict", "list-with-string", "operation-not-converter", "int"],
)
def test_extra_weight_conversions_of_wrong_type_is_a_type_error(bad):
    with pytest.raises(TypeError, match="extra_weight_conversions"):
        Patcher(extra_weight_conversions=bad)


def test_defaults_and_properties():
    patcher = Patcher()
    assert patcher.class_mapping == {}
    assert patcher.filtered_weight_conversion_patterns == []
    assert patcher.extra_weight_conversions == []
    with patcher:  # an empty Patcher is a valid (no-op) scope
        model = LlamaModel(llama_config(num_hidden_layers=1))
    assert type(model.layers[0].self_attn) is LlamaAttention


def test_single_values_are_accepted_as_lists():
    converter = _qkv_converter()
    patcher = Patcher(
        {"LlamaAttention": MarkedLlamaAttention},
        filtered_weight_conversion_patterns=r"\.gate_up_proj",
        extra_weight_conversions=converter,
    )
    assert patcher.filtered_weight_conversion_patterns == [r"\.gate_up_proj"]
    assert patcher.extra_weight_conversions == [converter]


def test_transformers_own_transforms_are_translated_when_the_patcher_is_made():
    """A Patcher is where transformers' transforms enter: it holds modelpatch's translation from then on."""
    from transformers import core_model_loading as hf

    from modelpatch import MergeModulelist, WeightConverter

    stock = hf.WeightConverter("experts.*.w1.weight", "experts.w1", [hf.MergeModulelist(dim=0)])
    patcher = Patcher(extra_weight_conversions=[stock])
    assert patcher.extra_weight_conversions == [
        WeightConverter("experts.*.w1.weight", "experts.w1", [MergeModulelist(dim=0)])
    ]


def test_class_mapping_property_is_a_copy():
    patcher = Patcher({"LlamaAttention": MarkedLlamaAttention})
    mapping = patcher.class_mapping
    mapping["LlamaMLP"] = MarkedLlamaMLP
    del mapping["LlamaAttention"]
    assert patcher.class_mapping == {"LlamaAttention": MarkedLlamaAttention}


def test_patcher_mapping_is_snapshotted_at_construction():
    source = {"LlamaAttention": MarkedLlamaAttention}
    patcher = Patcher(source)
    source["LlamaAttention"] = PlainModule  # mutating the caller's dict later changes nothing
    with patcher:
        model = LlamaModel(llama_config(num_hidden_layers=1))
    assert type(model.layers[0].self_attn) is MarkedLlamaAttention


def test_constructing_a_patcher_does_not_touch_the_registry():
    modelpatch.register_patch_mapping({"LlamaMLP": MarkedLlamaMLP})
    Patcher({"LlamaMLP": PlainModule, "LlamaAttention": MarkedLlamaAttention})
    assert modelpatch.get_patch_mapping() == {"LlamaMLP": MarkedLlamaMLP}


# --- filters_out / adjust_conversions --------------------------------------------------------------------------


def test_filters_out_matches_source_or_target_patterns():
    gate_up, down = _experts_converters()
    qkv = _qkv_converter()
    patcher = Patcher(filtered_weight_conversion_patterns=[r"\.gate_up_proj", r"\.down_proj"])
    assert patcher.filters_out(gate_up)  # via its target "mlp.experts.gate_up_proj"
    assert patcher.filters_out(down)  # via source and target
    assert not patcher.filters_out(qkv)

    by_source = Patcher(filtered_weight_conversion_patterns="k_proj")
    assert by_source.filters_out(qkv)  # "k_proj.weight" is a source pattern
    assert not by_source.filters_out(gate_up)

    renaming = WeightRenaming(r"^transformer\.", "model.")
    assert Patcher(filtered_weight_conversion_patterns="model").filters_out(renaming)
    assert not Patcher(filtered_weight_conversion_patterns="^lm_head").filters_out(renaming)


def test_filters_use_re_search():
    gate_up, _ = _experts_converters()
    assert Patcher(filtered_weight_conversion_patterns="gate_up").filters_out(gate_up)
    assert not Patcher(filtered_weight_conversion_patterns="^gate_up").filters_out(gate_up)
    assert Patcher(filtered_weight_conversion_patterns="experts\\.gate_up_proj$").filters_out(gate_up)


def test_no_filters_filter_nothing():
    patcher = Patcher()
    assert not any(patcher.filters_out(t) for t in [*_experts_converters(), _qkv_converter()])


def test_adjust_conversions_prepends_extras_and_drops_filtered_in_order():
    gate_up, down = _experts_converters()
    rename = WeightRenaming(r"^transformer\.", "model.")
    extra_w, extra_b = _qkv_converter("weight"), _qkv_converter("bias")
    patcher = Patcher(
        {"LlamaAttention": MarkedLlamaAttention},
        filtered_weight_conversion_patterns=[r"\.gate_up_proj"],
        extra_weight_conversions=[extra_w, extra_b],
    )
    existing = [rename, gate_up, down]
    adjusted = patcher.adjust_conversions(existing)
    assert adjusted == [extra_w, extra_b, rename, down]
    assert adjusted[0] is extra_w and adjusted[1] is extra_b and adjusted[2] is rename
    assert existing == [rename, gate_up, down]  # the input list is not modified
    # Works on any iterable, including a generator, and on an empty one.
    assert patcher.adjust_conversions(t for t in existing) == adjusted
    assert patcher.adjust_conversions([]) == [extra_w, extra_b]


def test_extras_are_never_filtered():
    extra = _qkv_converter()
    patcher = Patcher(filtered_weight_conversion_patterns="qkv", extra_weight_conversions=[extra])
    assert patcher.filters_out(extra)
    assert patcher.adjust_conversions([_qkv_converter("bias")]) == [extra]


def test_repr_names_everything():
    patcher = Patcher(
        {"LlamaAttention": MarkedLlamaAttention},
        filtered_weight_conversion_patterns="gate_up",
        extra_weight_conversions=[_qkv_converter()],
    )
    text = repr(patcher)
    assert "LlamaAttention" in text and "MarkedLlamaAttention" in text
    assert "gate_up" in text and "qkv_proj.weight" in text
