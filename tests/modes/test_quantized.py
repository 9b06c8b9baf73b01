"""Quantized checkpoints and quantization at load, compared with stock transformers on the same directories.

Checkpoints are made here: fp8 ones by block-quantizing a stock-saved tiny model the way published DeepSeek / Qwen FP8
checkpoints are made (float8_e4m3fn weights, ``weight_scale_inv = amax / 448`` per 128x128 block, ``quant_method:
"fp8"`` in config.json); torchao ones by stock itself (``quantization_config=TorchAoConfig(Int8WeightOnlyConfig())``
at load, then ``save_pretrained``). On a machine without a GPU stock dequantizes fp8 to the model's dtype; modelpatch
must give the same modules and the same tensors, bit for bit. compressed-tensors ones are written by hand in its
``float-quantized`` format (float8 weights, one bfloat16 scale per output channel), which stock loads as they are and
decompresses in place at the first forward.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

import modelpatch
from modelpatch.errors import LoadPlanError, SaveError
from modelpatch.modes.quantization import quantizer_api_supported
from support.compare import assert_bitwise_equal, bits
from support.files import read_tensors
from support.quantized import BLOCK, FP8_MAX, declare_quantization, fp8_checkpoints, fp8_config, quantize_projections

# The oldest transformers releases of the supported range have another quantizer API: there modelpatch refuses
# quantized checkpoints by name (tests/loading/test_load_errors.py checks that).
pytestmark = pytest.mark.skipif(
    not quantizer_api_supported(), reason="this transformers' quantizer API predates 5.23's; loads are refused"
)

torchao = pytest.importorskip("torchao")
from torchao.quantization import Int8WeightOnlyConfig  # noqa: E402
from transformers import TorchAoConfig  # noqa: E402

FP8_MODELS = {
    "llama": fp8_config("llama"),
    "qwen2_moe": fp8_config(
        "qwen2_moe",
        moe_intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=256,
    ),
}


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    return fp8_checkpoints(tmp_path_factory.mktemp("fp8"), FP8_MODELS.__getitem__)


@pytest.fixture(scope="module")
def plain_llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plain") / "llama"
    torch.manual_seed(1)
    config = fp8_config("llama", hidden_size=64, intermediate_size=96)  # narrower: it is quantized by torchao
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    return path


def int8_config() -> TorchAoConfig:
    return TorchAoConfig(Int8WeightOnlyConfig())


@pytest.fixture(scope="module")
def torchao_checkpoint(plain_llama, tmp_path_factory) -> Path:
    """What stock writes for a model it quantized at load with torchao int8 weight-only."""
    path = tmp_path_factory.mktemp("torchao") / "llama"
    AutoModelForCausalLM.from_pretrained(plain_llama, quantization_config=int8_config()).save_pretrained(path)
    return path


def flat_state(model) -> dict[str, torch.Tensor]:
    """State dict with torchao tensors spread into their data (``<key>:qdata`` ...), for a bitwise comparison."""
    out = {}
    for key, tensor in model.state_dict().items():
        if type(tensor) is torch.Tensor:
            out[key] = tensor
        else:
            out[f"{key}:{type(tensor).__name__}"] = torch.empty(0)
            out.update({f"{key}:{name}": getattr(tensor, name) for name in tensor.tensor_data_names})
    return out


def module_types(model) -> dict[str, str]:
    return {name: type(module).__qualname__ for name, module in model.named_modules()}


def logits(model) -> torch.Tensor:
    ids = torch.randint(0, 120, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids).logits


def assert_same_as_stock(model, stock) -> None:
    assert module_types(model) == module_types(stock)
    assert_bitwise_equal(flat_state(model), flat_state(stock))
    assert torch.equal(bits(logits(model)), bits(logits(stock)))


# --- fp8 ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FP8_MODELS))
def test_fp8_checkpoint_loads_dequantized_like_stock(fp8_checkpoint, name):
    path = fp8_checkpoint(name)
    stock = AutoModelForCausalLM.from_pretrained(path)
    model = modelpatch.from_pretrained(AutoModelForCausalLM, path)
    assert_same_as_stock(model, stock)
    # Without a GPU stock dequantizes and drops the quantization config; so does modelpatch.
    assert model.dtype == stock.dtype == torch.bfloat16
    assert getattr(model.config, "quantization_config", None) is None
    assert getattr(stock.config, "quantization_config", None) is None
    assert not model.is_quantized and not stock.is_quantized


def test_fp8_dequantization_is_weight_times_block_scale(fp8_checkpoint):
    path = fp8_checkpoint("llama")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, path)
    stored = read_tensors(path)
    key = "model.layers.1.mlp.down_proj.weight"  # [256, 384]: a 2 x 3 grid of blocks
    weight, scale = stored[key].float(), stored[key.removesuffix("weight") + "weight_scale_inv"]
    assert tuple(scale.shape) == (2, 3)
    expected = weight * scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    assert torch.equal(model.get_parameter(key), expected.to(torch.bfloat16))


def test_fp8_composes_with_qkv_fusion(fp8_checkpoint):
    path = fp8_checkpoint("llama")
    stock = AutoModelForCausalLM.from_pretrained(path)
    model = modelpatch.from_pretrained(AutoModelForCausalLM, path, fusion_config={"qkv": True})
    for layer, stock_layer in zip(model.model.layers, stock.model.layers, strict=True):
        parts = [getattr(stock_layer.self_attn, p).weight for p in ("q_proj", "k_proj", "v_proj")]
        assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat(parts))
    torch.testing.assert_close(logits(model), logits(stock))


def test_fp8_save_refuses_the_checkpoint_layout_and_writes_the_dequantized_runtime_layout(fp8_checkpoint, tmp_path):
    model = modelpatch.from_pretrained(AutoModelForCausalLM, fp8_checkpoint("llama"))
    for save in (
        lambda: modelpatch.save_pretrained(model, tmp_path / "out"),
        lambda: model.save_pretrained(tmp_path / "o"),
    ):
        with pytest.raises(SaveError, match=r"fp8 weights were dequantized at load.*save_original_format=False"):
            save()
        assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()
    modelpatch.save_pretrained(model, tmp_path / "runtime", save_original_format=False)
    assert "quantization_config" not in json.loads((tmp_path / "runtime" / "config.json").read_text())
    reloaded = modelpatch.from_pretrained(AutoModelForCausalLM, tmp_path / "runtime")
    assert_bitwise_equal(reloaded.state_dict(), model.state_dict())


def test_fp8_scale_without_its_weight_is_named(fp8_checkpoint, tmp_path, no_tensor_reads):
    path = tmp_path / "broken"
    shutil.copytree(fp8_checkpoint("llama"), path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.0.self_attn.o_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        LoadPlanError, match=r"fp8 quantized tensors(.|\n)*layers\.0\.self_attn\.o_proj\.weight_scale_inv"
    ):
        modelpatch.from_pretrained(AutoModelForCausalLM, path)


@pytest.mark.parametrize("missing", ["one", "all"])
def test_fp8_weights_without_their_scales_are_refused_by_name(fp8_checkpoint, tmp_path, no_tensor_reads, missing):
    # Without its scale a float8 weight would load as if it were the weight itself (logits 0.4-0.65 off).
    path = tmp_path / "broken"
    shutil.copytree(fp8_checkpoint("llama"), path)
    tensors = load_file(str(path / "model.safetensors"))
    scales = sorted(key for key in tensors if key.endswith("weight_scale_inv"))
    dropped = scales[:1] if missing == "one" else scales
    for key in dropped:
        del tensors[key]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(LoadPlanError, match=r"without (its|their) scale") as info:
        modelpatch.from_pretrained(AutoModelForCausalLM, path)
    message = str(info.value)
    assert "weight_scale_inv" in message
    assert info.value.problems == {"quantized weights without scales": [k.removesuffix("_scale_inv") for k in dropped]}
    if missing == "one":
        assert "model.layers.0.mlp.down_proj.weight\n" in message
    else:
        assert "model.layers.{0..1}.mlp.down_proj.weight\n" in message


# --- torchao ------------------------------------------------------------------------------------------------------


def test_torchao_checkpoint_loads_like_stock(torchao_checkpoint):
    stock = AutoModelForCausalLM.from_pretrained(torchao_checkpoint)
    model = modelpatch.from_pretrained(AutoModelForCausalLM, torchao_checkpoint)
    assert type(model.model.layers[0].self_attn.q_proj.weight).__name__ == "Int8Tensor"
    assert_same_as_stock(model, stock)
    assert model.config.quantization_config.to_dict() == stock.config.quantization_config.to_dict()
    assert model.hf_quantizer.quantization_config.quant_method == "torchao"


def test_torchao_checkpoint_saves_what_stock_writes(torchao_checkpoint, tmp_path):
    model = modelpatch.from_pretrained(AutoModelForCausalLM, torchao_checkpoint)
    modelpatch.save_pretrained(model, tmp_path / "modelpatch")
    model.save_pretrained(tmp_path / "stock_path")  # the stock save method of a modelpatch model
    # Stock's own default save of a torchao checkpoint it loaded fails (its deserializer has no reverse op); its
    # runtime-layout save writes what it wrote when it quantized the model: the source checkpoint.
    stock = AutoModelForCausalLM.from_pretrained(torchao_checkpoint)
    stock.save_pretrained(tmp_path / "stock", save_original_format=False)
    for directory in (tmp_path / "modelpatch", tmp_path / "stock_path", torchao_checkpoint):
        assert_bitwise_equal(read_tensors(directory), read_tensors(tmp_path / "stock"))
        assert metadata(directory) == metadata(tmp_path / "stock")
        saved = json.loads((directory / "config.json").read_text())
        stock_config = json.loads((tmp_path / "stock" / "config.json").read_text())
        assert saved["quantization_config"] == stock_config["quantization_config"]
    reloaded = modelpatch.from_pretrained(AutoModelForCausalLM, tmp_path / "modelpatch")
    assert_bitwise_equal(flat_state(reloaded), flat_state(model))


def metadata(directory: Path) -> dict[str, str]:
    with safe_open(str(directory / "model.safetensors"), "pt") as file:
        return file.metadata()


def test_torchao_checkpoint_with_a_fusion_that_would_concatenate_it_is_refused(torchao_checkpoint, no_tensor_reads):
    with pytest.raises(
        LoadPlanError, match=r"cannot concatenate or stack quantized tensors(.|\n)*self_attn\.qkv_proj\.weight"
    ):
        modelpatch.from_pretrained(AutoModelForCausalLM, torchao_checkpoint, fusion_config={"qkv": True})


def _with_quantization_config(source: Path, path: Path, settings: dict) -> Path:
    shutil.copytree(source, path)
    return declare_quantization(path, settings)


def test_torchao_settings_on_a_full_precision_checkpoint_are_refused_naming_them(
    plain_llama, tmp_path, no_tensor_reads
):
    path = _with_quantization_config(plain_llama, tmp_path / "mislabelled", int8_config().to_dict())
    with pytest.raises(LoadPlanError, match=r"torchao quantizer cannot prepare LlamaForCausalLM") as info:
        modelpatch.from_pretrained(AutoModelForCausalLM, path)
    assert f"the quantization_config of {path / 'config.json'}" in str(info.value)
    assert "remove the quantization_config" in str(info.value)


@pytest.mark.parametrize("quant_type", ["junk", {"default": "junk"}, 5, None])
def test_junk_torchao_quant_type_is_refused_naming_the_config(plain_llama, tmp_path, no_tensor_reads, quant_type):
    settings = {**int8_config().to_dict(), "quant_type": quant_type}
    if quant_type is None:
        del settings["quant_type"]
    path = _with_quantization_config(plain_llama, tmp_path / "junk", settings)
    expected = "no 'quant_type' in its settings" if quant_type is None else ""
    with pytest.raises(LoadPlanError, match=rf"torchao quantizer refuses this load: {expected}") as info:
        modelpatch.from_pretrained(AutoModelForCausalLM, path)
    assert f"Check the quantization_config of {path / 'config.json'}" in str(info.value)


def test_torchao_quantization_at_load_like_stock(plain_llama):
    stock = AutoModelForCausalLM.from_pretrained(plain_llama, quantization_config=int8_config())
    model = modelpatch.from_pretrained(AutoModelForCausalLM, plain_llama, quantization_config=int8_config())
    assert_same_as_stock(model, stock)
    assert type(model.lm_head.weight) is torch.nn.Parameter  # the head is not quantized, as in stock


def test_torchao_quantization_at_load_quantizes_the_fused_projection(plain_llama, tmp_path):
    stock = AutoModelForCausalLM.from_pretrained(plain_llama, quantization_config=int8_config())
    model = modelpatch.from_pretrained(
        AutoModelForCausalLM, plain_llama, fusion_config={"qkv": True}, quantization_config=int8_config()
    )
    for layer, stock_layer in zip(model.model.layers, stock.model.layers, strict=True):
        fused = layer.self_attn.qkv_proj.weight
        assert type(fused).__name__ == "Int8Tensor"
        # Row-wise int8: the fused projection's data are its parts' data, stacked.
        for name in fused.tensor_data_names:
            parts = [getattr(getattr(stock_layer.self_attn, p).weight, name) for p in ("q_proj", "k_proj", "v_proj")]
            assert torch.equal(getattr(fused, name), torch.cat(parts)), name
    assert torch.equal(logits(model), logits(stock))

    # The original layout: the fused tensors cut back into their parts by rows (tests/quantization/
    # test_torchao_routes.py compares the folder with stock's).
    modelpatch.save_pretrained(model, tmp_path / "original")
    assert_bitwise_equal(flat_state(AutoModelForCausalLM.from_pretrained(tmp_path / "original")), flat_state(stock))
    modelpatch.save_pretrained(model, tmp_path / "runtime", save_original_format=False)
    reloaded = modelpatch.from_pretrained(AutoModelForCausalLM, tmp_path / "runtime")
    assert type(reloaded.model.layers[0].self_attn.qkv_proj.weight).__name__ == "Int8Tensor"
    assert_bitwise_equal(flat_state(reloaded), flat_state(model))


def test_torchao_quantize_after_the_load_is_refused_naming_what_saves_it(plain_llama, tmp_path):
    """The SaveError advised save_original_format=False, which refuses such a model the same way: only a load
    quantizer serialises quantized tensors. What it advises instead is done here, and gives back the same model."""
    from torchao.quantization import quantize_

    model = modelpatch.from_pretrained(AutoModelForCausalLM, plain_llama)
    quantize_(model, Int8WeightOnlyConfig())
    for original_format in (True, False):
        with pytest.raises(SaveError, match=r"lm_head \(Linear\): weight is a Int8Tensor") as info:
            modelpatch.save_pretrained(model, tmp_path / "out", save_original_format=original_format)
        assert "save_original_format=False" not in str(info.value)
        assert "quantization_config=TorchAoConfig(...)" in str(info.value)
        assert "before quantizing" in str(info.value) and "torch.save(model.state_dict(), path)" in str(info.value)
    assert not (tmp_path / "out").exists()

    # Loaded quantized: saved by its quantizer, loaded back the same.
    quantized = modelpatch.from_pretrained(AutoModelForCausalLM, plain_llama, quantization_config=int8_config())
    modelpatch.save_pretrained(quantized, tmp_path / "quantized")
    assert_bitwise_equal(
        flat_state(modelpatch.from_pretrained(AutoModelForCausalLM, tmp_path / "quantized")), flat_state(quantized)
    )
    # torchao's own format, onto the model loaded as before.
    torch.save(model.state_dict(), tmp_path / "state.pt")
    again = modelpatch.from_pretrained(AutoModelForCausalLM, plain_llama)
    again.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True), assign=True)
    assert_bitwise_equal(flat_state(again), flat_state(model))
    assert torch.equal(logits(again), logits(model))


# --- refused ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, method",
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "gptq"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}, "awq"),
        ({"load_in_4bit": True}, "bitsandbytes"),
        ({"quant_method": "made_up"}, "made_up"),
    ],
)
def test_unsupported_methods_are_refused_by_name_before_any_tensor_is_read(
    plain_llama, tmp_path, no_tensor_reads, settings, method
):
    path = _with_quantization_config(plain_llama, tmp_path / "quantized", settings)
    with pytest.raises(LoadPlanError, match=rf"quantized with it, and modelpatch does not support '{method}'"):
        modelpatch.from_pretrained(AutoModelForCausalLM, path)


def test_unsupported_quantization_at_load_is_refused_by_name(plain_llama, no_tensor_reads):
    with pytest.raises(LoadPlanError, match=r"quantization_config= asks for quantization method 'bitsandbytes'"):
        modelpatch.from_pretrained(
            AutoModelForCausalLM, plain_llama, quantization_config=BitsAndBytesConfig(load_in_8bit=True)
        )


def test_fp8_quantization_at_load_without_a_gpu_is_refused_with_stocks_reason(plain_llama, no_tensor_reads):
    from transformers import FineGrainedFP8Config

    with pytest.raises(LoadPlanError, match=r"fp8 quantizer refuses this load: No GPU"):
        modelpatch.from_pretrained(AutoModelForCausalLM, plain_llama, quantization_config=FineGrainedFP8Config())


# --- compressed-tensors -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compressed_tensors_checkpoint(plain_llama, tmp_path_factory) -> Path:
    """FP8 weights with channel-wise scales in compressed-tensors' ``float-quantized`` format (as llm-compressor's
    FP8_DYNAMIC scheme writes them)."""
    pytest.importorskip("compressed_tensors")
    path = tmp_path_factory.mktemp("compressed") / "llama"
    shutil.copytree(plain_llama, path)
    settings = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "token",
                    "symmetric": True,
                    "dynamic": True,
                },
            }
        },
    }
    return quantize_projections(path, _fp8_channelwise, settings)


def _fp8_channelwise(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """float8_e4m3fn weight and its ``weight_scale`` (one bfloat16 scale per output channel: amax / 448)."""
    scale = weight.float().abs().amax(dim=1, keepdim=True) / FP8_MAX
    return {
        "weight": (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn),
        "weight_scale": scale.to(torch.bfloat16),
    }


def test_compressed_tensors_checkpoint_loads_like_stock(compressed_tensors_checkpoint):
    stock = AutoModelForCausalLM.from_pretrained(compressed_tensors_checkpoint)
    model = modelpatch.from_pretrained(AutoModelForCausalLM, compressed_tensors_checkpoint)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn  # compressed until it runs
    assert_same_as_stock(model, stock)
    # The first forward decompresses in place, in both.
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert_bitwise_equal(model.state_dict(), stock.state_dict())
    assert model.config.quantization_config.to_dict() == stock.config.quantization_config.to_dict()


def test_compressed_tensors_checkpoint_with_a_fusion_is_refused_by_name(compressed_tensors_checkpoint, no_tensor_reads):
    with pytest.raises(LoadPlanError, match=r"compressed-tensors checkpoint stores quantized tensors(.|\n)*qkv_proj"):
        modelpatch.from_pretrained(AutoModelForCausalLM, compressed_tensors_checkpoint, fusion_config={"qkv": True})


def test_compressed_tensors_save_is_refused_by_name(compressed_tensors_checkpoint, tmp_path):
    model = modelpatch.from_pretrained(AutoModelForCausalLM, compressed_tensors_checkpoint)
    for original_format in (True, False):
        with pytest.raises(SaveError, match=r"modelpatch does not save compressed-tensors models"):
            modelpatch.save_pretrained(model, tmp_path / "out", save_original_format=original_format)
    assert not (tmp_path / "out").exists()


def test_compressed_tensors_dequantize_at_load_is_refused_by_name(compressed_tensors_checkpoint, no_tensor_reads):
    from transformers import CompressedTensorsConfig

    with pytest.raises(
        LoadPlanError, match=r"compressed-tensors quantizer loads this checkpoint with CompressedTensorsDequantize"
    ):
        modelpatch.from_pretrained(
            AutoModelForCausalLM,
            compressed_tensors_checkpoint,
            quantization_config=CompressedTensorsConfig(dequantize=True),
        )
