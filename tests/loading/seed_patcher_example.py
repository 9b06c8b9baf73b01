# transformers' documented Patcher quick example (a Qwen2-MoE with sequential experts and fused q/k/v), with:
#   * its import line changed from `from transformers import ...` to `from modelpatch import ...` (the only change
#     to the user's code);
#   * the "# ... rest of implementation" parts written out, with q/k/v sized for grouped-query attention (the
#     documented class sizes qkv_proj as 3 * heads * head_dim, wrong when there are fewer key/value heads);
#   * a tiny local checkpoint (CHECKPOINT, set by the test through runpy's init_globals) instead of the hub id.
# Run by tests/loading/test_seed_example.py; not collected by pytest (no test_ prefix).
import torch
import torch.nn as nn
from transformers.activations import ACT2FN
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.qwen2_moe.modeling_qwen2_moe import apply_rotary_pos_emb

from modelpatch import AutoModelForCausalLM, Concatenate, Patcher, WeightConverter


class ExpertMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.moe_intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.moe_intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.moe_intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


# Define restructured expert module for quantization compatibility
class SequentialExperts(nn.ModuleList):
    """MoE experts as a ModuleList instead of custom container.

    Many quantization libraries prefer experts as a sequence of standard
    PyTorch linear layers for easier quantization application.
    """

    def __init__(self, config):
        super().__init__()
        for _ in range(config.num_experts):
            self.append(ExpertMLP(config))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        # Each token's top-k experts, weighted by the router (the documented version's argmax ignores top-k).
        final_hidden = torch.zeros_like(hidden_states)
        for expert_idx, expert in enumerate(self):
            token_idx, slot = torch.where(top_k_index == expert_idx)
            if token_idx.numel():
                out = expert(hidden_states[token_idx]) * top_k_weights[token_idx, slot, None]
                final_hidden.index_add_(0, token_idx, out.to(final_hidden.dtype))
        return final_hidden


# Define fused attention for compute-intensive quantization kernels
class FusedQKVAttention(nn.Module):
    """Attention with fused Q, K, V projections.

    Fusing QKV projections into a single Linear layer enables
    compute-intensive quantization kernels that are more efficient.
    """

    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.q_size = config.num_attention_heads * self.head_dim
        self.kv_size = config.num_key_value_heads * self.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=True)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        shape = (*input_shape, -1, self.head_dim)
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        out, weights = sdpa_attention_forward(
            self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
        )
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


# Create patcher with both class replacements and weight conversions
patcher = Patcher(
    class_mapping={
        "Qwen2MoeExperts": SequentialExperts,
        "Qwen2MoeAttention": FusedQKVAttention,
    },
    # Filter out existing conversions incompatible with new structure
    filtered_weight_conversion_patterns=[".gate_up_proj", ".down_proj"],
    # Add conversions to fuse Q, K, V weights into single qkv_proj
    extra_weight_conversions=[
        WeightConverter(
            source_patterns=["q_proj.weight", "k_proj.weight", "v_proj.weight"],
            target_patterns=["qkv_proj.weight"],
            operations=[Concatenate(dim=0)],
        ),
        WeightConverter(
            source_patterns=["q_proj.bias", "k_proj.bias", "v_proj.bias"],
            target_patterns=["qkv_proj.bias"],
            operations=[Concatenate(dim=0)],
        ),
    ],
)

# Load model with patches applied
model = AutoModelForCausalLM.from_pretrained(
    CHECKPOINT,  # noqa: F821 (set by the test; the documented example names a hub repository here)
    patcher=patcher,
)
# Model now has SequentialExperts and FusedQKVAttention modules with properly converted weights
