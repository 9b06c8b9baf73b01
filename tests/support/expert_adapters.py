"""What the expert-LoRA tests share: the experts layouts ``linear_experts`` fuses, one model class each, and a
transformers-4-era adapter (per-expert LoRA weights) written for a fused model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from peft import LoraConfig
from safetensors.torch import save_file
from torch import nn

from modelpatch.fusions.linear_experts.modules import LinearExperts

# Every experts layout linear_experts fuses (see tests/fusions/test_linear_experts_layouts.py): the plain forward,
# the experts' own _apply_gate, transposed weights (with is_transposed, and Llama 4's without), interleaved gate/up
# with biases, other checkpoint names, a vision-language model.
EXPERT_FAMILIES = [
    "AriaTextForCausalLM",
    "DeepseekV4ForCausalLM",
    "GptOssForCausalLM",
    "GraniteMoeForCausalLM",
    "HYV4ForCausalLM",
    "InklingForConditionalGeneration",
    "Llama4ForCausalLM",
    "MiniMaxM3VLForCausalLM",
    "MixtralForCausalLM",
]


def write_per_expert_adapter(
    fused_model: nn.Module, directory: Path, make_config: Callable[[list[str]], LoraConfig], rank: int = 2
) -> None:
    """An adapter in transformers 4's layout for ``fused_model`` (a ``linear_experts`` model) into ``directory``:
    random rank-``rank`` LoRA on every expert's Linears (``<experts>.<e>.gate_proj.lora_A.weight`` ...), under the
    config ``make_config`` gives for the experts' child names, saved as PEFT saves an adapter."""
    experts = {name: module for name, module in fused_model.named_modules() if isinstance(module, LinearExperts)}
    names = next(iter(experts.values()))[0].names
    generator = torch.Generator().manual_seed(3)
    state = {}
    for path, module in experts.items():
        for index in range(len(module)):
            for child in names:
                linear = getattr(module[index], child)
                key = f"base_model.model.{path}.{index}.{child}"
                state[f"{key}.lora_A.weight"] = torch.randn(rank, linear.in_features, generator=generator) / 10
                state[f"{key}.lora_B.weight"] = torch.randn(linear.out_features, rank, generator=generator) / 10
    make_config(list(names)).save_pretrained(directory)
    save_file(state, directory / "adapter_model.safetensors")
