"""Fusions that cannot apply as asked are refused or skipped out loud, never half-applied or silently shadowed.

* Discovery decides per instance for the projection families, in whatever order the instances come (Perceiver's
  first attention is a cross-attention whose q/k/v read inputs of different sizes: it stays as it is, the others
  fuse); a class is left whole when an instance that would be fused is outside the target patterns.
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
from modelpatch.fusions.projections.spec import GateUpFusionSpec
from support.compare import assert_same_files

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


def test_perceiver_cross_attention_stays_as_it_is_and_the_self_attentions_fuse(tmp_path, caplog):
    """Perceiver's first attention is a cross-attention whose key/value read inputs of another size than its query:
    it stays a stock PerceiverSelfAttention (said at INFO with the reason), while the later instances of the same class
    fuse; outputs equal stock's, and the save is the stock checkpoint, bitwise."""
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
    torch.manual_seed(0)
    PerceiverModel(config).save_pretrained(tmp_path / "stock")
    stock = PerceiverModel.from_pretrained(tmp_path / "stock")
    with caplog.at_level(logging.INFO, logger="modelpatch"):
        model = modelpatch.from_pretrained(PerceiverModel, tmp_path / "stock", fusion_config={"qkv": True})
    cross = model.encoder.cross_attention.attention.self
    assert type(cross) is PerceiverSelfAttention
    fused = [layer.attention.self for layer in model.encoder.self_attends]
    assert all(isinstance(m, PerceiverSelfAttention) and type(m) is not PerceiverSelfAttention for m in fused)
    assert (
        "Fusion 'qkv' leaves PerceiverSelfAttention at encoder.cross_attention.attention.self as it is: query reads 16 "
        "features and key 8" in caplog.text
    )
    inputs = torch.randn(1, 5, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(inputs).last_hidden_state, stock(inputs).last_hidden_state, atol=1e-6, rtol=0)
    modelpatch.save_pretrained(model, tmp_path / "saved")
    assert_same_files(tmp_path / "saved", tmp_path / "stock")


def test_instances_outside_the_target_patterns_keep_their_class_unfused(stock, caplog):
    llama = stock("llama")
    modelpatch.register_fusion("gate_up_first", FirstLayerGateUp())
    with caplog.at_level(logging.INFO, logger="modelpatch"):
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


@pytest.mark.parametrize(
    ("fusion", "mapping", "message"),
    [
        (
            "gate_up",
            {"LlamaMLP": SubclassMLP},
            r"Fusion 'gate_up' would replace SubclassMLP, which the Patcher builds in "
            r"place of what its key 'LlamaMLP' matches",
        ),
        (
            "qkv",
            {"Attention": WrappedAttention},
            r"Fusion 'qkv' and the Patcher both replace LlamaAttention \(the Patcher's "
            r"key 'Attention' -> WrappedAttention\)",
        ),
    ],
    ids=["gate_up", "qkv"],
)
def test_a_fusion_of_a_class_the_patcher_replaces_is_refused_saying_so(stock, fusion, mapping, message):
    path = stock("llama").path
    with pytest.raises(FusionError, match=message):
        modelpatch.from_pretrained(AutoModelForCausalLM, path, fusion_config={fusion: True}, patcher=Patcher(mapping))
