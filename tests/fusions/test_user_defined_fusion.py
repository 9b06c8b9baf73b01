"""Worked example: a user-defined fusion, written with the public extension API only.

The gated MLP of Llama-style models computes ``down(act(gate(x)) * up(x))`` with three ``nn.Linear`` layers. Many
kernels (xformers' ``SwiGLU``, for one) want the gate and up projections stacked into a single weight ``w12`` and the
down projection called ``w3``. The fusion below swaps every such MLP for that module at load time, converts the
checkpoint's ``gate_proj`` / ``up_proj`` / ``down_proj`` weights on the way in, and writes them back unchanged on save.

A fusion is a :class:`modelpatch.ModuleFusionSpec` (abstract: ``is_fusable`` and ``make_fused_class`` are required)
with these hooks, one signature each:

* ``target_modules_patterns``: regexes that pre-select candidate modules by dotted name (here: ``...layers.N.mlp``);
* ``is_fusable(module)``: whether one candidate (an instance built on the meta device) can be fused. Fusion is
  class-level: a class is replaced only if *every* candidate instance of it is fusable;
* ``make_fused_class(original_cls)``: the replacement class, constructed with the original's ``__init__`` arguments
  (``LlamaMLP(config)`` -> ``SwiGLU(config)``). Define it at module level so fused models pickle;
* ``make_transforms(config, modules)``: weight transforms from the checkpoint layout to the fused one. They are
  reversed on save, so ``save_pretrained`` writes the original checkpoint layout (bitwise) by default;
* ``tensor_parallel_layout(module, rules, ranks)`` (optional): how the fused module splits under ``tp_plan``, given
  the model's plan rules for the modules it replaced. Without it, the fused module stays whole on every rank
  (tests/modes/test_tensor_parallel.py loads this fusion on two ranks, with and without it).

Then ``register_fusion("swiglu", SwiGLUFusionSpec())`` and load with ``fusion_config={"swiglu": True}``.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable

import pytest
import torch
from fusion_models import assert_outputs_close, check_fused_roundtrip, checkpoint_shapes
from torch import nn
from transformers.activations import ACT2FN

import modelpatch
from modelpatch import (
    Concatenate,
    FusedParts,
    FusionError,
    ModuleFusionSpec,
    TensorParallelLayout,
    TensorParallelShard,
    WeightConverter,
    WeightRenaming,
    register_fusion,
    unregister_fusion,
)


class SwiGLU(nn.Module):
    """``w3(act(x @ w1.T) * (x @ w2.T))`` with the gate (``w1``) and up (``w2``) projections stacked in ``w12``.

    Its constructor takes what the MLPs it replaces take: a model config (and, for MLPs sized otherwise, such as
    Qwen2-MoE's shared expert, an ``intermediate_size``).
    """

    def __init__(self, config, intermediate_size: int | None = None):
        super().__init__()
        self.intermediate_size = intermediate_size or config.intermediate_size
        self.w12 = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=False)
        self.w3 = nn.Linear(self.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w12(x).chunk(2, dim=-1)
        return self.w3(self.act_fn(gate) * up)


class SwiGLUFusionSpec(ModuleFusionSpec):
    """Gated MLPs of decoder layers (``model.layers.N.mlp``: Llama, Mistral, Qwen2, ...) -> :class:`SwiGLU`."""

    # Only the decoder layers' ``mlp`` children: a MoE block's shared expert (``mlp.shared_expert``) is left alone.
    target_modules_patterns = (r"layers\.\d+\.mlp$",)

    def is_fusable(self, module: nn.Module) -> bool:
        gate, up, down = (getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj"))
        return (
            all(type(p) is nn.Linear and p.bias is None for p in (gate, up, down))
            and gate.out_features == up.out_features == down.in_features
        )

    def make_fused_class(self, original_cls: type[nn.Module]) -> type[nn.Module]:
        return SwiGLU

    def make_transforms(self, config, modules):
        # The checkpoint keeps gate and up apart: stack them (gate first) on load, split them again on save. The
        # two parts always have the same size, which also lets a from_config model be saved in the original layout.
        return [
            WeightConverter(
                [r"\.mlp\.gate_proj\.weight$", r"\.mlp\.up_proj\.weight$"],
                ".mlp.w12.weight",
                [Concatenate(dim=0, equal_parts=True)],
            ),
            WeightRenaming(r"\.mlp\.down_proj\.weight$", ".mlp.w3.weight"),
        ]

    def tensor_parallel_layout(self, module, rules, ranks):
        # Where the model's plan shards the stock MLP (gate and up colwise, down rowwise), shard SwiGLU alike: each
        # rank holds its block of gate's rows and of up's rows in w12 (so that its chunk(2) splits them), and w3 sums
        # the ranks' partial outputs. A plan that shards no part of the MLP leaves it whole.
        if not rules.keys() & {"gate_proj", "up_proj", "down_proj"}:
            return None
        return TensorParallelLayout(
            replaces=frozenset({"gate_proj", "up_proj", "down_proj"}),
            shards={
                "w12": TensorParallelShard("colwise", parts=FusedParts((module.intermediate_size,) * 2)),
                "w3": TensorParallelShard("rowwise"),
            },
        )


@pytest.fixture
def swiglu():
    register_fusion("swiglu", SwiGLUFusionSpec())
    yield
    # (the conftest also restores the registry)


# --- The example at work -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2"])
def test_swiglu_matches_stock_and_saves_back(swiglu, tiny, tmp_path, name):
    check_fused_roundtrip(tiny(name), {"swiglu": True}, tmp_path)


def test_swiglu_structure(swiglu, tiny):
    ckpt = tiny("llama")
    model = ckpt.load({"swiglu": True})
    stock_mlp = ckpt.stock().model.layers[1].mlp
    mlp = model.model.layers[1].mlp
    assert type(mlp) is SwiGLU
    assert torch.equal(mlp.w12.weight, torch.cat([stock_mlp.gate_proj.weight, stock_mlp.up_proj.weight]))
    assert torch.equal(mlp.w3.weight, stock_mlp.down_proj.weight)
    assert "model.layers.1.mlp.w12.weight" in model.state_dict()
    # A fused model pickles like any other (SwiGLU is importable from this module).
    clone = pickle.loads(pickle.dumps(model))
    assert type(clone.model.layers[1].mlp) is SwiGLU
    assert_outputs_close(ckpt.outputs(clone), ckpt.stock_outputs(), atol=1e-5)


def test_target_patterns_keep_candidates_out(swiglu, tiny, caplog):
    """Qwen2-MoE's decoder ``mlp`` is the sparse MoE block (not a gated MLP) and its shared expert does not match the
    pattern: nothing is fused, and the load says so."""
    ckpt = tiny("qwen2_moe")
    with caplog.at_level(logging.INFO, logger="modelpatch.fusions.apply"):
        model = ckpt.load({"swiglu": True})
    assert not any(isinstance(m, SwiGLU) for m in model.modules())
    assert "Fusion 'swiglu' found nothing to fuse" in caplog.text
    assert_outputs_close(ckpt.outputs(model), ckpt.stock_outputs())


def test_a_class_wanted_by_two_fusions_is_an_error(swiglu, tiny):
    with pytest.raises(FusionError, match="Fusions 'gate_up' and 'swiglu' both want to replace LlamaMLP"):
        tiny("llama").load({"gate_up": True, "swiglu": True})


def test_from_config_with_a_user_fusion(swiglu, tiny, tmp_path):
    ckpt = tiny("llama")
    model = modelpatch.from_config(ckpt.model_class, ckpt.stock().config, fusion_config={"swiglu": True})
    assert type(model.model.layers[0].mlp) is SwiGLU
    assert model.config.modelpatch["fusion_config"] == {"swiglu": True}
    # Concatenate(equal_parts=True) lets a model that was never loaded be split back into gate_proj / up_proj.
    modelpatch.save_pretrained(model, tmp_path / "saved")
    assert checkpoint_shapes(tmp_path / "saved") == checkpoint_shapes(ckpt.path)
    assert_outputs_close(ckpt.outputs(ckpt.load({}, path=tmp_path / "saved")), ckpt.outputs(model))


def test_checkpoints_stay_loadable_without_the_fusion(swiglu, tiny, tmp_path):
    ckpt = tiny("llama")
    modelpatch.save_pretrained(ckpt.load({"swiglu": True}), tmp_path / "saved")
    unregister_fusion("swiglu")
    # The stored config names a fusion this process does not have; the files are the original layout, so the
    # checkpoint loads unfused (with a warning naming the fusion), by anyone.
    assert checkpoint_shapes(tmp_path / "saved") == checkpoint_shapes(ckpt.path)
    assert_outputs_close(ckpt.outputs(ckpt.load(path=tmp_path / "saved")), ckpt.stock_outputs())
    assert_outputs_close(ckpt.outputs(ckpt.load({}, path=tmp_path / "saved")), ckpt.stock_outputs())


# --- The extension API contract -----------------------------------------------------------------------------------


def test_make_transforms_receives_the_modules_to_fuse(tiny):
    seen = {}

    class Recording(SwiGLUFusionSpec):
        def make_transforms(self, config, modules):
            seen["config"], seen["modules"] = config, modules
            return super().make_transforms(config, modules)

    register_fusion("recording", Recording())
    tiny("llama").load({"recording": True})
    assert seen["config"].model_type == "llama"
    assert sorted(seen["modules"]) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all(m.gate_proj.weight.device.type == "meta" for m in seen["modules"].values())


def test_overwriting_a_fusion_takes_effect(tiny):
    """Replacing a registered fusion with another spec class changes what later loads build, even for a class the
    previous spec already generated a fused class for."""
    from modelpatch.fusions.projections import QKVFusionSpec

    class KVFusionSpec(QKVFusionSpec):
        groups = ((("k_proj", "v_proj"), "kv_proj"),)

    ckpt = tiny("llama")
    assert hasattr(ckpt.load({"qkv": True}).model.layers[0].self_attn, "qkv_proj")
    register_fusion("qkv", KVFusionSpec(), overwrite=True)
    attention = ckpt.load({"qkv": True}).model.layers[0].self_attn
    assert hasattr(attention, "kv_proj") and not hasattr(attention, "qkv_proj")
    assert attention.kv_proj.part_sizes == (16, 16)
    assert_outputs_close(ckpt.outputs(ckpt.load({"qkv": True})), ckpt.stock_outputs())


# --- Under tensor parallelism (tests/modes/test_tensor_parallel.py) --------------------------------------------


class WholeSwiGLUFusionSpec(SwiGLUFusionSpec):
    """The example without its ``tensor_parallel_layout``: ModuleFusionSpec's default, which leaves the fused MLP
    whole on every rank of a ``tp_plan`` load."""

    tensor_parallel_layout = ModuleFusionSpec.tensor_parallel_layout


class MisdeclaredSwiGLUFusionSpec(SwiGLUFusionSpec):
    """The example declaring ``shards(module)`` where it shards: a layout that does not fit SwiGLU, refused by name
    at a ``tp_plan`` load (before anything is sharded), rather than loaded into a model that computes another
    function on every rank."""

    shards: Callable[[SwiGLU], dict[str, TensorParallelShard]]

    def tensor_parallel_layout(self, module, rules, ranks):
        layout = super().tensor_parallel_layout(module, rules, ranks)
        return None if layout is None else TensorParallelLayout(layout.replaces, type(self).shards(module))


def _misdeclared(shards: Callable[[SwiGLU], dict[str, TensorParallelShard]]) -> type[MisdeclaredSwiGLUFusionSpec]:
    return type("MisdeclaredSwiGLUFusionSpec", (MisdeclaredSwiGLUFusionSpec,), {"shards": staticmethod(shards)})


ROWWISE = TensorParallelShard("rowwise")
# name: (spec class, what the refusal names)
MISDECLARED_LAYOUTS = {
    # gate and up joined in w12, split as one block: rank 0 would hold gate's rows alone (logits off by 0.14).
    "swiglu_one_block": (
        _misdeclared(lambda m: {"w12": TensorParallelShard("colwise"), "w3": ROWWISE}),
        "model.layers.*.mlp.w12.weight is joined from parts of [64, 64] along dim 0, which a colwise split as one "
        "block cuts across",
    ),
    "swiglu_untiled": (
        _misdeclared(
            lambda m: {"w12": TensorParallelShard("colwise", parts=FusedParts((m.intermediate_size,))), "w3": ROWWISE}
        ),
        "model.layers.*.mlp.w12.weight has 128 rows, and the parts [64] declared for them tile 64",
    ),
    "swiglu_unknown_module": (
        _misdeclared(
            lambda m: {
                "w12": TensorParallelShard("colwise", parts=FusedParts((m.intermediate_size,) * 2)),
                "w3": ROWWISE,
                "w13": TensorParallelShard("colwise"),
            }
        ),
        "shards 'w13', which names no module of model.layers.*.mlp (its modules: act_fn, w12, w3)",
    ),
}

# The names the tensor-parallel tests register these fusions under (in their ranks and in the test process).
TENSOR_PARALLEL_FUSIONS = {
    "swiglu": SwiGLUFusionSpec,
    "swiglu_whole": WholeSwiGLUFusionSpec,
    **{name: spec for name, (spec, _) in MISDECLARED_LAYOUTS.items()},
}
