"""Quantized checkpoints made by hand from a stock-saved tiny model, the way published ones are made.

Block-scaled fp8 (DeepSeek / Qwen FP8): float8_e4m3fn projection weights and one float32 ``weight_scale_inv`` per
128 x 128 block (``amax / 448``), ``quant_method: "fp8"`` in config.json. Projections only: embeddings, the head,
norms, routers and gates stay as they are. Widths must be multiples of 128.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PretrainedConfig

from support.models import sized_config

BLOCK = 128
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def quantize_fp8_blockwise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn weight and its ``weight_scale_inv`` (one float32 scale per 128x128 block: amax / 448)."""
    rows, cols = weight.shape
    blocks = weight.float().reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    quantized = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quantized.reshape(rows, cols), scale


def _is_quantized_projection(key: str) -> bool:
    # Like the published checkpoints: linear projections only (no embeddings, head, norms, routers or gates).
    return key.endswith("_proj.weight")


def write_fp8_checkpoint(config: PretrainedConfig, path: Path) -> Path:
    """A bfloat16 model of ``config`` (weights perturbed), saved by stock, its projections block-quantized to fp8."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param, dtype=torch.float32).to(param.dtype) * 0.05)
    model.save_pretrained(path)
    settings = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
    }
    return quantize_projections(path, _fp8_blockwise, settings)


def fp8_config(model_type: str, **overrides: Any) -> PretrainedConfig:
    """A text config of ``model_type`` whose projections are whole fp8 blocks: width 256 and MLP 384 (2 x 3 blocks of
    128 per projection, so block scales matter), q/k/v 256/128/128 rows (4 query, 2 key/value heads), two layers, 128
    tokens, an untied head; ``overrides`` applied last."""
    fixed = {"max_position_embeddings": 64, "tie_word_embeddings": False}
    return sized_config(
        model_type, vocab=128, hidden=256, intermediate=384, layers=2, heads=4, kv_heads=2, **{**fixed, **overrides}
    )


def fp8_checkpoints(root: Path, config: Callable[[str], PretrainedConfig]) -> Callable[[str], Path]:
    """The block-fp8 checkpoint of each model named to the returned function (``config(name)``: its config), written
    under ``root`` by :func:`write_fp8_checkpoint` when first asked for."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = write_fp8_checkpoint(config(name), root / name)
        return built[name]

    return get


def _fp8_blockwise(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """:func:`quantize_fp8_blockwise`'s weight and scale, by name suffix."""
    quantized, scale_inv = quantize_fp8_blockwise(weight)
    return {"weight": quantized, "weight_scale_inv": scale_inv}


def quantize_projections(
    path: Path, quantize: Callable[[torch.Tensor], dict[str, torch.Tensor]], settings: dict
) -> Path:
    """Replace each projection weight of ``path``'s single-file checkpoint by what ``quantize`` makes of it (name
    suffix -> tensor: the weight and its scale), and declare ``settings`` as its quantization_config."""
    tensors = {}
    for key, tensor in load_file(str(path / "model.safetensors")).items():
        if _is_quantized_projection(key):
            tensors.update({key.removesuffix("weight") + suffix: part for suffix, part in quantize(tensor).items()})
        else:
            tensors[key] = tensor
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return declare_quantization(path, settings)


def declare_quantization(path: Path, settings: dict) -> Path:
    """``settings`` as the quantization_config of ``path``'s config.json."""
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = settings
    (path / "config.json").write_text(json.dumps(raw))
    return path
