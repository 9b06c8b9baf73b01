"""Fused models in the hands of other tools: module swaps, quantizer loops, torchao, stock save paths, Trainer.

Whatever replaces a module a fusion created is what runs; saves either reload to the same outputs (with modelpatch
and, in the original format, with stock transformers) or refuse by name and write nothing.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from fusion_models import VOCAB, assert_outputs_close, assert_same_files
from torch import nn
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import modelpatch
from modelpatch import SaveError
from modelpatch.fusions.projections import FusedLinear, ProjectionSlice

TEXT_FUSIONS = {"qkv": True, "gate_up": True}
MOE_FUSIONS = {"qkv": True, "gate_up": True, "linear_experts": True}


class Int8FakeQuantLinear(nn.Module):
    """What a quantizer loop puts in place of an ``nn.Linear``: int8 weights, one scale per output row."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
        self.register_buffer("weight", torch.round(weight / scale).to(torch.int8))
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight.to(x.dtype) * self.scale, self.bias)


def quantize_linears(model: nn.Module) -> list[str]:
    """The usual quantizer loop: every ``nn.Linear`` (subclasses included) but the output head is replaced."""
    head = model.get_output_embeddings()
    replaced = []
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and module is not head:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, Int8FakeQuantLinear(module))
            replaced.append(name)
    return replaced


def snapshot(directory):
    return {p.name: p.read_bytes() for p in directory.iterdir()} if directory.exists() else None


# --- module swaps take effect -------------------------------------------------------------------------------------


def test_replacing_the_fused_projection_changes_the_forward(tiny):
    ckpt = tiny("llama")
    model = ckpt.load(TEXT_FUSIONS)
    attention = model.model.layers[0].self_attn
    fired = []
    attention.q_proj.register_forward_hook(lambda *args: fired.append("q_proj"))
    before = ckpt.outputs(model)["logits"]

    doubled = nn.Linear(attention.qkv_proj.in_features, attention.qkv_proj.out_features, bias=False)
    with torch.no_grad():
        doubled.weight.copy_(attention.qkv_proj.weight * 2)
    attention.qkv_proj = doubled
    after = ckpt.outputs(model)["logits"]

    assert fired, "forward hooks on the original projection names fire"
    assert not torch.allclose(before, after)
    # The same change made on the stock model (q, k and v doubled) gives the same outputs.
    stock = AutoModelForCausalLM.from_pretrained(ckpt.path)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(stock.model.layers[0].self_attn, name).weight.mul_(2)
    torch.testing.assert_close(after, ckpt.outputs(stock)["logits"], atol=1e-5, rtol=0)


def test_replacing_an_expert_linear_changes_the_forward(tiny):
    ckpt = tiny("qwen2_moe")
    model = ckpt.load(MOE_FUSIONS)
    before = ckpt.outputs(model)["logits"]
    for layer in model.model.layers:
        for expert in layer.mlp.experts:
            expert.down_proj = nn.Linear(expert.down_proj.in_features, expert.down_proj.out_features, bias=False)
            nn.init.zeros_(expert.down_proj.weight)
    after = ckpt.outputs(model)["logits"]
    assert not torch.allclose(before, after)
    # Experts that output zeros are experts that do not exist: the same as the stock model with zeroed experts.
    stock = AutoModelForCausalLM.from_pretrained(ckpt.path)
    with torch.no_grad():
        for layer in stock.model.layers:
            layer.mlp.experts.down_proj.zero_()
    torch.testing.assert_close(after, ckpt.outputs(stock)["logits"], atol=1e-5, rtol=0)


def test_replacing_the_patch_embedding_linear_changes_the_forward(tiny):
    ckpt = tiny("qwen2_vl")
    model = ckpt.load({"patch_embeddings": True})
    patch_embed = model.model.visual.patch_embed
    fused = patch_embed.proj
    pixels = torch.randn(16, fused.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = patch_embed(pixels)
        replacement = nn.Linear(fused.in_features, fused.out_features, bias=False)
        replacement.weight.copy_(fused.weight * 3)
        patch_embed.proj = replacement
        after = patch_embed(pixels)
    assert model.get_submodule("model.visual.patch_embed.proj") is replacement  # named lookups see the module
    torch.testing.assert_close(after, before * 3, atol=1e-5, rtol=0)


# --- a quantizer loop ---------------------------------------------------------------------------------------------


def test_quantizer_loop_on_a_fused_llama(tiny, tmp_path):
    ckpt = tiny("llama")
    model = ckpt.load(TEXT_FUSIONS)
    replaced = quantize_linears(model)
    # The loop sees the fused projections (what it should quantize), never the parameter-free slices.
    assert "model.layers.0.self_attn.qkv_proj" in replaced and "model.layers.0.mlp.gate_up_proj" in replaced
    slices = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    assert not [name for name in replaced if name.rpartition(".")[2] in slices]
    assert all(isinstance(m, ProjectionSlice) for n, m in model.named_modules() if n.rpartition(".")[2] in slices)

    # Row-wise int8 scales of the fused layer are those of its parts: equal to the stock model quantized alike.
    stock = AutoModelForCausalLM.from_pretrained(ckpt.path)
    quantize_linears(stock)
    quantized = ckpt.outputs(model)
    assert_outputs_close(quantized, ckpt.outputs(stock))
    assert not torch.allclose(quantized["logits"], ckpt.stock_outputs()["logits"])

    for save in (
        lambda d: modelpatch.save_pretrained(model, d),
        lambda d: modelpatch.save_pretrained(model, d, save_original_format=False),
        lambda d: model.save_pretrained(d),
    ):
        target = tmp_path / "out"
        with pytest.raises(
            SaveError,
            match=r"model.layers.0.self_attn.qkv_proj \(Int8FakeQuantLinear\): weight is "
            r"torch.int8, built as torch.float32; scale is new",
        ):
            save(target)
        assert not target.exists() or not any(target.iterdir())


def test_quantizer_loop_on_linear_experts(tiny, tmp_path):
    ckpt = tiny("qwen2_moe")
    model = ckpt.load(MOE_FUSIONS)
    reference = ckpt.load(MOE_FUSIONS)
    replaced = quantize_linears(model)
    assert "model.layers.0.mlp.experts.3.up_proj" in replaced
    # The quantized model computes with the dequantized weights: the same as the float model holding them.
    with torch.no_grad():
        for name in replaced:
            quant = model.get_submodule(name)
            reference.get_submodule(name).weight.copy_(quant.weight.float() * quant.scale)
    assert_outputs_close(ckpt.outputs(model), ckpt.outputs(reference))
    with pytest.raises(SaveError, match=r"model.layers.1.mlp.experts.0.down_proj \(Int8FakeQuantLinear\)"):
        modelpatch.save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_torchao_int8_weight_only_is_refused_by_name(tiny, tmp_path):
    torchao = pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    ckpt = tiny("qwen2_moe")
    model = ckpt.load(MOE_FUSIONS)
    quantize_(model, Int8WeightOnlyConfig())
    assert type(model.model.layers[0].self_attn.qkv_proj.weight).__module__.startswith(torchao.__name__)
    ckpt.outputs(model)  # the quantized fused model runs
    for original_format in (True, False):
        # (torchao before 0.17 quantizes into its AffineQuantizedTensor)
        match = r"model.layers.0.self_attn.qkv_proj \(FusedLinear\): weight is a (Int8Tensor|AffineQuantizedTensor)"
        with pytest.raises(SaveError, match=match):
            modelpatch.save_pretrained(model, tmp_path / "out", save_original_format=original_format)
    assert not (tmp_path / "out").exists()


# --- stock save paths ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, fusions", [("llama", TEXT_FUSIONS), ("qwen2_moe", MOE_FUSIONS)])
def test_stock_save_pretrained_writes_what_stock_loads(tiny, tmp_path, name, fusions):
    ckpt = tiny(name)
    model = ckpt.load(fusions)
    assert not hasattr(model.config, "fusion_config")  # a key stock transformers would act on
    model.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert "fusion_config" not in config and "runtime_layout" not in config["modelpatch"]
    assert_same_files(tmp_path / "saved", ckpt.path)

    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert_outputs_close(ckpt.outputs(reloaded), ckpt.outputs(model))
    # modelpatch's reload applies the fusions recorded under its own key.
    refused = modelpatch.from_pretrained(ckpt.model_class, tmp_path / "saved")
    assert isinstance(refused.model.layers[0].self_attn.qkv_proj, FusedLinear)


def test_trainer_checkpoint_of_a_fused_model_loads_in_stock(tiny, tmp_path):
    ckpt = tiny("llama")
    model = ckpt.load(TEXT_FUSIONS)
    model.train()
    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, VOCAB, (8, 10), generator=generator)]
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"),
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        logging_strategy="no",
        disable_tqdm=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(model=model, args=args, train_dataset=rows)
        trainer.train()
    trained = model.model.layers[0].self_attn.qkv_proj.weight.detach().clone()
    assert not torch.equal(trained, ckpt.load(TEXT_FUSIONS).model.layers[0].self_attn.qkv_proj.weight)

    trainer.save_model(str(tmp_path / "final"))
    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "final", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    model.eval()
    assert_outputs_close(ckpt.outputs(reloaded), ckpt.outputs(model))


def test_save_of_a_peft_model_says_what_to_do(tiny, tmp_path):
    peft = pytest.importorskip("peft")
    model = tiny("llama").load(TEXT_FUSIONS)
    peft_model = peft.get_peft_model(model, peft.LoraConfig(target_modules=["qkv_proj"], r=2))
    with pytest.raises(SaveError, match=r"PEFT model\. Merge the adapter first .*merge_and_unload"):
        modelpatch.save_pretrained(peft_model, tmp_path / "out")
    with pytest.raises(SaveError, match=r"carries PEFT adapter layers \(model.layers.0.self_attn.qkv_proj"):
        modelpatch.save_pretrained(peft_model.base_model.model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _word_tokenizer():
    """A real fast tokenizer over the tiny models' 64-token vocabulary, built locally (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"<unk>": VOCAB - 1}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="w1", pad_token="w0")


def test_a_fused_model_generates_in_a_pipeline_like_stock(tiny):
    from transformers import pipeline

    from modelpatch import AutoModelForCausalLM as PatchedAuto

    ckpt = tiny("llama")
    tokenizer = _word_tokenizer()
    prompt = "w5 w9 w12 w3"
    outputs = []
    for model in (
        AutoModelForCausalLM.from_pretrained(ckpt.path),
        PatchedAuto.from_pretrained(ckpt.path, fusion_config=TEXT_FUSIONS),
    ):
        generator = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
        outputs.append(
            generator(prompt, max_new_tokens=8, do_sample=False, return_full_text=False)[0]["generated_text"]
        )
    assert outputs[0] == outputs[1] and len(outputs[0].split()) == 8
