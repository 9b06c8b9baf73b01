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

import functools
import inspect
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import ClassVar, cast

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PretrainedConfig

from ..conversion.operations import Concatenate
from ..conversion.transforms import WeightConverter, WeightTransform
from .generated import make_class
from .hooks import global_hooks, hooked
from .spec import ModuleFusionSpec, ModulesToFuse

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

    # Called where the Linear it replaced was called, with the same input, returning that Linear's output: a hook
    # registered on that Linear keeps its meaning here (modelpatch.fuse / unfuse carry hooks over between the two).
    stands_in_for: ClassVar[tuple[type[nn.Module], ...]] = (nn.Linear,)

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

    def release_owner(self) -> None:
        """Break the owner <-> slice reference cycle of a fused module being discarded, so that reference counting
        frees its tensors at once: the slice keeps only what its ``forward`` reads of the owner (the fused layer and
        the pending parts), so a forward still running on the discarded module in another thread computes as before.
        """
        fused = self.owner.__dict__["_modules"].get(self.fused_name)
        object.__setattr__(
            self, "owner", SimpleNamespace(_modules={self.fused_name: fused}, **{self.fused_name: fused})
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


# Attributes a module's forward may read from a projection (what a slice provides besides being called).
_SLICE_ATTRIBUTES = ("weight", "bias", "in_features", "out_features")

# Modules that transformers rebuilds at run time, outside any load: a fused module there would be replaced by a
# stock one (with other state keys) at the first forward that rebuilds it. ``module.qualname`` -> why.
REBUILT_AT_RUN_TIME = {
    f"transformers.models.{model}.modeling_{model}.{prefix}{kind}": (
        f"{prefix}Attention.set_attention_type rebuilds its self-attention at run time (at the first forward on a "
        "sequence too short for block-sparse attention), which would drop the fused projection"
    )
    for model, prefix in (("big_bird", "BigBird"), ("bigbird_pegasus", "BigBirdPegasus"))
    for kind in ("SelfAttention", "BlockSparseAttention")
}


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@functools.cache  # one read of a class's source per process, not one per instance
def _forward_misuse(cls: type, names: tuple[str, ...]) -> str | None:
    """How ``cls.forward`` uses one of ``names`` otherwise than a slice stands in for it (calling it, reading its
    weight, bias or sizes), or None. A forward whose source cannot be read is not known."""
    try:
        source = inspect.getsource(cast(type[nn.Module], cls).forward)
    except (OSError, TypeError):
        return f"the source of {cls.__qualname__}.forward is not available to check how it uses {'/'.join(names)}"
    for name in names:
        pattern = rf"self\.{name}\b(?!\s*\()(?!\.(?:{'|'.join(_SLICE_ATTRIBUTES)})\b)"
        if (found := re.search(pattern, source)) is not None or re.search(rf"self\.{name}\.\w+\s*=[^=]", source):
            use = found.group(0) if found else f"self.{name}.<attribute> = ..."
            return f"{cls.__qualname__}.forward uses {use!r} otherwise than calling it"
    return None


def _projection_mismatch(module: nn.Module, names: Sequence[str], fused_name: str) -> str | None:
    """Why ``module``'s children ``names`` cannot become one fused Linear ``fused_name``, or None when they can."""
    linears = [getattr(module, name) for name in names]
    for name, linear in zip(names, linears, strict=True):
        if type(linear) is not nn.Linear:
            return f"its {name} is a {type(linear).__qualname__}, not an nn.Linear"
        state = [n for n, _ in (*linear.named_parameters(), *linear.named_buffers()) if n not in ("weight", "bias")]
        if state or linear._modules:
            return f"its {name} holds {', '.join(state or list(linear._modules))} besides its weight and bias"
        if hooked(linear):
            return f"its {name} has hooks"
    first = linears[0]
    for name, linear in zip(names[1:], linears[1:], strict=True):
        if linear.in_features != first.in_features:
            return f"{names[0]} reads {first.in_features} features and {name} {linear.in_features}"
        if (linear.bias is None) != (first.bias is None):
            which = name if linear.bias is None else names[0]
            return f"{which} has no bias while the others have one: one fused Linear cannot hold that"
        if linear.weight.dtype != first.weight.dtype:
            return f"{names[0]} is {first.weight.dtype} and {name} {linear.weight.dtype}"
    if fused_name in module._modules or fused_name in module._parameters or fused_name in module.__dict__:
        return f"it already has an attribute {fused_name!r}"
    if (rebuilt := REBUILT_AT_RUN_TIME.get(_class_path(type(module)))) is not None:
        return rebuilt
    # A class object hashes by identity (mypy reads nn.Module's instance __hash__ annotation instead).
    return _forward_misuse(cast(type, type(module)), tuple(names))


def _key_space_pattern(paths: Sequence[str]) -> str:
    """A capture group matching exactly ``paths`` (module paths) at the start of a key: the one group a converter's
    target may capture (it holds no nested group)."""
    return "^(" + "|".join(re.escape(path) for path in sorted(paths, key=lambda p: (-len(p), p))) + ")"


class FusedProjectionsSpec(ModuleFusionSpec):
    """Fuse groups of sibling Linear layers that share their input.

    The fused class decides per instance (``per_instance``): an instance whose projections cannot be fused (another
    input size, a bias on some only, extra state, a forward that uses them otherwise than calling them) stays an
    instance of the original class.

    Attributes:
        groups: ``(child names, fused name)`` alternatives, in order of preference; a module is a candidate when it
            has one group's children, and fusable when they are plain ``nn.Linear`` with the same input size, bias
            presence and dtype, holding nothing else, and its forward only calls them (or reads their weight, bias
            and sizes).
        prefix: Prefix of generated class names (``"QKVFused"``).
    """

    groups: Sequence[tuple[tuple[str, ...], str]] = ()
    prefix = "Fused"
    per_instance = True
    reads_runtime_names = True

    def _candidate_groups(self, module: nn.Module) -> list[tuple[tuple[str, ...], str]]:
        return [g for g in self.groups if all(name in module._modules for name in g[0])]

    def _group_of(self, module: nn.Module) -> tuple[tuple[str, ...], str] | None:
        return next((g for g in self._candidate_groups(module) if _projection_mismatch(module, *g) is None), None)

    def is_candidate(self, module: nn.Module) -> bool:
        return bool(self._candidate_groups(module))

    def is_fusable(self, module: nn.Module) -> bool:
        return self._group_of(module) is not None

    def unfusable_reason(self, module: nn.Module) -> str | None:
        candidates = self._candidate_groups(module)
        if not candidates:
            names = " or ".join("/".join(names) for names, _ in self.groups)
            return f"it has no {names} children"
        reasons = [_projection_mismatch(module, *group) for group in candidates]
        return None if None in reasons else "; ".join(r for r in reasons if r)

    def make_fused_class(self, original_cls: type[nn.Module]) -> type[nn.Module]:
        spec = self

        def __init__(self, *args, **kwargs):
            original_cls.__init__(self, *args, **kwargs)
            group = spec._group_of(self)
            if group is None:
                # Decided per instance, by the very test discovery ran on the unfused build: this instance stays what
                # it is, an instance of the original class.
                self.__class__ = original_cls
                return
            fuse_linears(self, *group)

        return make_class(self.prefix, original_cls, {"__init__": __init__}, spec=self)

    def make_transforms(self, config: PretrainedConfig, modules: Mapping[str, nn.Module]) -> list[WeightTransform]:
        """One converter per layout (child names, fused name, part sizes), scoped to the exact paths of the modules
        of that layout: ``<path>.q_proj`` / ``k_proj`` / ``v_proj`` -> ``<path>.qkv_proj``. Two towers (or layers) of
        one model with other sizes get a converter each, so neither's tensors are cut to the other's sizes."""
        layouts: dict[tuple[tuple[str, ...], str, tuple[int, ...]], list[str]] = defaultdict(list)
        spellings = modules if isinstance(modules, ModulesToFuse) else ModulesToFuse(modules)
        taken = set(modules)
        for module_name, module in modules.items():
            names, fused_name = self._group_of(module)  # type: ignore[misc]
            sizes = tuple(getattr(module, n).out_features for n in names)
            # Another spelling of the name in a checkpoint, unless it is some other module's own name.
            layouts[(names, fused_name, sizes)] += [
                n for n in spellings.key_space_names(module_name) if n == module_name or n not in taken
            ]
        transforms: list[WeightTransform] = []
        for (names, fused_name, sizes), paths in sorted(layouts.items(), key=lambda item: sorted(item[1])[0]):
            scope = _key_space_pattern(paths)
            transforms.append(
                WeightConverter(
                    [rf"^\1\.{re.escape(name)}(?=\.(?:weight|bias)$)" for name in names],
                    rf"{scope}\.{fused_name}",
                    [Concatenate(dim=0, sizes=sizes)],
                )
            )
        return transforms
