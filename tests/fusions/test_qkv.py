"""``qkv``: an attention module's q/k/v ``nn.Linear`` projections (BERT: query/key/value) become one ``nn.Linear``,
sized from the actual projections (grouped-query attention: 32 + 16 + 16 rows here), with a bias when they have one."""

from __future__ import annotations

import weakref

import pytest
import torch
from fusion_models import ATOL, check_fused_roundtrip
from torch import nn

from modelpatch.fusions.projections import FusedLinear, ProjectionSlice

# name: (path of layer 0's attention module, child projections, fused name)
ATTENTION = {
    "llama": ("model.layers.0.self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    "mistral": ("model.layers.0.self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    "qwen2": ("model.layers.0.self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    "qwen2_moe": ("model.layers.0.self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    "qwen3": ("model.layers.0.self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    "bert": ("encoder.layer.0.attention.self", ("query", "key", "value"), "qkv"),
}


@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_matches_stock_and_saves_back(tiny, tmp_path, name):
    check_fused_roundtrip(tiny(name), {"qkv": True}, tmp_path)


@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_one_linear_sized_from_the_projections(tiny, name):
    ckpt = tiny(name)
    path, children, fused_name = ATTENTION[name]
    stock_attention = ckpt.stock().get_submodule(path)
    fused_model = ckpt.load({"qkv": True})
    attention = fused_model.get_submodule(path)

    assert type(attention).__module__ == "modelpatch.fusions.generated"
    assert isinstance(attention, type(stock_attention))
    fused = getattr(attention, fused_name)
    assert isinstance(fused, nn.Linear) and isinstance(fused, FusedLinear)
    stock_parts = [getattr(stock_attention, child) for child in children]
    assert fused.part_sizes == tuple(p.out_features for p in stock_parts)
    assert fused.out_features == sum(fused.part_sizes)
    assert (fused.bias is None) == (stock_parts[0].bias is None)
    assert torch.equal(fused.weight, torch.cat([p.weight for p in stock_parts]))
    if fused.bias is not None:
        assert torch.equal(fused.bias, torch.cat([p.bias for p in stock_parts]))
    # The original names stay callable, own no parameters, and expose their rows of the fused weight.
    for child, stock_part in zip(children, stock_parts, strict=True):
        part = getattr(attention, child)
        assert isinstance(part, ProjectionSlice) and not list(part.parameters())
        assert torch.equal(part.weight, stock_part.weight)
    keys = set(fused_model.state_dict())
    assert f"{path}.{fused_name}.weight" in keys
    assert not any(f"{path}.{child}." in key for key in keys for child in children)


def test_grouped_query_part_sizes(tiny):
    attention = tiny("llama").load({"qkv": True}).model.layers[1].self_attn
    assert attention.qkv_proj.part_sizes == (32, 16, 16)
    assert tuple(attention.qkv_proj.weight.shape) == (64, 32)


def test_generation_with_kv_cache_matches_stock(tiny):
    ckpt = tiny("llama")
    prompt = torch.tensor([[5, 9, 2, 17, 33]])
    kwargs = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    expected = ckpt.stock().generate(prompt, **kwargs)
    actual = ckpt.load({"qkv": True}).generate(prompt, **kwargs)
    assert torch.equal(actual.sequences, expected.sequences)
    for a, e in zip(actual.scores, expected.scores, strict=True):
        torch.testing.assert_close(a, e, atol=ATOL, rtol=0)


def test_attention_outputs_are_still_recorded(tiny):
    """``output_attentions`` hooks are attached by class: the fused attention class must still be recorded."""
    ckpt = tiny("llama")
    stock, fused = ckpt.model_class.from_pretrained(ckpt.path), ckpt.load({"qkv": True})
    for model in (stock, fused):
        model.set_attn_implementation("eager")  # sdpa returns no attention weights
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    with torch.no_grad():
        expected = stock(ids, output_attentions=True).attentions
        actual = fused(ids, output_attentions=True).attentions
    assert len(actual) == len(expected) == 2
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, atol=ATOL, rtol=0)


def test_gradients_reach_the_fused_weight(tiny):
    """Training sees one parameter whose gradient is the stock q/k/v gradients stacked."""
    ckpt = tiny("qwen2")  # with q/k/v biases
    stock = ckpt.model_class.from_pretrained(ckpt.path)  # a private copy: gradients are written into it
    fused = ckpt.load({"qkv": True})
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    stock(ids, labels=ids).loss.backward()
    fused(ids, labels=ids).loss.backward()
    stock_attention, fused_attention = stock.model.layers[0].self_attn, fused.model.layers[0].self_attn
    for attribute in ("weight", "bias"):
        parts = [getattr(stock_attention, n) for n in ("q_proj", "k_proj", "v_proj")]
        expected = torch.cat([getattr(part, attribute).grad for part in parts])
        torch.testing.assert_close(getattr(fused_attention.qkv_proj, attribute).grad, expected, atol=ATOL, rtol=0)


class TestFusedLinear:
    """The slices share one matmul per input, whatever order they are called in."""

    def make(self, bias=True):
        torch.manual_seed(0)
        parts = [nn.Linear(8, n, bias=bias) for n in (8, 4, 4)]
        fused = FusedLinear(8, [8, 4, 4], bias=bias)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([p.weight for p in parts]))
            if bias:
                fused.bias.copy_(torch.cat([p.bias for p in parts]))
        owner = nn.Module()
        owner.qkv_proj = fused
        return parts, fused, [ProjectionSlice(owner, "qkv_proj", (8, 4, 4), i, 8) for i in range(3)]

    @pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (1, 1, 0, 2, 2)])
    def test_any_call_order(self, order):
        parts, _, slices = self.make()
        x = torch.randn(2, 3, 8)
        for i in order:
            torch.testing.assert_close(slices[i](x), parts[i](x), atol=1e-6, rtol=0)

    def test_interleaved_inputs(self):
        parts, fused, slices = self.make(bias=False)
        x, y = torch.randn(5, 8), torch.randn(5, 8)
        torch.testing.assert_close(slices[0](x), parts[0](x), atol=1e-6, rtol=0)
        torch.testing.assert_close(slices[1](y), parts[1](y), atol=1e-6, rtol=0)  # a new input: recomputed
        torch.testing.assert_close(slices[2](x), parts[2](x), atol=1e-6, rtol=0)
        torch.testing.assert_close(slices[2](y), parts[2](y), atol=1e-6, rtol=0)

    def test_one_matmul_for_the_three_projections(self):
        _, fused, slices = self.make()
        calls = []
        fused.register_forward_hook(lambda *args: calls.append(1))
        x = torch.randn(3, 8)
        outputs = [s(x) for s in slices]
        assert len(calls) == 1
        # nothing left holding the input or the fused output once every part was taken
        inputs, fused_output = weakref.ref(x), weakref.ref(outputs[0]._base)
        del x, outputs
        assert inputs() is None and fused_output() is None
