"""Patch scopes: where and when a class patch takes effect.

Mechanism. Modeling code builds children by calling their classes (``LlamaAttention(config, idx)``). While at least
one scope is open anywhere in the process, ``nn.Module.__new__`` is a small dispatcher that looks at the *calling
context's* active scopes (a :class:`contextvars.ContextVar`) and, if one maps the class being built, builds the
replacement instead. Module globals and class objects are never modified, so:

* other threads and asyncio tasks, which have their own context, keep building the original classes;
* ``isinstance``/``issubclass``, pickling and ``torch.compile`` see the untouched classes;
* copies and unpickled objects keep their class: only constructions that pass arguments are dispatched (modeling
  code always passes a config or sizes; a class constructed with no arguments at all is never replaced);
* a replacement that wraps the module it replaces (``self.inner = LlamaAttention(config, layer_idx)`` inside the
  replacement's ``__init__``) gets the original class there instead of recursing into itself;
* nothing is scanned on entry: a class is resolved the first time it is constructed in a scope (then cached),
  and classes whose modeling module is imported inside the scope are covered too.

Scopes are removed by identity, not by restoring a saved value, so nested and interleaved scopes
(A enters, B enters, A leaves, B leaves) and exits by exception always leave exactly the scopes still open.

The dispatcher is installed on first use and stays: CPython cannot restore ``object.__new__``'s slot once a type
has had a ``__new__`` of its own. Outside every scope it costs a ``torch.compiler.is_compiling()`` check and one
``ContextVar.get`` per module construction. Modules built inside a ``torch.compile``'d region are never replaced.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from . import registry
from .candidates import is_patch_candidate
from .mapping import PatchMapping
from .recorders import register_replacement_for_recorders

logger = logging.getLogger(__name__)


class _Scope:
    """One entered scope: the mappings it activates, innermost (highest priority) first."""

    __slots__ = ("layers",)

    def __init__(self, layers: tuple[PatchMapping, ...]):
        self.layers = layers


class _ActiveScopes:
    """The scopes open in one context, with a per-class resolution cache."""

    __slots__ = ("scopes", "_cache", "_replacements")

    def __init__(self, scopes: tuple[_Scope, ...]):
        self.scopes = scopes
        self._cache: dict[type, type | None] = {}
        self._replacements = frozenset().union(*(layer.replacements() for s in scopes for layer in s.layers))

    def resolve(self, cls: type) -> type | None:
        try:
            return self._cache[cls]
        except KeyError:
            pass
        replacement = None
        if cls not in self._replacements and is_patch_candidate(cls):
            for scope in reversed(self.scopes):
                replacement = next((r for layer in scope.layers if (r := layer.lookup(cls.__name__))), None)
                if replacement is not None:
                    break
        if replacement is cls:
            replacement = None
        self._cache[cls] = replacement
        return replacement


_active: contextvars.ContextVar[_ActiveScopes | None] = contextvars.ContextVar("modelpatch_active_scopes", default=None)

_hook_lock = threading.Lock()
_saved_new = nn.Module.__dict__.get("__new__")


class _Build:
    """A non-subclass replacement being built for ``original`` in this context."""

    __slots__ = ("original", "wraps_original")

    def __init__(self, original: type):
        self.original = original
        self.wraps_original = False


# The replacements being built in this context, outermost first. While a replacement for ``C`` is being built, building
# ``C`` again gives the original class: a replacement that wraps the module it replaces
# (``self.inner = LlamaAttention(config, layer_idx)``) must get the original, not recurse into itself.
_building: contextvars.ContextVar[tuple[_Build, ...]] = contextvars.ContextVar("modelpatch_building", default=())


def _dispatching_new(cls, *args, **kwargs):
    # Inside a torch.compile'd region (modules built during forward, e.g. ``ModuleList`` slicing) nothing is
    # dispatched: dynamo cannot trace ``ContextVar.get`` (a graph break, an error with ``fullgraph=True``), and
    # patches only concern building models.
    if torch.compiler.is_compiling():
        return object.__new__(cls)
    active = _active.get()
    # copy, deepcopy and unpickling rebuild objects with ``cls.__new__(cls)`` and no arguments; they must get the
    # object's own class back. Modeling code always passes a config or sizes.
    if active is not None and (args or kwargs):
        replacement = active.resolve(cls)
        if replacement is not None:
            building = _building.get()
            wrapping = next((b for b in building if b.original is cls), None)
            if wrapping is None:
                return _build_replacement(cls, replacement, building, args, kwargs)
            wrapping.wraps_original = True
    if _saved_new is not None:
        return _saved_new(cls, *args, **kwargs)
    # What ``cls(...)`` would have used without the dispatcher: the next ``__new__`` after nn.Module in its MRO
    # (a user class ``class M(nn.Module, Base)`` may get its ``__new__`` from ``Base``).
    new = super(nn.Module, cls).__new__
    if new is object.__new__:
        return object.__new__(cls)
    return new(cls, *args, **kwargs)


def _build_replacement(cls, replacement, building, args, kwargs):
    logger.debug("Building %s instead of %s", replacement.__qualname__, cls.__qualname__)
    if issubclass(replacement, cls):
        # type.__call__ will run replacement.__init__ on the returned instance.
        return replacement.__new__(replacement, *args, **kwargs)
    # Not an instance of ``cls``: type.__call__ returns it as is, without calling __init__ again.
    build = _Build(cls)
    token = _building.set((*building, build))
    try:
        instance = replacement(*args, **kwargs)
    finally:
        _building.reset(token)
    register_replacement_for_recorders(cls, replacement, wraps_original=build.wraps_original)
    return instance


def _install_dispatcher() -> None:
    if nn.Module.__new__ is _dispatching_new:
        return
    with _hook_lock:
        if nn.Module.__new__ is not _dispatching_new:
            nn.Module.__new__ = staticmethod(_dispatching_new)


@contextmanager
def patch_scope(*layers: PatchMapping) -> Iterator[None]:
    """Activate ``layers`` (first = highest priority) for constructions in the current thread / task."""
    scope = _Scope(tuple(layer for layer in layers if layer))
    if not scope.layers:
        yield
        return
    _install_dispatcher()
    current = _active.get()
    _active.set(_ActiveScopes((current.scopes if current else ()) + (scope,)))
    try:
        yield
    finally:
        current = _active.get()
        remaining = tuple(s for s in (current.scopes if current else ()) if s is not scope)
        _active.set(_ActiveScopes(remaining) if remaining else None)


def apply_patches():
    """Context manager that applies the registered patches to models built inside it, in this thread or task only.

    ``from_pretrained`` / ``from_config`` of modelpatch apply registered patches automatically; this is for manual
    construction (``LlamaModel(config)``). The registry is read once, on entry.

    Example::

        register_patch_mapping({"LlamaAttention": MyAttention})
        with apply_patches():
            model = LlamaModel(config)   # layers use MyAttention
        model = LlamaModel(config)       # original classes again
    """
    return patch_scope(registry.snapshot())
