"""Fusions: load a checkpoint with fused q/k/v and gate/up projections, verify, save back bit for bit.

Run: .venv/bin/python examples/fuse_and_save.py
"""

import filecmp
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import modelpatch

with tempfile.TemporaryDirectory() as tmp:
    source, saved = Path(tmp, "source"), Path(tmp, "saved")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    LlamaForCausalLM(config).save_pretrained(source)  # a checkpoint written by stock transformers

    fused = modelpatch.from_pretrained(AutoModelForCausalLM, source, fusion_config={"qkv": True, "gate_up": True})
    print(fused.model.layers[0].self_attn.qkv_proj)  # one Linear, sized for grouped-query attention
    print(modelpatch.get_load_report(fused).summary())

    reference = modelpatch.from_pretrained(AutoModelForCausalLM, source)
    report = modelpatch.verify(reference, fused)
    print(report)
    assert report.passed

    modelpatch.save_pretrained(fused, saved)  # back to q/k/v and gate/up
    same = filecmp.cmp(source / "model.safetensors", saved / "model.safetensors", shallow=False)
    print("saved file byte-identical to the source:", same)
    assert same
