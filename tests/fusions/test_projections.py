"""How a fused projection computes: on CPU in float32 each part from its rows of the fused weight (the product stock
computes: one wide product is slower there), and so do gate/up parts of many rows off the CPU (their activation reads
them faster whole); elsewhere one product for all parts; and whatever stands at or hooks the fused name is always what
runs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from modelpatch.fusions.projections import FusedLinear
from modelpatch.fusions.projections.spec import GateUpFusionSpec
from support.compiled import check_compiled_generation

TEXT_FUSIONS = {"qkv": True, "gate_up": True}
PRODUCTS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"}


class CountProducts(TorchDispatchMode):
    """Counts the matrix products torch runs, by output width."""

    def __init__(self) -> None:
        super().__init__()
        self.widths: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) in PRODUCTS:
            self.widths.append(out.shape[-1])
        return out


def _projections(attention: nn.Module, mlp: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [attention.q_proj(x), attention.k_proj(x), attention.v_proj(x), mlp.gate_proj(x), mlp.up_proj(x)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parts_equal_stock_and_float32_on_cpu_computes_them_one_by_one(tiny, dtype):
    ckpt = tiny("llama")
    model = ckpt.load(TEXT_FUSIONS, dtype=dtype)
    stock = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=dtype)
    layer, stock_layer = model.model.layers[0], stock.model.layers[0]
    x = torch.randn(2, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad(), CountProducts() as products:
        parts = _projections(layer.self_attn, layer.mlp, x)
    expected = _projections(stock_layer.self_attn, stock_layer.mlp, x)
    if dtype == torch.float32:
        # The very products stock computes: bitwise the same.
        for part, reference in zip(parts, expected, strict=True):
            assert torch.equal(part, reference)
        assert sorted(products.widths) == sorted(t.shape[-1] for t in expected)
    else:
        for part, reference in zip(parts, expected, strict=True):
            torch.testing.assert_close(part, reference, atol=1e-2, rtol=1e-2)
        assert sorted(products.widths) == sorted(
            [layer.self_attn.qkv_proj.out_features, layer.mlp.gate_up_proj.out_features]
        )
    torch.testing.assert_close(ckpt.outputs(model)["logits"], ckpt.outputs(stock)["logits"], atol=2e-2, rtol=0)


def test_a_hooked_or_replaced_fused_layer_is_called_in_float32(tiny):
    ckpt = tiny("llama")
    model = ckpt.load(TEXT_FUSIONS)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    x = torch.randn(1, 4, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    calls = []
    handle = attention.qkv_proj.register_forward_hook(lambda module, args, out: calls.append(out.shape[-1]))
    with torch.no_grad(), CountProducts() as products:
        attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
    assert calls == [attention.qkv_proj.out_features]  # once, for the three parts
    assert products.widths == [attention.qkv_proj.out_features]
    handle.remove()

    class Scaled(FusedLinear):  # a subclass stands there: its own forward runs
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    fused = mlp.gate_up_proj
    scaled = Scaled(fused.in_features, fused.part_sizes, bias=False)
    with torch.no_grad():
        scaled.weight.copy_(fused.weight)
        before = mlp.up_proj(x)
        mlp.gate_up_proj = scaled
        torch.testing.assert_close(mlp.up_proj(x), before * 2)


def test_off_the_cpu_gate_up_parts_of_many_rows_are_computed_apart(tiny):
    """Off the CPU (the meta device stands for an accelerator: the same rule, shapes only), gate and up each multiply
    by their own rows from ``apart_from_rows`` rows of input on, in any batch shape; with fewer rows, and for q/k/v at
    any size, the one fused product is computed once for all parts."""
    layer = tiny("llama").load(TEXT_FUSIONS, dtype=torch.bfloat16).model.layers[0]
    attention, mlp = copy.deepcopy(layer.self_attn).to("meta"), copy.deepcopy(layer.mlp).to("meta")
    hidden, intermediate = mlp.gate_proj.in_features, mlp.gate_proj.out_features
    rows = GateUpFusionSpec.apart_from_rows
    assert rows is not None
    for shape, apart in (((1, rows), True), ((4, rows // 4), True), ((1, rows - 1), False), ((2, 1), False)):
        x = torch.empty(*shape, hidden, device="meta", dtype=torch.bfloat16)
        with torch.no_grad(), CountProducts() as products:
            gate, up = mlp.gate_proj(x), mlp.up_proj(x)
            attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
        assert gate.shape == up.shape == (*shape, intermediate)
        gate_up = [intermediate, intermediate] if apart else [2 * intermediate]
        assert products.widths == gate_up + [attention.qkv_proj.out_features], shape


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_generation_is_one_graph_with_nothing_replayed_beyond_stock(tiny, dtype):
    """transformers' compiled decoding (static cache) of a llama with ``qkv`` + ``gate_up``: one graph compiled once
    for every step, the fused model's eager tokens, nothing replayed after the graph that stock's frame does not
    replay (the slices used to leave their pending parts' bookkeeping there), and in the graph one product per fused
    layer in bfloat16 (float32 on CPU: stock's products)."""
    ckpt = tiny("llama")
    model = ckpt.load(TEXT_FUSIONS, dtype=dtype)
    stock = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=dtype)
    run = check_compiled_generation(model, stock, ckpt.inputs()["input_ids"])
    if dtype == torch.bfloat16:
        assert run.products() == sum(isinstance(module, nn.Linear) for module in model.modules())
    else:
        assert run.products() == sum(isinstance(module, nn.Linear) for module in stock.modules())
