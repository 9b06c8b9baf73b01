"""Conversions that tell a checkpoint tensor's layout by its shape, where the shape cannot tell (issue 37, item 9).

transformers maps Qwen3-VL-MoE's 3-D experts with ``Transpose(1, 2, check_dims=True)``: checkpoints written before
transformers 5 hold ``gate_up_proj`` as ``(E, H, 2I)`` and ``down_proj`` as ``(E, I, H)``, later ones ``(E, 2I, H)``
and ``(E, H, I)``, and the tensor is transposed when its shape is not the model's. Where the swapped dims are equal
(``H == 2I``, or ``H == I``) both layouts have the model's shape, and stock reads an older checkpoint silently
transposed. modelpatch decides such a tensor by the checkpoint's other tensors (the other projection, whose layouts
then differ), and refuses by key where they do not decide.

Each checkpoint is written by stock ``save_pretrained``; its older twin is the same file with the expert tensors
rewritten transposed (safetensors). Both must load to the state stock loads from the first, and save back to
themselves.
"""

from __future__ import annotations

import re

import pytest
import torch
from transformers import Qwen3VLMoeForConditionalGeneration

import modelpatch
from modelpatch import LoadPlanError
from modelpatch._transformers_mapping import builtin_keys, builtin_mapping
from modelpatch.conversion import TensorMeta, plan_load
from modelpatch.conversion.operations import Transpose
from modelpatch.conversion.transforms import WeightConverter
from support.compare import assert_bitwise_equal, assert_same_files
from support.files import rewrite_checkpoint

# Every converter of transformers' registry that tells a layout by shape: (mapping key, target pattern).
TESTED = {("qwen3_vl_moe", "mlp.experts.gate_up_proj"), ("qwen3_vl_moe", "mlp.experts.down_proj")}
# Checkpoint -> its projection whose two layouts have one shape.
SQUARE = {"qwen3_vl_moe": "gate_up_proj", "qwen3_vl_moe_square_down": "down_proj"}
EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


def older(tensors: dict[str, torch.Tensor], layers: str = r"\d+") -> None:
    """The expert tensors of ``layers`` in the layout before transformers 5 (the last two dims swapped)."""
    for key in list(tensors):
        if EXPERTS.search(key) and re.search(rf"\.layers\.(?:{layers})\.", key):
            tensors[key] = tensors[key].transpose(1, 2).contiguous()


def test_every_shape_told_layout_of_the_registry_is_tested():
    found = {
        (key, pattern)
        for key in builtin_keys()
        for transform in builtin_mapping(key) or []
        if isinstance(transform, WeightConverter)
        and any(isinstance(op, Transpose) and op.check_dims for op in transform.operations)
        for pattern in transform.target_patterns
    }
    assert found == TESTED


@pytest.mark.parametrize("layout", ["current", "older"])
@pytest.mark.parametrize("name", sorted(SQUARE))
def test_either_layout_loads_the_stock_model_and_saves_back_to_itself(tiny, tmp_path, name, layout):
    checkpoint = tiny(name)
    shapes = {key: tuple(t.shape) for key, t in checkpoint.tensors().items() if key.endswith(SQUARE[name])}
    assert all(shape[1] == shape[2] for shape in shapes.values())  # the case at stake: both layouts, one shape
    path = checkpoint.path if layout == "current" else rewrite_checkpoint(checkpoint.path, tmp_path / "older", older)
    model = modelpatch.from_pretrained(Qwen3VLMoeForConditionalGeneration, path)
    assert_bitwise_equal(model.state_dict(), checkpoint.stock().state_dict())
    modelpatch.save_pretrained(model, tmp_path / "saved")
    assert_same_files(tmp_path / "saved", path)  # the older layout is written back as it was read


def test_a_checkpoint_whose_layers_disagree_is_refused_by_key(tiny, tmp_path):
    """Layer 0 in the older layout, layer 1 in the current one: the square gate_up tensors cannot be told."""
    path = rewrite_checkpoint(tiny("qwen3_vl_moe").path, tmp_path / "mixed", lambda t: older(t, layers="0"))
    with pytest.raises(LoadPlanError, match="layouts the shapes cannot tell") as refused:
        modelpatch.from_pretrained(Qwen3VLMoeForConditionalGeneration, path)
    problems = refused.value.problems["layouts the shapes cannot tell"]
    assert len(problems) == 2
    for layer, problem in enumerate(problems):
        assert f"'model.language_model.layers.{layer}.mlp.experts.gate_up_proj': its shape (4, 32, 32)" in problem
        assert "the checkpoint's other tensors disagree" in problem
        assert "'model.language_model.layers.0.mlp.experts.down_proj' is in another layout" in problem
        assert "'model.language_model.layers.1.mlp.experts.down_proj' is in the model's layout" in problem
    assert "layers.{0..1}.mlp.experts.gate_up_proj" in str(refused.value)  # one line for both


def test_a_square_tensor_nothing_else_tells_is_a_problem_of_the_plan():
    key = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    meta = {key: TensorMeta((4, 32, 32), torch.float32)}
    plan = plan_load(meta, builtin_mapping("qwen3_vl_moe") or [], expected=meta)
    (problem,) = plan.problems["layouts the shapes cannot tell"]
    assert f"{key!r}: its shape (4, 32, 32)" in problem
    assert "no other tensor of the checkpoint shows which layout it is written in" in problem
