"""A second adapter on a PeftModel that modelpatch made on a ``linear_experts`` model, added through PEFT's own
``add_adapter`` / ``load_adapter``: its expert LoRA is there, in stock's ``target_parameters`` form, and both adapters
compute what the same two adapters compute with stock PEFT on the stock model (fp32, within 1e-5, each active in turn)
and save as stock's, bitwise. Stock ``PeftModel.from_pretrained`` of a stock expert adapter onto the fused model,
which cannot be hooked before PEFT makes its layers, is refused by name when it loads the weights it would drop.
"""

from __future__ import annotations

import copy
import inspect
from pathlib import Path

import peft
import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file

import modelpatch
from modelpatch.errors import PeftIntegrationError
from support.expert_adapters import write_per_expert_adapter
from support.models import VOCAB

TOLERANCE = {"atol": 1e-5, "rtol": 0}
FUSED = {"qkv": True, "gate_up": True, "linear_experts": True}
STOCK_TARGETS = ["experts.gate_up_proj", "experts.down_proj"]
# The expert projections' names per family (gate, up, down), as a user targets them by module name.
NAMES = {"qwen3_moe": ["gate_proj", "up_proj", "down_proj"], "mixtral": ["w1", "w3", "w2"]}


def _lora(**kwargs) -> LoraConfig:
    return LoraConfig(**{"r": 2, "lora_alpha": 4, "init_lora_weights": False, **kwargs})


def _configs(name: str, targets: str) -> tuple[LoraConfig, LoraConfig]:
    """The first and the second adapter's configs: expert LoRA by stock target_parameters, "all-linear" or the
    expert projections' names (PEFT wants every adapter's target_parameters alike, so both target the experts
    the same way; ranks and the other targets differ)."""
    if targets == "target_parameters":
        return (
            _lora(target_modules=["q_proj"], target_parameters=STOCK_TARGETS),
            _lora(r=3, lora_alpha=5, target_modules=["v_proj"], target_parameters=STOCK_TARGETS),
        )
    if targets == "all-linear":
        return _lora(target_modules="all-linear"), _lora(r=3, lora_alpha=5, target_modules="all-linear")
    return _lora(target_modules=["q_proj", *NAMES[name]]), _lora(r=3, lora_alpha=5, target_modules=NAMES[name])


def _logits(model: torch.nn.Module) -> torch.Tensor:
    input_ids = torch.randint(0, VOCAB - 8, (2, 12), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def _saved(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "adapter_model.safetensors")


def _assert_same_tensors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


def _two_adapters(model: torch.nn.Module, make, first: LoraConfig, second: LoraConfig, how: str, saved: Path):
    """``make(model, first)`` under seed 0, then the second adapter added through the PeftModel's own method."""
    torch.manual_seed(0)
    peft_model = make(model, first)
    torch.manual_seed(1)
    if how == "add_adapter":
        peft_model.add_adapter("second", second)
    else:
        peft_model.load_adapter(saved, adapter_name="second")
    return peft_model


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("targets", ["target_parameters", "all-linear", "names"])
@pytest.mark.parametrize("how", ["add_adapter", "load_adapter"])
def test_a_second_expert_adapter_through_peft_is_stocks(tiny, tmp_path, name, targets, how):
    ckpt = tiny(name)
    first, second = _configs(name, targets)
    # The adapter load_adapter reads: stock PEFT's, made on the stock model.
    torch.manual_seed(2)
    peft.get_peft_model(ckpt.model_class.from_pretrained(ckpt.path), second).save_pretrained(tmp_path / "saved")

    stock = _two_adapters(
        ckpt.model_class.from_pretrained(ckpt.path), peft.get_peft_model, first, second, how, tmp_path / "saved"
    )
    fused = _two_adapters(ckpt.load(FUSED), modelpatch.get_peft_model, first, second, how, tmp_path / "saved")
    assert any(".experts." in key and ".second." in key for key in fused.state_dict())

    for adapter in ("default", "second"):
        stock.set_adapter(adapter)
        fused.set_adapter(adapter)
        expected = _logits(stock)
        torch.testing.assert_close(_logits(fused), expected, **TOLERANCE)
    with stock.disable_adapter():
        assert (_logits(fused) - _logits(stock)).abs().max() > 1e-3, "the second adapter changes the outputs"

    stock.save_pretrained(tmp_path / "stock")
    fused.save_pretrained(tmp_path / "fused")
    for directory in ("", "second"):
        _assert_same_tensors(_saved(tmp_path / "fused" / directory), _saved(tmp_path / "stock" / directory))
        # PEFT matches target_parameters in sorted order: the list's order means nothing.
        fused_targets = LoraConfig.from_pretrained(tmp_path / "fused" / directory).target_parameters
        assert sorted(fused_targets) == sorted(
            LoraConfig.from_pretrained(tmp_path / "stock" / directory).target_parameters
        )


def test_the_methods_are_bound_methods_of_the_peft_model_and_its_copies(tiny):
    fused = modelpatch.get_peft_model(tiny("qwen3_moe").load(FUSED), _lora(target_parameters=STOCK_TARGETS))
    copied = copy.deepcopy(fused)
    for model in (fused, copied):
        for name in ("add_adapter", "load_adapter"):
            method = getattr(model, name)
            assert inspect.ismethod(method) and method.__self__ is model and name in model.__dict__
    torch.manual_seed(1)
    copied.add_adapter("second", _lora(r=3, target_parameters=STOCK_TARGETS))
    assert any(".experts." in key and ".second." in key for key in copied.state_dict())


def test_a_second_adapter_that_cannot_be_carried_is_refused_before_any_of_its_layers(tiny):
    fused = modelpatch.get_peft_model(
        tiny("qwen3_moe").load(FUSED), _lora(target_modules=["q_proj"], target_parameters=STOCK_TARGETS)
    )
    before = _logits(fused)
    with pytest.raises(PeftIntegrationError, match=r"experts.*lora_dropout=0\.1"):
        fused.add_adapter("second", _lora(target_modules=["v_proj"], target_parameters=STOCK_TARGETS, lora_dropout=0.1))
    assert "second" not in fused.peft_config
    assert not any(".second." in key for key in fused.state_dict())
    torch.testing.assert_close(_logits(fused), before, atol=0, rtol=0)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_stock_from_pretrained_of_an_expert_adapter_on_the_fused_model_is_refused(tiny, tmp_path, name):
    ckpt = tiny(name)
    peft.get_peft_model(
        ckpt.model_class.from_pretrained(ckpt.path), _lora(target_modules=["q_proj"], target_parameters=STOCK_TARGETS)
    ).save_pretrained(tmp_path / "stock")
    with pytest.raises(PeftIntegrationError, match=r"experts.*modelpatch\.load_adapter"):
        peft.PeftModel.from_pretrained(ckpt.load({"linear_experts": True}), tmp_path / "stock")


# qwen3_moe: stock PEFT converts its transformers-4 adapters itself; qwen3_vl_moe: it does not, modelpatch does.
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_vl_moe"])
def test_a_transformers_4_adapter_as_the_second_converts_as_a_first_one(tiny, tmp_path, name):
    """PEFT's load_adapter of a transformers-4 adapter (per-expert LoRA) beside a first adapter: converted into the
    stock form as modelpatch.load_adapter converts it alone (which the tests of test_peft_experts.py hold against
    stock PEFT), computing and saving the same; where stock PEFT converts it too, what stock PEFT's load_adapter
    computes and saves on the stock model."""
    ckpt = tiny(name)
    fused_model = ckpt.load({"linear_experts": True})
    directory = tmp_path / "transformers4"
    write_per_expert_adapter(fused_model, directory, lambda names: _lora(target_modules=names))
    first = _lora(target_modules=["q_proj"], target_parameters=["gate_up_proj", "down_proj"])

    fused = _two_adapters(fused_model, modelpatch.get_peft_model, first, first, "load_adapter", directory)
    alone = modelpatch.load_adapter(ckpt.load({"linear_experts": True}), directory)
    fused.set_adapter("second")
    torch.testing.assert_close(_logits(fused), _logits(alone), **TOLERANCE)
    with alone.disable_adapter():
        assert (_logits(fused) - _logits(alone)).abs().max() > 1e-3, "the converted adapter changes the outputs"
    fused.save_pretrained(tmp_path / "fused")
    alone.save_pretrained(tmp_path / "alone")
    _assert_same_tensors(_saved(tmp_path / "fused" / "second"), _saved(tmp_path / "alone"))
    if name == "qwen3_moe":
        stock_model = ckpt.model_class.from_pretrained(ckpt.path)
        stock = _two_adapters(stock_model, peft.get_peft_model, first, first, "load_adapter", directory)
        for adapter in ("default", "second"):
            stock.set_adapter(adapter)
            fused.set_adapter(adapter)
            torch.testing.assert_close(_logits(fused), _logits(stock), **TOLERANCE)
        stock.save_pretrained(tmp_path / "stock")
        _assert_same_tensors(_saved(tmp_path / "fused" / "second"), _saved(tmp_path / "stock" / "second"))


def test_after_peft_refuses_a_second_adapter_the_first_computes_as_before(tiny):
    """PEFT's own refusal (adapters with target_parameters must all target the same parameters) while the experts
    stand in stock form: they are put back with the first adapter, which computes as before and saves as before."""
    ckpt = tiny("qwen3_moe")
    first = _lora(target_modules=["q_proj"], target_parameters=STOCK_TARGETS)
    torch.manual_seed(0)
    fused = modelpatch.get_peft_model(ckpt.load(FUSED), first)
    before = _logits(fused)
    with pytest.raises(ValueError, match="must target the same set of parameters"):
        fused.add_adapter("second", _lora(target_parameters=["experts.gate_up_proj"]))
    torch.testing.assert_close(_logits(fused), before, atol=0, rtol=0)
    torch.manual_seed(0)
    stock = peft.get_peft_model(ckpt.model_class.from_pretrained(ckpt.path), first)
    torch.testing.assert_close(_logits(fused), _logits(stock), **TOLERANCE)
    assert {k for k in fused.state_dict() if ".lora_" in k} == {k for k in stock.state_dict() if ".lora_" in k}
