"""``linear_experts``: transformers' fused 3-D MoE experts become a ModuleList of per-expert MLPs of plain
``nn.Linear`` layers, routed with the top-k weights exactly as stock; checkpoint keys load and save unchanged."""

from __future__ import annotations

import pytest
import torch
from fusion_models import EXPERT_NAMES, check_fused_roundtrip, checkpoint_shapes
from torch import nn

from modelpatch.fusions.linear_experts.modules import ExpertMLP, LinearExperts


@pytest.mark.parametrize("name", sorted(EXPERT_NAMES))
def test_matches_stock_and_saves_back(tiny, tmp_path, name):
    check_fused_roundtrip(tiny(name), {"linear_experts": True}, tmp_path)


@pytest.mark.parametrize("name", sorted(EXPERT_NAMES))
def test_per_expert_linear_modules(tiny, name):
    ckpt = tiny(name)
    stock_experts = ckpt.stock().model.layers[0].mlp.experts
    model = ckpt.load({"linear_experts": True})
    experts = model.model.layers[0].mlp.experts

    assert isinstance(experts, LinearExperts) and isinstance(experts, nn.ModuleList)
    assert len(experts) == stock_experts.gate_up_proj.shape[0] == 4
    gate, up, down = EXPERT_NAMES[name]
    intermediate = stock_experts.down_proj.shape[-1]
    for index, expert in enumerate(experts):
        assert isinstance(expert, ExpertMLP)
        assert all(type(getattr(expert, child)) is nn.Linear for child in (gate, up, down))
        assert torch.equal(getattr(expert, gate).weight, stock_experts.gate_up_proj[index, :intermediate])
        assert torch.equal(getattr(expert, up).weight, stock_experts.gate_up_proj[index, intermediate:])
        assert torch.equal(getattr(expert, down).weight, stock_experts.down_proj[index])
    # The experts' runtime layout *is* the checkpoint's: one key per expert and projection, same shapes (Mixtral's
    # checkpoints still name the block ``block_sparse_moe``: the model type's renaming stays in effect).
    checkpoint = {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in checkpoint_shapes(ckpt.path).items()}
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == checkpoint


def _routing(model, layer=0):
    """The (hidden_states, top_k_index, top_k_weights) the experts of ``layer`` receive for the test batch."""
    captured = {}
    experts = model.model.layers[layer].mlp.experts
    handle = experts.register_forward_pre_hook(lambda module, args: captured.setdefault("args", args))
    try:
        with torch.no_grad():
            model(input_ids=torch.randint(0, 56, (2, 12), generator=torch.Generator().manual_seed(1)))
    finally:
        handle.remove()
    return captured["args"]


@pytest.mark.parametrize("name", sorted(EXPERT_NAMES))
def test_routed_exactly_like_stock(tiny, name):
    """Same tokens, several experts hit, unequal top-k weights: the experts' outputs match stock's fused experts."""
    ckpt = tiny(name)
    model = ckpt.load({"linear_experts": True})
    hidden, top_k_index, top_k_weights = _routing(model)
    assert top_k_index.shape == top_k_weights.shape == (24, 2)
    assert len(top_k_index.unique()) >= 3, "the test batch should reach several experts"
    assert (top_k_weights[:, 0] - top_k_weights[:, 1]).abs().min() > 1e-3, "top-k weights should differ"

    with torch.no_grad():
        expected = ckpt.stock().model.layers[0].mlp.experts(hidden, top_k_index, top_k_weights)
        actual = model.model.layers[0].mlp.experts(hidden, top_k_index, top_k_weights)
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=0)
        # Arbitrary routing weights (not the router's): still weighted exactly like stock.
        weights = torch.rand(top_k_weights.shape, generator=torch.Generator().manual_seed(2))
        torch.testing.assert_close(
            model.model.layers[0].mlp.experts(hidden, top_k_index, weights),
            ckpt.stock().model.layers[0].mlp.experts(hidden, top_k_index, weights),
            atol=1e-6,
            rtol=0,
        )


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_zeroing_an_expert_changes_exactly_its_tokens(tiny, name):
    ckpt = tiny(name)
    model = ckpt.load({"linear_experts": True})
    hidden, top_k_index, top_k_weights = _routing(model)
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():
        before = experts(hidden, top_k_index, top_k_weights)
        for expert in top_k_index.unique().tolist():
            routed = (top_k_index == expert).any(dim=-1)
            assert 0 < routed.sum() < len(routed)
            saved = [p.clone() for p in experts[expert].parameters()]
            for param in experts[expert].parameters():
                param.zero_()
            after = experts(hidden, top_k_index, top_k_weights)
            for param, value in zip(experts[expert].parameters(), saved, strict=True):
                param.copy_(value)
            changed = (after != before).any(dim=-1)
            assert torch.equal(changed, routed), f"expert {expert}"
        assert torch.equal(experts(hidden, top_k_index, top_k_weights), before)


def test_routing_with_a_dropped_slot():
    """A router may mark a top-k slot as unused with index ``num_experts``: it contributes nothing."""
    torch.manual_seed(0)
    experts = LinearExperts(3, 8, 4, nn.SiLU(), ("gate_proj", "up_proj", "down_proj"), device=None, dtype=None)
    hidden = torch.randn(5, 8)
    index = torch.tensor([[0, 3], [1, 2], [3, 3], [2, 0], [1, 3]])
    weights = torch.rand(5, 2)
    expected = torch.zeros(5, 8)
    for token in range(5):
        for slot in range(2):
            if index[token, slot] < 3:
                expected[token] += experts[int(index[token, slot])](hidden[token]) * weights[token, slot]
    with torch.no_grad():
        torch.testing.assert_close(experts(hidden, index, weights), expected.detach(), atol=1e-6, rtol=0)
