"""LoRA on the experts of ``linear_experts`` models, against stock PEFT's ``target_parameters`` LoRA on the stock 3-D
experts: adapters made on either side load on the other and compute the same (fp32, within 1e-5), a round trip
through the fused model gives back the same tensors bitwise, a training step is stock's, and what cannot be carried
exactly is refused before any adapter layer exists.

Every experts layout ``linear_experts`` fuses is covered, with the zoo sweep's tiny configs (``benchmarks/zoo.py``),
as ``tests/fusions/test_linear_experts_layouts.py`` covers the fusion itself. Adapters are random in A and B
(``init_lora_weights=False``), so a wrong row, column or expert shows in the outputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch
import transformers
from packaging.version import Version
from peft import AdaLoraConfig, IA3Config, LoraConfig
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file, save_file

import modelpatch
from modelpatch.errors import PeftIntegrationError
from modelpatch.fusions.linear_experts.modules import LinearExperts
from support.compare import assert_outputs_close
from support.expert_adapters import EXPERT_FAMILIES, write_per_expert_adapter
from support.models import VOCAB
from support.zoo import load_zoo

zoo = load_zoo()

TOLERANCE = {"atol": 1e-5}
EXPERTS = {"linear_experts": True}
FUSED = {"qkv": True, "gate_up": True, "linear_experts": True}
STOCK_TARGETS = ["experts.gate_up_proj", "experts.down_proj"]


def _checkpoint(name: str, root: Path) -> tuple[type, Path]:
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    if name == "AriaTextForCausalLM" and Version(transformers.__version__) < Version("5.18"):
        # Before 5.18 Aria's experts are another class, without 3-D weights: linear_experts leaves them as they are.
        pytest.skip(f"transformers {transformers.__version__}: Aria's experts have no 3-D weights before 5.18")
    cls = getattr(transformers, name)
    torch.manual_seed(0)
    model = cls(zoo.tiny_config(cls.config_class))
    zoo._perturb(model)
    path = root / name
    model.save_pretrained(path)
    return cls, path


def _outputs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    model.eval()
    with torch.no_grad():
        return zoo._forward(
            model, zoo.dummy_inputs(model.get_base_model() if hasattr(model, "get_base_model") else model)[0]
        )


def _lora(**kwargs) -> LoraConfig:
    return LoraConfig(**{"r": 2, "lora_alpha": 4, "init_lora_weights": False, **kwargs})


def _saved(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "adapter_model.safetensors")


def _assert_same_tensors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype and torch.equal(actual[key], value), key


def _no_adapter_layers(model: torch.nn.Module) -> bool:
    return not any(isinstance(module, BaseTunerLayer) for module in model.modules())


@pytest.mark.parametrize("name", EXPERT_FAMILIES)
def test_stock_expert_adapter_loads_computes_and_saves_back_bitwise(tmp_path, name):
    """Stock PEFT's target_parameters adapter of the stock experts, loaded onto the fused model: the same outputs,
    merged too; saved again, the same tensors and targets."""
    cls, path = _checkpoint(name, tmp_path)
    torch.manual_seed(1)
    stock = peft.get_peft_model(cls.from_pretrained(path), _lora(target_modules=[], target_parameters=STOCK_TARGETS))
    stock.save_pretrained(tmp_path / "stock")
    expected = _outputs(stock)
    base = _outputs(cls.from_pretrained(path))
    assert any((expected[k] - base[k]).abs().max() > 1e-3 for k in base), "the adapter changes the outputs"

    fused = modelpatch.load_adapter(modelpatch.from_pretrained(cls, path, fusion_config=EXPERTS), tmp_path / "stock")
    assert any(isinstance(m, LinearExperts) for m in fused.modules())
    assert_outputs_close(_outputs(fused), expected, **TOLERANCE)
    fused.save_pretrained(tmp_path / "again")
    _assert_same_tensors(_saved(tmp_path / "again"), _saved(tmp_path / "stock"))
    saved_config = json.loads((tmp_path / "again" / "adapter_config.json").read_text())
    assert sorted(saved_config["target_parameters"]) == sorted(STOCK_TARGETS)

    assert_outputs_close(_outputs(fused.merge_and_unload()), _outputs(stock.merge_and_unload()), **TOLERANCE)


@pytest.mark.parametrize("name", EXPERT_FAMILIES)
def test_adapter_made_on_the_fused_model_is_the_stock_adapter(tmp_path, name):
    """modelpatch.get_peft_model with expert targets by module name: saved in the target_parameters form, which stock
    PeftModel.from_pretrained loads on the stock model and computes the same with."""
    cls, path = _checkpoint(name, tmp_path)
    fused_model = modelpatch.from_pretrained(cls, path, fusion_config=EXPERTS)
    gate, up, down = next(m for m in fused_model.modules() if isinstance(m, LinearExperts))[0].names
    torch.manual_seed(1)
    fused = modelpatch.get_peft_model(fused_model, _lora(target_modules=[gate, up, down]))
    fused.save_pretrained(tmp_path / "fused")
    saved_config = json.loads((tmp_path / "fused" / "adapter_config.json").read_text())
    assert saved_config["target_parameters"] and not any(
        ".experts." in key and f".{gate}." in key for key in _saved(tmp_path / "fused")
    )

    stock = peft.PeftModel.from_pretrained(cls.from_pretrained(path), tmp_path / "fused")
    assert_outputs_close(_outputs(fused), _outputs(stock), **TOLERANCE)
    assert_outputs_close(_outputs(fused.merge_and_unload()), _outputs(stock.merge_and_unload()), **TOLERANCE)


@pytest.mark.parametrize("name", EXPERT_FAMILIES)
def test_one_seed_draws_stocks_initial_expert_adapter_bitwise(tmp_path, name):
    """Under one seed, modelpatch.get_peft_model on the fused model draws the initial LoRA weights stock PEFT draws
    on the stock model with the stock config (what the fused side saves): PEFT itself makes the experts' layers, on a
    stand-in of the stock experts, in stock's order among the attention's."""
    cls, path = _checkpoint(name, tmp_path)
    fused_model = modelpatch.from_pretrained(cls, path, fusion_config=EXPERTS)
    experts_path, experts = next((n, m) for n, m in fused_model.named_modules() if isinstance(m, LinearExperts))
    gate, up, down = experts[0].names
    # The router's 2-D weight (a stock target parameter too, beside the experts in every MoE layer), so that stock's
    # order interleaves the two kinds layer by layer.
    block = experts_path.rpartition(".")[0]
    routers = [
        n.removeprefix(block.rpartition(".")[0] + ".")
        for n, param in fused_model.named_parameters()
        if n.startswith(f"{block}.") and n.count(".") == block.count(".") + 2 and param.dim() == 2
    ]
    torch.manual_seed(0)
    config = _lora(target_modules=["q_proj", gate, up, down], target_parameters=routers[:1] or None)
    made = modelpatch.get_peft_model(fused_model, config)
    made.save_pretrained(tmp_path / "fused")
    stock_config = LoraConfig.from_pretrained(tmp_path / "fused")
    stock_model = cls.from_pretrained(path)
    torch.manual_seed(0)
    peft.get_peft_model(stock_model, stock_config).save_pretrained(tmp_path / "stock")
    _assert_same_tensors(_saved(tmp_path / "fused"), _saved(tmp_path / "stock"))


# qwen2_moe: not in PEFT's v5 conversion table, with a shared expert (slices with gate_up); the others: PEFT rewrites
# their expert targets itself (and "all-linear" adds the router).
@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe"])
@pytest.mark.parametrize("target_modules", ["all-linear", ["q_proj", "gate_proj", "up_proj", "down_proj"]])
def test_all_linear_and_names_on_fused_moe_models_match_stock(tiny, tmp_path, name, target_modules):
    ckpt = tiny(name)
    if name == "mixtral" and target_modules != "all-linear":
        target_modules = ["q_proj", "w1", "w3", "w2"]
    torch.manual_seed(0)
    fused = modelpatch.get_peft_model(ckpt.load(FUSED), _lora(target_modules=target_modules))
    assert any(".experts." in key for key in fused.state_dict() if ".lora_" in key)
    fused.save_pretrained(tmp_path / "fused")

    stock = peft.PeftModel.from_pretrained(ckpt.model_class.from_pretrained(ckpt.path), tmp_path / "fused")
    assert {k for k in stock.state_dict() if ".lora_" in k} == {k for k in fused.state_dict() if ".lora_" in k}
    input_ids = torch.randint(0, VOCAB - 8, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            fused(input_ids=input_ids).logits, stock(input_ids=input_ids).logits, **TOLERANCE, rtol=0
        )

    again = modelpatch.load_adapter(ckpt.load(FUSED), tmp_path / "fused")
    again.save_pretrained(tmp_path / "again")
    _assert_same_tensors(_saved(tmp_path / "again"), _saved(tmp_path / "fused"))


@pytest.mark.parametrize("name", ["qwen3_moe", "MixtralForCausalLM"])
def test_a_training_step_from_the_same_adapter_is_stocks(tiny, tmp_path, name):
    """From one stock adapter, one AdamW step on the fused model and on the stock model: the same loss, and the same
    adapter after the step (the gate and up parts share each expert's lora_A, as stock's gate_up does)."""
    if name == "qwen3_moe":
        ckpt = tiny(name)
        cls, path = ckpt.model_class, ckpt.path
    else:
        cls, path = _checkpoint(name, tmp_path)
    torch.manual_seed(1)
    made = peft.get_peft_model(
        cls.from_pretrained(path), _lora(target_modules=["q_proj"], target_parameters=STOCK_TARGETS)
    )
    made.save_pretrained(tmp_path / "adapter")

    input_ids = torch.randint(0, VOCAB - 8, (2, 16), generator=torch.Generator().manual_seed(2))
    results = []
    for model in (
        peft.PeftModel.from_pretrained(cls.from_pretrained(path), tmp_path / "adapter", is_trainable=True),
        modelpatch.load_adapter(
            modelpatch.from_pretrained(cls, path, fusion_config=FUSED), tmp_path / "adapter", is_trainable=True
        ),
    ):
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        model.save_pretrained(tmp_path / f"step{len(results)}")
        results.append((loss.detach(), _saved(tmp_path / f"step{len(results)}")))
    (stock_loss, stock_after), (fused_loss, fused_after) = results
    torch.testing.assert_close(fused_loss, stock_loss, **TOLERANCE, rtol=0)
    assert fused_after.keys() == stock_after.keys()
    for key in stock_after:
        torch.testing.assert_close(fused_after[key], stock_after[key], **TOLERANCE, rtol=0)
    assert any(not torch.equal(stock_after[k], v) for k, v in _saved(tmp_path / "adapter").items()), "a step was taken"


# --- refused before any adapter layer exists -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, words",
    [
        (_lora(target_modules=["gate_proj", "up_proj", "down_proj"], lora_dropout=0.1), "lora_dropout=0.1"),
        (_lora(target_modules=["gate_proj", "up_proj", "down_proj"], use_dora=True), "use_dora=True"),
        (_lora(target_modules=["gate_proj", "up_proj", "down_proj"], lora_bias=True), "lora_bias=True"),
        (_lora(target_modules=r".*experts\.0\.(gate_proj|up_proj|down_proj)"), "not every expert"),
        (_lora(target_modules=r".*experts\.\d+\.gate_proj"), "without their up_proj"),
        (_lora(target_modules=["q_proj"], target_parameters=["q_proj.weight"]), "does not hold"),
        (AdaLoraConfig(target_modules=["gate_proj", "up_proj", "down_proj"], total_step=10), "AdaLoraConfig"),
        (IA3Config(target_modules=["down_proj"], feedforward_modules=["down_proj"]), "IA3Config"),
        (_lora(target_modules=r".*\.(qkv_proj|q_proj|k_proj|v_proj)"), "also their parts"),
    ],
)
def test_what_cannot_be_carried_to_stock_is_refused_by_name(tiny, config, words):
    model = tiny("qwen2_moe").load(FUSED)
    with pytest.raises(PeftIntegrationError, match=words) as raised:
        modelpatch.get_peft_model(model, config)
    assert "modelpatch.get_peft_model" not in str(raised.value), "the remedy is not the function that failed"
    assert _no_adapter_layers(model)


def test_adalora_on_fused_projections_is_refused_without_pointing_back(tiny):
    model = tiny("llama").load({"qkv": True, "gate_up": True})
    with pytest.raises(PeftIntegrationError, match="AdaLoraConfig targets .*q_proj") as raised:
        modelpatch.get_peft_model(model, AdaLoraConfig(target_modules="all-linear", total_step=10))
    assert "modelpatch.get_peft_model" not in str(raised.value)
    assert _no_adapter_layers(model)


# Only linear_experts (no fused projection): the experts are the one fused thing "all-linear" finds. qwen3_moe: PEFT
# resolves "all-linear" inside its transformers-v5 target rewrite, before injecting.
@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_stock_all_linear_on_a_linear_experts_model_is_refused_before_any_adapter_layer(tiny, name):
    """Stock PEFT's "all-linear" (what TRL's SFTTrainer runs) would adapt every per-expert Linear, which the stock
    model (two 3-D parameters per experts module) drops on load without a word: refused while PEFT resolves the
    targets, naming the experts modules and the remedy, with no adapter layer made; the remedy takes the same model
    and config."""
    model = tiny(name).load(EXPERTS)
    with pytest.raises(
        PeftIntegrationError,
        match=r"fused layers model\.layers\.0\.mlp\.experts \(gate_up_proj, "
        r"down_proj\).*modelpatch\.get_peft_model.*modelpatch\.load_adapter",
    ):
        peft.get_peft_model(model, _lora(target_modules="all-linear"))
    assert _no_adapter_layers(model)
    adapted = modelpatch.get_peft_model(model, _lora(target_modules="all-linear"))
    assert any(isinstance(module, BaseTunerLayer) for module in adapted.modules())


def _save_per_expert_adapter(peft_model: peft.PeftModel, directory: Path) -> None:
    """What PEFT's save_pretrained writes (on transformers 4, or of stock PEFT's LoRA on per-expert Linears): the
    config and the per-expert weights under their module names."""
    # PEFT's own save of these is refused (see test_stock_peft_saving_per_expert_lora_is_refused_by_name).
    peft_model.peft_config["default"].save_pretrained(directory)
    state = {k.replace(".default.", "."): v for k, v in peft_model.state_dict().items() if ".lora_" in k}
    save_file(state, directory / "adapter_model.safetensors")


def _per_expert_targets(model: torch.nn.Module, children: str = "gate|up|down") -> str:
    """A regex for every expert's Linears of ``model`` (``children``: which of gate / up / down)."""
    gate, up, down = next(m for m in model.modules() if isinstance(m, LinearExperts))[0].names
    names = dict(zip(("gate", "up", "down"), (gate, up, down), strict=True))
    return rf".*\.experts\.\d+\.({'|'.join(names[c] for c in children.split('|'))})"


# Mixtral: stock PEFT rewrites per-expert targets into target_parameters for it (its transformers-v5 table), so it makes
# no per-expert LoRA there; its transformers-4 adapters are the next test's.
@pytest.mark.parametrize("name", [name for name in EXPERT_FAMILIES if name != "MixtralForCausalLM"])
def test_per_expert_adapter_converts_to_the_stock_adapter_exactly(tmp_path, name):
    """A transformers-4-era adapter (per-expert LoRA, here made by stock PEFT on the linear_experts Linears, which
    compute it) loaded by modelpatch: the same outputs as its source; saved, the stock target_parameters adapter
    (gate and up as one LoRA of rank 2r with a block-diagonal B), which stock PEFT loads on the stock model to the
    same outputs; loaded and saved again, the same tensors bitwise."""
    cls, path = _checkpoint(name, tmp_path)
    source_model = modelpatch.from_pretrained(cls, path, fusion_config=EXPERTS)
    torch.manual_seed(1)
    source = peft.get_peft_model(source_model, _lora(target_modules=_per_expert_targets(source_model)))
    _save_per_expert_adapter(source, tmp_path / "per_expert")
    assert any(".experts.1." in key for key in _saved(tmp_path / "per_expert"))
    expected = _outputs(source)

    fused = modelpatch.load_adapter(
        modelpatch.from_pretrained(cls, path, fusion_config=EXPERTS), tmp_path / "per_expert"
    )
    assert_outputs_close(_outputs(fused), expected, **TOLERANCE)
    fused.save_pretrained(tmp_path / "stock_form")
    saved_config = json.loads((tmp_path / "stock_form" / "adapter_config.json").read_text())
    assert {target.rpartition(".")[2] for target in saved_config["target_parameters"]} == {"down_proj", "gate_up_proj"}
    assert saved_config["rank_pattern"] == {r".*\.gate_up_proj": 4}
    assert saved_config["alpha_pattern"] == {r".*\.gate_up_proj": 8}
    assert not any(".experts.1." in key for key in _saved(tmp_path / "stock_form"))

    stock = peft.PeftModel.from_pretrained(cls.from_pretrained(path), tmp_path / "stock_form")
    assert_outputs_close(_outputs(stock), expected, **TOLERANCE)
    again = modelpatch.load_adapter(
        modelpatch.from_pretrained(cls, path, fusion_config=EXPERTS), tmp_path / "stock_form"
    )
    again.save_pretrained(tmp_path / "again")
    _assert_same_tensors(_saved(tmp_path / "again"), _saved(tmp_path / "stock_form"))


@pytest.mark.parametrize("name", ["MixtralForCausalLM", "qwen3_moe"])
def test_transformers_4_adapter_converts_as_stock_peft_converts_it(tiny, tmp_path, name):
    """A transformers-4 adapter of a model type stock PEFT converts itself (per-expert w1 / w3 / w2 LoRA, written here
    as PEFT on transformers 4 writes it): modelpatch's load computes what stock PEFT's load computes on the stock
    model, and saves the tensors stock PEFT converted them into, bitwise."""
    if name == "qwen3_moe":
        ckpt = tiny(name)
        cls, path = ckpt.model_class, ckpt.path
    else:
        cls, path = _checkpoint(name, tmp_path)
    fused_model = modelpatch.from_pretrained(cls, path, fusion_config=EXPERTS)
    directory = tmp_path / "transformers4"
    write_per_expert_adapter(fused_model, directory, lambda names: _lora(target_modules=names))

    stock = peft.PeftModel.from_pretrained(cls.from_pretrained(path), directory)
    fused = modelpatch.load_adapter(fused_model, directory)
    expected, base = _outputs(stock), _outputs(cls.from_pretrained(path))
    assert any((expected[k] - base[k]).abs().max() > 1e-3 for k in base), "stock PEFT converted and applied it"
    assert_outputs_close(_outputs(fused), expected, **TOLERANCE)
    stock.save_pretrained(tmp_path / "stock")
    fused.save_pretrained(tmp_path / "fused")
    _assert_same_tensors(_saved(tmp_path / "fused"), _saved(tmp_path / "stock"))


@pytest.mark.parametrize(
    "children, config, words",
    [
        ("gate|up|down", {"target_modules": r".*experts\.0\.(gate_proj|up_proj|down_proj)"}, "not of every expert"),
        ("gate", {}, "without their up_proj"),
        ("down", {"rank_pattern": {"experts.0.down_proj": 4}}, "ranks / alphas"),
        ("gate|up|down", {"lora_dropout": 0.1}, "lora_dropout=0.1"),
        ("gate|up|down", {"use_dora": True}, "no DoRA"),
        ("gate|up", {"use_rslora": True}, "rsLoRA"),
    ],
)
def test_per_expert_adapter_without_an_exact_stock_form_is_refused_by_name(tiny, tmp_path, children, config, words):
    ckpt = tiny("qwen2_moe")
    source_model = ckpt.load(EXPERTS)
    torch.manual_seed(0)
    made = peft.get_peft_model(
        source_model, _lora(**{"target_modules": _per_expert_targets(source_model, children), **config})
    )
    _save_per_expert_adapter(made, tmp_path)
    model = ckpt.load(EXPERTS)
    with pytest.raises(PeftIntegrationError, match=words):
        modelpatch.load_adapter(model, tmp_path)
    assert _no_adapter_layers(model)


@pytest.mark.parametrize("name", ["qwen2_moe", "GraniteMoeForCausalLM"])
def test_stock_peft_saving_per_expert_lora_is_refused_by_name(tiny, tmp_path, name):
    """Stock PEFT given the expert Linears by name (model types PEFT does not rewrite) adapts each one; its adapter
    would be silently partial on the stock model, so saving it is refused, naming the experts and the remedy, which
    saves the stock adapter from the same model and config."""
    if name == "qwen2_moe":
        ckpt = tiny(name)
        cls, path = ckpt.model_class, ckpt.path
    else:
        cls, path = _checkpoint(name, tmp_path)
    model = modelpatch.from_pretrained(cls, path, fusion_config=EXPERTS)
    names = list(next(m for m in model.modules() if isinstance(m, LinearExperts))[0].names)
    made = peft.get_peft_model(model, _lora(target_modules=names))
    with pytest.raises(
        PeftIntegrationError, match=r"per-expert Linears of .*layers\.0\..*experts .*modelpatch\.get_peft_model"
    ):
        made.save_pretrained(tmp_path / "adapter")
    assert not (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    remedy = modelpatch.get_peft_model(
        modelpatch.from_pretrained(cls, path, fusion_config=EXPERTS), _lora(target_modules=names)
    )
    remedy.save_pretrained(tmp_path / "remedy")
    assert json.loads((tmp_path / "remedy" / "adapter_config.json").read_text())["target_parameters"]
