"""``modelpatch.fuse`` / ``modelpatch.unfuse`` on models already in memory (stock-loaded, modelpatch-loaded)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch
import transformers
from fusion_models import assert_outputs_close, assert_same_files, module_types
from packaging.version import Version
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP

import modelpatch
from modelpatch import FusionError
from modelpatch.conversion import ConversionOperation
from modelpatch.fusions.projections import FusedLinear
from support.compare import assert_bitwise_equal
from support.fusions import assert_refused_unchanged
from support.models import tiny_config
from support.zoo import load_zoo

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
    with caplog.at_level(logging.WARNING, logger="modelpatch.restructuring.restructure"):
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


def trainable(model: torch.nn.Module) -> dict[str, bool]:
    return {key: parameter.requires_grad for key, parameter in model.named_parameters()}


def backward(ckpt, model: torch.nn.Module) -> None:
    model(**ckpt.inputs()).logits.sum().backward()


@pytest.mark.parametrize("direction", ["fuse", "unfuse"])
def test_parts_frozen_and_trainable_that_would_become_one_tensor_are_refused_by_name(tiny, direction):
    """One Parameter has one requires_grad: a frozen q_proj fused with a trainable k_proj / v_proj would train (an
    optimizer step would move its rows), and unfusing would leave it trainable. Refused before anything changes,
    naming the module and which parts are frozen; a gradient mask would not be exact (weight decay, momentum)."""
    if direction == "fuse":
        model = tiny("llama").model_class.from_pretrained(tiny("llama").path)
        model.model.layers[1].self_attn.q_proj.requires_grad_(False)
        call = lambda m: modelpatch.fuse(m, CASES["llama"])  # noqa: E731
        match = "model.layers.1.self_attn: qkv_proj.weight would be one parameter made of q_proj.weight (frozen: "
        match += "requires_grad=False) and k_proj.weight, v_proj.weight (trainable)"
    else:  # the experts fused at load, one Linear each: stock holds their gate / up rows in one 3-D tensor
        model = tiny("qwen2_moe").load(CASES["qwen2_moe"])
        model.model.layers[0].mlp.experts[2].up_proj.requires_grad_(False)
        call = modelpatch.unfuse
        match = "model.layers.0.mlp.experts: gate_up_proj would be one parameter made of 2.up_proj.weight (frozen: "
        match += "requires_grad=False) and 0.gate_proj.weight, 0.up_proj.weight, 1.gate_proj.weight, "
        match += "1.up_proj.weight and 3 more (trainable)"
    assert_refused_unchanged(model, call, match)


@pytest.mark.parametrize("name", ["llama", "qwen2_moe"])
def test_parts_frozen_alike_keep_their_state_through_fuse_and_unfuse(tiny, name):
    """Parts that agree give the fused parameter their state, and unfusing gives each part the fused one's: frozen
    q/k/v of layer 0 make a frozen qkv_proj there, stock's frozen 3-D gate_up_proj frozen gate / up Linears."""
    ckpt = tiny(name)
    model = ckpt.model_class.from_pretrained(ckpt.path)
    for part in ("q_proj", "k_proj", "v_proj"):
        getattr(model.model.layers[0].self_attn, part).requires_grad_(False)
    if name == "qwen2_moe":
        model.model.layers[1].mlp.experts.gate_up_proj.requires_grad_(False)
    before = trainable(model)

    modelpatch.fuse(model, CASES[name])
    layers = model.model.layers
    assert not layers[0].self_attn.qkv_proj.weight.requires_grad and layers[1].self_attn.qkv_proj.weight.requires_grad
    if name == "qwen2_moe":
        for expert in layers[1].mlp.experts:
            assert not expert.gate_proj.weight.requires_grad and not expert.up_proj.weight.requires_grad
            assert expert.down_proj.weight.requires_grad
        assert all(weight.requires_grad for weight in layers[0].mlp.experts.parameters())
    modelpatch.unfuse(model)
    assert trainable(model) == before


@pytest.mark.parametrize("name", ["llama", "qwen2_moe"])
def test_accumulated_grads_are_carried_into_the_fused_layout_and_back(tiny, name):
    """Gradients accumulated before fuse() (micro-batches of one step) are laid out as the weights are: the fused
    model's .grad of each parameter is what fusing a model whose weights are those gradients gives; the next backward
    accumulates into them; unfuse gives them back bit for bit (qkv, gate_up, linear_experts' 3-D gate_up / down)."""
    ckpt = tiny(name)
    model = ckpt.model_class.from_pretrained(ckpt.path)
    backward(ckpt, model)
    stock_grads = {key: parameter.grad.clone() for key, parameter in model.named_parameters()}
    grads_as_weights = ckpt.model_class.from_pretrained(ckpt.path)
    with torch.no_grad():
        for key, parameter in grads_as_weights.named_parameters():
            parameter.copy_(stock_grads[key])

    modelpatch.fuse(grads_as_weights, CASES[name])
    fused_grads = dict(grads_as_weights.named_parameters())
    modelpatch.fuse(model, CASES[name])
    assert_bitwise_equal({key: parameter.grad for key, parameter in model.named_parameters()}, fused_grads)

    modelpatch.unfuse(model)
    assert_bitwise_equal({key: parameter.grad for key, parameter in model.named_parameters()}, stock_grads)

    modelpatch.fuse(model, CASES[name])
    backward(ckpt, model)  # the same batch again, accumulated into the carried gradients: twice them
    for key, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, 2 * fused_grads[key].detach(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("direction", ["fuse", "unfuse"])
def test_parts_with_and_without_an_accumulated_grad_are_refused_by_name(tiny, direction):
    """An optimizer skips a parameter without a .grad and steps one with zeros: parts with and parts without one
    cannot become one tensor. Refused before anything changes, naming the module and the parts."""
    if direction == "fuse":
        ckpt = tiny("llama")
        model = ckpt.model_class.from_pretrained(ckpt.path)
        backward(ckpt, model)
        model.model.layers[0].mlp.up_proj.weight.grad = None
        call = lambda m: modelpatch.fuse(m, CASES["llama"])  # noqa: E731
        match = "model.layers.0.mlp: gate_up_proj.weight would be made of gate_proj.weight (with an accumulated .grad)"
        match += " and up_proj.weight (without one)"
    else:
        ckpt = tiny("qwen2_moe")
        model = ckpt.load(CASES["qwen2_moe"])
        backward(ckpt, model)
        model.model.layers[1].mlp.experts[3].down_proj.weight.grad = None
        call = modelpatch.unfuse
        match = "model.layers.1.mlp.experts: down_proj would be made of 0.down_proj.weight, 1.down_proj.weight, "
        match += "2.down_proj.weight (with an accumulated .grad) and 3.down_proj.weight (without one)"
    assert_refused_unchanged(model, call, match)


@dataclass(frozen=True)
class Scale(ConversionOperation):
    """A user's conversion that multiplies a weight by ``factor``: exact for the weight, not for its gradient (the
    scaled weight's gradient is the original's divided by ``factor``, not multiplied)."""

    factor: float = 2.0

    def bind(self, shapes, num_targets):
        return self, list(shapes)

    def apply(self, slots):
        return [slot * self.factor for slot in slots]

    def reverse(self):
        return Scale(1 / self.factor)


class DoubledDownLlamaMLP(LlamaMLP):
    """LlamaMLP holding twice its down projection (``Scale(2)`` on the way in) and halving its output."""

    def forward(self, x):
        return super().forward(x) / 2


def test_a_grad_through_a_conversion_that_does_not_only_move_entries_is_refused_by_name(tiny):
    """patch_model converts weights through the Patcher's conversions: a .grad is carried only through operations
    that move entries (a scaled weight's gradient is not the scaled gradient)."""
    ckpt = tiny("llama")
    model = ckpt.model_class.from_pretrained(ckpt.path)
    backward(ckpt, model)
    patcher = modelpatch.Patcher(
        {"LlamaMLP": DoubledDownLlamaMLP},
        extra_weight_conversions=[
            modelpatch.WeightConverter("mlp.down_proj.weight", "mlp.down_proj.weight", [Scale()])
        ],
    )
    patch = lambda m: modelpatch.patch_model(m, patcher)  # noqa: E731
    assert_refused_unchanged(
        model,
        patch,
        "model.layers.1.mlp: the .grad of down_proj.weight cannot be carried through Scale",
        "patch_model()",
    )
    model.zero_grad()
    patch(model)
    assert type(model.model.layers[1].mlp) is DoubledDownLlamaMLP
    assert_outputs_close(ckpt.outputs(model), ckpt.stock_outputs())


def test_a_tensor_without_data_is_refused_by_name_before_any_module_changes(tiny, tmp_path):
    """One k_proj on the meta device (a placeholder never filled): planning sees shapes only, so the fill would fail
    at layer 1, after layer 0 was fused. Refused before anything changes; once the tensor is back, fuse is exact."""
    ckpt = tiny("llama")
    model = ckpt.model_class.from_pretrained(ckpt.path)
    k_proj = model.model.layers[1].self_attn.k_proj
    weight = k_proj.weight
    k_proj.weight = torch.nn.Parameter(weight.to("meta"))
    fuse = lambda m: modelpatch.fuse(m, CASES["llama"])  # noqa: E731
    assert_refused_unchanged(model, fuse, "model.layers.1.self_attn.k_proj.weight is on the meta device")
    assert not hasattr(model.config, "modelpatch")
    k_proj.weight = weight
    fuse(model)
    assert_outputs_close(ckpt.outputs(model), ckpt.stock_outputs())
    model.save_pretrained(tmp_path / "saved")
    assert_same_files(tmp_path / "saved", ckpt.path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_parts_of_one_fused_tensor_on_different_devices_are_refused_by_name(tiny):
    ckpt = tiny("llama")
    model = ckpt.model_class.from_pretrained(ckpt.path)
    model.model.layers[1].self_attn.k_proj.cuda()
    assert_refused_unchanged(
        model, lambda m: modelpatch.fuse(m, {"qkv": True}), "model.layers.1.self_attn.q_proj.weight", "cpu, cuda:0"
    )


def test_a_weight_shared_across_layers_is_refused_by_name_where_fusing_would_unshare_it(tiny):
    """Layer 1's q_proj.weight is layer 0's Parameter: each layer's qkv_proj would be a copy of its own, which one
    optimizer step moves apart. A shared tensor fuse does not convert (o_proj) stays shared: the same object."""
    ckpt = tiny("llama")
    model = ckpt.model_class.from_pretrained(ckpt.path)
    layers = model.model.layers
    layers[1].self_attn.q_proj.weight = layers[0].self_attn.q_proj.weight
    assert_refused_unchanged(
        model,
        lambda m: modelpatch.fuse(m, {"qkv": True}),
        "model.layers.0.self_attn.q_proj.weight is the same tensor as model.layers.1.self_attn.q_proj.weight",
    )

    model = ckpt.model_class.from_pretrained(ckpt.path)
    layers = model.model.layers
    layers[1].self_attn.o_proj.weight = layers[0].self_attn.o_proj.weight
    modelpatch.fuse(model, {"qkv": True})
    assert layers[1].self_attn.o_proj.weight is layers[0].self_attn.o_proj.weight


def test_a_part_the_fused_class_has_no_place_for_is_named_first_in_the_refusal(tiny):
    """A bias added to one q_proj (the fused class, built from the config, has none): the planner's problem is the
    whole reason, the message's first item (it began with an empty one)."""
    ckpt = tiny("llama")
    model = ckpt.model_class.from_pretrained(ckpt.path)
    q_proj = model.model.layers[0].self_attn.q_proj
    q_proj.bias = torch.nn.Parameter(torch.zeros(q_proj.out_features))
    assert_refused_unchanged(
        model,
        lambda m: modelpatch.fuse(m, {"qkv": True}),
        "do not convert to those of QKVFusedLlamaAttention (['model.layers.0.self_attn.q_proj.bias'] match",
    )


def _gpt_oss():
    if Version(transformers.__version__) < Version("5.18"):
        pytest.skip(f"transformers {transformers.__version__}: GPT-OSS's experts have no 3-D weights before 5.18")
    return load_zoo()._build(transformers.GptOssForCausalLM)


def test_a_setting_changed_on_the_live_module_is_refused_by_name():
    """The fused modules are built from the config: GPT-OSS's gate limit set on the live experts alone (or a Llama's
    attention scaling) would be lost without a word, so ``fuse`` names it and changes nothing. (Set in the config
    too, it fuses: tests/fusions/test_linear_experts_layouts.py.)"""
    model = _gpt_oss()
    model.model.layers[0].mlp.experts.limit = 1.0
    assert_refused_unchanged(
        model,
        lambda m: modelpatch.fuse(m, {"linear_experts": True}),
        "model.layers.0.mlp.experts.limit is 1.0 (its config builds 7.0)",
    )
    llama = AutoModelForCausalLM.from_config(tiny_config("llama"))
    llama.model.layers[1].self_attn.scaling = 0.5
    assert_refused_unchanged(
        llama, lambda m: modelpatch.fuse(m, {"qkv": True}), "model.layers.1.self_attn.scaling is 0.5"
    )


def test_unfuse_refuses_a_setting_changed_on_the_fused_module():
    model = modelpatch.fuse(_gpt_oss(), {"linear_experts": True})
    for expert in model.model.layers[0].mlp.experts:
        expert.gate_fn.state.limit = 2.0
    assert_refused_unchanged(model, modelpatch.unfuse, "model.layers.0.mlp.experts.limit is 2.0")
