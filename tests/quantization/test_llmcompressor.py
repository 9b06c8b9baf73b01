"""llm-compressor's ``oneshot`` on modelpatch models, side by side with stock transformers on the same checkpoint.

Each test runs one recipe on the stock model and on the modelpatch model (fused ``qkv`` / ``gate_up``, unfused, or
``linear_experts``), saves both through ``model.save_pretrained`` (llm-compressor's compressed save wraps it) and
compares what was written: the same keys, the same tensors bit for bit, the same ``config.json`` (its
``quantization_config`` included); stock transformers then reloads modelpatch's folder. The calibration set is four
sequences of 16 random tokens.

llm-compressor pins transformers and torch releases below modelpatch's range, so CI installs it without its
dependencies (scripts/setup.sh); where it does not import, these tests are skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

import modelpatch
from support.files import read_tensors
from support.models import VOCAB, sized_config
from support.process import run_fresh

try:  # a release outside the range it was checked on may fail at import with more than an ImportError
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.context import moe_calibration_context
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQMapping, AWQModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier
    from llmcompressor.pipelines.cache import IntermediatesCache
    from llmcompressor.transformers.compression.compressed_tensors_utils import modify_save_pretrained
except Exception as error:  # noqa: BLE001
    pytest.skip(f"llm-compressor does not import here: {error!r}", allow_module_level=True)

FUSED = {"qkv": True, "gate_up": True}
# SmoothQuant's Llama mappings, as llm-compressor infers them for the stock model, and written for the fused layers.
FUSED_SMOOTHQUANT_MAPPINGS = [
    [["re:.*qkv_proj$"], "re:.*input_layernorm$"],
    [["re:.*gate_up_proj$"], "re:.*post_attention_layernorm$"],
]


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocabulary = {f"t{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocabulary, unk_token="t0")))


def _calibration() -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    samples = [
        {
            "input_ids": torch.randint(0, VOCAB, (16,), generator=generator),
            "attention_mask": torch.ones(16, dtype=torch.long),
        }
        for _ in range(4)
    ]
    return DataLoader(samples, batch_size=1)


def _quantize(model, recipe, *, data: bool = True) -> None:
    oneshot(
        model=model,
        dataset=_calibration() if data else None,
        recipe=recipe,
        processor=_tokenizer(),
        num_calibration_samples=4,
        max_seq_length=16,
    )


def _logits(model) -> torch.Tensor:
    input_ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def _config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


def _assert_same_checkpoint(ours: Path, stock: Path) -> None:
    mine, theirs = read_tensors(ours), read_tensors(stock)
    assert sorted(mine) == sorted(theirs)
    for key, tensor in theirs.items():
        assert mine[key].dtype == tensor.dtype and torch.equal(mine[key], tensor), key
    assert _config(ours) == _config(stock)


def _stock_and_ours(checkpoint: Path, tmp_path: Path, fusion_config, stock_recipe, our_recipe, *, data: bool = True):
    """Quantize the stock model and modelpatch's, save both; returns the two folders and modelpatch's model."""
    stock = AutoModelForCausalLM.from_pretrained(checkpoint)
    _quantize(stock, stock_recipe(), data=data)
    stock.save_pretrained(tmp_path / "stock")
    ours = modelpatch.from_pretrained(AutoModelForCausalLM, checkpoint, fusion_config=fusion_config)
    _quantize(ours, our_recipe(), data=data)
    ours.save_pretrained(tmp_path / "ours")
    return tmp_path / "stock", tmp_path / "ours", ours


def _w8a8(mappings=None):
    return lambda: [
        SmoothQuantModifier(smoothing_strength=0.8, mappings=mappings),
        QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"]),
    ]


@pytest.mark.parametrize(
    ("fusion_config", "mappings"),
    [(FUSED, None), (FUSED, FUSED_SMOOTHQUANT_MAPPINGS), (None, None)],
    ids=["fused-inferred-mappings", "fused-mappings-for-fused-names", "unfused"],
)
def test_smoothquant_w8a8_saves_what_stock_saves(tiny, tmp_path, fusion_config, mappings):
    """SmoothQuant smooths q/k/v (gate/up) by one shared layernorm, so on the fused layer it is the same algorithm:
    the smoothed, int8-quantized weights and their per-channel scales are stock's, written under stock's names. The
    mappings llm-compressor infers for Llama name q_proj, k_proj, v_proj (and match qkv_proj itself: ``re:.*v_proj``
    is unanchored): they smooth the fused layer, once."""
    checkpoint = tiny("llama").path
    stock, ours, model = _stock_and_ours(checkpoint, tmp_path, fusion_config, _w8a8(), _w8a8(mappings))
    _assert_same_checkpoint(ours, stock)
    assert _config(ours)["quantization_config"]["ignore"] == ["lm_head"]
    reloaded = AutoModelForCausalLM.from_pretrained(ours)
    torch.testing.assert_close(_logits(reloaded), _logits(model), rtol=0, atol=1e-5)


def test_a_smoothquant_mapping_naming_some_parts_of_a_fused_layer_is_refused_by_name(tiny):
    """Balancing q_proj alone would, on the fused layer, scale k_proj's and v_proj's rows too: refused, naming the
    mapping and the fused layer, before any weight changes."""
    model = tiny("llama").load(FUSED)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    recipe = [SmoothQuantModifier(mappings=[[["re:.*q_proj$"], "re:.*input_layernorm$"]])]
    with pytest.raises(modelpatch.FusionError, match=r"input_layernorm balances part\(s\) \[0\] of the fused qkv_proj"):
        _quantize(model, recipe)
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())


def test_smoothing_modifiers_imported_after_the_fused_model_is_built_fold_their_mappings(tiny):
    """The order of the imports does not matter: llm-compressor's SmoothQuant and AWQ imported after the fused model
    is built (a fresh interpreter) resolve mappings naming the parts to the fused layers all the same."""
    script = f"""
import sys
from transformers import AutoModelForCausalLM
import modelpatch
model = modelpatch.from_pretrained(AutoModelForCausalLM, {str(tiny("llama").path)!r}, fusion_config={FUSED!r})
assert not any(name.startswith("llmcompressor.modifiers.transform") for name in sys.modules)
from llmcompressor.modifiers.transform.smoothquant.base import SmoothQuantModifier
from llmcompressor.modifiers.transform.awq import base
mark = "_modelpatch_folds_fused_projections"
wrapped = [SmoothQuantModifier._resolve_mappings, base.AWQModifier._set_resolved_mappings, base.match_modules_set]
waiting = any(type(finder).__name__ == "_FoldAtImport" for finder in sys.meta_path)
print(all(getattr(function, mark, False) for function in wrapped), waiting)
"""
    assert run_fresh(script).stdout.strip().splitlines()[-1] == "True False"


def test_moe_calibration_runs_every_expert_on_every_token(tiny):
    """Inside llm-compressor's MoE calibration context (oneshot enters it unless moe_calibrate_all_experts=False),
    every expert's Linears see every token and the layer keeps the routed tokens' results: the logits are those of
    stock's experts linearized by llm-compressor in that context, bit for bit, and the routed logits up to rounding
    (a product over all the tokens rounds some rows otherwise than one over the routed ones)."""
    checkpoint = tiny("qwen3_moe")
    model = checkpoint.load({"linear_experts": True})
    stock = AutoModelForCausalLM.from_pretrained(checkpoint.path)
    linearize_moe(stock)
    rows: dict[int, int] = {}
    experts = model.model.layers[0].mlp.experts
    for index, expert in enumerate(experts):
        expert.gate_proj.register_forward_pre_hook(
            lambda module, args, index=index: rows.__setitem__(index, rows.get(index, 0) + args[0].shape[0])
        )
    input_ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        routed = model(input_ids=input_ids).logits
        assert sum(rows.values()) == input_ids.numel() * model.config.num_experts_per_tok
        rows.clear()
        with moe_calibration_context():
            every, stock_every = model(input_ids=input_ids).logits, stock(input_ids=input_ids).logits
    assert rows == dict.fromkeys(range(len(experts)), input_ids.numel())
    assert torch.equal(every, stock_every)
    torch.testing.assert_close(every, routed, rtol=0, atol=1e-6)


def _static_fp8_moe():
    return [QuantizationModifier(targets="Linear", scheme="FP8", ignore=["lm_head", "re:.*mlp.gate$"])]


def _gptq_w8a8_moe():
    return [GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head", "re:.*mlp.gate$"])]


@pytest.mark.parametrize("recipe", [_static_fp8_moe, _gptq_w8a8_moe], ids=["static-fp8", "gptq-w8a8"])
def test_calibrated_recipes_on_linear_experts_save_what_stock_saves(tiny, tmp_path, recipe):
    """Calibrated recipes on Qwen3-MoE: stock's experts, linearized by llm-compressor, calibrate every expert on
    every token (its default); modelpatch's linear_experts do the same, so the static input scales and GPTQ's
    Hessians are stock's, and so is the checkpoint, bit for bit."""
    checkpoint = tiny("qwen3_moe").path
    stock, ours, _ = _stock_and_ours(checkpoint, tmp_path, {"linear_experts": True}, recipe, recipe)
    _assert_same_checkpoint(ours, stock)
    if recipe is _static_fp8_moe:  # every expert of a layer saw the same tokens: one input scale
        tensors = read_tensors(ours)
        for layer in range(2):
            scales = [tensors[f"model.layers.{layer}.mlp.experts.{e}.gate_proj.input_scale"] for e in range(4)]
            assert all(torch.equal(scale, scales[0]) for scale in scales)


def test_fp8_dynamic_on_linear_experts_saves_per_expert_names_as_stock(tiny, tmp_path):
    """Data-free FP8_DYNAMIC on Qwen3-MoE: stock linearizes its 3-D experts for llm-compressor; modelpatch's
    linear_experts already holds one Linear per expert. The checkpoints are the same, per-expert names included."""
    checkpoint = tiny("qwen3_moe").path

    def recipe():
        return [QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head", "re:.*mlp.gate$"])]

    stock, ours, _ = _stock_and_ours(checkpoint, tmp_path, {"linear_experts": True}, recipe, recipe, data=False)
    _assert_same_checkpoint(ours, stock)
    assert "model.layers.0.mlp.experts.3.down_proj.weight_scale" in read_tensors(ours)


def test_a_per_tensor_scale_of_a_fused_layer_goes_to_each_part(tmp_path):
    """Static FP8 (one weight scale and one input scale per layer): calibrating the fused layer gives q, k and v one
    scale (stock gives each its own); each part is written with it, so stock's reload computes what the quantized fused
    model computes."""
    config = sized_config("llama", vocab=VOCAB, hidden=32, intermediate=64, layers=1, heads=4, kv_heads=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "source")
    model = modelpatch.from_pretrained(AutoModelForCausalLM, tmp_path / "source", fusion_config=FUSED)
    _quantize(model, [QuantizationModifier(targets="Linear", scheme="FP8", ignore=["lm_head"])])
    model.save_pretrained(tmp_path / "ours")
    tensors = read_tensors(tmp_path / "ours")
    attention = "model.layers.0.self_attn"
    assert not any("qkv_proj" in key or "gate_up_proj" in key for key in tensors)
    scales = [tensors[f"{attention}.{part}.weight_scale"] for part in ("q_proj", "k_proj", "v_proj")]
    assert scales[0].numel() == 1 and all(torch.equal(scale, scales[0]) for scale in scales)
    assert torch.equal(scales[0].flatten(), model.model.layers[0].self_attn.qkv_proj.weight_scale.flatten())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    torch.testing.assert_close(_logits(reloaded), _logits(model), rtol=0, atol=1e-5)


def test_llmcompressors_save_wrapper_on_a_modelpatch_model(tiny, tmp_path):
    """modify_save_pretrained, llm-compressor's own: it takes the bound method apart and calls its function rebound
    to the model; the folder is in the original layout and stock reloads it."""
    checkpoint = tiny("llama")
    model = checkpoint.load(FUSED)
    modify_save_pretrained(model)
    model.save_pretrained(tmp_path, save_compressed=False)
    assert sorted(read_tensors(tmp_path)) == sorted(checkpoint.tensors())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    torch.testing.assert_close(_logits(reloaded), _logits(model), rtol=0, atol=1e-6)


def _wide_checkpoint(directory: Path, family: str = "llama", kv_heads: int = 2, *, uneven_norms: bool = False) -> Path:
    """A Llama (or ``family``) whose projections read 128 features: one group (and one block) of 128 columns per
    row. ``uneven_norms``: layernorm weights drawn log-normal instead of ones, so that the input channels of the
    projections differ in size (AWQ then scales every mapping instead of finding the identity best)."""
    config = sized_config(family, vocab=VOCAB, hidden=128, intermediate=128, layers=1, heads=4, kv_heads=kv_heads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if uneven_norms:
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if name.endswith("layernorm.weight"):
                    weight.copy_(torch.randn(weight.shape).mul(0.8).exp())
    model.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("modifier", [QuantizationModifier, GPTQModifier], ids=["round-to-nearest", "gptq"])
def test_w4a16_packed_weights_of_fused_layers_save_what_stock_saves(tmp_path, modifier):
    """W4A16 (4-bit weights packed in int32, one scale per group of 128 columns of each row), rounded to nearest
    (data-free) or by GPTQ (calibrated: q, k and v read one input, so the fused layer's Hessian is each part's, and
    GPTQ's updates stay within each row). Each part gets its rows of the packed weight and of the scales, and its own
    weight_shape."""
    checkpoint = _wide_checkpoint(tmp_path / "source")

    def recipe():
        return [modifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])]

    data = modifier is GPTQModifier
    stock, ours, model = _stock_and_ours(checkpoint, tmp_path, FUSED, recipe, recipe, data=data)
    _assert_same_checkpoint(ours, stock)
    assert read_tensors(ours)["model.layers.0.self_attn.k_proj.weight_shape"].tolist() == [64, 128]
    reloaded = AutoModelForCausalLM.from_pretrained(ours)
    torch.testing.assert_close(_logits(reloaded), _logits(model), rtol=0, atol=1e-5)


@pytest.fixture
def _unpinned(monkeypatch):
    """llm-compressor 0.14's AWQ pins its cached calibration inputs in memory, which needs a CUDA driver: on a machine
    without one, the cache is left unpinned (pinning speeds host-to-device copies and changes no value)."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(IntermediatesCache, "pin_memory", lambda self, batch_index, input_names=None: None)


def _awq_w4a16(mappings=None):
    return lambda: [
        AWQModifier(mappings=mappings),
        QuantizationModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]),
    ]


@pytest.mark.usefixtures("_unpinned")
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha-four-mappings", "gqa-v-to-o-skipped"])
def test_awq_w4a16_on_fused_layers_saves_what_stock_saves(tmp_path, kv_heads):
    """AWQ with the mappings llm-compressor infers for Llama (q/k/v by input_layernorm, v_proj -> o_proj, gate/up by
    post_attention_layernorm, up_proj -> down_proj): the same grid search on the fused layers (the same inputs, the
    rows quantized per group as the parts', the loss over the same parent modules), so the scaled, 4-bit packed
    weights and their scales are stock's. v_proj and up_proj smooth as the last rows of their fused layers; with
    grouped-query attention (v_proj narrower than o_proj's input) stock skips v_proj -> o_proj, and so does the fused
    model."""
    checkpoint = _wide_checkpoint(tmp_path / "source", kv_heads=kv_heads, uneven_norms=True)
    stock, ours, model = _stock_and_ours(checkpoint, tmp_path, FUSED, _awq_w4a16(), _awq_w4a16())
    _assert_same_checkpoint(ours, stock)
    source, saved = read_tensors(checkpoint), read_tensors(ours)
    norms = ["model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"]
    assert not any(torch.equal(saved[name], source[name]) for name in norms)  # both layernorms smoothed
    reloaded = AutoModelForCausalLM.from_pretrained(ours)
    torch.testing.assert_close(_logits(reloaded), _logits(model), rtol=0, atol=1e-5)


@pytest.mark.usefixtures("_unpinned")
@pytest.mark.parametrize(
    ("family", "mapping", "message"),
    [
        (
            "llama",
            AWQMapping("re:.*input_layernorm$", ["re:.*q_proj$"]),
            r"input_layernorm balances part\(s\) \[0\] of the fused qkv_proj",
        ),
        ("llama", AWQMapping("re:.*gate_proj$", ["re:.*down_proj$"]), r"mlp\.gate_proj, part 0 of the fused gate_up"),
        (
            "qwen2",
            AWQMapping("re:.*v_proj$", ["re:.*o_proj$"]),
            r"self_attn\.qkv_proj, a fused layer with a bias, by 128 scales",
        ),
    ],
    ids=["some-parts-balanced", "first-part-smoothed", "fused-smooth-layer-with-bias"],
)
def test_an_awq_mapping_the_fused_layer_cannot_follow_is_refused_by_name(tmp_path, family, mapping, message):
    """Balancing q_proj alone would scale k_proj's and v_proj's rows too; llm-compressor smooths a fused layer's last
    rows (gate_proj's are its first) and would divide Qwen2's whole qkv bias by v_proj's scales: each refused, naming
    the mapping and the fused layer, before any weight changes."""
    checkpoint = _wide_checkpoint(tmp_path / "source", family=family, kv_heads=4)
    model = modelpatch.from_pretrained(AutoModelForCausalLM, checkpoint, fusion_config=FUSED)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(modelpatch.FusionError, match=message):
        _quantize(model, _awq_w4a16([mapping])())
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in before.items())


def test_a_layout_that_cannot_be_split_is_refused_by_name_before_anything_is_written(tmp_path):
    """FP8 block scales: one per 128 x 128 block of the fused weight, and k_proj and v_proj (64 rows each) share one
    block: not split exactly."""
    model = modelpatch.from_pretrained(AutoModelForCausalLM, _wide_checkpoint(tmp_path / "source"), fusion_config=FUSED)
    _quantize(model, [QuantizationModifier(targets="Linear", scheme="FP8_BLOCK", ignore=["lm_head"])], data=False)
    with pytest.raises(modelpatch.SaveError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight_scale \[2, 1\]"):
        model.save_pretrained(tmp_path / "ours")
    assert not any((tmp_path / "ours").glob("*.safetensors"))


def test_a_runtime_layout_save_of_a_compressed_fused_model_is_refused_by_name(tiny, tmp_path):
    """llm-compressor writes config.json again after the save (the source's, plus its quantization_config): a
    runtime-layout folder would lose modelpatch's record and load nowhere. Refused by name."""
    model = tiny("llama").load(FUSED)
    _quantize(model, [QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])], data=False)
    with pytest.raises(modelpatch.SaveError, match=r"runtime layout: model\.layers\.0\.self_attn\.qkv_proj"):
        model.save_pretrained(tmp_path / "door", save_original_format=False)
    assert not any((tmp_path / "door").glob("*.safetensors"))


def test_modelpatchs_own_save_of_a_compressed_model_is_refused_by_name(tiny, tmp_path):
    """modelpatch.save_pretrained writes the model's config, without the quantization_config only the tool writes:
    stock would load the tensors as a plain model's. Refused, naming the layers and llm-compressor's save."""
    model = tiny("llama").load(FUSED)
    _quantize(model, [QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])], data=False)
    for original_format in (True, False):
        with pytest.raises(
            modelpatch.SaveError, match=r"model\.layers\.0\.self_attn\.qkv_proj.*model\.save_pretrained"
        ):
            modelpatch.save_pretrained(model, tmp_path, save_original_format=original_format)
    assert not any(tmp_path.iterdir())
