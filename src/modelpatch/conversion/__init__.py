"""Weight conversion: pure tensor operations, declarative transforms, planning, and the per-model-type registry."""

from .operations import (
    Chunk,
    Concatenate,
    Conv3dToLinear,
    ConversionOperation,
    LinearToConv3d,
    MergeModulelist,
    SplitModulelist,
    Transpose,
)
from .planner import ConversionGroup, ConversionPlan, TensorMeta, plan_load, plan_save
from .registry import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from .transforms import WeightConverter, WeightRenaming, WeightTransform

__all__ = [
    "Chunk",
    "Concatenate",
    "Conv3dToLinear",
    "ConversionGroup",
    "ConversionOperation",
    "ConversionPlan",
    "LinearToConv3d",
    "MergeModulelist",
    "SplitModulelist",
    "TensorMeta",
    "Transpose",
    "WeightConverter",
    "WeightRenaming",
    "WeightTransform",
    "get_checkpoint_conversion_mapping",
    "plan_load",
    "plan_save",
    "register_checkpoint_conversion_mapping",
]
