"""modelpatch: restructure transformers models at load time and save them back in their original format.

The public API, layered bottom-up:

* weight conversion (``modelpatch.conversion``): operations, ``WeightConverter`` / ``WeightRenaming``, and the
  per-model-type registry;
* class patching (``modelpatch.patching``): the patch registry, ``apply_patches`` and ``Patcher``;
* fusions (``modelpatch.fusions``): ``fusion_config`` families and ``ModuleFusionSpec``;
* loading and saving (``modelpatch.loading``): ``from_pretrained``, ``from_config``, ``save_pretrained``;
* verification (``modelpatch.verify``): stock-vs-patched equivalence reports.
"""

from .conversion import (
    Chunk,
    Concatenate,
    Conv3dToLinear,
    ConversionOperation,
    FuseExpertGroups,
    GroupWeightRename,
    IndexOffsetRenaming,
    Interleave,
    LinearToConv3d,
    MergeModulelist,
    PermuteForRope,
    PrefixChange,
    Split,
    SplitExpertGroups,
    SplitModulelist,
    Transpose,
    WeightConverter,
    WeightRenaming,
    WeightTransform,
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
)
from .errors import (
    CheckpointError,
    ConversionError,
    FusionError,
    LoadPlanError,
    ModelPatchError,
    PatchRegistryError,
    SaveError,
)
from .fusions import ModuleFusionSpec, available_fusions, register_fusion, unregister_fusion
from .loading import (
    LoadReport,
    PlannedLoad,
    from_config,
    from_pretrained,
    fuse,
    get_load_report,
    plan_pretrained,
    save_pretrained,
    unfuse,
)
from .verify import VerificationReport, verify
from .patching import (
    Patcher,
    apply_patches,
    clear_patch_mapping,
    get_patch_mapping,
    get_patchable_namespaces,
    register_patch_mapping,
    register_patchable_namespace,
    unregister_patch_mapping,
    unregister_patchable_namespace,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "Chunk",
    "Concatenate",
    "Conv3dToLinear",
    "ConversionError",
    "ConversionOperation",
    "FuseExpertGroups",
    "FusionError",
    "GroupWeightRename",
    "IndexOffsetRenaming",
    "Interleave",
    "LinearToConv3d",
    "LoadReport",
    "LoadPlanError",
    "MergeModulelist",
    "ModuleFusionSpec",
    "ModelPatchError",
    "PatchRegistryError",
    "Patcher",
    "SaveError",
    "PermuteForRope",
    "PlannedLoad",
    "PrefixChange",
    "Split",
    "SplitExpertGroups",
    "SplitModulelist",
    "Transpose",
    "WeightConverter",
    "WeightRenaming",
    "WeightTransform",
    "apply_patches",
    "available_fusions",
    "clear_patch_mapping",
    "from_config",
    "from_pretrained",
    "fuse",
    "get_checkpoint_conversion_mapping",
    "get_load_report",
    "get_patch_mapping",
    "get_patchable_namespaces",
    "plan_pretrained",
    "register_checkpoint_conversion_mapping",
    "register_fusion",
    "register_patch_mapping",
    "register_patchable_namespace",
    "save_pretrained",
    "unregister_fusion",
    "unregister_patch_mapping",
    "unfuse",
    "unregister_patchable_namespace",
    "VerificationReport",
    "verify",
]


def __getattr__(name: str) -> object:
    # The drop-in Auto classes (``from modelpatch import AutoModelForCausalLM``), made on first import.
    if name.startswith("AutoModel"):
        from .auto import auto_class

        cls = auto_class(name)
        globals()[name] = cls
        return cls
    raise AttributeError(f"module 'modelpatch' has no attribute {name!r}")


def __dir__() -> list[str]:
    from .auto import auto_class_names

    return sorted({*globals(), *auto_class_names()})
