"""The ``qkv`` fusion: one Linear for an attention module's query, key and value projections."""

from .spec import QKVFusionSpec

__all__ = ["QKVFusionSpec"]
