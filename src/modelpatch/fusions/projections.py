"""Fused projections, shared by the ``qkv`` and ``gate_up`` families.

Several ``nn.Linear`` children that read the same input (``q_proj``, ``k_proj``, ``v_proj``) become one
:class:`FusedLinear` (``qkv_proj``): a plain ``nn.Linear`` whose output rows are the parts concatenated, which is
what quantization tools and fused kernels want to see. The original attribute names stay as parameter-free
:class:`ProjectionSlice` modules, so the original ``forward`` runs unchanged: the first slice called with an input
computes the one fused matmul, and its siblings called with the same input take their part of that result.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PretrainedConfig

from ..conversion.operations import Concatenate
from ..conversion.transforms import WeightConverter, WeightTransform
from .generated import make_class
from .spec import ModuleFusionSpec


class FusedLinear(nn.Linear):
    """``nn.Linear`` computing several projections of one input at once; ``part_sizes`` are their output sizes."""

    def __init__(self, in_features: int, part_sizes: Sequence[int], bias: bool, device=None, dtype=None):
        super().__init__(in_features, sum(part_sizes), bias=bias, device=device, dtype=dtype)
        self.part_sizes = tuple(part_sizes)
        self._pending: tuple[torch.Tensor, list[torch.Tensor | None]] | None = None

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Output ``index`` for input ``x``: from the pending fused result when ``x`` is the input it was computed for."""
        pending = self._pending
        if pending is None or pending[0] is not x or pending[1][index] is None:
            parts: list[torch.Tensor | None] = list(self(x).split(self.part_sizes, dim=-1))
            pending = (x, parts)
        result = pending[1][index]
        pending[1][index] = None
        self._pending = pending if any(p is not None for p in pending[1]) else None
        return result  # type: ignore[return-value]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, part_sizes={self.part_sizes}"


class ProjectionSlice(nn.Module):
    """Stands where one of the fused projections was; owns no parameters (they live once, in the fused layer)."""

    def __init__(self, fused: FusedLinear, index: int):
        super().__init__()
        object.__setattr__(self, "fused", fused)  # not registered as a child: no duplicate parameters
        self.index = index
        self.in_features = fused.in_features
        self.out_features = fused.part_sizes[index]

    def _rows(self) -> slice:
        start = sum(self.fused.part_sizes[: self.index])
        return slice(start, start + self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        return self.fused.weight[self._rows()]

    @property
    def bias(self) -> torch.Tensor | None:
        return None if self.fused.bias is None else self.fused.bias[self._rows()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(self.index, x)

    def extra_repr(self) -> str:
        return f"part {self.index} of the fused projection, out_features={self.out_features}"


def fuse_linears(module: nn.Module, names: Sequence[str], fused_name: str) -> FusedLinear:
    """Replace ``module``'s Linear children ``names`` by one ``FusedLinear`` called ``fused_name`` and slices."""
    linears = [getattr(module, name) for name in names]
    first = linears[0]
    fused = FusedLinear(
        first.in_features,
        [lin.out_features for lin in linears],
        bias=first.bias is not None,
        device=first.weight.device,
        dtype=first.weight.dtype,
    )
    if first.weight.device.type != "meta":
        with torch.no_grad():
            fused.weight.copy_(torch.cat([lin.weight for lin in linears]))
            if fused.bias is not None:
                fused.bias.copy_(torch.cat([lin.bias for lin in linears]))
    for name in names:
        delattr(module, name)
    setattr(module, fused_name, fused)
    for index, name in enumerate(names):
        setattr(module, name, ProjectionSlice(fused, index))
    return fused


def _compatible_linears(module: nn.Module, names: Sequence[str]) -> bool:
    linears = [getattr(module, name, None) for name in names]
    if not all(type(lin) is nn.Linear for lin in linears):
        return False
    first = linears[0]
    return all(
        lin.in_features == first.in_features
        and (lin.bias is None) == (first.bias is None)
        and lin.weight.dtype == first.weight.dtype
        for lin in linears
    )


def _local_pattern(module_name: str, child: str) -> str:
    """``<module's own name>.<child>`` wherever it stands in a key, followed by ``.weight`` or ``.bias``."""
    anchor = module_name.rpartition(".")[2]
    path = f"{re.escape(anchor)}\\.{re.escape(child)}" if anchor else re.escape(child)
    return rf"(?<![^.]){path}(?=\.(?:weight|bias)$)"


class FusedProjectionsSpec(ModuleFusionSpec):
    """Fuse groups of sibling Linear layers that share their input.

    Attributes:
        groups: ``(child names, fused name)`` alternatives; a module is fusable when it has one group's children,
            all plain ``nn.Linear`` with the same input size, bias presence and dtype.
        prefix: Prefix of generated class names (``"QKVFused"``).
    """

    groups: Sequence[tuple[tuple[str, ...], str]] = ()
    prefix = "Fused"

    def _group_of(self, module: nn.Module) -> tuple[tuple[str, ...], str] | None:
        return next((g for g in self.groups if _compatible_linears(module, g[0])), None)

    def is_fusable(self, module: nn.Module) -> bool:
        return self._group_of(module) is not None

    def make_fused_class(self, original_cls: type[nn.Module]) -> type[nn.Module]:
        spec = self

        def __init__(self, *args, **kwargs):
            original_cls.__init__(self, *args, **kwargs)
            group = spec._group_of(self)
            if group is None:
                raise TypeError(f"{type(self).__name__}: this instance has no fusable {spec.groups} projections.")
            fuse_linears(self, *group)

        return make_class(self.prefix, original_cls, {"__init__": __init__}, spec=self)

    def make_transforms(
        self, config: PretrainedConfig, modules: Mapping[str, nn.Module] | None = None
    ) -> list[WeightTransform]:
        """One converter per (module name, child names, part sizes): ``self_attn.q_proj -> self_attn.qkv_proj``."""
        shapes: dict[tuple[str, tuple[str, ...], str, tuple[int, ...]], None] = {}
        for module_name, module in (modules or {}).items():
            names, fused_name = self._group_of(module)  # type: ignore[misc]
            sizes = tuple(getattr(module, n).out_features for n in names)
            shapes[(module_name.rpartition(".")[2], names, fused_name, sizes)] = None
        return [
            WeightConverter(
                [_local_pattern(anchor, name) for name in names],
                f"{anchor}.{fused_name}" if anchor else fused_name,
                [Concatenate(dim=0, sizes=sizes)],
            )
            for anchor, names, fused_name, sizes in shapes
        ]
