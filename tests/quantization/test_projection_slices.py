"""What tools that work by module name read and write of a projection slice (SmoothQuant / AWQ-style mappings name
``q_proj``, ``gate_proj``): its ``weight`` and ``bias`` are views of its rows of the fused layer, so that reading them
gives the stock Linear's tensors and writing them in place changes exactly those rows; a hook on a slice sees the
slice's input, as on the stock Linear."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

FUSED = {"qkv": True, "gate_up": True}


def test_slice_weights_are_views_of_the_fused_rows(tiny):
    checkpoint = tiny("qwen2")  # q/k/v with biases
    model, stock = checkpoint.load(FUSED), AutoModelForCausalLM.from_pretrained(checkpoint.path)
    attention, stock_attention = model.model.layers[0].self_attn, stock.model.layers[0].self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        part, linear = getattr(attention, name), getattr(stock_attention, name)
        assert torch.equal(part.weight, linear.weight) and torch.equal(part.bias, linear.bias)
    scales = torch.rand(attention.k_proj.in_features) + 0.5
    with torch.no_grad():  # what SmoothQuant does to each balance layer: multiply its weight's columns
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(attention, name).weight.mul_(scales.view(1, -1))
            getattr(stock_attention, name).weight.mul_(scales.view(1, -1))
        attention.v_proj.bias.mul_(2)  # one part's bias: the others' rows stay as they were
        stock_attention.v_proj.bias.mul_(2)
    fused = attention.qkv_proj
    expected = [getattr(stock_attention, name) for name in ("q_proj", "k_proj", "v_proj")]
    assert torch.equal(fused.weight, torch.cat([linear.weight for linear in expected]))
    assert torch.equal(fused.bias, torch.cat([linear.bias for linear in expected]))
    inputs = checkpoint.inputs()
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, stock(**inputs).logits, rtol=0, atol=1e-5)


def test_a_hook_on_a_slice_sees_its_input(tiny):
    checkpoint = tiny("llama")
    model, stock = checkpoint.load(FUSED), AutoModelForCausalLM.from_pretrained(checkpoint.path)
    seen: dict[str, torch.Tensor] = {}
    for label, mlp in (("fused", model.model.layers[1].mlp), ("stock", stock.model.layers[1].mlp)):
        mlp.up_proj.register_forward_pre_hook(lambda module, args, label=label: seen.__setitem__(label, args[0]))
    inputs = checkpoint.inputs()
    with torch.no_grad():
        model(**inputs), stock(**inputs)
    torch.testing.assert_close(seen["fused"], seen["stock"], rtol=0, atol=1e-6)
