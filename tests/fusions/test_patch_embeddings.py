"""``patch_embeddings``: a Conv3d whose kernel equals its stride (no padding, dilation 1, groups 1) runs as an
``nn.Linear`` over the flattened patch. Qwen2-VL in both key layouts, Qwen2.5-VL and Qwen3-VL (whose Conv3d has a
bias) are loaded from stock-saved checkpoints and compared with the unfused stock model."""

from __future__ import annotations

import pytest
import torch
from fusion_models import check_fused_roundtrip, checkpoint_shapes
from torch import nn
from torch.nn import functional as F

import modelpatch
from modelpatch.fusions import PatchEmbeddingsFusionSpec
from modelpatch.fusions.apply import discover
from modelpatch.fusions.patch_embeddings.modules import Conv3dAsLinear, is_patch_conv
from modelpatch.fusions.registry import get_fusion

VLMS = ["qwen2_vl", "qwen2_vl_runtime", "qwen2_5_vl", "qwen3_vl"]


# --- The fused module against the convolution ---------------------------------------------------------------------


def _conv(in_channels=3, out_channels=40, kernel=(2, 14, 14), bias=True, seed=0, **kwargs) -> nn.Conv3d:
    torch.manual_seed(seed)
    return nn.Conv3d(in_channels, out_channels, kernel, stride=kwargs.pop("stride", kernel), bias=bias, **kwargs)


@pytest.mark.parametrize(
    "in_channels, kernel, bias",
    [(3, (2, 14, 14), False), (3, (2, 16, 16), True), (1, (1, 4, 4), True), (4, (3, 2, 5), False)],
)
def test_linear_matches_conv3d_on_patches(in_channels, kernel, bias):
    conv = _conv(in_channels, 40, kernel, bias)
    fused = Conv3dAsLinear(conv)
    assert isinstance(fused, nn.Linear)
    assert (fused.in_features, fused.out_features) == (in_channels * kernel[0] * kernel[1] * kernel[2], 40)
    # The kernel flattened in (C, T, H, W) order: exactly the conversion a checkpoint goes through.
    assert torch.equal(fused.weight, conv.weight.reshape(40, -1))
    patches = torch.randn(257, in_channels, *kernel)
    with torch.no_grad():
        expected = F.conv3d(patches, conv.weight, conv.bias, stride=kernel)
        actual = fused(patches)
    assert actual.shape == expected.shape == (257, 40, 1, 1, 1)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "shape",
    [
        (2, 3, 4, 28, 42),  # several patches per sample
        (1, 3, 2, 14, 15),  # a ragged edge the convolution drops
        (3, 4, 28, 28),  # unbatched input
    ],
)
def test_falls_back_to_the_convolution_for_other_inputs(shape):
    conv = _conv(3, 16, (2, 14, 14), bias=True)
    fused = Conv3dAsLinear(conv)
    x = torch.randn(shape)
    with torch.no_grad():
        expected = conv(x)
        actual = fused(x)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


def test_built_on_meta_without_copying():
    with torch.device("meta"):
        conv = nn.Conv3d(3, 8, (2, 14, 14), stride=(2, 14, 14), bias=False)
    fused = Conv3dAsLinear(conv)
    assert fused.weight.device.type == "meta" and fused.weight.shape == (8, 1176) and fused.bias is None


@pytest.mark.parametrize(
    "conv, qualifies",
    [
        (_conv(), True),
        (_conv(bias=False), True),
        (_conv(padding=1), False),
        (_conv(stride=(1, 14, 14)), False),  # stride != kernel: overlapping patches
        (_conv(stride=(2, 7, 7)), False),
        (_conv(dilation=2), False),
        (_conv(in_channels=4, out_channels=8, groups=2), False),
        (nn.Conv2d(3, 8, 14, stride=14), False),
        (type("MyConv3d", (nn.Conv3d,), {})(3, 8, (2, 14, 14), stride=(2, 14, 14)), False),  # custom forward
    ],
    ids=["plain", "no-bias", "padding", "stride-t", "stride-hw", "dilation", "groups", "conv2d", "subclass"],
)
def test_which_convolutions_qualify(conv, qualifies):
    assert is_patch_conv(conv) is qualifies


class _Embed(nn.Module):
    def __init__(self, **conv_kwargs):
        super().__init__()
        self.proj = _conv(**conv_kwargs)


class PatchEmbed(_Embed):
    def __init__(self):
        super().__init__()


class PaddedPatchEmbed(_Embed):
    def __init__(self):
        super().__init__(padding=(0, 1, 1))


class OverlappingPatchEmbed(_Embed):
    def __init__(self):
        super().__init__(stride=(2, 7, 7))


def test_non_qualifying_convolutions_are_not_fused():
    tower = nn.ModuleDict({"a": PatchEmbed(), "b": PaddedPatchEmbed(), "c": OverlappingPatchEmbed()})
    found = discover(tower, {"patch_embeddings": PatchEmbeddingsFusionSpec()})
    assert list(found.mapping) == ["PatchEmbed"]
    assert list(found.modules["patch_embeddings"]) == ["a"]


# --- Vision-language models ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", VLMS)
def test_matches_stock_and_saves_back(tiny, tmp_path, name):
    """Vision tower outputs within 1e-5, text logits too; saves bitwise in the layout the checkpoint has."""
    check_fused_roundtrip(tiny(name), {"patch_embeddings": True}, tmp_path)


@pytest.mark.parametrize("name", VLMS)
def test_the_kernel_is_converted_not_reinitialised(tiny, name):
    ckpt = tiny(name)
    stock_proj = ckpt.stock().model.visual.patch_embed.proj
    patch_embed = ckpt.load({"patch_embeddings": True}).model.visual.patch_embed
    assert type(patch_embed).__module__ == "modelpatch.fusions.generated"
    assert isinstance(patch_embed, type(ckpt.stock().model.visual.patch_embed))
    assert isinstance(patch_embed.proj, Conv3dAsLinear)
    assert torch.equal(patch_embed.proj.weight, stock_proj.weight.reshape(stock_proj.out_channels, -1))
    if stock_proj.bias is not None:
        assert torch.equal(patch_embed.proj.bias, stock_proj.bias)
    else:
        assert patch_embed.proj.bias is None


@pytest.mark.parametrize("name, key", [("qwen2_vl", "visual."), ("qwen2_vl_runtime", "model.visual.")])
def test_both_qwen2_vl_key_layouts(tiny, tmp_path, name, key):
    """The published layout (visual.*, model.layers.*) and 5.23's runtime one (model.visual.*,
    model.language_model.*): the checkpoint stores a 5-D kernel, the runtime-format save a 2-D weight."""
    ckpt = tiny(name)
    assert checkpoint_shapes(ckpt.path)[f"{key}patch_embed.proj.weight"] == (32, 3, 2, 14, 14)
    model = ckpt.load({"patch_embeddings": True})
    out = tmp_path / "runtime"
    modelpatch.save_pretrained(model, out, save_original_format=False)
    assert checkpoint_shapes(out)["model.visual.patch_embed.proj.weight"] == (32, 1176)


@pytest.mark.parametrize(
    ("conv", "words"),
    [
        (nn.Conv3d(3, 8, (2, 4, 4), stride=(2, 4, 4)), None),
        (nn.Conv3d(3, 8, (2, 4, 4), stride=(1, 4, 4)), "stride"),
        (nn.Conv3d(3, 8, (2, 4, 4), stride=(2, 4, 4), padding=1), "padding"),
        (nn.Conv3d(3, 9, (2, 4, 4), stride=(2, 4, 4), groups=3, bias=False), "groups"),
        (nn.Conv2d(3, 8, 4, stride=4), "no Conv3d"),
    ],
)
def test_unfusable_reason_names_what_is_not_a_patch_tiling(conv, words):
    """Only a Conv3d that tiles its input into non-overlapping patches runs as a Linear; for any other the family
    says what differs (discovery reports it with the module left as it is)."""
    holder = nn.Module()
    holder.proj = conv
    spec = get_fusion("patch_embeddings")
    reason = spec.unfusable_reason(holder)
    assert spec.is_fusable(holder) is (words is None)
    assert reason is None if words is None else words in reason, reason
