"""Built-in conversions: published checkpoint layouts of stock transformers 5.23 models -> their runtime layouts."""

from __future__ import annotations

from .operations import Concatenate, MergeModulelist
from .transforms import WeightConverter, WeightRenaming, WeightTransform


def _fused_experts(gate: str, up: str, down: str, gate_up_target: str, down_target: str) -> list[WeightTransform]:
    """Per-expert ``gate``/``up``/``down`` Linear weights -> fused 3-D ``gate_up_proj`` / ``down_proj``."""
    return [
        WeightConverter(
            [gate, up], gate_up_target, [MergeModulelist(dim=0), Concatenate(dim=1, equal_parts=True)]
        ),
        WeightConverter(down, down_target, [MergeModulelist(dim=0)]),
    ]


def _qwen_moe() -> list[WeightTransform]:
    return _fused_experts(
        "mlp.experts.*.gate_proj.weight",
        "mlp.experts.*.up_proj.weight",
        "mlp.experts.*.down_proj.weight",
        "mlp.experts.gate_up_proj",
        "mlp.experts.down_proj",
    )


def _mixtral() -> list[WeightTransform]:
    return [
        WeightRenaming(r"\.block_sparse_moe\.", ".mlp."),
        *_fused_experts(
            ".experts.*.w1.weight",
            ".experts.*.w3.weight",
            ".experts.*.w2.weight",
            ".experts.gate_up_proj",
            ".experts.down_proj",
        ),
    ]


def _qwen_vl() -> list[WeightTransform]:
    # Published checkpoints keep the vision tower at the root and the text model under ``model.``; the runtime nests
    # both under ``model.``. Keys already in the runtime layout (what 5.23's save_pretrained writes) match neither.
    return [
        WeightRenaming(r"^visual\.", "model.visual."),
        WeightRenaming(r"^model\.(?!language_model\.|visual\.)", "model.language_model."),
    ]


def builtin_conversions() -> dict[str, list[WeightTransform]]:
    """Fresh instances of every built-in mapping, keyed by ``config.model_type``."""
    return {
        "mixtral": _mixtral(),
        "qwen2_moe": _qwen_moe(),
        "qwen3_moe": _qwen_moe(),
        "olmoe": _qwen_moe(),
        "qwen2_vl": _qwen_vl(),
        "qwen2_5_vl": _qwen_vl(),
    }
