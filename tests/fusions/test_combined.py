"""Families combined in one load, ``from_config`` with fusions, and fused models through pickle / deepcopy."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys

import pytest
import torch
from fusion_models import (
    assert_outputs_close,
    assert_outputs_equal,
    check_fused_roundtrip,
    checkpoint_shapes,
    module_types,
)
from transformers import Qwen2MoeForCausalLM

import modelpatch
from modelpatch.conversion.planner import TensorMeta, plan_save
from modelpatch.fusions.apply import prepare_fusions, resolve_fusion_config
from modelpatch.fusions.linear_experts.modules import LinearExperts
from modelpatch.fusions.patch_embeddings.modules import Conv3dAsLinear
from modelpatch.fusions.projections import FusedLinear
from modelpatch.loading.build import build_empty_model

COMBINATIONS = [
    ("qwen2_moe", {"qkv": True, "gate_up": True, "linear_experts": True}),
    ("qwen3_moe", {"qkv": True, "linear_experts": True}),
    ("mixtral", {"qkv": True, "linear_experts": True}),
    ("olmoe", {"qkv": True, "linear_experts": True}),
    ("llama", {"qkv": True, "gate_up": True}),
    ("qwen2_vl", {"patch_embeddings": True, "qkv": True, "gate_up": True}),
    # Qwen2.5-VL's vision MLP is gated too, with biases: gate_up fuses it as well as the text MLP.
    ("qwen2_5_vl", {"patch_embeddings": True, "qkv": True, "gate_up": True}),
    ("qwen3_vl", {"patch_embeddings": True, "qkv": True}),
]
ALL_TEXT = {"qkv": True, "gate_up": True, "linear_experts": True}


@pytest.mark.parametrize("name, fusion_config", COMBINATIONS, ids=[c[0] for c in COMBINATIONS])
def test_families_combine(tiny, tmp_path, name, fusion_config):
    check_fused_roundtrip(tiny(name), fusion_config, tmp_path)


def test_every_family_is_applied_in_one_load(tiny):
    model = tiny("qwen2_moe").load(ALL_TEXT)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, FusedLinear)
    assert isinstance(layer.mlp.shared_expert.gate_up_proj, FusedLinear)
    assert isinstance(layer.mlp.experts, LinearExperts)
    assert sorted(model.config.modelpatch["fusion_config"]) == ["gate_up", "linear_experts", "qkv"]

    vlm = tiny("qwen2_5_vl").load({"patch_embeddings": True, "qkv": True, "gate_up": True})
    assert isinstance(vlm.model.visual.patch_embed.proj, Conv3dAsLinear)
    assert isinstance(vlm.model.visual.blocks[0].mlp.gate_up_proj, FusedLinear)
    assert vlm.model.visual.blocks[0].mlp.gate_up_proj.bias is not None
    assert isinstance(vlm.model.language_model.layers[0].self_attn.qkv_proj, FusedLinear)


# --- from_config --------------------------------------------------------------------------------------------------


def _fresh(name, tiny, fusion_config):
    torch.manual_seed(0)
    config = tiny(name).stock().config
    return modelpatch.from_config(tiny(name).model_class, config, fusion_config=fusion_config)


def test_from_config_builds_fused_classes(tiny, tmp_path):
    model = _fresh("qwen2_moe", tiny, ALL_TEXT)
    layer = model.model.layers[1]
    assert isinstance(layer.self_attn.qkv_proj, FusedLinear) and layer.self_attn.qkv_proj.part_sizes == (32, 16, 16)
    assert isinstance(layer.mlp.shared_expert.gate_up_proj, FusedLinear)
    assert isinstance(layer.mlp.experts, LinearExperts) and len(layer.mlp.experts) == 4
    assert model.config.modelpatch["fusion_config"] == ALL_TEXT
    assert not hasattr(tiny("qwen2_moe").stock().config, "modelpatch")  # the caller's config is not modified
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()

    # Runtime layout: reloads as the same fused model.
    modelpatch.save_pretrained(model, tmp_path / "runtime", save_original_format=False)
    reloaded = modelpatch.from_pretrained(Qwen2MoeForCausalLM, tmp_path / "runtime")
    assert module_types(reloaded) == module_types(model)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, logits)

    vlm = _fresh("qwen2_vl", tiny, {"patch_embeddings": True})
    assert isinstance(vlm.model.visual.patch_embed.proj, Conv3dAsLinear)


@pytest.mark.parametrize(
    "name, fusion_config",
    [("llama", {"qkv": True, "gate_up": True}), ("qwen2_vl", {"patch_embeddings": True})],
)
def test_fusion_transforms_reverse_without_a_load(tiny, name, fusion_config):
    """The fusion's transforms declare their sizes (q/k/v rows, the Conv3d kernel), so a model that never went through
    a load can be mapped back to the checkpoint layout."""
    ckpt = tiny(name)
    model = _fresh(name, tiny, fusion_config)
    unfused = build_empty_model(ckpt.model_class, copy.deepcopy(model.config), torch.float32, [])
    prepared = prepare_fusions(unfused, model.config, resolve_fusion_config(model.config, None), [])
    runtime = {k: TensorMeta(tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    plan = plan_save(runtime, prepared.adjust_conversions(modelpatch.loading.load.model_conversions(model)))
    plan.raise_problems()
    saved = {k: runtime[v].shape for k, v in plan.direct.items()}
    saved.update({k: tuple(v.shape) for k, v in plan.outputs.items()})
    assert saved == checkpoint_shapes(ckpt.path)


@pytest.mark.parametrize(
    "name, fusion_config",
    [("llama", {"qkv": True, "gate_up": True}), ("qwen2_moe", ALL_TEXT), ("qwen2_vl", {"patch_embeddings": True})],
)
def test_from_config_saves_in_checkpoint_layout(tiny, tmp_path, name, fusion_config):
    """A model that was never loaded saves in the layout a stock save of the same config has (the fusions declared
    their sizes), and loads back without fusions to the same outputs."""
    ckpt = tiny(name)
    model = _fresh(name, tiny, fusion_config)
    modelpatch.save_pretrained(model, tmp_path / "saved")
    assert checkpoint_shapes(tmp_path / "saved") == checkpoint_shapes(ckpt.path)
    unfused = ckpt.load({}, path=tmp_path / "saved")
    assert not any(type(m).__module__.startswith("modelpatch") for m in unfused.modules())
    assert_outputs_close(ckpt.outputs(unfused), ckpt.outputs(model))


# --- pickle / deepcopy --------------------------------------------------------------------------------------------


def test_pickle_and_deepcopy(tiny):
    ckpt = tiny("qwen2_moe")
    model = ckpt.load(ALL_TEXT)
    expected = ckpt.outputs(model)
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert module_types(clone) == module_types(model)
        assert_outputs_equal(ckpt.outputs(clone), expected)
        attention = clone.model.layers[0].self_attn
        assert attention.q_proj.fused is attention.qkv_proj  # the slices follow their own copy of the fused layer
        assert attention.qkv_proj.weight.data_ptr() != model.model.layers[0].self_attn.qkv_proj.weight.data_ptr()


def test_unpickles_in_a_fresh_process(tiny, tmp_path):
    """Generated classes live in modelpatch.fusions.generated; a fresh interpreter has not generated them yet."""
    ckpt = tiny("qwen2_vl")
    model = ckpt.load({"patch_embeddings": True, "qkv": True, "gate_up": True})
    expected = ckpt.outputs(model)
    (tmp_path / "model.pkl").write_bytes(pickle.dumps(model))
    script = (
        "import pickle, sys, torch\n"
        "model = pickle.loads(open(sys.argv[1], 'rb').read())\n"
        "g = torch.Generator().manual_seed(0)\n"
        "ids = torch.randint(0, 56, (2, 12), generator=g)\n"
        "pixels = torch.randn(16, 1176, generator=g)\n"
        "with torch.no_grad():\n"
        "    out = {'logits': model(input_ids=ids).logits,\n"
        "           'vision': model.model.visual(pixels, grid_thw=torch.tensor([[1, 4, 4]])).last_hidden_state}\n"
        "out['classes'] = sorted({type(m).__module__ + '.' + type(m).__name__ for m in model.modules()})\n"
        "torch.save(out, sys.argv[2])\n"
    )
    subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "model.pkl"), str(tmp_path / "out.pt")],
        check=True,
        capture_output=True,
        timeout=120,
    )
    out = torch.load(tmp_path / "out.pt")
    assert "modelpatch.fusions.generated.PatchLinearPatchEmbed" in out["classes"]
    assert "modelpatch.fusions.generated.QKVFusedQwen2VLAttention" in out["classes"]
    assert torch.equal(out["logits"], expected["logits"])
    assert torch.equal(out["vision"], expected["vision"])


def test_outputs_close_to_stock_after_pickle(tiny):
    ckpt = tiny("mixtral")
    model = pickle.loads(pickle.dumps(ckpt.load({"qkv": True, "linear_experts": True})))
    assert_outputs_close(ckpt.outputs(model), ckpt.stock_outputs())


# --- Saving a modified fused model -------------------------------------------------------------------------------


def test_trained_weights_are_saved_back_in_the_checkpoint_layout(tiny, tmp_path):
    """Saving reverses the conversions on the *current* weights: change every fused parameter, save, load without
    fusions, and get the changed model's outputs."""
    ckpt = tiny("qwen2_moe")
    model = ckpt.load(ALL_TEXT)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "qkv_proj" in name or "gate_up_proj" in name or ".experts." in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    modelpatch.save_pretrained(model, tmp_path / "trained")
    assert checkpoint_shapes(tmp_path / "trained") == checkpoint_shapes(ckpt.path)
    unfused = ckpt.load({}, path=tmp_path / "trained")
    assert not any(type(m).__module__.startswith("modelpatch") for m in unfused.modules())
    changed = ckpt.outputs(model)
    assert (changed["logits"] - ckpt.stock_outputs()["logits"]).abs().max() > 1e-3
    assert_outputs_close(ckpt.outputs(unfused), changed)


def test_stock_transformers_loads_a_default_format_save(tiny, tmp_path):
    # In a subprocess: stock transformers' own fusion stays registered process-wide once a load has used it.
    ckpt = tiny("qwen2_vl")
    modelpatch.save_pretrained(ckpt.load({"patch_embeddings": True}), tmp_path / "saved")
    script = (
        "import sys, torch\n"
        "from transformers import Qwen2VLForConditionalGeneration as M\n"
        "pixels = torch.randn(16, 1176, generator=torch.Generator().manual_seed(0))\n"
        "grid = torch.tensor([[1, 4, 4]])\n"
        "with torch.no_grad():\n"
        "    out = [M.from_pretrained(p).model.visual(pixels, grid_thw=grid).last_hidden_state for p in sys.argv[1:]]\n"
        "print((out[0] - out[1]).abs().max().item())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(ckpt.path), str(tmp_path / "saved")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout.split()[-1]) <= 1e-5
