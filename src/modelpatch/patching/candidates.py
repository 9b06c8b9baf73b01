"""Which classes a patch may replace.

Only ``nn.Module`` subclasses defined in transformers' modeling modules (``transformers.models.<name>.modeling_*``)
are candidates, plus those of namespaces the user opts in with :func:`register_patchable_namespace` (a package of their
own models, say). Output dataclasses, configs, functions and ``AttentionInterface`` are never constructed through
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


def is_patch_candidate(cls: type) -> bool:
    """Whether instances of ``cls`` may be replaced by a patch."""
    module = getattr(cls, "__module__", None) or ""
    if module.startswith("transformers.models.") and module.rpartition(".")[2].startswith("modeling_"):
        return True
    return any(module == ns or module.startswith(ns + ".") for ns in _namespaces)
