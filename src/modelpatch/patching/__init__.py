"""Class patching: the registry, scoped application, and ``Patcher``."""

from .candidates import get_patchable_namespaces, register_patchable_namespace, unregister_patchable_namespace
from .mapping import PatchMapping
from .patcher import Patcher
from .registry import clear_patch_mapping, get_patch_mapping, register_patch_mapping, unregister_patch_mapping
from .scope import apply_patches, patch_scope

__all__ = [
    "PatchMapping",
    "Patcher",
    "apply_patches",
    "clear_patch_mapping",
    "get_patch_mapping",
    "get_patchable_namespaces",
    "patch_scope",
    "register_patch_mapping",
    "register_patchable_namespace",
    "unregister_patch_mapping",
    "unregister_patchable_namespace",
]
