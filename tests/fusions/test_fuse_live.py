"""``modelpatch.fuse`` / ``modelpatch.unfuse`` on models already in memory (stock-loaded, modelpatch-loaded)."""

from __future__ import annotations

import logging

import pytest
import torch
from fusion_models import assert_outputs_close, assert_same_files, module_types

import modelpatch
from modelpatch import FusionError
from modelpatch.fusions.projections import FusedLinear
from support.compare import assert_bitwise_equal

CASES = {
    "llama": {"qkv": True, "gate_up": True},
    "qwen2_moe": {"qkv": True, "gate_up": True, "linear_experts": True},
    "qwen2_vl": {"patch_embeddings": True, "qkv": True, "gate_up": True},
}


def state_copy(model):
    return {key: tensor.detach().clone() for key, tensor in model.state_dict().items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fuse_a_stock_loaded_model_save_and_unfuse(tiny, tmp_path, name):
    ckpt = tiny(name)
    model = ckpt.model_class.from_pretrained(ckpt.path)
    stock_types, stock_state = module_types(model), state_copy(model)

    assert modelpatch.fuse(model, CASES[name]) is model
    assert module_types(model) == module_types(ckpt.load(CASES[name]))  # what a fused load builds
    assert_outputs_close(ckpt.outputs(model), ckpt.stock_outputs())
    assert model.config.modelpatch["fusion_config"] == CASES[name]

    modelpatch.save_pretrained(model, tmp_path / "modelpatch")
    assert_same_files(tmp_path / "modelpatch", ckpt.path)
    model.save_pretrained(tmp_path / "stock_method")
    assert_same_files(tmp_path / "stock_method", ckpt.path)

    assert modelpatch.unfuse(model) is model
    assert module_types(model) == stock_types
    assert_bitwise_equal(model.state_dict(), stock_state)
    assert not hasattr(model.config, "modelpatch")
    modelpatch.save_pretrained(model, tmp_path / "unfused")
    assert_same_files(tmp_path / "unfused", ckpt.path)


def test_unfuse_a_model_fused_at_load(tiny, tmp_path):
    ckpt = tiny("qwen2_moe")
    model = ckpt.load(CASES["qwen2_moe"])
    modelpatch.unfuse(model)
    assert module_types(model) == module_types(ckpt.stock())
    assert_bitwise_equal(model.state_dict(), state_copy(ckpt.stock()))
    modelpatch.save_pretrained(model, tmp_path / "saved")
    assert_same_files(tmp_path / "saved", ckpt.path)
    # ... and fusing it again, as the live model it now is, gives the fused load's outputs.
    modelpatch.fuse(model, CASES["qwen2_moe"])
    assert_outputs_close(ckpt.outputs(model), ckpt.outputs(ckpt.load(CASES["qwen2_moe"])))


def test_untouched_parameters_stay_the_same_objects(tiny):
    """An optimizer built before fusing keeps pointing at the live norms and output projections."""
    model = tiny("llama").model_class.from_pretrained(tiny("llama").path)
    layer = model.model.layers[0]
    o_proj, norm, q_weight = layer.self_attn.o_proj.weight, layer.input_layernorm.weight, layer.self_attn.q_proj.weight
    modelpatch.fuse(model, {"qkv": True})
    assert model.model.layers[0].self_attn.o_proj.weight is o_proj
    assert model.model.layers[0].input_layernorm.weight is norm
    fused = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(fused, FusedLinear) and fused.weight.requires_grad
    assert torch.equal(fused.weight[: q_weight.shape[0]], q_weight)


def test_fuse_refusals_leave_the_model_unchanged(tiny, caplog):
    ckpt = tiny("llama")
    model = ckpt.model_class.from_pretrained(ckpt.path)
    before = module_types(model)
    with pytest.raises(FusionError, match="Unknown fusion 'bogus'"):
        modelpatch.fuse(model, {"bogus": True})
    with caplog.at_level(logging.WARNING, logger="modelpatch.loading.restructure"):
        modelpatch.fuse(model, {"linear_experts": True})  # a dense model has no experts
    assert "nothing to fuse" in caplog.text
    assert module_types(model) == before
    modelpatch.fuse(model, {"qkv": True})
    with pytest.raises(FusionError, match=r"already fused .*modelpatch.unfuse\(model\) first"):
        modelpatch.fuse(model, {"gate_up": True})
    with pytest.raises(TypeError, match="takes a transformers PreTrainedModel"):
        modelpatch.fuse(model.model.layers[0], {"qkv": True})


@pytest.mark.parametrize("direction", ["fuse", "unfuse"])
def test_an_optimizer_holding_the_replaced_parameters_is_refused_before_anything_changes(tiny, direction):
    ckpt = tiny("llama")
    model = ckpt.load({"qkv": True} if direction == "unfuse" else None)
    optimizer = torch.optim.AdamW(model.parameters())
    before = {key: tensor.clone() for key, tensor in model.state_dict().items()}
    with pytest.raises(modelpatch.FusionError, match=rf"{direction}\(\) would replace .* the optimizer holds"):
        if direction == "fuse":
            modelpatch.fuse(model, {"qkv": True}, optimizer=optimizer)
        else:
            modelpatch.unfuse(model, optimizer=optimizer)
    assert_bitwise_equal(model.state_dict(), before)
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    (modelpatch.fuse(model, {"qkv": True}, optimizer=fresh) if direction == "fuse" else modelpatch.unfuse(model))
