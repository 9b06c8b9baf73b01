"""Patches during construction, and the conversion list: extra conversions first, then the model type's minus
filtered."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP

import modelpatch
from modelpatch import MergeModulelist, Patcher, WeightConverter, WeightRenaming
from modelpatch.conversion.registry import get_checkpoint_conversion_mapping
from modelpatch.errors import PatchError
from support.compare import assert_bitwise_equal
from support.files import rewrite_checkpoint
from support.models import sized_config


class CountingMLP(LlamaMLP):
    """Same weights as LlamaMLP; counts forwards."""

    calls = 0

    def forward(self, x):
        type(self).calls += 1
        return super().forward(x)


class OtherMLP(LlamaMLP):
    pass


class MarkedAttention(LlamaAttention):
    pass


def test_registered_patch_applies_to_from_pretrained(stock_checkpoint):
    ckpt = stock_checkpoint("llama")
    modelpatch.register_patch_mapping({"LlamaMLP": CountingMLP})
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path)
    assert all(type(layer.mlp) is CountingMLP for layer in model.model.layers)
    stock = AutoModelForCausalLM.from_pretrained(ckpt.path)
    assert type(stock.model.layers[0].mlp) is LlamaMLP  # stock transformers is untouched
    CountingMLP.calls = 0
    with torch.no_grad():
        assert torch.equal(model(**ckpt.inputs()).logits, stock(**ckpt.inputs()).logits)
    assert CountingMLP.calls == 2


def test_patcher_wins_over_the_registry_and_is_scoped(stock_checkpoint):
    ckpt = stock_checkpoint("llama")
    modelpatch.register_patch_mapping({"LlamaMLP": OtherMLP})
    model = modelpatch.from_pretrained(LlamaForCausalLM, ckpt.path, patcher=Patcher({"LlamaMLP": CountingMLP}))
    assert type(model.model.layers[0].mlp) is CountingMLP
    model = modelpatch.from_pretrained(LlamaForCausalLM, ckpt.path)
    assert type(model.model.layers[0].mlp) is OtherMLP


def test_patcher_applies_to_from_config():
    config = sized_config("llama", vocab=64, hidden=32, intermediate=48, layers=1, heads=2, kv_heads=1)
    model = modelpatch.from_config(AutoModelForCausalLM, config, patcher=Patcher({"LlamaMLP": CountingMLP}))
    assert type(model.model.layers[0].mlp) is CountingMLP
    assert type(modelpatch.from_config(AutoModelForCausalLM, config).model.layers[0].mlp) is LlamaMLP


def test_conversion_list_is_extras_then_unfiltered_builtins(stock_checkpoint, tmp_path):
    ckpt = stock_checkpoint("qwen2_moe")
    gate_up, down = get_checkpoint_conversion_mapping("qwen2_moe")
    # Replace only the down_proj converter by an equivalent one of our own.
    extra = WeightConverter("mlp.experts.*.down_proj.weight", "mlp.experts.down_proj", [MergeModulelist(dim=0)])
    patcher = Patcher(filtered_weight_conversion_patterns=r"\*\.down_proj", extra_weight_conversions=extra)
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path, patcher=patcher)
    report = modelpatch.get_load_report(model)
    assert list(report.transforms) == [extra, gate_up]
    assert {g.converter for g in report.groups} == {extra, gate_up}
    reference = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path)
    assert_bitwise_equal(model.state_dict(), reference.state_dict())
    modelpatch.save_pretrained(model, tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (ckpt.path / "model.safetensors").read_bytes()


def test_transformers_own_converter_through_a_patcher(stock_checkpoint, tmp_path):
    """transformers' WeightConverter is accepted where modelpatch's is, and translated."""
    from transformers import core_model_loading as hf

    ckpt = stock_checkpoint("qwen2_moe")
    extra = hf.WeightConverter("mlp.experts.*.down_proj.weight", "mlp.experts.down_proj", [hf.MergeModulelist(dim=0)])
    patcher = Patcher(filtered_weight_conversion_patterns=r"\*\.down_proj", extra_weight_conversions=extra)
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path, patcher=patcher)
    report = modelpatch.get_load_report(model)
    assert WeightConverter("mlp.experts.*.down_proj.weight", "mlp.experts.down_proj", [MergeModulelist(dim=0)]) in {
        g.converter for g in report.groups
    }
    assert_bitwise_equal(model.state_dict(), modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path).state_dict())
    modelpatch.save_pretrained(model, tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (ckpt.path / "model.safetensors").read_bytes()


def test_extra_renaming_through_a_patcher(stock_checkpoint, tmp_path):
    """A checkpoint with renamed keys loads with an extra WeightRenaming and saves back under its own names."""

    def edit(tensors):
        for key in list(tensors):
            if ".mlp." in key:
                tensors[key.replace(".mlp.", ".feed_forward.")] = tensors.pop(key)

    directory = rewrite_checkpoint(stock_checkpoint("llama").path, tmp_path / "renamed", edit)
    patcher = Patcher(extra_weight_conversions=[WeightRenaming(r"\.feed_forward\.", ".mlp.")])
    model = modelpatch.from_pretrained(AutoModelForCausalLM, directory, patcher=patcher)
    reference = modelpatch.from_pretrained(AutoModelForCausalLM, stock_checkpoint("llama").path)
    assert_bitwise_equal(model.state_dict(), reference.state_dict())
    modelpatch.save_pretrained(model, tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (directory / "model.safetensors").read_bytes()


def test_report_summary_and_absent_report(stock_checkpoint):
    ckpt = stock_checkpoint("mixtral")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path)
    summary = modelpatch.get_load_report(model).summary()
    assert "converted groups: 4" in summary and "renamed: 2" in summary
    assert modelpatch.get_load_report(AutoModelForCausalLM.from_pretrained(ckpt.path)) is None
    assert modelpatch.get_load_report(torch.nn.Linear(1, 1)) is None


# --- what a load replaced, and keys that matched nothing ---------------------------------------------------------


def test_report_lists_each_replaced_class_with_its_key_and_replacement(stock_checkpoint):
    ckpt = stock_checkpoint("llama")
    modelpatch.register_patch_mapping({"MLP": OtherMLP})  # a plain word: matched with re.search
    model = modelpatch.from_pretrained(
        AutoModelForCausalLM, ckpt.path, patcher=Patcher({"^LlamaAttention$": MarkedAttention})
    )
    assert type(model.model.layers[0].mlp) is OtherMLP
    assert modelpatch.get_load_report(model).replaced == {
        "LlamaAttention": ("^LlamaAttention$", f"{__name__}.MarkedAttention"),
        "LlamaMLP": ("MLP", f"{__name__}.OtherMLP"),
    }
    assert modelpatch.get_load_report(modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path)).replaced == {
        "LlamaMLP": ("MLP", f"{__name__}.OtherMLP")
    }


def test_a_key_that_matches_nothing_in_a_load_is_a_warning_naming_it(stock_checkpoint, caplog):
    ckpt = stock_checkpoint("llama")
    # "LlamaMLP" matches a class the load builds, even though the Patcher's "MLP$" wins over it: no warning.
    modelpatch.register_patch_mapping({"LlamaMLP": CountingMLP, "Qwen2MoeExperts": CountingMLP})
    patcher = Patcher({"LlamaAtention": MarkedAttention, "MLP$": OtherMLP})  # a typo, and a pattern that applies
    with caplog.at_level(logging.WARNING, logger="modelpatch"):
        model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path, patcher=patcher)
    warnings = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "Patch key" in r.getMessage()
    ]
    assert len(warnings) == 2
    assert "'LlamaAtention' of the Patcher matched no class built by this load of LlamaForCausalLM" in warnings[0]
    assert "'Qwen2MoeExperts' of the global patch registry matched no class" in warnings[1]
    assert type(model.model.layers[0].self_attn) is LlamaAttention
    assert type(model.model.layers[0].mlp) is OtherMLP

    caplog.clear()
    config = sized_config("llama", vocab=64, hidden=32, intermediate=48, layers=1, heads=2, kv_heads=1)
    with caplog.at_level(logging.WARNING, logger="modelpatch"):
        modelpatch.from_config(AutoModelForCausalLM, config, patcher=patcher)
    assert "'LlamaAtention' of the Patcher matched no class" in caplog.text


def test_a_patch_that_replaces_the_model_class_by_a_plain_module_is_refused_by_name(stock_checkpoint):
    """``".*"`` matches the model class too: the load built an ``nn.Identity`` as the model and failed on the first
    PreTrainedModel attribute it asked for (an AttributeError traceback)."""
    ckpt = stock_checkpoint("llama")
    patcher = Patcher({".*": torch.nn.Identity})
    message = (
        r"The patch '\.\*' replaces the model class LlamaForCausalLM itself by torch\.nn\.modules\.linear\.Identity"
    )
    with pytest.raises(PatchError, match=message):
        modelpatch.from_pretrained(LlamaForCausalLM, ckpt.path, patcher=patcher)
    with pytest.raises(PatchError, match=message):
        modelpatch.from_config(LlamaForCausalLM, AutoConfig.from_pretrained(ckpt.path), patcher=patcher)
