"""Patchable namespaces: classes outside transformers are only replaced once their namespace is registered."""

from __future__ import annotations

import pytest
import torch
from patching_user_models import FastUserAttention, UserAttention, UserBlock, UserModel
from transformers import LlamaModel
from transformers.models.llama.modeling_llama import LlamaAttention

import modelpatch
from modelpatch.patching.candidates import is_patch_candidate
from support.patching import PlainModule, llama_config

NAMESPACE = UserModel.__module__  # "patching_user_models": a real, importable module name


@pytest.fixture
def user_namespace():
    assert NAMESPACE not in modelpatch.get_patchable_namespaces()
    modelpatch.register_patchable_namespace(NAMESPACE)
    try:
        yield NAMESPACE
    finally:
        if NAMESPACE in modelpatch.get_patchable_namespaces():
            modelpatch.unregister_patchable_namespace(NAMESPACE)


def _attention_types(model: UserModel) -> list[type]:
    return [type(block.attention) for block in model.blocks]


def test_user_classes_are_not_candidates_by_default():
    assert NAMESPACE == "patching_user_models"
    assert not is_patch_candidate(UserAttention)
    modelpatch.register_patch_mapping({"UserAttention": FastUserAttention})
    with modelpatch.apply_patches():
        model = UserModel()
    assert _attention_types(model) == [UserAttention, UserAttention]


def test_registered_namespace_makes_user_classes_patchable(user_namespace):
    assert user_namespace in modelpatch.get_patchable_namespaces()
    assert is_patch_candidate(UserAttention)
    modelpatch.register_patch_mapping({"UserAttention": FastUserAttention})
    with modelpatch.apply_patches():
        model = UserModel()
    assert _attention_types(model) == [FastUserAttention, FastUserAttention]
    assert all(type(block) is UserBlock for block in model.blocks)
    # The replacement runs like the original.
    assert model(torch.zeros(1, 8)).shape == (1, 8)
    # Outside the scope, the original again.
    assert _attention_types(UserModel()) == [UserAttention, UserAttention]


def test_unregistering_the_namespace_stops_patching(user_namespace):
    modelpatch.register_patch_mapping({"UserAttention": FastUserAttention})
    modelpatch.unregister_patchable_namespace(user_namespace)
    assert user_namespace not in modelpatch.get_patchable_namespaces()
    with modelpatch.apply_patches():
        model = UserModel()
    assert _attention_types(model) == [UserAttention, UserAttention]


def test_namespace_matches_whole_dotted_components(user_namespace):
    # A prefix that is not a whole dotted component does not match.
    modelpatch.register_patchable_namespace("patching_user")
    try:
        assert is_patch_candidate(UserAttention)  # via the real namespace
        modelpatch.unregister_patchable_namespace(user_namespace)
        assert not is_patch_candidate(UserAttention)  # "patching_user" is not "patching_user_models"
    finally:
        modelpatch.unregister_patchable_namespace("patching_user")


def test_transformers_modeling_classes_are_candidates_others_are_not():
    from transformers.modeling_outputs import BaseModelOutputWithPast
    from transformers.pytorch_utils import Conv1D

    assert is_patch_candidate(LlamaAttention)
    assert not is_patch_candidate(Conv1D)  # transformers, but not a modeling_* module of transformers.models
    assert not is_patch_candidate(torch.nn.Linear)
    assert not is_patch_candidate(BaseModelOutputWithPast)
    assert not is_patch_candidate(PlainModule)


@pytest.mark.parametrize("bad", ["", ".leading", "trailing.", None, 3])
def test_invalid_namespace_is_rejected(bad):
    before = modelpatch.get_patchable_namespaces()
    with pytest.raises(ValueError):
        modelpatch.register_patchable_namespace(bad)
    assert modelpatch.get_patchable_namespaces() == before


def test_unregistering_an_unknown_namespace_names_it():
    with pytest.raises(ValueError, match="'not_registered.pkg'"):
        modelpatch.unregister_patchable_namespace("not_registered.pkg")


def test_registering_a_namespace_does_not_affect_transformers_patching(user_namespace):
    modelpatch.register_patch_mapping({"UserAttention": FastUserAttention})
    with modelpatch.apply_patches():
        model = LlamaModel(llama_config(num_hidden_layers=1))
    assert type(model.layers[0].self_attn) is LlamaAttention
