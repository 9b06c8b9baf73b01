"""The fusion registry and ``fusion_config``: validation, persistence in config.json, per-load scoping, discovery."""

from __future__ import annotations

import json
import logging
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from fusion_models import assert_outputs_close, assert_outputs_equal, module_types
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP

import modelpatch
from modelpatch import FusionError, ModuleFusionSpec, available_fusions, register_fusion, unregister_fusion
from modelpatch.fusions import QKVFusionSpec

BUILTIN = ["gate_up", "linear_experts", "patch_embeddings", "qkv"]


def generated_modules(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if type(module).__module__.startswith("modelpatch")]


def config_json(path) -> dict:
    return json.loads((path / "config.json").read_text())


# --- Registry -----------------------------------------------------------------------------------------------------


def test_builtin_fusions_are_available():
    assert available_fusions() == BUILTIN


def test_register_overwrite_unregister():
    spec, other = QKVFusionSpec(), QKVFusionSpec()
    register_fusion("my_qkv", spec)
    assert "my_qkv" in available_fusions()
    with pytest.raises(FusionError, match="already registered.*overwrite=True"):
        register_fusion("my_qkv", other)
    register_fusion("my_qkv", other, overwrite=True)
    assert modelpatch.fusions.get_fusion("my_qkv") is other
    unregister_fusion("my_qkv")
    assert available_fusions() == BUILTIN
    with pytest.raises(FusionError, match="No fusion named 'my_qkv'; available: gate_up, linear_experts"):
        unregister_fusion("my_qkv")


@pytest.mark.parametrize("name", ["my-fusion", "", "1st", 3])
def test_fusion_names_must_be_identifiers(name):
    with pytest.raises(FusionError, match="identifier"):
        register_fusion(name, QKVFusionSpec())


def test_only_specs_can_be_registered():
    with pytest.raises(TypeError, match="ModuleFusionSpec"):
        register_fusion("qkv_class", QKVFusionSpec)  # the class, not an instance


# --- fusion_config validation -------------------------------------------------------------------------------------


def test_unknown_fusion_lists_the_available_ones(tiny):
    ckpt = tiny("llama")
    for load in (
        lambda: ckpt.load({"qkv": True, "flash_qkv": True}),
        lambda: modelpatch.from_config(LlamaForCausalLM, ckpt.stock().config, fusion_config={"flash_qkv": True}),
    ):
        with pytest.raises(FusionError) as error:
            load()
        message = str(error.value)
        assert "'flash_qkv'" in message
        assert all(name in message for name in BUILTIN), message


def test_unknown_fusion_stored_in_config_json(tiny, tmp_path, caplog):
    ckpt = tiny("llama")
    edited = shutil.copytree(ckpt.path, tmp_path / "edited")
    config = config_json(edited)
    config["fusion_config"] = {"flash_qkv": True}
    (edited / "config.json").write_text(json.dumps(config))
    # Original-layout tensors need no fusion code: the load goes on unfused and says which fusion it skipped.
    with caplog.at_level(logging.WARNING, logger="modelpatch.fusions.apply"):
        model = ckpt.load(path=edited)
    assert generated_modules(model) == []
    assert "'flash_qkv'" in caplog.text
    assert_outputs_equal(ckpt.outputs(model), ckpt.stock_outputs())
    assert generated_modules(ckpt.load({}, path=edited)) == []  # an explicit argument replaces the stored one


def test_unknown_fusion_in_a_runtime_layout_checkpoint(tiny, tmp_path):
    ckpt = tiny("llama")
    modelpatch.save_pretrained(ckpt.load({"qkv": True}), tmp_path / "runtime", save_original_format=False)
    config = config_json(tmp_path / "runtime")
    config["modelpatch"]["fusion_config"] = {"qkv": True, "flash_qkv": True}
    (tmp_path / "runtime" / "config.json").write_text(json.dumps(config))
    with pytest.raises(FusionError, match=r"runtime layout of fusion\(s\) 'flash_qkv'.*modelpatch.register_fusion"):
        ckpt.load(path=tmp_path / "runtime")


def test_runtime_layout_checkpoint_with_other_fusions_is_refused(tiny, tmp_path):
    ckpt = tiny("llama")
    modelpatch.save_pretrained(ckpt.load({"qkv": True}), tmp_path / "runtime", save_original_format=False)
    with pytest.raises(
        FusionError, match=r"runtime layout of fusions \['qkv'\].*modelpatch convert SRC DST --fusion none"
    ):
        ckpt.load({}, path=tmp_path / "runtime")


@pytest.mark.parametrize("value", [1, 0, "yes", None, 0.5, ["fast"]])
def test_option_values_must_be_bool_or_dict(tiny, value):
    with pytest.raises(FusionError, match=r"fusion_config\['qkv'\] must be True, False or an options dict"):
        tiny("llama").load({"qkv": value})


@pytest.mark.parametrize("value", [["qkv"], "qkv", True])
def test_fusion_config_must_be_a_dict(tiny, value):
    with pytest.raises(FusionError, match="fusion_config must be a dict"):
        tiny("llama").load(value)


@pytest.mark.parametrize("name", [name for name in BUILTIN if name != "linear_experts"])
def test_options_of_a_family_with_strict_alone(tiny, name):
    with pytest.raises(FusionError, match=f"Invalid options for fusion '{name}'.*'block_size'; allowed: strict"):
        tiny("llama").load({name: {"block_size": 64}})
    with pytest.raises(FusionError, match=f"Invalid options for fusion '{name}': strict must be True or False"):
        tiny("llama").load({name: {"strict": "yes"}})


def test_unknown_option_is_named_with_the_allowed_ones(tiny):
    with pytest.raises(
        FusionError, match=r"'linear_experts': unknown option\(s\) 'block_size'; allowed: strict, child_names"
    ):
        tiny("qwen2_moe").load({"linear_experts": {"block_size": 64}})


@pytest.mark.parametrize("names", ["w1", ["w1", "w3"], ["w1", "w1", "w2"], ["w1", "w3", "not a name"], [1, 2, 3]])
def test_invalid_option_values_are_refused(tiny, names):
    with pytest.raises(FusionError, match=r"Invalid options for fusion 'linear_experts': child_names must be three"):
        tiny("qwen2_moe").load({"linear_experts": {"child_names": names}})


def test_options_configure_the_family_and_are_stored(tiny, tmp_path):
    """``child_names`` renames each expert's Linears; the checkpoint's per-expert keys then need a renaming, which a
    Patcher gives, and the generated class is one per configured spec, not shared with the default one."""
    ckpt = tiny("qwen2_moe")
    default = ckpt.load({"linear_experts": True})
    patcher = modelpatch.Patcher(
        extra_weight_conversions=[
            modelpatch.WeightRenaming(r"experts\.(\d+)\.gate_proj\.", r"experts.\1.w1."),
            modelpatch.WeightRenaming(r"experts\.(\d+)\.up_proj\.", r"experts.\1.w3."),
            modelpatch.WeightRenaming(r"experts\.(\d+)\.down_proj\.", r"experts.\1.w2."),
        ]
    )
    options = {"linear_experts": {"child_names": ["w1", "w3", "w2"]}}
    renamed = modelpatch.from_pretrained(type(default), ckpt.path, fusion_config=options, patcher=patcher)
    experts = renamed.model.layers[0].mlp.experts
    assert [name for name, _ in experts[0].named_children()] == ["w1", "w3", "w2", "act_fn"]
    assert type(experts) is not type(default.model.layers[0].mlp.experts)
    assert type(experts).__mro__[1:] == type(default.model.layers[0].mlp.experts).__mro__[1:]
    assert_outputs_close(ckpt.outputs(renamed), ckpt.stock_outputs())
    assert renamed.config.modelpatch["fusion_config"] == options
    # The same options again: the same configured spec, so the same generated class.
    again = modelpatch.from_pretrained(type(default), ckpt.path, fusion_config=options, patcher=patcher)
    assert type(again.model.layers[0].mlp.experts) is type(experts)


def test_hooks_have_one_signature():
    with pytest.raises(TypeError, match=r"make_transforms must take \(config, modules\) after self, got \(config\)"):

        class OldStyle(ModuleFusionSpec):
            def make_transforms(self, config):
                return []


def test_required_hooks_are_abstract():
    class OnlyFusable(ModuleFusionSpec):
        def is_fusable(self, module):
            return False

    with pytest.raises(TypeError, match="abstract.*make_fused_class"):
        OnlyFusable()


def test_empty_options_enable_and_false_disables(tiny):
    ckpt = tiny("llama")
    enabled = ckpt.load({"qkv": {}, "gate_up": False})
    assert isinstance(enabled.model.layers[0].self_attn.qkv_proj, torch.nn.Linear)
    assert type(enabled.model.layers[0].mlp) is LlamaMLP
    assert enabled.config.modelpatch["fusion_config"] == {"qkv": {}, "gate_up": False}
    assert generated_modules(ckpt.load({"qkv": False, "gate_up": False})) == []


# --- Persistence --------------------------------------------------------------------------------------------------


def test_persisted_reused_and_overridden(tiny, tmp_path):
    ckpt = tiny("llama")
    fused = ckpt.load({"qkv": True})
    assert fused.config.modelpatch["fusion_config"] == {"qkv": True}
    assert not hasattr(ckpt.stock().config, "modelpatch")  # the checkpoint's config object is not touched
    modelpatch.save_pretrained(fused, tmp_path / "saved")
    saved = config_json(tmp_path / "saved")
    assert saved["modelpatch"] == {"version": 1, "fusion_config": {"qkv": True}}
    assert "fusion_config" not in saved  # stock transformers 5.23 would apply its own fusion from that key

    # Omitted: the stored config is reused.
    reused = ckpt.load(path=tmp_path / "saved")
    assert type(reused.model.layers[0].self_attn) is type(fused.model.layers[0].self_attn)
    assert_outputs_equal(ckpt.outputs(reused), ckpt.outputs(fused))

    # Explicit: replaces the stored one (no merging).
    overridden = ckpt.load({"gate_up": True}, path=tmp_path / "saved")
    assert type(overridden.model.layers[0].self_attn) is LlamaAttention
    assert type(overridden.model.layers[0].mlp).__name__ == "InputProjFusedLlamaMLP"
    assert overridden.config.modelpatch["fusion_config"] == {"gate_up": True}

    disabled = ckpt.load({"qkv": False}, path=tmp_path / "saved")
    assert generated_modules(disabled) == []
    assert_outputs_close(ckpt.outputs(disabled), ckpt.stock_outputs())

    # An explicit empty config drops the stored one, and so does the next save.
    plain = ckpt.load({}, path=tmp_path / "saved")
    assert generated_modules(plain) == [] and not hasattr(plain.config, "modelpatch")
    modelpatch.save_pretrained(plain, tmp_path / "plain")
    assert "fusion_config" not in config_json(tmp_path / "plain")
    assert "modelpatch" not in config_json(tmp_path / "plain")


# --- Scoping ------------------------------------------------------------------------------------------------------


def test_a_fusion_is_scoped_to_its_load(tiny):
    ckpt = tiny("llama")
    fused = ckpt.load({"qkv": True, "gate_up": True})
    assert [n for n, m in fused.named_modules() if type(m).__module__ == "modelpatch.fusions.generated"] == [
        f"model.layers.{i}.{child}" for i in range(2) for child in ("self_attn", "mlp")
    ]
    assert modelpatch.get_patch_mapping() == {}  # nothing registered globally

    config = ckpt.stock().config
    for later in (
        ckpt.load(),
        ckpt.model_class.from_pretrained(ckpt.path),
        modelpatch.from_config(LlamaForCausalLM, config),
        LlamaForCausalLM(config),
    ):
        assert generated_modules(later) == []
        assert type(later.model.layers[0].self_attn) is LlamaAttention


def test_a_failed_fused_load_leaves_nothing_behind(tiny):
    class Broken(QKVFusionSpec):
        prefix = "BrokenQKVFused"

        def make_fused_class(self, original_cls):
            def __init__(self, *args, **kwargs):
                raise RuntimeError("cannot build")

            return type("BrokenAttention", (original_cls,), {"__init__": __init__})

    register_fusion("broken", Broken())
    ckpt = tiny("llama")
    with pytest.raises(RuntimeError, match="cannot build"):
        ckpt.load({"broken": True})
    assert generated_modules(ckpt.load()) == []
    assert generated_modules(LlamaForCausalLM(ckpt.stock().config)) == []


def test_concurrent_loads_get_their_own_structure(tiny):
    """Two loads started at once, one fused and one not, several times over: each gets its own structure."""
    ckpt = tiny("llama")
    barrier = threading.Barrier(2)

    def load(fusion_config):
        barrier.wait(timeout=30)
        return ckpt.load(fusion_config)

    with ThreadPoolExecutor(2) as pool:
        for _ in range(3):
            fused_future, plain_future = pool.submit(load, {"qkv": True, "gate_up": True}), pool.submit(load, None)
            fused, plain = fused_future.result(timeout=120), plain_future.result(timeout=120)
            assert type(fused.model.layers[0].self_attn).__name__ == "QKVFusedLlamaAttention"
            assert type(fused.model.layers[1].mlp).__name__ == "InputProjFusedLlamaMLP"
            assert module_types(plain) == module_types(ckpt.stock())
    assert_outputs_close(ckpt.outputs(fused), ckpt.stock_outputs())
    assert_outputs_equal(ckpt.outputs(plain), ckpt.stock_outputs())


def test_another_thread_builds_stock_classes_while_a_fused_build_runs(tiny):
    """Thread A is held *inside* its fused build (its patches active) while thread B builds the same model class:
    B gets stock classes. (modelpatch serialises its own builds, so B builds directly, on the meta device.)"""
    ckpt = tiny("llama")
    building, other_done = threading.Event(), threading.Event()

    class HeldQKV(QKVFusionSpec):
        prefix = "HeldQKVFused"

        def make_fused_class(self, original_cls):
            fused = super().make_fused_class(original_cls)

            def __init__(self, *args, **kwargs):
                building.set()
                assert other_done.wait(30), "the other thread did not finish"
                fused.__init__(self, *args, **kwargs)

            return type(f"Held{original_cls.__name__}", (fused,), {"__init__": __init__})

    register_fusion("held_qkv", HeldQKV())

    def other_build():
        assert building.wait(30), "the fused load never started building"
        try:
            with torch.device("meta"):
                return LlamaForCausalLM(ckpt.stock().config)
        finally:
            other_done.set()

    with ThreadPoolExecutor(2) as pool:
        fused_future, other_future = pool.submit(ckpt.load, {"held_qkv": True}), pool.submit(other_build)
        fused, other = fused_future.result(timeout=120), other_future.result(timeout=120)

    assert type(fused.model.layers[0].self_attn).__name__ == "HeldLlamaAttention"
    assert_outputs_close(ckpt.outputs(fused), ckpt.stock_outputs())
    assert module_types(other) == module_types(ckpt.stock())
    assert generated_modules(ckpt.load()) == []


# --- Discovery ----------------------------------------------------------------------------------------------------


def test_discovery_sees_a_meta_device_model(tiny, caplog):
    class Spy(ModuleFusionSpec):
        def __init__(self):
            self.devices: set[str] = set()
            self.names: list[str] = []

        def is_fusable(self, module):
            self.devices.update(p.device.type for p in module.parameters(recurse=False))
            self.names.append(type(module).__name__)
            return False

        def make_fused_class(self, original_cls):
            raise AssertionError("nothing is fusable")

    spy = Spy()
    register_fusion("spy", spy)
    with caplog.at_level(logging.INFO, logger="modelpatch.fusions.apply"):
        model = tiny("llama").load({"spy": True})
    assert spy.devices == {"meta"}
    assert {"LlamaForCausalLM", "LlamaAttention", "LlamaMLP", "Linear"} <= set(spy.names)
    assert "found nothing to fuse" in caplog.text
    assert generated_modules(model) == []


def test_one_fused_class_per_compatible_class(tiny):
    """Every instance of a fusable class gets the same generated class, in this load and in later ones."""
    ckpt = tiny("llama")
    first, second = ckpt.load({"qkv": True}), ckpt.load({"qkv": True})
    classes = {type(layer.self_attn) for model in (first, second) for layer in model.model.layers}
    assert len(classes) == 1
    (fused,) = classes
    assert fused.__module__ == "modelpatch.fusions.generated"
    assert getattr(modelpatch.fusions.generated, fused.__name__) is fused
    assert issubclass(fused, LlamaAttention)


def test_two_fusions_wanting_one_class_is_an_error(tiny):
    class AlsoQKV(QKVFusionSpec):
        prefix = "AlsoQKVFused"

    register_fusion("also_qkv", AlsoQKV())
    with pytest.raises(FusionError, match="both want to replace LlamaAttention; enable one"):
        tiny("llama").load({"qkv": True, "also_qkv": True})
