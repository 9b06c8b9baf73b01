"""What every fusion family must show, for one tiny checkpoint and one ``fusion_config``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from torch import nn
from transformers import PreTrainedModel

import modelpatch
from modelpatch import FusionError
from support.checkpoints import TinyCheckpoint
from support.compare import assert_outputs_close, assert_outputs_equal, assert_same_files, module_types
from support.files import checkpoint_shapes


def check_fused_roundtrip(ckpt: TinyCheckpoint, fusion_config: dict[str, Any], tmp_path: Path) -> PreTrainedModel:
    """What every family must show, for one checkpoint and ``fusion_config``:

    * fp32 outputs within 1e-5 of the unfused stock model;
    * default save: the tensor files are bitwise the source checkpoint's, and config.json records the fusions;
    * ``save_original_format=False``: the runtime layout is written, and a reload without arguments rebuilds the
      fused model (from the stored ``fusion_config``) with identical outputs.

    Returns the fused model.
    """
    fused = ckpt.load(fusion_config)
    outputs = ckpt.outputs(fused)
    assert_outputs_close(outputs, ckpt.stock_outputs())

    original = tmp_path / "original_format"
    modelpatch.save_pretrained(fused, original)
    assert_same_files(original, ckpt.path)
    assert modelpatch.from_pretrained(ckpt.model_class, original).config.modelpatch["fusion_config"] == fusion_config

    runtime = tmp_path / "runtime_format"
    modelpatch.save_pretrained(fused, runtime, save_original_format=False)
    runtime_shapes = checkpoint_shapes(runtime)
    expected_shapes = {k: tuple(v.shape) for k, v in fused.state_dict().items()}
    for tied in getattr(fused, "all_tied_weights_keys", {}) or {}:
        expected_shapes.pop(tied, None)
    assert runtime_shapes == expected_shapes, "the runtime-format save is not the fused model's state dict"

    reloaded = modelpatch.from_pretrained(ckpt.model_class, runtime)
    assert module_types(reloaded) == module_types(fused)
    assert_outputs_equal(ckpt.outputs(reloaded), outputs)
    return fused


# torch's per-module hook dicts: a restructuring moves them (the very dict objects) to the modules it puts in place.
HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def model_objects(model: nn.Module) -> dict[str, Any]:
    """Every object of ``model`` a restructuring could replace or move, by where it is: each module; its hook dicts,
    each hook in them (and the module a hook bound to its module refers to), a forward set on the instance; each
    parameter and buffer, with ``requires_grad``, ``.grad`` and its tensor hooks. Compare two with
    :func:`assert_same_objects`."""
    objects: dict[str, Any] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        objects[name] = module
        objects[f"{name} forward"] = module.__dict__.get("forward")
        for attribute in HOOK_DICTS:
            hooks = objects[f"{name} {attribute}"] = getattr(module, attribute)
            for key, hook in hooks.items():
                objects[f"{name} {attribute}[{key}]"] = hook
                if getattr(hook, "with_module", False):  # torch's _WrappedHook: bound to its module by weakref
                    objects[f"{name} {attribute}[{key}] module"] = hook.module()
        for key, tensor in [*module._parameters.items(), *module._buffers.items()]:
            objects[f"{name}.{key}"] = tensor
            if tensor is not None:
                objects[f"{name}.{key} requires_grad"] = tensor.requires_grad
                objects[f"{name}.{key} grad"] = tensor.grad
                objects[f"{name}.{key} hooks"] = tensor._backward_hooks
    return objects


def assert_same_objects(before: dict[str, Any], after: dict[str, Any]) -> None:
    """``after`` holds the very objects ``before`` does, at the same places (identity, not equality)."""
    assert after.keys() == before.keys(), sorted(after.keys() ^ before.keys())[:5]
    changed = [key for key, value in before.items() if after[key] is not value]
    assert not changed, changed[:5]


def assert_refused_unchanged(model: nn.Module, call: Callable[[nn.Module], Any], *match: str) -> None:
    """``call(model)`` (a fuse, unfuse or patch_model) raises a FusionError whose message holds every ``match`` and
    says the model was left unchanged, and it was: the same modules, hooks and parameter objects, each with the same
    ``requires_grad`` and ``.grad`` (:func:`model_objects`)."""
    types = module_types(model)
    before = model_objects(model)
    with pytest.raises(FusionError) as error:
        call(model)
    for text in (*match, "The model was left unchanged"):
        assert text in str(error.value)
    assert module_types(model) == types
    assert_same_objects(before, model_objects(model))
