"""The checkpoint factory: tiny checkpoints written by stock transformers' own ``save_pretrained``, once per session.

Every checkpoint is a real directory produced by ``model.save_pretrained`` of transformers 5.x (no hub, no mocks).
Parameters are perturbed before saving so that norms and biases are not all ones/zeros (and, in the tiny family, MoE
routers are decisive): a conversion that mixes up q/k/v, gate/up, experts or kernel layouts shows in the values.

Two named families draw on the one config table of :mod:`support.models`:

* :data:`TINY_CHECKPOINTS` (the ``tiny`` fixture): the default width, every fusion family's models, built with the
  concrete model class; :meth:`TinyCheckpoint.stock` keeps the stock model loaded from it for the session.
* :data:`STOCK_CHECKPOINTS` (the ``stock_checkpoint`` fixture): the wider configs of the loader and reliability tests,
  built through the Auto classes, with shards, a bf16 and a tied variant, and Qwen2-VL inputs holding an image.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForMaskedLM,
    BertModel,
    LlamaForCausalLM,
    MistralForCausalLM,
    MixtralForCausalLM,
    OlmoeForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2ForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen2VLForConditionalGeneration,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeForConditionalGeneration,
)

import modelpatch
from support.files import read_tensors
from support.models import tiny_config, wide

Inputs = Callable[[int, int], dict[str, torch.Tensor]]


def token_inputs(seed: int, vocab_size: int) -> dict[str, torch.Tensor]:
    """Two rows of twelve token ids below the vocabulary's last eight (where the special tokens live)."""
    generator = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, vocab_size - 8, (2, 12), generator=generator)}


# Qwen2-VL's special tokens are the wide vocabulary's last four ids.
QWEN2_VL_IMAGE_TOKEN = 128 - 4


def image_inputs(seed: int, vocab_size: int) -> dict[str, torch.Tensor]:
    """One 28x28 image (a 2x2 grid of 14x14 patches, merged 2x2 into one image token) among ten tokens."""
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab_size - 8, (1, 10), generator=generator)
    ids[0, 3] = QWEN2_VL_IMAGE_TOKEN
    return {
        "input_ids": ids,
        "mm_token_type_ids": (ids == QWEN2_VL_IMAGE_TOKEN).int(),
        "pixel_values": torch.randn(4, 3 * 2 * 14 * 14, generator=generator),
        "image_grid_thw": torch.tensor([[1, 2, 2]]),
    }


@dataclass(frozen=True)
class CheckpointSpec:
    """How one named checkpoint is made: model class, config, ``save_pretrained`` keywords, and its inputs.

    A concrete model class is built by calling it with the config; an Auto class through ``from_config``.
    """

    model_class: type
    config: Callable[[], PretrainedConfig]
    save_kwargs: dict[str, Any] = field(default_factory=dict)
    dtype: torch.dtype | None = None
    inputs: Inputs = token_inputs
    # Noise on the MoE routers (``mlp.gate.weight``): 1.0 makes top-k decisive, so a mixed-up expert shows.
    router_scale: float = 0.05
    vision: bool = False


def _tiny(
    model_class: type[PreTrainedModel], model_type: str, config: dict[str, Any] | None = None, **save_kwargs: Any
) -> CheckpointSpec:
    return CheckpointSpec(
        model_class,
        lambda: tiny_config(model_type, **(config or {})),
        save_kwargs,
        router_scale=1.0,
        vision=model_type.endswith("_vl"),
    )


# MoE model type: per-expert child names (gate, up, down) of its published checkpoints.
EXPERT_NAMES = {
    "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
    "olmoe": ("gate_proj", "up_proj", "down_proj"),
    "mixtral": ("w1", "w3", "w2"),
}
# The MoE models as stock 5.23 saves them with save_original_format=False: experts stored fused, as 3-D
# ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj`` keys (the published layout of Qwen3.5-MoE, for one).
MOE_3D = {f"{name}_3d": name for name in EXPERT_NAMES}

TINY_CHECKPOINTS: dict[str, CheckpointSpec] = {
    "llama": _tiny(LlamaForCausalLM, "llama"),
    # The head tied to the embeddings, as Llama-3.2-1B's (the docs' model) is.
    "llama_tied": _tiny(LlamaForCausalLM, "llama", {"tie_word_embeddings": True}),
    # Head counts that do not divide by two ranks (tensor parallelism refuses them): one key/value head; three heads.
    "llama_one_kv_head": _tiny(LlamaForCausalLM, "llama", {"num_key_value_heads": 1}),
    "llama_three_heads": _tiny(
        LlamaForCausalLM, "llama", {"hidden_size": 24, "num_attention_heads": 3, "num_key_value_heads": 3}
    ),
    "mistral": _tiny(MistralForCausalLM, "mistral"),
    "qwen2": _tiny(Qwen2ForCausalLM, "qwen2"),
    "qwen3": _tiny(Qwen3ForCausalLM, "qwen3"),
    "bert": _tiny(BertModel, "bert"),
    "qwen2_moe": _tiny(Qwen2MoeForCausalLM, "qwen2_moe"),
    "qwen3_moe": _tiny(Qwen3MoeForCausalLM, "qwen3_moe"),
    "mixtral": _tiny(MixtralForCausalLM, "mixtral"),
    "olmoe": _tiny(OlmoeForCausalLM, "olmoe"),
    # Stock 5.23 save_pretrained writes the published Qwen2-VL layout (visual.*, model.layers.*) by default and its
    # runtime layout (model.visual.*, model.language_model.*) with save_original_format=False: both exist in the wild.
    "qwen2_vl": _tiny(Qwen2VLForConditionalGeneration, "qwen2_vl"),
    "qwen2_vl_runtime": _tiny(Qwen2VLForConditionalGeneration, "qwen2_vl", save_original_format=False),
    "qwen2_5_vl": _tiny(Qwen2_5_VLForConditionalGeneration, "qwen2_5_vl"),
    "qwen3_vl": _tiny(Qwen3VLForConditionalGeneration, "qwen3_vl"),
    # 3-D experts whose older layout has their shape: gate_up_proj (2 x 16 == 32 == hidden), down_proj (32 == hidden).
    "qwen3_vl_moe": _tiny(Qwen3VLMoeForConditionalGeneration, "qwen3_vl_moe"),
    "qwen3_vl_moe_square_down": _tiny(
        Qwen3VLMoeForConditionalGeneration, "qwen3_vl_moe", {"text": {"moe_intermediate_size": 32}}
    ),
}
TINY_CHECKPOINTS.update(
    {name: _tiny(TINY_CHECKPOINTS[base].model_class, base, save_original_format=False) for name, base in MOE_3D.items()}
)
VISION = {name for name, spec in TINY_CHECKPOINTS.items() if spec.vision}


def _wide(model_class: type, model_type: str, save_kwargs: dict[str, Any] | None = None, **overrides: Any):
    return CheckpointSpec(model_class, lambda: tiny_config(model_type, **wide(**overrides)), save_kwargs or {})


def _wide_vision_language(model_type: str, **save_kwargs: Any) -> CheckpointSpec:
    vision: dict[str, Any] = dict(depth=2, num_heads=4)
    if model_type == "qwen2_vl":
        vision.update(hidden_size=64, mlp_ratio=2)
    else:
        vision.update(out_hidden_size=64, fullatt_block_indexes=[1])

    def config() -> PretrainedConfig:
        return tiny_config(
            model_type,
            text=wide(rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
            vision=vision,
            image_token_id=QWEN2_VL_IMAGE_TOKEN,
            video_token_id=128 - 3,
            vision_start_token_id=128 - 2,
            vision_end_token_id=128 - 1,
        )

    return CheckpointSpec(AutoModelForImageTextToText, config, save_kwargs, inputs=image_inputs)


_BERT_WIDE = dict(vocab_size=128, max_position_embeddings=64)

STOCK_CHECKPOINTS: dict[str, CheckpointSpec] = {
    "llama": _wide(AutoModelForCausalLM, "llama"),
    "llama_tied": _wide(AutoModelForCausalLM, "llama", tie_word_embeddings=True),
    "llama_sharded": _wide(AutoModelForCausalLM, "llama", {"max_shard_size": "40KB"}),
    "llama_bf16": CheckpointSpec(AutoModelForCausalLM, lambda: tiny_config("llama", **wide()), dtype=torch.bfloat16),
    "mistral": _wide(AutoModelForCausalLM, "mistral"),
    "qwen2": _wide(AutoModelForCausalLM, "qwen2"),
    "gpt2": CheckpointSpec(AutoModelForCausalLM, lambda: tiny_config("gpt2", vocab_size=128)),
    # BERT's MLM decoder is tied to the word embeddings: a load that forgets to tie gives a random head.
    "bert": CheckpointSpec(AutoModelForMaskedLM, lambda: tiny_config("bert", **_BERT_WIDE)),
    "bert_base": CheckpointSpec(AutoModel, lambda: tiny_config("bert", **_BERT_WIDE)),
    "qwen2_moe": _wide(AutoModelForCausalLM, "qwen2_moe", moe_intermediate_size=32, shared_expert_intermediate_size=48),
    "qwen2_moe_sharded": _wide(
        AutoModelForCausalLM,
        "qwen2_moe",
        {"max_shard_size": "30KB"},
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    # num_key_value_heads == num_attention_heads: the seeds' 3 * heads * head_dim fused q/k/v sizing is valid.
    "qwen2_moe_mha": _wide(
        AutoModelForCausalLM,
        "qwen2_moe",
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_key_value_heads=4,
    ),
    "qwen2_moe_wide": _wide(
        AutoModelForCausalLM, "qwen2_moe", moe_intermediate_size=512, shared_expert_intermediate_size=48
    ),
    "mixtral": _wide(AutoModelForCausalLM, "mixtral", intermediate_size=32),
    "qwen3_moe": _wide(AutoModelForCausalLM, "qwen3_moe", moe_intermediate_size=32, head_dim=16),
    "olmoe": _wide(AutoModelForCausalLM, "olmoe", intermediate_size=32),
    "qwen2_vl": _wide_vision_language("qwen2_vl"),
    "qwen2_vl_runtime": _wide_vision_language("qwen2_vl", save_original_format=False),
    "qwen2_5_vl": _wide_vision_language("qwen2_5_vl"),
}


def layers_on_disk() -> dict[str, str]:
    """A device map of the stock Llama checkpoints: the decoder layers offloaded to disk, the rest on the CPU (a new
    dict at each call, since a load may keep or change the one it gets)."""
    return {
        "model.embed_tokens": "cpu",
        "model.layers": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }


@dataclass
class TinyCheckpoint:
    """A stock-saved checkpoint directory, how it was made, and the reference (stock) model loaded from it."""

    name: str
    path: Path
    model_class: type
    spec: CheckpointSpec = field(repr=False)
    vocab_size: int = field(repr=False)
    _stock: PreTrainedModel | None = field(default=None, repr=False)
    _stock_outputs: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def save_kwargs(self) -> dict[str, Any]:
        return self.spec.save_kwargs

    @property
    def files(self) -> list[Path]:
        return sorted(self.path.glob("*.safetensors"))

    @property
    def single_file(self) -> bool:
        return len(self.files) == 1

    def tensors(self) -> dict[str, torch.Tensor]:
        return read_tensors(self.path)

    def inputs(self) -> dict[str, torch.Tensor]:
        """The model inputs of this checkpoint (the same on every call)."""
        return self.spec.inputs(sum(map(ord, self.name)), self.vocab_size)

    def stock(self) -> PreTrainedModel:
        """The model stock ``from_pretrained`` builds from this checkpoint (shared: do not modify it)."""
        if self._stock is None:
            self._stock = self.model_class.from_pretrained(self.path)
        return self._stock

    def stock_outputs(self) -> dict[str, torch.Tensor]:
        if self._stock_outputs is None:
            self._stock_outputs = self.outputs(self.stock())
        return self._stock_outputs

    def reference_logits(self) -> torch.Tensor:
        """Logits of a fresh stock ``from_pretrained`` of this checkpoint on :meth:`inputs`."""
        model = self.model_class.from_pretrained(self.path).eval()
        with torch.no_grad():
            return model(**self.inputs()).logits

    def load(self, fusion_config: dict[str, Any] | None = None, path: Path | None = None, **kwargs) -> PreTrainedModel:
        return modelpatch.from_pretrained(self.model_class, path or self.path, fusion_config=fusion_config, **kwargs)

    def outputs(self, model: PreTrainedModel) -> dict[str, torch.Tensor]:
        """fp32 outputs to compare: logits (last hidden state for BERT) and, for VLMs, the vision tower's outputs."""
        generator = torch.Generator().manual_seed(0)
        input_ids = torch.randint(0, self.vocab_size - 8, (2, 12), generator=generator)
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            result = model(input_ids=input_ids)
            out["logits"] = result.logits if hasattr(result, "logits") else result.last_hidden_state
            if self.spec.vision:
                patch = model.config.vision_config.patch_size
                pixels = torch.randn(16, 3 * 2 * patch * patch, generator=generator)
                vision = model.model.visual(pixels, grid_thw=torch.tensor([[1, 4, 4]]))
                out["vision"] = vision.last_hidden_state
                out["vision_merged"] = vision.pooler_output
        return out


class CheckpointFactory:
    """Builds each named checkpoint of ``table`` on first request, once per factory (the fixtures: per session)."""

    def __init__(self, root: Path, table: dict[str, CheckpointSpec] = TINY_CHECKPOINTS):
        self.root = root
        self.table = table
        self._built: dict[str, TinyCheckpoint] = {}

    def __call__(self, name: str) -> TinyCheckpoint:
        if name not in self._built:
            self._built[name] = self._build(name)
        return self._built[name]

    def _build(self, name: str) -> TinyCheckpoint:
        spec = self.table[name]
        seed = sum(map(ord, name))
        torch.manual_seed(seed)
        config = spec.config()
        if issubclass(spec.model_class, PreTrainedModel):
            model = spec.model_class(config)
        else:  # an Auto class cannot be instantiated; it picks the concrete class from the config
            model = spec.model_class.from_config(config, **({"dtype": spec.dtype} if spec.dtype else {}))
        perturb(model, seed, router_scale=spec.router_scale)
        path = self.root / name
        model.save_pretrained(path, **spec.save_kwargs)
        return TinyCheckpoint(name, path, spec.model_class, spec, config.get_text_config().vocab_size)


def perturb(model: torch.nn.Module, seed: int, router_scale: float = 0.05) -> None:
    """Noise of scale 0.05 on every floating-point parameter (norms != 1, biases != 0); ``router_scale`` on routers."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.is_floating_point():
                scale = router_scale if name.endswith("mlp.gate.weight") else 0.05
                noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
                param.add_(noise.to(param.dtype) * scale)
