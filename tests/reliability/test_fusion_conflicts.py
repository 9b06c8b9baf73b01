"""Fusions that cannot apply as asked are refused or skipped out loud, never half-applied or silently shadowed.

* Discovery fuses a class only when every instance of it is fusable, in whatever order the instances come
  (Perceiver's first attention is a cross-attention whose q/k/v read inputs of different sizes).
* A user converter (Patcher extra or registered mapping) for exactly the weight a fusion converts: only one of them
  could run, so the load is refused naming both.
* A fusion and a Patcher entry on the same class: refused, saying so (instead of a load-plan error that blames the
  checkpoint).
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, PerceiverConfig, PerceiverModel
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP
from transformers.models.perceiver.modeling_perceiver import PerceiverSelfAttention

import modelpatch
from modelpatch import Concatenate, FusionError, Patcher, WeightConverter
from modelpatch.fusions.gate_up.spec import GateUpFusionSpec

pytestmark = pytest.mark.reliability

QKV = WeightConverter(["q_proj", "k_proj", "v_proj"], "qkv_proj", [Concatenate(dim=0)])


class FirstLayerGateUp(GateUpFusionSpec):
    """``gate_up`` restricted by target pattern to the first decoder layer's MLP."""

    target_modules_patterns = (r"layers\.0\.mlp$",)


class SubclassMLP(LlamaMLP):
    """Same math as LlamaMLP."""


class WrappedAttention(torch.nn.Module):
    """Not a LlamaAttention: it wraps one."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.inner = LlamaAttention(config, layer_idx)

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


# --- discovery: every instance, whatever the order ----------------------------------------------------------------


def test_perceiver_cross_attention_first_keeps_its_class_unfused(caplog):
    config = PerceiverConfig(
        num_latents=4,
        d_latents=16,
        d_model=8,
        num_blocks=1,
        num_self_attends_per_block=2,
        num_self_attention_heads=2,
        num_cross_attention_heads=1,
        vocab_size=32,
        max_position_embeddings=16,
    )
    with caplog.at_level(logging.WARNING, logger="modelpatch"):
        model = modelpatch.from_config(PerceiverModel, config, fusion_config={"qkv": True})
    # The cross-attention (first) is not fusable, the self-attentions (after it) are: the class stays as it is.
    assert {type(m) for m in model.modules() if "SelfAttention" in type(m).__name__} == {PerceiverSelfAttention}
    assert (
        "Fusion 'qkv' skips PerceiverSelfAttention: its instance 'encoder.cross_attention.attention.self' is not "
        "fusable" in caplog.text
    )


def test_instances_outside_the_target_patterns_keep_their_class_unfused(stock, caplog):
    llama = stock("llama")
    modelpatch.register_fusion("gate_up_first", FirstLayerGateUp())
    with caplog.at_level(logging.WARNING, logger="modelpatch"):
        model = modelpatch.from_pretrained(AutoModelForCausalLM, llama.path, fusion_config={"gate_up_first": True})
    # Fusing LlamaMLP would fuse the second layer's MLP too, against the target patterns.
    assert {type(layer.mlp) for layer in model.model.layers} == {LlamaMLP}
    assert "its instance 'model.layers.1.mlp' is outside the fusion's target_modules_patterns" in caplog.text
    with torch.no_grad():
        torch.testing.assert_close(model(**llama.inputs()).logits, llama.reference_logits(), rtol=0, atol=0)


# --- converters for the weights a fusion converts ----------------------------------------------------------------


def test_a_patcher_extra_converter_for_the_fused_weights_is_refused_naming_both(stock):
    with pytest.raises(FusionError) as raised:
        modelpatch.from_pretrained(
            AutoModelForCausalLM,
            stock("llama").path,
            fusion_config={"qkv": True},
            patcher=Patcher(extra_weight_conversions=QKV),
        )
    message = str(raised.value)
    assert repr(QKV) in message and "the Patcher's extra_weight_conversions" in message
    assert "fusion 'qkv'" in message and "self_attn.q_proj.weight" in message


def test_a_registered_converter_for_the_fused_weights_is_refused_naming_both(stock):
    modelpatch.register_checkpoint_conversion_mapping("llama", [QKV], overwrite=True)
    with pytest.raises(FusionError, match=r"from the registered conversion mapping and fusion 'qkv'"):
        modelpatch.from_pretrained(AutoModelForCausalLM, stock("llama").path, fusion_config={"qkv": True})
    # Filtered out by the Patcher, it no longer competes with the fusion: the load is the stock model's.
    model = modelpatch.from_pretrained(
        AutoModelForCausalLM,
        stock("llama").path,
        fusion_config={"qkv": True},
        patcher=Patcher(filtered_weight_conversion_patterns="^q_proj$"),
    )
    with torch.no_grad():
        torch.testing.assert_close(
            model(**stock("llama").inputs()).logits, stock("llama").reference_logits(), atol=1e-5, rtol=1e-5
        )


# --- a fusion and a Patcher entry on the same class ----------------------------------------------------------------


def test_a_fusion_of_a_class_the_patcher_replaces_is_refused_saying_so(stock):
    path = stock("llama").path
    with pytest.raises(
        FusionError,
        match=r"Fusion 'gate_up' would replace SubclassMLP, which the Patcher builds in "
        r"place of what its key 'LlamaMLP' matches",
    ):
        modelpatch.from_pretrained(
            AutoModelForCausalLM, path, fusion_config={"gate_up": True}, patcher=Patcher({"LlamaMLP": SubclassMLP})
        )
    with pytest.raises(
        FusionError,
        match=r"Fusion 'qkv' and the Patcher both replace LlamaAttention \(the Patcher's "
        r"key 'Attention' -> WrappedAttention\)",
    ):
        modelpatch.from_pretrained(
            AutoModelForCausalLM, path, fusion_config={"qkv": True}, patcher=Patcher({"Attention": WrappedAttention})
        )
