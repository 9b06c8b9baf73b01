"""``Replicate``: one tensor given as a copy to each target (a fused layer's per-tensor scale written to each part);
its reverse gives the one tensor back only from equal parts. ``SplitShapeRows``: a packed weight's shape per part."""

from __future__ import annotations

import pytest
import torch

from modelpatch import ConversionError
from modelpatch.conversion.operations import Replicate, SplitShapeRows, Unreplicate, bind_operations, run_operations


@pytest.mark.parametrize("shape", [(), (1,), (4, 2)])
def test_replicate_copies_the_tensor_to_every_target_and_reverses_exactly(shape):
    tensor = torch.randn(shape)
    bound, shapes = bind_operations([Replicate()], [tuple(shape)], 3)
    assert shapes == [tuple(shape)] * 3
    parts = run_operations(bound, [tensor])
    assert len(parts) == 3 and all(torch.equal(part, tensor) for part in parts)
    assert len({part.untyped_storage().data_ptr() for part in parts}) == 3  # copies: no part aliases another
    reverse = bound[0].reverse()
    (back,) = run_operations([reverse], parts)
    assert torch.equal(back, tensor)


def test_unreplicate_refuses_parts_that_differ():
    with pytest.raises(ConversionError, match="different values"):
        run_operations([Unreplicate()], [torch.ones(1), torch.zeros(1)])
    with pytest.raises(ConversionError, match="one shape"):
        bind_operations([Unreplicate()], [(1,), (2,)], 1)


def test_replicate_takes_one_tensor():
    with pytest.raises(ConversionError, match="exactly one tensor"):
        bind_operations([Replicate()], [(1,), (1,)], 2)


def test_split_shape_rows_gives_each_part_its_rows_and_reverses_exactly():
    """compressed-tensors' ``weight_shape`` of a fused packed weight: ``[rows, columns]`` per part."""
    bound, shapes = bind_operations([SplitShapeRows(sizes=(32, 16, 16))], [(2,)], 3)
    parts = run_operations(bound, [torch.tensor([64, 128])])
    assert [part.tolist() for part in parts] == [[32, 128], [16, 128], [16, 128]]
    (back,) = run_operations([bound[0].reverse()], parts)
    assert back.tolist() == [64, 128]
    with pytest.raises(ConversionError, match="does not have 64 rows"):
        run_operations(bound, [torch.tensor([60, 128])])
