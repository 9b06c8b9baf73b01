"""The state-dict boundary's instance-level methods are real bound methods of the model.

Tools take them apart as methods (llm-compressor's ``oneshot`` keeps ``model.save_pretrained.__self__`` and calls
``__func__`` rebound to the model from the wrapper it installs in its place); what they call must still save the
original layout. Copies and pickles of the model keep them, bound to the copy.
"""

from __future__ import annotations

import copy
import inspect
import pickle
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM

from support.files import read_tensors

FUSED = {"qkv": True, "gate_up": True}
BOUNDARY = ("save_pretrained", "load_state_dict", "get_output_embeddings")


def _assert_bound(model, names=BOUNDARY) -> None:
    for name in names:
        method = model.__dict__[name]
        assert inspect.ismethod(method), name
        assert method.__self__ is model, name
        assert method.__func__.__get__(model, type(model)) == method, name


@pytest.mark.parametrize("fusion_config", [FUSED, None], ids=["fused", "unfused"])
def test_boundary_methods_are_bound_methods_of_the_model(tiny, fusion_config):
    model = tiny("llama").load(fusion_config)
    _assert_bound(model)
    for module in model.modules():  # sub-models too
        if module is not model and "get_output_embeddings" in module.__dict__:
            _assert_bound(module, ("get_output_embeddings",))


def test_a_wrapper_calling_the_rebound_function_saves_the_original_layout(tiny, tmp_path):
    """What llm-compressor's modify_save_pretrained does: a weak reference to __self__, the function rebound."""
    checkpoint = tiny("llama")
    model = checkpoint.load(FUSED)
    method = model.save_pretrained
    model_ref, function, cls = weakref.ref(method.__self__), method.__func__, type(model)
    del method

    def wrapper(directory, **kwargs):
        return function.__get__(model_ref(), cls)(directory, **kwargs)

    model.save_pretrained = wrapper
    model.save_pretrained(tmp_path)
    assert sorted(read_tensors(tmp_path)) == sorted(checkpoint.tensors())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    inputs = checkpoint.inputs()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "clone", [copy.deepcopy, lambda model: pickle.loads(pickle.dumps(model))], ids=["deepcopy", "pickle"]
)
def test_copies_keep_the_boundary_bound_to_the_copy(tiny, tmp_path, clone):
    checkpoint = tiny("llama")
    copied = clone(checkpoint.load(FUSED))
    _assert_bound(copied)
    copied.save_pretrained(tmp_path)  # the original layout, as the model it was copied from writes it
    assert sorted(read_tensors(tmp_path)) == sorted(checkpoint.tensors())


def test_a_tools_own_method_is_pickled_as_it_is(tiny):
    model = tiny("llama").load(FUSED)
    model.load_state_dict = print  # a tool's replacement (picklable): not the boundary's any more
    copied = pickle.loads(pickle.dumps(model))
    assert copied.load_state_dict is print
    _assert_bound(copied, ("save_pretrained", "get_output_embeddings"))
