"""PEFT on fused models, against stock transformers + stock PEFT on the same tiny stock-saved checkpoints.

Adapters are made with nonzero A and B (``init_lora_weights=False``), so a LoRA layer on the wrong rows, a lost
merge or a missing module shows in the logits.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import peft
import pytest
import torch
from peft import IA3Config, LoraConfig
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file

import modelpatch
from modelpatch.errors import CheckpointError, ModelPatchError, PeftIntegrationError
from modelpatch.fusions.projections import FusedLinear, ProjectionSlice
from support.compare import ATOL
from support.models import VOCAB

FUSED = {"qkv": True, "gate_up": True}
FUSED_EXPERTS = {**FUSED, "linear_experts": True}
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _logits(model: torch.nn.Module) -> torch.Tensor:
    input_ids = torch.randint(0, VOCAB - 8, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


def _lora(target_modules, **kwargs) -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=target_modules, **kwargs)


def _random_adapter(model: torch.nn.Module, target_modules) -> peft.PeftModel:
    """Stock PEFT with nonzero A and B."""
    torch.manual_seed(0)
    return peft.get_peft_model(model, _lora(target_modules, init_lora_weights=False))


def _lora_state(peft_model: peft.PeftModel) -> dict[str, torch.Tensor]:
    return {key: value for key, value in peft_model.state_dict().items() if ".lora_" in key}


def _copy_adapter(source: peft.PeftModel, target: peft.PeftModel) -> None:
    """``source``'s adapter weights into ``target``, which must have exactly the same adapter keys."""
    assert _lora_state(target).keys() == _lora_state(source).keys()
    result = target.load_state_dict(_lora_state(source), strict=False)
    assert not result.unexpected_keys


def _assert_fused_structure(model: torch.nn.Module) -> None:
    attention = model.model.layers[0].self_attn
    assert type(attention.qkv_proj) is FusedLinear
    assert all(type(getattr(attention, name)) is ProjectionSlice for name in ("q_proj", "k_proj", "v_proj"))


# --- 1. LoRA on the fused layers, plain PEFT --------------------------------------------------------------------

# qwen2_moe: its experts are plain nn.Linear with linear_experts; a regex keeps PEFT off the shared expert's slices.
FUSED_TARGETS = {
    "llama": (FUSED, ["qkv_proj", "gate_up_proj"]),
    "qwen2_moe": (FUSED_EXPERTS, r".*\.(qkv_proj|gate_up_proj|experts\.\d+\.(gate_proj|up_proj|down_proj))"),
}


@pytest.mark.parametrize("name", sorted(FUSED_TARGETS))
def test_lora_on_fused_layers_trains_and_merges(tiny, name):
    ckpt = tiny(name)
    fusion_config, target_modules = FUSED_TARGETS[name]
    peft_model = _random_adapter(ckpt.load(fusion_config), target_modules)
    attention = peft_model.base_model.model.model.layers[0].self_attn
    assert isinstance(attention.qkv_proj, peft.tuners.lora.Linear)
    assert type(attention.qkv_proj.base_layer) is FusedLinear
    assert type(attention.q_proj) is ProjectionSlice, "the slices stay, and run the LoRA layer through qkv_proj"

    input_ids = torch.randint(0, VOCAB - 8, (4, 32), generator=torch.Generator().manual_seed(1))
    peft_model(input_ids=input_ids, labels=input_ids).loss.backward()
    adapter = {key: param for key, param in peft_model.named_parameters() if ".lora_" in key}
    assert adapter and all(param.requires_grad for param in adapter.values())
    if name == "qwen2_moe":
        assert any(".experts.3.down_proj." in key for key in adapter)
    no_gradient = [key for key, param in adapter.items() if param.grad is None or not param.grad.any()]
    assert not no_gradient, f"adapter weights without gradient: {no_gradient[:5]}"

    adapted = _logits(peft_model)
    assert (adapted - ckpt.stock_outputs()["logits"]).abs().max() > 1e-2, "the adapter should change the outputs"
    merged = peft_model.merge_and_unload()
    _assert_fused_structure(merged)
    _assert_close(_logits(merged), adapted)


# --- 2. PEFT's usual recipe on the original names -------------------------------------------------------------


HINT = r"modelpatch\.get_peft_model / modelpatch\.load_adapter"


def test_plain_peft_refuses_projection_slices_naming_modelpatchs_entry_points(tiny, tmp_path):
    """Why modelpatch.get_peft_model exists: stock PEFT has no LoRA layer for a ProjectionSlice; each stock entry
    point's error says what adapts the original names."""
    checkpoint = tiny("llama")
    with pytest.raises(ValueError, match=HINT):
        peft.get_peft_model(checkpoint.load(FUSED), _lora(["q_proj", "v_proj"]))
    stock = peft.get_peft_model(checkpoint.model_class.from_pretrained(checkpoint.path), _lora(["q_proj", "v_proj"]))
    stock.save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match=HINT):
        peft.PeftModel.from_pretrained(checkpoint.load(FUSED), tmp_path / "adapter")
    with pytest.raises(ValueError, match=HINT):
        checkpoint.load(FUSED).load_adapter(tmp_path / "adapter")


ALL_LINEAR_REFUSED = r"'all-linear' would adapt the fused layers .*\.qkv(_proj)? \(.*modelpatch\.get_peft_model"


# bert: its fused attention holds no other Linear (the output projection is another module's); qwen3_moe: PEFT
# resolves "all-linear" inside its transformers-v5 target rewrite, before injecting.
@pytest.mark.parametrize(
    "name, fusion_config",
    [("llama", FUSED), ("qwen2_moe", FUSED_EXPERTS), ("qwen3_moe", FUSED), ("bert", {"qkv": True})],
)
def test_stock_all_linear_on_a_fused_model_is_refused_before_any_adapter_layer(tiny, name, fusion_config):
    """Stock PEFT's "all-linear" finds the fused layers; their adapter would name the original checkpoint as its base,
    where stock PEFT drops their weights without a word. Refused (LoRA and IA3 alike) while PEFT resolves the targets,
    naming the fused layers and modelpatch.get_peft_model, with no adapter layer made."""
    model = tiny(name).load(fusion_config)
    for make_adapter in (
        lambda: peft.get_peft_model(model, _lora("all-linear")),
        lambda: peft.get_peft_model(model, IA3Config(target_modules="all-linear", feedforward_modules=[])),
    ):
        with pytest.raises(PeftIntegrationError, match=ALL_LINEAR_REFUSED):
            make_adapter()
        assert not any(isinstance(module, BaseTunerLayer) for module in model.modules())
    assert model.get_output_embeddings() is type(model).get_output_embeddings(model), "other callers: transformers'"
    # What the error points to takes the same model and config.
    assert any(isinstance(m, ProjectionSlice) for m in modelpatch.get_peft_model(model, _lora("all-linear")).modules())


# qwen2_moe without linear_experts: LoRA weights of per-expert Linears do not load on transformers' 3-D experts.
@pytest.mark.parametrize("name", ["llama", "qwen2_moe"])
def test_all_linear_adapter_of_a_fused_model_loads_on_the_stock_checkpoint(tiny, tmp_path, name):
    """What the refusal points to: modelpatch.get_peft_model's "all-linear" adapter, saved by stock PEFT, loads with
    stock PeftModel.from_pretrained on the checkpoint it names as its base and computes what the fused model does."""
    ckpt = tiny(name)
    torch.manual_seed(0)
    fused = modelpatch.get_peft_model(ckpt.load(FUSED), _lora("all-linear", init_lora_weights=False))
    fused.save_pretrained(tmp_path)

    stock = peft.PeftModel.from_pretrained(ckpt.model_class.from_pretrained(ckpt.path), tmp_path)
    assert _lora_state(stock).keys() == _lora_state(fused).keys()
    _assert_close(_logits(stock), _logits(fused))


# qwen3_moe: PEFT rewrites "all-linear" for transformers' fused 3-D experts (experts and router as parameters).
@pytest.mark.parametrize(
    "name, target_modules",
    [
        ("llama", ["q_proj", "v_proj"]),
        ("llama", "all-linear"),
        ("qwen2_moe", ["q_proj", "v_proj"]),
        ("qwen2_moe", "all-linear"),
        ("qwen2_moe", ALL_PROJECTIONS),
        ("qwen3_moe", "all-linear"),
    ],
)
def test_original_names_match_stock(tiny, name, target_modules):
    ckpt = tiny(name)
    stock = _random_adapter(ckpt.model_class.from_pretrained(ckpt.path), target_modules)
    config = _lora(target_modules)
    fused = modelpatch.get_peft_model(ckpt.load(FUSED), config)
    assert config.target_modules == _lora(target_modules).target_modules, "the caller's config is not modified"

    _copy_adapter(stock, fused)  # same key names: the slices keep the original names
    assert not any(isinstance(module, FusedLinear) for module in fused.modules() if hasattr(module, "lora_A"))
    _assert_close(_logits(fused), _logits(stock))

    merged = fused.merge_and_unload(safe_merge=True)  # safe merge assigns .data: the delta must reach the rows
    _assert_fused_structure(merged)
    _assert_close(_logits(merged), _logits(stock.merge_and_unload()))


def test_merge_adapter_then_unmerge_restores_the_fused_rows(tiny):
    ckpt = tiny("llama")
    peft_model = modelpatch.get_peft_model(ckpt.load(FUSED), _lora("all-linear", init_lora_weights=False))
    attention = peft_model.base_model.model.model.layers[0].self_attn
    original = attention.qkv_proj.weight.detach().clone()
    adapted = _logits(peft_model)

    peft_model.merge_adapter(safe_merge=True)
    assert not torch.allclose(attention.qkv_proj.weight, original)
    _assert_close(_logits(peft_model), adapted)
    peft_model.unmerge_adapter()
    torch.testing.assert_close(attention.qkv_proj.weight, original, atol=1e-6, rtol=0)
    _assert_close(_logits(peft_model), adapted)


def test_non_lora_configs(tiny):
    ckpt = tiny("llama")
    # Explicit targets, PEFT's default IA3 targets for llama (k_proj, v_proj, down_proj) and "all-linear" reach slices.
    for config in (
        IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
        IA3Config(),
        IA3Config(target_modules="all-linear", feedforward_modules=[]),
    ):
        with pytest.raises(PeftIntegrationError, match="IA3Config") as raised:
            modelpatch.get_peft_model(ckpt.load(FUSED), config)
        assert isinstance(raised.value, ModelPatchError) and "qkv_proj" in str(raised.value)

    config = IA3Config(target_modules=["o_proj", "down_proj"], feedforward_modules=["down_proj"])
    peft_model = modelpatch.get_peft_model(ckpt.load(FUSED), config)
    adapted = {name for name, module in peft_model.named_modules() if isinstance(module, peft.tuners.ia3.IA3Layer)}
    expected = {f"layers.{i}.{m}" for i in (0, 1) for m in ("self_attn.o_proj", "mlp.down_proj")}
    assert adapted == {f"base_model.model.model.{name}" for name in expected}


# --- 3. Adapters saved with PEFT --------------------------------------------------------------------------------


@pytest.mark.parametrize("name, fusion_config", [("llama", FUSED), ("qwen2_moe", FUSED_EXPERTS)])
def test_load_adapter_saved_from_stock(tiny, tmp_path, name, fusion_config):
    """Suffix targets as PEFT saves them; with linear_experts they also match the per-expert Linears, which the
    stock adapter has no weights for and which therefore stay without LoRA."""
    ckpt = tiny(name)
    stock = _random_adapter(ckpt.model_class.from_pretrained(ckpt.path), ALL_PROJECTIONS)
    stock.save_pretrained(tmp_path)

    loaded = modelpatch.load_adapter(ckpt.load(fusion_config), tmp_path)
    assert isinstance(loaded, peft.PeftModel)
    assert _lora_state(loaded).keys() == _lora_state(stock).keys()
    assert not any(param.requires_grad for param in loaded.parameters())
    _assert_close(_logits(loaded), _logits(stock))


def test_adapter_config_nested_past_the_parsers_recursion_limit_is_named(tiny, tmp_path):
    ckpt = tiny("llama")
    _random_adapter(ckpt.model_class.from_pretrained(ckpt.path), ALL_PROJECTIONS).save_pretrained(tmp_path)
    config_file = tmp_path / "adapter_config.json"
    text = config_file.read_text().rstrip().removesuffix("}")
    config_file.write_text(text + ', "extra": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(CheckpointError, match="nested") as info:
        modelpatch.load_adapter(ckpt.load(FUSED), tmp_path)
    assert str(config_file) in str(info.value)


def test_adapter_on_expert_linears_reloads(tiny, tmp_path):
    """The experts' LoRA of a linear_experts model is saved in stock PEFT's target_parameters form; load_adapter
    reads it back onto the fused model, under another adapter name, trainable, without PEFT's warning of missing
    keys."""
    ckpt = tiny("qwen2_moe")
    torch.manual_seed(0)
    trained = modelpatch.get_peft_model(ckpt.load(FUSED_EXPERTS), _lora(ALL_PROJECTIONS, init_lora_weights=False))
    trained.save_pretrained(tmp_path)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = modelpatch.load_adapter(ckpt.load(FUSED_EXPERTS), tmp_path, adapter_name="experts", is_trainable=True)
    assert not [w for w in caught if "missing adapter keys" in str(w.message)]
    assert loaded.active_adapter == "experts"
    assert all(param.requires_grad for key, param in loaded.named_parameters() if ".lora_" in key)
    _assert_close(_logits(loaded), _logits(trained))


# --- 4. Without peft -----------------------------------------------------------------------------------------------


def test_modelpatch_imports_without_peft():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["peft"] = None  # what an environment without peft looks like to an import
        import modelpatch
        try:
            modelpatch.get_peft_model(None, None)
        except ImportError as error:
            assert "pip install peft" in str(error), error
        else:
            raise AssertionError("no ImportError")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


# init_lora_weights: PEFT's default (random A, zero B) and random A and B; "all-linear" and explicit names.
@pytest.mark.parametrize(
    "name, fusion_config, target_modules, init",
    [
        ("llama", FUSED, "all-linear", True),
        ("llama", FUSED, ALL_PROJECTIONS, False),
        ("llama", FUSED, ["v_proj", "up_proj"], True),
        ("qwen3_moe", FUSED_EXPERTS, "all-linear", False),
        ("qwen3_moe", FUSED_EXPERTS, "all-linear", True),
        ("qwen3_moe", FUSED_EXPERTS, ALL_PROJECTIONS, False),
    ],
)
def test_initial_adapter_under_one_seed_is_stocks_bitwise(tiny, tmp_path, name, fusion_config, target_modules, init):
    """modelpatch.get_peft_model creates the adapter layers in the stock model's order (the parts stand where the
    originals stood), so under one seed a fused model draws stock's initial LoRA weights: the saved adapters are the
    same tensors, bitwise (an A/B run of fused against stock starts from the same adapter)."""
    ckpt = tiny(name)
    adapters = {}
    for side, model, make in (
        ("stock", ckpt.model_class.from_pretrained(ckpt.path), peft.get_peft_model),
        ("fused", ckpt.load(fusion_config), modelpatch.get_peft_model),
    ):
        torch.manual_seed(0)  # after the load: the seed is for the adapter alone
        make(model, _lora(target_modules, init_lora_weights=init)).save_pretrained(tmp_path / side)
        adapters[side] = load_file(tmp_path / side / "adapter_model.safetensors")
    assert adapters["fused"].keys() == adapters["stock"].keys()
    for key, tensor in adapters["stock"].items():
        assert torch.equal(adapters["fused"][key], tensor), key
