"""The save half of quantization: what a save of a model loaded with a quantizer writes.

A model loaded with transformers' quantizer (``quantization.py``, the load half) is written as stock writes it: the
quantizer's own serialisation (``get_state_dict_and_metadata``: its flattened tensors and their safetensors
metadata), or refused by name where modelpatch cannot write it so that it loads back the same model. This module
reads what the load recorded (:class:`~modelpatch.loading.record.QuantizedLoad`) and the quantizer on the model; it
imports none of transformers' quantizer API, so that saving a plain model does not load it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from ..errors import SaveError
from ..loading.record import QuantizedLoad, get_load_report, model_record
from ..loading.report import LoadReport
from ..state import stored_fusion_config

if TYPE_CHECKING:
    from ..saving.plan import SavePlan


def plan_quantized_save(plan: SavePlan) -> None:
    """The quantization mode's part of a save's plan (``Quantization.plan_save``): the model's quantizer serialises
    it (:meth:`SavePlan.serialise`: what stock writes), unless it holds plain tensors (dequantized at load and saved in
    the runtime layout).

    Raises SaveError, naming the method, for what modelpatch cannot write so that it loads back the same model: a
    collective save (each rank its rows: a quantizer's serialisation is of the whole model), a layout other than the
    checkpoint's, a quantizer removed since or one with no serialisation of its own.
    """
    model = plan.model
    model_state = model_record(model)
    record: QuantizedLoad | None = None if model_state is None else model_state.quantization
    if record is None:
        return
    if plan.writer.writes_rows:
        raise SaveError(f"{type(model).__name__} is quantized: modelpatch does not save quantized sharded models.")
    serialised = _quantized_checkpoint(model, record, get_load_report(model), original_format=plan.original_format)
    if serialised is not None:
        plan.serialise(*serialised)


def _quantized_checkpoint(
    model: PreTrainedModel, record: QuantizedLoad, report: LoadReport | None, *, original_format: bool
) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """The tensors and safetensors metadata a save of a model loaded quantized writes (what stock writes), or None
    when it holds plain tensors (dequantized and saved in the runtime layout)."""
    if record.dequantized:
        if original_format:
            raise SaveError(
                f"Cannot save {type(model).__name__} in its checkpoint's layout: its {record.method} weights were "
                "dequantized at load and their block scales are not kept, so the float8 tensors cannot be written back "
                "(stock transformers would re-quantize every 2-D weight, embeddings included, under a config that no "
                "longer declares fp8: a checkpoint that loads wrong). Nothing was written. Save the dequantized "
                "weights with save_original_format=False."
            )
        return None
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        raise SaveError(f"{type(model).__name__} was loaded with {record.method} but its quantizer was removed since.")
    if original_format:
        converted = [] if report is None else [group.sources_summary() for group in report.groups]
        renamed = [] if report is None else [f"{v} -> {k}" for k, v in report.direct.items() if k != v]
        fused = stored_fusion_config(model.config)
        if report is None or report.runtime_layout or converted or renamed or fused:
            raise SaveError(
                f"Cannot save {type(model).__name__} in its checkpoint's layout: it holds {record.method} tensors "
                "and its layout differs from the checkpoint's (conversions or fusions: "
                f"{', '.join([*converted, *renamed][:3]) or 'fusions or a runtime-layout source'}), and modelpatch "
                "cannot split or unstack quantized tensors. Nothing was written. Save with "
                "save_original_format=False (modelpatch loads that back), or load without the fusions."
            )
    tensors, metadata = quantizer.get_state_dict_and_metadata(model)
    if tensors is None:
        raise SaveError(
            f"Cannot save {type(model).__name__}: transformers' {record.method} quantizer has no serialisation of its "
            "own, and the model's live state is not the checkpoint's (compressed-tensors decompresses the weights in "
            "place at the first forward, so what stock writes depends on whether the model ran). modelpatch does not "
            f"save {record.method} models. Nothing was written."
        )
    return tensors, metadata
