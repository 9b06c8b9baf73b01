"""Which classes a mapping replaces: exact names, patterns, precedence, and what broad patterns must leave alone.

Covered on Llama, Qwen2Moe and BERT, including the BERT pitfall of the monkey-patching documentation.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import (
    BertModel,
    GPT2Config,
    GPT2Model,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    Qwen2MoeForCausalLM,
)
from transformers.models.bert import modeling_bert
from transformers.models.bert.modeling_bert import BertAttention, BertSelfAttention, BertSelfOutput
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaRMSNorm
from transformers.models.qwen2_moe.modeling_qwen2_moe import (
    Qwen2MoeAttention,
    Qwen2MoeExperts,
    Qwen2MoeSparseMoeBlock,
)
from transformers.pytorch_utils import Conv1D

import modelpatch
from support.patching import (
    MarkedBertSelfAttention,
    MarkedLlamaAttention,
    MarkedLlamaMLP,
    MarkedQwen2MoeAttention,
    OtherLlamaAttention,
    PlainModule,
    bert_config,
    build,
    input_ids,
    llama_config,
    module_classes,
    qwen2_moe_config,
    reference_and_patched,
)

# --- exact names and patterns ------------------------------------------------------------------------------------


def test_exact_name_replaces_only_that_class():
    modelpatch.register_patch_mapping({"LlamaAttention": MarkedLlamaAttention})
    with modelpatch.apply_patches():
        model = build(LlamaModel, llama_config())
    types = module_classes(model)
    assert MarkedLlamaAttention in types and LlamaAttention not in types
    assert LlamaMLP in types and LlamaDecoderLayer in types and LlamaRMSNorm in types
    assert all(type(layer.self_attn) is MarkedLlamaAttention for layer in model.layers)


def test_exact_beats_pattern_whatever_the_registration_order():
    modelpatch.register_patch_mapping({".*Attention": OtherLlamaAttention})
    modelpatch.register_patch_mapping({"LlamaAttention": MarkedLlamaAttention})
    with modelpatch.apply_patches():
        model = build(LlamaModel, llama_config())
    assert all(type(layer.self_attn) is MarkedLlamaAttention for layer in model.layers)


def test_patterns_are_tried_in_registration_order():
    modelpatch.register_patch_mapping({"^Llama.*Attention": MarkedLlamaAttention})
    modelpatch.register_patch_mapping({".*Attention$": OtherLlamaAttention})
    with modelpatch.apply_patches():
        first = build(LlamaModel, llama_config(num_hidden_layers=1))
    assert type(first.layers[0].self_attn) is MarkedLlamaAttention

    modelpatch.clear_patch_mapping()
    modelpatch.register_patch_mapping({".*Attention$": OtherLlamaAttention})
    modelpatch.register_patch_mapping({"^Llama.*Attention": MarkedLlamaAttention})
    with modelpatch.apply_patches():
        second = build(LlamaModel, llama_config(num_hidden_layers=1))
    assert type(second.layers[0].self_attn) is OtherLlamaAttention


@pytest.mark.parametrize(
    ("pattern", "replaced"),
    [
        ("Attention$", True),  # re.search: matches anywhere, here at the end
        ("lamaAtt", True),  # an identifier too: no class is named so, so it is searched for as a pattern
        ("lama.tt", True),  # a pattern: re.search finds it in the middle
        ("^Attention", False),  # anchored at the start: LlamaAttention does not start with it
        ("^LlamaAttention$", True),
        ("^llamaattention$", False),  # case-sensitive
        ("(?i)^llamaattention$", True),
    ],
)
def test_patterns_use_re_search(pattern, replaced):
    modelpatch.register_patch_mapping({pattern: MarkedLlamaAttention})
    with modelpatch.apply_patches():
        model = build(LlamaModel, llama_config(num_hidden_layers=1))
    assert (type(model.layers[0].self_attn) is MarkedLlamaAttention) is replaced
    assert type(model.layers[0].mlp) is LlamaMLP


def test_a_plain_word_key_is_a_pattern_too():
    """As transformers documents it: every key is tried as an exact name first, then every key with ``re.search``.

    No class is named "Attention" or "MLP", so they replace every class whose name contains them.
    """
    modelpatch.register_patch_mapping({"Attention": MarkedLlamaAttention, "MLP": MarkedLlamaMLP})
    with modelpatch.apply_patches():
        model = build(LlamaModel, llama_config(num_hidden_layers=2))
    assert {type(layer.self_attn) for layer in model.layers} == {MarkedLlamaAttention}
    assert {type(layer.mlp) for layer in model.layers} == {MarkedLlamaMLP}
    assert type(model.layers[0]) is LlamaDecoderLayer and type(model.norm) is LlamaRMSNorm


def test_an_exact_name_key_beats_an_earlier_key_matching_as_a_pattern():
    # "LlamaAttention" names the class exactly; "Attention" (registered first) only matches it as a pattern.
    modelpatch.register_patch_mapping({"Attention": OtherLlamaAttention, "LlamaAttention": MarkedLlamaAttention})
    with modelpatch.apply_patches():
        model = build(LlamaModel, llama_config(num_hidden_layers=1))
    assert type(model.layers[0].self_attn) is MarkedLlamaAttention


def test_an_exact_name_key_also_matches_longer_names_as_a_pattern():
    # "BertAttention" names BertAttention exactly, and is found in no other BERT class name; "SelfAttention" is a
    # pattern for BertSelfAttention.
    modelpatch.register_patch_mapping({"SelfAttention": MarkedBertSelfAttention})
    with modelpatch.apply_patches():
        model = build(BertModel, bert_config(num_hidden_layers=1))
    assert type(model.encoder.layer[0].attention) is BertAttention
    assert type(model.encoder.layer[0].attention.self) is MarkedBertSelfAttention


def test_qwen2_moe_exact_and_pattern():
    modelpatch.register_patch_mapping({"Qwen2MoeAttention": MarkedQwen2MoeAttention, ".*MoeExperts$": PlainModule})
    with modelpatch.apply_patches():
        model = build(Qwen2MoeForCausalLM, qwen2_moe_config())
    for layer in model.model.layers:
        assert type(layer.self_attn) is MarkedQwen2MoeAttention
        assert type(layer.mlp) is Qwen2MoeSparseMoeBlock
        assert type(layer.mlp.experts) is PlainModule
        # The non-subclass replacement got the original's constructor arguments.
        assert layer.mlp.experts.received_args == (model.config,)
    assert Qwen2MoeExperts not in module_classes(model)


def test_qwen2_moe_subclass_replacement_keeps_outputs():
    config = qwen2_moe_config()
    reference, patched = reference_and_patched(
        Qwen2MoeForCausalLM, config, {"Qwen2MoeAttention": MarkedQwen2MoeAttention}
    )
    patched.load_state_dict(reference.state_dict())
    assert Qwen2MoeAttention not in module_classes(patched)
    ids = input_ids()
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, reference(ids).logits, rtol=0, atol=0)


# --- broad patterns leave non-modules alone ---------------------------------------------------------------------


def test_broad_pattern_leaves_outputs_configs_functions_and_attention_interface_alone():
    from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    llama_globals = dict(vars(modeling_llama))
    interface_before = transformers.AttentionInterface
    eager_before = modeling_llama.eager_attention_forward
    sdpa_before = ALL_ATTENTION_FUNCTIONS["sdpa"]

    # Broad patterns that match output dataclasses, configs, AttentionInterface and functions by name.
    modelpatch.register_patch_mapping(
        {
            ".*Attention": MarkedLlamaAttention,
            ".*Output.*": PlainModule,
            ".*Config": PlainModule,
            ".*Interface": PlainModule,
            ".*_forward$": PlainModule,
        }
    )

    with modelpatch.apply_patches():
        # Module globals and library objects are the very same objects inside the scope.
        assert vars(modeling_llama) == llama_globals
        assert all(vars(modeling_llama)[name] is value for name, value in llama_globals.items())
        assert transformers.AttentionInterface is interface_before is AttentionInterface
        assert modeling_llama.ALL_ATTENTION_FUNCTIONS is ALL_ATTENTION_FUNCTIONS
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_before
        assert transformers.modeling_outputs.BaseModelOutputWithPast is BaseModelOutputWithPast
        assert modeling_llama.LlamaConfig is LlamaConfig is transformers.LlamaConfig

        # ... and constructing them inside the scope gives the real thing.
        config = LlamaConfig(**llama_config().to_dict())
        assert type(config) is LlamaConfig
        interface = AttentionInterface()
        assert type(interface) is AttentionInterface
        interface["eager_test"] = eager_before  # a local registration works as usual
        assert interface["eager_test"] is eager_before
        assert interface["sdpa"] is sdpa_before
        output = BaseModelOutputWithPast(last_hidden_state=torch.zeros(1))
        assert type(output) is BaseModelOutputWithPast
        model = build(LlamaForCausalLM, llama_config())
        ids = input_ids()
        with torch.no_grad():
            outputs = model(ids)
            base_outputs = model.model(ids)

    # The attention modules were replaced; output dataclasses, configs and the attention interface were not.
    assert all(type(layer.self_attn) is MarkedLlamaAttention for layer in model.model.layers)
    assert type(model.config) is LlamaConfig
    assert type(outputs) is CausalLMOutputWithPast
    assert type(base_outputs) is BaseModelOutputWithPast
    assert outputs.logits.shape == (1, ids.shape[1], 64)
    assert "eager_test" not in ALL_ATTENTION_FUNCTIONS  # the local registration did not leak
    assert vars(modeling_llama) == llama_globals


def test_broad_attention_pattern_replaces_llama_attention_only():
    modelpatch.register_patch_mapping({".*Attention": MarkedLlamaAttention})
    with modelpatch.apply_patches():
        model = build(LlamaForCausalLM, llama_config())
    types = module_classes(model)
    assert MarkedLlamaAttention in types and LlamaAttention not in types
    assert {LlamaMLP, LlamaDecoderLayer, LlamaRMSNorm} <= types
    reference = build(LlamaForCausalLM, llama_config())
    model.load_state_dict(reference.state_dict())
    ids = input_ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)


class MarkedConv1D(Conv1D):
    """Same math as transformers' Conv1D."""


def test_non_modeling_classes_are_replaced_only_where_modeling_code_imports_them_by_name():
    """Conv1D (transformers.pytorch_utils) and torch's Linear/Embedding are no candidates: GPT-2's modeling module
    imports Conv1D by name, so its Conv1D(...) calls are replaced (as transformers' apply_patches replaces them);
    Llama's nn.Linear/nn.Embedding (not imported by name) and constructions in this test are not."""
    modelpatch.register_patch_mapping({"Conv1D": MarkedConv1D, "^Linear$": PlainModule, "^Embedding$": PlainModule})
    config = GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16)
    with modelpatch.apply_patches():
        conv = Conv1D(4, 3)
        linear = torch.nn.Linear(3, 4)
        llama = build(LlamaModel, llama_config(num_hidden_layers=1))
        gpt2 = build(GPT2Model, config, seed=1)
    assert type(conv) is Conv1D and type(linear) is torch.nn.Linear
    assert PlainModule not in module_classes(llama)
    attention = gpt2.h[0].attn
    assert type(attention.c_attn) is MarkedConv1D and type(attention.c_proj) is MarkedConv1D
    assert Conv1D not in module_classes(gpt2)
    reference = build(GPT2Model, config)
    gpt2.load_state_dict(reference.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(gpt2(input_ids()).last_hidden_state, reference(input_ids()).last_hidden_state)


def test_replacement_is_not_replaced_again_by_a_matching_pattern():
    # MarkedLlamaMLP's own name matches ".*MLP"; it must be built as itself, not recursively replaced.
    modelpatch.register_patch_mapping({".*MLP": MarkedLlamaMLP, ".*Attention": MarkedLlamaAttention})
    with modelpatch.apply_patches():
        model = build(LlamaModel, llama_config())
        direct = MarkedLlamaMLP(model.config)
    assert type(direct) is MarkedLlamaMLP
    assert all(type(layer.mlp) is MarkedLlamaMLP for layer in model.layers)


# --- the BERT pitfall --------------------------------------------------------------------------------------------


def test_bert_narrow_self_attention_pattern_keeps_the_model_working():
    config = bert_config()
    reference, patched = reference_and_patched(BertModel, config, {".*SelfAttention$": MarkedBertSelfAttention})

    for layer in patched.encoder.layer:
        assert type(layer.attention) is BertAttention  # the container is untouched ...
        assert type(layer.attention.self) is MarkedBertSelfAttention  # ... only the inner attention is swapped
        assert type(layer.attention.output) is BertSelfOutput
    assert BertSelfAttention not in module_classes(patched)
    assert patched.state_dict().keys() == reference.state_dict().keys()

    patched.load_state_dict(reference.state_dict())
    ids = input_ids()
    with torch.no_grad():
        expected = reference(ids, output_attentions=True)
        actual = patched(ids, output_attentions=True)
    torch.testing.assert_close(actual.last_hidden_state, expected.last_hidden_state, rtol=0, atol=0)
    torch.testing.assert_close(actual.pooler_output, expected.pooler_output, rtol=0, atol=0)
    assert len(actual.attentions) == config.num_hidden_layers


def test_bert_broad_attention_pattern_swaps_the_container():
    """The documented pitfall: ``.*Attention`` also matches ``BertAttention``, the container of self/output."""
    config = bert_config()
    reference, broken = reference_and_patched(BertModel, config, {".*Attention": MarkedBertSelfAttention})

    for layer in broken.encoder.layer:
        # BertAttention's construction was replaced: the container *is* a self-attention now ...
        assert type(layer.attention) is MarkedBertSelfAttention
        children = dict(layer.attention.named_children())
        # ... so its "self" and "output" submodules are gone (no dense/LayerNorm/residual after attention).
        assert "self" not in children and "output" not in children
        assert not hasattr(layer.attention, "output")
    types = module_classes(broken)
    assert BertAttention not in types and BertSelfOutput not in types and BertSelfAttention not in types

    missing = reference.state_dict().keys() - broken.state_dict().keys()
    assert "encoder.layer.0.attention.output.dense.weight" in missing
    assert "encoder.layer.0.attention.self.query.weight" in missing
    with pytest.raises(RuntimeError, match="attention.output.dense.weight"):
        broken.load_state_dict(reference.state_dict())

    # Silently broken: it still runs, but even with every shared weight copied over it computes something else.
    shared = {k.replace(".attention.self.", ".attention."): v for k, v in reference.state_dict().items()}
    result = broken.load_state_dict(shared, strict=False)
    assert not result.missing_keys
    assert "encoder.layer.0.attention.output.dense.weight" in result.unexpected_keys
    ids = input_ids()
    with torch.no_grad():
        out = broken(ids).last_hidden_state
        expected = reference(ids).last_hidden_state
    assert out.shape == expected.shape
    assert not torch.allclose(out, expected, atol=1e-3)


def test_bert_module_globals_untouched_by_patterns():
    bert_globals = dict(vars(modeling_bert))
    modelpatch.register_patch_mapping({".*Attention": MarkedBertSelfAttention})
    with modelpatch.apply_patches():
        assert all(vars(modeling_bert)[name] is value for name, value in bert_globals.items())
        assert modeling_bert.BertAttention is BertAttention
    assert vars(modeling_bert) == bert_globals
