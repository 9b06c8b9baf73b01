"""Fused projections, shared by the ``qkv`` and ``gate_up`` families.

Several ``nn.Linear`` children that read the same input (``q_proj``, ``k_proj``, ``v_proj``) become one
:class:`FusedLinear` (``qkv_proj``): a plain ``nn.Linear`` whose output rows are the parts concatenated, which is
what quantization tools, PEFT and fused kernels want to see. The original attribute names stay as parameter-free
:class:`ProjectionSlice` modules, so the original ``forward`` runs unchanged: the first slice called with an input
computes the one fused matmul, and its siblings called with the same input take their part of that result.

One exception, for speed: on CPU in float32, one wide matrix product is slower than its parts (measured with MKL on
2 cores, 128 tokens: 0.91x for a Llama gate/up, 0.96x for q/k/v; equal or faster at one token), so there each slice
computes its own rows of the fused weight, the very product stock computes, while the fused layer is a plain
:class:`FusedLinear` that nothing hooks.

A slice looks the fused layer up on its owner *by attribute, at call time*. Whatever replaced ``qkv_proj`` since
(a quantized Linear, a PEFT LoRA wrapper, a module with forward hooks) is what runs; a slice never keeps a reference
to the layer it was made from.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PretrainedConfig

from ..conversion.operations import Concatenate
from ..conversion.transforms import WeightConverter, WeightTransform
from .generated import make_class
from .hooks import global_hooks, hooked
from .spec import ModuleFusionSpec

# Attribute of the owner module holding the fused output not yet taken by every slice, per fused layer name.
_PENDING_ATTRIBUTE = "_modelpatch_pending_parts"


class FusedLinear(nn.Linear):
    """``nn.Linear`` computing several projections of one input at once; ``part_sizes`` are their output sizes."""

    def __init__(self, in_features: int, part_sizes: Sequence[int], bias: bool, device=None, dtype=None):
        super().__init__(in_features, sum(part_sizes), bias=bias, device=device, dtype=dtype)
        self.part_sizes = tuple(part_sizes)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, part_sizes={self.part_sizes}"


class ProjectionSlice(nn.Module):
    """Stands where one of the fused projections was; owns no parameters (they live once, in the fused layer).

    Args:
        owner: The module holding the fused layer (the attention or MLP module). Kept as a plain attribute, not a
            child, so it is neither traversed nor saved twice; deepcopy and pickle keep it pointing at the copy.
        fused_name: The owner's attribute holding the fused layer (``"qkv_proj"``), read at every call.
        part_sizes: Output sizes of all parts, in order.
        index: Which part this slice is.
    """

    def __init__(self, owner: nn.Module, fused_name: str, part_sizes: Sequence[int], index: int, in_features: int):
        super().__init__()
        object.__setattr__(self, "owner", owner)
        self.fused_name = fused_name
        self.part_sizes = tuple(part_sizes)
        self.index = index
        self.in_features = in_features
        self.out_features = self.part_sizes[index]

    @property
    def fused(self) -> nn.Module:
        """The module that computes the fused projection now (whatever stands at ``owner.<fused_name>``)."""
        return getattr(self.owner, self.fused_name)

    def rows(self) -> slice:
        """This part's rows of the fused weight."""
        start = sum(self.part_sizes[: self.index])
        return slice(start, start + self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        # nn.Module annotates attributes as Tensor | Module; whatever computes the fused projection has a weight.
        return cast(torch.Tensor, self.fused.weight)[self.rows()]

    @property
    def bias(self) -> torch.Tensor | None:
        bias = getattr(self.fused, "bias", None)
        return None if bias is None else bias[self.rows()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        owner_state = self.owner.__dict__
        # The owner's child modules live in its _modules dict: read it directly (what getattr would find, without
        # nn.Module.__getattr__'s Python fallback on every projection call).
        fused = owner_state["_modules"][self.fused_name]
        if x.dtype == torch.float32 and x.device.type == "cpu" and _plain(fused):
            # The part's rows of a row-major weight are a contiguous matrix: the product stock computes.
            rows, bias = self.rows(), fused.bias
            return F.linear(x, fused.weight[rows], None if bias is None else bias[rows])
        pending = owner_state.setdefault(_PENDING_ATTRIBUTE, {})
        entry = pending.get(self.fused_name)
        if entry is None or entry[0] is not x or entry[1] is not fused or entry[2][self.index] is None:
            parts: list[torch.Tensor | None] = list(fused(x).split(self.part_sizes, dim=-1))
            entry = (x, fused, parts)
        result = entry[2][self.index]
        entry[2][self.index] = None
        # Keep the fused output only until every sibling has taken its part: nothing else holds the input.
        if any(part is not None for part in entry[2]):
            pending[self.fused_name] = entry
        else:
            pending.pop(self.fused_name, None)
        return result

    def extra_repr(self) -> str:
        # Stock PEFT (get_peft_model, PeftModel.from_pretrained, transformers' load_adapter) names a module it cannot
        # adapt by its repr only: this is where its error can say what adapts the original names.
        return (
            f"part {self.index} of {self.fused_name}, out_features={self.out_features}; "
            "LoRA on it: modelpatch.get_peft_model / modelpatch.load_adapter"
        )


def _plain(fused: nn.Module) -> bool:
    """Whether calling ``fused`` only multiplies by its weight: a :class:`FusedLinear` as built, unhooked, holding
    plain parameters (not a tensor subclass: a quantized or distributed weight)."""
    return (
        type(fused) is FusedLinear
        and FusedLinear.forward is nn.Linear.forward
        and type(fused.weight) is nn.Parameter
        and (fused.bias is None or type(fused.bias) is nn.Parameter)
        and not hooked(fused)
        and not global_hooks()
    )


def fuse_linears(module: nn.Module, names: Sequence[str], fused_name: str) -> FusedLinear:
    """Replace ``module``'s Linear children ``names`` by one ``FusedLinear`` called ``fused_name`` and slices."""
    linears = [getattr(module, name) for name in names]
    first = linears[0]
    sizes = [lin.out_features for lin in linears]
    fused = FusedLinear(
        first.in_features, sizes, bias=first.bias is not None, device=first.weight.device, dtype=first.weight.dtype
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
        setattr(module, name, ProjectionSlice(module, fused_name, sizes, index, first.in_features))
    return fused


def _compatible_linears(module: nn.Module, names: Sequence[str]) -> bool:
    linears = [lin for name in names if type(lin := getattr(module, name, None)) is nn.Linear]
    if len(linears) != len(names):
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

    def make_transforms(self, config: PretrainedConfig, modules: Mapping[str, nn.Module]) -> list[WeightTransform]:
        """One converter per (module name, child names, part sizes): ``self_attn.q_proj -> self_attn.qkv_proj``."""
        shapes: dict[tuple[str, tuple[str, ...], str, tuple[int, ...]], None] = {}
        for module_name, module in modules.items():
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
