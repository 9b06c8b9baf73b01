"""Key patterns of WeightRenaming / WeightConverter (transformers' syntax): ``*.`` wildcards and converter indices, key
boundaries, rendering, scopes, inverses, validation."""

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
from modelpatch.conversion.transforms import (
    GroupWeightRename,
    IndexOffsetRenaming,
    PrefixChange,
    compile_key_pattern,
    key_template,
    literal_form,
)


def test_converter_star_captures_a_digits_only_index():
    pattern = compile_key_pattern("mlp.experts.*.gate_proj.weight", indexed=True)
    match = pattern.search("model.layers.3.mlp.experts.12.gate_proj.weight")
    assert match is not None and match.group("index") == "12"
    assert pattern.search("model.layers.3.mlp.experts.x.gate_proj.weight") is None
    assert pattern.search("model.layers.3.mlp.experts..gate_proj.weight") is None
    # Inside a segment too (transformers' ``ngram_embedding.shard_*.weight``).
    assert compile_key_pattern("shard_*.weight", indexed=True).search("e.shard_3.weight").group("index") == "3"


def test_renaming_star_matches_any_characters_several_times():
    renaming = WeightRenaming("encoder.*.attention.*.inv_freq", "inv_freq")
    assert renaming.rename("m.encoder.layer.0.attention.self.rotary.inv_freq") == "m.inv_freq"
    assert renaming.rename("m.encoder.0.inv_freq") is None


@pytest.mark.parametrize("pattern", ["layers.*", r"q_proj.weigh*t"])
def test_star_not_before_a_dot_is_an_ordinary_regex_quantifier(pattern):
    compiled = compile_key_pattern(pattern, indexed=True)
    assert "index" not in compiled.groupindex
    assert compiled.search("a.q_proj.weighhht" if "weigh" in pattern else "a.layers.0")


def test_patterns_stop_at_a_key_boundary():
    renaming = WeightRenaming("mlp.w2.weight", "mlp.down_proj.weight")
    assert renaming.rename("layers.0.mlp.w2.weight") == "layers.0.mlp.down_proj.weight"
    assert renaming.rename("layers.0.mlp.w2.weight_scale_inv") is None
    # A pattern ending in a dot or an underscore is a prefix, as in transformers.
    assert WeightRenaming("mlp.w2.", "mlp.down.").rename("mlp.w2.weight_scale_inv") == "mlp.down.weight_scale_inv"
    assert WeightRenaming("hc_", "h_").rename("a.hc_fn") == "a.h_fn"


def test_leftmost_match_wins_then_the_longest_pattern():
    converter = WeightConverter(["weight", "weight.absmax"], ["w", "w.absmax"], [])
    assert converter.match_source("a.weight.absmax").position == 1
    converter = WeightConverter(["b.c", "a.b"], "x", [])
    assert converter.match_source("a.b.c").position == 1


def test_pattern_errors_name_the_pattern():
    with pytest.raises(ConversionError, match="more than one"):
        compile_key_pattern("layers.*.experts.*.w1", indexed=True)
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


def test_rendering_keeps_the_rest_of_the_key():
    converter = WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])
    found = converter.match_source("model.layers.3.self_attn.k_proj.bias")
    assert found.position == 1
    assert found.render("qkv_proj") == "model.layers.3.self_attn.qkv_proj.bias"
    found = WeightConverter("experts.*.w1", "experts.gate").match_source("m.experts.4.w1.weight")
    assert found.index == 4 and found.render("experts.*.w1", index=4) == "m.experts.4.w1.weight"
    with pytest.raises(ConversionError, match="index"):
        found.render("experts.*.w1")


def test_converter_match_source_and_target():
    converter = WeightConverter(
        ["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
        "mlp.experts.gate_up_proj",
        [MergeModulelist(dim=0), Concatenate(dim=1)],
    )
    assert converter.match_source("model.layers.0.mlp.experts.3.up_proj.weight").position == 1
    assert converter.match_source("model.layers.0.mlp.shared_expert.up_proj.weight") is None
    assert converter.match_target("model.layers.0.mlp.experts.gate_up_proj").position == 0
    assert converter.match_target("model.layers.0.mlp.experts.gate_up_proj_bias") is None


def test_target_templates_follow_transformers():
    # Escapes, anchors and look-arounds are dropped; \1 is the source's first group.
    renaming = WeightRenaming(r"\.indexer\.wq_b\.", r"\.compressor\.indexer\.q_b_proj\.")
    assert renaming.rename("layers.0.indexer.wq_b.weight") == "layers.0.compressor.indexer.q_b_proj.weight"
    renaming = WeightRenaming(r"(vision_tower\.layers\.\d+)\.ln_1\.", r"\1.layernorm_before.")
    assert (
        renaming.rename("model.vision_tower.layers.7.ln_1.weight")
        == "model.vision_tower.layers.7.layernorm_before.weight"
    )
    assert key_template(r"^model(?!\.(language_model|visual))") == ("model", None)
    assert key_template(r"^(?:(?!timm_model\.))(.+)") == ("\\1", "(.+)")
    with pytest.raises(ConversionError, match="not a key template"):
        WeightRenaming("a", r"b\d+")


def test_scoped_transforms_see_keys_under_their_prefix_only():
    renaming = WeightRenaming(r"^language_model\.model", "language_model").scoped("", "model")
    assert renaming.rename("model.language_model.model.layers.0") == "model.language_model.layers.0"
    assert renaming.rename("language_model.model.layers.0") == "language_model.layers.0"
    inner = WeightRenaming(r"^embed\.", "embed_tokens.").scoped("text_model", "model")
    assert inner.rename("model.text_model.embed.weight") == "model.text_model.embed_tokens.weight"
    assert inner.rename("text_model.embed.weight") == "text_model.embed_tokens.weight"
    assert inner.rename("model.vision.embed.weight") is None
    assert inner != WeightRenaming(r"^embed\.", "embed_tokens.")


def test_renaming_and_inverse():
    renaming = WeightRenaming(r"\.block_sparse_moe\.", ".mlp.")
    assert renaming.rename("model.layers.0.block_sparse_moe.gate.weight") == "model.layers.0.mlp.gate.weight"
    assert renaming.rename("model.norm.weight") is None
    inverse = renaming.reverse()
    assert inverse.rename("model.layers.0.mlp.gate.weight") == "model.layers.0.block_sparse_moe.gate.weight"


def test_renaming_with_lookahead_inverts():
    renaming = WeightRenaming(r"^model\.(?!language_model\.|visual\.)", "model.language_model.")
    assert renaming.rename("model.layers.0.x") == "model.language_model.layers.0.x"
    assert renaming.rename("model.visual.blocks.0") is None
    assert renaming.rename("lm_head.weight") is None
    assert renaming.reverse().rename("model.language_model.layers.0.x") == "model.layers.0.x"


def test_renaming_with_a_group_inverts_like_transformers():
    renaming = WeightRenaming(r"layers\.(\d+)\.attn", r"blocks.\1.attention")
    assert renaming.rename("m.layers.3.attn.w") == "m.blocks.3.attention.w"
    assert renaming.reverse().rename("m.blocks.3.attention.w") == "m.layers.3.attn.w"
    prefix = PrefixChange(prefix_to_add="timm_model")
    assert prefix.rename("conv.weight") == "timm_model.conv.weight" and prefix.rename("timm_model.conv.weight") is None
    assert prefix.reverse().rename("timm_model.conv.weight") == "conv.weight" and prefix.alternative


def test_renaming_that_cannot_be_inverted():
    with pytest.raises(ConversionError, match="cannot be reversed"):
        WeightRenaming(r"layer.+norm", "norm").reverse()


def test_renaming_takes_one_target_for_any_number_of_sources():
    legacy = WeightRenaming(
        [r"^model\.language_model\.model", r"^language_model\.model\.model"], "model.language_model"
    )
    assert legacy.rename("language_model.model.model.x") == "model.language_model.x"
    assert legacy.rename("model.language_model.model.x") == "model.language_model.x"
    with pytest.raises(ConversionError, match="one target"):
        WeightRenaming("a", ["b", "c"])


def test_group_rename_pairs_and_guard():
    group = GroupWeightRename([r"blocks.(\d+).norm0", r"blocks.(\d+).norm1"], [r"blocks.\1.norm1", r"blocks.\1.norm2"])
    assert (
        group.rename("blocks.0.norm0.w") == "blocks.0.norm1.w"
        and group.rename("blocks.0.norm1.w") == "blocks.0.norm2.w"
    )
    assert group.is_guard("blocks.2.norm0.w") and not group.is_guard("blocks.2.norm1.w")
    assert group.reverse().rename("blocks.0.norm2.w") == "blocks.0.norm1.w"
    with pytest.raises(ConversionError, match="pairs"):
        GroupWeightRename(["a", "b"], ["c"])


def test_index_offset_renaming():
    renaming = IndexOffsetRenaming(r"attn_queries\.(\d+)", r"layers.\1.query", offset=1)
    assert renaming.rename("m.attn_queries.0.w") == "m.layers.1.query.w"
    assert renaming.reverse().rename("m.layers.1.query.w") == "m.attn_queries.0.w"


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
        (r"(?<![^.])experts\.gate_up_proj$", "experts.gate_up_proj"),
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
    assert WeightRenaming("a", "b", alternative=True) != WeightRenaming("a", "b")
    assert len({a, b, c}) == 2
    alternative = WeightConverter(["q", "k"], "qk", [Concatenate(dim=0)], alternative=True)
    assert alternative != a and not a.alternative
    assert "alternative=True" in repr(alternative) and "alternative" not in repr(a)


def test_transpose_and_other_operations_in_converters():
    converter = WeightConverter("w_in", "w_out", [Transpose(0, 1)])
    assert converter.operations == (Transpose(0, 1),)
