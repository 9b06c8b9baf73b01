"""Hooks of modules a restructuring replaces: which move to the modules that stand in their place, and moving them.

Restructuring a live model (:mod:`modelpatch.restructuring.restructure`) replaces modules that may carry hooks: an
activation-steering forward hook on ``mlp``, transformers' own output recorders, a state-dict hook. A hook keeps its
meaning on the module that stands where its module stood when that module is called alike (the same arguments, the
same function): the replaced module itself always is (its replacement is called where it was), a module inside it is
when its counterpart has the same class or stands in for it (``stands_in_for``, as the projection slice that stands
where ``q_proj`` was). Deciding (:func:`plan_hook_moves`, :func:`tensor_hook_problems`) reads the modules only;
moving (:func:`move_hooks`) is the execute step's. torch keeps hooks in per-module dicts that the handles refer to:
moving gives the new module those very dicts, so the handles keep working.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.modules.module import _WrappedHook

from ..fusions.generated import fused_class_origin

# torch's per-module hook dicts, with what the error messages call them: those run around a call, and those run
# around state-dict saves and loads. The ``_with_kwargs`` / ``_always_called`` dicts are flags of forward hooks.
_CALL_HOOKS = {
    "_forward_pre_hooks": "forward pre-hook",
    "_forward_pre_hooks_with_kwargs": "",
    "_forward_hooks": "forward hook",
    "_forward_hooks_with_kwargs": "",
    "_forward_hooks_always_called": "",
    "_backward_pre_hooks": "backward pre-hook",
    "_backward_hooks": "backward hook",
}
_STATE_HOOKS = {
    "_state_dict_pre_hooks": "state-dict pre-hook",
    "_state_dict_hooks": "state-dict hook",
    "_load_state_dict_pre_hooks": "load-state-dict pre-hook",
    "_load_state_dict_post_hooks": "load-state-dict post-hook",
}


class HookMove(NamedTuple):
    """The hooks of ``live`` (a module replaced) go to ``new`` (the module that stands in its place)."""

    live: nn.Module
    new: nn.Module


def _hook_kinds(module: nn.Module, table: Mapping[str, str]) -> list[str]:
    return [label for attribute, label in table.items() if label and getattr(module, attribute)]


def _same_constructor(a: type, b: type) -> bool:
    """Whether instances of ``a`` and ``b`` are built by the same code: the same class, or a fused class and the
    class it replaced (whose ``__init__`` it runs)."""
    return a is b or any(
        origin is not None and origin[0] is other
        for origin, other in ((fused_class_origin(a), b), (fused_class_origin(b), a))
    )


def _called_alike(live: nn.Module, new: nn.Module) -> bool:
    """Whether ``new`` is called where ``live`` was, with the same arguments, returning what it returned."""
    a, b = type(live), type(new)
    return _same_constructor(a, b) or a in getattr(b, "stands_in_for", ()) or b in getattr(a, "stands_in_for", ())


def _state_layout(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {key: tuple(tensor.shape) for key, tensor in module.state_dict(keep_vars=True).items()}


def plan_hook_moves(live: nn.Module, new: nn.Module, name: str, verb: str) -> tuple[list[HookMove], list[str]]:
    """The hooked modules inside ``live`` (module ``name``) and those of ``new`` their hooks move to; and, for each
    hook that would lose its meaning in ``new``, the module and why. Changes nothing.

    The replaced module itself is called where it was, with the same arguments, and computes the same function: its
    call hooks always keep their meaning. A module inside it keeps them when ``new`` has a module at the same path
    that is called alike; state-dict hooks need the same state (keys and shapes) there.
    """
    targets = dict(new.named_modules(remove_duplicate=False))
    moves: list[HookMove] = []
    problems: list[str] = []
    for path, module in live.named_modules():
        call, state = _hook_kinds(module, _CALL_HOOKS), _hook_kinds(module, _STATE_HOOKS)
        forward = "forward" in module.__dict__
        if not (call or state or forward):
            continue
        target = targets.get(path)
        if forward:
            why = "its forward is set on the instance (it would keep calling the replaced module)"
        elif target is None:
            why = f"the {verb}d model has no module there"
        elif call and path and not _called_alike(module, target):
            why = f"a {type(target).__name__} stands there, not called as the {type(module).__name__} was"
        elif state and _state_layout(module) != _state_layout(target):
            why = f"the {type(target).__name__} that stands there holds other tensors"
        else:
            moves.append(HookMove(module, target))
            continue
        kinds = ", ".join([*call, *state] or ["a forward set on the instance"])
        problems.append(f"{name}.{path} ({kinds}): {why}" if path else f"{name} ({kinds}): {why}")
    return moves, problems


def tensor_hook_problems(tensors: Mapping[str, torch.Tensor], kept: set[str], verb: str) -> list[str]:
    """Tensors with hooks of their own (``register_hook``, ``register_post_accumulate_grad_hook``) that the
    restructuring converts into new tensors, which would not have them (those in ``kept`` stay the same objects)."""
    return [
        f"{key} (a tensor hook): {verb} converts it into a new tensor"
        for key, tensor in tensors.items()
        if key not in kept and (tensor._backward_hooks or getattr(tensor, "_post_accumulate_grad_hooks", None))
    ]


def move_hooks(move: HookMove) -> None:
    """Give ``move.new`` the hook dicts of ``move.live`` (the very objects, so that the hooks' handles remove them
    from the new module; the live one keeps them too, so a forward still running on it runs them). Hooks the new
    module registered itself when built are kept unless the live one was built by the same code (then it holds their
    twins)."""
    live, new = move
    same = _same_constructor(type(live), type(new))
    for attribute in (*_CALL_HOOKS, *_STATE_HOOKS):
        hooks, own = getattr(live, attribute), getattr(new, attribute)
        if not hooks:
            continue
        if not same:
            for key, hook in own.items():
                hooks.setdefault(key, hook)
        new.__dict__[attribute] = hooks
    for hook in new._load_state_dict_pre_hooks.values():
        # register_load_state_dict_pre_hook binds its hook to the module by weak reference.
        if isinstance(hook, _WrappedHook) and hook.with_module and hook.module() is live:
            hook.module = weakref.ref(new)
    if live._backward_hooks or live._backward_pre_hooks:
        new._is_full_backward_hook = live._is_full_backward_hook
