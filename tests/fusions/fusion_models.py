"""Tiny checkpoints for the fusion tests, written by stock transformers' own ``save_pretrained``, and comparisons.

Every checkpoint is a real directory produced by ``model.save_pretrained`` of transformers 5.23 (no hub, no mocks).
Parameters are perturbed before saving so that norms and biases are not all ones/zeros and MoE routers are decisive:
a fusion that mixes up q/k/v, gate/up, experts or kernel layouts shows in the values. Each checkpoint remembers the
stock model loaded from it (``stock()``), so the reference outputs are computed once per session.
"""

from __future__ import annotations

import filecmp
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import (
    BertConfig,
    BertModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    PreTrainedModel,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

import modelpatch

VOCAB = 64
ATOL = 1e-5

# Grouped-query attention everywhere (4 query heads, 2 key/value heads): fused q/k/v parts are 32/16/16 rows.
TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False)
MOE = dict(TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def _qwen2_vl_config() -> Qwen2VLConfig:
    return Qwen2VLConfig(
        text_config=dict(TEXT, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, in_channels=3, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
    )


def _qwen2_5_vl_config() -> Qwen2_5_VLConfig:
    return Qwen2_5_VLConfig(
        text_config=dict(TEXT, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32, fullatt_block_indexes=[0],
                           window_size=56),
    )


def _qwen3_vl_config() -> Qwen3VLConfig:
    # Qwen3-VL: 16x16 patches and a Conv3d *with* bias (the other two have none).
    return Qwen3VLConfig(
        text_config=dict(TEXT, head_dim=8,
                         rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32,
                           num_position_embeddings=64, deepstack_visual_indexes=[0]),
    )


# name: (model class, config factory, stock save_pretrained kwargs)
MODELS: dict[str, tuple[type[PreTrainedModel], Callable[[], Any], dict[str, Any]]] = {
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(**TEXT), {}),
    "mistral": (MistralForCausalLM, lambda: MistralConfig(**TEXT, sliding_window=None), {}),
    "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**TEXT), {}),  # q/k/v with bias
    "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(**TEXT, head_dim=8), {}),  # q_norm / k_norm after q/k
    "bert": (BertModel, lambda: BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=4, intermediate_size=64), {}),
    "qwen2_moe": (Qwen2MoeForCausalLM, lambda: Qwen2MoeConfig(**MOE, shared_expert_intermediate_size=24), {}),
    "qwen3_moe": (Qwen3MoeForCausalLM, lambda: Qwen3MoeConfig(**MOE, head_dim=8), {}),
    "mixtral": (MixtralForCausalLM, lambda: MixtralConfig(**TEXT, num_local_experts=4, num_experts_per_tok=2), {}),
    "olmoe": (OlmoeForCausalLM, lambda: OlmoeConfig(**dict(TEXT, intermediate_size=16), num_experts=4,
                                                    num_experts_per_tok=2), {}),
    # Stock 5.23 save_pretrained writes the published Qwen2-VL layout (visual.*, model.layers.*) by default and its
    # runtime layout (model.visual.*, model.language_model.*) with save_original_format=False: both exist in the wild.
    "qwen2_vl": (Qwen2VLForConditionalGeneration, _qwen2_vl_config, {}),
    "qwen2_vl_runtime": (Qwen2VLForConditionalGeneration, _qwen2_vl_config, {"save_original_format": False}),
    "qwen2_5_vl": (Qwen2_5_VLForConditionalGeneration, _qwen2_5_vl_config, {}),
    "qwen3_vl": (Qwen3VLForConditionalGeneration, _qwen3_vl_config, {}),
}
# MoE model: per-expert child names (gate, up, down) of its published checkpoints
EXPERT_NAMES = {
    "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
    "olmoe": ("gate_proj", "up_proj", "down_proj"),
    "mixtral": ("w1", "w3", "w2"),
}
# The MoE models as stock 5.23 saves them with save_original_format=False: experts stored fused, as 3-D
# ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj`` keys (the published layout of Qwen3.5-MoE, for one).
MOE_3D = {f"{name}_3d": name for name in EXPERT_NAMES}
MODELS.update({name: (*MODELS[base][:2], {"save_original_format": False}) for name, base in MOE_3D.items()})
VISION = {"qwen2_vl", "qwen2_vl_runtime", "qwen2_5_vl", "qwen3_vl"}


@dataclass
class TinyCheckpoint:
    """A stock-saved checkpoint directory, its model class, and the reference (stock) model loaded from it."""

    name: str
    path: Path
    model_class: type[PreTrainedModel]
    _stock: PreTrainedModel | None = field(default=None, repr=False)
    _stock_outputs: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    def stock(self) -> PreTrainedModel:
        """The model stock ``from_pretrained`` builds from this checkpoint (shared: do not modify it)."""
        if self._stock is None:
            self._stock = self.model_class.from_pretrained(self.path)
        return self._stock

    def stock_outputs(self) -> dict[str, torch.Tensor]:
        if self._stock_outputs is None:
            self._stock_outputs = self.outputs(self.stock())
        return self._stock_outputs

    def load(self, fusion_config: dict[str, Any] | None = None, path: Path | None = None, **kwargs) -> PreTrainedModel:
        return modelpatch.from_pretrained(self.model_class, path or self.path, fusion_config=fusion_config, **kwargs)

    def outputs(self, model: PreTrainedModel) -> dict[str, torch.Tensor]:
        """fp32 outputs to compare: logits (last hidden state for BERT) and, for VLMs, the vision tower's outputs."""
        generator = torch.Generator().manual_seed(0)
        input_ids = torch.randint(0, VOCAB - 8, (2, 12), generator=generator)
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            result = model(input_ids=input_ids)
            out["logits"] = result.logits if hasattr(result, "logits") else result.last_hidden_state
            if self.name in VISION:
                patch = model.config.vision_config.patch_size
                pixels = torch.randn(16, 3 * 2 * patch * patch, generator=generator)
                vision = model.model.visual(pixels, grid_thw=torch.tensor([[1, 4, 4]]))
                out["vision"] = vision.last_hidden_state
                out["vision_merged"] = vision.pooler_output
        return out


class CheckpointFactory:
    """Builds each named checkpoint on first request, once per session."""

    def __init__(self, root: Path):
        self.root = root
        self._built: dict[str, TinyCheckpoint] = {}

    def __call__(self, name: str) -> TinyCheckpoint:
        if name not in self._built:
            self._built[name] = self._build(name)
        return self._built[name]

    def _build(self, name: str) -> TinyCheckpoint:
        model_class, make_config, save_kwargs = MODELS[name]
        seed = sum(map(ord, name))
        torch.manual_seed(seed)
        model = model_class(make_config())
        perturb(model, seed)
        path = self.root / name
        model.save_pretrained(path, **save_kwargs)
        return TinyCheckpoint(name, path, model_class)


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Small noise on every parameter (norms != 1, biases != 0); strong noise on MoE routers (decisive top-k)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 1.0 if name.endswith("mlp.gate.weight") else 0.05
            param.add_(torch.randn(param.shape, generator=generator) * scale)


def assert_outputs_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float = ATOL):
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], atol=atol, rtol=0, msg=lambda m, key=key: f"{key}: {m}")


def assert_outputs_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]):
    assert actual.keys() == expected.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key


def assert_same_files(saved: Path, source: Path) -> None:
    """Every safetensors file (and shard index) of ``source`` exists in ``saved`` with identical bytes."""
    names = sorted(p.name for p in source.iterdir() if p.suffix == ".safetensors" or p.name.endswith(".index.json"))
    assert names, f"no tensor files in {source}"
    assert sorted(p.name for p in saved.iterdir() if p.name in names or p.suffix == ".safetensors") == names
    for name in names:
        assert filecmp.cmp(saved / name, source / name, shallow=False), f"{name} differs from the source checkpoint"


def checkpoint_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes


def check_fused_roundtrip(ckpt: TinyCheckpoint, fusion_config: dict[str, Any], tmp_path: Path) -> PreTrainedModel:
    """What every family must show, for one checkpoint and ``fusion_config``:

    * fp32 outputs within 1e-5 of the unfused stock model;
    * default save: the tensor files are bitwise the source checkpoint's, and config.json records the fusions;
    * ``save_original_format=False``: the runtime layout is written, and a reload without arguments rebuilds the
      fused model (from the stored ``fusion_config``) with identical outputs.

    Returns the fused model.
    """
    fused = ckpt.load(fusion_config)
    outputs = ckpt.outputs(fused)
    assert_outputs_close(outputs, ckpt.stock_outputs())

    original = tmp_path / "original_format"
    modelpatch.save_pretrained(fused, original)
    assert_same_files(original, ckpt.path)
    assert modelpatch.from_pretrained(ckpt.model_class, original).config.modelpatch["fusion_config"] == fusion_config

    runtime = tmp_path / "runtime_format"
    modelpatch.save_pretrained(fused, runtime, save_original_format=False)
    runtime_shapes = checkpoint_shapes(runtime)
    expected_shapes = {k: tuple(v.shape) for k, v in fused.state_dict().items()}
    for tied in getattr(fused, "all_tied_weights_keys", {}) or {}:
        expected_shapes.pop(tied, None)
    assert runtime_shapes == expected_shapes, "the runtime-format save is not the fused model's state dict"

    reloaded = modelpatch.from_pretrained(ckpt.model_class, runtime)
    assert module_types(reloaded) == module_types(fused)
    assert_outputs_equal(ckpt.outputs(reloaded), outputs)
    return fused


def module_types(model: torch.nn.Module) -> dict[str, type]:
    return {name: type(module) for name, module in model.named_modules()}
