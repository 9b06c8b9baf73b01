"""Key patterns of WeightRenaming / WeightConverter: the ``*`` index segment, rendering, inverses, validation."""

from __future__ import annotations

import pytest

from modelpatch import (
    Concatenate,
    ConversionError,
    MergeModulelist,
    Transpose,
    WeightConverter,
    WeightRenaming,
    WeightTransform,
)
from modelpatch.conversion.transforms import compile_key_pattern, literal_form, render_target


def test_star_segment_captures_an_integer_index():
    pattern = compile_key_pattern("mlp.experts.*.gate_proj.weight")
    match = pattern.search("model.layers.3.mlp.experts.12.gate_proj.weight")
    assert match is not None and match.group("index") == "12"
    assert pattern.search("model.layers.3.mlp.experts.x.gate_proj.weight") is None
    assert pattern.search("model.layers.3.mlp.experts..gate_proj.weight") is None


@pytest.mark.parametrize("pattern", ["*.weight", "layers.*", "*"])
def test_star_segment_at_either_end(pattern):
    compiled = compile_key_pattern(pattern)
    assert compiled.search(pattern.replace("*", "7")).group("index") == "7"


def test_star_inside_a_segment_is_an_ordinary_regex_quantifier():
    pattern = compile_key_pattern(r"q_proj.weigh*t")
    assert "index" not in pattern.groupindex
    assert pattern.search("a.q_proj.weighhht")


def test_pattern_errors_name_the_pattern():
    with pytest.raises(ConversionError, match="more than one"):
        compile_key_pattern("layers.*.experts.*.w1")
    with pytest.raises(ConversionError, match=r"'q_proj\('"):
        WeightConverter("q_proj(", "qkv_proj")
    with pytest.raises(ConversionError, match="source_patterns"):
        WeightConverter([], "x")
    with pytest.raises(ConversionError, match="source_patterns"):
        WeightConverter([""], "x")
    with pytest.raises(ConversionError, match="source_patterns"):
        WeightConverter([3], "x")


def test_converter_operations_are_validated():
    with pytest.raises(TypeError, match="ConversionOperation"):
        WeightConverter("a", "b", [object()])
    single = WeightConverter("a", "b", Concatenate(dim=0))
    assert single.operations == (Concatenate(dim=0),)
    assert WeightConverter("a", "b").operations == ()


def test_render_target_keeps_the_rest_of_the_key():
    converter = WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])
    position, match = converter.match_source("model.layers.3.self_attn.k_proj.bias")
    assert position == 1
    assert render_target("qkv_proj", match) == "model.layers.3.self_attn.qkv_proj.bias"
    _, match = WeightConverter("experts.*.w1", "experts.gate").match_source("m.experts.4.w1.weight")
    assert render_target("experts.*.w1", match, index=4) == "m.experts.4.w1.weight"
    with pytest.raises(ConversionError, match="index"):
        render_target("experts.*.w1", match)


def test_converter_match_source_and_target():
    converter = WeightConverter(
        ["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
        "mlp.experts.gate_up_proj",
        [MergeModulelist(dim=0), Concatenate(dim=1)],
    )
    assert converter.match_source("model.layers.0.mlp.experts.3.up_proj.weight")[0] == 1
    assert converter.match_source("model.layers.0.mlp.shared_expert.up_proj.weight") is None
    assert converter.match_target("model.layers.0.mlp.experts.gate_up_proj")[0] == 0


def test_renaming_and_inverse():
    renaming = WeightRenaming(r"\.block_sparse_moe\.", ".mlp.")
    assert renaming.rename("model.layers.0.block_sparse_moe.gate.weight") == "model.layers.0.mlp.gate.weight"
    assert renaming.rename("model.norm.weight") is None
    inverse = renaming.inverse()
    assert inverse.rename("model.layers.0.mlp.gate.weight") == "model.layers.0.block_sparse_moe.gate.weight"


def test_renaming_with_lookahead_inverts():
    renaming = WeightRenaming(r"^model\.(?!language_model\.|visual\.)", "model.language_model.")
    assert renaming.rename("model.layers.0.x") == "model.language_model.layers.0.x"
    assert renaming.rename("model.visual.blocks.0") is None
    assert renaming.rename("lm_head.weight") is None
    assert renaming.inverse().rename("model.language_model.layers.0.x") == "model.layers.0.x"


def test_renaming_that_cannot_be_inverted():
    with pytest.raises(ConversionError, match="cannot be reversed"):
        WeightRenaming(r"layers\.(\d+)\.attn", r"blocks.\1.attention").inverse()
    with pytest.raises(ConversionError, match="cannot be reversed"):
        WeightRenaming(r"layer.+norm", "norm").inverse()


def test_renaming_takes_exactly_one_pattern_each():
    with pytest.raises(ConversionError, match="one source and one target"):
        WeightRenaming(["a", "b"], "c")
    with pytest.raises(ConversionError, match="one source and one target"):
        WeightRenaming("a", ["b", "c"])


def test_renaming_to_empty_string_is_allowed():
    assert WeightRenaming(r"^bert\.", "").rename("bert.embeddings.x") == "embeddings.x"


@pytest.mark.parametrize(
    ("pattern", "literal"),
    [
        (r"\.block_sparse_moe\.", ".block_sparse_moe."),
        (r"^visual\.", "visual."),
        (r"^model\.(?!language_model\.|visual\.)", "model."),
        ("q_proj", "q_proj"),
        (r"layers\.\d+", None),
        ("a|b", None),
        ("(x)", None),
    ],
)
def test_literal_form(pattern, literal):
    assert literal_form(pattern) == literal


def test_transforms_compare_by_value():
    a = WeightConverter(["q", "k"], "qk", [Concatenate(dim=0)])
    b = WeightConverter(("q", "k"), ["qk"], (Concatenate(dim=0),))
    c = WeightConverter(["q", "k"], "qk", [Concatenate(dim=1)])
    assert a == b and hash(a) == hash(b) and a != c
    assert WeightRenaming("a", "b") == WeightRenaming("a", "b") != WeightConverter("a", "b")
    assert isinstance(a, WeightTransform) and isinstance(WeightRenaming("a", "b"), WeightTransform)
    assert "Concatenate" in repr(a) and "WeightRenaming('a', 'b')" == repr(WeightRenaming("a", "b"))
    assert len({a, b, c}) == 2
    alternative = WeightConverter(["q", "k"], "qk", [Concatenate(dim=0)], alternative=True)
    assert alternative != a and not a.alternative
    assert "alternative=True" in repr(alternative) and "alternative" not in repr(a)


def test_transpose_and_other_operations_in_converters():
    converter = WeightConverter("w_in", "w_out", [Transpose(0, 1)])
    assert converter.operations == (Transpose(0, 1),)
