"""Hooks on the modules ``modelpatch.fuse`` / ``unfuse`` replace: carried over where they keep their meaning,
refused by name where they would not; and restructuring from several threads."""

from __future__ import annotations

import threading

import pytest
import torch

import modelpatch
from modelpatch import FusionError
from support.compare import assert_outputs_close, module_types
from support.fusions import assert_refused_unchanged as _refused

FUSIONS = {
    "llama": {"qkv": True, "gate_up": True},
    "qwen2_moe": {"qkv": True, "gate_up": True, "linear_experts": True},
    "qwen2_vl": {"patch_embeddings": True, "qkv": True, "gate_up": True},
}

# Modules of each model to steer: the replaced modules themselves, a projection a fusion merges, one it leaves alone.
STEERED = {
    "llama": [
        "model.layers.0.mlp",
        "model.layers.1.self_attn",
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.mlp.up_proj",
        "model.layers.0.self_attn.o_proj",
    ],
    "qwen2_moe": [
        "model.layers.0.mlp.experts",
        "model.layers.1.self_attn",
        "model.layers.0.mlp.shared_expert.gate_proj",
        "model.layers.1.self_attn.v_proj",
    ],
    "qwen2_vl": [
        "model.visual.patch_embed",
        "model.visual.patch_embed.proj",
        "model.language_model.layers.0.self_attn.k_proj",
        "model.visual.blocks.0.attn",
    ],
}


def steer(model: torch.nn.Module, names: list[str]) -> list[torch.utils.hooks.RemovableHandle]:
    """Activation steering: each module's output is shifted (a forward hook), its input scaled (a pre-hook)."""
    handles = []
    for index, name in enumerate(names):
        module = model.get_submodule(name)

        def shift(module, args, output, index=index):
            if isinstance(output, tuple):
                return (output[0] + 0.05 * (index + 1), *output[1:])
            return output + 0.05 * (index + 1)

        def scale(module, args, kwargs):
            if args:
                return (args[0] * 1.1, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": kwargs["hidden_states"] * 1.1}

        handles.append(module.register_forward_hook(shift))
        if index % 2:
            handles.append(module.register_forward_pre_hook(scale, with_kwargs=True))
    return handles


@pytest.mark.parametrize("name", sorted(FUSIONS))
def test_steering_hooks_apply_after_fuse_and_unfuse_as_on_the_stock_model(tiny, name):
    ckpt = tiny(name)
    stock = ckpt.model_class.from_pretrained(ckpt.path)
    steer(stock, STEERED[name])
    steered = ckpt.outputs(stock)
    assert not torch.allclose(steered["logits"], ckpt.stock_outputs()["logits"], atol=1e-3)  # the hooks matter

    model = ckpt.model_class.from_pretrained(ckpt.path)
    handles = steer(model, STEERED[name])
    modelpatch.fuse(model, FUSIONS[name])
    assert module_types(model) == module_types(ckpt.load(FUSIONS[name]))
    assert_outputs_close(ckpt.outputs(model), steered)
    modelpatch.unfuse(model)
    assert_outputs_close(ckpt.outputs(model), steered)
    modelpatch.fuse(model, FUSIONS[name])
    # The handles registered on the stock modules remove the hooks from the modules that carry them now.
    for handle in handles:
        handle.remove()
    assert_outputs_close(ckpt.outputs(model), ckpt.stock_outputs())


def test_backward_hooks_are_carried_over(tiny):
    ckpt = tiny("llama")
    model = ckpt.model_class.from_pretrained(ckpt.path)
    seen: list[torch.Size] = []
    model.model.layers[0].mlp.register_full_backward_hook(
        lambda module, grad_in, grad_out: seen.append(grad_out[0].shape)
    )
    modelpatch.fuse(model, FUSIONS["llama"])
    model(**ckpt.inputs()).logits.sum().backward()
    assert len(seen) == 1


def test_output_recorders_installed_before_fusing_keep_recording(tiny):
    """transformers installs its output-capturing hooks once per model, at the first forward asking for outputs."""
    ckpt = tiny("llama")
    stock = ckpt.model_class.from_pretrained(ckpt.path, attn_implementation="eager")
    model = ckpt.model_class.from_pretrained(ckpt.path, attn_implementation="eager")
    inputs = ckpt.inputs()
    with torch.no_grad():
        model(**inputs, output_attentions=True)
        modelpatch.fuse(model, FUSIONS["llama"])
        fused = model(**inputs, output_attentions=True).attentions
        expected = stock(**inputs, output_attentions=True).attentions
    assert len(fused) == len(expected) == stock.config.num_hidden_layers
    for actual, reference in zip(fused, expected, strict=True):
        torch.testing.assert_close(actual, reference, atol=1e-5, rtol=1e-4)


def test_hooks_that_would_lose_their_meaning_are_refused_by_name(tiny):
    ckpt = tiny("llama")
    model = ckpt.model_class.from_pretrained(ckpt.path)
    attention = model.model.layers[1].self_attn
    fuse = lambda m: modelpatch.fuse(m, FUSIONS["llama"])  # noqa: E731

    handle = attention.q_proj.weight.register_hook(lambda grad: grad * 2)
    _refused(model, fuse, "model.layers.1.self_attn.q_proj.weight (a tensor hook)")
    handle.remove()
    handle = attention.register_state_dict_post_hook(lambda *args: None)
    _refused(model, fuse, "model.layers.1.self_attn (state-dict hook)", "holds other tensors")
    handle.remove()
    model.model.layers[0].mlp.forward = model.model.layers[0].mlp.forward
    _refused(model, fuse, "model.layers.0.mlp (a forward set on the instance)")
    del model.model.layers[0].mlp.forward

    modelpatch.fuse(model, FUSIONS["llama"])
    handle = model.model.layers[1].self_attn.qkv_proj.register_forward_hook(lambda *args: None)
    _refused(
        model,
        modelpatch.unfuse,
        "model.layers.1.self_attn.qkv_proj (forward hook): the unfused model has no module there",
    )
    handle.remove()
    modelpatch.unfuse(model)


# Hooks fuse and unfuse would move (the modules replaced, one a fusion leaves alone) and what refuses the plan late:
# after every module was planned and those hooks were found movable.
MOVABLE = ["model.layers.0.mlp", "model.layers.1.self_attn", "model.layers.0.self_attn.o_proj"]
LATE_REFUSALS = {
    "tensor hook": ("fuse", "model.layers.1.self_attn.q_proj.weight (a tensor hook)"),
    "frozen part": ("fuse", "qkv_proj.weight would be one parameter made of q_proj.weight (frozen"),
    "hook that cannot move": ("unfuse", "model.layers.1.self_attn.qkv_proj (forward hook)"),
}


@pytest.mark.parametrize("refusal", sorted(LATE_REFUSALS))
def test_planning_moves_nothing_a_refused_plan_leaves_every_hook_where_it_was(tiny, refusal):
    """fuse / unfuse plan every module first, deciding which hooks move where; only executing the plan moves them.
    A plan refused after hooks were found movable leaves every module, hook dict, hook and parameter the very object
    it was, where it was."""
    ckpt = tiny("llama")
    model = ckpt.model_class.from_pretrained(ckpt.path)
    direction, match = LATE_REFUSALS[refusal]
    if direction == "unfuse":
        modelpatch.fuse(model, FUSIONS["llama"])
    steer(model, MOVABLE)
    o_proj = model.model.layers[0].self_attn.o_proj
    o_proj.register_state_dict_post_hook(lambda *args: None)
    o_proj.register_load_state_dict_pre_hook(lambda module, *args: None)  # bound to o_proj
    attention = model.model.layers[1].self_attn
    if refusal == "tensor hook":
        attention.q_proj.weight.register_hook(lambda grad: grad)
    elif refusal == "frozen part":
        attention.q_proj.requires_grad_(False)
    else:
        attention.qkv_proj.register_forward_hook(lambda *args: None)
    call = modelpatch.unfuse if direction == "unfuse" else lambda m: modelpatch.fuse(m, FUSIONS["llama"])
    _refused(model, call, match)


def test_a_state_dict_hook_where_the_state_is_kept_is_carried_over(tiny):
    ckpt = tiny("llama")
    model = ckpt.model_class.from_pretrained(ckpt.path)
    called: list[str] = []
    model.model.layers[0].self_attn.o_proj.register_state_dict_post_hook(lambda module, *args: called.append("o_proj"))
    modelpatch.fuse(model, FUSIONS["llama"])
    called.clear()  # fuse reads states too
    model.state_dict()
    assert called == ["o_proj"]


def test_fusing_one_model_from_two_threads_fuses_it_once(tiny):
    ckpt = tiny("llama")
    model = ckpt.model_class.from_pretrained(ckpt.path)
    barrier, outcomes = threading.Barrier(2), []

    def fuse():
        barrier.wait()
        try:
            modelpatch.fuse(model, FUSIONS["llama"])
            outcomes.append("fused")
        except Exception as exc:  # noqa: BLE001 - what the loser gets is the point
            outcomes.append(exc)

    threads = [threading.Thread(target=fuse) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes.count("fused") == 1
    (error,) = [outcome for outcome in outcomes if outcome != "fused"]
    assert isinstance(error, FusionError) and "is already fused" in str(error)
    assert_outputs_close(ckpt.outputs(model), ckpt.stock_outputs())


# float32 on CPU: each projection slice multiplies by its rows; bfloat16: the first slice runs the fused layer and its
# siblings take their parts of that output (kept on the owner).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_forward_running_while_another_thread_unfuses_finishes_with_the_same_result(tiny, dtype):
    ckpt = tiny("llama")
    model = ckpt.load(FUSIONS["llama"], dtype=dtype).eval()
    inputs = ckpt.inputs()
    with torch.no_grad():
        expected = model(**inputs).logits
    inside, unfused, results = threading.Event(), threading.Event(), []

    def pause_once(module, args):
        if not inside.is_set():
            inside.set()
            unfused.wait(timeout=60)

    model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(pause_once)

    def forward():
        try:
            with torch.no_grad():
                results.append(model(**inputs).logits)
        except Exception as exc:  # noqa: BLE001 - reported below
            results.append(exc)

    thread = threading.Thread(target=forward)
    thread.start()
    assert inside.wait(timeout=60)
    modelpatch.unfuse(model)  # while that forward is inside the fused attention of layer 0
    unfused.set()
    thread.join()
    (result,) = results
    assert isinstance(result, torch.Tensor), result
    tolerance = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 5e-2}
    torch.testing.assert_close(result, expected, **tolerance)


class WrappingLlamaMLP(torch.nn.Module):
    """Not a LlamaMLP: the same function, built from LlamaMLP's arguments, under other child names."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP

        self.inner = LlamaMLP(config)

    def forward(self, x):
        return self.inner(x)


def test_patch_model_carries_the_hooks_of_the_modules_it_replaces(tiny):
    """The replacement is called where the replaced module was: its hooks apply; those inside it, at paths the
    replacement does not have, are refused."""
    ckpt = tiny("llama")
    stock = ckpt.model_class.from_pretrained(ckpt.path)
    steer(stock, ["model.layers.0.mlp", "model.layers.1.mlp"])
    model = ckpt.model_class.from_pretrained(ckpt.path)
    handles = steer(model, ["model.layers.0.mlp", "model.layers.1.mlp"])
    patcher = modelpatch.Patcher(
        {"LlamaMLP": WrappingLlamaMLP},
        extra_weight_conversions=[modelpatch.WeightRenaming(r"\.mlp\.(?!inner\.)", ".mlp.inner.")],
    )
    inner = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda *args: None)
    _refused(model, lambda m: modelpatch.patch_model(m, patcher), "model.layers.0.mlp.down_proj (forward hook)")
    inner.remove()
    modelpatch.patch_model(model, patcher)
    assert type(model.model.layers[1].mlp) is WrappingLlamaMLP
    assert_outputs_close(ckpt.outputs(model), ckpt.outputs(stock))
    for handle in handles:
        handle.remove()
    assert_outputs_close(ckpt.outputs(model), ckpt.stock_outputs())
