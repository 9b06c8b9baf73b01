"""The runtime modules of fused projections, shared by the ``qkv`` and ``gate_up`` families.

Several ``nn.Linear`` children that read the same input (``q_proj``, ``k_proj``, ``v_proj``) become one
:class:`FusedLinear` (``qkv_proj``): a plain ``nn.Linear`` whose output rows are the parts concatenated, which is
what quantization tools, PEFT and fused kernels want to see. The original attribute names stay as parameter-free
:class:`ProjectionSlice` modules, so the original ``forward`` runs unchanged: the first slice called with an input
computes the one fused matmul, and its siblings called with the same input take their part of that result. Under
``torch.compile`` that is one product per fused layer in the graph, with nothing of the slices' bookkeeping left to
run in Python around it.

Two exceptions, for speed, where the fused layer is a plain :class:`FusedLinear` that nothing hooks; each slice
then computes its own rows of the fused weight, the very product stock computes (bitwise stock's output):

* on CPU in float32, where one wide matrix product is slower than its parts (measured with MKL on 2 cores, 128
  tokens: 0.91x for a Llama gate/up, 0.96x for q/k/v; equal or faster at one token);
* on an accelerator, for families whose parts are read elementwise (``gate_up``: ``act(gate) * up``) from
  ``apart_from_rows`` rows of input on, in eager mode. The parts of one product are strided views of it, and an
  elementwise kernel over strided views runs torch's non-vectorised path: on an H200 (bf16, 2048 x 14336),
  ``silu(gate) * up`` took 0.190 ms over the views against 0.091 ms over separate outputs, while the one wide
  product saved nothing (0.718 against 0.720 ms); with few rows the one launch wins (one token: the MLP in 0.121
  against 0.130 ms). Compiled code keeps the one product: the compiler fuses the activation into its read.

A slice looks the fused layer up on its owner *by attribute, at call time*. Whatever replaced ``qkv_proj`` since
(a quantized Linear, a PEFT LoRA wrapper, a module with forward hooks) is what runs; a slice never keeps a reference
to the layer it was made from.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import ClassVar, cast

import torch
from torch import nn
from torch.nn import functional as F

from ..hooks import global_hooks, hooked

# Prefix of the owner module's attribute holding the fused output not yet taken by every slice, one attribute per
# fused layer (``_modelpatch_pending_qkv_proj``), present only between the first slice's call and the last one's.
_PENDING_PREFIX = "_modelpatch_pending_"


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
        apart_from_rows: From this many rows of input on (on an accelerator, in eager mode), the slice multiplies by
            its own rows of the fused weight; None: never (see the module's docstring).
    """

    # Called where the Linear it replaced was called, with the same input, returning that Linear's output: a hook
    # registered on that Linear keeps its meaning here (modelpatch.fuse / unfuse carry hooks over between the two).
    stands_in_for: ClassVar[tuple[type[nn.Module], ...]] = (nn.Linear,)

    def __init__(
        self,
        owner: nn.Module,
        fused_name: str,
        part_sizes: Sequence[int],
        index: int,
        in_features: int,
        apart_from_rows: int | None = None,
    ):
        super().__init__()
        object.__setattr__(self, "owner", owner)
        self.fused_name = fused_name
        self.part_sizes = tuple(part_sizes)
        self.index = index
        self.in_features = in_features
        self.out_features = self.part_sizes[index]
        self.apart_from_rows = apart_from_rows

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
        if self.computes_own_rows(x) and (parameters := _plain_parameters(fused)) is not None:
            # The part's rows of a row-major weight are a contiguous matrix: the product stock computes.
            weight, bias = parameters
            rows = self.rows()
            return F.linear(x, weight[rows], None if bias is None else bias[rows])
        # The first slice called with x computes the fused output and leaves it on the owner for its siblings; the
        # one that takes the last part deletes the attribute, so nothing keeps the input alive after the forward.
        # Added and deleted within one call, the attribute is invisible to compiled code: dynamo traces the fused
        # product once and replays nothing after its graph. (A dict kept on the owner between calls was a
        # pre-existing object mutated on every call, whose contents dynamo rewrote in Python after each compiled
        # call, as stock's compiled frame does not.)
        key = _PENDING_PREFIX + self.fused_name
        entry = owner_state.get(key)
        if entry is None or entry[0] is not x or entry[1] is not fused or entry[2][self.index] is None:
            parts: list[torch.Tensor | None] = list(fused(x).split(self.part_sizes, dim=-1))
            entry = (x, fused, parts)
            owner_state[key] = entry
        parts = entry[2]
        result = cast(torch.Tensor, parts[self.index])  # not None: checked above
        parts[self.index] = None
        if all(part is None for part in parts):
            # delattr, not ``del owner_state[key]``: dynamo before torch 2.13 cannot trace a deletion from a module's
            # __dict__ and broke the graph there, in every fused layer.
            delattr(self.owner, key)
        return result

    def computes_own_rows(self, x: torch.Tensor) -> bool:
        """Whether, given ``x``, this slice multiplies by its own rows of a plain fused layer rather than taking its
        part of the fused product (the module's docstring says where and why)."""
        if x.is_cpu:
            return x.dtype == torch.float32
        return (
            self.apart_from_rows is not None
            and not torch.compiler.is_compiling()
            and x.numel() >= self.apart_from_rows * x.shape[-1]
        )

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


def _plain_parameters(fused: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``fused``'s weight and bias when calling it only multiplies by its weight: a :class:`FusedLinear` as built,
    unhooked, holding plain parameters (not a tensor subclass: a quantized or distributed weight); else None. Read
    from its parameter dict (``nn.Module.__getattr__`` is a Python call per attribute, on every projection)."""
    if (
        type(fused) is not FusedLinear
        or FusedLinear.forward is not nn.Linear.forward
        or hooked(fused)
        or global_hooks()
    ):
        return None
    parameters = fused.__dict__["_parameters"]
    weight, bias = parameters.get("weight"), parameters.get("bias")
    if type(weight) is not nn.Parameter or (bias is not None and type(bias) is not nn.Parameter):
        return None
    return weight, bias


def fuse_linears(
    module: nn.Module, names: Sequence[str], fused_name: str, apart_from_rows: int | None = None
) -> FusedLinear:
    """Replace ``module``'s Linear children ``names`` by one ``FusedLinear`` called ``fused_name`` and slices
    (``apart_from_rows``: see :class:`ProjectionSlice`)."""
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
    # The fused layer and its slices take the place of the first original Linear among the module's children, so
    # that whatever walks the children in order (PEFT creating its adapter layers, drawing each one's random initial
    # weights) meets the parts where it meets the originals on the stock model.
    children = list(module._modules)
    after = [child for child in children[children.index(names[0]) :] if child not in names]
    for name in names:
        delattr(module, name)
    setattr(module, fused_name, fused)
    for index, name in enumerate(names):
        slice_ = ProjectionSlice(module, fused_name, sizes, index, first.in_features, apart_from_rows)
        setattr(module, name, slice_)
    for name in after:
        module._modules[name] = module._modules.pop(name)
    return fused
