"""transformers' own patch registry never takes part in a modelpatch build.

``PreTrainedModel.get_init_context`` and ``_from_config`` (which composite models such as Qwen2-VL call for their
sub-models from their own ``__init__``) enter transformers' global ``apply_patches()``. Left in, a patch registered
with *transformers'* ``register_patch_mapping`` would silently replace classes in modelpatch loads, and a single stock
``fusion_config`` load (which registers its fused class there for good) would break every later modelpatch load of
the process.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Qwen2VLForConditionalGeneration,
    conversion_mapping,
    fusion_mapping,
    monkey_patching,
)
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.qwen2_vl.modeling_qwen2_vl import PatchEmbed

import modelpatch
from support.checkpoints import perturb
from support.models import tiny_config

pytestmark = pytest.mark.reliability


def stock_from_pretrained(model_class, *args, **kwargs):
    """Stock ``from_pretrained`` while transformers' patch registry holds entries. Older releases of the supported
    range apply them by importing every transformers module, some of which need optional packages (torchvision):
    without those, stock itself cannot load, so there is no scenario to compare against."""
    try:
        return model_class.from_pretrained(*args, **kwargs)
    except ModuleNotFoundError as exc:
        pytest.skip(f"stock transformers cannot apply its own patch registry here: {exc}")


class ZeroMLP(LlamaMLP):
    """Loads LlamaMLP's weights, and computes nothing: a model built with it gives other logits."""

    def forward(self, x):
        return torch.zeros_like(x)


# transformers' process-wide registries a test here may change. Which exist depends on the transformers release (the
# fusion registry's caches are recent): those a release lacks are skipped.
_REGISTRIES = (
    (monkey_patching, "_monkey_patch_mapping_cache"),
    (conversion_mapping, "_checkpoint_conversion_mapping_cache"),
    (conversion_mapping, "USER_REGISTERED_MAPPINGS"),
    (fusion_mapping, "_FUSION_DISCOVERY_CACHE"),
    (fusion_mapping, "_REGISTERED_FUSION_SOURCE_PATTERNS"),
)


@pytest.fixture
def transformers_registries():
    """Restore transformers' process-wide patch, conversion and fusion registries after the test."""
    saved = [(module, name, copy.copy(getattr(module, name))) for module, name in _REGISTRIES if hasattr(module, name)]
    yield
    monkey_patching.clear_patch_mapping()
    for module, name, value in saved:
        current = getattr(module, name)
        if value is None or current is None:
            setattr(module, name, value)
        else:
            current.clear()
            current.update(value)


def test_a_patch_registered_with_transformers_is_not_applied_by_modelpatch_loads(stock, transformers_registries):
    llama = stock("llama")
    expected = llama.reference_logits()
    monkey_patching.register_patch_mapping({"LlamaMLP": ZeroMLP})

    model = modelpatch.from_pretrained(AutoModelForCausalLM, llama.path)
    assert {type(layer.mlp) for layer in model.model.layers} == {LlamaMLP}
    with torch.no_grad():
        torch.testing.assert_close(model(**llama.inputs()).logits, expected, rtol=0, atol=0)
    fresh = modelpatch.from_config(AutoModelForCausalLM, model.config)
    assert {type(layer.mlp) for layer in fresh.model.layers} == {LlamaMLP}
    # modelpatch's own registry still applies, alone.
    modelpatch.register_patch_mapping({"LlamaMLP": ZeroMLP})
    assert type(modelpatch.from_pretrained(AutoModelForCausalLM, llama.path).model.layers[0].mlp) is ZeroMLP


def test_a_stock_fused_load_does_not_break_later_modelpatch_loads(tmp_path, transformers_registries):
    config = tiny_config("qwen2_vl", text={"num_hidden_layers": 1})
    torch.manual_seed(0)
    source = Qwen2VLForConditionalGeneration(config)
    perturb(source, seed=3)
    source.save_pretrained(tmp_path)
    pixels = torch.randn(16, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1))
    grid = torch.tensor([[1, 4, 4]])

    def vision(model):
        with torch.no_grad():
            return model.model.visual(pixels, grid_thw=grid).pooler_output

    expected = vision(Qwen2VLForConditionalGeneration.from_pretrained(tmp_path).eval())
    # Stock transformers' own fused load registers its fused PatchEmbed in transformers' patch registry, for good.
    stock_from_pretrained(Qwen2VLForConditionalGeneration, tmp_path, fusion_config={"patch_embeddings": True})
    assert monkey_patching.get_patch_mapping()

    model = modelpatch.from_pretrained(Qwen2VLForConditionalGeneration, tmp_path)
    assert type(model.model.visual.patch_embed) is PatchEmbed
    torch.testing.assert_close(vision(model), expected, rtol=0, atol=0)
    fused = modelpatch.from_pretrained(
        Qwen2VLForConditionalGeneration, tmp_path, fusion_config={"patch_embeddings": True}
    )
    assert type(fused.model.visual.patch_embed).__module__ == "modelpatch.fusions.generated"
    torch.testing.assert_close(vision(fused), expected, atol=1e-5, rtol=1e-5)


def test_transformers_registry_still_works_outside_modelpatch_builds(stock, transformers_registries):
    llama = stock("llama")
    monkey_patching.register_patch_mapping({"LlamaMLP": ZeroMLP})
    modelpatch.from_pretrained(AutoModelForCausalLM, llama.path)
    assert monkey_patching.get_patch_mapping() == {"LlamaMLP": ZeroMLP}
    stock_model = stock_from_pretrained(AutoModelForCausalLM, llama.path)
    assert type(stock_model.model.layers[0].mlp) is ZeroMLP
