"""A slice of the zoo sweep (``benchmarks/zoo.py``) in CI: tiny models of the model types below are written by stock
``save_pretrained`` (transformers' reverse conversions: the published layout), and modelpatch must load them to the
state stock loads, bit for bit, and save them to the tensors stock saves.

The slice holds one or more types of every distinct MoE and VLM mapping transformers registers, and every operation
and transform kind its mapping uses (per-expert merges, Ernie's expert groups, check-dims transposes, class-name
mappings of sub-models, prefix changes), plus plain bert, gpt2 and t5.
"""

from __future__ import annotations

import pytest
import transformers

import modelpatch
from modelpatch import MergeModulelist, WeightConverter
from support.zoo import load_zoo

zoo = load_zoo()

# model type: whether its load must convert groups of tensors (experts merged, q/k/v split, ...).
SLICE = {
    # transformers' qwen2_moe mapping and the types that alias it
    "qwen2_moe": True,
    "qwen3_moe": True,
    "olmoe": True,
    "deepseek_v3": True,
    "glm4_moe": True,
    "ernie4_5_moe": True,
    "dots1": True,
    "hunyuan_v1_moe": True,
    # mixtral's (block_sparse_moe renaming + w1/w3/w2) and the ones like it
    "mixtral": True,
    "minimax": True,
    "phimoe": True,
    "lfm2_moe": True,
    "nemotron_h": True,
    # 3-D experts by renaming, feed_forward experts
    "granitemoe": False,
    "jamba": True,
    # Ernie 4.5 VL: expert groups split text/vision, transposed gates; Qwen3-VL-MoE: check-dims transposes
    "ernie4_5_vl_moe": True,
    "qwen3_vl_moe": True,
    # single-op mappings: Split (Molmo2), GroupWeightRename + PermuteForRope (Kimi K2.5), PermuteForRope alone
    # (Mistral Large 4), Interleave + IndexOffsetRenaming (Inkling 2), an indexed Concatenate of shards (Qwen4 exp),
    # DeepSeek-V4's renamings and experts
    "molmo2": True,
    "kimi_k25": True,
    "mistral_large4": True,
    "inkling2_text": True,
    # Inkling 2 Loop (5.24): message queries merged by row groups, experts whose scales a checkpoint may lack
    "inkling2_loop_text": True,
    "qwen4_exp_text": True,
    "deepseek_v4": True,
    # VLMs: llava's mapping and its aliases, class-name mappings of Qwen2-VL / Qwen2.5-VL and their sub-models
    "llava": False,
    "mistral3": False,
    "paligemma": False,
    "qwen2_vl": False,
    "qwen2_5_vl": False,
    # vision class mappings (ViT-style renamings, Dinov2's chunked gate/up, CLIP-style vision towers)
    "vit": False,
    "dinov2": False,
    "siglip": False,
    # no mapping at all
    "bert": False,
    "gpt2": False,
    "t5": False,
    # a config that refuses num_hidden_layers being set (it derives it from block_sizes)
    "funnel": False,
    # num_hidden_layers above every index of its checkpoint: its decoder holds one layer fewer
    "oneformer": False,
}


@pytest.fixture(scope="module")
def registry_classes():
    return zoo._registry_classes()


@pytest.mark.parametrize("model_type", sorted(SLICE))
def test_zoo_type_round_trips_bitwise(model_type, registry_classes):
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(
            f"transformers {transformers.__version__} has no model type {model_type!r} (a later release added it)"
        )
    result = zoo.check_type(model_type, registry_classes)
    assert result.status == "bitwise", zoo._line(result)
    tested = [c for c in result.classes if c.status == "bitwise"]
    assert tested, zoo._line(result)
    if SLICE[model_type]:
        assert any(c.converted_groups for c in tested), f"{model_type}: no conversion was exercised"


def test_the_sweep_notices_a_wrong_conversion():
    """A mapping that merges Mixtral's experts in the wrong order loads a different state: the check fails."""
    modelpatch.register_checkpoint_conversion_mapping(
        "mixtral",
        [
            modelpatch.WeightRenaming(".block_sparse_moe.", ".mlp."),
            WeightConverter(
                [".experts.*.w3.weight", ".experts.*.w1.weight"],
                ".experts.gate_up_proj",
                [MergeModulelist(dim=0), modelpatch.Concatenate(dim=1)],
            ),
            WeightConverter(".experts.*.w2.weight", ".experts.down_proj", [MergeModulelist(dim=0)]),
        ],
        overwrite=True,
    )
    result = zoo.check_type("mixtral")
    assert result.status == "failed" and "values differ" in result.reason, zoo._line(result)


def test_tiny_configs_shrink_sub_configs_and_token_ids():
    from transformers import LlavaConfig

    config = zoo.tiny_config(LlavaConfig)
    assert config.text_config.hidden_size == zoo.HIDDEN and config.text_config.num_hidden_layers == zoo.LAYERS
    assert config.vision_config.hidden_size == zoo.HIDDEN
    assert config.image_token_id < config.text_config.vocab_size == zoo.VOCAB


def test_model_types_and_classes():
    types = zoo.model_types()
    assert {"mixtral", "llava", "bert"} <= set(types) and len(types) > 500
    assert zoo.classes_for("qwen2_vl")[:2] == ["Qwen2VLModel", "Qwen2VLForConditionalGeneration"]
