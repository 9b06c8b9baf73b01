"""A slice of the zoo fusion sweep (``benchmarks/zoo.py --fusions``) in CI: tiny models of the model types below are
written by stock ``save_pretrained`` and loaded with every fusion requested (``qkv``, ``gate_up``, ``linear_experts``,
``patch_embeddings``). Each must load, compute on its own dummy inputs what stock computes (bitwise, or within fp32
tolerance where a fused product sums in another order), and save the files stock wrote, bit for bit.

The slice holds encoders (text, audio, a two-tower one), vision-language and audio-language composites, MoE models of
every experts layout ``linear_experts`` fuses (transformers' plain experts, a clamped gate, GPT-OSS's transposed
biased interleaved experts, Aria's transposed ones inside a VLM, GraniteMoE's renamed 3-D keys), Qwen-VL-style
patch embeddings, and MuSE Spark, whose experts stay unfused (their per-expert norm) and still save bitwise.
"""

from __future__ import annotations

import pytest
import transformers
from packaging.version import Version
from transformers import CONFIG_MAPPING

from support.zoo import load_zoo

zoo = load_zoo()

# model type: the families whose every candidate must be fused (the others: fused where they can be)
SLICE = {
    "bert": ("qkv",),
    "wav2vec2": ("qkv",),
    "clip": ("qkv",),
    "llava": ("qkv", "gate_up"),
    "granite_speech": ("qkv", "gate_up"),
    "qwen2_5_vl": ("qkv", "gate_up", "patch_embeddings"),
    "qwen3_vl_moe": ("linear_experts", "patch_embeddings"),
    "qwen3_moe": ("qkv", "linear_experts"),
    "gpt_oss": ("linear_experts",),
    "deepseek_v4": ("linear_experts",),
    "aria": ("qkv", "linear_experts"),
    "granitemoe": ("linear_experts",),
    "vivit": ("patch_embeddings",),
    "muse_spark_text": (),
}


@pytest.fixture(scope="module")
def registry_classes():
    return zoo._registry_classes()


# What transformers 5.15-5.17 lack of the slice: Aria's experts were another class then, with no 3-D weights.
BEFORE_5_18 = {"aria": ("qkv",)}


def _skip_absent(model_type: str) -> None:
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no model type {model_type!r}")


@pytest.mark.parametrize("model_type", sorted(SLICE))
def test_zoo_type_fuses_and_stays_exact(model_type, registry_classes):
    _skip_absent(model_type)
    result = zoo.check_fusions(model_type, registry_classes)
    line = zoo._fusion_line(result)
    assert result.status in ("fused", "partly fused"), line
    assert result.forward in ("bitwise", "close"), line
    assert result.save == "bitwise", line
    before = Version(transformers.__version__) < Version("5.18")
    for family in BEFORE_5_18.get(model_type, SLICE[model_type]) if before else SLICE[model_type]:
        assert result.candidates[family] and result.fused[family] == result.candidates[family], line


def test_muse_spark_experts_are_candidates_left_unfused(registry_classes):
    _skip_absent("muse_spark_text")
    result = zoo.check_fusions("muse_spark_text", registry_classes, ["linear_experts"])
    assert result.candidates == {"linear_experts": 2} and result.fused == {"linear_experts": 0}, zoo._fusion_line(
        result
    )
    assert result.forward == "bitwise" and result.save == "bitwise", zoo._fusion_line(result)


def test_the_sweep_notices_a_fused_forward_that_differs(monkeypatch, registry_classes):
    """The comparison is live: experts whose gate loses its clamp are caught (forward ``differs``), as the plain
    experts forward standing in for DeepSeek-V4's clamped one would be."""
    from modelpatch.fusions.linear_experts import spec

    layouts = dict(spec.KNOWN_FORWARDS)
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

    digest = spec.forward_digest(DeepseekV4Experts)  # this release's (5.15-5.17 wrote it otherwise)
    assert digest is not None and layouts[digest].gate == "chunked"
    layouts[digest] = spec.ExpertsLayout("DeepSeek-V4's forward read as the plain one")
    monkeypatch.setattr(spec, "KNOWN_FORWARDS", layouts)
    monkeypatch.setitem(zoo._OVERRIDES, "deepseek_v4", {"swiglu_limit": 0.02})
    result = zoo.check_fusions("deepseek_v4", registry_classes, ["linear_experts"])
    assert result.fused == {"linear_experts": 2} and result.forward.startswith("differs"), zoo._fusion_line(result)
    assert result.status == "failed", zoo._fusion_line(result)
