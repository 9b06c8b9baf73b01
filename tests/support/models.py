"""The tiny-model table: model type -> a builder of a tiny config of that type (overrides as keywords).

Grouped-query attention everywhere (4 query heads, 2 key/value heads: fused q/k/v parts are 32/16/16 rows at the
default width), two layers, untied heads. ``WIDE`` widens a text config (the loader and reliability checkpoints use it,
so that their shards and expert slices have room). ``sized_config`` builds a text config of sizes a test chooses itself.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from transformers import AutoConfig, PretrainedConfig

VOCAB = 64

TEXT: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)
MOE: dict[str, Any] = dict(TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
WIDE: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=96, max_position_embeddings=128)

# Keyword arguments of the text-only model types.
_TEXT_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": TEXT,
    "mistral": dict(TEXT, sliding_window=None),
    "qwen2": TEXT,  # q/k/v with bias
    "qwen3": dict(TEXT, head_dim=8),  # q_norm / k_norm after q/k
    "qwen2_moe": dict(MOE, shared_expert_intermediate_size=24),
    "qwen3_moe": dict(MOE, head_dim=8),
    "mixtral": dict(TEXT, num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(TEXT, intermediate_size=16, num_experts=4, num_experts_per_tok=2),
    "bert": dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
    "gpt2": dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64),
}

_MROPE = {"type": "mrope", "mrope_section": [1, 1, 2]}
# The vision tower of the vision-language types: one block of width 32, 2 heads, RGB patches over 2 frames, merged
# 2x2. Qwen2.5-VL and Qwen3-VL (-MoE) add an MLP of width 64 and a merger out to the text width.
_VISION: dict[str, Any] = dict(
    depth=1, hidden_size=32, num_heads=2, in_channels=3, spatial_merge_size=2, temporal_patch_size=2
)
_VISION_WITH_MLP: dict[str, Any] = dict(_VISION, intermediate_size=64, out_hidden_size=32)
_MROPE_INTERLEAVED = {"rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True}
# Qwen3-VL's: 16x16 patches and a Conv3d *with* bias (the others have none).
_QWEN3_VL_VISION: dict[str, Any] = dict(
    _VISION_WITH_MLP, patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0]
)
# Vision-language types: (text config keywords, vision config keywords).
_VISION_LANGUAGE_CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "qwen2_vl": (dict(TEXT, rope_scaling=_MROPE), dict(_VISION, embed_dim=32, patch_size=14)),
    "qwen2_5_vl": (
        dict(TEXT, rope_scaling=_MROPE),
        dict(_VISION_WITH_MLP, patch_size=14, fullatt_block_indexes=[0], window_size=56),
    ),
    "qwen3_vl": (dict(TEXT, head_dim=8, rope_scaling=_MROPE_INTERLEAVED), _QWEN3_VL_VISION),
    # 3-D experts: gate_up_proj is 32 x 32 per expert at this width (2 x moe_intermediate_size == hidden_size).
    "qwen3_vl_moe": (dict(MOE, head_dim=8, rope_scaling=_MROPE_INTERLEAVED), _QWEN3_VL_VISION),
}


def _text_config(model_type: str, **overrides: Any) -> PretrainedConfig:
    return AutoConfig.for_model(model_type, **{**_TEXT_CONFIGS[model_type], **overrides})


def _vision_language_config(
    model_type: str, text: dict[str, Any] | None = None, vision: dict[str, Any] | None = None, **overrides: Any
) -> PretrainedConfig:
    """``text`` and ``vision`` update the sub-configs' keywords; ``overrides`` are the top-level config's."""
    text_defaults, vision_defaults = _VISION_LANGUAGE_CONFIGS[model_type]
    return AutoConfig.for_model(
        model_type,
        text_config={**text_defaults, **(text or {})},
        vision_config={**vision_defaults, **(vision or {})},
        **overrides,
    )


TINY_CONFIGS: dict[str, Callable[..., PretrainedConfig]] = {
    **{model_type: partial(_text_config, model_type) for model_type in _TEXT_CONFIGS},
    **{model_type: partial(_vision_language_config, model_type) for model_type in _VISION_LANGUAGE_CONFIGS},
}


def tiny_config(model_type: str, **overrides: Any) -> PretrainedConfig:
    """A tiny config of ``model_type`` (a key of :data:`TINY_CONFIGS`), ``overrides`` applied."""
    return TINY_CONFIGS[model_type](**overrides)


def sized_config(
    model_type: str,
    *,
    vocab: int,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int | None = None,
    **overrides: Any,
) -> PretrainedConfig:
    """A text config of ``model_type`` of exactly these sizes, ``overrides`` applied last (they may replace a size).

    For the tests whose checks depend on sizes of their own (file sizes, memory bounds, quantization blocks); the
    others take :func:`tiny_config`. ``kv_heads`` left out keeps the type's default (as many as ``heads``)."""
    sizes: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
    )
    if kv_heads is not None:
        sizes["num_key_value_heads"] = kv_heads
    return AutoConfig.for_model(model_type, **{**sizes, **overrides})


def wide(**overrides: Any) -> dict[str, Any]:
    """The keywords that turn a tiny text config into the wider one (128 tokens, width 64), plus ``overrides``."""
    return {**WIDE, **overrides}
