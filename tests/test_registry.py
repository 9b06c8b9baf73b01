"""The one registry type: its verbs, copy-on-write snapshots, scopes, and the error every registry raises."""

from __future__ import annotations

import threading

import pytest
from torch import nn

import modelpatch
from modelpatch import ConversionError, FusionError, PatchRegistryError, RegistryError, WeightRenaming
from modelpatch.conversion.registry import conversion_registry
from modelpatch.fusions.projections import GateUpFusionSpec
from modelpatch.fusions.registry import fusion_registry
from modelpatch.patching.candidates import namespace_registry
from modelpatch.patching.registry import patch_registry
from modelpatch.registry import Registry
from modelpatch.testing import REGISTRIES, scoped_registries
from support.threads import run_on_threads


class Replacement(nn.Module):
    pass


def test_register_get_and_order():
    registry: Registry[str, int] = Registry("number")
    registry.register({"b": 2, "a": 1})
    registry.register({"c": 3})
    assert registry.get("a") == 1 and registry.get("missing", None) is None
    assert list(registry.snapshot().items()) == [("b", 2), ("a", 1), ("c", 3)]
    registry.register({"b": 20}, overwrite=True)  # replaced in place: the order is the registration order
    assert list(registry.snapshot().items()) == [("b", 20), ("a", 1), ("c", 3)]


def test_register_clash_names_every_key_and_registers_nothing():
    registry: Registry[str, int] = Registry("number")
    registry.register({"a": 1, "b": 2})
    before = registry.snapshot()
    with pytest.raises(RegistryError, match=r"'a', 'b' are already registered in the number registry.*overwrite=True"):
        registry.register({"a": 10, "new": 3, "b": 20})
    assert registry.snapshot() is before and dict(before) == {"a": 1, "b": 2}


def test_unregister_is_all_or_nothing_and_names_the_unknown_keys():
    registry: Registry[str, int] = Registry("number")
    registry.register({"a": 1, "b": 2, "c": 3})
    with pytest.raises(RegistryError) as info:
        registry.unregister(["a", "x", "y"])
    assert str(info.value) == "No number named 'x', 'y'; available: a, b, c."
    assert dict(registry.snapshot()) == {"a": 1, "b": 2, "c": 3}
    registry.unregister(["a", "c"])
    assert dict(registry.snapshot()) == {"b": 2}
    with pytest.raises(TypeError, match=r"pass \['b'\]"):
        registry.unregister("b")  # type: ignore[arg-type]
    assert dict(registry.snapshot()) == {"b": 2}


def test_get_unknown_key_lists_what_is_registered():
    registry: Registry[str, int] = Registry("number")
    with pytest.raises(RegistryError, match=r"No number named 'x'; available: none\."):
        registry.get("x")
    registry.register({"a": 1})
    with pytest.raises(RegistryError, match=r"No number named 'x'; available: a\."):
        registry.get("x")


def test_clear():
    registry: Registry[str, int] = Registry("number")
    registry.register({"a": 1})
    registry.clear()
    assert dict(registry.snapshot()) == {}
    registry.register({"a": 2})  # keys are free again
    assert registry.get("a") == 2


def test_snapshots_are_copies_on_write():
    registry: Registry[str, int] = Registry("number")
    registry.register({"a": 1})
    first = registry.snapshot()
    assert registry.snapshot() is first  # unchanged registry: the same table, so derived caches stay valid
    with pytest.raises(TypeError):
        first["b"] = 2  # type: ignore[index]
    registry.register({"b": 2})
    registry.register({"a": 10}, overwrite=True)
    registry.unregister(["b"])
    assert dict(first) == {"a": 1}  # every later change made a new table
    second = registry.snapshot()
    registry.clear()
    assert dict(second) == {"a": 10} and dict(registry.snapshot()) == {}


def test_restore_puts_back_a_snapshot_and_copies_what_it_is_given():
    registry: Registry[str, int] = Registry("number")
    registry.register({"a": 1})
    saved = registry.snapshot()
    registry.register({"b": 2})
    registry.restore(saved)
    assert dict(registry.snapshot()) == {"a": 1}
    given = {"z": 26}
    registry.restore(given)
    given["y"] = 25  # the caller's dict is not the registry's table
    assert dict(registry.snapshot()) == {"z": 26}
    with pytest.raises(TypeError, match="snapshot"):
        registry.restore([("a", 1)])  # type: ignore[arg-type]


def test_scoped_restores_on_exit_and_on_error():
    registry: Registry[str, int] = Registry("number")
    registry.register({"a": 1})
    with registry.scoped() as before:
        assert dict(before) == {"a": 1}
        registry.register({"b": 2})
        registry.unregister(["a"])
        assert dict(registry.snapshot()) == {"b": 2}
    assert dict(registry.snapshot()) == {"a": 1}
    with pytest.raises(KeyError), registry.scoped():
        registry.clear()
        raise KeyError("boom")
    assert dict(registry.snapshot()) == {"a": 1}


def test_error_type_must_be_a_registry_error():
    with pytest.raises(TypeError, match="RegistryError"):
        Registry("number", ValueError)  # type: ignore[arg-type]


def test_concurrent_registrations_of_one_key_have_one_winner():
    registry: Registry[str, int] = Registry("number")
    barrier = threading.Barrier(32)
    outcomes: list[bool] = []

    def register(i: int) -> None:
        barrier.wait()
        try:
            registry.register({"key": i, f"own{i}": i})
            outcomes.append(True)
        except RegistryError:
            outcomes.append(False)

    run_on_threads(register, 32)
    assert outcomes.count(True) == 1
    winner = registry.get("key")
    assert dict(registry.snapshot()) == {"key": winner, f"own{winner}": winner}  # losers added nothing


def _refusals() -> dict[str, BaseException]:
    """What each public registry raises for a key it does not have."""
    caught: dict[str, BaseException] = {}
    for name, call in {
        "patch": lambda: modelpatch.unregister_patch_mapping("NotRegistered"),
        "namespace": lambda: modelpatch.unregister_patchable_namespace("not.registered"),
        "conversion": lambda: conversion_registry.unregister(["not_registered"]),
        "fusion": lambda: modelpatch.unregister_fusion("not_registered"),
    }.items():
        with pytest.raises(RegistryError) as info:
            call()
        caught[name] = info.value
    return caught


def test_every_registry_raises_the_registry_error_and_its_domain_error():
    caught = _refusals()
    assert "'NotRegistered'" in str(caught["patch"]) and isinstance(caught["patch"], PatchRegistryError)
    assert "'not.registered'" in str(caught["namespace"]) and isinstance(caught["namespace"], ValueError)
    assert "'not_registered'" in str(caught["conversion"]) and isinstance(caught["conversion"], ConversionError)
    assert "'not_registered'" in str(caught["fusion"]) and isinstance(caught["fusion"], FusionError)
    modelpatch.register_fusion("gate_up_twice", GateUpFusionSpec())
    with pytest.raises(RegistryError, match="'gate_up_twice' is already registered in the fusion registry"):
        modelpatch.register_fusion("gate_up_twice", GateUpFusionSpec())
    with pytest.raises(RegistryError, match="'qwen2_moe'.*overwrite=True"):  # a key built into transformers
        modelpatch.register_checkpoint_conversion_mapping("qwen2_moe", [])


def test_the_public_functions_are_views_of_the_registries():
    modelpatch.register_patch_mapping({"LlamaMLP": Replacement})
    modelpatch.register_patchable_namespace("my_project.models")
    modelpatch.register_checkpoint_conversion_mapping("my_model", [WeightRenaming(r"\.old\.", ".new.")])
    modelpatch.register_fusion("gate_up_copy", GateUpFusionSpec())
    assert dict(patch_registry.snapshot()) == {"LlamaMLP": Replacement}
    assert "my_project.models" in namespace_registry.snapshot()
    assert "my_model" in conversion_registry.snapshot()
    assert fusion_registry.get("gate_up_copy") is modelpatch.fusions.get_fusion("gate_up_copy")


def test_scoped_registries_restores_all_four():
    assert {id(r) for r in REGISTRIES} == {
        id(patch_registry),
        id(namespace_registry),
        id(conversion_registry),
        id(fusion_registry),
    }
    before = [dict(r.snapshot()) for r in REGISTRIES]
    with pytest.raises(RuntimeError), scoped_registries():
        modelpatch.register_patch_mapping({"LlamaMLP": Replacement})
        modelpatch.register_patchable_namespace("my_project.models")
        modelpatch.register_checkpoint_conversion_mapping("my_model", [WeightRenaming(r"\.old\.", ".new.")])
        modelpatch.unregister_fusion("qkv")
        assert [dict(r.snapshot()) for r in REGISTRIES] != before
        raise RuntimeError("a failing test")
    assert [dict(r.snapshot()) for r in REGISTRIES] == before
    assert "qkv" in modelpatch.available_fusions()


def test_patch_scopes_read_a_compiled_snapshot_that_follows_the_registry():
    from modelpatch.patching import registry as patch_module

    empty = patch_module.snapshot()
    assert patch_module.snapshot() is empty  # compiled once per registry change
    modelpatch.register_patch_mapping({".*MLP": Replacement})
    compiled = patch_module.snapshot()
    assert compiled.match("LlamaMLP") == (".*MLP", Replacement) and empty.match("LlamaMLP") is None
    modelpatch.clear_patch_mapping()
    assert patch_module.snapshot().match("LlamaMLP") is None and compiled.match("LlamaMLP") is not None
