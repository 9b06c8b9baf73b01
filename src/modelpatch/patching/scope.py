"""Patch scopes: where and when a class patch takes effect.

Mechanism. Modeling code builds children by calling their classes (``LlamaAttention(config, idx)``). While at least
one scope is open anywhere in the process, ``nn.Module.__new__`` is a small dispatcher that looks at the *calling
context's* active scopes (a :class:`contextvars.ContextVar`) and, if one maps the class being built, builds the
replacement instead. Module globals and class objects are never modified, so:

* other threads and asyncio tasks, which have their own context, keep building the original classes;
* ``isinstance``/``issubclass``, pickling and ``torch.compile`` see the untouched classes;
* copies and unpickled objects keep their class: a construction without arguments is only dispatched when patchable
  code (a transformers modeling module, or a registered namespace) makes it, as ``MultiScaleDeformableAttention()``
  or ``BloomGelu()`` are made; copy, deepcopy and pickle call ``__new__`` from their own code;
* a class that is not a candidate (``torch.nn.LayerNorm``) is dispatched only where patchable code that imports it by
  name constructs it (``from torch.nn import LayerNorm`` in Qwen2-VL): where transformers' own ``apply_patches``,
  which rebinds module globals, would replace it. Such a module's ``nn.LayerNorm(...)`` is replaced too;
* a replacement that wraps the module it replaces (``self.inner = LlamaAttention(config, layer_idx)`` inside the
  replacement's ``__init__``, a subclass of it or not) gets the original class there instead of recursing into
  itself;
* nothing is scanned on entry: a class is resolved the first time it is constructed in a scope (then cached),
  and classes whose modeling module is imported inside the scope are covered too.

A scope belongs to the context that entered it (and to contexts copied from it while it is open, such as asyncio
tasks created inside it). Leaving it ends it *everywhere*, whichever thread or context leaves it: a generator that
entered a scope and is closed by another thread (or collected) ends the scope in the context that entered it too.
Scopes are removed by identity, not by restoring a saved value, so nested and interleaved scopes (A enters, B enters,
A leaves, B leaves) and exits by exception always leave exactly the scopes still open.

The dispatcher is installed on first use and stays (``modelpatch/_installs.py``, with every process-wide
install): CPython cannot restore ``object.__new__``'s slot once a type has had a ``__new__`` of its own. Outside
every scope it costs a ``torch.compiler.is_compiling()`` check and one ``ContextVar.get`` per module construction.
Inside a scope, a class no key matches costs one dictionary lookup more.
Modules built inside a ``torch.compile``'d region are never replaced.
"""

from __future__ import annotations

import contextvars
import logging
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .._installs import ORIGINAL_MODULE_NEW, install_module_new
from ..errors import PatchError
from . import registry
from .candidates import is_patch_candidate, is_patchable_module
from .mapping import PatchMapping
from .recorders import register_replacement_for_recorders

logger = logging.getLogger(__name__)


class PatchScope:
    """One entered scope: the mappings it activates (highest priority first) and what it did so far.

    Attributes:
        layers: The non-empty mappings of the scope, highest priority first.
        ended: Whether the scope has been left (in any context).
        matched: Names of the classes built under the scope, where patches apply, that one of its keys matches.
        replaced: Class name -> ``(key, replacement)`` for every class the scope replaced.
    """

    __slots__ = ("layers", "ended", "matched", "replaced")

    def __init__(self, layers: tuple[PatchMapping, ...]):
        self.layers = layers
        self.ended = False
        self.matched: set[str] = set()
        self.replaced: dict[str, tuple[str, type[nn.Module]]] = {}


class _Resolution:
    """How a class resolves in one set of open scopes: the winning scope, key and replacement."""

    __slots__ = ("scope", "key", "replacement", "imported", "matching", "recorded", "init_codes")

    def __init__(
        self,
        cls: type,
        scope: PatchScope,
        key: str,
        replacement: type,
        imported: bool,
        matching: tuple[PatchScope, ...],
    ):
        self.scope = scope
        self.key = key
        self.replacement = replacement
        # Not a candidate: replaced only where patchable code that imports it by name constructs it.
        self.imported = imported
        # Every open scope with a key matching the class (they all record it in ``matched``).
        self.matching = matching
        self.recorded = False
        # The code of the ``__init__`` methods a subclass replacement runs before reaching the replaced class's own.
        self.init_codes = (
            frozenset(
                init.__code__
                for klass in replacement.__mro__
                if klass is not cls
                and issubclass(klass, cls)
                and isinstance(init := klass.__dict__.get("__init__"), types.FunctionType)
            )
            if issubclass(replacement, cls)
            else frozenset()
        )


# Replaced by a new object each time a scope ends, so that every context notices, at its next dispatch, that one of
# its scopes may have been ended by another context.
_epoch = object()


class _ActiveScopes:
    """The scopes open in one context, with a per-class resolution cache."""

    __slots__ = ("scopes", "epoch", "_cache", "_replacements")

    def __init__(self, scopes: tuple[PatchScope, ...]):
        self.epoch = _epoch  # read before filtering: a scope ending meanwhile changes ``_epoch`` again
        self.scopes = tuple(scope for scope in scopes if not scope.ended)
        self._cache: dict[type, _Resolution | None] = {}
        self._replacements = frozenset().union(*(layer.replacements() for s in self.scopes for layer in s.layers))

    def resolve(self, cls: type) -> _Resolution | None:
        try:
            return self._cache[cls]
        except KeyError:
            pass
        resolution = None if cls in self._replacements else self._match(cls)
        self._cache[cls] = resolution
        return resolution

    def _match(self, cls: type) -> _Resolution | None:
        winner: tuple[PatchScope, str, type] | None = None
        matching: list[PatchScope] = []
        for scope in reversed(self.scopes):
            for layer in scope.layers:
                found = layer.match(cls.__name__)
                if found is None:
                    continue
                if not any(s is scope for s in matching):
                    matching.append(scope)
                if winner is None:
                    winner = (scope, *found)
        if winner is None or winner[2] is cls:
            return None
        return _Resolution(cls, *winner, imported=not is_patch_candidate(cls), matching=tuple(matching))


def _active_scopes(scopes: tuple[PatchScope, ...]) -> _ActiveScopes | None:
    active = _ActiveScopes(scopes)
    return active if active.scopes else None


_active: contextvars.ContextVar[_ActiveScopes | None] = contextvars.ContextVar("modelpatch_active_scopes", default=None)


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


def _refreshed(active: _ActiveScopes) -> _ActiveScopes | None:
    """``active`` without the scopes another context has ended since it was made (published in this context)."""
    epoch = _epoch  # read before looking: a scope ending meanwhile changes ``_epoch`` again
    if all(not scope.ended for scope in active.scopes):
        active.epoch = epoch
        return active
    refreshed = _active_scopes(active.scopes)
    _active.set(refreshed)
    return refreshed


def _made_by_patchable_code(cls: type, imported: bool, caller) -> bool:
    """Whether ``caller``, the frame that called ``cls(...)`` (or ``cls.__new__``), is code whose constructions a
    patch redirects: a patchable module's, which for an ``imported`` class must also bind its name to it."""
    caller_globals = caller.f_globals
    if not is_patchable_module(caller_globals.get("__name__") or ""):
        return False
    return not imported or caller_globals.get(cls.__name__) is cls


def _dispatching_new(cls, *args, **kwargs):
    # Inside a torch.compile'd region (modules built during forward, e.g. ``ModuleList`` slicing) nothing is
    # dispatched: dynamo cannot trace ``ContextVar.get`` (a graph break, an error with ``fullgraph=True``), and
    # patches only concern building models.
    if torch.compiler.is_compiling():
        return object.__new__(cls)
    active = _active.get()
    if active is not None and active.epoch is not _epoch:
        active = _refreshed(active)
    if active is not None:
        resolution = active.resolve(cls)
        # A candidate constructed with arguments is replaced wherever it is built; the caller's frame is only looked
        # at for constructions without arguments (copy and pickle make those too) and for non-candidate classes.
        if resolution is not None and (
            ((args or kwargs) and not resolution.imported)
            or _made_by_patchable_code(cls, resolution.imported, sys._getframe(1))
        ):
            if not resolution.recorded:
                for scope in resolution.matching:
                    scope.matched.add(cls.__name__)
                resolution.recorded = True
            building = _building.get()
            wrapping = next((b for b in building if b.original is cls), None)
            if wrapping is None and not _inside_own_init(resolution, sys._getframe(1)):
                resolution.scope.replaced[cls.__name__] = (resolution.key, resolution.replacement)
                return _build_replacement(cls, resolution.replacement, resolution.key, building, args, kwargs)
            if wrapping is not None:
                wrapping.wraps_original = True
    if ORIGINAL_MODULE_NEW is not None:
        return ORIGINAL_MODULE_NEW(cls, *args, **kwargs)
    # What ``cls(...)`` would have used without the dispatcher: the next ``__new__`` after nn.Module in its MRO
    # (a user class ``class M(nn.Module, Base)`` may get its ``__new__`` from ``Base``).
    new = super(nn.Module, cls).__new__
    if new is object.__new__:
        return object.__new__(cls)
    return new(cls, *args, **kwargs)


def _inside_own_init(resolution: _Resolution, frame) -> bool:
    """Whether ``frame`` or a caller of it runs the ``__init__`` of an instance of ``resolution``'s replacement, a
    subclass of the class it replaces.

    Such a replacement is built by ``type.__call__``, which runs its ``__init__`` after the dispatcher returned (no
    context marks that construction, as one marks a non-subclass replacement's): its stack frames do. A replacement
    that wraps the class it replaces (``super().__init__(config); self.inner = LlamaMLP(config)``) must get the
    original there, not itself again, forever.
    """
    codes = resolution.init_codes
    if not codes:
        return False
    while frame is not None:
        code = frame.f_code
        if code in codes and isinstance(frame.f_locals.get(code.co_varnames[0]), resolution.replacement):
            return True
        frame = frame.f_back
    return False


def _describe_arguments(args: tuple, kwargs: dict) -> str:
    described = [type(arg).__name__ for arg in args] + [
        f"{name}={type(value).__name__}" for name, value in kwargs.items()
    ]
    return ", ".join(described) or "no arguments"


def _build_replacement(cls, replacement, key, building, args, kwargs):
    logger.debug("Building %s instead of %s", replacement.__qualname__, cls.__qualname__)
    if issubclass(replacement, cls):
        # type.__call__ will run replacement.__init__ on the returned instance.
        return replacement.__new__(replacement, *args, **kwargs)
    # Not an instance of ``cls``: type.__call__ returns it as is, without calling __init__ again.
    build = _Build(cls)
    token = _building.set((*building, build))
    try:
        instance = replacement(*args, **kwargs)
    except PatchError:
        raise  # a patch inside the replacement's own construction, named there
    except Exception as exc:  # whatever the replacement's constructor raises: the patch is what is wrong
        raise PatchError(
            f"The patch {key!r} replaces {cls.__qualname__} by {replacement.__module__}.{replacement.__qualname__}, "
            f"which cannot be built with the arguments {cls.__qualname__} is built with "
            f"({_describe_arguments(args, kwargs)}): {type(exc).__name__}: {exc}. A replacement takes the replaced "
            "class's constructor arguments."
        ) from exc
    finally:
        _building.reset(token)
    register_replacement_for_recorders(cls, replacement, wraps_original=build.wraps_original)
    return instance


def _end(scope: PatchScope) -> None:
    """End ``scope`` in every context: here at once, elsewhere at that context's next dispatch."""
    global _epoch
    scope.ended = True
    _epoch = object()
    current = _active.get()
    if current is not None:
        _active.set(_active_scopes(current.scopes))


@contextmanager
def patch_scope(*layers: PatchMapping) -> Iterator[PatchScope]:
    """Activate ``layers`` (first = highest priority) for constructions in the current thread / task.

    Yields the :class:`PatchScope`, which records what it matched and replaced. Leaving it from another thread or
    context (a generator closed elsewhere) ends it everywhere and does not raise.
    """
    scope = PatchScope(tuple(layer for layer in layers if layer))
    if not scope.layers:
        yield scope
        return
    install_module_new(_dispatching_new)
    current = _active.get()
    _active.set(_active_scopes((current.scopes if current else ()) + (scope,)))
    try:
        yield scope
    finally:
        _end(scope)


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
