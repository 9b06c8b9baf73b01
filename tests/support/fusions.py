"""What every fusion family must show, for one tiny checkpoint and one ``fusion_config``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

import modelpatch
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
