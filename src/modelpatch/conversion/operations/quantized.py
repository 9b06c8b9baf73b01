"""Operations on quantized checkpoint tensors: a weight stored without its companions, float8 weights dequantized
with their block scales, torchao tensor subclasses rebuilt from their flattened parts, a packed weight's shape split
with its rows."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from ...errors import ConversionError
from .base import (
    ConversionOperation,
    Shape,
    ShapeSlot,
    Slot,
    check_int,
    check_type,
    common_dtype,
    require_tensor_slots,
)


@dataclass(frozen=True)
class WithoutCompanions(ConversionOperation):
    """A weight a quantized format may store beside companion tensors (its scales), stored without them: passed
    through as it is. The slots are the weight, then ``companions`` optional ones. A group that has any companion is
    refused when it is bound, naming ``format``: dequantizing it is not something modelpatch does. With ``inverse``,
    the reverse: the tensor back as the weight, with no companions, as stock writes it.

    transformers' ``Inkling2LoopDequantizeExperts`` (5.24): a weight alone is passed through; NVFP4 / MXFP8 experts
    with their scales are refused by name.
    """

    moves_entries: ClassVar[bool] = True

    companions: int = 0
    format: str = "quantized"
    inverse: bool = False

    def __post_init__(self):
        owner = type(self).__name__
        check_int(owner, "companions", self.companions, 0)
        check_type(owner, "format", self.format, str)
        check_type(owner, "inverse", self.inverse, bool)

    def bind(self, shapes, num_targets):
        if self.inverse:
            (shape,) = require_tensor_slots(shapes, self)
            return self, [shape, *([None] * self.companions)]
        if len(shapes) != 1 + self.companions or shapes[0] is None:
            raise ConversionError(f"{self!r} takes a weight and {self.companions} optional companions: {shapes}.")
        if any(shape is not None for shape in shapes[1:]):
            raise ConversionError(
                f"{self!r}: the checkpoint stores {self.format} data beside the weight, which modelpatch does not "
                "dequantize. Load it with stock transformers and save it (dequantized), then load that."
            )
        return self, [shapes[0]]

    def output_dtype(self, dtypes):
        return common_dtype(dtypes[:1], repr(self))

    def apply(self, slots):
        return [slots[0], *([None] * self.companions)] if self.inverse else [slots[0]]

    def reverse(self):
        return replace(self, inverse=not self.inverse)


_FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)


def _scale_grid(shape: Shape) -> tuple[int, int]:
    """Blocks per (rows, columns) that a scale tensor of ``shape`` stands for: its last two dims, or one scale."""
    if len(shape) >= 2:
        return shape[-2], shape[-1]
    if math.prod(shape) == 1:
        return 1, 1
    raise ConversionError(f"a scale of shape {shape} is neither a block grid (2-D) nor one per-tensor scale.")


@dataclass(frozen=True)
class Fp8BlockDequantize(ConversionOperation):
    """Float8 weights and their block scales -> full-precision weights, as transformers' FP8 loader dequantizes them.

    The slots come in runs of ``1 + companions``: a float8 weight, its ``weight_scale_inv`` (one float32 scale per
    block of a ``[rows/blocks, cols/blocks]`` grid, or one for the tensor), then further companions
    (``activation_scale``) that a dequantized weight has no use for and that are dropped. The outputs are the weights:
    ``weight.float() * scale`` block by block, cast to ``dtype`` — the same arithmetic, in the same order, as
    transformers 5.23's ``Fp8Dequantize``, so the result is bitwise stock's. A run whose scale is absent is a weight the
    checkpoint did not quantize (a norm): it passes through (cast to ``dtype`` only when other weights of the group
    are dequantized, so that they can be stacked). ``uint8`` scales are MXFP8's power-of-two exponents.

    There is no exact reverse: the scales are not kept, and re-quantizing what was dequantized does not give them back.
    """

    dtype: torch.dtype = torch.bfloat16
    companions: int = 2
    scaled: bool | None = None

    def _runs(self, slots: list) -> list[tuple]:
        size = 1 + self.companions
        if not slots or len(slots) % size:
            raise ConversionError(f"{self!r} needs slots in runs of {size} (weight, scale, ...), got {len(slots)}.")
        return [tuple(slots[i : i + size]) for i in range(0, len(slots), size)]

    def bind(self, shapes, num_targets):
        out: list[ShapeSlot] = []
        scaled = set()
        for weight, scale, *_ in self._runs(shapes):
            if weight is None:
                raise ConversionError(f"{self!r}: a scale without its weight.")
            scaled.add(scale is not None)
            if scale is None:
                out.append(weight)
                continue
            # An indexed slot (one tensor per expert) pairs with an indexed slot of as many scales.
            weights, scales = (weight, scale) if isinstance(weight, list) else ([weight], [scale])
            if not isinstance(scale, type(weight)) or len(weights) != len(scales):
                raise ConversionError(f"{self!r}: weights {weight} and scales {scale} do not pair up.")
            for weight_shape, scale_shape in zip(weights, scales, strict=True):
                if len(weight_shape) < 2:
                    raise ConversionError(f"{self!r}: a block-scaled weight must be at least 2-D, got {weight_shape}.")
                grid = _scale_grid(scale_shape)
                if weight_shape[-2] % grid[0] or weight_shape[-1] % grid[1]:
                    raise ConversionError(
                        f"{self!r}: weight {weight_shape} does not divide into the scale grid {grid} (transformers "
                        "dequantizes only whole blocks)."
                    )
            out.append(weight)
        return replace(self, scaled=True in scaled), out

    def output_dtype(self, dtypes):
        runs = self._runs(dtypes)
        if any(scale is not None for _, scale, *_ in runs):
            for weight, scale, *_ in runs:
                if scale is not None and weight not in _FLOAT8_DTYPES:
                    raise ConversionError(
                        f"{self!r}: a scaled weight is {weight}, not float8 (packed FP4 weights are not supported)."
                    )
            return self.dtype
        return super().output_dtype([weight for weight, *_ in runs])

    def apply(self, slots):
        out: list[Slot] = []
        for weight, scale, *_ in self._runs(slots):
            if scale is None:
                out.append([self._cast(t) for t in weight] if isinstance(weight, list) else self._cast(weight))
            elif isinstance(weight, list):
                out.append([self._dequantize(w, s) for w, s in zip(weight, scale, strict=True)])
            else:
                out.append(self._dequantize(weight, scale))
        return out

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.dtype) if self.scaled and tensor.is_floating_point() else tensor

    def _dequantize(self, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        rows, cols = weight.shape[-2:]
        grid_rows, grid_cols = _scale_grid(tuple(scale.shape))
        scale = (scale.to(torch.float32) - 127.0).exp2() if scale.dtype == torch.uint8 else scale.to(torch.float32)
        blocks = weight.to(torch.float32).reshape(-1, grid_rows, rows // grid_rows, grid_cols, cols // grid_cols)
        scales = scale.reshape(-1, grid_rows, grid_cols).unsqueeze(-1).unsqueeze(2)
        return (blocks * scales).to(self.dtype).reshape(weight.shape)

    def reverse(self):
        raise ConversionError(
            f"{self!r} has no exact reverse: the float8 weights were dequantized at load and their block scales "
            "are not kept, so the checkpoint's float8 tensors cannot be written back. Save in the runtime layout "
            "(save_original_format=False) to write the dequantized weights."
        )


@dataclass(frozen=True)
class TorchAoTensor(ConversionOperation):
    """torchao's flattened tensor-subclass data -> the tensor subclass (an ``Int8Tensor`` weight, say).

    torchao saves a quantized ``<module>.weight`` as ``<module>._weight_qdata``, ``<module>._weight_scale``, ... plus a
    JSON entry per tensor in the safetensors metadata (its subclass, block size, dtype and which data it has).
    ``metadata`` is that mapping; :meth:`for_sources` picks the entry of each group's tensor and which slot holds which
    data, and torchao's own ``unflatten_tensor_state_dict`` rebuilds the subclass. Absent slots are data the tensor
    does not have (an ``Int8Tensor`` has no ``scale_and_zero``).

    No reverse: the flattened data alone is not the format, its metadata is part of it. A save writes torchao
    tensors with torchao's own serialisation (data and metadata together).
    """

    metadata: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    tensor_name: str | None = None
    data_names: tuple[str | None, ...] = ()
    dtypes: tuple[torch.dtype | None, ...] = ()
    result_dtype: torch.dtype | None = None

    def for_sources(self, keys, dtypes):
        first = keys[0]
        if not isinstance(first, str):
            raise ConversionError(f"{self!r} reads one tensor per slot, got {first!r}.")
        # torchao names the data of ``<module>.<param>`` ``<module>._<param>_<data>``; a param name may contain "_".
        module, _, flat = first.rpartition(".")
        splits = [i for i, char in enumerate(flat) if char == "_" and i > 1] if flat.startswith("_") else []
        tensor_name = next((name for i in splits if (name := f"{module}.{flat[1:i]}") in self.metadata), None)
        if tensor_name is None:
            raise ConversionError(f"{self!r}: the checkpoint's torchao metadata has no entry for {first!r}.")
        prefix = f"{module}._{tensor_name.rpartition('.')[2]}_"
        data_names = []
        for key in keys:
            if key is not None and (not isinstance(key, str) or not key.startswith(prefix)):
                raise ConversionError(f"{self!r}: {key!r} is not data of torchao tensor {tensor_name!r}.")
            data_names.append(None if key is None else key[len(prefix) :])
        return replace(self, tensor_name=tensor_name, data_names=tuple(data_names), dtypes=tuple(dtypes))

    def _specialised_name(self) -> str:
        if self.tensor_name is None:
            raise ConversionError(f"{self!r} is used before it is specialised to a group (for_sources).")
        return self.tensor_name

    def _entry(self) -> dict:
        entry = json.loads(self.metadata[self._specialised_name()])
        wanted = set(entry.get("_tensor_data_names") or ())
        present = {name for name in self.data_names if name is not None}
        if not wanted <= present:
            raise ConversionError(
                f"{self!r}: torchao tensor {self.tensor_name!r} needs data {sorted(wanted)}, the checkpoint has "
                f"{sorted(present)}."
            )
        return entry

    def bind(self, shapes, num_targets):
        entry = self._entry()
        # torchao builds the subclass from meta tensors of the stored shapes: the runtime shape and dtype, no data.
        entry["_data"].update(
            {
                name: torch.empty(shape, dtype=dtype, device="meta")
                for name, shape, dtype in zip(self.data_names, shapes, self.dtypes, strict=True)
                if name is not None
            }
        )
        from torchao.prototype.safetensors.safetensors_utils import object_from_dict

        try:
            tensor = object_from_dict(entry)
        except Exception as exc:  # torchao's constructors raise many types on inconsistent data
            raise ConversionError(f"{self!r}: torchao cannot build {self.tensor_name!r} from {shapes}: {exc}") from None
        return replace(self, result_dtype=tensor.dtype), [tuple(tensor.shape)]

    def output_dtype(self, dtypes):
        if self.result_dtype is None:
            raise ConversionError(f"{self!r}: the dtype of a torchao tensor is known once it is bound.")
        return self.result_dtype

    def apply(self, slots):
        from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

        tensor_name = self._specialised_name()
        module, _, param = tensor_name.rpartition(".")
        data = {
            f"{module}._{param}_{name}": t for name, t in zip(self.data_names, slots, strict=True) if name is not None
        }
        metadata = {tensor_name: self.metadata[tensor_name], "tensor_names": json.dumps([tensor_name])}
        tensors, leftover = unflatten_tensor_state_dict(data, metadata)
        if leftover or tensor_name not in tensors:
            raise ConversionError(f"{self!r}: torchao did not rebuild {tensor_name!r} (left {sorted(leftover)}).")
        return [tensors[tensor_name]]

    def reverse(self):
        raise ConversionError(
            f"{self!r} has no tensor-only reverse: torchao tensors are written by torchao's serialisation, data and "
            "metadata together (modelpatch.save_pretrained does this for a torchao model whose layout is unchanged)."
        )


@dataclass(frozen=True)
class SplitShapeRows(ConversionOperation):
    """A tensor holding a 2-D weight's shape ``[rows, columns]`` (compressed-tensors' ``weight_shape`` beside packed
    4-bit weights) as one per part of those rows: ``[size, columns]`` for each of ``sizes``, which must add up to the
    rows it holds. Its reverse is :class:`ConcatenateShapeRows`."""

    sizes: tuple[int, ...] = ()

    def bind(self, shapes, num_targets):
        tensors = require_tensor_slots(shapes, self)
        if len(tensors) != 1 or tuple(tensors[0]) != (2,) or len(self.sizes) != num_targets:
            raise ConversionError(
                f"{self!r} takes one shape tensor of 2 entries into {num_targets} parts, got {tensors}."
            )
        return self, [(2,)] * num_targets

    def apply(self, slots):
        shape = slots[0]
        if int(shape[0]) != sum(self.sizes):
            raise ConversionError(f"{self!r}: the shape {shape.tolist()} does not have {sum(self.sizes)} rows.")
        return [torch.stack([shape.new_tensor(size), shape[1]]) for size in self.sizes]

    def reverse(self):
        return ConcatenateShapeRows()


@dataclass(frozen=True)
class ConcatenateShapeRows(ConversionOperation):
    """Shape tensors ``[rows, columns]`` of parts with the same columns as the shape of their concatenation along the
    rows (the reverse of :class:`SplitShapeRows`)."""

    def bind(self, shapes, num_targets):
        tensors = require_tensor_slots(shapes, self)
        if not tensors or any(tuple(shape) != (2,) for shape in tensors):
            raise ConversionError(f"{self!r} takes shape tensors of 2 entries, got {tensors}.")
        return self, [(2,)]

    def apply(self, slots):
        if any(int(shape[1]) != int(slots[0][1]) for shape in slots):
            raise ConversionError(f"{self!r}: the parts have other columns: {[s.tolist() for s in slots]}.")
        return [torch.stack([sum(shape[0] for shape in slots), slots[0][1]])]

    def reverse(self):
        return SplitShapeRows()
