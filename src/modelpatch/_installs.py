"""Every process-wide install of modelpatch: the places where it replaces or adds to an attribute of torch or of
transformers for the whole process, rather than per model or per scope. :func:`installs` lists all eight at run time
(``modelpatch.installs()``, ``modelpatch inspect --installs``), with whether each is made yet in this process.

Four are made here, in the bottom layer. Four live with the concept that needs them, in higher layers, and tell this
module when they are made (:func:`made`): the output recorders' specs, a tensor-parallel style, the ``linear_experts``
custom operator, llm-compressor's SmoothQuant mappings folded for fused projections; docs/ARCHITECTURE.md says why
each lives there.

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
:func:`watch_module_registrations`         adds one hook to torch's global registration hooks for child modules
                                           and for parameters (``register_module_module_registration_hook``,
                                           ``register_module_parameter_registration_hook``), when the first
                                           ``linear_experts`` module packs its experts: how PEFT, quantizers and
                                           parametrizations put their modules and weights in place, which that
                                           module must notice (``fusions/linear_experts/modules.py`` says why).
                                           The hook returns None, so torch registers what it was given; it acts
                                           on packed experts' modules only. Never undone (it costs one dict
                                           lookup per registration).
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
from dataclasses import dataclass
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
        _made.add("transformers_patch_registry")


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


_registration_hook: Callable[..., None] | None = None


def watch_module_registrations(hook: Callable[..., None]) -> None:
    """Add ``hook`` to torch's global registration hooks for child modules and parameters (once; see the table).

    torch calls it as ``hook(module, name, value)`` for every module or parameter assigned to any module of the
    process; it must return None (torch then registers ``value`` itself) and act on modelpatch's modules only.

    Raises:
        RuntimeError: another hook was installed already (there is one watcher per process).
    """
    global _registration_hook
    if _registration_hook is hook:
        return
    with _lock:
        if _registration_hook is hook:
            return
        if _registration_hook is not None:
            raise RuntimeError(f"torch's registration hooks already watch for {_registration_hook!r}, not {hook!r}.")
        from torch.nn.modules import module as torch_module

        torch_module.register_module_module_registration_hook(hook)
        torch_module.register_module_parameter_registration_hook(hook)
        _registration_hook = hook


# --- the list of installs ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Install:
    """One process-wide install of modelpatch, as :func:`installs` reports it.

    Attributes:
        name: Its short name (``"module_new"``, ``"registration_hooks"``, ...).
        patches: What it replaces or adds to, in torch or transformers.
        by: The function of modelpatch that makes it.
        when: When modelpatch makes it (never at import).
        installed: Whether it is made in this process (for the init wrappers, which transformers may swap back
            between builds: whether they are in place now).
    """

    name: str
    patches: str
    by: str
    when: str
    installed: bool


# name -> (what it patches, the function making it, when).
_TABLE: dict[str, tuple[str, str, str]] = {
    "module_new": (
        "torch.nn.Module.__new__",
        "modelpatch._installs.install_module_new",
        "the first patch scope",
    ),
    "transformers_patch_registry": (
        "transformers.monkey_patching.get_patch_mapping",
        "modelpatch._installs.isolate_from_transformers_patches",
        "the first build",
    ),
    "meta_initialisation": (
        "torch.nn.init's 14 filling functions (uniform_, normal_, ...)",
        "modelpatch._installs.skip_meta_initialisation",
        "every build",
    ),
    "registration_hooks": (
        "torch's global module and parameter registration hooks",
        "modelpatch._installs.watch_module_registrations",
        "the first linear_experts module packed",
    ),
    "output_recorders": (
        "the _can_record_outputs specs of transformers' modeling modules (a replacement class added)",
        "modelpatch.patching.recorders.register_replacement_for_recorders",
        "the first patch or fusion replacing a recorded class",
    ),
    "tensor_parallel_style": (
        "transformers' registry of tensor-parallel styles (modelpatch_colwise_parts)",
        "modelpatch.modes.parallel._register_colwise_parts",
        "the first tensor-parallel load",
    ),
    "grouped_linear_operator": (
        "torch.library (the custom operator modelpatch::grouped_linear)",
        "modelpatch.fusions.linear_experts.modules._register_opaque_grouped_linear",
        "the first LinearExperts built",
    ),
    "smoothing_mappings": (
        "llm-compressor's SmoothQuantModifier._resolve_mappings, AWQModifier._set_resolved_mappings and the "
        "AWQ module's match_modules_set (wrapped; before llm-compressor is imported, a "
        "finder on sys.meta_path waiting for those two modules)",
        "modelpatch.fusions.projections.smoothing.fold_smoothing_mappings",
        "the first module with fused projections built, where llm-compressor is installed",
    ),
}
_made: set[str] = set()


def made(name: str) -> None:
    """Record that the install ``name`` of the list is made (what the installs of higher layers call once done).

    Raises:
        ValueError: ``name`` is not in the list (a new install must be listed, here and in docs/ARCHITECTURE.md).
    """
    if name not in _TABLE:
        raise ValueError(f"{name!r} is no install of modelpatch's list: add it to modelpatch/_installs.py.")
    _made.add(name)


def _installed(name: str) -> bool:
    if name == "module_new":
        return nn.Module.__dict__.get("__new__") is not ORIGINAL_MODULE_NEW
    if name == "meta_initialisation":
        from torch.nn import init

        return all(getattr(getattr(init, fill, None), _SKIPS_META, False) for fill in FILLING_FUNCTIONS)
    if name == "registration_hooks":
        return _registration_hook is not None
    return name in _made


def installs() -> list[Install]:
    """Every process-wide install of modelpatch, in the order of the module docstring's table, with whether each is
    made in this process yet: what modelpatch changed outside the models it builds (``modelpatch inspect
    --installs`` prints it)."""
    return [Install(name, *row, installed=_installed(name)) for name, row in _TABLE.items()]
