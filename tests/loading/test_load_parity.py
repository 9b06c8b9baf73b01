"""Parity with stock transformers on tiny checkpoints written by stock ``save_pretrained``.

For every model: the state dict (keys, dtypes, bytes), the non-persistent buffers (rotary ``inv_freq``), the tied
parameter structure and the logits equal stock ``from_pretrained``'s exactly; an unpatched save writes the source
checkpoint back bit for bit (tensors, and the file bytes where the writer produces one file).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import modelpatch
from support.compare import assert_bitwise_equal, bits, tied_groups
from support.files import read_tensors, rewrite_checkpoint

PARITY = [
    "llama",
    "llama_tied",
    "mistral",
    "qwen2",
    "gpt2",
    "bert",
    "bert_base",
    "qwen2_moe",
    "mixtral",
    "qwen3_moe",
    "olmoe",
    "qwen2_vl",
    "qwen2_vl_runtime",
    "qwen2_5_vl",
    "llama_sharded",
    "qwen2_moe_sharded",
    "llama_bf16",
]

_loaded: dict[str, tuple] = {}


def _pair(stock_checkpoint, name: str):
    """(checkpoint, stock model, modelpatch model), loaded once per module."""
    if name not in _loaded:
        ckpt = stock_checkpoint(name)
        stock = ckpt.model_class.from_pretrained(ckpt.path)
        mine = modelpatch.from_pretrained(ckpt.model_class, ckpt.path)
        _loaded[name] = (ckpt, stock, mine)
    return _loaded[name]


@pytest.fixture(scope="module", autouse=True)
def _forget_models():
    yield
    _loaded.clear()


def _outputs(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


@pytest.mark.parametrize("name", PARITY)
def test_state_dict_buffers_and_ties_match_stock(stock_checkpoint, name):
    _, stock, mine = _pair(stock_checkpoint, name)
    assert type(mine) is type(stock)
    assert_bitwise_equal(mine.state_dict(), stock.state_dict())
    # Non-persistent buffers (rotary inv_freq, BERT position_ids) end exactly as stock builds them.
    assert_bitwise_equal(dict(mine.named_buffers()), dict(stock.named_buffers()))
    assert tied_groups(mine) == tied_groups(stock)
    assert mine.training is stock.training is False
    assert mine.dtype == stock.dtype
    assert mine.config.to_dict() == stock.config.to_dict()


@pytest.mark.parametrize("name", PARITY)
def test_logits_match_stock(stock_checkpoint, name):
    ckpt, stock, mine = _pair(stock_checkpoint, name)
    inputs = ckpt.inputs()
    expected = _outputs(stock, inputs)
    assert torch.equal(_outputs(mine, inputs), expected)


@pytest.mark.parametrize("name", PARITY)
def test_unpatched_save_is_bitwise_the_source(stock_checkpoint, name, tmp_path):
    ckpt, _, mine = _pair(stock_checkpoint, name)
    out = tmp_path / "saved"
    modelpatch.save_pretrained(
        mine,
        out,
        **({"max_shard_size": ckpt.save_kwargs["max_shard_size"]} if "max_shard_size" in ckpt.save_kwargs else {}),
    )
    assert_bitwise_equal(read_tensors(out), ckpt.tensors())
    if ckpt.single_file:
        assert (out / "model.safetensors").read_bytes() == (ckpt.path / "model.safetensors").read_bytes()
    # And stock transformers reads what we wrote into the same model.
    again = ckpt.model_class.from_pretrained(out)
    assert_bitwise_equal(again.state_dict(), mine.state_dict())


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral", "qwen3_moe", "olmoe"])
def test_moe_experts_are_fused_and_reported(stock_checkpoint, name):
    ckpt, _, mine = _pair(stock_checkpoint, name)
    report = modelpatch.get_load_report(mine)
    assert report is mine.modelpatch_report
    converted = report.converted
    assert "model.layers.0.mlp.experts.gate_up_proj" in converted
    assert "model.layers.0.mlp.experts.down_proj" in converted
    source = ckpt.tensors()
    gate_name, up_name = ("w1", "w3") if name == "mixtral" else ("gate_proj", "up_proj")
    container = "block_sparse_moe" if name == "mixtral" else "mlp"
    fused = mine.model.layers[1].mlp.experts.gate_up_proj
    expert = 2
    gate = source[f"model.layers.1.{container}.experts.{expert}.{gate_name}.weight"]
    up = source[f"model.layers.1.{container}.experts.{expert}.{up_name}.weight"]
    assert torch.equal(bits(fused[expert]), bits(torch.cat([gate, up])))
    assert len(report.groups) == 2 * 2  # two layers x (gate_up, down)


def test_qwen2_vl_layouts_load_to_the_same_runtime_model(stock_checkpoint):
    _, _, legacy = _pair(stock_checkpoint, "qwen2_vl")
    _, _, runtime = _pair(stock_checkpoint, "qwen2_vl_runtime")
    legacy_keys = set(stock_checkpoint("qwen2_vl").tensors())
    runtime_keys = set(stock_checkpoint("qwen2_vl_runtime").tensors())
    assert any(k.startswith("visual.") for k in legacy_keys) and any(k.startswith("model.layers.") for k in legacy_keys)
    assert all(k.startswith(("model.visual.", "model.language_model.", "lm_head.")) for k in runtime_keys)
    assert legacy.state_dict().keys() == runtime.state_dict().keys()
    report = modelpatch.get_load_report(legacy)
    assert report.direct["model.visual.patch_embed.proj.weight"] == "visual.patch_embed.proj.weight"
    assert (
        report.direct["model.language_model.layers.0.self_attn.q_proj.weight"]
        == "model.layers.0.self_attn.q_proj.weight"
    )


@pytest.mark.parametrize("name", ["gpt2", "llama_tied", "bert"])
def test_tied_weights_reported_and_shared(stock_checkpoint, name):
    _, _, mine = _pair(stock_checkpoint, name)
    report = modelpatch.get_load_report(mine)
    assert report.tied, "tied pairs are reported"
    for target, source in report.tied.items():
        assert mine.get_parameter(target) is mine.get_parameter(source)


def test_sharded_checkpoint_is_really_sharded(stock_checkpoint):
    ckpt = stock_checkpoint("llama_sharded")
    assert len(ckpt.files) > 2 and (ckpt.path / "model.safetensors.index.json").is_file()


def test_auto_and_concrete_classes_load_the_same(stock_checkpoint):
    from transformers import LlamaForCausalLM

    ckpt, _, mine = _pair(stock_checkpoint, "llama")
    concrete = modelpatch.from_pretrained(LlamaForCausalLM, ckpt.path)
    assert type(concrete) is LlamaForCausalLM
    assert_bitwise_equal(concrete.state_dict(), mine.state_dict())


def test_path_may_be_str(stock_checkpoint):
    ckpt, _, mine = _pair(stock_checkpoint, "qwen2")
    model = modelpatch.from_pretrained(ckpt.model_class, str(ckpt.path))
    assert_bitwise_equal(model.state_dict(), mine.state_dict())
    assert isinstance(modelpatch.get_load_report(model).source, Path)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_keep_in_fp32_modules_as_stock(tmp_path, dtype):
    """T5 keeps its ``wo`` projections in float32 when loaded in float16 (``_keep_in_fp32_modules``), like stock;
    saving such a model writes them back in float32, bit for bit."""
    from transformers import AutoModelForSeq2SeqLM, T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    T5ForConditionalGeneration(
        T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    ).save_pretrained(tmp_path / "t5")
    stock = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "t5", dtype=dtype)
    ours = modelpatch.from_pretrained(AutoModelForSeq2SeqLM, tmp_path / "t5", dtype=dtype)
    assert {k: v.dtype for k, v in ours.state_dict().items()} == {k: v.dtype for k, v in stock.state_dict().items()}
    assert_bitwise_equal(ours.state_dict(), stock.state_dict())


def test_bert_legacy_gamma_beta_keys_load_like_stock(stock_checkpoint, tmp_path):
    """transformers' "legacy" renamings: a BERT checkpoint with TF-era ``LayerNorm.gamma``/``beta`` names loads into
    ``LayerNorm.weight``/``bias`` exactly as stock loads it, and saves back under the names it came with (as stock's
    save of that model does)."""
    ckpt = stock_checkpoint("bert")

    def to_legacy(tensors):
        for key in [k for k in tensors if "LayerNorm." in k]:
            tensors[key.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")] = (
                tensors.pop(key)
            )

    legacy = rewrite_checkpoint(ckpt.path, tmp_path / "legacy", to_legacy)
    assert any(k.endswith("LayerNorm.gamma") for k in read_tensors(legacy))
    stock = ckpt.model_class.from_pretrained(legacy)
    mine = modelpatch.from_pretrained(ckpt.model_class, legacy, unexpected_keys="error")
    assert_bitwise_equal(mine.state_dict(), stock.state_dict())
    assert_bitwise_equal(mine.state_dict(), ckpt.model_class.from_pretrained(ckpt.path).state_dict())

    stock.save_pretrained(tmp_path / "stock")
    modelpatch.save_pretrained(mine, tmp_path / "mine")
    assert_bitwise_equal(read_tensors(tmp_path / "mine"), read_tensors(tmp_path / "stock"))
    assert_bitwise_equal(read_tensors(tmp_path / "mine"), read_tensors(legacy))
