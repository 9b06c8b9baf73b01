"""fp8 routes on fused (``qkv``, ``gate_up``) and ``linear_experts`` models, side by side with stock transformers.

Three fp8 routes users take, as far as each runs on the CPU:

* transformers' ``FineGrainedFP8Config`` at load (block-wise fp8 kept in float8 by its ``FP8Linear``) needs a GPU, in
  stock as in modelpatch: refused with stock's reason before any tensor is read, fused models included;
* a block-fp8 checkpoint (``quant_method: "fp8"``, DeepSeek / Qwen FP8): stock dequantizes it on the CPU; modelpatch
  does the same, then fuses the dequantized weights, so the fused model computes what stock's computes;
* llm-compressor's ``FP8_DYNAMIC`` checkpoint (compressed-tensors' float-quantized format), saved from a fused model:
  stock loads it, modelpatch loads it unfused as stock does, and refuses a fused load of it by name.

torchao's fp8 (``Float8WeightOnlyConfig``) is a torchao route: tests/quantization/test_torchao_routes.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, FineGrainedFP8Config

import modelpatch
from modelpatch.checkpoint import Checkpoint
from modelpatch.errors import LoadPlanError, SaveError
from modelpatch.modes.quantization import quantizer_api_supported
from support.compare import assert_bitwise_equal
from support.quantized import fp8_checkpoints, fp8_config

pytestmark = pytest.mark.skipif(
    not quantizer_api_supported(),
    reason=f"transformers {transformers.__version__}'s quantizer API predates 5.23's: modelpatch refuses the load",
)

FUSED = {"qkv": True, "gate_up": True}
# Widths of multiples of 128 (the fp8 blocks): q/k/v 256/128/128 rows, the MLP 384, each expert 128.
FP8_CONFIGS = {
    "llama": dict(model_type="llama"),
    "qwen3_moe": dict(
        model_type="qwen3_moe", head_dim=64, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2
    ),
}
ROUTES = [("llama", FUSED), ("qwen3_moe", {"linear_experts": True, **FUSED})]


def _config(name: str):
    return fp8_config(**FP8_CONFIGS[name])


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    return fp8_checkpoints(tmp_path_factory.mktemp("fp8_routes"), _config)


def _logits(model) -> torch.Tensor:
    vocab = model.config.get_text_config().vocab_size
    input_ids = torch.randint(0, vocab - 8, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=input_ids).logits


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU stock keeps fp8 in float8 (FP8Linear)")
@pytest.mark.parametrize("name, fusion_config", ROUTES, ids=["fused", "linear_experts"])
def test_fp8_quantization_at_load_needs_a_gpu_fused_too(fp8_checkpoint, tmp_path, no_tensor_reads, name, fusion_config):
    """FineGrainedFP8Config on a full-precision checkpoint: stock's quantizer refuses without a GPU; so does
    modelpatch's load, with stock's reason, before any tensor is read."""
    plain = tmp_path / "plain"
    AutoModelForCausalLM.from_config(_config(name)).save_pretrained(plain)
    with pytest.raises(RuntimeError, match="No GPU or XPU found") as stock:
        AutoModelForCausalLM.from_pretrained(plain, quantization_config=FineGrainedFP8Config())
    with pytest.raises(LoadPlanError, match=r"fp8 quantizer refuses this load: No GPU or XPU found") as ours:
        modelpatch.from_pretrained(
            AutoModelForCausalLM, plain, fusion_config=fusion_config, quantization_config=FineGrainedFP8Config()
        )
    assert str(stock.value).rstrip(".") in str(ours.value)


@pytest.mark.parametrize("name, fusion_config", ROUTES, ids=["fused", "linear_experts"])
def test_block_fp8_checkpoint_loads_fused_as_stock_dequantizes_it(fp8_checkpoint, name, fusion_config):
    """Dequantized block by block first (stock's op, translated), then fused: the fused weights are stock's
    dequantized parts, concatenated, and the fused model computes what stock's computes."""
    path = fp8_checkpoint(name)
    stock = AutoModelForCausalLM.from_pretrained(path)
    model = modelpatch.from_pretrained(AutoModelForCausalLM, path, fusion_config=fusion_config)
    for layer, stock_layer in zip(model.model.layers, stock.model.layers, strict=True):
        parts = [getattr(stock_layer.self_attn, p).weight for p in ("q_proj", "k_proj", "v_proj")]
        assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat(parts))
        if name == "llama":
            parts = [getattr(stock_layer.mlp, p).weight for p in ("gate_proj", "up_proj")]
            assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat(parts))
        else:  # stock's 3-D experts hold [gate; up] rows per expert; linear_experts one Linear each
            for index, expert in enumerate(layer.mlp.experts):
                gate_up = torch.cat([expert.gate_proj.weight, expert.up_proj.weight])
                assert torch.equal(gate_up, stock_layer.mlp.experts.gate_up_proj[index])
                assert torch.equal(expert.down_proj.weight, stock_layer.mlp.experts.down_proj[index])
    assert getattr(model.config, "quantization_config", None) is None  # dequantized, as stock drops it
    torch.testing.assert_close(_logits(model), _logits(stock))


@pytest.mark.parametrize("name, fusion_config", ROUTES, ids=["fused", "linear_experts"])
def test_a_dequantized_fused_model_saves_its_runtime_layout_and_stock_loads_it_unfused(
    fp8_checkpoint, tmp_path, name, fusion_config
):
    """The block scales are gone after dequantizing: the original (float8) layout is refused by name, nothing
    written. The runtime layout loads back in modelpatch; unfused first, it is stock's own runtime layout, which stock
    loads and computes the same with."""
    model = modelpatch.from_pretrained(AutoModelForCausalLM, fp8_checkpoint(name), fusion_config=fusion_config)
    with pytest.raises(SaveError, match=r"fp8 weights were dequantized at load.*save_original_format=False"):
        modelpatch.save_pretrained(model, tmp_path / "original")
    assert not (tmp_path / "original").exists()
    modelpatch.save_pretrained(model, tmp_path / "runtime", save_original_format=False)
    reloaded = modelpatch.from_pretrained(AutoModelForCausalLM, tmp_path / "runtime")
    assert_bitwise_equal(reloaded.state_dict(), model.state_dict())

    fused = _logits(model)
    modelpatch.unfuse(model)
    modelpatch.save_pretrained(model, tmp_path / "unfused", save_original_format=False)
    assert "quantization_config" not in json.loads((tmp_path / "unfused" / "config.json").read_text())
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "unfused")
    torch.testing.assert_close(_logits(stock), fused)


# --- llm-compressor's FP8_DYNAMIC checkpoint -------------------------------------------------------------------------


def _fp8_dynamic_from_a_fused_model(source: Path, target: Path) -> Path:
    try:  # a release outside the range it was checked on may fail at import with more than an ImportError
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import QuantizationModifier
    except Exception as error:  # noqa: BLE001
        pytest.skip(f"llm-compressor does not import here: {error!r}")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, source, fusion_config=FUSED)
    oneshot(model=model, recipe=[QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])])
    model.save_pretrained(target)
    return target


def test_an_fp8_dynamic_checkpoint_saved_from_a_fused_model_loads_unfused_as_stock_and_fused_is_refused(
    tiny, tmp_path, monkeypatch
):
    """compressed-tensors' float8 weights decompress in place at the first forward: modelpatch loads them as stock
    does, unfused (the same tensors and outputs); a fusion would have to concatenate float8 tensors with their
    per-row scales before that, which modelpatch refuses by name, before any tensor is read."""
    pytest.importorskip("compressed_tensors")
    path = _fp8_dynamic_from_a_fused_model(tiny("llama").path, tmp_path / "fp8_dynamic")
    stock = AutoModelForCausalLM.from_pretrained(path)
    model = modelpatch.from_pretrained(AutoModelForCausalLM, path)
    assert model.model.layers[0].self_attn.k_proj.weight.dtype == torch.float8_e4m3fn
    assert_bitwise_equal(model.state_dict(), stock.state_dict())
    assert torch.equal(_logits(model), _logits(stock))

    def refuse(self, key):
        raise AssertionError(f"tensor {key!r} was read")

    monkeypatch.setattr(Checkpoint, "tensor", refuse)
    with pytest.raises(LoadPlanError, match=r"compressed-tensors checkpoint stores quantized tensors(.|\n)*qkv_proj"):
        modelpatch.from_pretrained(AutoModelForCausalLM, path, fusion_config=FUSED)
