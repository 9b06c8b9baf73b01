"""The save half of quantization: what a save of a model loaded with a quantizer writes.

A model loaded with transformers' quantizer (``quantization.py``, the load half) is written as stock writes it: the
quantizer's own serialisation (``get_state_dict_and_metadata``: its flattened tensors and their safetensors
metadata), or refused by name where modelpatch cannot write it so that it loads back the same model. This module
reads what the load recorded (:class:`~modelpatch.loading.record.QuantizedLoad`) and the quantizer on the model; it
imports none of transformers' quantizer API, so that saving a plain model does not load it.

A torchao model whose layout differs from the checkpoint's (a fused ``qkv_proj`` quantized at load) is written in the
original layout as stock writes its own: each fused tensor subclass is cut into its parts by rows with torchao's own
slicing, where every part then holds exactly its rows of the quantized data (row-wise int8: each row's int8 values,
scale and zero point) or the layer's one value unchanged (a per-tensor scale, which each part was quantized with),
and the parts are flattened with torchao's serialisation (what transformers' torchao quantizer writes). A layout that
cannot be cut so (quantization blocks of several rows across a part boundary, a subclass torchao cannot slice, a
conversion other than a split by rows) is refused by name before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from .._transformers_mapping import model_conversions
from ..conversion.operations import Chunk
from ..conversion.planner import ConversionGroup, ConversionPlan, TensorMeta, plan_load
from ..errors import SaveError
from ..loading.diagnose import collapse_lines
from ..loading.record import QuantizedLoad, get_load_report, model_record
from ..loading.report import LoadReport
from ..saving.contents import model_layout, state_to_save
from ..state import stored_fusion_config

if TYPE_CHECKING:
    from ..saving.plan import SavePlan


def plan_quantized_save(plan: SavePlan) -> None:
    """The quantization mode's part of a save's plan (``Quantization.plan_save``): the model's quantizer serialises
    it (:meth:`SavePlan.serialise`: what stock writes), unless it holds plain tensors (dequantized at load and saved in
    the runtime layout).

    Raises SaveError, naming the method, for what modelpatch cannot write so that it loads back the same model: a
    collective save (each rank its rows: a quantizer's serialisation is of the whole model), a layout other than the
    checkpoint's that is not torchao's split exactly by rows, a quantizer removed since or one with no serialisation
    of its own.
    """
    model = plan.model
    model_state = model_record(model)
    record: QuantizedLoad | None = None if model_state is None else model_state.quantization
    if record is None:
        return
    if plan.writer.writes_rows:
        raise SaveError(f"{type(model).__name__} is quantized: modelpatch does not save quantized sharded models.")
    serialised = _quantized_checkpoint(model, record, plan.state, original_format=plan.original_format)
    if serialised is not None:
        plan.serialise(*serialised)


def _quantized_checkpoint(
    model: PreTrainedModel, record: QuantizedLoad, state: Mapping[str, Any], *, original_format: bool
) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """The tensors and safetensors metadata a save of a model loaded quantized writes (what stock writes), or None
    when it holds plain tensors (dequantized and saved in the runtime layout)."""
    report = get_load_report(model)
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
    changes = _layout_changes(model, report) if original_format else []
    if changes and record.method == "torchao":
        return _torchao_original_layout(model, state, report)
    if changes:
        raise SaveError(
            f"Cannot save {type(model).__name__} in its checkpoint's layout: it holds {record.method} tensors and its "
            f"layout differs from the checkpoint's (conversions or fusions: {', '.join(changes[:3])}), and modelpatch "
            f"does not split or unstack {record.method} tensors. Nothing was written. Save with "
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


def _layout_changes(model: PreTrainedModel, report: LoadReport | None) -> list[str]:
    """How ``model``'s runtime layout differs from its checkpoint's, in words (none: the same layout)."""
    if report is None or report.runtime_layout:
        return ["a runtime-layout source"]
    changes = [group.sources_summary() for group in report.groups]
    changes += [f"{source} -> {key}" for key, source in report.direct.items() if key != source]
    return changes or (["fusions"] if stored_fusion_config(model.config) is not None else [])


def _torchao_original_layout(
    model: PreTrainedModel, state: Mapping[str, Any], report: LoadReport | None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """torchao's serialisation of ``model``'s state in the checkpoint's layout: each torchao tensor of a fused layer
    cut into its parts by rows (:func:`_row_parts`), every other tensor through the layout's exact reverse.

    Raises:
        SaveError: A torchao tensor is converted otherwise than split by rows, or does not split exactly; every tensor
            at fault is named, before anything is written.
    """
    kept = state_to_save(model, state, report)
    layout = model_layout(model, kept)
    quantized = {key for key, tensor in kept.items() if type(tensor.detach()) is not torch.Tensor}
    problems: list[str] = []
    parts: dict[str, torch.Tensor] = {}
    plain = ConversionPlan(direct=dict(layout.direct))
    for group in layout.groups:
        if not quantized & set(group.source_keys()):
            plain.groups.append(group)
            continue
        cut = _row_parts(group, kept)
        if isinstance(cut, str):
            problems.append(cut)
        else:
            parts.update(cut)
    if problems:
        raise SaveError(
            f"Cannot save {type(model).__name__} in its checkpoint's layout: these torchao tensors of its fused layers "
            "do not split exactly into the checkpoint's tensors; nothing was written:\n  - "
            + "\n  - ".join(problems)
            + "\nSave with save_original_format=False (modelpatch loads that back), or load without the fusion."
        )
    _refuse_what_stock_would_combine(model, layout, kept, parts)
    with torch.no_grad():
        converted = {**plain.run(kept.__getitem__), **parts}
    # In the model's order, each fused tensor's parts where it stands (stock's order: q_proj, k_proj, v_proj, o_proj).
    position = {key: index for index, key in enumerate(kept)}
    sources = layout.sources_of()
    original = {key: converted[key] for key in sorted(converted, key=lambda k: position[sources[k][0]])}
    # torchao is imported only here: a torchao model was loaded, so it is installed.
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    # What transformers' torchao quantizer writes (its get_state_dict_and_metadata flattens the model's state dict).
    tensors, metadata = flatten_tensor_state_dict(original)
    return tensors, metadata


def _refuse_what_stock_would_combine(
    model: PreTrainedModel,
    layout: ConversionPlan,
    state: Mapping[str, torch.Tensor],
    parts: Mapping[str, torch.Tensor],
) -> None:
    """Refuse, naming them, torchao tensors of the original layout (``layout`` of ``state``, torchao ``parts`` cut
    from its fused tensors) that stock transformers' load would convert. Reads shapes only.

    Stock's torchao quantizer quantizes ``nn.Linear`` weights only, so a stock model's converted parameters (3-D
    experts stacked from per-expert weights) are never torchao tensors, and its load cannot stack torchao tensors into
    them: it leaves those parameters at their random initialisation. A model that quantized its experts one Linear at
    a time (``linear_experts``) writes such tensors.
    """
    metas = {key: TensorMeta(tuple(state[source].shape), state[source].dtype) for key, source in layout.direct.items()}
    for group in layout.groups:
        metas.update(group.target_metas())
    quantized = {key for key, source in layout.direct.items() if type(state[source].detach()) is not torch.Tensor}
    quantized |= set(parts)
    combined = [
        f"{sorted(set(group.source_keys()) & quantized)} -> {group.target_keys()} "
        f"({', '.join(type(op).__name__ for op in group.operations)})"
        for group in plan_load(metas, model_conversions(model)).groups
        if set(group.source_keys()) & quantized
    ]
    if combined:
        raise SaveError(
            f"Cannot save {type(model).__name__} in its checkpoint's layout: stock transformers would load these "
            "torchao tensors through a conversion that combines them, which its torchao quantizer cannot do (it "
            "quantizes nn.Linear weights only): the parameters they make would be left at random. Nothing was "
            "written.\n  - "
            + "\n  - ".join(collapse_lines(combined))
            + "\nSave with save_original_format=False (modelpatch loads that back with the same fusion_config), or "
            "quantize the model loaded without linear_experts (its experts then stay in full precision, as in stock)."
        )


def _row_parts(group: ConversionGroup, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | str:
    """The parts of a torchao tensor that ``group`` splits by rows (checkpoint key -> part), or why it cannot be.

    Each part is torchao's own slice of the tensor (``narrow``: its class, block size and dtype kept), accepted when
    every piece of quantized data in it is exactly the fused tensor's: its rows (a view of them) or, for data that is
    one for the whole layer, the same value. Anything else (a block of rows across a part boundary, data torchao
    recomputes or cannot slice) would not be what the fused layer computes.
    """
    sources, split = group.source_keys(), group.operations[0] if len(group.operations) == 1 else None
    if len(sources) != 1 or not isinstance(split, Chunk) or split.dim != 0 or split.sizes is None:
        targets = ", ".join(group.target_keys())
        return f"{', '.join(sources)} -> {targets}: {list(group.operations)} is not a split by rows"
    key = sources[0]
    tensor = state[key].detach()
    kind = type(tensor).__name__
    names = [*getattr(tensor, "tensor_data_names", ()), *getattr(tensor, "optional_tensor_data_names", ())]
    block = getattr(tensor, "block_size", None)
    if not names or block is None:
        return f"{key} ({kind}): not a torchao tensor with quantized data and a block size, which modelpatch can cut"
    parts, start = {}, 0
    for target, rows in zip(group.target_keys(), split.sizes, strict=True):
        try:
            part = tensor.narrow(0, start, rows)
        except Exception as error:  # torchao raises NotImplementedError, or another error, for what it cannot slice
            return f"{key} ({kind}): torchao cannot slice it by rows ({error})"
        for name in names:
            whole, piece = getattr(tensor, name, None), getattr(part, name, None)
            if whole is None and piece is None:
                continue
            if not _exact_piece(whole, piece, start, rows, tensor.shape[0]):
                shape = list(whole.shape) if isinstance(whole, torch.Tensor) else whole
                return (
                    f"{key} ({kind}, block size {list(block)}): its {name} {shape} is neither one entry per output "
                    f"row nor one for the whole layer, or torchao's slice does not keep it: it does not split into "
                    f"{', '.join(group.target_keys())} ({list(split.sizes)} rows) exactly"
                )
        parts[target] = part
        start += rows
    return parts


def _exact_piece(whole: Any, piece: Any, start: int, rows: int, total: int) -> bool:
    """Whether ``piece`` (a part's data) is ``whole``'s (the fused tensor's) rows ``start:start+rows`` as they are,
    or ``whole`` itself when it is one value for the whole layer."""
    if not isinstance(whole, torch.Tensor) or not isinstance(piece, torch.Tensor) or whole.dtype != piece.dtype:
        return False
    if whole.ndim >= 1 and whole.shape[0] == total and total > 1:
        return _same_bits(piece, whole[start : start + rows])
    return whole.numel() == 1 and _same_bits(piece, whole)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same shape and bytes (compared as bytes: float8 has no comparison on the CPU)."""
    return a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )
