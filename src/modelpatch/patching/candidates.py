"""Which classes a patch may replace, and which code's constructions it may redirect.

*Patchable modules* are transformers' modeling modules (``transformers.models.<name>.modeling_*``) plus the
namespaces the user opts in with :func:`register_patchable_namespace` (a package of their own models, say).
``nn.Module`` subclasses defined in a patchable module are *candidates*: replaced wherever they are constructed with
arguments. Any other class (``torch.nn.LayerNorm``, transformers' ``Conv1D``) is replaced only where patchable code
that imports it by name constructs it, which is where transformers' own ``apply_patches`` (rebinding module globals)
would replace it. Output dataclasses, configs, functions and ``AttentionInterface`` are never constructed through
``nn.Module.__new__`` and so can never be swapped, whatever a pattern matches.
"""

from __future__ import annotations

from ..registry import Registry

namespace_registry: Registry[str, bool] = Registry("patchable namespace")
"""The user namespaces made patchable (keys; the values carry nothing). ``namespace_registry.scoped()`` restores it."""


def register_patchable_namespace(namespace: str) -> None:
    """Also make ``nn.Module`` classes of modules named ``namespace`` or ``namespace.*`` patchable.

    Example: ``register_patchable_namespace("my_project.models")`` lets ``{"MyAttention": Fast}`` replace
    ``my_project.models.blocks.MyAttention``. Registering a namespace twice is harmless.
    """
    if not isinstance(namespace, str) or not namespace or namespace.startswith(".") or namespace.endswith("."):
        raise ValueError(f"A patchable namespace must be a dotted module name, got {namespace!r}.")
    namespace_registry.register({namespace: True}, overwrite=True)


def unregister_patchable_namespace(namespace: str) -> None:
    """Undo :func:`register_patchable_namespace`.

    Raises:
        RegistryError: ``namespace`` is not registered (named; also a ``ValueError``).
    """
    namespace_registry.unregister([namespace])


def get_patchable_namespaces() -> frozenset[str]:
    """The user namespaces registered with :func:`register_patchable_namespace`."""
    return frozenset(namespace_registry.snapshot())


def is_patchable_module(module: str) -> bool:
    """Whether the module named ``module`` is a transformers modeling module or in a registered namespace."""
    if module.startswith("transformers.models.") and module.rpartition(".")[2].startswith("modeling_"):
        return True
    return any(module == ns or module.startswith(ns + ".") for ns in namespace_registry.snapshot())


def is_patch_candidate(cls: type) -> bool:
    """Whether ``cls`` is defined in a patchable module (replaced wherever it is constructed with arguments)."""
    return is_patchable_module(getattr(cls, "__module__", None) or "")
