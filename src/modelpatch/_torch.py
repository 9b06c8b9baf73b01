"""The one door to torch's private API: every private torch name modelpatch uses, one small function each (the same
shape as :mod:`modelpatch._transformers` and :mod:`modelpatch._peft`).

modelpatch restructures live modules and shards their tensors, which takes a few of torch's internals: the hook dicts
torch keeps on every module (moved onto the modules a restructuring puts in place, read to see whether a module does
more than its ``forward``) and on every tensor, the dicts of hooks registered for every module, the wrapper of hooks
bound to their module (``_WrappedHook``), the strided shard placement of FSDP2 (``_StridedShard``), the default
process group's store, the ``_metadata`` of a state dict, and the grouped matrix product of the torch releases that
have no public one (``torch._grouped_mm``, 2.8 and 2.9). They are all reached through this module, so moving to
another torch release means auditing this one file.

:data:`PRIVATE_API` lists every module-level or class-level name (where it lives, the first torch release that has it,
the feature that needs it); :data:`INSTANCE_ATTRIBUTES` those torch sets on instances only (no class declares them).
The floor is torch 2.6 (pyproject.toml): a first release of "2.6" means "in 2.6 already". Each function resolves its
names when called, through :func:`require` where it is not on a module's call path, so on a release that lacks one
only the feature needing it is refused, with a :class:`~modelpatch.errors.TorchVersionError` naming the release, the
name and the feature. (Those read on every call of a fused module, the hook dicts, are plain attribute reads, which
compiled code traces.)

:data:`MODULE_INTERNALS` are the exception, read directly by module code everywhere: ``nn.Module``'s own storage
(``_parameters``, ``_buffers``, ``_modules``: what ``__getattr__`` / ``__setattr__`` are built on, and what replacing a
tensor in place without a registration hook takes) and ``_apply``, the one method every ``.to()`` / ``.cuda()`` /
``to_empty`` goes through (overridden where a module must lay its tensors out again after one). Wrapping them would
put a call in every loop over a module's tensors for no check gained: they are listed here with their first release
instead, and tests/test_torch_door.py fails on any other private torch name used outside this module.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from ._doors import Door, private_api
from .errors import TorchVersionError

# The torch releases this door was read against and the suite exercises: the lowest and the newest CI runs
# (.ci/constraints-lowest.txt, .ci/constraints.txt). "Checked against A–B" in a function's docstring means read in
# those releases' source and exercised by the suite on both.
CHECKED = ("2.6.0", "2.15.0")

# Every private module- or class-level name of torch the door relies on, by the feature that needs it: each in torch
# 2.6, the floor, but _grouped_mm (2.8). PRIVATE_API: "module:attribute path" -> (first release, feature).
PRIVATE_API: dict[str, tuple[str, str]] = private_api(
    "2.6",
    {
        "moving state-dict hooks onto restructured modules": ["torch.nn.modules.module:_WrappedHook"],
        "fused modules' shortcuts (hooks on every module)": [
            "torch.nn.modules.module:_global_forward_hooks",
            "torch.nn.modules.module:_global_forward_pre_hooks",
            "torch.nn.modules.module:_global_backward_hooks",
            "torch.nn.modules.module:_global_backward_pre_hooks",
        ],
        "linear_experts' grouped product before torch.nn.functional.grouped_mm (2.10)": ["torch:_grouped_mm"],
        "tensor-parallel loads of stacked experts": ["torch.distributed.tensor.placement_types:_StridedShard"],
        "collective saves (the ranks' agreement)": ["torch.distributed.distributed_c10d:_get_default_store"],
    },
    since={"torch:_grouped_mm": "2.8"},
)

# torch's per-module hook dicts (set by nn.Module.__init__), with what error messages call them: those run around a
# call, and those run around state-dict saves and loads. A dict labelled "" holds flags of forward hooks.
CALL_HOOKS: dict[str, str] = {
    "_forward_pre_hooks": "forward pre-hook",
    "_forward_pre_hooks_with_kwargs": "",
    "_forward_hooks": "forward hook",
    "_forward_hooks_with_kwargs": "",
    "_forward_hooks_always_called": "",
    "_backward_pre_hooks": "backward pre-hook",
    "_backward_hooks": "backward hook",
}
STATE_HOOKS: dict[str, str] = {
    "_state_dict_pre_hooks": "state-dict pre-hook",
    "_state_dict_hooks": "state-dict hook",
    "_load_state_dict_pre_hooks": "load-state-dict pre-hook",
    "_load_state_dict_post_hooks": "load-state-dict post-hook",
}

# Private attributes torch sets on instances: "Class.attribute" -> (first release, feature). Checked on instances by
# the door's test (a Module, a Tensor, a state dict).
INSTANCE_ATTRIBUTES: dict[str, tuple[str, str]] = {
    **{f"Module.{name}": ("2.6", "moving hooks onto restructured modules") for name in (*CALL_HOOKS, *STATE_HOOKS)},
    "Module._is_full_backward_hook": ("2.6", "moving backward hooks onto restructured modules"),
    "Tensor._backward_hooks": ("2.6", "refusing to restructure tensors that carry hooks"),
    "Tensor._post_accumulate_grad_hooks": ("2.6", "refusing to restructure tensors that carry hooks"),
    "OrderedDict._metadata": ("2.6", "state dicts in the original layout (module versions kept)"),
}

# nn.Module internals read (or overridden) directly by module code; see the module docstring for why.
MODULE_INTERNALS: dict[str, str] = {"_parameters": "2.6", "_buffers": "2.6", "_modules": "2.6", "_apply": "2.6"}


# require(path): the private name path of PRIVATE_API, looked up now (TorchVersionError, naming it and the feature
# that needs it, where the installed torch lacks it); available(path): whether the installed torch has it.
_DOOR = Door(
    PRIVATE_API,
    TorchVersionError,
    lambda: f"torch {torch.__version__}",
    f" (modelpatch was checked against torch {' and '.join(CHECKED)}).",
)
require = _DOOR.require
available = _DOOR.available


def grouped_mm() -> Callable[..., torch.Tensor] | None:
    """torch's grouped matrix product: ``torch.nn.functional.grouped_mm`` (public from 2.10), else
    ``torch._grouped_mm`` (2.8, 2.9); None where torch has neither (2.6, 2.7: callers run each group alone).

    Checked against 2.6.0–2.15.0: absent in 2.6; in 2.15 both, the public one first.
    """
    public = getattr(torch.nn.functional, "grouped_mm", None)
    if public is not None:
        return public
    return require("torch:_grouped_mm") if available("torch:_grouped_mm") else None


def call_hook_kinds(module: nn.Module) -> list[str]:
    """What the hooks run around ``module``'s calls are called in messages, one per kind it has.

    Checked against 2.6.0–2.15.0: the dicts of :data:`CALL_HOOKS`, set by ``nn.Module.__init__``.
    """
    return [label for attribute, label in CALL_HOOKS.items() if label and getattr(module, attribute)]


def state_hook_kinds(module: nn.Module) -> list[str]:
    """What the hooks run around ``module``'s state-dict saves and loads are called in messages, one per kind.

    Checked against 2.6.0–2.15.0: the dicts of :data:`STATE_HOOKS`, set by ``nn.Module.__init__``.
    """
    return [label for attribute, label in STATE_HOOKS.items() if getattr(module, attribute)]


def has_call_hooks(module: nn.Module) -> bool:
    """Whether hooks of ``module`` run around its calls (forward, forward pre, backward, backward pre).

    Checked against 2.6.0–2.15.0: ``_forward_hooks``, ``_forward_pre_hooks``, ``_backward_hooks``,
    ``_backward_pre_hooks``.
    """
    return bool(
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
    )


def has_global_call_hooks() -> bool:
    """Whether hooks registered for every module (``register_module_forward_hook`` and its kin) are in place.

    Read straight from torch's module, not through :func:`require`: fused modules ask it on every call, compiled ones
    too, where dynamo traces plain attribute reads but no import machinery.

    Checked against 2.6.0–2.15.0: ``torch.nn.modules.module._global_{forward,forward_pre,backward,backward_pre}_hooks``.
    """
    return bool(
        torch_module._global_forward_hooks
        or torch_module._global_forward_pre_hooks
        or torch_module._global_backward_hooks
        or torch_module._global_backward_pre_hooks
    )


def share_hooks(live: nn.Module, new: nn.Module, keep_own: bool) -> None:
    """Give ``new`` the hook dicts of ``live`` (the very objects, so the hooks' handles remove them from ``new``),
    adding the hooks ``new`` registered itself when ``keep_own``; a load-state-dict pre-hook bound to ``live`` is bound
    to ``new`` instead, and the kind of backward hooks comes along with them.

    Checked against 2.6.0–2.15.0: the dicts of :data:`CALL_HOOKS` and :data:`STATE_HOOKS`; ``_WrappedHook`` (what
    ``register_load_state_dict_pre_hook`` stores: ``with_module`` and a weak ``module``); ``_is_full_backward_hook``.
    """
    for attribute in (*CALL_HOOKS, *STATE_HOOKS):
        hooks, own = getattr(live, attribute), getattr(new, attribute)
        if not hooks:
            continue
        if keep_own:
            for key, hook in own.items():
                hooks.setdefault(key, hook)
        new.__dict__[attribute] = hooks
    wrapped_hook = require("torch.nn.modules.module:_WrappedHook")
    for hook in new._load_state_dict_pre_hooks.values():
        # register_load_state_dict_pre_hook binds its hook to the module by weak reference.
        if isinstance(hook, wrapped_hook) and hook.with_module and hook.module() is live:
            hook.module = weakref.ref(new)
    if live._backward_hooks or live._backward_pre_hooks:
        new._is_full_backward_hook = live._is_full_backward_hook


def tensor_has_hooks(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` carries hooks of its own (``register_hook``, ``register_post_accumulate_grad_hook``).

    Checked against 2.6.0–2.15.0: ``Tensor._backward_hooks``, ``Tensor._post_accumulate_grad_hooks`` (None until
    one is registered).
    """
    return bool(tensor._backward_hooks or getattr(tensor, "_post_accumulate_grad_hooks", None))


def copy_state_dict_metadata(target: Any, source: Mapping[str, Any]) -> None:
    """Give the state dict ``target`` the ``_metadata`` of ``source`` (the module versions torch's
    ``load_state_dict`` reads), if it has one.

    Checked against 2.6.0–2.15.0: ``nn.Module.state_dict`` sets ``_metadata`` on the ``OrderedDict`` it returns.
    """
    metadata = getattr(source, "_metadata", None)
    if metadata is not None:
        target._metadata = metadata


def strided_split_factor(placement: object) -> int | None:
    """The number of parts a strided shard placement (FSDP2's placement of a dim sharded as several parts in turn)
    splits its dim into; None for any other placement.

    Checked against 2.6.0–2.15.0: ``torch.distributed.tensor.placement_types._StridedShard.split_factor``.
    """
    if isinstance(placement, require("torch.distributed.tensor.placement_types:_StridedShard")):
        factor: int = placement.split_factor
        return factor
    return None


def default_store() -> torch.distributed.Store:
    """The key-value store of the default process group (torch has no public accessor of it).

    Checked against 2.6.0–2.15.0: ``torch.distributed.distributed_c10d._get_default_store()``.
    """
    store: torch.distributed.Store = require("torch.distributed.distributed_c10d:_get_default_store")()
    return store
