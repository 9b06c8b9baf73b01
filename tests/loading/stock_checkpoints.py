"""Helpers: tiny checkpoints written by stock transformers' own ``save_pretrained``, built once per session.

Every checkpoint is a real directory produced by ``model.save_pretrained`` of transformers 5.23 (no hub, no mocks).
Parameters are perturbed before saving so that norms and biases are not all ones/zeros: a conversion that mixes up
``q``/``k``/``v`` or experts is then visible in the values.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForMaskedLM,
    PreTrainedModel,
)

VOCAB = 128


@dataclass
class StockCheckpoint:
    """A checkpoint directory written by stock ``save_pretrained`` and how to exercise it."""

    name: str
    path: Path
    model_class: type
    inputs: Callable[[], dict[str, torch.Tensor]]
    save_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def files(self) -> list[Path]:
        return sorted(self.path.glob("*.safetensors"))

    @property
    def single_file(self) -> bool:
        return len(self.files) == 1

    def tensors(self) -> dict[str, torch.Tensor]:
        return read_tensors(self.path)


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file of ``directory`` (read eagerly, independent of the files)."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bytes: bitwise comparison that treats NaNs and -0.0 exactly."""
    # A fresh standard-strided copy: "contiguous" views with size-1 dims may have any stride, which view() refuses.
    return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor.detach().cpu()).reshape(-1).view(torch.uint8)


def assert_tensors_identical(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Same keys, dtypes, shapes and bytes."""
    assert sorted(actual) == sorted(expected), (
        f"only in actual: {sorted(actual.keys() - expected.keys())}; only in expected: "
        f"{sorted(expected.keys() - actual.keys())}"
    )
    for key in expected:
        a, e = actual[key], expected[key]
        assert a.dtype == e.dtype, f"{key}: {a.dtype} != {e.dtype}"
        assert tuple(a.shape) == tuple(e.shape), f"{key}: {tuple(a.shape)} != {tuple(e.shape)}"
        assert torch.equal(bits(a), bits(e)), f"{key}: values differ"


def tied_groups(model: torch.nn.Module) -> set[frozenset[str]]:
    """Parameters sharing one storage, as sets of names (only groups of two or more)."""
    by_ptr: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_ptr.setdefault(param.data_ptr(), set()).add(name)
    return {frozenset(names) for names in by_ptr.values() if len(names) > 1}


def rewrite_checkpoint(source: Path, target: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """Copy a single-file checkpoint, letting ``edit`` change its tensors (a hand-made variant of a stock one)."""
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def _perturb(model: PreTrainedModel, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                param.add_(torch.randn(param.shape, generator=generator, dtype=torch.float32).to(param.dtype) * 0.05)


def _token_inputs(seed: int, length: int = 12) -> Callable[[], dict[str, torch.Tensor]]:
    def make() -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        return {"input_ids": torch.randint(0, VOCAB - 8, (2, length), generator=generator)}

    return make


def _llama_like(**overrides: Any) -> dict[str, Any]:
    return {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
        **overrides,
    }


def _moe(**overrides: Any) -> dict[str, Any]:
    return _llama_like(**{"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, **overrides})


CONFIGS: dict[str, tuple[str, type, dict[str, Any]]] = {
    # name: (model_type, class, config kwargs)
    "llama": ("llama", AutoModelForCausalLM, _llama_like()),
    "llama_tied": ("llama", AutoModelForCausalLM, _llama_like(tie_word_embeddings=True)),
    "mistral": ("mistral", AutoModelForCausalLM, _llama_like(sliding_window=None)),
    "qwen2": ("qwen2", AutoModelForCausalLM, _llama_like()),
    "gpt2": (
        "gpt2",
        AutoModelForCausalLM,
        {"vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64},
    ),
    "bert": (
        "bert",
        AutoModelForMaskedLM,
        {
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 64,
            "max_position_embeddings": 64,
        },
    ),
    "bert_base": (
        "bert",
        AutoModel,
        {
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 64,
            "max_position_embeddings": 64,
        },
    ),
    "qwen2_moe": ("qwen2_moe", AutoModelForCausalLM, _moe(shared_expert_intermediate_size=48)),
    # num_key_value_heads == num_attention_heads: the seeds' 3 * heads * head_dim fused q/k/v sizing is valid.
    "qwen2_moe_mha": (
        "qwen2_moe",
        AutoModelForCausalLM,
        _moe(shared_expert_intermediate_size=48, num_key_value_heads=4),
    ),
    "qwen2_moe_wide": (
        "qwen2_moe",
        AutoModelForCausalLM,
        _moe(shared_expert_intermediate_size=48, moe_intermediate_size=512),
    ),
    "mixtral": (
        "mixtral",
        AutoModelForCausalLM,
        _llama_like(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen3_moe": ("qwen3_moe", AutoModelForCausalLM, _moe(head_dim=16)),
    "olmoe": ("olmoe", AutoModelForCausalLM, _llama_like(intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
}

QWEN2_VL_IMAGE_TOKEN = VOCAB - 4


def _qwen2_vl_config(model_type: str = "qwen2_vl"):
    text = _llama_like(rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    vision = {
        "depth": 2,
        "num_heads": 4,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "in_channels": 3,
    }
    if model_type == "qwen2_vl":
        vision.update(embed_dim=32, hidden_size=64, mlp_ratio=2)
    else:
        vision.update(
            hidden_size=32, out_hidden_size=64, intermediate_size=64, fullatt_block_indexes=[1], window_size=56
        )
    return AutoConfig.for_model(
        model_type,
        text_config=text,
        vision_config=vision,
        image_token_id=QWEN2_VL_IMAGE_TOKEN,
        video_token_id=VOCAB - 3,
        vision_start_token_id=VOCAB - 2,
        vision_end_token_id=VOCAB - 1,
    )


def _qwen2_vl_inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    # One 28x28 image: a 2x2 grid of 14x14 patches, merged 2x2 into one image token.
    ids = torch.randint(0, VOCAB - 8, (1, 10), generator=generator)
    ids[0, 3] = QWEN2_VL_IMAGE_TOKEN
    return {
        "input_ids": ids,
        "mm_token_type_ids": (ids == QWEN2_VL_IMAGE_TOKEN).int(),
        "pixel_values": torch.randn(4, 3 * 2 * 14 * 14, generator=generator),
        "image_grid_thw": torch.tensor([[1, 2, 2]]),
    }


class CheckpointFactory:
    """Builds each named stock checkpoint on first request, once per session."""

    def __init__(self, root: Path):
        self.root = root
        self._built: dict[str, StockCheckpoint] = {}

    def __call__(self, name: str) -> StockCheckpoint:
        if name not in self._built:
            self._built[name] = self._build(name)
        return self._built[name]

    def _save(self, name: str, model: PreTrainedModel, seed: int, **save_kwargs: Any) -> Path:
        _perturb(model, seed)
        path = self.root / name
        model.save_pretrained(path, **save_kwargs)
        return path

    def _build(self, name: str) -> StockCheckpoint:
        seed = sum(map(ord, name))
        torch.manual_seed(seed)
        if name in CONFIGS:
            model_type, model_class, kwargs = CONFIGS[name]
            model = model_class.from_config(AutoConfig.for_model(model_type, **kwargs))
            return StockCheckpoint(name, self._save(name, model, seed), model_class, _token_inputs(seed))
        if name in ("qwen2_vl", "qwen2_vl_runtime", "qwen2_5_vl"):
            # Stock save_pretrained writes the published layout (visual.*, model.layers.*) by default and the
            # runtime layout (model.visual.*, model.language_model.*) with save_original_format=False.
            config = _qwen2_vl_config("qwen2_5_vl" if name == "qwen2_5_vl" else "qwen2_vl")
            model = AutoModelForImageTextToText.from_config(config)
            kwargs = {"save_original_format": False} if name == "qwen2_vl_runtime" else {}
            path = self._save(name, model, seed, **kwargs)
            return StockCheckpoint(name, path, AutoModelForImageTextToText, _qwen2_vl_inputs, kwargs)
        if name == "llama_sharded":
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **_llama_like()))
            path = self._save(name, model, seed, max_shard_size="40KB")
            return StockCheckpoint(name, path, AutoModelForCausalLM, _token_inputs(seed), {"max_shard_size": "40KB"})
        if name == "qwen2_moe_sharded":
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2_moe", **CONFIGS["qwen2_moe"][2]))
            path = self._save(name, model, seed, max_shard_size="30KB")
            return StockCheckpoint(name, path, AutoModelForCausalLM, _token_inputs(seed), {"max_shard_size": "30KB"})
        if name == "llama_bf16":
            model = AutoModelForCausalLM.from_config(
                AutoConfig.for_model("llama", **_llama_like()), dtype=torch.bfloat16
            )
            return StockCheckpoint(name, self._save(name, model, seed), AutoModelForCausalLM, _token_inputs(seed))
        raise KeyError(name)


def config_json(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / "config.json").read_text())
