"""``linear_experts`` over every 3-D experts layout transformers 5.23 ships: the ones it fuses compute what stock
computes (forward within fp32 tolerance, default save bitwise the source, stock reload of that save equal), and the
ones it cannot fuse exactly are left as they are, with the reason.

Fused beyond transformers' plain experts forward: experts gating through their own ``_apply_gate`` (a clamped SwiGLU:
DeepSeek-V4, HY-V4; GPT-OSS's ``(up + 1) * glu`` without an ``act_fn``: MiniMax-M3-VL), GPT-OSS's transposed
weights with biases and interleaved gate/up columns, Aria's transposed weights, Llama 4's experts (each over the tokens
already dispatched to it), and checkpoints that store the 3-D
weights under other names (Aria's ``fc1`` / ``fc2``, GraniteMoE's ``input_linear`` / ``output_linear``, Inkling's
interleaved ``w13_weight``), which the save writes back. The gate limits are lowered so that the clamps bite. Tiny
models come from the zoo sweep's configs (``benchmarks/zoo.py``), the same ones the fusion sweep checks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version
from torch import nn

import modelpatch
from modelpatch.fusions.linear_experts.modules import ExpertGate, LinearExperts
from modelpatch.fusions.registry import get_fusion
from support.compare import assert_bitwise_equal, assert_outputs_close, assert_outputs_equal, assert_same_files
from support.zoo import load_zoo

zoo = load_zoo()

FUSION = {"linear_experts": True}
# class -> the gate limit that makes its clamp bite on the test inputs (None: no clamp)
FUSED = {
    "GptOssForCausalLM": 0.02,  # transposed [E, in, out] weights, biases, interleaved gate/up, clamped gate
    "DeepseekV4ForCausalLM": 0.02,  # its own _apply_gate: act_fn with clamps
    "HYV4ForCausalLM": 0.02,  # its own _apply_gate, no act_fn
    "MiniMaxM3VLForCausalLM": 0.02,  # GPT-OSS's gate on [gate; up] halves
    "MixtralForCausalLM": None,  # transformers' plain experts forward
    "AriaTextForCausalLM": None,  # transposed [E, in, out] weights, stored as experts.fc1 / fc2
    "GraniteMoeForCausalLM": None,  # stored as input_linear / output_linear
    "InklingForConditionalGeneration": None,  # stored interleaved as experts.w13_weight, a VLM
    "Llama4ForCausalLM": None,  # transposed, every expert over the tokens already dispatched to it
}
# class -> words of the reason its experts are left unfused
UNFUSED = {
    "MuseSparkTextModel": "post_expert_norm",
    "OpenAIPrivacyFilterForTokenClassification": "float32",
    "Ernie4_5_VLMoeForConditionalGeneration": "expert groups",
    "Inkling2ForCausalLM": "float32",
}


# Layouts transformers 5.15-5.17 did not have yet: Aria's experts were another class (no 3-D weights, left unfused),
# GPT-OSS's experts took their gate limit as a constant, not from the config the tests set it in.
BEFORE_5_18 = {
    "AriaTextForCausalLM": "Aria's experts have no 3-D weights",
    "GptOssForCausalLM": "GPT-OSS's gate limit is a constant",
}


def _checkpoint(name: str, root: Path, limit: float | None = None) -> tuple[type, Path]:
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    if name in BEFORE_5_18 and Version(transformers.__version__) < Version("5.18"):
        pytest.skip(f"transformers {transformers.__version__}: {BEFORE_5_18[name]} before 5.18")
    cls = getattr(transformers, name)
    config = zoo.tiny_config(cls.config_class)
    if limit is not None:
        config.get_text_config().swiglu_limit = limit
    torch.manual_seed(0)
    model = cls(config)
    zoo._perturb(model)
    path = root / name
    model.save_pretrained(path)
    return cls, path


def _outputs(model: nn.Module) -> dict[str, torch.Tensor]:
    model.eval()
    return zoo._forward(model, zoo.dummy_inputs(model)[0])


def _experts(model: nn.Module) -> list[nn.Module]:
    return [m for n, m in model.named_modules() if n.endswith(".experts")]


@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_layouts_compute_and_save_what_stock_does(tmp_path, name):
    cls, source = _checkpoint(name, tmp_path, FUSED[name])
    stock = cls.from_pretrained(source)
    fused = modelpatch.from_pretrained(cls, source, fusion_config=FUSION)

    experts = _experts(fused)
    assert experts and all(isinstance(m, LinearExperts) for m in experts), [type(m) for m in experts]
    expected = _outputs(stock)
    assert_outputs_close(_outputs(fused), expected)
    if FUSED[name] is not None:
        # The clamp bites: without it stock computes something else, so the fused gate is the clamped one.
        for module in _experts(stock):
            for attribute in ("limit", "swiglu_limit"):
                if hasattr(module, attribute):
                    setattr(module, attribute, 1e9)
        unclamped = _outputs(stock)
        assert any(not torch.allclose(unclamped[k], expected[k], atol=1e-3) for k in expected)

    saved = tmp_path / "saved"
    modelpatch.save_pretrained(fused, saved)
    assert_same_files(saved, source)
    assert_bitwise_equal(cls.from_pretrained(saved).state_dict(), cls.from_pretrained(source).state_dict())


@pytest.mark.parametrize("name", sorted(UNFUSED))
def test_experts_it_cannot_fuse_exactly_stay_as_they_are(tmp_path, name):
    """MuSE Spark's per-expert output norm, the privacy filter's float32 projections, Ernie 4.5 VL's checkpoint of
    grouped experts: the experts keep their stock class (nothing dropped: the save is the
    source; the load does not refuse), with the reason."""
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    cls, source = _checkpoint(name, tmp_path)
    stock = cls.from_pretrained(source)
    model = modelpatch.from_pretrained(cls, source, fusion_config=FUSION)

    experts = _experts(model)
    assert experts and all(type(m) is type(s) for m, s in zip(experts, _experts(stock), strict=True))
    reason = get_fusion("linear_experts").unfusable_reason(experts[0])
    assert reason is not None and UNFUSED[name] in reason, reason
    assert_outputs_equal(_outputs(model), _outputs(stock))
    saved = tmp_path / "saved"
    modelpatch.save_pretrained(model, saved)
    assert_same_files(saved, source)


def test_a_changed_forward_is_not_fused():
    """A subclass of a fusable experts class whose forward computes something else is left as it is: the family
    fuses forwards it knows, not classes that look like them."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    class ScaledExperts(MixtralExperts):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return 2 * super().forward(hidden_states, top_k_index, top_k_weights)

    config = zoo.tiny_config(transformers.MixtralConfig)
    spec = get_fusion("linear_experts")
    with torch.device("meta"):
        stock, changed = MixtralExperts(config), ScaledExperts(config)
    assert spec.unfusable_reason(stock) is None and spec.is_fusable(stock)
    reason = spec.unfusable_reason(changed)
    assert not spec.is_fusable(changed) and reason is not None and "ScaledExperts.forward" in reason, reason


def _scaled_experts() -> type[nn.Module]:
    """Mixtral's experts with a forward the family does not know (as a new transformers release may edit one)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    class ScaledExperts(MixtralExperts):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return 2 * super().forward(hidden_states, top_k_index, top_k_weights)

    return ScaledExperts


def test_an_unrecognised_forward_is_a_candidate_left_with_its_reason(tmp_path, caplog):
    """Loaded with a forward it does not know, the experts stay as they are and the load says so at INFO (class, path,
    why); ``strict`` refuses by name instead of loading unfused without a word."""
    scaled = _scaled_experts()
    cls, source = _checkpoint("MixtralForCausalLM", tmp_path)
    patcher = modelpatch.Patcher({"MixtralExperts": scaled})
    with caplog.at_level("INFO", logger="modelpatch.fusions.apply"):
        model = modelpatch.from_pretrained(cls, source, patcher=patcher, fusion_config=FUSION)
    experts = _experts(model)
    assert experts and all(type(m) is scaled for m in experts)
    said = "\n".join(r.getMessage() for r in caplog.records if "linear_experts" in r.getMessage())
    assert "ScaledExperts" in said and "model.layers.0.mlp.experts" in said and "ScaledExperts.forward" in said, said
    stock = cls.from_pretrained(source)
    stock_scaled = modelpatch.from_pretrained(cls, source, patcher=patcher)
    assert_outputs_equal(_outputs(model), _outputs(stock_scaled))
    # the patched forward ran, not the stock one
    assert any(not torch.equal(a, b) for a, b in zip(_outputs(model).values(), _outputs(stock).values(), strict=True))

    with pytest.raises(modelpatch.FusionError, match=r"(?s)strict.*ScaledExperts at model\.layers\.0\.mlp\.experts"):
        modelpatch.from_pretrained(cls, source, patcher=patcher, fusion_config={"linear_experts": {"strict": True}})


def test_a_fused_class_for_an_unrecognised_forward_is_refused():
    spec = get_fusion("linear_experts")
    with pytest.raises(modelpatch.FusionError, match=r"ScaledExperts.*ScaledExperts\.forward"):
        spec.make_fused_class(_scaled_experts())


def test_a_fused_class_refuses_an_instance_it_cannot_fuse():
    """A fused class built directly (not by discovery) for a config whose experts hold another layout says why."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    class BiasedExperts(MixtralExperts):
        def __init__(self, config):
            super().__init__(config)
            self.scale = nn.Parameter(torch.ones(1))

    BiasedExperts.forward = MixtralExperts.forward  # the known forward, an extra parameter
    fused = get_fusion("linear_experts").make_fused_class(BiasedExperts)
    with pytest.raises(modelpatch.FusionError, match="BiasedExperts.*scale"):
        fused(zoo.tiny_config(transformers.MixtralConfig))


@pytest.mark.parametrize("interleaved", [False, True])
def test_the_gate_sees_the_stock_column_order(interleaved):
    """An ExpertGate gets the gate and up outputs back in the order the stock weights give them, from the separate
    Linears (expert by expert) and from the packed product (every gate output, then every up output) alike."""
    seen = []

    def apply_gate(state, gate_up):
        seen.append(gate_up)
        return gate_up[..., : gate_up.shape[-1] // 2] * state.scale

    gate, up = torch.randn(5, 3), torch.randn(5, 3)
    expert_gate = ExpertGate(apply_gate, {"scale": 2.0}, interleaved)
    separate = expert_gate(gate, up)
    packed = expert_gate.packed(torch.cat([gate, up], dim=-1))
    stock_order = torch.stack([gate, up], dim=-1).flatten(-2) if interleaved else torch.cat([gate, up], dim=-1)
    assert torch.equal(seen[0], stock_order) and torch.equal(seen[1], stock_order)
    assert torch.equal(separate, packed)


def test_live_fuse_and_unfuse_of_gpt_oss_experts():
    """A model in memory: ``modelpatch.fuse`` runs the same transforms (transpose, de-interleave, split; biases too),
    the fused forward matches, and ``unfuse`` gives back the stock tensors bit for bit."""
    if Version(transformers.__version__) < Version("5.18"):
        pytest.skip(f"transformers {transformers.__version__}: {BEFORE_5_18['GptOssForCausalLM']} before 5.18")
    model = zoo._build(transformers.GptOssForCausalLM)
    model.config.get_text_config().swiglu_limit = 0.02
    for module in _experts(model):
        module.limit = 0.02
    expected = _outputs(model)
    state = {key: tensor.clone() for key, tensor in model.state_dict().items()}

    modelpatch.fuse(model, FUSION)
    assert all(isinstance(m, LinearExperts) for m in _experts(model))
    assert_outputs_close(_outputs(model), expected)
    modelpatch.unfuse(model)
    assert_bitwise_equal(model.state_dict(), state)


def test_llama4_experts_called_one_by_one_compute_the_same(tmp_path):
    """With a hook on an expert's Linear (what PEFT or accelerate put there), Llama 4's fused experts call each
    expert module on its slice of tokens instead of the batched products: the same outputs."""
    cls, source = _checkpoint("Llama4ForCausalLM", tmp_path)
    fused = modelpatch.from_pretrained(cls, source, fusion_config=FUSION)
    batched = _outputs(fused)
    calls = []
    experts = _experts(fused)[0]
    experts[1].gate_proj.register_forward_hook(lambda *args: calls.append(1))
    assert_outputs_close(_outputs(fused), batched)
    assert calls
