"""The process-wide installs (``modelpatch/_installs.py``): each is idempotent and leaves every caller outside
modelpatch's scopes and builds what the original gives."""

from __future__ import annotations

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
