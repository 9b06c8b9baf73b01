"""Class patching: replace every LlamaAttention while a model is built, in this thread only.

Run: .venv/bin/python examples/patch_attention.py
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention

import modelpatch


class CountingAttention(LlamaAttention):
    """Same math as LlamaAttention; counts its calls."""

    calls = 0

    def forward(self, *args, **kwargs):
        CountingAttention.calls += 1
        return super().forward(*args, **kwargs)


config = LlamaConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)

modelpatch.register_patch_mapping({"LlamaAttention": CountingAttention})
try:
    with modelpatch.apply_patches():
        patched = LlamaForCausalLM(config)
    plain = LlamaForCausalLM(config)  # outside the scope: stock classes
finally:
    modelpatch.clear_patch_mapping()

print("inside the scope: ", type(patched.model.layers[0].self_attn).__name__)
print("outside the scope:", type(plain.model.layers[0].self_attn).__name__)
patched(torch.tensor([[1, 2, 3]]))
print("CountingAttention calls:", CountingAttention.calls)
assert CountingAttention.calls == config.num_hidden_layers
