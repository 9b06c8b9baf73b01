"""Output recorders (``output_attentions`` / ``output_router_logits``) on patched and unpatched models.

transformers attaches its recording hooks by class (``_can_record_outputs``). modelpatch extends those specs additively
when a non-subclass replacement is built, so patched models record from the replacement and unpatched models of the
same class (built before or after) still record exactly once per layer.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM, LlamaModel, Qwen2MoeForCausalLM
from transformers.models.llama.modeling_llama import LlamaPreTrainedModel
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

import modelpatch
from support.patching import (
    MarkedLlamaAttention,
    MarkedQwen2MoeAttention,
    ReimplementedLlamaAttention,
    ReimplementedQwen2MoeRouter,
    WrappedLlamaAttention,
    WrappedQwen2MoeAttention,
    _copy_llama_attention_state,
    build,
    input_ids,
    llama_config,
    qwen2_moe_config,
    reference_and_patched,
)

LAYERS = 3
HEADS = 4
SEQ = input_ids().shape[1]


def _run(model, **kwargs):
    ids = input_ids()
    with torch.no_grad():
        return model(ids, **kwargs)


def _assert_attentions(outputs, layers=LAYERS, seq=SEQ):
    assert outputs.attentions is not None
    assert len(outputs.attentions) == layers
    for attention in outputs.attentions:
        assert attention.shape == (1, HEADS, seq, seq)
        # Softmax rows of a causal attention: each row sums to one.
        torch.testing.assert_close(attention.sum(-1), torch.ones(1, HEADS, seq))


def _llama_wrapper_state(state):
    return {k.replace(".self_attn.", ".self_attn.inner."): v for k, v in state.items()}


CASES = {
    "llama-subclass": (LlamaForCausalLM, llama_config, "LlamaAttention", MarkedLlamaAttention, None),
    "llama-wrapper": (LlamaForCausalLM, llama_config, "LlamaAttention", WrappedLlamaAttention, _llama_wrapper_state),
    "llama-reimplementation": (LlamaForCausalLM, llama_config, "LlamaAttention", ReimplementedLlamaAttention, None),
    "qwen2moe-subclass": (Qwen2MoeForCausalLM, qwen2_moe_config, "Qwen2MoeAttention", MarkedQwen2MoeAttention, None),
    "qwen2moe-wrapper": (
        Qwen2MoeForCausalLM,
        qwen2_moe_config,
        "Qwen2MoeAttention",
        WrappedQwen2MoeAttention,
        _llama_wrapper_state,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_output_attentions_on_patched_and_unpatched_models(case):
    model_cls, config_fn, name, replacement, remap_state = CASES[case]
    config = config_fn(num_hidden_layers=LAYERS)

    # before: built (and never run) before the patch exists
    before, patched = reference_and_patched(model_cls, config, {name: replacement})
    after = build(model_cls, config, seed=2)

    assert {type(layer.self_attn) for layer in patched.model.layers} == {replacement}
    state = before.state_dict()
    patched.load_state_dict(remap_state(state) if remap_state else state)
    after.load_state_dict(state)

    expected = _run(before, output_attentions=True)
    _assert_attentions(expected)
    for model in (patched, after):
        outputs = _run(model, output_attentions=True)
        _assert_attentions(outputs)  # exactly one per layer: neither missing nor recorded twice
        torch.testing.assert_close(outputs.logits, expected.logits, rtol=0, atol=0)
        for actual, reference in zip(outputs.attentions, expected.attentions, strict=True):
            torch.testing.assert_close(actual, reference, rtol=0, atol=0)
    # Asking for nothing still records nothing.
    assert _run(patched).attentions is None


def test_model_run_before_the_patch_keeps_recording():
    config = llama_config(num_hidden_layers=LAYERS)
    early = build(LlamaModel, config)
    _assert_attentions(_run(early, output_attentions=True))  # hooks installed before any patch
    modelpatch.register_patch_mapping({"LlamaAttention": ReimplementedLlamaAttention})
    with modelpatch.apply_patches():
        patched = build(LlamaModel, config)
    _assert_attentions(_run(patched, output_attentions=True))
    _assert_attentions(_run(early, output_attentions=True))


def test_recorder_extension_is_additive():
    config = llama_config(num_hidden_layers=1)
    modelpatch.register_patch_mapping({"LlamaAttention": ReimplementedLlamaAttention})
    with modelpatch.apply_patches():
        build(LlamaModel, config)
    spec = LlamaPreTrainedModel._can_record_outputs["attentions"]
    specs = spec if isinstance(spec, list) else [spec]
    from transformers.models.llama.modeling_llama import LlamaAttention

    assert specs[0] is LlamaAttention  # the original is kept, first
    assert ReimplementedLlamaAttention in specs
    assert specs.count(ReimplementedLlamaAttention) == 1
    # Building again does not add it twice.
    with modelpatch.apply_patches():
        build(LlamaModel, config)
    spec = LlamaPreTrainedModel._can_record_outputs["attentions"]
    assert (spec if isinstance(spec, list) else [spec]).count(ReimplementedLlamaAttention) == 1


def test_subclass_and_wrapper_replacements_leave_recorders_unchanged():
    config = llama_config(num_hidden_layers=1)
    spec_before = LlamaPreTrainedModel._can_record_outputs["attentions"]
    modelpatch.register_patch_mapping({"LlamaAttention": MarkedLlamaAttention})
    with modelpatch.apply_patches():
        build(LlamaModel, config)
    with modelpatch.Patcher({"LlamaAttention": WrappedLlamaAttention}):
        build(LlamaModel, config)
    spec_after = LlamaPreTrainedModel._can_record_outputs["attentions"]
    specs_after = spec_after if isinstance(spec_after, list) else [spec_after]
    assert MarkedLlamaAttention not in specs_after
    assert WrappedLlamaAttention not in specs_after
    assert spec_after == spec_before


def test_router_logits_recorded_from_a_non_subclass_router():
    config = qwen2_moe_config(num_hidden_layers=LAYERS)
    before, patched = reference_and_patched(
        Qwen2MoeForCausalLM, config, {"Qwen2MoeTopKRouter": ReimplementedQwen2MoeRouter}
    )
    after = build(Qwen2MoeForCausalLM, config, seed=2)
    assert {type(layer.mlp.gate) for layer in patched.model.layers} == {ReimplementedQwen2MoeRouter}
    assert {type(layer.mlp.gate) for layer in after.model.layers} == {Qwen2MoeTopKRouter}
    patched.load_state_dict(before.state_dict())
    after.load_state_dict(before.state_dict())

    expected = _run(before, output_router_logits=True)
    assert len(expected.router_logits) == LAYERS
    for model in (patched, after):
        outputs = _run(model, output_router_logits=True)
        assert len(outputs.router_logits) == LAYERS
        for actual, reference in zip(outputs.router_logits, expected.router_logits, strict=True):
            assert actual.shape == (input_ids().shape[1], config.num_experts)
            torch.testing.assert_close(actual, reference, rtol=0, atol=0)
        torch.testing.assert_close(outputs.aux_loss, expected.aux_loss, rtol=0, atol=0)


def test_hidden_states_unaffected_by_attention_patches():
    config = llama_config(num_hidden_layers=LAYERS)
    modelpatch.register_patch_mapping({"LlamaAttention": ReimplementedLlamaAttention})
    with modelpatch.apply_patches():
        patched = build(LlamaModel, config)
    outputs = _run(patched, output_hidden_states=True, output_attentions=True)
    assert len(outputs.hidden_states) == LAYERS + 1
    assert len(outputs.attentions) == LAYERS


def test_recorder_extension_is_permanent_in_place_and_inert_for_stock_models():
    """What docs/class_patching.md says: the replacement is added beside the original, in place, for good."""
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.models.mistral.modeling_mistral import MistralPreTrainedModel

    class FreshAttention(torch.nn.Module):
        """LlamaAttention reimplemented by a class no earlier test has built (the extension is process-wide)."""

        def __init__(self, config, layer_idx):
            super().__init__()
            _copy_llama_attention_state(self, config, layer_idx)

        forward = LlamaAttention.forward

    specs = LlamaPreTrainedModel._can_record_outputs
    entries_before = dict(specs)
    mistral_before = dict(MistralPreTrainedModel._can_record_outputs)
    config = llama_config(num_hidden_layers=LAYERS)
    stock_before = build(LlamaModel, config)
    expected = _run(stock_before, output_attentions=True)

    with modelpatch.Patcher({"LlamaAttention": FreshAttention}):
        patched = build(LlamaModel, config)
    after = build(LlamaModel, config)

    assert LlamaPreTrainedModel._can_record_outputs is specs  # the same dict, changed in place ...
    assert list(specs) == list(entries_before)  # ... with the same keys
    attentions = specs["attentions"]
    assert isinstance(attentions, list) and attentions[0] is LlamaAttention and FreshAttention in attentions
    assert all(specs[key] == value for key, value in entries_before.items() if key != "attentions")
    assert MistralPreTrainedModel._can_record_outputs == mistral_before  # other modeling modules: untouched
    # It stays after the scope, and a model without the replacement records exactly as before it.
    after.load_state_dict(stock_before.state_dict())
    outputs = _run(after, output_attentions=True)
    _assert_attentions(outputs)
    for actual, reference in zip(outputs.attentions, expected.attentions, strict=True):
        torch.testing.assert_close(actual, reference, rtol=0, atol=0)
    _assert_attentions(_run(patched, output_attentions=True))


def test_a_subclass_of_an_earlier_replacement_is_recorded_once():
    """The first replacement is in the specs for good; a subclass of it must not be added again beside it (its
    modules would be recorded twice: 2 x layers attentions)."""

    class FirstAttention(ReimplementedLlamaAttention):
        pass

    class SecondAttention(FirstAttention):
        pass

    config = llama_config(num_hidden_layers=LAYERS)
    for replacement in (FirstAttention, SecondAttention):
        with modelpatch.Patcher({"LlamaAttention": replacement}):
            model = build(LlamaModel, config)
        _assert_attentions(_run(model, output_attentions=True))
