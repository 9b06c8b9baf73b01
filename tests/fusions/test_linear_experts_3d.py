"""``linear_experts`` on checkpoints that store the experts fused, as 3-D ``mlp.experts.gate_up_proj [E, 2I, H]`` and
``mlp.experts.down_proj [E, H, I]`` keys (written here by stock ``save_pretrained(save_original_format=False)``).

The load splits them into the per-expert ``nn.Linear`` weights and records the split, so a default save writes the
3-D keys back bitwise. Per-expert checkpoints load with no conversion at all (and save back per expert:
``test_linear_experts.py``). Experts held in both layouts, or 3-D tensors that do not fit the model, are refused
before any tensor data is read.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fusion_models import (
    EXPERT_NAMES,
    MOE_3D,
    assert_outputs_close,
    assert_same_files,
    check_fused_roundtrip,
    checkpoint_shapes,
)
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import modelpatch
from modelpatch import LoadPlanError
from modelpatch.fusions.linear_experts.modules import LinearExperts
from support.models import sized_config

FUSION = {"linear_experts": True}
LAYERS, EXPERTS = 2, 4
EXPERTS_0 = "model.layers.0.mlp.experts"
EXPERTS_1 = "model.layers.1.mlp.experts"


@pytest.mark.parametrize("name", sorted(MOE_3D))
def test_stock_runtime_saves_store_the_experts_3d(tiny, name):
    shapes = checkpoint_shapes(tiny(name).path)
    stock = tiny(name).stock().model.layers[0].mlp.experts
    for layer in range(LAYERS):
        assert shapes[f"model.layers.{layer}.mlp.experts.gate_up_proj"] == tuple(stock.gate_up_proj.shape)
        assert shapes[f"model.layers.{layer}.mlp.experts.down_proj"] == tuple(stock.down_proj.shape)
    assert len(stock.gate_up_proj.shape) == 3 and stock.gate_up_proj.shape[0] == EXPERTS
    assert not [key for key in shapes if re.search(r"experts\.\d+\.", key)]


@pytest.mark.parametrize("name", sorted(MOE_3D))
def test_matches_stock_and_saves_back_3d(tiny, tmp_path, name):
    """Outputs within 1e-5 of stock loaded from the same 3-D checkpoint; the default save is bitwise the source
    files; the runtime-format save reloads fused (all in ``check_fused_roundtrip``)."""
    ckpt = tiny(name)
    model = check_fused_roundtrip(ckpt, FUSION, tmp_path)

    gate, up, down = EXPERT_NAMES[MOE_3D[name]]
    stock = ckpt.stock().model.layers[0].mlp.experts
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, LinearExperts) and len(experts) == EXPERTS
    intermediate = stock.down_proj.shape[-1]
    for index, expert in enumerate(experts):
        assert torch.equal(getattr(expert, gate).weight, stock.gate_up_proj[index, :intermediate])
        assert torch.equal(getattr(expert, up).weight, stock.gate_up_proj[index, intermediate:])
        assert torch.equal(getattr(expert, down).weight, stock.down_proj[index])
    # Every per-expert weight was converted from its layer's 3-D tensor (what the default save reversed).
    converted = model.modelpatch_report.converted
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}.mlp.experts"
        for index in range(EXPERTS):
            assert converted[f"{prefix}.{index}.{gate}.weight"] == [f"{prefix}.gate_up_proj"]
            assert converted[f"{prefix}.{index}.{up}.weight"] == [f"{prefix}.gate_up_proj"]
            assert converted[f"{prefix}.{index}.{down}.weight"] == [f"{prefix}.down_proj"]
    assert len(converted) == LAYERS * EXPERTS * 3


def test_auto_class_loads_3d_experts(tiny):
    ckpt = tiny("qwen3_moe_3d")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path, fusion_config=FUSION)
    assert isinstance(model.model.layers[1].mlp.experts, LinearExperts)
    assert_outputs_close(ckpt.outputs(model), ckpt.stock_outputs())


@pytest.mark.parametrize("name", sorted(EXPERT_NAMES))
def test_per_expert_checkpoints_are_not_converted(tiny, name):
    """The 3-D converters are part of the load but match no per-expert key: every tensor is read unchanged."""
    report = tiny(name).load(FUSION).modelpatch_report
    assert report.groups == ()
    assert any(getattr(t, "alternative", False) for t in report.transforms)


def test_3d_patterns_match_only_the_experts_own_keys(tiny):
    planned = modelpatch.plan_pretrained(AutoModelForCausalLM, tiny("qwen2_moe_3d").path, fusion_config=FUSION)
    converters = [t for t in planned.transforms if getattr(t, "alternative", False)]
    assert len(converters) == 2

    def matched(key):
        return any(c.match_source(key) for c in converters)

    assert matched(f"{EXPERTS_0}.gate_up_proj") and matched(f"{EXPERTS_0}.down_proj")
    for key in (
        f"{EXPERTS_0}.gate_up_proj_bias",
        f"{EXPERTS_0}.down_proj_bias",
        f"{EXPERTS_0}.gate_up_proj_scale_inv",
        f"{EXPERTS_0}.gate_up_proj.weight",
        "model.layers.0.mlp.shared_experts.gate_up_proj",
        f"{EXPERTS_0}.0.gate_proj.weight",
        f"{EXPERTS_0}.0.down_proj.weight",
    ):
        assert not matched(key), key


def _rewrite(source: Path, target: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of a stock-saved single-file checkpoint whose tensors ``edit`` changes."""
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def _down_per_expert(tensors):
    down = tensors.pop(f"{EXPERTS_0}.down_proj")
    tensors.update({f"{EXPERTS_0}.{i}.down_proj.weight": down[i].clone() for i in range(len(down))})


def test_a_layer_may_store_gate_up_3d_and_down_per_expert(tiny, tmp_path):
    """Each 3-D tensor is converted on its own, as stock transformers converts each per-expert projection on its own:
    such a checkpoint loads like stock and saves back exactly as it came."""
    path = _rewrite(tiny("qwen2_moe_3d").path, tmp_path / "mixed", _down_per_expert)
    model = modelpatch.from_pretrained(AutoModelForCausalLM, path, fusion_config=FUSION)
    stock = AutoModelForCausalLM.from_pretrained(path)
    assert_outputs_close(tiny("qwen2_moe_3d").outputs(model), tiny("qwen2_moe_3d").outputs(stock))
    modelpatch.save_pretrained(model, tmp_path / "saved")
    assert_same_files(tmp_path / "saved", path)


def _both_layouts(tensors):
    gate_up, down = tensors[f"{EXPERTS_0}.gate_up_proj"], tensors[f"{EXPERTS_0}.down_proj"]
    gate, up = gate_up.chunk(2, dim=1)
    for i in range(len(gate_up)):
        tensors[f"{EXPERTS_0}.{i}.gate_proj.weight"] = gate[i].clone()
        tensors[f"{EXPERTS_0}.{i}.up_proj.weight"] = up[i].clone()
        tensors[f"{EXPERTS_0}.{i}.down_proj.weight"] = down[i].clone()


def _one_more_expert(tensors):
    for key in (f"{EXPERTS_1}.gate_up_proj", f"{EXPERTS_1}.down_proj"):
        tensors[key] = torch.cat([tensors[key], tensors[key][:1]])


def _odd_gate_up_rows(tensors):
    tensors[f"{EXPERTS_1}.gate_up_proj"] = tensors[f"{EXPERTS_1}.gate_up_proj"][:, 1:].clone()


def _wrong_intermediate_size(tensors):
    tensors[f"{EXPERTS_1}.down_proj"] = tensors[f"{EXPERTS_1}.down_proj"][..., 1:].clone()


# case: (edit, problem kinds, what the message must name)
REFUSED = {
    "both layouts for one layer": (
        _both_layouts,
        ["duplicate keys"],
        [
            f"{EXPERTS_0}.gate_up_proj",
            f"{EXPERTS_0}.down_proj",
            f"{EXPERTS_0}.0.gate_proj.weight",
            f"{EXPERTS_0}.3.up_proj.weight",
            f"{EXPERTS_0}.2.down_proj.weight",
        ],
    ),
    "more experts than the model": (
        _one_more_expert,
        ["conversion errors", "missing from the checkpoint"],
        [f"{EXPERTS_1}.gate_up_proj", f"{EXPERTS_1}.down_proj", "expected 4 entries along dim 0"],
    ),
    "gate_up rows that do not halve": (
        _odd_gate_up_rows,
        ["conversion errors", "missing from the checkpoint"],
        [f"{EXPERTS_1}.gate_up_proj", "does not split into 2 equal parts", f"{EXPERTS_1}.{{0..3}}.gate_proj.weight"],
    ),
    "wrong intermediate size": (
        _wrong_intermediate_size,
        ["shape mismatches"],
        [f"{EXPERTS_1}.down_proj", f"{EXPERTS_1}.{{0..3}}.down_proj.weight", "[32, 15]", "[32, 16]"],
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_misfit_3d_checkpoints_are_refused_at_plan_time(tiny, tmp_path, case):
    edit, kinds, needles = REFUSED[case]
    path = _rewrite(tiny("qwen2_moe_3d").path, tmp_path / "broken", edit)
    # plan_pretrained reads headers only: the same error comes from the plan, before any tensor data.
    with pytest.raises(LoadPlanError) as planned:
        modelpatch.plan_pretrained(AutoModelForCausalLM, path, fusion_config=FUSION)
    with pytest.raises(LoadPlanError) as loaded:
        modelpatch.from_pretrained(AutoModelForCausalLM, path, fusion_config=FUSION)
    assert loaded.value.problems == planned.value.problems
    assert sorted(loaded.value.problems) == kinds
    message = str(loaded.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in:\n{message}"


# Routed and shared experts from the first layer on (DeepSeek's keywords, which GLM-4-MoE and dots1 share); DeepSeek
# adds its multi-head latent attention and one expert group.
_ROUTED = dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=0, moe_intermediate_size=16)
_LATENT_ATTENTION = dict(qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, kv_lora_rank=16, q_lora_rank=16)
_DEEPSEEK = dict(_ROUTED, **_LATENT_ATTENTION, n_group=1, topk_group=1)
# Other MoE families transformers 5.23 maps, as tiny configs; their experts are the same 3-D module shape.
MORE_MOE = {
    "deepseek_v3": dict(_DEEPSEEK, head_dim=8),
    "deepseek_v2": _DEEPSEEK,
    "glm4_moe": dict(_ROUTED, head_dim=8),
    "dots1": dict(_ROUTED, head_dim=8),
    "hunyuan_v1_moe": dict(num_experts=4, moe_intermediate_size=16, head_dim=8),
    "phimoe": dict(num_local_experts=4),
    "minimax": dict(num_local_experts=4, head_dim=8),
    "ernie4_5_moe": dict(moe_num_experts=4, moe_intermediate_size=16, head_dim=8),
    "granitemoe": dict(num_local_experts=4),
}


@pytest.mark.parametrize("model_type", sorted(MORE_MOE))
def test_more_moe_families_load_3d_experts_and_save_them_back(model_type, tmp_path):
    moe = {
        "num_experts_per_tok": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
        **MORE_MOE[model_type],
    }
    config = sized_config(model_type, vocab=64, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=4, **moe)
    torch.manual_seed(0)
    stock_model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in stock_model.named_parameters():
            param.add_(torch.randn_like(param) * (1.0 if name.endswith("gate.weight") else 0.05))
    stock_model.save_pretrained(tmp_path / "3d", save_original_format=False)
    assert any(key.endswith("experts.gate_up_proj") for key in checkpoint_shapes(tmp_path / "3d"))

    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "3d")
    fused = modelpatch.from_pretrained(AutoModelForCausalLM, tmp_path / "3d", fusion_config=FUSION)
    experts = sum(isinstance(getattr(m, "gate_up_proj", None), torch.nn.Parameter) for m in stock.modules())
    assert experts > 0 and sum(isinstance(m, LinearExperts) for m in fused.modules()) == experts
    ids = torch.randint(0, 60, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, stock(ids).logits, atol=1e-5, rtol=0)
    modelpatch.save_pretrained(fused, tmp_path / "saved")
    assert_same_files(tmp_path / "saved", tmp_path / "3d")
