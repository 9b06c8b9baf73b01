"""``gate_up``: the gate and up projections of gated MLPs (Llama, Mistral, Qwen2, Qwen2-MoE's shared expert) become
one ``nn.Linear`` (``gate_up_proj``); ``down_proj`` is untouched."""

from __future__ import annotations

import pytest
import torch
from fusion_models import check_fused_roundtrip
from torch import nn

from modelpatch.fusions.projections import FusedLinear, ProjectionSlice

MLP = {
    "llama": "model.layers.0.mlp",
    "mistral": "model.layers.0.mlp",
    "qwen2": "model.layers.0.mlp",
    "qwen2_moe": "model.layers.0.mlp.shared_expert",
}


@pytest.mark.parametrize("name", sorted(MLP))
def test_matches_stock_and_saves_back(tiny, tmp_path, name):
    check_fused_roundtrip(tiny(name), {"gate_up": True}, tmp_path)


@pytest.mark.parametrize("name", sorted(MLP))
def test_one_linear_for_gate_and_up(tiny, name):
    ckpt = tiny(name)
    stock_mlp = ckpt.stock().get_submodule(MLP[name])
    model = ckpt.load({"gate_up": True})
    mlp = model.get_submodule(MLP[name])

    assert type(mlp).__module__ == "modelpatch.fusions.generated" and isinstance(mlp, type(stock_mlp))
    assert isinstance(mlp.gate_up_proj, FusedLinear) and isinstance(mlp.gate_up_proj, nn.Linear)
    intermediate = stock_mlp.gate_proj.out_features
    assert mlp.gate_up_proj.part_sizes == (intermediate, intermediate)
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([stock_mlp.gate_proj.weight, stock_mlp.up_proj.weight]))
    assert isinstance(mlp.gate_proj, ProjectionSlice) and isinstance(mlp.up_proj, ProjectionSlice)
    assert type(mlp.down_proj) is nn.Linear and torch.equal(mlp.down_proj.weight, stock_mlp.down_proj.weight)


def test_moe_experts_are_left_alone(tiny):
    """Only the shared expert is a gated MLP of Linear layers; the routed experts keep their stock 3-D layout."""
    ckpt = tiny("qwen2_moe")
    experts = ckpt.load({"gate_up": True}).model.layers[0].mlp.experts
    assert type(experts) is type(ckpt.stock().model.layers[0].mlp.experts)
    assert experts.gate_up_proj.dim() == 3
