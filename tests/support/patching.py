"""Tiny real models and replacement classes shared by the class-patching tests.

Everything here is importable by name (``support.patching``), so models built with these replacements can be pickled.
No mocks: every replacement is a real ``nn.Module`` that runs inside a real transformers model.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.bert.modeling_bert import BertSelfAttention
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeAttention, Qwen2MoeExperts, Qwen2MoeTopKRouter

import modelpatch
from support.models import VOCAB, tiny_config

SEQ_LEN = 5


def eager_config(model_type: str, num_hidden_layers: int = 2, **overrides) -> PretrainedConfig:
    """A tiny config of ``model_type`` with eager attention (its weights are what the recorders capture)."""
    return tiny_config(
        model_type,
        **{
            "num_hidden_layers": num_hidden_layers,
            "max_position_embeddings": 64,
            "attn_implementation": "eager",
            **overrides,
        },
    )


llama_config = partial(eager_config, "llama")
bert_config = partial(eager_config, "bert")


def qwen2_moe_config(num_hidden_layers: int = 2, **overrides) -> PretrainedConfig:
    return eager_config("qwen2_moe", num_hidden_layers, **{"shared_expert_intermediate_size": 32, **overrides})


def build(model_class: type[nn.Module], config: PretrainedConfig, seed: int = 0) -> nn.Module:
    """``model_class(config)`` in eval mode, its random initialisation seeded by ``seed``."""
    torch.manual_seed(seed)
    return model_class(config).eval()


@contextmanager
def patched_build(
    model_class: type[nn.Module], config: PretrainedConfig, mapping: dict[str, type]
) -> Iterator[tuple[nn.Module, nn.Module]]:
    """The reference ``build(model_class, config)``, then ``mapping`` registered and, inside ``apply_patches``, the
    patched build (seed 1); the body of the ``with`` runs inside that scope too."""
    reference = build(model_class, config)
    modelpatch.register_patch_mapping(mapping)
    with modelpatch.apply_patches():
        yield reference, build(model_class, config, seed=1)


def reference_and_patched(
    model_class: type[nn.Module], config: PretrainedConfig, mapping: dict[str, type]
) -> tuple[nn.Module, nn.Module]:
    """:func:`patched_build` with nothing else done inside the scope."""
    with patched_build(model_class, config, mapping) as models:
        return models


def input_ids(vocab_size: int = VOCAB, seq_len: int = SEQ_LEN) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab_size, (1, seq_len), generator=generator)


def module_classes(model: nn.Module) -> set[type]:
    """The classes a model is built of."""
    return {type(m) for m in model.modules()}


# --- Replacements that subclass the original and keep its math -----------------------------------------------------


class CountingLlamaAttention(LlamaAttention):
    """A LlamaAttention that counts how often ``__init__`` runs (per class, thread-safe)."""

    init_calls = 0
    _lock = threading.Lock()

    def __init__(self, config, layer_idx):
        with CountingLlamaAttention._lock:
            CountingLlamaAttention.init_calls += 1
        super().__init__(config, layer_idx)


class MarkedLlamaAttention(LlamaAttention):
    """Same math as LlamaAttention; only its type tells it apart."""


class OtherLlamaAttention(LlamaAttention):
    """A second distinguishable LlamaAttention subclass (for precedence tests)."""


class MarkedLlamaMLP(LlamaMLP):
    """Same math as LlamaMLP."""


class MarkedQwen2MoeAttention(Qwen2MoeAttention):
    """Same math as Qwen2MoeAttention."""


class MarkedQwen2MoeExperts(Qwen2MoeExperts):
    """Same math as Qwen2MoeExperts."""


class MarkedBertSelfAttention(BertSelfAttention):
    """Same math as BertSelfAttention."""


class PlainModule(nn.Module):
    """A replacement with no relation to any transformers class; accepts any constructor arguments."""

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.received_args = args
        self.received_kwargs = kwargs

    def forward(self, *args, **kwargs):  # pragma: no cover - never run
        raise AssertionError("PlainModule is never meant to run")


# --- Replacements that do NOT subclass the original ------------------------------------------------------------------


class ArgsRecordingAttention(nn.Module):
    """Not a LlamaAttention: records the arguments it was built with, then wraps an original LlamaAttention."""

    init_calls = 0
    received: list[tuple[tuple, dict]] = []
    _lock = threading.Lock()

    def __init__(self, *args, **kwargs):
        super().__init__()
        with ArgsRecordingAttention._lock:
            ArgsRecordingAttention.init_calls += 1
            ArgsRecordingAttention.received.append((args, kwargs))
        self.inner = LlamaAttention(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


class _WrappedAttention(nn.Module):
    """Not an attention class of transformers: it wraps an original ``wrapped`` and returns its outputs unchanged."""

    wrapped: type[nn.Module]

    def __init__(self, config, layer_idx):
        super().__init__()
        self.inner = self.wrapped(config, layer_idx)

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


class WrappedLlamaAttention(_WrappedAttention):
    """Not a LlamaAttention: it wraps an inner (original) LlamaAttention."""

    wrapped = LlamaAttention


class WrappedQwen2MoeAttention(_WrappedAttention):
    """Not a Qwen2MoeAttention: it wraps an original one."""

    wrapped = Qwen2MoeAttention


def _copy_llama_attention_state(target: nn.Module, config, layer_idx: int) -> None:
    target.config = config
    target.layer_idx = layer_idx
    target.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    target.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
    target.scaling = target.head_dim**-0.5
    target.attention_dropout = config.attention_dropout
    target.is_causal = True
    bias = config.attention_bias
    target.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * target.head_dim, bias=bias)
    target.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * target.head_dim, bias=bias)
    target.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * target.head_dim, bias=bias)
    target.o_proj = nn.Linear(config.num_attention_heads * target.head_dim, config.hidden_size, bias=bias)


class ReimplementedLlamaAttention(nn.Module):
    """Not a LlamaAttention and contains none: its own projections, LlamaAttention's math (same parameter names)."""

    def __init__(self, config, layer_idx):
        super().__init__()
        _copy_llama_attention_state(self, config, layer_idx)

    def forward(self, *args, **kwargs):
        return LlamaAttention.forward(self, *args, **kwargs)


class ReimplementedQwen2MoeRouter(nn.Module):
    """Not a Qwen2MoeTopKRouter: same parameters and math, written out again."""

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.norm_topk_prob = config.norm_topk_prob
        self.hidden_dim = config.hidden_size
        self.weight = nn.Parameter(torch.zeros(self.num_experts, self.hidden_dim))

    def forward(self, hidden_states):
        return Qwen2MoeTopKRouter.forward(self, hidden_states)
