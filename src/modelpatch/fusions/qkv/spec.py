"""``qkv``: ``q_proj``/``k_proj``/``v_proj`` (or BERT's ``query``/``key``/``value``) -> one ``qkv_proj`` Linear.

Sized from the actual projections, so grouped-query attention (fewer key/value heads) fuses correctly.
"""

from __future__ import annotations

from ..projections import FusedProjectionsSpec


class QKVFusionSpec(FusedProjectionsSpec):
    groups = ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("query", "key", "value"), "qkv"))
    prefix = "QKVFused"
