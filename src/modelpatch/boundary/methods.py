"""The boundary's instance-level methods: real bound methods, which survive a copy and a pickle.

The state-dict boundary replaces a few methods of one model (``save_pretrained``, ``load_state_dict``,
``get_output_embeddings``) without touching transformers' classes, so each is an instance attribute. Tools take these
methods apart as methods: llm-compressor's ``oneshot`` keeps a weak reference to ``model.save_pretrained.__self__``
and calls ``model.save_pretrained.__func__`` rebound to the model from the wrapper it installs in its place, and other
code asks ``inspect.ismethod``. So each is a :class:`types.MethodType` of a module-level function bound to the model:
``__self__`` is the model, ``__func__`` the function, and the function rebound to the model is the same method.

``copy.deepcopy`` copies a bound method rebound to the copy. Pickle does not: it stores a bound method as
``getattr(model, name)``, which it evaluates while the model is still being rebuilt, before its ``__dict__`` is
restored, so the unpickled model would get transformers' class method instead, silently. Each module given a bound
method therefore also gets an instance-level ``__getstate__`` (pickle and deepcopy read ``__getstate__`` from the
instance), which leaves out the boundary's methods still installed and puts in their place an entry that, unpickled,
binds them again to the new model.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from torch import nn

# The module's attribute naming the functions bound on it: name -> module-level function (picklable by reference).
_BOUND_ATTRIBUTE = "_modelpatch_bound_methods"


def bind_method(module: nn.Module, name: str, function: Callable[..., Any]) -> None:
    """Install ``function`` bound to ``module`` as ``module.<name>`` (an instance attribute; the class is untouched).

    ``function`` must be a module-level function (pickle stores it by its qualified name) taking ``module`` first.
    """
    bound: dict[str, Callable[..., Any]] = dict(module.__dict__.get(_BOUND_ATTRIBUTE, {}))
    bound[name] = function
    object.__setattr__(module, _BOUND_ATTRIBUTE, bound)
    object.__setattr__(module, name, types.MethodType(function, module))
    object.__setattr__(module, "__getstate__", types.MethodType(_getstate, module))


def _installed(module: nn.Module, name: str, function: Callable[..., Any]) -> bool:
    """Whether ``module.<name>`` is still ``function`` bound to ``module`` (a tool may have put its own in its place,
    which is pickled as it is)."""
    method = module.__dict__.get(name)
    return isinstance(method, types.MethodType) and method.__func__ is function and method.__self__ is module


def _getstate(module: nn.Module) -> dict[str, Any]:
    """``module``'s class's pickled state, without the boundary's bound methods, which :class:`_Rebind` binds again."""
    state = type(module).__getstate__(module)
    bound = state.get(_BOUND_ATTRIBUTE, {})
    names = [name for name, function in bound.items() if _installed(module, name, function)]
    for name in names:
        del state[name]
    state["__getstate__"] = _Rebind(module, tuple(names))
    return state


class _Rebind:
    """Stands for the boundary's methods in a pickled (or deep-copied) module's state; unpickled, it binds them to the
    new module and is the new module's ``__getstate__``."""

    def __init__(self, module: nn.Module, names: tuple[str, ...]):
        self.module = module
        self.names = names

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebind, (self.module, self.names, self.module.__dict__[_BOUND_ATTRIBUTE]))


def _rebind(module: nn.Module, names: tuple[str, ...], bound: dict[str, Callable[..., Any]]) -> types.MethodType:
    # Called while ``module`` is being rebuilt, before its state is restored: its __dict__ may still be empty, and the
    # state's update that follows adds to what is set here (the state holds none of ``names``).
    for name in names:
        object.__setattr__(module, name, types.MethodType(bound[name], module))
    return types.MethodType(_getstate, module)
