"""A Patcher restructuring Qwen2-MoE experts into a ModuleList of plain Linear MLPs (the seeds' use case), with the
built-in per-expert -> fused conversion filtered out so the checkpoint's per-expert weights load directly.

Run: .venv/bin/python examples/moe_sequential_experts.py
"""

import tempfile

import torch
from torch import nn
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
from transformers.activations import ACT2FN

import modelpatch


class ExpertMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        size, inner = config.hidden_size, config.moe_intermediate_size
        self.gate_proj = nn.Linear(size, inner, bias=False)
        self.up_proj = nn.Linear(size, inner, bias=False)
        self.down_proj = nn.Linear(inner, size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class SequentialExperts(nn.ModuleList):
    """Top-k routed like stock (the seeds' argmax version is wrong: it ignores the routing weights)."""

    def __init__(self, config):
        super().__init__(ExpertMLP(config) for _ in range(config.num_experts))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for expert_idx, expert in enumerate(self):
            token_idx, slot = torch.where(top_k_index == expert_idx)
            if token_idx.numel():
                out.index_add_(0, token_idx, expert(hidden_states[token_idx]) * top_k_weights[token_idx, slot, None])
        return out


config = Qwen2MoeConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
)
with tempfile.TemporaryDirectory() as source:
    torch.manual_seed(0)
    Qwen2MoeForCausalLM(config).save_pretrained(source)
    patcher = modelpatch.Patcher(
        class_mapping={"Qwen2MoeExperts": SequentialExperts},
        filtered_weight_conversion_patterns=[r"gate_up_proj", r"down_proj$"],
    )
    model = modelpatch.from_pretrained(Qwen2MoeForCausalLM, source, patcher=patcher)
    print(model.model.layers[0].mlp.experts[0])
    report = modelpatch.verify(modelpatch.from_pretrained(Qwen2MoeForCausalLM, source), model)
    print(report)
    assert report.passed
