"""The ``patch_embeddings`` fusion: a patch-sized Conv3d becomes a Linear over the flattened patch."""

from .spec import PatchEmbeddingsFusionSpec

__all__ = ["PatchEmbeddingsFusionSpec"]
