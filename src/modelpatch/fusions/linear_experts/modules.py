"""Per-expert MoE modules made of plain ``nn.Linear`` layers, routed exactly like transformers' fused experts.

The experts' weights are each expert's own ``nn.Linear`` (what quantizers and PEFT replace), laid out in memory as
views of one 3-D tensor per projection (``gate_up [E, 2I, H]``, ``down [E, H, I]``, transformers' fused layout). While
that layout holds and nothing stands between the experts and their weights (a replaced or wrapped Linear, a hook, a
weight swapped or re-assigned, weights that need gradients), ``forward`` runs every expert at once with grouped
matrix products over the tokens sorted by expert, as stock transformers' fused experts do; otherwise it calls each
routed expert module in turn, so whatever stands in an expert's place is what runs.

Checking every expert, Linear, weight and data pointer would be most of what a call of a few tokens costs (eager: a
walk over 3 x E Linears; compiled: guards on each of them), so calls rely on a change signal instead: the packed
state is marked changed by a module or parameter assigned to the experts list, an expert or one of their Linears
(torch's global registration hooks: how PEFT, quantizers and parametrizations put theirs in place), by any other
attribute set on an expert (a plain-function activation, an instance ``forward``), and by any deletion from the list
or an expert. Eager calls walk everything once, then again only once the signal is set, a hook was registered
anywhere (every registration takes a new handle id), or an identity or a weight's data moved: each call checks, in
C-level passes, that every expert, Linear, weight and absent bias is still the one packed (writes straight into
``_modules`` / ``_parameters`` signal nothing) and compares the weights' data pointers, which a ``.data``
re-assignment or ``torch.utils.swap_tensors`` changes while the Parameter stays. With gradients off, compiled code
guards on the flag alone; once it is set, compiled code recompiles into the full check until an eager call or
:meth:`LinearExperts.pack` finds the layout intact again. What nothing signals is seen by compiled code after
``pack()``: writes straight into a module's ``_parameters`` or ``_modules``, a weight's ``.data`` re-assigned or
swapped. Hooks registered after compiling
are seen where dynamo guards on hooks at all (as for any module: ``torch._dynamo.config.skip_nnmodule_hook_guards =
False``); a ``forward`` set on a Linear's instance after compiling is not seen by compiled code (dynamo does not guard
the hook scan's look for it).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache, partial
from itertools import repeat
from types import SimpleNamespace
from typing import Any, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ... import _installs
from ..._torch import grouped_mm
from ...checkpoint.pages import release_pages
from ..hooks import global_hooks, hooked
from ..settings import plain_settings

# torch.nn.functional.grouped_mm (torch >= 2.10) else torch._grouped_mm (2.8, 2.9); None: no grouped path at all.
_GROUPED_MM: Callable[..., torch.Tensor] | None = grouped_mm()
_TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def _grouped_runs_on(*weights: torch.Tensor) -> bool:
    """Whether the grouped product has a kernel for these packed weights: on CPU from torch 2.9 (before 2.11 for
    16-byte aligned data only), on CUDA from compute capability 8.0."""
    device = weights[0].device
    if _GROUPED_MM is None:
        return False
    if device.type == "cpu":
        return _TORCH_VERSION >= (2, 11) or (_TORCH_VERSION >= (2, 9) and all(w.data_ptr() % 16 == 0 for w in weights))
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


# --- calibrating every expert ---------------------------------------------------------------------------------------

# llm-compressor's module holding its "calibrate all experts" switch (checked against llmcompressor 0.14.0.1: its
# ``get_calibrate_all_experts_flag()``, set inside ``moe_calibration_context()``, which ``oneshot`` enters for the whole
# calibration unless ``moe_calibrate_all_experts=False``). Read from ``sys.modules``, never imported: a process that
# has not imported it cannot have set the switch.
_LLMCOMPRESSOR_MOE_CONTEXT = "llmcompressor.modeling.moe.context"


def calibrating_all_experts() -> bool:
    """Whether a calibration asks every expert to see every token (llm-compressor's MoE calibration): each expert's
    Linears then run over all tokens, so that their observers and Hessians gather statistics of all of them, while the
    layer's output keeps only the routed tokens' results, as llm-compressor's own linearized experts do. Never inside
    compiled code (calibration runs eagerly, and a lookup in ``sys.modules`` is nothing to trace)."""
    if torch.compiler.is_compiling():
        return False
    context = sys.modules.get(_LLMCOMPRESSOR_MOE_CONTEXT)
    read_flag = getattr(context, "get_calibrate_all_experts_flag", None)
    return read_flag is not None and bool(read_flag())


# --- the change signal ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Watch:
    """A module that packed experts are made of (the experts list, an expert, an expert's Linear), and the
    LinearExperts whose packed state it is part of (one, unless modules are shared)."""

    module: weakref.ref[nn.Module]
    owners: tuple[weakref.ref[LinearExperts], ...]


# id(module) -> its watch. Keyed by id, not by module: torch's registration hooks pass every module of the process,
# and a module class may not be hashable. An entry goes when its module does.
_WATCHED: dict[int, _Watch] = {}


def _forget(key: int, ref: weakref.ref[nn.Module]) -> None:
    watch = _WATCHED.get(key)
    if watch is not None and watch.module is ref:
        del _WATCHED[key]


def _watch(modules: Iterable[nn.Module], owner: LinearExperts) -> None:
    """Have a change to any of ``modules`` mark ``owner``'s packed state changed."""
    _watch_registrations()
    for module in modules:
        key = id(module)
        watch = _WATCHED.get(key)
        if watch is None or watch.module() is not module:
            _WATCHED[key] = _Watch(weakref.ref(module, partial(_forget, key)), (weakref.ref(owner),))
        elif all(ref() is not owner for ref in watch.owners):
            watch.owners = (*(ref for ref in watch.owners if ref() is not None), weakref.ref(owner))


def _changed(module: nn.Module, *_: object) -> None:
    """Mark the packed state of the experts ``module`` is part of as changed (nothing for any other module)."""
    watch = _WATCHED.get(id(module))
    if watch is None or watch.module() is not module:
        return
    for ref in watch.owners:
        owner = ref()
        packed = None if owner is None else owner._packed
        if packed is not None:
            packed.changed = True


@cache
def _watch_registrations() -> None:
    """Route torch's global hooks for child modules and parameters assigned to any module to :func:`_changed` (once
    per process, from the first packed experts on: they cover the Linears, which are torch's own class)."""
    _installs.watch_module_registrations(_changed)


class ExpertGate:
    """The gate of experts whose stock class computes it in a method of its own (``_apply_gate``: a clamped SwiGLU,
    GPT-OSS's ``(up + 1) * glu``): that method, run on what it reads from the stock module (its limits, its
    activation), fed the gate and up outputs in the order the stock weights give them.

    ``interleaved``: the stock weights alternate gate and up rows (GPT-OSS), which the experts' Linears hold apart.
    """

    def __init__(self, function: Callable[[Any, torch.Tensor], torch.Tensor], state: dict[str, Any], interleaved: bool):
        self.function = function
        self.state = SimpleNamespace(**state)
        self.interleaved = interleaved

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The gated hidden state from one expert's gate and up outputs."""
        parts = (gate, up)
        joined = torch.stack(parts, dim=-1).flatten(-2) if self.interleaved else torch.cat(parts, dim=-1)
        return self.function(self.state, joined)

    def packed(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The gated hidden state from the packed product (every gate output, then every up output)."""
        if self.interleaved:
            gate_up = gate_up.unflatten(-1, (2, -1)).transpose(-2, -1).flatten(-2)
        return self.function(self.state, gate_up)

    def __repr__(self) -> str:
        return f"ExpertGate({getattr(self.function, '__qualname__', self.function)!r}, interleaved={self.interleaved})"


class ExpertMLP(nn.Module):
    """One gated expert: ``down(act(gate(x)) * up(x))``, or ``down(gate_fn(gate(x), up(x)))`` with an
    :class:`ExpertGate`; child names follow the checkpoint's convention."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        act_fn: Callable | None,
        names: tuple[str, str, str],
        device,
        dtype,
        bias: bool = False,
        gate_fn: ExpertGate | None = None,
    ):
        super().__init__()
        self.names = names
        gate, up, down = names
        setattr(self, gate, nn.Linear(hidden, intermediate, bias=bias, device=device, dtype=dtype))
        setattr(self, up, nn.Linear(hidden, intermediate, bias=bias, device=device, dtype=dtype))
        setattr(self, down, nn.Linear(intermediate, hidden, bias=bias, device=device, dtype=dtype))
        self.act_fn = act_fn
        self.gate_fn = gate_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        if self.gate_fn is not None:
            return down(self.gate_fn(gate(x), up(x)))
        act_fn = cast(Callable[[torch.Tensor], torch.Tensor], self.act_fn)  # set whenever gate_fn is not
        # The activation reads the gate half of one joined product, as stock's experts read their gate_up product's:
        # on a CPU an activation over such a strided view runs torch's scalar kernel, over a contiguous tensor its
        # vectorised one, and the two round differently (a tiny Qwen3-MoE's float32 MLP output moved by 4e-9).
        gate_out, up_out = torch.cat((gate(x), up(x)), dim=-1).chunk(2, dim=-1)
        return down(act_fn(gate_out) * up_out)

    # Attributes that are neither modules nor parameters (a plain-function activation, ``names``, an instance-level
    # ``forward``) take no registration hook: the expert signals them itself, as it does deletions.
    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name != "training":  # train() / eval(): nothing an expert computes depends on it
            _changed(self)

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        _changed(self)


@dataclass
class _Packed:
    """The experts' weights as two 3-D tensors, and what the experts must still hold for those to be true."""

    gate_up: torch.Tensor  # [E, 2I, H]: expert e's gate rows, then its up rows
    down: torch.Tensor  # [E, H, I]
    experts: tuple[nn.Module, ...]
    # Per Linear: (its parent's children dict, its name, the Linear, its weight), for the full check.
    linears: tuple[tuple[dict[str, nn.Module | None], str, nn.Linear, torch.Tensor], ...]
    act_fn: Callable  # the experts' activation (one object for all of them)
    gate_fn: ExpertGate | None  # their gate, where the stock class has its own (one object for all of them)
    modules: tuple[nn.Module, ...]  # the experts and their Linears, for the hook scan
    weights: list[torch.Tensor]  # each Linear's weight, in the order of ``linears``
    # The same entries column by column, for the eager calls' C-level passes (_unchanged_since_checked):
    # each Linear's parent's children dict, its name, the Linear, and the Linear's parameters dict.
    parents: tuple[dict[str, nn.Module | None], ...]
    names: tuple[str, ...]
    linear_modules: list[nn.Linear]
    parameters: tuple[dict[str, nn.Parameter | None], ...]
    no_biases: list[None]
    # Their data pointers, which a ``.data`` re-assignment or ``torch.utils.swap_tensors`` changes while the
    # Parameter stays (nothing signals either).
    pointers: list[int]
    # ``arange(E)`` on the weights' device as int64 and as the narrow sort keys of many slots (see _sort_keys): the
    # boundaries whose searchsorted in the sorted expert ids gives the grouped products' offsets.
    expert_ids: torch.Tensor
    narrow_expert_ids: torch.Tensor
    # RemovableHandle.next_id when the last full check found the layout intact and no hook on the experts: every
    # hook registration takes a new handle id, so while it is unchanged (and nothing was signalled) eager calls need
    # not check every Linear again (see LinearExperts._grouped_weights).
    hooks_checked_at: int = -1
    # Set by anything assigned to (or deleted from) the experts, an expert or their Linears since the last full check
    # (see the module docstring); compiled code guards on it instead of on every Linear.
    changed: bool = False

    def hooked(self) -> bool:
        """Whether a hook (or an instance-level ``forward``) sits on an expert or one of its Linears."""
        return any(hooked(module) for module in self.modules)

    def boundaries(self, keys: torch.Tensor) -> torch.Tensor:
        """The expert ids in the dtype of the sort ``keys``."""
        return self.expert_ids if keys.dtype == self.expert_ids.dtype else self.narrow_expert_ids


def _activation(expert: nn.Module) -> Any:
    # An activation module is a child; a plain function an attribute.
    return expert._modules.get("act_fn") or expert.__dict__.get("act_fn")


def _gate(expert: nn.Module) -> Any:
    return expert.__dict__.get("gate_fn")


def _packable(weights: Sequence[Sequence[torch.Tensor]], shapes: tuple[tuple[int, int], ...]) -> bool:
    first = weights[0][0]
    return all(
        type(w) is nn.Parameter
        and w.device.type != "meta"
        and w.device == first.device
        and w.dtype == first.dtype
        and w.dtype.is_floating_point
        and tuple(w.shape) == shape
        for expert in weights
        for w, shape in zip(expert, shapes, strict=True)
    )


def _one_tensor(rows: Sequence[Sequence[torch.Tensor]], shape: tuple[int, int, int]) -> torch.Tensor | None:
    """The ``shape`` tensor whose entry ``e`` is ``rows[e]``'s tensors stacked, when they already lie that way in one
    storage (experts split from a 3-D checkpoint tensor, or packed before and left in place by a no-op ``.to()``),
    so packing them needs no copy; else None."""
    first = rows[0][0]
    stride = rows[1][0].storage_offset() - first.storage_offset() if len(rows) > 1 else shape[1] * shape[2]
    if stride < shape[1] * shape[2]:
        return None
    storage = first.untyped_storage().data_ptr()
    for index, parts in enumerate(rows):
        offset = first.storage_offset() + index * stride
        for part in parts:
            if (
                not part.is_contiguous()
                or part.untyped_storage().data_ptr() != storage
                or part.storage_offset() != offset
            ):
                return None
            offset += part.numel()
    return first.detach().as_strided(shape, (stride, shape[2], 1), first.storage_offset())


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The grouped product as one opaque operator for ``torch.compile``, whose own lowering takes bfloat16 only.
    It takes the weight untransposed: compiled code would copy a transposed view to a contiguous tensor first."""
    return _GROUPED_MM(x, weight.transpose(-2, -1), offs=offsets)  # type: ignore[misc]


def _grouped_linear_shape(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[-2])


# ``modelpatch::grouped_linear``, registered when the first LinearExperts is built (never inside a compiled
# region): registering a custom operator reads its source file (~60 ms), which every process importing the loader
# paid at import time when this was a decorator, fused experts or not.
_opaque_grouped_linear: Any = None


def _register_opaque_grouped_linear() -> None:
    global _opaque_grouped_linear
    if _opaque_grouped_linear is None:
        op = torch.library.custom_op("modelpatch::grouped_linear", _grouped_linear, mutates_args=())
        op.register_fake(_grouped_linear_shape)
        _opaque_grouped_linear = op
        _installs.made("grouped_linear_operator")


def _grouped(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x[rows of group g] @ weight[g].T`` for each group ``g``, groups delimited by ``offsets`` (cumulative)."""
    if torch.compiler.is_compiling():
        return _opaque_grouped_linear(x, weight, offsets)
    return _GROUPED_MM(x, weight.transpose(-2, -1), offs=offsets)  # type: ignore[misc]


class LinearExperts(nn.ModuleList):
    """``experts[i]`` is expert ``i``; ``forward(hidden_states, top_k_index, top_k_weights)`` weighs each token's
    top-k expert outputs by its routing weights, as the fused experts of transformers do. A ``top_k_index`` equal to
    ``num_experts`` marks an unused slot (some routers pad with it): it contributes nothing."""

    # The stock experts module's 3-D parameters this module stands for, in the order the stock classes register them
    # (every experts class linear_experts fuses names them so).
    ORIGINAL_PARAMETERS = ("gate_up_proj", "down_proj")

    def original_names(self) -> tuple[str, ...]:
        """The names, on the stock model, of what this module stands for (its stock experts module's parameters):
        what an adapter saved for the stock model must name instead of this module's per-expert Linears."""
        return self.ORIGINAL_PARAMETERS

    def computing_settings(self) -> dict[str, object]:
        """The plain attributes this module computes with, under the names the stock experts module gives them: its
        own, and those its experts' gate read from the stock module it was built from (GPT-OSS's ``limit`` and
        ``alpha``). A live ``fuse`` checks them against the module it replaces (see
        :func:`modelpatch.restructuring.restructure.fuse`)."""
        settings = plain_settings(self)
        gate = next((expert.gate_fn for expert in self if isinstance(expert, ExpertMLP)), None)
        if gate is not None:
            settings.update(plain_settings(gate.state))
        return settings

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        act_fn: Callable | None,
        names,
        device,
        dtype,
        bias: bool = False,
        gate_fn: ExpertGate | None = None,
    ):
        super().__init__(
            ExpertMLP(hidden, intermediate, act_fn, names, device, dtype, bias, gate_fn) for _ in range(num_experts)
        )
        _register_opaque_grouped_linear()
        self.num_experts = num_experts
        self.hidden_dim = hidden
        self.intermediate_dim = intermediate
        self._packed: _Packed | None = None
        self.pack()

    # --- the packed layout ---------------------------------------------------------------------------------------

    def pack(self, *, release_sources: bool = False) -> bool:
        """Lay the experts' weights out as views of one ``[E, 2I, H]`` and one ``[E, H, I]`` tensor (in place: the
        ``nn.Parameter`` objects stay, only their storage moves), which is what the grouped path reads.

        Called after a load, a live fuse and every ``.to()`` / ``.cuda()`` / ``to_empty``; call it again after
        re-assigning an expert weight's ``.data`` by hand. Weights already laid out so (split from a 3-D checkpoint
        tensor) are adopted without a copy. ``release_sources`` (a load: nothing else holds the weights read) drops the
        resident pages of the checkpoint file each copied weight was read from, expert by expert. Returns whether the
        experts are packed: not while any expert's Linear was replaced (quantized, PEFT), has a bias, or its weights
        are on the meta device or of mixed dtypes, nor while the list holds other than ``num_experts`` experts, nor
        where torch has no grouped product for them.

        From here on the experts signal changes (see the module docstring): a module or parameter assigned to the
        list, an expert or one of their Linears, any attribute set on (or deleted from) an expert, an expert deleted
        or inserted. Eager calls check every Linear again only after that signal, a hook registration, an expert,
        Linear or weight that is not the one packed, or a weight's data moving (``.data`` re-assignment,
        ``torch.utils.swap_tensors``); compiled code with gradients off takes the grouped path on the signal alone.
        So under ``torch.compile`` what nothing signals needs this call before it is seen: writes straight into
        ``_parameters`` / ``_modules``, a weight's ``.data`` re-assigned or swapped. Packing also clears the signal.
        """
        self._packed = None
        experts = [expert for expert in self if type(expert) is ExpertMLP]
        # (forward routes num_experts experts: the grouped products need one packed expert per route.)
        if not experts or len(experts) != len(self) or len(self) != self.num_experts:
            return False
        linears: list[list[nn.Linear]] = []
        for expert in experts:
            row: list[nn.Linear] = []
            for name in expert.names:
                linear = expert._modules.get(name)
                if type(linear) is not nn.Linear or linear.bias is not None:
                    return False
                row.append(linear)
            linears.append(row)
        weights = [tuple(lin.weight for lin in row) for row in linears]
        hidden, intermediate = self.hidden_dim, self.intermediate_dim
        act_fn, gate_fn = _activation(self[0]), _gate(self[0])
        shapes = ((intermediate, hidden), (intermediate, hidden), (hidden, intermediate))
        if any(_activation(e) is not act_fn or _gate(e) is not gate_fn for e in self) or not _packable(weights, shapes):
            return False
        count = len(weights)
        gate_up = _one_tensor([(g, u) for g, u, _ in weights], (count, 2 * intermediate, hidden))
        down = _one_tensor([(d,) for _, _, d in weights], (count, hidden, intermediate))
        if gate_up is None or down is None:
            first = weights[0][0]
            gate_up = torch.empty(count, 2 * intermediate, hidden, dtype=first.dtype, device=first.device)
            down = torch.empty(count, hidden, intermediate, dtype=first.dtype, device=first.device)
            with torch.no_grad():
                for index, (gate, up, down_weight) in enumerate(weights):
                    # One expert at a time: its old tensors go as soon as its Parameters point into the new ones, and
                    # so do the pages of a checkpoint file they were read from, which would stay resident otherwise.
                    for target, weight in (
                        (gate_up[index, :intermediate], gate),
                        (gate_up[index, intermediate:], up),
                        (down[index], down_weight),
                    ):
                        target.copy_(weight)
                        old = weight.detach()
                        weight.data = target
                        if release_sources:
                            release_pages(old)
        if not _grouped_runs_on(gate_up, down):
            return False
        modules = (*experts, *(linear for row in linears for linear in row))
        entries = tuple(
            (expert._modules, name, linear, linear.weight)
            for expert, row in zip(experts, linears, strict=True)
            for name, linear in zip(expert.names, row, strict=True)
        )
        expert_ids = torch.arange(count, device=gate_up.device)
        self._packed = _Packed(
            gate_up,
            down,
            tuple(self),
            entries,
            act_fn,
            gate_fn,
            modules,
            weights=[entry[3] for entry in entries],
            parents=tuple(entry[0] for entry in entries),
            names=tuple(entry[1] for entry in entries),
            linear_modules=[entry[2] for entry in entries],
            parameters=tuple(entry[2]._parameters for entry in entries),
            no_biases=[None] * len(entries),
            pointers=[entry[3].data_ptr() for entry in entries],
            expert_ids=expert_ids,
            narrow_expert_ids=expert_ids.to(_narrow_key_dtype(count)),
        )
        _watch((self, *modules), self)
        return True

    def _apply(self, fn, recurse: bool = True):
        # .to() / .cuda() / .half() / to_empty give every weight storage of its own: lay them out again.
        result = super()._apply(fn, recurse)
        self.pack()
        return result

    def __getstate__(self) -> dict[str, Any]:
        # The packed tensors alias the experts' weights: pickle (and deepcopy) those once, and pack the copy again.
        state = super().__getstate__()
        return {**state, "_packed": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        _register_opaque_grouped_linear()  # unpickled in a process that never built one
        self.pack()

    # ModuleList's __delitem__ / pop delete through delattr, and insert writes its dict directly: neither takes a
    # registration hook.
    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        _changed(self)

    def insert(self, index: int, module: nn.Module) -> None:
        super().insert(index, module)
        _changed(self)

    def _grouped_weights(self, hidden_states: torch.Tensor | None = None) -> _Packed | None:
        """The packed weights when the grouped path computes exactly what calling each expert would (and the
        gradients it would), else None."""
        packed = self._packed
        if packed is None or global_hooks():
            return None
        compiling = torch.compiler.is_compiling()
        grad = torch.is_grad_enabled()
        if compiling and grad and hidden_states is not None and hidden_states.requires_grad:
            return None  # the opaque operator compiled code calls has no backward
        if compiling and not grad and not packed.changed:
            # Nothing was assigned to the experts since the layout was last found intact: guard on that flag rather
            # than on each Linear, its weight and the activation (and on the hooks, where dynamo guards on hooks). A
            # change sets the flag, which recompiles into the full check below.
            return None if packed.hooked() else packed
        if not compiling and self._unchanged_since_checked(packed, grad):
            return packed
        return self._checked(packed, compiling, grad)

    def _unchanged_since_checked(self, packed: _Packed, grad: bool) -> bool:
        """Whether an eager call may skip the full check: it last found the layout intact and no hook on the experts,
        and since then nothing was signalled, no hook was registered anywhere, every expert, Linear, weight and (no)
        bias is still the one packed (a write straight into ``_modules`` or ``_parameters``, as accelerate's
        ``set_module_tensor_to_device`` makes, signals nothing), and no weight's data moved (a ``.data``
        re-assignment or ``swap_tensors``, which nothing signals either); with gradients on, no weight wants one.
        Each is one C-level pass (``map`` over dict lookups and identities), not the Python walk over every expert
        and Linear that a call of a few tokens would spend most of its time on."""
        count = len(packed.weights)
        # List equality takes identical items as equal without calling their __eq__ (modules compare by identity;
        # a tensor that is not the packed one compares elementwise, which fails or is false: not unchanged).
        try:
            same = (
                tuple(self._modules.values()) == packed.experts
                and list(map(dict.get, packed.parents, packed.names)) == packed.linear_modules
                and list(map(dict.get, packed.parameters, repeat("weight", count))) == packed.weights
                and list(map(dict.get, packed.parameters, repeat("bias", count))) == packed.no_biases
            )
        except RuntimeError:  # a weight of another shape, or one whose elementwise comparison is ambiguous
            return False
        return (
            same
            and not packed.changed
            and packed.hooks_checked_at == RemovableHandle.next_id
            and list(map(torch.Tensor.data_ptr, packed.weights)) == packed.pointers
            and not (grad and any(map(_requires_grad, packed.weights)))
        )

    def _checked(self, packed: _Packed, compiling: bool, grad: bool) -> _Packed | None:
        """The full check: every expert, Linear, weight, data pointer, activation and hook."""
        if tuple(self._modules.values()) != packed.experts:
            return None
        for (children, name, linear, weight), pointer in zip(packed.linears, packed.pointers, strict=True):
            if children.get(name) is not linear:
                return None
            parameters = linear._parameters
            current = parameters.get("weight")
            if current is not weight or parameters.get("bias") is not None or (grad and current.requires_grad):
                # A new weight, or one whose gradient the grouped path (reading the 3-D tensors) would not give.
                return None
            if not compiling and current.data_ptr() != pointer:
                return None
        if any(_activation(e) is not packed.act_fn or _gate(e) is not packed.gate_fn for e in packed.experts):
            return None
        if compiling:
            # torch.compile guards on what this reads, and writes no state of its own.
            return None if packed.hooked() else packed
        # (A forward wrapped on an instance takes no handle: one wrapped after this scan is seen only with a new hook,
        # a change signalled, or through the weights accelerate moves along with it.)
        if packed.changed or packed.hooks_checked_at != RemovableHandle.next_id:
            # Every Linear was checked above: compiled code may guard on the flag alone again.
            packed.changed = False
            if packed.hooked():
                return None
            packed.hooks_checked_at = RemovableHandle.next_id
        return packed

    # --- forward ---------------------------------------------------------------------------------------------------

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        num_tokens, top_k = top_k_index.shape
        every_token = calibrating_all_experts()
        # Calibrating every expert on every token: each expert module is called (the grouped path calls none).
        packed = None if every_token else self._grouped_weights(hidden_states)
        # Every (token, slot) pair sorted by expert, as stock sorts them; unused slots (index num_experts) sort last.
        keys = _sort_keys(top_k_index.reshape(-1), self.num_experts)
        sorted_keys, order = torch.sort(keys)
        tokens = order // top_k
        # Where each expert's rows end: unused slots fall past the last expert's. (A fixed-size result, unlike
        # bincount's, keeps torch.compile's graph whole.)
        boundaries = (
            packed.boundaries(keys)
            if packed is not None
            else torch.arange(self.num_experts, device=keys.device, dtype=keys.dtype)
        )
        offsets = torch.searchsorted(sorted_keys, boundaries, right=True, out_int32=True)
        if packed is not None:
            # The grouped products leave the rows of unused slots unwritten: _weighted_sum never reads them.
            out = self._grouped_forward(packed, hidden_states[tokens], offsets)
        else:
            out = self._expert_by_expert(hidden_states, tokens, offsets, every_token=every_token)
        summed = _weighted_sum(out, order, sorted_keys, top_k_index, top_k_weights, self.num_experts)
        return summed if summed.dtype == hidden_states.dtype else summed.to(hidden_states.dtype)

    def forward_dispatched(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Every expert over its own slice of ``hidden_states`` (``[E * T, H]``: the tokens already dispatched to
        each expert and weighted by their router scores, as Llama 4's experts take them), ``[E * T, H]`` out."""
        x = hidden_states.view(self.num_experts, -1, self.hidden_dim)
        if calibrating_all_experts():
            # Every expert over every expert's slice (llm-compressor's MoE calibration), keeping its own slice's rows.
            return torch.cat([expert(hidden_states).view_as(x)[index] for index, expert in enumerate(self)])
        packed = self._grouped_weights(hidden_states)
        if packed is not None and packed.gate_fn is None:
            # One batched product per projection, as stock's: the packed weights are [E, out, in].
            gate, up = torch.bmm(x, packed.gate_up.transpose(1, 2)).chunk(2, dim=-1)
            out = torch.bmm(packed.act_fn(gate) * up, packed.down.transpose(1, 2))
        else:
            out = torch.stack([expert(x[index]) for index, expert in enumerate(self)])
        return out.view(-1, self.hidden_dim)

    def _grouped_forward(self, packed: _Packed, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if x.dtype != packed.gate_up.dtype:
            x = x.to(packed.gate_up.dtype)
        gate_up = _grouped(x, packed.gate_up, offsets)
        if packed.gate_fn is not None:
            return _grouped(packed.gate_fn.packed(gate_up), packed.down, offsets)
        gate, up = gate_up.chunk(2, dim=-1)
        return _grouped(packed.act_fn(gate) * up, packed.down, offsets)

    def _expert_by_expert(
        self, hidden_states: torch.Tensor, tokens: torch.Tensor, offsets: torch.Tensor, *, every_token: bool = False
    ) -> torch.Tensor:
        """Each routed expert module called on its tokens (rows in sorted order; unused slots stay zero).

        ``every_token`` (:func:`calibrating_all_experts`): every expert is called on all of ``hidden_states`` and
        only its routed tokens' rows are kept, so the output is the routed one while each expert sees every token.

        With gradients wanted, an expert no token was routed to is called too, on no rows: its weights then get a
        gradient of zeros, as the rows of stock's 3-D parameter do, so that an optimizer treats them alike (weight
        decay, moments) and every expert takes part in each gradient reduction of data-parallel training (FSDP2
        reduces the gradients that exist; experts without one on some rank would desynchronise the ranks).
        """
        out = hidden_states.new_zeros(tokens.shape[0], hidden_states.shape[-1])
        grad = torch.is_grad_enabled()
        start = 0
        for expert, end in zip(self, offsets.tolist(), strict=False):
            rows = slice(start, end)
            if every_token:
                out[rows] = expert(hidden_states)[tokens[rows]].to(out.dtype)
            elif end > start or (grad and any(p.requires_grad for p in expert.parameters())):
                out[rows] = expert(hidden_states[tokens[rows]]).to(out.dtype)
            start = end
        return out


def _requires_grad(tensor: torch.Tensor) -> bool:
    return tensor.requires_grad


# Up to this many slots a GPU sorts in one kernel, whatever the dtype; beyond, by radix, one pass per key byte: there
# expert ids as the narrowest integers that hold them take 1 or 2 passes where int64 takes 8.
_SORTED_IN_ONE_KERNEL_UP_TO = 4096


def _narrow_key_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer dtype holding ``0 .. num_experts`` (the last: an unused slot)."""
    if num_experts < 2**8:
        return torch.uint8
    return torch.int16 if num_experts < 2**15 else torch.int32


def _sort_keys(slots: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The expert ids to sort: int64 (what a few slots come as), or narrow for many."""
    many = slots.shape[0] > _SORTED_IN_ONE_KERNEL_UP_TO
    dtype = _narrow_key_dtype(num_experts) if many else torch.int64
    return slots if slots.dtype == dtype else slots.to(dtype)


def _weighted_sum(
    out: torch.Tensor,
    order: torch.Tensor,
    sorted_keys: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    num_experts: int,
) -> torch.Tensor:
    """Each token's expert outputs (``out``: rows in sorted order) weighed by its routing weights and summed over its
    slots, as stock does: the products stock forms, back in (token, slot) order, summed there (one rounding per token
    in bf16). An unused slot (index ``num_experts``, sorted past every expert's rows, which hold whatever the grouped
    products left there) contributes zero."""
    num_tokens, top_k = top_k_index.shape
    num_slots, hidden = out.shape
    if torch.compiler.is_compiling():
        weighted = _scattered_back(out, order, sorted_keys, top_k_weights, num_experts)
    elif num_slots * hidden <= (_MASKED_ON_CPU_UP_TO if out.device.type == "cpu" else _MASKED_UP_TO):
        # Few rows: the host's operations are what costs. Back to (token, slot) order, weighed there, unused slots
        # masked.
        weighted = out[_inverse(order)] * top_k_weights.reshape(-1, 1)
        weighted.masked_fill_(top_k_index.reshape(-1, 1) >= num_experts, 0)
    else:
        weighted = _gathered_back(out, order, sorted_keys, top_k_weights, num_experts)
    return weighted.view(num_tokens, top_k, hidden).sum(dim=1)


def _gathered_back(
    out: torch.Tensor, order: torch.Tensor, sorted_keys: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """Many rows, eager: each pass over them is what costs, so no masking pass and no scatter (a GPU gathers rows
    faster than it scatters them). The rows are weighed in sorted order into a buffer with one more row, zeroed, which
    every unused slot gathers back instead of its own."""
    num_slots, hidden = out.shape
    weights = top_k_weights.reshape(-1)[order]
    if out.requires_grad:  # a product written into a buffer has no backward: one more pass, when training
        product = out * weights.unsqueeze(1)
        buffer = torch.cat((product, product.new_zeros(1, hidden)))
    else:
        dtype = out.dtype if weights.dtype == out.dtype else torch.promote_types(out.dtype, weights.dtype)
        buffer = out.new_empty((num_slots + 1, hidden), dtype=dtype)
        torch.mul(out, weights.unsqueeze(1), out=buffer[:num_slots])
        buffer[num_slots].zero_()
    rows = torch.arange(num_slots, device=out.device).masked_fill_(sorted_keys >= num_experts, num_slots)
    return buffer[torch.empty_like(order).scatter_(0, order, rows)]


def _scattered_back(
    out: torch.Tensor, order: torch.Tensor, sorted_keys: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """Compiled: the rows weighed in sorted order, unused ones masked, scattered back to (token, slot) order, which
    the compiler fuses into fewer passes than a gather (and computes as it always has)."""
    weighted = out * top_k_weights.reshape(-1)[order].unsqueeze(1)
    weighted = torch.where((sorted_keys < num_experts).unsqueeze(1), weighted, 0)
    return torch.empty_like(weighted).index_copy_(0, order, weighted)


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """The inverse of the permutation ``order``: on a CPU, one sort of a handful of slots; else a scatter. A sort is
    the dearest operation to issue on a GPU (on an H200's host, under the profiler: 90 us of the 970 us a one-token
    block call took, and two device copies), and on a CPU sorting 256 slots already costs more than scattering them."""
    if order.device.type == "cpu" and order.shape[0] <= _SORTED_ON_CPU_UP_TO:
        return torch.argsort(order)
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=order.device))


# Measured on 1 core: argsort of 8 slots 2.6 us against 3.6 us for the scatter, of 256 slots 4.3 against 3.9 us.
_SORTED_ON_CPU_UP_TO = 64


# Up to this many elements (slots x hidden) in the experts' output, masking the rows of unused slots costs less than
# the four more operations that avoid it: on a GPU, which waits on the host issuing operations while the rows are few
# (a pass over 4M elements is a few microseconds); on a CPU, which runs every operation in turn, while they fit its
# caches.
_MASKED_UP_TO = 2**22
_MASKED_ON_CPU_UP_TO = 2**15
