"""The seeds' complete qwen2_moe example, run as written (imports aside), and its grouped-query variant."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import modelpatch
from modelpatch import Chunk, Concatenate, LoadPlanError, WeightConverter
from modelpatch._transformers_mapping import builtin_mapping
from support.compare import assert_bitwise_equal, bits
from support.files import read_tensors

SEED_EXAMPLE = Path(__file__).with_name("seed_qwen2_moe_example.py")


def _run_seed_example(checkpoint: Path) -> dict:
    return runpy.run_path(str(SEED_EXAMPLE), init_globals={"CHECKPOINT": str(checkpoint)})


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def test_seed_example_runs_matches_stock_and_saves_back_bitwise(stock_checkpoint, tmp_path):
    ckpt = stock_checkpoint("qwen2_moe_mha")
    namespace = _run_seed_example(ckpt.path)
    model = namespace["model"]

    layer = model.model.layers[0]
    assert type(layer.self_attn) is namespace["FusedQKVAttention"]
    assert type(layer.mlp.experts) is namespace["ModuleListExperts"]
    source = ckpt.tensors()
    for suffix in ("weight", "bias"):
        fused = layer.self_attn.qkv_proj.get_parameter(suffix)
        parts = [source[f"model.layers.0.self_attn.{p}_proj.{suffix}"] for p in "qkv"]
        assert torch.equal(bits(fused), bits(torch.cat(parts)))
    assert torch.equal(
        bits(layer.mlp.experts[3].up_proj.weight), bits(source["model.layers.0.mlp.experts.3.up_proj.weight"])
    )

    stock = AutoModelForCausalLM.from_pretrained(ckpt.path)
    inputs = ckpt.inputs()
    torch.testing.assert_close(_logits(model, inputs), _logits(stock, inputs), atol=1e-5, rtol=0)

    out = tmp_path / "saved"
    modelpatch.save_pretrained(model, out)
    assert_bitwise_equal(read_tensors(out), source)
    assert (out / "model.safetensors").read_bytes() == (ckpt.path / "model.safetensors").read_bytes()


def test_seed_example_registration_replaced_the_builtin_mapping(stock_checkpoint):
    _run_seed_example(stock_checkpoint("qwen2_moe_mha").path)
    (converter,) = modelpatch.get_checkpoint_conversion_mapping("qwen2_moe")
    assert converter.target_patterns == ("qkv_proj",)


def test_seed_example_on_grouped_query_checkpoint_fails_loudly(stock_checkpoint):
    """The seed's 3*heads*head_dim sizing is wrong for GQA: one LoadPlanError naming every qkv key, no random
    weights."""
    ckpt = stock_checkpoint("qwen2_moe")
    with pytest.raises(LoadPlanError) as info:
        _run_seed_example(ckpt.path)
    mismatches = info.value.problems["shape mismatches"]
    named = {line.split(":")[0] for line in mismatches}
    assert named == {f"model.layers.{i}.self_attn.qkv_proj.{s}" for i in range(2) for s in ("weight", "bias")}
    for key in named:
        assert key in str(info.value)


def _gqa_attention_class(namespace: dict):
    """The seed's FusedQKVAttention with q/k/v sized (heads + 2 * kv_heads) * head_dim and split by those sizes."""
    base = namespace["FusedQKVAttention"]
    apply_rotary_pos_emb = namespace["apply_rotary_pos_emb"]
    sdpa_attention_forward = namespace["sdpa_attention_forward"]

    class GroupedQKVAttention(base):
        def __init__(self, config, layer_idx: int):
            super().__init__(config, layer_idx)
            self.q_size = config.num_attention_heads * self.head_dim
            self.kv_size = config.num_key_value_heads * self.head_dim
            self.qkv_proj = torch.nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=True)

        def forward(
            self,
            hidden_states,
            position_embeddings=None,
            attention_mask=None,
            past_key_values=None,
            cache_position=None,
            **kwargs,
        ):
            input_shape = hidden_states.shape[:-1]
            hidden_shape = (*input_shape, -1, self.head_dim)
            q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, k, v = (t.view(hidden_shape).transpose(1, 2) for t in (q, k, v))
            cos, sin = position_embeddings
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            if past_key_values is not None:
                k, v = past_key_values.update(k, v, self.layer_idx, {"sin": sin, "cos": cos})
            out, weights = sdpa_attention_forward(
                self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
            )
            return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights

    return GroupedQKVAttention


def test_grouped_query_variant_loads_matches_stock_and_saves_back_exactly(stock_checkpoint, tmp_path):
    ckpt = stock_checkpoint("qwen2_moe")  # 4 heads, 2 kv heads, head_dim 16: q/k/v rows 64/32/32
    namespace = _run_seed_example(stock_checkpoint("qwen2_moe_mha").path)  # defines the classes, registers
    modelpatch.register_patch_mapping({"Qwen2MoeAttention": _gqa_attention_class(namespace)}, overwrite=True)

    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path)
    source = ckpt.tensors()
    qkv = model.model.layers[1].self_attn.qkv_proj
    assert tuple(qkv.weight.shape) == (128, 64)
    parts = [source[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(bits(qkv.weight), bits(torch.cat(parts)))

    report = modelpatch.get_load_report(model)
    concatenations = [op for group in report.groups for op in group.operations if isinstance(op, Concatenate)]
    assert concatenations and {op.sizes for op in concatenations} == {(64, 32, 32)}
    reverse = concatenations[0].reverse()
    assert isinstance(reverse, Chunk) and reverse.sizes == (64, 32, 32)

    stock = AutoModelForCausalLM.from_pretrained(ckpt.path)
    inputs = ckpt.inputs()
    torch.testing.assert_close(_logits(model, inputs), _logits(stock, inputs), atol=1e-5, rtol=0)

    out = tmp_path / "saved"
    modelpatch.save_pretrained(model, out)
    saved = read_tensors(out)
    assert saved["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)  # not an equal 43/43/42 chunk
    assert_bitwise_equal(saved, source)
    assert (out / "model.safetensors").read_bytes() == (ckpt.path / "model.safetensors").read_bytes()
    # The saved checkpoint is a valid stock checkpoint again.
    again = AutoModelForCausalLM.from_pretrained(out)
    assert_bitwise_equal(again.state_dict(), stock.state_dict())


def test_grouped_query_variant_through_a_patcher(stock_checkpoint, tmp_path):
    """Seed 002's Patcher form: class mapping + filtered conversions + extra converters, nothing global."""
    ckpt = stock_checkpoint("qwen2_moe")
    namespace = _run_seed_example(stock_checkpoint("qwen2_moe_mha").path)
    modelpatch.clear_patch_mapping()
    modelpatch.register_checkpoint_conversion_mapping(
        model_type="qwen2_moe", mapping=builtin_mapping("qwen2_moe"), overwrite=True
    )

    extra = [
        WeightConverter(["q_proj.weight", "k_proj.weight", "v_proj.weight"], ["qkv_proj.weight"], [Concatenate(dim=0)]),
        WeightConverter(["q_proj.bias", "k_proj.bias", "v_proj.bias"], ["qkv_proj.bias"], [Concatenate(dim=0)]),
    ]
    patcher = modelpatch.Patcher(
        class_mapping={
            "Qwen2MoeExperts": namespace["ModuleListExperts"],
            "Qwen2MoeAttention": _gqa_attention_class(namespace),
        },
        filtered_weight_conversion_patterns=[".gate_up_proj", ".down_proj"],
        extra_weight_conversions=extra,
    )
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path, patcher=patcher)
    assert type(model.model.layers[0].mlp.experts) is namespace["ModuleListExperts"]
    report = modelpatch.get_load_report(model)
    assert list(report.transforms) == extra  # built-ins filtered out, extras first
    stock = AutoModelForCausalLM.from_pretrained(ckpt.path)
    inputs = ckpt.inputs()
    torch.testing.assert_close(_logits(model, inputs), _logits(stock, inputs), atol=1e-5, rtol=0)

    out = tmp_path / "saved"
    modelpatch.save_pretrained(model, out)
    assert (out / "model.safetensors").read_bytes() == (ckpt.path / "model.safetensors").read_bytes()

    # The Patcher was scoped to that load: a plain load builds stock classes with the built-in conversions.
    plain = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path)
    assert type(plain.model.layers[0].mlp.experts).__name__ == "Qwen2MoeExperts"


def test_from_config_with_the_seed_patches_saves_in_checkpoint_layout(stock_checkpoint, tmp_path):
    """A never-loaded model built with the seed's fused attention saves per-projection keys stock can load.

    With no checkpoint to record the q/k/v sizes from, the converter must declare equal parts (valid here:
    num_key_value_heads == num_attention_heads); an undeclared Concatenate is refused with an explanation.
    """
    from transformers import AutoConfig

    ckpt = stock_checkpoint("qwen2_moe_mha")
    namespace = _run_seed_example(ckpt.path)
    config = AutoConfig.from_pretrained(ckpt.path)
    torch.manual_seed(0)
    model = modelpatch.from_config(AutoModelForCausalLM, config)  # seed patches registered globally
    assert type(model.model.layers[0].self_attn) is namespace["FusedQKVAttention"]
    with pytest.raises(modelpatch.ConversionError, match="equal_parts=True"):
        modelpatch.save_pretrained(model, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()

    equal = WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0, equal_parts=True)])
    modelpatch.clear_patch_mapping()
    patcher = modelpatch.Patcher(
        class_mapping={
            "Qwen2MoeExperts": namespace["ModuleListExperts"],
            "Qwen2MoeAttention": namespace["FusedQKVAttention"],
        },
        extra_weight_conversions=[equal],
    )
    modelpatch.register_checkpoint_conversion_mapping(model_type="qwen2_moe", mapping=[], overwrite=True)
    model = modelpatch.from_config(AutoModelForCausalLM, config, patcher=patcher)
    modelpatch.save_pretrained(model, tmp_path / "out")
    saved = read_tensors(tmp_path / "out")
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in ckpt.tensors().items()}
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    inputs = ckpt.inputs()
    torch.testing.assert_close(_logits(stock, inputs), _logits(model, inputs), atol=1e-5, rtol=0)


def test_documented_patcher_example_runs_with_only_its_import_changed(stock_checkpoint, tmp_path):
    """The Patcher quick example (grouped-query attention, sequential experts) through modelpatch's Auto class."""
    ckpt = stock_checkpoint("qwen2_moe")  # 4 heads, 2 key/value heads
    namespace = runpy.run_path(
        str(SEED_EXAMPLE.with_name("seed_patcher_example.py")), init_globals={"CHECKPOINT": str(ckpt.path)}
    )
    model = namespace["model"]
    layer = model.model.layers[0]
    assert type(layer.self_attn) is namespace["FusedQKVAttention"]
    assert type(layer.mlp.experts) is namespace["SequentialExperts"]
    # The same model modelpatch.from_pretrained builds with transformers' Auto class.
    again = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path, patcher=namespace["patcher"])
    assert_bitwise_equal(again.state_dict(), model.state_dict())

    stock = AutoModelForCausalLM.from_pretrained(ckpt.path)
    inputs = ckpt.inputs()
    torch.testing.assert_close(_logits(model, inputs), _logits(stock, inputs), atol=1e-5, rtol=0)
    # Both save paths write the stock checkpoint again, bit for bit.
    modelpatch.save_pretrained(model, tmp_path / "saved")
    model.save_pretrained(tmp_path / "stock_method")
    for out in ("saved", "stock_method"):
        assert (tmp_path / out / "model.safetensors").read_bytes() == (ckpt.path / "model.safetensors").read_bytes()
    # Only the import line differs from the documented code: nothing global changed in transformers.
    assert (
        type(AutoModelForCausalLM.from_pretrained(ckpt.path).model.layers[0].self_attn).__name__ == "Qwen2MoeAttention"
    )


def test_modelpatch_auto_classes_stand_for_transformers(stock_checkpoint):
    from modelpatch import AutoModel
    from modelpatch import AutoModelForCausalLM as PatchedAuto

    ckpt = stock_checkpoint("llama")
    assert PatchedAuto.transformers_class is AutoModelForCausalLM
    model = PatchedAuto.from_pretrained(ckpt.path, fusion_config={"qkv": True})
    assert type(model.model.layers[0].self_attn).__name__ == "QKVFusedLlamaAttention"
    assert type(AutoModel.from_pretrained(ckpt.path)).__name__ == "LlamaModel"
    built = PatchedAuto.from_config(model.config, fusion_config={"gate_up": True})
    assert type(built.model.layers[0].mlp).__name__ == "InputProjFusedLlamaMLP"
    with pytest.raises(OSError, match="from_pretrained"):
        PatchedAuto()
    with pytest.raises(AttributeError, match="no Auto model class 'AutoModelForNothing'"):
        modelpatch.AutoModelForNothing  # noqa: B018


def test_the_documented_patcher_applied_to_a_model_in_memory(stock_checkpoint, tmp_path):
    """modelpatch.patch_model: the Patcher example on a model stock transformers loaded, as a load would apply it."""
    ckpt = stock_checkpoint("qwen2_moe")
    namespace = runpy.run_path(
        str(SEED_EXAMPLE.with_name("seed_patcher_example.py")), init_globals={"CHECKPOINT": str(ckpt.path)}
    )
    live = AutoModelForCausalLM.from_pretrained(ckpt.path)
    assert modelpatch.patch_model(live, namespace["patcher"]) is live
    loaded = namespace["model"]
    assert {n: type(m) for n, m in live.named_modules()} == {n: type(m) for n, m in loaded.named_modules()}
    assert_bitwise_equal(live.state_dict(), loaded.state_dict())
    modelpatch.save_pretrained(live, tmp_path / "saved")
    assert (tmp_path / "saved" / "model.safetensors").read_bytes() == (ckpt.path / "model.safetensors").read_bytes()
