"""The process-wide installs of modelpatch's bottom layer: the places where it replaces an attribute of torch or of
transformers for the whole process, rather than per model or per scope. Three more live with the concept that needs
them, in higher layers (the output recorders' specs, a tensor-parallel style, the ``linear_experts`` custom
operator); docs/ARCHITECTURE.md names each and why.

Each install is idempotent (a second call, from any thread, changes nothing), made on first need (never at import),
and leaves every caller outside modelpatch's own scopes and builds exactly what the original gives:

=========================================  =====================================================================
install                                    replaces, why, and how it is undone
=========================================  =====================================================================
:func:`install_module_new`                 ``torch.nn.Module.__new__`` by the patch dispatcher of
                                           :mod:`modelpatch.patching.scope`, when the first patch scope opens:
                                           modeling code builds children by calling their classes, and this is
                                           the one hook that sees each construction without rebinding module
                                           globals. Never undone: CPython cannot give a type back the
                                           ``object.__new__`` slot once it had a ``__new__`` of its own; outside
                                           every scope the dispatcher builds what the original would.
:func:`isolate_from_transformers_patches`  ``transformers.monkey_patching.get_patch_mapping`` by a wrapper that
                                           reads ``{}`` inside a modelpatch build (:data:`inside_build`), so that
                                           transformers' own patch registry stays out of modelpatch's builds,
                                           nested ``_from_config`` calls included (``loading/build.py`` says
                                           why). Installed at the first build; not undone (the wrapper returns
                                           the original's answer everywhere else). Refused with a
                                           ``RuntimeError`` when transformers' two readers of the registry no
                                           longer read it through that name (checked in their bytecode names).
:func:`skip_meta_initialisation`           the 14 filling functions of ``torch.nn.init`` (:data:`FILLING_FUNCTIONS`)
                                           by wrappers that return a *meta* tensor untouched inside a modelpatch
                                           build: they fill nothing there (meta tensors hold no values) and cost
                                           half of a meta build. Checked at every build, because transformers'
                                           init contexts swap these attributes and put back what they found
                                           (torch's originals, possibly); never undone otherwise (the wrappers
                                           call the original for every real tensor and every other context).
=========================================  =====================================================================

This module sits beside the layers, below all of them, like :mod:`modelpatch._transformers` (the door it reads
transformers' private registry module through, when an install needs it: importing this module imports no
transformers).
"""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

_lock = threading.Lock()

inside_build: contextvars.ContextVar[bool] = contextvars.ContextVar("modelpatch_inside_build", default=False)
"""Whether the current context is inside a modelpatch build (``loading/build.py`` sets it); what the build-time
installs read."""

ORIGINAL_MODULE_NEW = nn.Module.__dict__.get("__new__")
"""``nn.Module``'s own ``__new__`` before the dispatcher replaced it (None: it had none, ``object.__new__`` serves)."""


def install_module_new(dispatcher: Callable[..., Any]) -> None:
    """Make ``dispatcher`` ``nn.Module.__new__`` for the process (once; see the table above)."""
    if nn.Module.__new__ is dispatcher:
        return
    with _lock:
        if nn.Module.__new__ is not dispatcher:
            nn.Module.__new__ = staticmethod(dispatcher)  # type: ignore[method-assign]


_ISOLATING = "_modelpatch_isolating"


def isolate_from_transformers_patches() -> None:
    """Make ``transformers.monkey_patching.get_patch_mapping`` return ``{}`` inside modelpatch builds (once).

    It is what ``apply_patches`` and ``patch_output_recorders`` read the registry through (by its module-global
    name, at call time), so both do nothing there; every other caller, and every other context, gets exactly what
    the original returns.

    Raises:
        RuntimeError: One of those two no longer reads the registry through ``get_patch_mapping``: transformers'
            structure changed, and modelpatch cannot keep its registry out of builds with this version.
    """
    # Imported here: patch scopes use this module too, and importing them imports no transformers.
    from ._transformers import patch_registry_module

    # Any: the module's functions are read and one is replaced, which a ModuleType annotation does not allow.
    monkey_patching: Any = patch_registry_module()

    if getattr(monkey_patching.get_patch_mapping, _ISOLATING, False):
        return
    with _lock:
        original = monkey_patching.get_patch_mapping
        if getattr(original, _ISOLATING, False):
            return
        readers = {
            "apply_patches": getattr(monkey_patching.apply_patches, "__wrapped__", monkey_patching.apply_patches),
            "patch_output_recorders": monkey_patching.patch_output_recorders,
        }
        for name, reader in readers.items():
            if "get_patch_mapping" not in getattr(getattr(reader, "__code__", None), "co_names", ()):
                raise RuntimeError(
                    f"transformers.monkey_patching.{name} no longer reads the registry through get_patch_mapping: "
                    "modelpatch cannot keep transformers' patch registry out of its builds with this transformers "
                    "version."
                )

        @functools.wraps(original)
        def get_patch_mapping():
            return {} if inside_build.get() else original()

        get_patch_mapping.__dict__[_ISOLATING] = True
        monkey_patching.get_patch_mapping = get_patch_mapping


# torch.nn.init's functions that fill a tensor in place (what module constructors call to initialise parameters).
FILLING_FUNCTIONS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)
_SKIPS_META = "_modelpatch_skips_meta"


def _skipping_meta(fill: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(fill)
    def skipping(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if inside_build.get() and tensor.is_meta:
            return tensor
        return fill(tensor, *args, **kwargs)

    setattr(skipping, _SKIPS_META, True)
    return skipping


def skip_meta_initialisation() -> None:
    """Make ``torch.nn.init``'s filling functions return meta tensors untouched inside modelpatch builds.

    Modules look these functions up on ``torch.nn.init`` at call time, so wrapping the module's attributes reaches
    every constructor that initialises through it. Checked at every build, not once: transformers' init contexts
    (``no_init_weights``, ``guard_torch_init_functions``) swap these attributes and put back what they found, which
    may be torch's originals. Every other context, and every real tensor, gets the original function.
    """
    from torch.nn import init

    with _lock:
        for name in FILLING_FUNCTIONS:
            fill = getattr(init, name, None)
            if fill is not None and not getattr(fill, _SKIPS_META, False):
                setattr(init, name, _skipping_meta(fill))
