"""The load's shortcuts change nothing observable: meta builds skip parameter initialisation only for meta tensors
inside modelpatch builds, finalisation skips only loaded modules, and fusion discovery reuses the loader's build."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

import modelpatch
import modelpatch.loading.load as load_module
from modelpatch.loading.build import build_empty_model
from support.stock_checkpoints import assert_tensors_identical

SRC = Path(modelpatch.__file__).parent


def _normal(seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.nn.init.normal_(torch.empty(4, 4))


def test_init_functions_behave_as_torch_outside_builds(stock_checkpoint):
    before = _normal(7)
    config = AutoConfig.from_pretrained(stock_checkpoint("llama").path)
    model = build_empty_model(LlamaForCausalLM, config, torch.float32, [])
    assert model.lm_head.weight.is_meta
    # A real tensor is filled, from the same random stream as before any build.
    assert torch.equal(_normal(7), before)
    # A meta tensor outside a build gets torch's own function, with its checks.
    with pytest.raises(ValueError, match="fewer than 2 dimensions"):
        torch.nn.init.kaiming_uniform_(torch.empty(3, device="meta"))


def test_real_tensors_are_initialised_inside_builds(stock_checkpoint):
    """``from_config`` builds inside a modelpatch build with real tensors: initialised exactly as stock's."""
    config = AutoConfig.from_pretrained(stock_checkpoint("llama").path)
    torch.manual_seed(3)
    stock = AutoModelForCausalLM.from_config(config)
    torch.manual_seed(3)
    mine = modelpatch.from_config(AutoModelForCausalLM, config)
    assert_tensors_identical(mine.state_dict(), stock.state_dict())


def test_fully_loaded_model_initialises_only_its_buffers_like_stock(stock_checkpoint):
    ckpt = stock_checkpoint("llama")
    stock = ckpt.model_class.from_pretrained(ckpt.path)
    mine = modelpatch.from_pretrained(ckpt.model_class, ckpt.path)
    assert_tensors_identical(mine.state_dict(), stock.state_dict())
    for name, buffer in stock.named_buffers():
        assert torch.equal(mine.get_buffer(name), buffer), name
    assert all(getattr(m, "_is_hf_initialized", False) for m in mine.modules())


@pytest.fixture
def build_count(monkeypatch):
    """How many meta builds ``from_pretrained`` makes (the loader's own build function, counted)."""
    calls = []
    build = load_module.build_empty_model_patched

    def counting(*args, **kwargs):
        calls.append(args[0])
        return build(*args, **kwargs)

    monkeypatch.setattr(load_module, "build_empty_model_patched", counting)
    return calls


@pytest.mark.parametrize(
    "fusion_config, builds",
    [(None, 1), ({"patch_embeddings": True}, 1), ({"qkv": True, "gate_up": True}, 2)],
    ids=["no fusion", "nothing to fuse", "fused"],
)
def test_discovery_reuses_the_loader_build(stock_checkpoint, build_count, fusion_config, builds):
    """One build without fusions (discovery's, kept when nothing is fused), one more only for the fused model."""
    ckpt = stock_checkpoint("llama")
    model = modelpatch.from_pretrained(ckpt.model_class, ckpt.path, fusion_config=fusion_config)
    assert len(build_count) == builds
    stock = ckpt.model_class.from_pretrained(ckpt.path)
    inputs = ckpt.inputs()
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, stock(**inputs).logits)
    if builds == 1:
        assert_tensors_identical(model.state_dict(), stock.state_dict())


PIPELINES = {"loading", "saving", "modes", "boundary", "restructuring"}


def test_fusions_do_not_import_loading():
    """Layers import downwards only: fusion discovery gets its model from the loader."""
    for path in (SRC / "fusions").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = "." * node.level + (node.module or "")
                assert not PIPELINES & set(module.split(".")), f"{path.relative_to(SRC)} imports {module}"
            elif isinstance(node, ast.Import):
                assert not any(set(a.name.split(".")) & PIPELINES for a in node.names), path
