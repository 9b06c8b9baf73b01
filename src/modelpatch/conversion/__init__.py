"""Weight conversion: pure tensor operations, declarative transforms, planning, and the conversion registry (which
translates transformers' own mapping)."""

from .operations import (
    Chunk,
    Concatenate,
    Conv3dToLinear,
    ConversionOperation,
    FuseExpertGroups,
    Interleave,
    LinearToConv3d,
    MergeModulelist,
    MergeRowGroups,
    PermuteForRope,
    Split,
    SplitExpertGroups,
    SplitModulelist,
    Transpose,
    Unpad,
    WithoutCompanions,
)
from .planner import ConversionGroup, ConversionPlan, TensorMeta, plan_load, plan_save
from .registry import (
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
)
from .transforms import (
    GroupWeightRename,
    IndexOffsetRenaming,
    LayerPairRenaming,
    PrefixChange,
    WeightConverter,
    WeightRenaming,
    WeightTransform,
)

__all__ = [
    "Chunk",
    "Concatenate",
    "Conv3dToLinear",
    "ConversionGroup",
    "ConversionOperation",
    "ConversionPlan",
    "FuseExpertGroups",
    "GroupWeightRename",
    "IndexOffsetRenaming",
    "Interleave",
    "LayerPairRenaming",
    "LinearToConv3d",
    "MergeModulelist",
    "MergeRowGroups",
    "PermuteForRope",
    "PrefixChange",
    "Split",
    "SplitExpertGroups",
    "SplitModulelist",
    "TensorMeta",
    "Transpose",
    "Unpad",
    "WeightConverter",
    "WeightRenaming",
    "WeightTransform",
    "WithoutCompanions",
    "get_checkpoint_conversion_mapping",
    "plan_load",
    "plan_save",
    "register_checkpoint_conversion_mapping",
]
