"""What modelpatch persists: the keys it writes into ``config.json`` and the attributes it sets on models.

Kept in one module so that every path that writes them (``from_pretrained``, ``from_config``, the savers) and every
path that reads them agree, and so that a change of format is made in one place.

config.json keys (all prefixed ``modelpatch_``: transformers ignores them, so a checkpoint modelpatch writes loads in
stock transformers exactly as its tensors say):

* ``modelpatch_fusion_config``: the fusions the model was saved with; a later modelpatch load applies them again.
* ``modelpatch_runtime_layout``: the tensors are in the runtime (fused, converted) layout and load without conversion.
  It describes the *files*, so it never stays on an in-memory config.

transformers 5.23 acts on a plain ``fusion_config`` key itself (applying its own patch-embedding fusion, rejecting
names it does not know), so modelpatch reads that key for compatibility but never writes it, and removes it from the
configs of the models it builds.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

FUSION_CONFIG_KEY = "modelpatch_fusion_config"
RUNTIME_LAYOUT_KEY = "modelpatch_runtime_layout"
TRANSFORMERS_FUSION_CONFIG_KEY = "fusion_config"

# Attributes set on the models modelpatch builds.
REPORT_ATTRIBUTE = "modelpatch_report"  # the LoadReport of a loaded model (public: get_load_report)
TRANSFORMS_ATTRIBUTE = "_modelpatch_transforms"  # the transforms a save runs backwards (a loaded model: its report's)
BASE_TRANSFORMS_ATTRIBUTE = "_modelpatch_base_transforms"  # the same without fusions: what unfuse goes back to
EXPECTED_STATE_ATTRIBUTE = "_modelpatch_expected_state"  # runtime key -> (shape, dtype) as built: what a save checks
QUANTIZATION_ATTRIBUTE = "_modelpatch_quantization"  # how a quantized load left the model: what a save must respect
OFFLOAD_ATTRIBUTE = "_modelpatch_offloaded_weights"  # weights of modules offloaded by a device_map: what a save reads


def stored_fusion_config(config: PretrainedConfig) -> Any:
    """The fusion config a checkpoint's config carries: modelpatch's key, else transformers' own."""
    stored = getattr(config, FUSION_CONFIG_KEY, None)
    return stored if stored is not None else getattr(config, TRANSFORMERS_FUSION_CONFIG_KEY, None)


def is_runtime_layout(config: PretrainedConfig) -> bool:
    """Whether the checkpoint ``config`` was read from stores its tensors in the runtime layout."""
    return bool(getattr(config, RUNTIME_LAYOUT_KEY, False))


def record_fusion_config(config: PretrainedConfig, fusion_config: dict[str, Any]) -> None:
    """Leave on an in-memory ``config`` only what describes the model: its fusions, under modelpatch's key.

    The file-layout flag and transformers' own ``fusion_config`` key are removed, so that stock transformers'
    ``model.save_pretrained`` (and Trainer) write a config.json that stock transformers loads correctly.
    """
    for key in (FUSION_CONFIG_KEY, TRANSFORMERS_FUSION_CONFIG_KEY, RUNTIME_LAYOUT_KEY):
        config.__dict__.pop(key, None)
    if any(value is not False for value in fusion_config.values()):
        setattr(config, FUSION_CONFIG_KEY, dict(fusion_config))
