"""DCP in the original layout (loading/distributed_checkpoint.py) in one process: ``set_original_state_dict`` checks
the whole dict against the model's original layout before it writes anything.

The two-rank runs (DTensor placeholders filled by ``torch.distributed.checkpoint``) are in test_fsdp_checkpoint.py;
``set_original_state_dict`` works on a model each process holds whole too, which is what these tests load into.
"""

from __future__ import annotations

import pytest
import torch

import modelpatch
from modelpatch.errors import LoadPlanError
from support.compare import assert_bitwise_equal

FUSED = {"qkv": True, "gate_up": True}
Q = "model.layers.0.self_attn.q_proj.weight"
K = "model.layers.0.self_attn.k_proj.weight"


def _perturbed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {k: v + torch.randn(v.shape, generator=generator, dtype=v.dtype) for k, v in state.items()}


def _refused(model, state_dict, *keys: str) -> str:
    """``set_original_state_dict(model, state_dict)`` is a :class:`LoadPlanError` naming ``keys`` and changes nothing;
    returns the message."""
    before = {key: tensor.clone() for key, tensor in model.state_dict().items()}
    with pytest.raises(LoadPlanError) as raised:
        modelpatch.set_original_state_dict(model, state_dict)
    message = str(raised.value)
    for key in keys:
        assert key in message, message
    assert "nothing was changed" in message and "get_original_state_dict" in message, message
    assert_bitwise_equal(model.state_dict(), before)
    return message


@pytest.mark.parametrize(
    ("name", "fusion_config"),
    [("llama", FUSED), ("qwen2_moe", {"linear_experts": True}), ("qwen2_moe_3d", {"linear_experts": True})],
)
def test_a_fused_models_original_state_fills_an_unfused_model(tiny, name, fusion_config):
    """The checks refuse nothing the original layout holds: a fused model's state (changed since its load) fills a
    model built without the fusions, as a stock load of the same tensors fills a stock model."""
    checkpoint = tiny(name)
    fused = checkpoint.load(fusion_config)
    with torch.no_grad():
        for parameter in fused.parameters():
            parameter.add_(0.5)
    original = modelpatch.get_original_state_dict(fused)
    unfused = checkpoint.load()
    modelpatch.set_original_state_dict(unfused, original)
    assert_bitwise_equal(dict(modelpatch.iter_original_state_dict(unfused)), original)


@pytest.mark.parametrize(
    "key", ["lm_head.weight", "model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight"]
)
@pytest.mark.parametrize("shape", [(1, 32), (32,), ()], ids=["row", "vector", "scalar"])
def test_a_tensor_that_would_broadcast_is_refused_by_name(tiny, key, shape):
    """``copy_`` broadcasts: one row (or a scalar) would fill every row of the parameter."""
    checkpoint = tiny("llama")
    model = checkpoint.load(FUSED)
    state = _perturbed(modelpatch.get_original_state_dict(model))
    state[key] = torch.ones(shape)
    message = _refused(model, state, key)
    assert f"the state dict gives {list(shape)}" in message


def test_q_and_k_of_swapped_sizes_are_refused_though_they_fill_qkv_proj(tiny):
    checkpoint = tiny("llama")
    model = checkpoint.load(FUSED)
    state = _perturbed(modelpatch.get_original_state_dict(model))
    q, k = state[Q], state[K]
    assert q.shape[0] != k.shape[0]  # grouped-query attention: k has fewer rows
    state[Q], state[K] = torch.cat([q, k])[: k.shape[0]], torch.cat([q, k])[k.shape[0] :]
    _refused(model, state, Q, K)


def test_every_key_is_checked_before_anything_is_written(tiny):
    """A shape that cannot broadcast and a non-tensor value, after keys that fit: refused, each named, nothing
    written (the keys before them included)."""
    checkpoint = tiny("llama")
    model = checkpoint.load(FUSED)
    state = _perturbed(modelpatch.get_original_state_dict(model))
    last, before_last = list(state)[-1], list(state)[-2]
    state[last] = torch.zeros(3, 3)
    state[before_last] = "weights"
    message = _refused(model, state, last, before_last)
    assert "not tensors" in message and "shape mismatches" in message


def test_keys_the_model_does_not_have_are_refused_by_name(tiny):
    checkpoint = tiny("llama")
    model = checkpoint.load(FUSED)
    state = _perturbed(modelpatch.get_original_state_dict(model))
    unknown = "model.layers.7.mlp.up_proj.weight"
    state[unknown] = state["model.layers.0.mlp.up_proj.weight"]
    _refused(model, state, unknown)


def test_missing_keys_are_a_load_error_naming_each(tiny):
    checkpoint = tiny("llama")
    model = checkpoint.load(FUSED)
    state = _perturbed(modelpatch.get_original_state_dict(model))
    del state[Q], state["lm_head.weight"]
    message = _refused(model, state, Q, "lm_head.weight")
    assert "missing from the state dict (2)" in message


def test_a_tied_weight_is_refused_naming_the_weight_it_is_tied_to(stock_checkpoint):
    """The original layout holds a tied pair once (as the checkpoint stores it): a stock ``state_dict()``, which holds
    both, is refused by name rather than one of the two silently winning."""
    checkpoint = stock_checkpoint("llama_tied")
    model = checkpoint.load()
    state = _perturbed(modelpatch.get_original_state_dict(model))
    assert "lm_head.weight" not in state
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    message = _refused(model, state, "lm_head.weight")
    assert "tied to model.embed_tokens.weight" in message


@pytest.mark.parametrize("key", [Q, "model.layers.1.mlp.down_proj.weight"])  # a converted part, a direct key
def test_a_placeholder_left_on_the_meta_device_is_refused_by_name_before_any_write(tiny, key):
    """A right-shaped meta tensor (a placeholder DCP did not fill) has no data: copying it fails, after the keys
    before it were written. Refused by name with nothing written."""
    checkpoint = tiny("llama")
    model = checkpoint.load(FUSED)
    state = _perturbed(modelpatch.get_original_state_dict(model))
    state[key] = state[key].to("meta")
    message = _refused(model, state, key)
    assert "on the meta device" in message
