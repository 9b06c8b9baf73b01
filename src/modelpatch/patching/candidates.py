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

import threading

_lock = threading.Lock()
_namespaces: frozenset[str] = frozenset()


def register_patchable_namespace(namespace: str) -> None:
    """Also make ``nn.Module`` classes of modules named ``namespace`` or ``namespace.*`` patchable.

    Example: ``register_patchable_namespace("my_project.models")`` lets ``{"MyAttention": Fast}`` replace
    ``my_project.models.blocks.MyAttention``.
    """
    global _namespaces
    if not isinstance(namespace, str) or not namespace or namespace.startswith(".") or namespace.endswith("."):
        raise ValueError(f"A patchable namespace must be a dotted module name, got {namespace!r}.")
    with _lock:
        _namespaces = _namespaces | {namespace}


def unregister_patchable_namespace(namespace: str) -> None:
    """Undo :func:`register_patchable_namespace`; unknown namespaces are an error naming them."""
    global _namespaces
    with _lock:
        if namespace not in _namespaces:
            raise ValueError(f"{namespace!r} is not a registered patchable namespace.")
        _namespaces = _namespaces - {namespace}


def get_patchable_namespaces() -> frozenset[str]:
    """The user namespaces registered with :func:`register_patchable_namespace`."""
    return _namespaces


def is_patchable_module(module: str) -> bool:
    """Whether the module named ``module`` is a transformers modeling module or in a registered namespace."""
    if module.startswith("transformers.models.") and module.rpartition(".")[2].startswith("modeling_"):
        return True
    return any(module == ns or module.startswith(ns + ".") for ns in _namespaces)


def is_patch_candidate(cls: type) -> bool:
    """Whether ``cls`` is defined in a patchable module (replaced wherever it is constructed with arguments)."""
    return is_patchable_module(getattr(cls, "__module__", None) or "")
