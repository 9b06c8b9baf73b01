"""torchao's routes on fused (``qkv``, ``gate_up``) and ``linear_experts`` models, side by side with stock transformers.

The route transformers documents for torchao: ``from_pretrained(..., quantization_config=TorchAoConfig(...))``, then
``save_pretrained`` (safetensors: torchao's flattened ``_weight_qdata`` / ``_weight_scale`` / ... tensors and a JSON
entry per tensor in the file's metadata), then stock ``from_pretrained`` of that folder. modelpatch quantizes the
fused layer as one Linear and writes it back in the original layout, cut into its parts by rows; stock's reload must
compute what the quantized fused model computes. Where the file stock would read cannot be written so, the save is
refused by name before anything is written. A quantizer loop the user runs after the load (``quantize_``) has no
``quantization_config`` to save with; stock's own save of such a model fails, modelpatch's refuses it by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import modelpatch
from modelpatch.errors import SaveError
from modelpatch.modes.quantization import quantizer_api_supported
from support.files import read_tensors

torchao = pytest.importorskip("torchao")
from torchao.quantization import (  # noqa: E402
    Float8WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    PerTensor,
    quantize_,
)
from transformers import TorchAoConfig  # noqa: E402

FUSED = {"qkv": True, "gate_up": True}
# transformers 5.15's quantizers rewrite weight conversions without the model: modelpatch refuses quantized loads
# there by name (tests/loading/test_load_errors.py), so the at-load routes have nothing to run.
needs_quantizer_api = pytest.mark.skipif(
    not quantizer_api_supported(),
    reason=f"transformers {transformers.__version__}'s quantizer API predates 5.23's: modelpatch refuses the load",
)


def _int8(**options) -> TorchAoConfig:
    return TorchAoConfig(Int8WeightOnlyConfig(**options))


def _logits(model, vocab: int = 64) -> torch.Tensor:
    input_ids = torch.randint(0, vocab - 8, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def _metadata(directory: Path) -> dict[str, str]:
    """torchao's metadata entries of the file's quantized tensors (stock lists its plain tensors under their runtime
    names, 3-D experts included, before it converts them back: those entries are not compared)."""
    with safe_open(str(directory / "model.safetensors"), "pt") as file:
        metadata = file.metadata()
    return {key: value for key, value in metadata.items() if '"_type": "Tensor"' not in value and key != "tensor_names"}


def _quantization_config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())["quantization_config"]


def _assert_what_stock_writes(ours: Path, stock: Path) -> None:
    """The same tensors bit for bit, the same torchao metadata and quantization_config."""
    mine, theirs = read_tensors(ours), read_tensors(stock)
    assert sorted(mine) == sorted(theirs)
    for key, tensor in theirs.items():
        assert mine[key].dtype == tensor.dtype and torch.equal(mine[key], tensor), key
    assert _metadata(ours) == _metadata(stock)
    assert _quantization_config(ours) == _quantization_config(stock)


# Weight-only int8, fp8 and intx (one scale per output row), and int8 weights with dynamic int8 activations: the
# torchao configs that run on the CPU.
ROW_WISE = {
    "int8_weight_only": Int8WeightOnlyConfig,
    "float8_weight_only": Float8WeightOnlyConfig,
    "intx_weight_only": IntxWeightOnlyConfig,
    "int8_dynamic_activation_int8_weight": Int8DynamicActivationInt8WeightConfig,
}


@needs_quantizer_api
@pytest.mark.parametrize(
    "name, method",
    [*(("llama", method) for method in ROW_WISE), ("qwen2", "int8_weight_only")],  # qwen2: q/k/v with bias
)
def test_row_wise_torchao_of_a_fused_model_saves_what_stock_saves(tiny, tmp_path, name, method):
    """One scale (and zero point) per output row: the fused layer's rows are its parts' rows, so the fused model
    quantized at load computes what stock's does, and its original-layout save, through modelpatch.save_pretrained and
    through model.save_pretrained, is the folder stock writes; stock's reload computes the same."""
    checkpoint = tiny(name).path
    stock = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=TorchAoConfig(ROW_WISE[method]()))
    stock.save_pretrained(tmp_path / "stock")
    model = modelpatch.from_pretrained(
        AutoModelForCausalLM, checkpoint, fusion_config=FUSED, quantization_config=TorchAoConfig(ROW_WISE[method]())
    )
    kind = type(stock.model.layers[0].self_attn.k_proj.weight)
    assert kind is not torch.nn.Parameter and type(model.model.layers[0].self_attn.qkv_proj.weight) is kind
    assert torch.equal(_logits(model), _logits(stock))

    modelpatch.save_pretrained(model, tmp_path / "ours")
    model.save_pretrained(tmp_path / "door")  # the stock method of a modelpatch model
    for folder in ("ours", "door"):
        _assert_what_stock_writes(tmp_path / folder, tmp_path / "stock")
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / folder)
        assert type(reloaded.model.layers[0].self_attn.k_proj.weight) is kind
        assert torch.equal(_logits(reloaded), _logits(model))


@needs_quantizer_api
def test_a_per_tensor_scale_of_a_fused_layer_goes_to_each_part(tiny, tmp_path):
    """Per-tensor int8: quantizing the fused layer gives q, k and v one scale (stock gives each its own). Each part is
    written with it (torchao's own slice of the tensor), so stock's reload computes what the quantized fused model
    computes, not what stock's own quantization computes."""
    checkpoint = tiny("llama").path
    per_tensor = _int8(granularity=PerTensor())
    model = modelpatch.from_pretrained(
        AutoModelForCausalLM, checkpoint, fusion_config=FUSED, quantization_config=per_tensor
    )
    modelpatch.save_pretrained(model, tmp_path / "ours")
    tensors = read_tensors(tmp_path / "ours")
    attention = "model.layers.0.self_attn"
    scales = [tensors[f"{attention}.{part}._weight_scale"] for part in ("q_proj", "k_proj", "v_proj")]
    fused_scale = model.model.layers[0].self_attn.qkv_proj.weight.scale
    assert all(scale.numel() == 1 and torch.equal(scale, fused_scale) for scale in scales)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert torch.equal(_logits(reloaded), _logits(model))
    stock = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=_int8(granularity=PerTensor()))
    stock_scales = [
        getattr(stock.model.layers[0].self_attn, part).weight.scale for part in ("q_proj", "k_proj", "v_proj")
    ]
    assert torch.equal(torch.stack(stock_scales).max(), fused_scale.flatten()[0])  # the largest of the parts'
    assert not all(torch.equal(scale, fused_scale) for scale in stock_scales)


@needs_quantizer_api
def test_int8_experts_of_linear_experts_are_refused_in_the_original_layout(tiny, tmp_path):
    """linear_experts quantizes every expert's Linear; stock's Qwen3-MoE stacks its experts into 3-D parameters that
    its torchao quantizer leaves in full precision, and its load cannot stack torchao tensors (it leaves them at
    random). Refused by name, nothing written; the runtime layout loads back in modelpatch."""
    checkpoint = tiny("qwen3_moe").path
    model = modelpatch.from_pretrained(
        AutoModelForCausalLM, checkpoint, fusion_config={"linear_experts": True}, quantization_config=_int8()
    )
    assert type(model.model.layers[0].mlp.experts[0].gate_proj.weight).__name__ == "Int8Tensor"
    for save in (
        lambda: modelpatch.save_pretrained(model, tmp_path / "ours"),
        lambda: model.save_pretrained(tmp_path / "ours"),
    ):
        with pytest.raises(SaveError, match=r"experts\.\{0\.\.3\}\.gate_proj\.weight.*MergeModulelist") as info:
            save()
        assert "save_original_format=False" in str(info.value)
        assert not any((tmp_path / "ours").glob("*.safetensors"))
    modelpatch.save_pretrained(model, tmp_path / "runtime", save_original_format=False)
    reloaded = modelpatch.from_pretrained(AutoModelForCausalLM, tmp_path / "runtime")
    assert torch.equal(_logits(reloaded), _logits(model))


@needs_quantizer_api
def test_linear_experts_with_experts_kept_in_full_precision_saves_what_stock_saves(tiny, tmp_path):
    """The refusal's other remedy: experts left out of the quantization (modules_to_not_convert), as stock leaves its
    3-D experts; attention fused and quantized. The folder is stock's, and stock's reload computes the same."""
    checkpoint = tiny("qwen3_moe").path

    def keep() -> TorchAoConfig:  # a regular expression of transformers' modules_to_not_convert
        return TorchAoConfig(Int8WeightOnlyConfig(), modules_to_not_convert=["lm_head", r"model.layers.*.mlp.experts"])

    stock = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=keep())
    stock.save_pretrained(tmp_path / "stock")
    model = modelpatch.from_pretrained(
        AutoModelForCausalLM,
        checkpoint,
        fusion_config={"linear_experts": True, "qkv": True},
        quantization_config=keep(),
    )
    assert type(model.model.layers[0].mlp.experts[0].gate_proj.weight) is torch.nn.Parameter
    assert torch.equal(_logits(model), _logits(stock))
    modelpatch.save_pretrained(model, tmp_path / "ours")
    _assert_what_stock_writes(tmp_path / "ours", tmp_path / "stock")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert torch.equal(_logits(reloaded), _logits(model))


def test_quantize_after_the_load_of_a_fused_model_is_refused_by_name(tiny, tmp_path):
    """The user's own loop: ``quantize_`` on the fused model. Its config has no quantization_config to write (stock's
    save of a stock model quantized so fails: torchao tensors are not plain storage), so both layouts are refused,
    naming the fused layer and the route that saves (quantization_config= at load)."""
    model = modelpatch.from_pretrained(AutoModelForCausalLM, tiny("llama").path, fusion_config=FUSED)
    quantize_(model, Int8WeightOnlyConfig())
    for original_format in (True, False):
        with pytest.raises(SaveError, match=r"model\.layers\.0\.self_attn\.qkv_proj \(\w+\): weight is a \w+") as info:
            modelpatch.save_pretrained(model, tmp_path / "out", save_original_format=original_format)
        assert "quantization_config=TorchAoConfig(...)" in str(info.value)
    with pytest.raises(SaveError, match=r"qkv_proj"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("*.safetensors"))


@needs_quantizer_api
def test_an_unfused_moe_quantized_at_load_saves_what_stock_saves(tiny, tmp_path):
    """Qwen3-MoE unfused: its 3-D experts (stacked at load, left in full precision by torchao) go back to per-expert
    weights, its quantized attention as it is: stock's folder."""
    checkpoint = tiny("qwen3_moe").path
    stock = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=_int8())
    stock.save_pretrained(tmp_path / "stock")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, checkpoint, quantization_config=_int8())
    assert torch.equal(_logits(model), _logits(stock))
    modelpatch.save_pretrained(model, tmp_path / "ours")
    _assert_what_stock_writes(tmp_path / "ours", tmp_path / "stock")
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in read_tensors(tmp_path / "ours")
