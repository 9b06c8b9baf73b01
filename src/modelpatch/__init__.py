"""modelpatch: restructure transformers models at load time and save them back in their original format.

The public API, layered bottom-up:

* weight conversion (``modelpatch.conversion``): operations, ``WeightConverter`` / ``WeightRenaming``, and the
  per-model-type registry;
* class patching (``modelpatch.patching``): the patch registry, ``apply_patches`` and ``Patcher``;
* fusions (``modelpatch.fusions``): ``fusion_config`` families and ``ModuleFusionSpec``;
* the pipelines (``modelpatch.loading``, ``.saving``, ``.modes``, ``.boundary``, ``.restructuring``):
  ``from_pretrained``, ``from_config``, ``save_pretrained``, the load modes, the original layout at every state-dict
  boundary, ``fuse`` / ``unfuse``;
* verification (``modelpatch.verify``): stock-vs-patched equivalence reports.

Every name below is importable from ``modelpatch`` itself; the sub-packages that define them (and so torch and
transformers) are imported on first use (PEP 562), so that ``import modelpatch`` and the ``modelpatch`` command's
``--help`` stay fast.
"""

from __future__ import annotations

import importlib
import sys
import types

from . import _border
from .errors import (
    CheckpointError,
    CheckpointPermissionError,
    ConversionError,
    ConversionRegistryError,
    FusionError,
    FusionRegistryError,
    LoadPlanError,
    ModelPatchError,
    PatchError,
    PatchRegistryError,
    PeftIntegrationError,
    PeftVersionError,
    RegistryError,
    SaveError,
    ShardingError,
    TensorParallelError,
    TorchVersionError,
    TransformersVersionError,
)

__version__ = "0.1.0"

# Public name -> the sub-module that defines it, imported when the name is first looked up.
_LAZY: dict[str, str] = {
    **dict.fromkeys(
        [
            "Chunk",
            "Concatenate",
            "FuseExpertGroups",
            "GroupWeightRename",
            "IndexOffsetRenaming",
            "Interleave",
            "LayerPairRenaming",
            "PermuteForRope",
            "PrefixChange",
            "Split",
            "SplitExpertGroups",
            "Conv3dToLinear",
            "ConversionOperation",
            "LinearToConv3d",
            "MergeModulelist",
            "MergeRowGroups",
            "SplitModulelist",
            "Transpose",
            "Unpad",
            "WeightConverter",
            "WeightRenaming",
            "WeightTransform",
            "WithoutCompanions",
            "get_checkpoint_conversion_mapping",
            "register_checkpoint_conversion_mapping",
        ],
        ".conversion",
    ),
    **dict.fromkeys(
        [
            "FusedParts",
            "ModuleFusionSpec",
            "TensorParallelLayout",
            "TensorParallelShard",
            "available_fusions",
            "register_fusion",
            "unregister_fusion",
        ],
        ".fusions",
    ),
    **dict.fromkeys(
        ["PlannedLoad", "from_config", "from_pretrained", "load_planned", "plan_pretrained"], ".loading.load"
    ),
    **dict.fromkeys(["LoadReport"], ".loading.report"),
    **dict.fromkeys(["get_load_report"], ".loading.record"),
    **dict.fromkeys(["save_pretrained"], ".saving.save"),
    **dict.fromkeys(["fuse", "patch_model", "unfuse"], ".restructuring.restructure"),
    **dict.fromkeys(["iter_original_state_dict"], ".boundary.state_dict"),
    **dict.fromkeys(["get_original_state_dict", "set_original_state_dict"], ".boundary.distributed_checkpoint"),
    **dict.fromkeys(["load_sharded"], ".loading.sharded"),
    **dict.fromkeys(["get_peft_model", "load_adapter"], ".integrations.peft"),  # peft itself only when called
    **dict.fromkeys(["VerificationReport", "verify"], ".verify"),
    **dict.fromkeys(["Install", "installs"], "._installs"),  # what modelpatch changed process-wide
    **dict.fromkeys(
        [
            "Patcher",
            "apply_patches",
            "clear_patch_mapping",
            "get_patch_mapping",
            "get_patchable_namespaces",
            "register_patch_mapping",
            "register_patchable_namespace",
            "unregister_patch_mapping",
            "unregister_patchable_namespace",
        ],
        ".patching",
    ),
}

# A list display (not a call) so that linters see the errors imported above as re-exported.
__all__ = [
    "CheckpointError",
    "CheckpointPermissionError",
    "ConversionError",
    "ConversionRegistryError",
    "FusionError",
    "FusionRegistryError",
    "LoadPlanError",
    "ModelPatchError",
    "PatchError",
    "PatchRegistryError",
    "PeftIntegrationError",
    "PeftVersionError",
    "RegistryError",
    "SaveError",
    "ShardingError",
    "TensorParallelError",
    "TorchVersionError",
    "TransformersVersionError",
    *sorted(_LAZY),
]


def __getattr__(name: str) -> object:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    elif name.startswith("AutoModel"):
        # The drop-in Auto classes (``from modelpatch import AutoModelForCausalLM``), made on first import.
        from .auto import auto_class

        value = auto_class(name)
    else:
        raise AttributeError(f"module 'modelpatch' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    from .auto import auto_class_names

    return sorted({*globals(), *_LAZY, *auto_class_names()})


class _Package(types.ModuleType):
    """The ``modelpatch`` module: keeps a public name that is also a sub-module's name bound to the public object.

    The import system binds every sub-module it imports as an attribute of its package. ``verify`` is both the
    public function and the sub-module ``modelpatch.verify``: once anything imported the sub-module (``from
    modelpatch.verify import default_inputs``), ``modelpatch.verify`` would be the module instead of the function.
    Eager imports avoided that by binding the function afterwards; lazily, it is refused here (the sub-module stays
    in ``sys.modules``).
    """

    def __setattr__(self, name: str, value: object) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def _import_border() -> None:
    # The border module registers itself as the conversion registry's provider of built-in mappings when imported;
    # the registry, below it, calls this at its first lookup that needs them (_border.py says why from here).
    from . import _transformers_mapping  # noqa: F401


_border.set_border_import(_import_border)
