"""``LoadOptions`` (the settings a load is planned from, checked once), the one ``LoadPlan`` and
``LoadReport.from_plan``: what ``plan_pretrained`` plans is what ``from_pretrained`` loads and records."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP

import modelpatch
from modelpatch import LoadReport, Patcher
from modelpatch.loading.hub import HubOptions
from modelpatch.loading.options import LoadOptions
from modelpatch.loading.plan import LoadPlan


class _MarkedMLP(LlamaMLP):
    """A stock MLP under another name: what a Patcher replacement looks like to the plan."""


BAD_OPTIONS = [
    ({"patcher": {"LlamaMLP": object}}, TypeError, "patcher must be a modelpatch.Patcher"),
    ({"unexpected_keys": "explode"}, ValueError, "unexpected_keys must be 'warn', 'error' or 'ignore'"),
    ({"new_parameters": "lm_head"}, TypeError, "new_parameters must be a list of regex patterns"),
    ({"new_parameters": ["lm_head", 3]}, TypeError, "new_parameters must be a list of regex patterns"),
    ({"new_parameters": ["lm_head(["]}, ValueError, "new_parameters entry 'lm_head\\(\\[' is not a valid"),
]


@pytest.mark.parametrize("keywords, error, message", BAD_OPTIONS)
def test_bad_options_are_refused_when_built_with_the_message_every_entry_point_gives(
    tmp_path, keywords, error, message
):
    with pytest.raises(error, match=message) as built:
        LoadOptions(**keywords)
    # Checked before the path is even looked at: the directory does not exist.
    missing = tmp_path / "missing"
    with pytest.raises(error) as loaded:
        modelpatch.from_pretrained(AutoModelForCausalLM, missing, **keywords)
    assert str(loaded.value) == str(built.value)
    with pytest.raises(error) as planned:
        modelpatch.plan_pretrained(AutoModelForCausalLM, missing, **keywords)
    assert str(planned.value) == str(built.value)


def test_options_are_frozen_and_keep_their_own_copy_of_the_patterns():
    patterns = ["score"]
    options = LoadOptions(new_parameters=patterns, hub=HubOptions(revision="v1"))
    patterns.append(".*")  # the caller's list changing later changes nothing
    assert options.new_parameters == ("score",)
    assert options.hub.revision == "v1"
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.dtype = "float32"  # type: ignore[misc]


@pytest.mark.parametrize("fusion_config", [None, {"qkv": True, "gate_up": True}])
def test_report_from_the_plan_is_the_report_the_load_records(tiny, fusion_config):
    ckpt = tiny("llama")
    plan = modelpatch.plan_pretrained(AutoModelForCausalLM, ckpt.path, fusion_config=fusion_config)
    assert isinstance(plan, LoadPlan)
    assert modelpatch.PlannedLoad is LoadPlan  # the exported name of plan_pretrained's result
    model = modelpatch.from_pretrained(AutoModelForCausalLM, ckpt.path, fusion_config=fusion_config)
    recorded = modelpatch.get_load_report(model)
    planned = LoadReport.from_plan(plan)
    assert recorded is not None
    assert planned.source == recorded.source == ckpt.path
    assert planned.summary() == recorded.summary()
    assert planned.checkpoint_keys == recorded.checkpoint_keys
    assert dict(planned.direct) == dict(recorded.direct)
    assert planned.converted == recorded.converted
    assert [repr(g) for g in planned.groups] == [repr(g) for g in recorded.groups]
    assert [repr(t) for t in planned.transforms] == [repr(t) for t in recorded.transforms]
    assert dict(planned.tied) == dict(recorded.tied)
    assert dict(planned.replaced) == dict(recorded.replaced)
    assert bool(planned.groups) == (fusion_config is not None)  # the fused load converts, the plain one does not


def test_plan_of_a_patched_load_records_the_replacements(tiny):
    ckpt = tiny("llama")
    plan = modelpatch.plan_pretrained(AutoModelForCausalLM, ckpt.path, patcher=Patcher({"LlamaMLP": _MarkedMLP}))
    assert plan.replaced["LlamaMLP"][0] == "LlamaMLP"
    assert plan.replaced["LlamaMLP"][1].endswith("_MarkedMLP")
    assert all(type(layer.mlp) is _MarkedMLP for layer in plan.model.model.layers)
    assert LoadReport.from_plan(plan).replaced == plan.replaced
