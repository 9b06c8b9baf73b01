"""``iter_original_state_dict`` of a LoRA model (boundary/peft_merge.py): the merged weights in the original names,
bitwise what a merged copy (``copy.deepcopy(peft_model).merge_and_unload()``) streams, and what the stock model
adapted with the same adapter holds once merged; the model unchanged, one merged tensor held at a time; what has no
exact merge refused by name before anything is yielded.

Adapters are random in A and B (``init_lora_weights=False``), so a delta added twice, to the wrong rows or expert, or
not at all shows in the bits.
"""

from __future__ import annotations

import copy
import weakref

import peft
import pytest
import torch
import transformers
from packaging.version import Version
from peft import IA3Config, LoraConfig

import modelpatch
from modelpatch.errors import PeftIntegrationError
from support.compare import assert_bitwise_equal
from support.expert_adapters import EXPERT_FAMILIES
from support.files import read_tensors
from support.zoo import load_zoo

FUSED = {"qkv": True, "gate_up": True}
MOE_FUSED = {**FUSED, "linear_experts": True}
STOCK_EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


def _lora(**kwargs) -> LoraConfig:
    return LoraConfig(**{"r": 2, "lora_alpha": 4, "init_lora_weights": False, **kwargs})


def _stream(model) -> dict[str, torch.Tensor]:
    streamed: dict[str, torch.Tensor] = {}
    for key, tensor in modelpatch.iter_original_state_dict(model):
        assert key not in streamed
        streamed[key] = tensor.clone()
    return streamed


def _merged_copy(peft_model) -> dict[str, torch.Tensor]:
    """What the one route before this gave: a second model, merged, streamed."""
    return _stream(copy.deepcopy(peft_model).merge_and_unload())


def _state(model) -> dict[str, torch.Tensor]:
    return {key: tensor.clone() for key, tensor in model.state_dict().items()}


def _adapted(tiny, name, fusion_config, dtype, **lora):
    checkpoint = tiny(name)
    torch.manual_seed(0)
    model = checkpoint.load(fusion_config, dtype=dtype)
    return checkpoint, modelpatch.get_peft_model(model, _lora(**lora))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("name", "fusion_config"),
    [("llama", None), ("llama", FUSED), ("qwen2", FUSED), ("qwen3_moe", MOE_FUSED), ("qwen2_moe", MOE_FUSED)],
)
def test_a_lora_model_streams_its_merged_weights_as_stock_merges_them(tiny, tmp_path, name, fusion_config, dtype):
    """Dense and MoE, fused or not, float32 and bfloat16 (float32 LoRA weights: the add's dtype matters): the stream
    is the merged copy's, bitwise, and the stock model's merged weights with the same adapter; the model unchanged."""
    checkpoint, peft_model = _adapted(tiny, name, fusion_config, dtype, target_modules="all-linear")
    before = _state(peft_model)
    streamed = _stream(peft_model)
    assert not any("lora_" in key or "base_layer" in key for key in streamed)
    assert_bitwise_equal(streamed, _merged_copy(peft_model))
    assert_bitwise_equal(_state(peft_model), before)  # nothing merged into the model, nothing left behind
    assert not any(getattr(m, "merged_adapters", None) for m in peft_model.modules())

    peft_model.save_pretrained(tmp_path / "adapter")
    stock = peft.PeftModel.from_pretrained(
        checkpoint.model_class.from_pretrained(checkpoint.path, dtype=dtype), tmp_path / "adapter"
    )
    stock_merged = stock.merge_and_unload()
    assert_bitwise_equal(streamed, _stream(stock_merged))
    base = _stream(checkpoint.model_class.from_pretrained(checkpoint.path, dtype=dtype))
    changed = [key for key in streamed if not torch.equal(streamed[key], base[key])]
    assert any(".experts." in key for key in changed) == (fusion_config == MOE_FUSED)
    assert any("q_proj" in key for key in changed) and any("down_proj" in key for key in changed)


@pytest.mark.parametrize("fusion_config", [None, FUSED])
@pytest.mark.parametrize(
    ("name", "lora"),
    [
        ("llama", {"target_modules": ["embed_tokens", "q_proj", "up_proj"]}),  # PEFT's Embedding LoRA adds otherwise
        ("qwen2", {"target_modules": ["q_proj", "v_proj"], "lora_bias": True}),  # into the fused bias's rows too
    ],
)
def test_embedding_lora_and_lora_bias_stream_merged(tiny, name, lora, fusion_config):
    # bfloat16 with float32 LoRA weights: each layer kind's add (cast first, or in the common dtype) shows in the bits.
    checkpoint, peft_model = _adapted(tiny, name, fusion_config, torch.bfloat16, **lora)
    with torch.no_grad():
        for key, parameter in peft_model.named_parameters():
            if ".lora_B." in key and key.endswith(".bias"):
                parameter.normal_()  # PEFT starts the LoRA bias at zero
    streamed = _stream(peft_model)
    assert_bitwise_equal(streamed, _merged_copy(peft_model))
    base = _stream(checkpoint.load(fusion_config, dtype=torch.bfloat16))
    changed = {key for key in streamed if not torch.equal(streamed[key], base[key])}
    expected = "model.embed_tokens.weight" if name == "llama" else "model.layers.1.self_attn.v_proj.bias"
    assert expected in changed and "model.layers.0.self_attn.q_proj.weight" in changed


def test_stock_target_parameters_on_an_unfused_moe_model_stream_merged(tiny):
    """Stock PEFT's LoRA of the 3-D experts (ParamWrapper, nested: one per parameter) on a stock-layout MoE model."""
    checkpoint = tiny("qwen3_moe")
    torch.manual_seed(0)
    peft_model = peft.get_peft_model(
        checkpoint.load(None), _lora(target_modules=["q_proj"], target_parameters=STOCK_EXPERTS)
    )
    streamed = _stream(peft_model)
    assert_bitwise_equal(streamed, _merged_copy(peft_model))
    base = _stream(checkpoint.load(None))
    # The checkpoint's layout (this one stores the experts one by one, as the stream of any model of it yields them).
    changed = [key for key in streamed if not torch.equal(streamed[key], base[key])]
    for part in ("self_attn.q_proj", "experts.0.gate_proj", "experts.3.up_proj", "experts.1.down_proj"):
        assert any(part in key for key in changed), part


@pytest.mark.parametrize("name", EXPERT_FAMILIES)
def test_every_experts_layout_streams_what_stock_merges(tmp_path, name):
    """Stock's target_parameters adapter of the 3-D experts loaded onto linear_experts: the stream is the merged
    copy's, and the files stock writes of the stock model with that adapter merged, bitwise."""
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    if name == "AriaTextForCausalLM" and Version(transformers.__version__) < Version("5.18"):
        pytest.skip(f"transformers {transformers.__version__}: Aria's experts have no 3-D weights before 5.18")
    zoo, cls = load_zoo(), getattr(transformers, name)
    torch.manual_seed(0)
    model = cls(zoo.tiny_config(cls.config_class))
    zoo._perturb(model)
    model.save_pretrained(tmp_path / "base")
    torch.manual_seed(1)
    stock = peft.get_peft_model(
        cls.from_pretrained(tmp_path / "base"), _lora(target_modules=[], target_parameters=STOCK_EXPERTS)
    )
    stock.save_pretrained(tmp_path / "adapter")
    fused = modelpatch.from_pretrained(cls, tmp_path / "base", fusion_config={"linear_experts": True})
    peft_model = modelpatch.load_adapter(fused, tmp_path / "adapter")
    streamed = _stream(peft_model)
    assert_bitwise_equal(streamed, _merged_copy(peft_model))
    stock.merge_and_unload().save_pretrained(tmp_path / "merged")
    assert_bitwise_equal(streamed, read_tensors(tmp_path / "merged"))
    base = read_tensors(tmp_path / "base")
    assert any(not torch.equal(streamed[key], base[key]) for key in streamed)  # the adapter adapts the experts only


@pytest.mark.parametrize(("name", "fusion_config"), [("llama", FUSED), ("qwen3_moe", MOE_FUSED)])
def test_after_merge_adapter_the_merged_weights_come_once(tiny, name, fusion_config):
    """TRL's GRPO merges (merge_adapter) before it reads the weights: the stream then adds nothing twice, and after
    unmerge_adapter it merges again; the base model while adapted (what GRPO reads) streams the same."""
    _, peft_model = _adapted(tiny, name, fusion_config, torch.float32, target_modules="all-linear")
    expected = _merged_copy(peft_model)
    peft_model.merge_adapter()
    assert_bitwise_equal(_stream(peft_model), expected)
    assert_bitwise_equal(_stream(peft_model.get_base_model()), expected)
    assert_bitwise_equal(_stream(peft_model.base_model), expected)
    peft_model.unmerge_adapter()
    assert_bitwise_equal(_stream(peft_model), _merged_copy(peft_model))


@pytest.mark.parametrize(("name", "fusion_config"), [("llama", FUSED), ("qwen3_moe", MOE_FUSED)])
def test_only_the_active_adapters_are_merged(tiny, name, fusion_config):
    _, peft_model = _adapted(tiny, name, fusion_config, torch.float32, target_modules="all-linear")
    torch.manual_seed(1)
    peft_model.add_adapter("second", _lora(target_modules=["q_proj", "v_proj", "o_proj"]))
    first = _stream(peft_model)
    assert_bitwise_equal(first, _merged_copy(peft_model))
    peft_model.set_adapter("second")
    second = _stream(peft_model)
    assert_bitwise_equal(second, _merged_copy(peft_model))
    assert first.keys() == second.keys() and any(not torch.equal(first[k], second[k]) for k in first)
    peft_model.base_model.set_adapter(["default", "second"])
    both = _stream(peft_model)
    assert_bitwise_equal(both, _merged_copy(peft_model))
    assert any(not torch.equal(both[k], first[k]) for k in first) and any(
        not torch.equal(both[k], second[k]) for k in first
    )


def test_one_merged_tensor_is_held_at_a_time(tiny):
    """Each merged tensor is computed when its turn comes and dropped by the stream once yielded: none outlives the
    consumer's reference (no dict of merged tensors is built; tensors are freed by reference count, no collection)."""
    _, peft_model = _adapted(tiny, "llama", None, torch.float32, target_modules="all-linear")
    own = {parameter.data_ptr() for parameter in peft_model.parameters()}
    stream = modelpatch.iter_original_state_dict(peft_model)
    previous: weakref.ref[torch.Tensor] | None = None
    merged = 0
    for _, tensor in stream:
        assert previous is None or previous() is None, "a merged tensor outlived its turn"
        previous = None
        if tensor.data_ptr() not in own:
            merged += 1
            previous = weakref.ref(tensor)
        del tensor
    assert merged == 14  # 2 layers x q, k, v, o, gate, up, down


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (_lora(target_modules=["q_proj"], use_dora=True), r"model\.layers\.0\.self_attn\.q_proj.*DoraLinearVariant"),
        (IA3Config(target_modules=["q_proj"], feedforward_modules=[]), r"IA3Model is none"),
        (_lora(target_modules=["q_proj"], modules_to_save=["lm_head"]), r"lm_head is a ModulesToSaveWrapper"),
    ],
)
def test_what_has_no_exact_merge_is_refused_by_name(tiny, config, words):
    model = tiny("llama").load(None)
    peft_model = peft.get_peft_model(model, config)
    stream = modelpatch.iter_original_state_dict(peft_model)
    with pytest.raises(PeftIntegrationError, match=words):
        next(stream)


def test_an_ia3_layer_under_the_base_model_is_refused_by_its_class(tiny):
    peft_model = peft.get_peft_model(
        tiny("llama").load(None), IA3Config(target_modules=["q_proj"], feedforward_modules=[])
    )
    with pytest.raises(
        PeftIntegrationError,
        match=r"model\.layers\.0\.self_attn\.q_proj is a peft\.tuners\.ia3\.layer\.Linear adapter layer",
    ):
        next(modelpatch.iter_original_state_dict(peft_model.get_base_model()))
