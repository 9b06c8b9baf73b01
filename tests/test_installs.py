"""The process-wide installs (``modelpatch/_installs.py``): each is idempotent and leaves every caller outside
modelpatch's scopes and builds what the original gives."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import init

from modelpatch import _installs
from modelpatch.patching.mapping import PatchMapping
from modelpatch.patching.scope import patch_scope


def test_the_module_new_dispatcher_installs_once():
    with patch_scope(PatchMapping.from_items([("NoSuchClass", nn.Identity)])):
        pass
    dispatcher = nn.Module.__new__
    assert dispatcher is not _installs.ORIGINAL_MODULE_NEW
    _installs.install_module_new(dispatcher)
    assert nn.Module.__new__ is dispatcher
    assert type(nn.Linear(2, 2)) is nn.Linear  # outside every scope: what the original builds


def test_transformers_patch_registry_wrapper_installs_once_and_reads_through_outside_builds():
    from modelpatch._transformers import patch_registry_module

    _installs.isolate_from_transformers_patches()
    monkey_patching = patch_registry_module()
    wrapper = monkey_patching.get_patch_mapping
    _installs.isolate_from_transformers_patches()
    assert monkey_patching.get_patch_mapping is wrapper
    assert wrapper() == wrapper.__wrapped__()
    token = _installs.inside_build.set(True)
    try:
        assert wrapper() == {}
    finally:
        _installs.inside_build.reset(token)


def test_init_wrappers_install_once_and_skip_only_meta_tensors_inside_builds():
    _installs.skip_meta_initialisation()
    wrapped = {name: getattr(init, name) for name in _installs.FILLING_FUNCTIONS}
    _installs.skip_meta_initialisation()
    assert all(getattr(init, name) is fill for name, fill in wrapped.items())
    real = torch.zeros(3)
    meta = torch.empty(3, device="meta")
    token = _installs.inside_build.set(True)
    try:
        assert init.ones_(meta) is meta
        assert torch.equal(init.ones_(real), torch.ones(3))  # a real tensor is filled, inside a build too
    finally:
        _installs.inside_build.reset(token)


def test_the_registration_hooks_install_once_and_register_what_torch_was_given():
    from torch.nn.modules import module as torch_module

    from modelpatch.fusions.linear_experts.modules import _changed

    _installs.watch_module_registrations(_changed)
    _installs.watch_module_registrations(_changed)
    registered = [
        *torch_module._global_module_registration_hooks.values(),
        *torch_module._global_parameter_registration_hooks.values(),
    ]
    assert registered.count(_changed) == 2  # one hook for modules, one for parameters
    parent, child, weight = nn.Module(), nn.Linear(2, 2), nn.Parameter(torch.ones(2))
    parent.child, parent.weight = child, weight
    assert parent.child is child and parent.weight is weight  # the hook changes nothing torch registers
    with pytest.raises(RuntimeError, match="already watch"):
        _installs.watch_module_registrations(print)


_REPORT_INSTALLS = """
import json, sys
import modelpatch
from transformers import LlamaForCausalLM, Qwen2MoeForCausalLM
from support.models import tiny_config

def made():
    return [install.name for install in modelpatch.installs() if install.installed]

steps = {"import": made()}
modelpatch.from_config(LlamaForCausalLM, tiny_config("llama"), fusion_config={"qkv": True})
steps["qkv"] = made()
moe = modelpatch.from_config(Qwen2MoeForCausalLM, tiny_config("qwen2_moe"), fusion_config={"linear_experts": True})
steps["linear_experts"] = made()
steps["packed"] = moe.model.layers[0].mlp.experts.pack()
print(json.dumps(steps))
"""


def test_every_install_is_listed_and_says_whether_it_is_made_once_its_first_need_came():
    """The one list: eight installs in a fixed order, none made at import, each reported made once the first load
    that needs it ran (in a fresh process, where nothing was installed before)."""
    import modelpatch

    listed = modelpatch.installs()
    assert [install.name for install in listed] == list(_installs._TABLE) and len(listed) == 8
    assert all(isinstance(install, modelpatch.Install) and install.patches and install.by for install in listed)
    support = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(support), *sys.path])}
    result = subprocess.run([sys.executable, "-c", _REPORT_INSTALLS], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = json.loads(result.stdout.strip().splitlines()[-1])
    assert steps["import"] == []
    # Fused projections fold llm-compressor's SmoothQuant mappings where llm-compressor is installed (CI installs it).
    folds = ["smoothing_mappings"] if importlib.util.find_spec("llmcompressor") is not None else []
    assert set(steps["qkv"]) == {"module_new", "transformers_patch_registry", "meta_initialisation", *folds}
    # linear_experts replaces a class qwen2_moe records (its experts) by one that is no subclass of it; its experts
    # watch torch's registrations once packed (not on a torch without a grouped product: 2.6).
    assert set(steps["linear_experts"]) - set(steps["qkv"]) == {
        "output_recorders",
        "grouped_linear_operator",
        *(["registration_hooks"] if steps["packed"] else []),
    }
    assert "tensor_parallel_style" not in steps["linear_experts"]  # no tensor-parallel load ran
    with pytest.raises(ValueError, match="no install of modelpatch's list"):
        _installs.made("no_such_install")
