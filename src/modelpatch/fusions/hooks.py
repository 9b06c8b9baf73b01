"""Whether calling a module does more than running its ``forward``.

Fused modules take shortcuts past the modules that stand in their parts' place (packed experts computed at once,
a projection's rows computed from the fused weight) only while calling those modules would compute nothing else:
no hook on them or on every module, no ``forward`` wrapped on the instance (accelerate's offloading hooks).
"""

from __future__ import annotations

from torch import nn

from .._torch import has_call_hooks, has_global_call_hooks


def hooked(module: nn.Module) -> bool:
    """Whether calling ``module`` does more than its ``forward``: hooks, or a forward wrapped on the instance."""
    return has_call_hooks(module) or "forward" in module.__dict__


def global_hooks() -> bool:
    """Whether hooks registered for every module are in place."""
    return has_global_call_hooks()
