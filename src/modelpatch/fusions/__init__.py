"""Fusion mapping: opt-in, load-scoped replacement of modules by fused equivalents, reversible on save.

Each family lives in its own sub-package with the same shape (``modules.py``: the runtime modules, ``spec.py``: its
:class:`ModuleFusionSpec`), and registers itself here; ``projections/`` holds two families, ``qkv`` and ``gate_up``,
which share both.
"""

from .linear_experts import LinearExpertsFusionSpec, LinearExpertsOptions
from .patch_embeddings import PatchEmbeddingsFusionSpec
from .projections import GateUpFusionSpec, QKVFusionSpec
from .registry import available_fusions, get_fusion, register_fusion, unregister_fusion
from .sharding import FusedParts, TensorParallelLayout, TensorParallelShard
from .spec import FusionOptions, ModuleFusionSpec

register_fusion("patch_embeddings", PatchEmbeddingsFusionSpec())
register_fusion("qkv", QKVFusionSpec())
register_fusion("gate_up", GateUpFusionSpec())
register_fusion("linear_experts", LinearExpertsFusionSpec())

__all__ = [
    "FusedParts",
    "FusionOptions",
    "GateUpFusionSpec",
    "LinearExpertsFusionSpec",
    "LinearExpertsOptions",
    "ModuleFusionSpec",
    "PatchEmbeddingsFusionSpec",
    "QKVFusionSpec",
    "TensorParallelLayout",
    "TensorParallelShard",
    "available_fusions",
    "get_fusion",
    "register_fusion",
    "unregister_fusion",
]
