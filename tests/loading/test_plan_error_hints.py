"""A ``LoadPlanError`` says why: unexpected keys next to missing ones, collapsed indices, and a hint fitting the cause.

``new_parameters`` is suggested only for parameters that really are new, never for ones a hint (or a listed conversion
problem) explains.
"""

from __future__ import annotations

import json

import pytest
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, BertForSequenceClassification

import modelpatch
from modelpatch import LoadPlanError, Patcher
from modelpatch.loading.diagnose import collapse_indices
from support.compare import assert_bitwise_equal
from support.files import rewrite_checkpoint

NEW_PARAMETERS_HINT = "new_parameters=[...]"
NEW_PARAMETERS_LINE = "Hint: Pass new_parameters=[...] (regex patterns) for parameters you want freshly initialised."


def plan_error(*args, **kwargs) -> LoadPlanError:
    with pytest.raises(LoadPlanError) as info:
        modelpatch.from_pretrained(*args, **kwargs)
    return info.value


def hints(error: LoadPlanError) -> list[str]:
    return [line for line in str(error).splitlines() if line.startswith("Hint: ")]


def test_collapse_indices_is_exact():
    keys = [f"model.layers.{layer}.mlp.experts.{e}.gate_proj.weight" for layer in range(24) for e in range(64)]
    assert collapse_indices(keys) == ["model.layers.{0..23}.mlp.experts.{0..63}.gate_proj.weight"]
    # Not a product: layer 1 lacks expert 2. Each merged line stands for exactly the keys it replaces.
    keys = ["l.0.e.0.w", "l.0.e.1.w", "l.0.e.2.w", "l.1.e.0.w", "l.1.e.1.w", "l.3.e.0.w", "l.3.e.1.w", "other"]
    assert collapse_indices(keys) == ["l.0.e.{0..2}.w", "l.{1,3}.e.{0..1}.w", "other"]
    assert collapse_indices(["a.5.b", "a.7.b", "a.6.b", "a.9.b"]) == ["a.{5..7,9}.b"]


def test_unexpected_keys_are_listed_next_to_missing_ones(stock_checkpoint, tmp_path):
    def edit(tensors):
        for layer in (0, 1):
            norm = f"model.layers.{layer}.input_layernorm"
            tensors[f"{norm}.wieght"] = tensors.pop(f"{norm}.weight")

    directory = rewrite_checkpoint(stock_checkpoint("llama").path, tmp_path / "typo", edit)
    error = plan_error(AutoModelForCausalLM, directory)
    assert error.problems == {
        "missing from the checkpoint": [f"model.layers.{i}.input_layernorm.weight" for i in (0, 1)]
    }
    lines = str(error).splitlines()
    assert "  - model.layers.{0..1}.input_layernorm.weight" in lines
    assert "in the checkpoint but not used by the model (2):" in lines
    assert "  - model.layers.{0..1}.input_layernorm.wieght" in lines
    assert hints(error) == [NEW_PARAMETERS_LINE]


class QueryOnlyAttention(nn.Module):
    """Meant to replace BertSelfAttention only; has none of BertAttention's children (self.*, output.*)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__()
        self.query = nn.Linear(config.hidden_size, config.hidden_size)


def test_a_pattern_that_replaced_a_container_class_is_named(stock_checkpoint):
    error = plan_error(
        AutoModelForMaskedLM, stock_checkpoint("bert").path, patcher=Patcher({".*Attention": QueryOnlyAttention})
    )
    assert "  - bert.encoder.layer.{0..1}.attention.query.weight" in str(error).splitlines()
    (hint,) = hints(error)
    assert "'.*Attention'" in hint and "BertAttention" in hint and "QueryOnlyAttention" in hint
    assert "bert.encoder.layer.{0..1}.attention" in hint and "anchor the pattern" in hint
    assert NEW_PARAMETERS_HINT not in str(error)


def test_a_runtime_layout_checkpoint_loaded_without_its_fusions(stock_checkpoint, tmp_path):
    fusions = {"qkv": True, "gate_up": True}
    runtime = tmp_path / "runtime"
    fused = modelpatch.from_pretrained(AutoModelForCausalLM, stock_checkpoint("llama").path, fusion_config=fusions)
    modelpatch.save_pretrained(fused, runtime, save_original_format=False)
    config = json.loads((runtime / "config.json").read_text())
    del config["modelpatch"]  # lost, e.g. by a config rewrite
    (runtime / "config.json").write_text(json.dumps(config))

    error = plan_error(AutoModelForCausalLM, runtime)
    assert "  - model.layers.{0..1}.self_attn.qkv_proj.weight" in str(error).splitlines()
    (hint,) = hints(error)
    assert "runtime layout" in hint and "fusion_config={'gate_up': True, 'qkv': True}" in hint
    assert NEW_PARAMETERS_HINT not in str(error)
    # The hint is right: with it, the checkpoint loads to the fused model's exact weights.
    model = modelpatch.from_pretrained(AutoModelForCausalLM, runtime, fusion_config=fusions)
    assert_bitwise_equal(model.state_dict(), fused.state_dict())


def test_a_fusion_the_checkpoint_cannot_feed_is_named(stock_checkpoint, tmp_path):
    def edit(tensors):
        del tensors["model.layers.0.self_attn.k_proj.weight"]

    directory = rewrite_checkpoint(stock_checkpoint("llama").path, tmp_path / "no_k", edit)
    error = plan_error(AutoModelForCausalLM, directory, fusion_config={"qkv": True})
    assert error.problems["missing from the checkpoint"] == ["model.layers.0.self_attn.qkv_proj.weight"]
    (hint,) = hints(error)
    assert "Fusion 'qkv'" in hint and "LlamaAttention" in hint and "fusion_config={'qkv': False}" in hint
    assert NEW_PARAMETERS_HINT not in str(error)


@pytest.mark.parametrize("fusion_config", [None, {"linear_experts": True}])
def test_missing_expert_weights_are_collapsed_and_not_called_new(stock_checkpoint, tmp_path, fusion_config):
    def edit(tensors):
        for key in [k for k in tensors if ".experts." in k and ".gate_proj." in k]:
            del tensors[key]

    directory = rewrite_checkpoint(stock_checkpoint("qwen2_moe").path, tmp_path / "no_gate", edit)
    error = plan_error(AutoModelForCausalLM, directory, fusion_config=fusion_config)
    lines = str(error).splitlines()
    if fusion_config is None:  # the stock layout fuses experts at load: the group is incomplete
        assert "  - model.layers.{0..1}.mlp.experts.gate_up_proj" in lines
        group = "  - ['model.layers.{0..1}.mlp.experts.{0..3}.up_proj.weight'] match"
        assert any(line.startswith(group) for line in lines)
        assert hints(error) == []
    else:  # per-expert modules: the missing keys themselves
        assert "  - model.layers.{0..1}.mlp.experts.{0..3}.gate_proj.weight" in lines
        assert "Fusion 'linear_experts'" in hints(error)[0]
    assert NEW_PARAMETERS_HINT not in str(error)


def test_parameters_that_really_are_new_get_the_new_parameters_hint(stock_checkpoint):
    error = plan_error(BertForSequenceClassification, stock_checkpoint("bert_base").path)
    assert hints(error) == [NEW_PARAMETERS_LINE]
