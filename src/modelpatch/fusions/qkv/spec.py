"""``qkv``: ``q_proj``/``k_proj``/``v_proj`` (BERT's ``query``/``key``/``value``, T5's ``q``/``k``/``v``) -> one
``qkv_proj`` (``qkv``) Linear.

Sized from the actual projections, so grouped-query attention (fewer key/value heads) fuses correctly. The attention's
own forward runs unchanged, each projection's name calling its rows of the fused Linear, so a cross-attention whose
key/value read another input of the same size computes what stock computes too.
"""

from __future__ import annotations

from ..projections import FusedProjectionsSpec


class QKVFusionSpec(FusedProjectionsSpec):
    groups = (
        (("q_proj", "k_proj", "v_proj"), "qkv_proj"),
        (("query", "key", "value"), "qkv"),
        (("q", "k", "v"), "qkv"),
    )
    prefix = "QKVFused"
