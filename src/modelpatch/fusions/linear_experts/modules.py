"""Per-expert MoE modules made of plain ``nn.Linear`` layers, routed exactly like transformers' fused experts."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class ExpertMLP(nn.Module):
    """One gated expert: ``down(act(gate(x)) * up(x))``; child names follow the checkpoint's convention."""

    def __init__(self, hidden: int, intermediate: int, act_fn: Callable, names: tuple[str, str, str], device, dtype):
        super().__init__()
        self.names = names
        gate, up, down = names
        setattr(self, gate, nn.Linear(hidden, intermediate, bias=False, device=device, dtype=dtype))
        setattr(self, up, nn.Linear(hidden, intermediate, bias=False, device=device, dtype=dtype))
        setattr(self, down, nn.Linear(intermediate, hidden, bias=False, device=device, dtype=dtype))
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.act_fn(gate(x)) * up(x))


class LinearExperts(nn.ModuleList):
    """``experts[i]`` is expert ``i``; ``forward(hidden_states, top_k_index, top_k_weights)`` weighs each token's
    top-k expert outputs by its routing weights, as the fused experts of transformers do."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act_fn: Callable, names, device, dtype):
        super().__init__(ExpertMLP(hidden, intermediate, act_fn, names, device, dtype) for _ in range(num_experts))
        self.num_experts = num_experts
        self.hidden_dim = hidden
        self.intermediate_dim = intermediate

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in hit[:, 0].tolist():
            if expert_idx == self.num_experts:  # padding slot used by some routers
                continue
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            out = self[expert_idx](hidden_states[token_idx]) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final
