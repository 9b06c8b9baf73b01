"""Classes patched where modeling code constructs them, as transformers' own ``apply_patches`` patches them.

* A modeling class constructed with no arguments (``BloomGelu()`` in Bloom's MLP, ``MultiScaleDeformableAttention()``
  in the deformable-DETR family) is replaced, while copies and unpickling (which also call ``__new__`` without
  arguments) keep their class.
* A class that is no candidate (``torch.nn.LayerNorm``) is replaced where a modeling module that imports it by name
  (``from torch.nn import LayerNorm`` in Qwen2-VL) constructs it, and nowhere else.
"""

from __future__ import annotations

import copy
import pickle

import torch
from torch import nn
from torch.nn import functional as F
from transformers import (
    BertModel,
    BloomConfig,
    BloomForCausalLM,
    PretrainedConfig,
    Qwen2VLForConditionalGeneration,
)
from transformers.models.bloom.modeling_bloom import BloomGelu

from support.models import VOCAB, tiny_config
from support.patching import build, input_ids, module_classes, patched_build


class TanhGelu(nn.Module):
    """Not a BloomGelu: the same tanh-approximated GELU through torch's own kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")


class MarkedLayerNorm(nn.LayerNorm):
    """Same math as torch's LayerNorm."""


def _bloom_config() -> BloomConfig:
    return BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)


def _qwen2_vl_config() -> PretrainedConfig:
    return tiny_config("qwen2_vl", text={"num_hidden_layers": 1}, vision={"depth": 2})


def test_a_class_modeling_code_constructs_without_arguments_is_replaced():
    config = _bloom_config()
    with patched_build(BloomForCausalLM, config, {"BloomGelu": TanhGelu}) as (reference, patched):
        # Copies made inside the scope call __new__ without arguments too, from copy's own code: untouched.
        copied = copy.deepcopy(reference)
        unpickled = pickle.loads(pickle.dumps(reference))
        direct = BloomGelu()  # not modeling code: as with transformers' apply_patches, the class itself
    assert {type(block.mlp.gelu_impl) for block in patched.transformer.h} == {TanhGelu}
    assert BloomGelu not in module_classes(patched)
    for clone in (copied, unpickled):
        assert {type(block.mlp.gelu_impl) for block in clone.transformer.h} == {BloomGelu}
    assert type(direct) is BloomGelu
    assert {type(block.mlp.gelu_impl) for block in build(BloomForCausalLM, config).transformer.h} == {BloomGelu}

    patched.load_state_dict(reference.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(patched(input_ids(VOCAB)).logits, reference(input_ids(VOCAB)).logits)


def test_a_torch_class_a_modeling_module_imports_by_name_is_replaced_there_only():
    config = _qwen2_vl_config()
    with patched_build(Qwen2VLForConditionalGeneration, config, {"^LayerNorm$": MarkedLayerNorm}) as (
        reference,
        patched,
    ):
        # BERT's modeling module calls nn.LayerNorm(...) (no name imported): untouched, like a direct construction.
        bert = BertModel(tiny_config("bert", num_hidden_layers=1))
        direct = nn.LayerNorm(8)
    visual = patched.model.visual
    assert {type(block.norm1) for block in visual.blocks} == {MarkedLayerNorm}
    assert {type(block.norm2) for block in visual.blocks} == {MarkedLayerNorm}
    assert type(visual.merger.ln_q) is MarkedLayerNorm
    assert nn.LayerNorm not in module_classes(patched)
    assert type(bert.embeddings.LayerNorm) is nn.LayerNorm and type(direct) is nn.LayerNorm
    assert MarkedLayerNorm not in module_classes(build(Qwen2VLForConditionalGeneration, config))

    patched.load_state_dict(reference.state_dict())
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(16, 3 * 2 * 14 * 14, generator=generator)
    grid = torch.tensor([[1, 4, 4]])
    with torch.no_grad():
        expected = reference.model.visual(pixels, grid_thw=grid).pooler_output
        torch.testing.assert_close(visual(pixels, grid_thw=grid).pooler_output, expected, rtol=0, atol=0)
