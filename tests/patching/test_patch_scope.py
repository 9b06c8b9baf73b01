"""Patch scopes: where and when replacements apply (threads, asyncio tasks, nesting, exceptions, copies)."""

from __future__ import annotations

import asyncio
import copy
import pickle
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import pytest
import torch
from transformers import BertModel, LlamaForCausalLM, LlamaModel, Qwen2MoeForCausalLM, Qwen2MoeModel
from transformers.models.bert.modeling_bert import BertSelfAttention
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeAttention, Qwen2MoeExperts

import modelpatch
from modelpatch import Patcher
from support.patching import (
    ArgsRecordingAttention,
    CountingLlamaAttention,
    MarkedBertSelfAttention,
    MarkedLlamaAttention,
    MarkedLlamaMLP,
    MarkedQwen2MoeAttention,
    MarkedQwen2MoeExperts,
    OtherLlamaAttention,
    WrappedLlamaAttention,
    bert_config,
    input_ids,
    llama_config,
    module_classes,
    qwen2_moe_config,
)


def _attn_mlp(model) -> tuple[set[type], set[type]]:
    layers = model.layers if hasattr(model, "layers") else model.model.layers
    return {type(layer.self_attn) for layer in layers}, {type(layer.mlp) for layer in layers}


def _tiny_llama():
    return LlamaModel(llama_config(num_hidden_layers=1))


# --- basic activity ------------------------------------------------------------------------------------------------


def test_patches_apply_only_inside_apply_patches():
    modelpatch.register_patch_mapping({"LlamaAttention": MarkedLlamaAttention})
    assert _attn_mlp(_tiny_llama()) == ({LlamaAttention}, {LlamaMLP})  # registered is not applied
    with modelpatch.apply_patches():
        assert _attn_mlp(_tiny_llama()) == ({MarkedLlamaAttention}, {LlamaMLP})
    assert _attn_mlp(_tiny_llama()) == ({LlamaAttention}, {LlamaMLP})


def test_patches_apply_only_inside_patcher():
    patcher = Patcher({"LlamaMLP": MarkedLlamaMLP})
    assert _attn_mlp(_tiny_llama()) == ({LlamaAttention}, {LlamaMLP})
    with patcher as entered:
        assert entered is patcher
        assert _attn_mlp(_tiny_llama()) == ({LlamaAttention}, {MarkedLlamaMLP})
    assert _attn_mlp(_tiny_llama()) == ({LlamaAttention}, {LlamaMLP})
    with patcher:  # reusable
        assert _attn_mlp(_tiny_llama()) == ({LlamaAttention}, {MarkedLlamaMLP})


def test_registry_is_read_once_on_entry():
    with modelpatch.apply_patches():
        modelpatch.register_patch_mapping({"LlamaAttention": MarkedLlamaAttention})
        assert _attn_mlp(_tiny_llama()) == ({LlamaAttention}, {LlamaMLP})
    with modelpatch.apply_patches():
        modelpatch.clear_patch_mapping()
        assert _attn_mlp(_tiny_llama()) == ({MarkedLlamaAttention}, {LlamaMLP})


def test_module_globals_are_never_touched():
    before = dict(vars(modeling_llama))
    modelpatch.register_patch_mapping({".*Attention": MarkedLlamaAttention, ".*MLP": MarkedLlamaMLP})
    with modelpatch.apply_patches(), Patcher({"LlamaRMSNorm": MarkedLlamaMLP}):
        assert modeling_llama.LlamaAttention is LlamaAttention
        assert modeling_llama.LlamaMLP is LlamaMLP
        assert vars(modeling_llama) == before
    assert vars(modeling_llama) == before


# --- threads and tasks ---------------------------------------------------------------------------------------------


# model class, config, mapping, classes the mapping replaces, their replacements
MODELS = {
    "llama": (
        LlamaModel,
        llama_config,
        {"LlamaAttention": MarkedLlamaAttention, "LlamaMLP": MarkedLlamaMLP},
        {LlamaAttention, LlamaMLP},
        {MarkedLlamaAttention, MarkedLlamaMLP},
    ),
    "qwen2_moe": (
        Qwen2MoeModel,
        qwen2_moe_config,
        {"Qwen2MoeAttention": MarkedQwen2MoeAttention, ".*MoeExperts$": MarkedQwen2MoeExperts},
        {Qwen2MoeAttention, Qwen2MoeExperts},
        {MarkedQwen2MoeAttention, MarkedQwen2MoeExperts},
    ),
    "bert": (
        BertModel,
        bert_config,
        {".*SelfAttention$": MarkedBertSelfAttention},
        {BertSelfAttention},
        {MarkedBertSelfAttention},
    ),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_patch_active_only_inside_the_scope(name):
    model_cls, config_fn, mapping, originals, replacements = MODELS[name]
    config = config_fn()
    modelpatch.register_patch_mapping(mapping)
    outside_before = module_classes(model_cls(config))
    with modelpatch.apply_patches():
        inside = module_classes(model_cls(config))
    outside_after = module_classes(model_cls(config))
    with Patcher(mapping):
        modelpatch.clear_patch_mapping()
        inside_patcher = module_classes(model_cls(config))
    for outside in (outside_before, outside_after):
        assert originals <= outside and not replacements & outside
    for types in (inside, inside_patcher):
        assert replacements <= types and not originals & types


@pytest.mark.parametrize("name", list(MODELS))
def test_other_thread_builds_originals_while_a_scope_builds_concurrently(name):
    model_cls, config_fn, mapping, originals, replacements = MODELS[name]
    modelpatch.register_patch_mapping(mapping)
    config = config_fn(num_hidden_layers=2)
    iterations = 25
    barrier = threading.Barrier(2)
    errors: list[str] = []
    seen: dict[str, set[type]] = {"patched": set(), "plain": set()}

    def builds(kind: str, scope: Callable[[], AbstractContextManager[object]]) -> None:
        try:
            with scope():
                for _ in range(iterations):
                    barrier.wait(timeout=30)
                    seen[kind] |= module_classes(model_cls(config))
        except BaseException as exc:  # noqa: BLE001
            errors.append(repr(exc))
            barrier.abort()

    threads = [
        threading.Thread(target=builds, args=("patched", modelpatch.apply_patches)),
        threading.Thread(target=builds, args=("plain", nullcontext)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors
    assert replacements <= seen["patched"] and not originals & seen["patched"]
    assert originals <= seen["plain"] and not replacements & seen["plain"]


def test_many_threads_with_different_patchers_get_their_own_replacements():
    config = llama_config(num_hidden_layers=1)
    replacements = [MarkedLlamaAttention, OtherLlamaAttention, None, CountingLlamaAttention] * 2
    barrier = threading.Barrier(len(replacements))
    results: list[object] = [None] * len(replacements)

    def run(i: int, replacement):
        try:
            patcher = Patcher({"LlamaAttention": replacement} if replacement else {})
            found = set()
            with patcher:
                for _ in range(10):
                    barrier.wait(timeout=30)
                    found |= _attn_mlp(LlamaModel(config))[0]
            results[i] = found
        except BaseException as exc:  # noqa: BLE001
            results[i] = exc
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i, r)) for i, r in enumerate(replacements)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert results == [{r or LlamaAttention} for r in replacements]


def test_asyncio_tasks_are_isolated():
    modelpatch.register_patch_mapping({"LlamaAttention": MarkedLlamaAttention})
    config = llama_config(num_hidden_layers=1)

    async def main():
        entered, built = asyncio.Event(), asyncio.Event()

        async def patched_task():
            with modelpatch.apply_patches():
                entered.set()
                await built.wait()  # the other task builds while this one is inside its scope
                return _attn_mlp(LlamaModel(config))[0]

        async def plain_task():
            await entered.wait()
            types = _attn_mlp(LlamaModel(config))[0]
            built.set()
            return types

        async def patcher_task():
            await entered.wait()
            with Patcher({"LlamaAttention": OtherLlamaAttention}):
                await asyncio.sleep(0)
                return _attn_mlp(LlamaModel(config))[0]

        results = await asyncio.gather(patched_task(), plain_task(), patcher_task())
        return results, _attn_mlp(LlamaModel(config))[0]

    (patched, plain, other), after = asyncio.run(main())
    assert patched == {MarkedLlamaAttention}
    assert plain == {LlamaAttention}
    assert other == {OtherLlamaAttention}
    assert after == {LlamaAttention}


# --- nesting, interleaving, exceptions ------------------------------------------------------------------------------


def test_nested_scopes():
    modelpatch.register_patch_mapping({"LlamaAttention": MarkedLlamaAttention})
    with modelpatch.apply_patches():
        with Patcher({"LlamaMLP": MarkedLlamaMLP}):
            assert _attn_mlp(_tiny_llama()) == ({MarkedLlamaAttention}, {MarkedLlamaMLP})
            with Patcher({"LlamaAttention": OtherLlamaAttention}):
                assert _attn_mlp(_tiny_llama()) == ({OtherLlamaAttention}, {MarkedLlamaMLP})
            assert _attn_mlp(_tiny_llama()) == ({MarkedLlamaAttention}, {MarkedLlamaMLP})
        assert _attn_mlp(_tiny_llama()) == ({MarkedLlamaAttention}, {LlamaMLP})
    assert _attn_mlp(_tiny_llama()) == ({LlamaAttention}, {LlamaMLP})


def test_innermost_scope_wins():
    modelpatch.register_patch_mapping({"LlamaAttention": MarkedLlamaAttention})
    patcher = Patcher({"LlamaAttention": OtherLlamaAttention})
    with modelpatch.apply_patches(), patcher:
        assert _attn_mlp(_tiny_llama())[0] == {OtherLlamaAttention}
    with patcher, modelpatch.apply_patches():
        assert _attn_mlp(_tiny_llama())[0] == {MarkedLlamaAttention}


def test_same_patcher_nested_twice():
    patcher = Patcher({"LlamaMLP": MarkedLlamaMLP})
    with patcher:
        with patcher:
            assert _attn_mlp(_tiny_llama())[1] == {MarkedLlamaMLP}
        assert _attn_mlp(_tiny_llama())[1] == {MarkedLlamaMLP}
    assert _attn_mlp(_tiny_llama())[1] == {LlamaMLP}


def test_interleaved_scopes_end_with_originals():
    modelpatch.register_patch_mapping({"LlamaAttention": MarkedLlamaAttention})
    a = modelpatch.apply_patches()
    b = Patcher({"LlamaMLP": MarkedLlamaMLP})
    a.__enter__()
    modelpatch.clear_patch_mapping()  # B reads the (now empty) registry: only A carries the attention patch
    b.__enter__()
    assert _attn_mlp(_tiny_llama()) == ({MarkedLlamaAttention}, {MarkedLlamaMLP})
    a.__exit__(None, None, None)  # A leaves first: only B's replacements remain
    assert _attn_mlp(_tiny_llama()) == ({LlamaAttention}, {MarkedLlamaMLP})
    b.__exit__(None, None, None)
    assert _attn_mlp(_tiny_llama()) == ({LlamaAttention}, {LlamaMLP})


def test_interleaved_patchers_end_with_originals():
    a = Patcher({"LlamaAttention": MarkedLlamaAttention})
    b = Patcher({"LlamaMLP": MarkedLlamaMLP})
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert _attn_mlp(_tiny_llama()) == ({LlamaAttention}, {MarkedLlamaMLP})
    b.__exit__(None, None, None)
    assert _attn_mlp(_tiny_llama()) == ({LlamaAttention}, {LlamaMLP})


def test_exception_inside_scope_restores_originals():
    modelpatch.register_patch_mapping({"LlamaAttention": MarkedLlamaAttention})
    with pytest.raises(KeyError, match="boom"):
        with modelpatch.apply_patches():
            assert _attn_mlp(_tiny_llama())[0] == {MarkedLlamaAttention}
            raise KeyError("boom")
    assert _attn_mlp(_tiny_llama()) == ({LlamaAttention}, {LlamaMLP})

    with pytest.raises(RuntimeError, match="boom"):
        with Patcher({"LlamaMLP": MarkedLlamaMLP}):
            raise RuntimeError("boom")
    assert _attn_mlp(_tiny_llama()) == ({LlamaAttention}, {LlamaMLP})


def test_exception_inside_inner_scope_restores_the_outer_scope():
    modelpatch.register_patch_mapping({"LlamaAttention": MarkedLlamaAttention})
    with modelpatch.apply_patches():
        with pytest.raises(ValueError, match="inner"):
            with Patcher({"LlamaMLP": MarkedLlamaMLP, "LlamaAttention": OtherLlamaAttention}):
                assert _attn_mlp(_tiny_llama()) == ({OtherLlamaAttention}, {MarkedLlamaMLP})
                raise ValueError("inner")
        assert _attn_mlp(_tiny_llama()) == ({MarkedLlamaAttention}, {LlamaMLP})
    assert _attn_mlp(_tiny_llama()) == ({LlamaAttention}, {LlamaMLP})


def test_exception_while_building_inside_scope_restores_originals():
    modelpatch.register_patch_mapping({"LlamaAttention": MarkedLlamaAttention})
    config = llama_config()
    # Set after validation, so that construction itself fails: in LlamaMLP, after the patched attention was built.
    config.hidden_act = "no-such-activation"
    with pytest.raises(KeyError, match="no-such-activation"):
        with modelpatch.apply_patches():
            LlamaModel(config)
    assert _attn_mlp(_tiny_llama()) == ({LlamaAttention}, {LlamaMLP})


# --- Patcher vs registry ------------------------------------------------------------------------------------------


def test_patcher_mapping_wins_over_registry_which_it_leaves_unchanged():
    modelpatch.register_patch_mapping({"LlamaAttention": MarkedLlamaAttention, "LlamaMLP": MarkedLlamaMLP})
    registry_before = modelpatch.get_patch_mapping()
    with Patcher({"LlamaAttention": OtherLlamaAttention}):
        assert modelpatch.get_patch_mapping() == registry_before
        # The Patcher's entry wins; registry entries it does not override still apply.
        assert _attn_mlp(_tiny_llama()) == ({OtherLlamaAttention}, {MarkedLlamaMLP})
    assert modelpatch.get_patch_mapping() == registry_before


def test_patcher_pattern_beats_registry_exact_name():
    modelpatch.register_patch_mapping({"LlamaAttention": MarkedLlamaAttention})
    with Patcher({".*Attention$": OtherLlamaAttention}):
        assert _attn_mlp(_tiny_llama())[0] == {OtherLlamaAttention}


# --- classes, copies, pickling ---------------------------------------------------------------------------------


def test_isinstance_and_issubclass_of_originals_unaffected():
    original = _tiny_llama().layers[0].self_attn
    mro_before = LlamaAttention.__mro__
    modelpatch.register_patch_mapping({"LlamaAttention": WrappedLlamaAttention, "LlamaMLP": MarkedLlamaMLP})
    with modelpatch.apply_patches():
        patched = _tiny_llama()
        assert isinstance(original, LlamaAttention) and type(original) is LlamaAttention
        assert not issubclass(WrappedLlamaAttention, LlamaAttention)
        assert not isinstance(patched.layers[0].self_attn, LlamaAttention)
        assert isinstance(patched.layers[0].mlp, LlamaMLP)  # a subclass replacement is still an instance
        assert issubclass(MarkedLlamaMLP, LlamaMLP) and not issubclass(LlamaMLP, MarkedLlamaMLP)
        assert LlamaAttention.__mro__ == mro_before
    assert type(patched.layers[0].self_attn.inner) is LlamaAttention
    assert isinstance(original, LlamaAttention)
    assert LlamaAttention.__new__ is torch.nn.Module.__new__


def _main_output(outputs) -> torch.Tensor:
    return outputs.logits if hasattr(outputs, "logits") else outputs.last_hidden_state


@pytest.mark.parametrize(
    ("model_cls", "config_fn"),
    [(LlamaForCausalLM, llama_config), (Qwen2MoeForCausalLM, qwen2_moe_config), (BertModel, bert_config)],
    ids=["llama", "qwen2_moe", "bert"],
)
def test_copies_made_inside_a_scope_keep_original_classes(model_cls, config_fn):
    torch.manual_seed(0)
    model = model_cls(config_fn()).eval()
    types_before = [type(m) for m in model.modules()]
    modelpatch.register_patch_mapping(
        {
            "LlamaAttention": MarkedLlamaAttention,
            "Qwen2MoeAttention": MarkedQwen2MoeAttention,
            "BertSelfAttention": MarkedBertSelfAttention,
            ".*MoeExperts$": MarkedQwen2MoeExperts,
            "LlamaMLP": MarkedLlamaMLP,
        }
    )
    with modelpatch.apply_patches():
        replacements = {MarkedLlamaAttention, MarkedQwen2MoeAttention, MarkedBertSelfAttention}
        assert module_classes(model_cls(config_fn())) & replacements  # the scope is active for constructions ...
        deep = copy.deepcopy(model)  # ... but copies keep their classes
        unpickled = pickle.loads(pickle.dumps(model))
        shallow = copy.copy(model)
    for clone in (deep, unpickled, shallow):
        assert [type(m) for m in clone.modules()] == types_before
    ids = input_ids()
    with torch.no_grad():
        expected = _main_output(model(ids))
        torch.testing.assert_close(_main_output(deep(ids)), expected, rtol=0, atol=0)
        torch.testing.assert_close(_main_output(unpickled(ids)), expected, rtol=0, atol=0)


def test_models_built_outside_a_scope_pickle_and_deepcopy():
    torch.manual_seed(0)
    plain = LlamaForCausalLM(llama_config()).eval()
    modelpatch.register_patch_mapping({"LlamaAttention": MarkedLlamaAttention})
    with modelpatch.apply_patches():
        patched = LlamaForCausalLM(llama_config()).eval()
    patched.load_state_dict(plain.state_dict())
    ids = input_ids()
    for model, attention in ((plain, LlamaAttention), (patched, MarkedLlamaAttention)):
        for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert {type(layer.self_attn) for layer in clone.model.layers} == {attention}
            with torch.no_grad():
                torch.testing.assert_close(clone(ids).logits, plain(ids).logits, rtol=0, atol=0)


# --- how replacements are built ------------------------------------------------------------------------------


def test_subclass_replacement_is_constructed_exactly_once():
    config = llama_config(num_hidden_layers=3)
    CountingLlamaAttention.init_calls = 0
    modelpatch.register_patch_mapping({"LlamaAttention": CountingLlamaAttention})
    with modelpatch.apply_patches():
        model = LlamaModel(config)
    assert CountingLlamaAttention.init_calls == 3
    assert [layer.self_attn.layer_idx for layer in model.layers] == [0, 1, 2]
    # Outside a scope, constructing the replacement directly also runs __init__ once.
    CountingLlamaAttention(config, 0)
    assert CountingLlamaAttention.init_calls == 4


def test_non_subclass_replacement_receives_the_original_constructor_args():
    config = llama_config(num_hidden_layers=3)
    ArgsRecordingAttention.init_calls = 0
    ArgsRecordingAttention.received = []
    modelpatch.register_patch_mapping({"LlamaAttention": ArgsRecordingAttention})
    with modelpatch.apply_patches():
        model = LlamaModel(config)
    assert ArgsRecordingAttention.init_calls == 3
    assert len(ArgsRecordingAttention.received) == 3
    for layer_idx, ((args, kwargs), layer) in enumerate(
        zip(ArgsRecordingAttention.received, model.layers, strict=True)
    ):
        # LlamaDecoderLayer calls LlamaAttention(config=config, layer_idx=layer_idx).
        bound = dict(zip(("config", "layer_idx"), args, strict=False)) | kwargs
        assert bound.keys() == {"config", "layer_idx"}
        assert bound["config"] is model.config
        assert bound["layer_idx"] == layer_idx
        assert type(layer.self_attn) is ArgsRecordingAttention
        # The wrapper's own LlamaAttention(...) call got the original class, not itself again.
        assert type(layer.self_attn.inner) is LlamaAttention


def test_wrapper_replacement_matches_the_original_outputs():
    config = llama_config()
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config).eval()
    modelpatch.register_patch_mapping({"LlamaAttention": WrappedLlamaAttention})
    with modelpatch.apply_patches():
        wrapped = LlamaForCausalLM(config).eval()
    state = {k.replace(".self_attn.", ".self_attn.inner."): v for k, v in reference.state_dict().items()}
    wrapped.load_state_dict(state)
    ids = input_ids()
    with torch.no_grad():
        torch.testing.assert_close(wrapped(ids).logits, reference(ids).logits, rtol=0, atol=0)


def test_wrapper_in_a_pattern_scope_still_gets_the_original_inside():
    # ".*Attention" also matches LlamaAttention built inside the wrapper; the wrapper must get the original there.
    modelpatch.register_patch_mapping({".*Attention": WrappedLlamaAttention})
    with modelpatch.apply_patches():
        model = _tiny_llama()
    attention = model.layers[0].self_attn
    assert type(attention) is WrappedLlamaAttention and type(attention.inner) is LlamaAttention


class DelegatingLlamaMLP(LlamaMLP):
    """A LlamaMLP that runs an inner original one: a wrapper that subclasses the class it wraps."""

    def __init__(self, config):
        super().__init__(config)
        self.inner = LlamaMLP(config)

    def forward(self, x):
        return self.inner(x)


def test_a_subclass_wrapper_gets_the_original_inside_its_own_construction():
    """Its __init__ runs after the dispatcher returned (type.__call__ runs it): it recursed into itself forever."""
    modelpatch.register_patch_mapping({"LlamaMLP": DelegatingLlamaMLP})
    with modelpatch.apply_patches():
        model = _tiny_llama()
    for layer in model.layers:
        assert type(layer.mlp) is DelegatingLlamaMLP and type(layer.mlp.inner) is LlamaMLP
    modelpatch.clear_patch_mapping()
    patched = modelpatch.from_config(LlamaModel, llama_config(), patcher=Patcher({"LlamaMLP": DelegatingLlamaMLP}))
    assert {(type(layer.mlp), type(layer.mlp.inner)) for layer in patched.layers} == {(DelegatingLlamaMLP, LlamaMLP)}


def test_argless_construction_is_never_replaced():
    modelpatch.register_patch_mapping({"BertModel": PlainModuleWithDefaults, ".*": PlainModuleWithDefaults})
    with modelpatch.apply_patches():
        # __new__ with no arguments is what copy/pickle use: it must return the class asked for.
        instance = LlamaAttention.__new__(LlamaAttention)
        bert_instance = BertModel.__new__(BertModel)
    assert type(instance) is LlamaAttention
    assert type(bert_instance) is BertModel


class PlainModuleWithDefaults(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        super().__init__()


def test_qwen2_moe_scope_activity():
    modelpatch.register_patch_mapping({"Qwen2MoeAttention": MarkedQwen2MoeAttention})
    config = qwen2_moe_config()
    with modelpatch.apply_patches():
        patched = Qwen2MoeForCausalLM(config)
    plain = Qwen2MoeForCausalLM(config)
    assert {type(layer.self_attn) for layer in patched.model.layers} == {MarkedQwen2MoeAttention}
    assert {type(layer.self_attn) for layer in plain.model.layers} == {Qwen2MoeAttention}


class _TaggingBase:
    """A base whose ``__new__`` must still run for ``class M(nn.Module, _TaggingBase)`` once the dispatcher exists."""

    def __new__(cls, *args, **kwargs):
        instance = super().__new__(cls)
        object.__setattr__(instance, "made_by", ("_TaggingBase.__new__", args, kwargs))
        return instance


class _ModuleWithBaseNew(torch.nn.Module, _TaggingBase):
    def __init__(self, width, *, bias=True):
        super().__init__()
        self.linear = torch.nn.Linear(width, width, bias=bias)


def test_dispatcher_keeps_a_later_base_new_working():
    modelpatch.register_patch_mapping({"LlamaMLP": MarkedLlamaMLP})
    with modelpatch.apply_patches():  # make sure the dispatcher is installed
        _tiny_llama()
    for scope in (modelpatch.apply_patches(), Patcher()):
        with scope:
            inside = _ModuleWithBaseNew(3, bias=False)
        assert inside.made_by == ("_TaggingBase.__new__", (3,), {"bias": False})
    outside = _ModuleWithBaseNew(2)
    assert outside.made_by == ("_TaggingBase.__new__", (2,), {})
    assert outside.linear.in_features == 2 and inside.linear.bias is None
    assert type(copy.deepcopy(outside)) is _ModuleWithBaseNew
