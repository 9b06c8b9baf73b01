"""``device_map``: accelerate's dispatch after a modelpatch load (CPU and disk offload on this machine)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import modelpatch
from support.checkpoints import layers_on_disk


def _logits(model, checkpoint):
    with torch.no_grad():
        return model(**checkpoint.inputs()).logits


def test_auto_device_map_fits_on_cpu_and_matches_stock(stock_checkpoint):
    checkpoint = stock_checkpoint("llama")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, checkpoint.path, device_map="auto")
    assert set(model.hf_device_map.values()) == {"cpu"}
    stock = AutoModelForCausalLM.from_pretrained(checkpoint.path)
    torch.testing.assert_close(_logits(model, checkpoint), _logits(stock, checkpoint), rtol=0, atol=0)


def test_disk_offload_with_fusions_matches_stock(stock_checkpoint, tmp_path):
    checkpoint = stock_checkpoint("llama")
    model = modelpatch.from_pretrained(
        AutoModelForCausalLM,
        checkpoint.path,
        fusion_config={"qkv": True},
        device_map=layers_on_disk(),
        offload_folder=tmp_path,
    )
    assert model.model.layers[0].self_attn.qkv_proj.weight.device.type == "meta"  # offloaded, streamed from disk
    assert any(tmp_path.iterdir())
    stock = AutoModelForCausalLM.from_pretrained(checkpoint.path)
    torch.testing.assert_close(_logits(model, checkpoint), _logits(stock, checkpoint), atol=1e-5, rtol=1e-5)


def test_device_map_errors(stock_checkpoint):
    path = stock_checkpoint("llama").path
    with pytest.raises(ValueError, match="offload_folder"):  # fused weights cannot be read in place from the files
        modelpatch.from_pretrained(AutoModelForCausalLM, path, device_map={"": "disk"}, fusion_config={"qkv": True})
    with pytest.raises(ValueError, match="'model.no_such_module'"):
        modelpatch.from_pretrained(AutoModelForCausalLM, path, device_map={"model.no_such_module": "cpu"})
    with pytest.raises(ValueError, match="either device or device_map"):
        modelpatch.from_pretrained(AutoModelForCausalLM, path, device="cpu", device_map="auto")
    with pytest.raises(ValueError, match="device_map must be a dict or one of"):
        modelpatch.from_pretrained(AutoModelForCausalLM, path, device_map="everywhere")
