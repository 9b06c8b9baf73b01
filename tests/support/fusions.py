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


def assert_refused_unchanged(model: nn.Module, call: Callable[[nn.Module], Any], *match: str) -> None:
    """``call(model)`` (a fuse, unfuse or patch_model) raises a FusionError whose message holds every ``match`` and
    says the model was left unchanged, and it was: the same modules, the same parameter objects, each with the same
    ``requires_grad`` and ``.grad``."""
    types = module_types(model)
    parameters = dict(model.named_parameters())
    training = {key: (p.requires_grad, p.grad) for key, p in parameters.items()}
    with pytest.raises(FusionError) as error:
        call(model)
    for text in (*match, "The model was left unchanged"):
        assert text in str(error.value)
    assert module_types(model) == types
    after = dict(model.named_parameters())
    assert after.keys() == parameters.keys() and all(after[key] is p for key, p in parameters.items())
    for key, (requires_grad, grad) in training.items():
        assert after[key].requires_grad == requires_grad and after[key].grad is grad, key
