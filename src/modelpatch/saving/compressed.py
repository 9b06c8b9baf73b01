"""Linear layers a quantization tool gave compressed-tensors' state (llm-compressor's ``oneshot``), in a save.

compressed-tensors quantizes a Linear in place: the module keeps its class and gains ``quantization_scheme``, and its
state becomes the format's tensors (``weight`` as int8 or fp8, or ``weight_packed`` and ``weight_shape`` for 4 bits;
``weight_scale``, ``weight_zero_point``, ``input_scale``, ...). Stock transformers and vLLM read them under the
module's checkpoint name (``q_proj.weight_scale``). A save of such a model writes them in the original layout:

* a layer written under one checkpoint name (unfused, an expert's Linear of ``linear_experts``): every tensor of it
  under that name;
* a fused layer whose weight the save splits into its parts by rows (``qkv_proj`` into ``q_proj``, ``k_proj``,
  ``v_proj``): each tensor per output row (the quantized weight, per-channel and per-group scales and zero points,
  the bias) split with the same rows, and each tensor that is one for the whole layer (a per-tensor scale) or per
  input column (an activation scale of the shared input, a group index) written to each part: every part was
  quantized with it, so the parts compute what the fused layer computes; a packed layer's ``weight_shape`` becomes
  each part's. Anything else (block scales across a part boundary) cannot be split exactly and is refused by name,
  before anything is written.

The module reads compressed-tensors' attribute names only; it imports neither compressed-tensors nor llm-compressor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import nn

from ..conversion.operations import Chunk, ConversionOperation, Replicate, SplitShapeRows
from ..conversion.planner import ConversionGroup, ConversionPlan, TensorMeta
from ..errors import SaveError

# The attribute compressed-tensors sets on every module it quantizes (its QuantizationScheme).
_SCHEME_ATTRIBUTE = "quantization_scheme"
# compressed-tensors' tensor names on a quantized Linear: those with one entry per output row of the weight (or one
# for the whole layer), and those of the layer's input (one for the whole layer, or one per input column).
_PER_ROW = frozenset(
    {
        "weight",
        "weight_packed",
        "bias",
        "weight_scale",
        "weight_zero_point",
        "weight_global_scale",
        "output_scale",
        "output_zero_point",
    }
)
_PER_INPUT = frozenset({"input_scale", "input_zero_point", "input_global_scale", "weight_g_idx"})


def compressed_modules(model: nn.Module) -> dict[str, nn.Linear]:
    """The Linear layers of ``model`` that compressed-tensors quantized (path -> module)."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and getattr(module, _SCHEME_ATTRIBUTE, None) is not None
    }


def refuse_without_quantization_config(model: nn.Module) -> None:
    """Refuse, naming the layers, a save by modelpatch's own writer of a model given compressed-tensors' state after
    its load.

    That writer writes the model's config, which has no ``quantization_config`` for a quantization made after the
    load: stock transformers would load the tensors as a plain model's (the scales unused). llm-compressor's
    compressed save (``model.save_pretrained``, which ``oneshot`` wraps) writes the config that goes with them. A model
    loaded quantized has its ``quantization_config``: its save is the quantization mode's to serialise or refuse.
    """
    modules = compressed_modules(model)
    loaded_quantized = getattr(getattr(model, "config", None), "quantization_config", None) is not None
    if modules and not loaded_quantized:
        names = _named_first(modules)
        raise SaveError(
            f"Cannot save {type(model).__name__} with modelpatch.save_pretrained: {_listed(names)} hold "
            "compressed-tensors' quantized state, whose quantization_config only the quantization tool writes. Nothing "
            "was written. Save with model.save_pretrained(directory) (llm-compressor's compressed save, after "
            "oneshot), which writes the original layout with it."
        )


def _named_first(modules: Mapping[str, nn.Linear]) -> list[str]:
    """The paths of ``modules``, the restructured layers first (a fused projection is a Linear subclass)."""
    return sorted(modules, key=lambda name: type(modules[name]) is nn.Linear)


def _listed(names: list[str]) -> str:
    return f"{', '.join(names[:3])}{f' and {len(names) - 3} more' if len(names) > 3 else ''}"


def refuse_runtime_layout(model: nn.Module, fused: bool) -> None:
    """Refuse, naming the layers, a runtime-layout save of a ``fused`` model holding compressed-tensors' state.

    Its fused tensors (``qkv_proj.weight_scale``) load only where modelpatch's record in ``config.json`` says how, and
    the tools that write such a model rewrite that file after the save (llm-compressor puts the source checkpoint's
    config back, then adds its ``quantization_config``): the folder would hold fused keys under a plain config, which
    neither stock transformers nor modelpatch loads. (modelpatch does not load a compressed-tensors checkpoint into a
    fused model either.) The original layout is what they read.
    """
    modules = compressed_modules(model)
    if fused and modules:
        raise SaveError(
            f"Cannot save {type(model).__name__} in its runtime layout: {_listed(_named_first(modules))} hold "
            "compressed-tensors' quantized state, "
            "and a tool rewriting config.json after the save (llm-compressor does) drops the record that says how "
            "its fused tensors load. Nothing was written. Save in the original layout (save_original_format=True, "
            "the default), which stock transformers and vLLM load."
        )


def compressed_layout(
    modules: Mapping[str, nn.Linear],
    runtime: Mapping[str, TensorMeta],
    built: Mapping[str, TensorMeta] | None,
    plan: Callable[[dict[str, TensorMeta]], ConversionPlan],
) -> ConversionPlan:
    """The checkpoint layout of ``runtime`` (runtime key -> meta) when ``modules`` hold compressed-tensors' state.

    ``plan`` plans a layout of plain tensors (the save's own); each module's weight goes into it as it was built
    (``built``, the state as built; else the Linear's shape), and its compressed tensors follow the way that weight is
    written.

    Raises:
        SaveError: A compressed tensor of a fused layer cannot be split exactly into the layer's parts, or the layer's
            weight is written otherwise than under one name or split by rows; every tensor at fault is named.
    """
    own: dict[str, list[str]] = {name: [] for name in modules}
    plain: dict[str, TensorMeta] = {}
    for key, meta in runtime.items():
        owner = key.rpartition(".")[0]
        if owner in own:
            own[owner].append(key)
        else:
            plain[key] = meta
    for name, module in modules.items():
        # The weight as built stands for the layer: its written form says where the compressed tensors go.
        pivot = f"{name}.weight"
        as_built = None if built is None else built.get(pivot)
        plain[pivot] = as_built or TensorMeta((module.out_features, module.in_features), torch.float32)
    layout = plan(plain)
    problems: list[str] = []
    for name in modules:
        pivot = f"{name}.weight"
        direct = [checkpoint for checkpoint, key in layout.direct.items() if key == pivot]
        groups = [group for group in layout.groups if pivot in group.source_keys()]
        if direct and not groups:
            base = direct[0][: -len("weight")]
            del layout.direct[direct[0]]
            layout.direct.update({base + key.rpartition(".")[2]: key for key in own[name]})
            continue
        split = groups[0].operations[0] if len(groups) == 1 and len(groups[0].operations) == 1 else None
        if direct or not isinstance(split, Chunk) or split.dim != 0 or groups[0].source_keys() != [pivot]:
            how = groups[0].operations if groups else "no key"
            problems.append(f"{name}: its weight is written as {how}, not under one name nor split by rows")
            continue
        group = groups[0]
        layout.groups.remove(group)
        bases = [target[: -len("weight")] for target in group.target_keys()]
        sizes = tuple(split.sizes or ())
        for key in own[name]:
            tensor_name, meta = key.rpartition(".")[2], runtime[key]
            operation = _part_operation(tensor_name, meta, sizes)
            if operation is None:
                problems.append(
                    f"{key} {list(meta.shape)} is neither one entry per output row nor one for the whole layer: it "
                    f"does not split into {', '.join(base.rstrip('.') for base in bases)} ({list(sizes)} rows) exactly"
                )
                continue
            layout.groups.append(_group(group, key, meta, [base + tensor_name for base in bases], operation))
    if problems:
        raise SaveError(
            "Cannot save the compressed-tensors state of these fused layers in the checkpoint's original layout; "
            "nothing was written:\n  - " + "\n  - ".join(problems) + "\nSave with save_original_format=False "
            "(modelpatch loads it), or quantize the model loaded without the fusion."
        )
    return layout


def _part_operation(tensor_name: str, meta: TensorMeta, sizes: tuple[int, ...]) -> ConversionOperation | None:
    """How ``tensor_name`` of a fused layer whose rows are ``sizes`` goes to each part, or None when not exactly."""
    numel = math.prod(meta.shape)
    if tensor_name in _PER_INPUT:
        return Replicate()
    if tensor_name == "weight_shape" and tuple(meta.shape) == (2,):
        return SplitShapeRows(sizes=sizes)
    if tensor_name in _PER_ROW:
        if len(meta.shape) >= 1 and meta.shape[0] == sum(sizes):
            return Chunk(dim=0, sizes=sizes)
        if numel == 1 and tensor_name not in ("weight", "weight_packed", "bias"):
            return Replicate()
    return None


def _group(
    weight: ConversionGroup, key: str, meta: TensorMeta, targets: list[str], operation: ConversionOperation
) -> ConversionGroup:
    """``key`` (a compressed tensor of the fused layer whose weight ``weight`` splits) written to ``targets``."""
    bound, shapes = operation.bind([meta.shape], len(targets))
    return ConversionGroup(
        converter=weight.converter,
        sources=(key,),
        targets=tuple(targets),
        operations=(bound,),
        source_shapes=(meta.shape,),
        target_shapes=tuple(shapes),
        dtype=meta.dtype,
    )
