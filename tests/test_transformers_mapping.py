"""transformers' conversion registry, translated: every entry of the installed release translates or is refused by
name, the transforms a release added load its checkpoints as stock does, and a model's transforms are collected as
stock collects them (class names, sub-model scopes, legacy)."""

from __future__ import annotations

import re

import pytest
import torch
import transformers

import modelpatch
from modelpatch import (
    ConversionError,
    LayerPairRenaming,
    PrefixChange,
    WeightRenaming,
    WeightTransform,
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
)
from modelpatch import _transformers_mapping as transformers_mapping
from modelpatch.conversion.registry import legacy_conversions
from support.compare import assert_bitwise_equal
from support.files import read_tensors, rewrite_checkpoint
from support.models import sized_config

# Operations of transformers that modelpatch does not translate yet: the mappings holding them are refused by name.
NOT_TRANSLATED: set[str] = set()


def test_every_builtin_mapping_translates_or_is_refused_by_name():
    refused = {}
    for key in sorted(transformers_mapping.builtin_keys()):
        try:
            translated = transformers_mapping.builtin_mapping(key)
        except ConversionError as error:
            refused[key] = str(error)
            continue
        assert translated is not None and all(isinstance(t, WeightTransform) for t in translated), key
    for key, message in refused.items():
        named = re.search(
            r"Cannot translate transformers' (?:operation )?(\w+) in the conversion mapping of '(.+)'", message
        )
        assert named is not None and named[1] in NOT_TRANSLATED and named[2] == key, message


def test_layer_pair_renaming_names_and_inverse():
    renaming = LayerPairRenaming()
    assert renaming.alternative
    pairs = {
        "backbone.layers.2.mixer.q_proj.weight": "backbone.layers.1.self_attn.q_proj.weight",
        "backbone.layers.3.mixer.up_proj.weight": "backbone.layers.1.mlp.up_proj.weight",
        "backbone.layers.2.attn_alpha": "backbone.layers.1.lambda_1",
        "backbone.layers.3.mlp_alpha": "backbone.layers.1.lambda_2",
    }
    for stored, runtime in pairs.items():
        assert renaming.rename(stored) == runtime and renaming.reverse().rename(runtime) == stored
    assert renaming.rename("backbone.layers.2.mixers.weight") is None
    assert renaming.rename("backbone.layers.1.self_attn.q_proj.weight") is None


def _two_blocks(tensors: dict[str, torch.Tensor]) -> None:
    """The stock-saved (one block per layer) tensors renamed into the two-block layout."""
    split = LayerPairRenaming(split=True)
    for key in list(tensors):
        renamed = split.rename(key)
        if renamed is not None:
            tensors[renamed] = tensors.pop(key)


def test_a_two_block_checkpoint_loads_as_stock_and_saves_back(tmp_path):
    """transformers 5.24's Dory checkpoints store each decoder layer as two blocks (its LayerPairCollapse)."""
    if not hasattr(transformers, "DoryForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Dory (5.24 added it)")
    dory = transformers.DoryConfig.model_type
    config = sized_config(dory, vocab=64, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, head_dim=8)
    torch.manual_seed(0)
    transformers.DoryForCausalLM(config).save_pretrained(tmp_path / "stock")
    source = rewrite_checkpoint(tmp_path / "stock", tmp_path / "two-blocks", _two_blocks)
    stored = read_tensors(source)
    assert any(".mixer." in key for key in stored) and any(key.endswith("mlp_alpha") for key in stored)

    stock = transformers.DoryForCausalLM.from_pretrained(source)
    patched = modelpatch.AutoModelForCausalLM.from_pretrained(source)
    assert_bitwise_equal(patched.state_dict(), stock.state_dict())
    patched.save_pretrained(tmp_path / "saved")
    assert_bitwise_equal(read_tensors(tmp_path / "saved"), stored)


def test_model_conversions_walk_sub_models_class_names_first():
    from transformers import AutoConfig, LlavaForConditionalGeneration

    config = AutoConfig.for_model("llava")
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(config)
    transforms = transformers_mapping.model_conversions(model)
    # The root's model-type mapping unscoped, then the class mappings of LlavaModel and of the CLIP vision tower, each
    # scoped to its sub-model (with or without the base model's prefix).
    assert transforms[:4] == get_checkpoint_conversion_mapping("llava")
    inner, vision = transforms[4:]
    assert inner.source_patterns == ("^language_model.model",) and inner.scope == ("", "model")
    assert isinstance(vision, PrefixChange) and vision.scope == ("vision_tower", "model")
    assert vision.rename("model.vision_tower.vision_model.embeddings.x") == "model.vision_tower.embeddings.x"
    assert all(t.alternative for t in legacy_conversions())


def test_a_class_name_mapping_wins_over_the_model_type():
    from transformers import AutoConfig, Qwen2MoeForCausalLM

    config = AutoConfig.for_model("qwen2_moe", num_hidden_layers=1, num_experts=2)
    with torch.device("meta"):
        model = Qwen2MoeForCausalLM(config)
    renaming = WeightRenaming(r"^transformer\.", "model.")
    register_checkpoint_conversion_mapping("Qwen2MoeForCausalLM", [renaming])
    transforms = transformers_mapping.model_conversions(model)
    # The root matched by class; its Qwen2MoeModel still gets the model type's mapping, scoped to it, as in stock.
    assert transforms[0] == renaming
    assert [t.source_patterns for t in transforms[1:]] == [
        t.source_patterns for t in get_checkpoint_conversion_mapping("qwen2_moe")
    ]
    assert all(t.scope == ("", "model") for t in transforms[1:])


def _inkling2_loop(path):
    """A tiny Inkling2Loop causal LM written by stock ``save_pretrained`` (transformers 5.24 added the type)."""
    from transformers import CONFIG_MAPPING

    if "inkling2_loop_text" not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no Inkling2Loop (5.24 added it)")
    from support.zoo import load_zoo

    config = load_zoo().tiny_config(CONFIG_MAPPING["inkling2_loop_text"])
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def test_inkling2_loop_message_queries_and_experts_load_and_save_as_stock(tmp_path):
    """Its mapping merges two query tensors by row groups, and passes its experts through when stored without scales."""
    source = _inkling2_loop(tmp_path / "stock")
    stored = read_tensors(source)
    assert any(key.endswith("middle_cycle_cross_pass_kv_queries") for key in stored)
    assert any(key.endswith("experts.w13_weight") for key in stored)
    stock = transformers.AutoModelForCausalLM.from_pretrained(source)
    patched = modelpatch.AutoModelForCausalLM.from_pretrained(source)
    assert_bitwise_equal(patched.state_dict(), stock.state_dict())
    assert any(".message_input.query" in key for key in modelpatch.get_load_report(patched).converted)
    patched.save_pretrained(tmp_path / "saved")
    assert_bitwise_equal(read_tensors(tmp_path / "saved"), stored)


def test_inkling2_loop_experts_stored_with_their_scales_are_refused_by_name(tmp_path):
    """The original checkpoints' NVFP4 / MXFP8 experts, which stock dequantizes: refused before any tensor is read."""
    source = _inkling2_loop(tmp_path / "stock")

    def add_scales(tensors: dict[str, torch.Tensor]) -> None:
        for key in [k for k in tensors if k.endswith("experts.w13_weight")]:
            tensors[key + "_scale"] = torch.full((*tensors[key].shape[:2], 1), 127, dtype=torch.uint8)

    scaled = rewrite_checkpoint(source, tmp_path / "scaled", add_scales)
    with pytest.raises(modelpatch.LoadPlanError, match=r"NVFP4 / MXFP8 scale data beside the weight") as caught:
        modelpatch.AutoModelForCausalLM.from_pretrained(scaled)
    assert "experts.w13_weight" in str(caught.value)
