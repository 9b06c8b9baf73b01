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

from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn

from .._torch import call_hook_kinds, share_hooks, state_hook_kinds, tensor_has_hooks
from ..fusions.generated import fused_class_origin


class HookMove(NamedTuple):
    """The hooks of ``live`` (a module replaced) go to ``new`` (the module that stands in its place)."""

    live: nn.Module
    new: nn.Module


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
        call, state = call_hook_kinds(module), state_hook_kinds(module)
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
        if key not in kept and tensor_has_hooks(tensor)
    ]


def move_hooks(move: HookMove) -> None:
    """Give ``move.new`` the hook dicts of ``move.live`` (the very objects, so that the hooks' handles remove them
    from the new module; the live one keeps them too, so a forward still running on it runs them). Hooks the new
    module registered itself when built are kept unless the live one was built by the same code (then it holds their
    twins)."""
    live, new = move
    share_hooks(live, new, keep_own=not _same_constructor(type(live), type(new)))
